"""Outside packages that only re-export ``splitgrad.impl``, written into a directory, for the
missing-API tests of ``test_properties_outside.py``.

* ``impl_star``: ``from splitgrad.impl import *`` (everything in ``impl.__all__``, FP8 recipes
  and ``fp8_autocast`` included, no quantizer module of its own): SPEC's API complete.
* ``impl_names``: the same names, each imported by name.
* ``impl_no_fp8``: the four modules only, no ``fp8_autocast``: lacks FP8 (its modules are impl's,
  so impl's forced FP8 path still plans cells under FP8).
"""

from __future__ import annotations

from pathlib import Path

import splitgrad.impl

_NAMES = "".join(f"    {name},\n" for name in splitgrad.impl.__all__)
PACKAGES = {
    "impl_star": '"""splitgrad.impl re-exported."""\nfrom splitgrad.impl import *  # noqa: F403\n',
    "impl_names": '"""splitgrad.impl re-exported name by name."""\n'
    f"from splitgrad.impl import (  # noqa: F401\n{_NAMES})\n",
    "impl_no_fp8": '"""splitgrad.impl\'s modules without FP8."""\n'
    "from splitgrad.impl import (  # noqa: F401\n"
    "    GroupedLinear,\n    LayerNormLinear,\n    LayerNormMLP,\n    Linear,\n)\n",
}


def write_reexports(root: Path) -> Path:
    """Write every package of :data:`PACKAGES` under ``root``; returns ``root`` (put it on
    ``sys.path``)."""
    for name, text in PACKAGES.items():
        pkg = root / name
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(text)
    return root
