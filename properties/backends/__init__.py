"""The Backend protocol and its adapters: ``impl``, ``reference``, ``torch-split``,
``transformer_engine``.

A backend turns a :class:`~splitgrad.properties.cases.case.ModuleConfig` into a live module and
drives it (forward, backward, ``backward_dw``, hooks, gradients), so the property checks never
touch a concrete API. Parameters are always addressed by their TransformerEngine names
(``fc1_weight``, ``weight3``...). The protocol is per-process and per-module (no global state),
so a distributed backend can implement the same methods on each rank.

:attr:`Backend.deviations` is the one place where a backend's known differences from SPEC.md are
written down: a check failing where one is declared is *reported* as a known deviation (never
turned into a pass), and one that never shows is reported too, so the list cannot rot.
:attr:`Backend.notes` lists what the adapter itself supplies (e.g. an emulated queue).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .library import (
    API_PARTS,
    ImplBackend,
    LibraryBackend,
    build_library_module,
    load_library_from_path,
    probe_library,
)
from .protocol import Backend, BackendUnavailable, Deviation
from .torch_split import TorchSplitBackend, TorchSplitHandle, TorchTwin
from .transformer_engine import (
    RecipeMappingError,
    TransformerEngineBackend,
    to_transformer_engine_recipe,
)

__all__ = [
    "API_PARTS",
    "BACKEND_NAMES",
    "Backend",
    "BackendUnavailable",
    "Deviation",
    "ImplBackend",
    "LibraryBackend",
    "RecipeMappingError",
    "TorchSplitBackend",
    "TorchSplitHandle",
    "TorchTwin",
    "TransformerEngineBackend",
    "build_library_module",
    "get_backend",
    "load_library_from_path",
    "probe_library",
    "to_transformer_engine_recipe",
]

_NAMED: dict[str, Callable[[], Backend]] = {
    "impl": ImplBackend,
    "reference": lambda: LibraryBackend("reference", "splitgrad.reference"),
    "torch-split": TorchSplitBackend,
    "transformer_engine": TransformerEngineBackend,
}
BACKEND_NAMES = tuple(_NAMED)


def _load(what: str, load: Callable[[], Any]) -> Any:
    """``load()``, any error but :class:`BackendUnavailable` raised as one: ``cannot {what}``."""
    try:
        return load()
    except BackendUnavailable:
        raise
    except Exception as exc:
        raise BackendUnavailable(f"cannot {what}: {type(exc).__name__}: {exc}") from exc


def get_backend(name: str) -> Backend:
    """The backend called ``name``: one of :data:`BACKEND_NAMES`, ``path:DIR`` (a package
    directory with SPEC §2's API, e.g. a mutated copy of impl), ``module:NAME[:ATTR]`` (an
    importable package with that API, or an object in one holding its modules) or
    ``class:MODULE:ATTR`` (a :class:`Backend` subclass, built without
    arguments, for an API that differs from SPEC's). Raises ``ValueError`` naming unknown
    backends and :class:`BackendUnavailable` when the package cannot be imported."""
    if name in _NAMED:
        return _NAMED[name]()
    if name.startswith("path:"):
        path = Path(name[5:])
        pkg = "splitgrad_under_test_" + "".join(c if c.isalnum() else "_" for c in path.name)
        lib = _load(f"import the package at {path}", lambda: load_library_from_path(path, pkg))
        return LibraryBackend(name, lib=lib)
    if name.startswith("module:"):
        module_name, _, attr = name[len("module:") :].partition(":")
        if not module_name:
            raise ValueError("module:NAME needs a package name, e.g. module:mypkg")

        def load() -> Any:
            module = importlib.import_module(module_name)
            return getattr(module, attr) if attr else module

        lib = _load(f"import {name[len('module:') :]}", load)
        return LibraryBackend(name, module_name, lib=lib)
    if name.startswith("class:"):
        module_name, _, attr = name[len("class:") :].rpartition(":")
        if not module_name or not attr:
            raise ValueError(f"class:MODULE:ATTR needs a module and a class, got {name!r}")
        cls = _load(
            f"load {module_name}:{attr}",
            lambda: getattr(importlib.import_module(module_name), attr),
        )
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ValueError(f"{name}: {attr} is not a splitgrad.properties Backend subclass")
        backend = cls()
        backend.name = name
        return backend
    raise ValueError(
        f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}, path:DIR, "
        "module:NAME or class:MODULE:ATTR"
    )
