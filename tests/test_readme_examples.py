"""The complete examples of the README and of ``docs/`` run as written: each block marked
``<!-- example: NAME -->`` is saved as a script and run with ``python`` in a fresh process (the
distributed ones spawn their own gloo ranks), and must exit 0: each example asserts its own
outcome."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
_BLOCK = re.compile(r"<!-- example: (\S+) -->\n```python\n(.*?)```", re.DOTALL)


def _examples(paths: list[Path]) -> dict[str, str]:
    """Every marked example in ``paths`` by name; a name used twice is an error."""
    found: dict[str, str] = {}
    for path in paths:
        for name, code in _BLOCK.findall(path.read_text()):
            if name in found:
                raise ValueError(f"{path.name}: example {name!r} is defined twice")
            found[name] = code
    return found


EXAMPLES = _examples([README, *DOCS])


def test_the_readme_has_its_examples():
    """The README keeps the model conversion and the two most used distributed examples; the
    longer ones live in the page that explains them."""
    assert {"convert-linears", "distributed-pipeline", "distributed-data-parallel"} <= set(
        _examples([README])
    )
    wanted = {
        "distributed-pipeline",
        "distributed-data-parallel",
        "distributed-experts",
        "dualpipe-steps",
        "autograd-tools",
        "trainer-sequence",
    }
    assert wanted <= set(EXAMPLES), sorted(EXAMPLES)


#: Examples that import an optional extra, by the module that extra installs.
NEEDS = {"trainer-sequence": "transformers"}


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_readme_example_runs(name, tmp_path):
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    script = tmp_path / f"{name.replace('-', '_')}.py"
    script.write_text(EXAMPLES[name])
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
