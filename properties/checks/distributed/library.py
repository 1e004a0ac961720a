"""The package a distributed check runs, from the ``--backend`` string that names it.

``impl``, ``reference``, ``module:NAME``, ``path:DIR`` and ``class:MODULE:ATTR`` name a library
backend as for ``splitgrad verify``; a bare import name (``mypkg``) or ``NAME:ATTR``
(``mypkg.testing:buggy``) names a package or object, as do the reducer and expert-parallel classes
a check is given. Each spawned rank resolves the string again; a process keeps what it loaded.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from ...backends import BACKEND_NAMES, BackendUnavailable, LibraryBackend, get_backend

_HARNESS_PREFIXES = ("path:", "module:", "class:")


@functools.cache
def load_library(name: str) -> Any:
    """The package (or object) ``name`` names; raises what loading it raised."""
    if name in BACKEND_NAMES or name.startswith(_HARNESS_PREFIXES):
        backend = get_backend(name)
        if not isinstance(backend, LibraryBackend):
            raise BackendUnavailable(
                f"backend {name!r} is no package with SPEC §2's modules, which the distributed "
                "checks build on every rank"
            )
        return backend.lib
    module, _, attribute = name.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


def preload_library(name: str) -> None:
    """Load the package ``--backend`` names here, before any rank does; ``ValueError`` with one
    line saying why it cannot be loaded."""
    try:
        load_library(name)
    except Exception as exc:  # an import error, a missing attribute, a package that raises
        cause = exc.__cause__ if isinstance(exc, BackendUnavailable) else exc
        if cause is None:  # the harness says why (a directory that does not exist)
            raise ValueError(f"--backend {name}: {exc}") from None
        raise ValueError(
            f"--backend {name}: cannot load it ({type(cause).__name__}: {cause})"
        ) from None
