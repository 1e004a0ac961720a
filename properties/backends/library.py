"""Backends for packages with SPEC §2's module API itself (``splitgrad.impl``,
``splitgrad.reference``, a mutated copy of impl): building, probing for gaps, importing from a
path."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch

from ..cases.case import KINDS, ModuleConfig, make_recipe
from .protocol import Backend, BackendUnavailable


def build_library_module(
    lib: Any,
    config: ModuleConfig,
    *,
    delay: bool,
    ub_bulk_wgrad: bool = False,
    omit: Collection[str] = (),
) -> Any:
    """Construct ``config`` from a namespace with the splitgrad/TE module API; the options in
    ``omit`` (``"device"``, ``"params_dtype"``) are not passed (torch's defaults decide)."""
    unknown = set(omit) - {"device", "params_dtype"}
    if unknown:
        raise ValueError(f"only device and params_dtype can be left out, got {sorted(unknown)}")
    kw: dict[str, Any] = {
        "bias": config.bias,
        "params_dtype": config.torch_dtype,
        "device": config.device,
        "fuse_wgrad_accumulation": config.fuse_wgrad_accumulation,
        "delay_wgrad_compute": delay,
    }
    for name in omit:
        del kw[name]
    if config.kind != "GroupedLinear" and ub_bulk_wgrad:
        kw["ub_bulk_wgrad"] = True
    if config.has_norm:
        kw["normalization"] = config.normalization
        kw["zero_centered_gamma"] = config.zero_centered_gamma
    if config.kind == "LayerNormMLP":
        kw["activation"] = config.activation
    cls = getattr(lib, config.kind)
    accepted = keywords(cls)
    if accepted is not None:
        # A constructor without an option SPEC lists still builds the default configuration.
        defaults = {"fuse_wgrad_accumulation": False, "delay_wgrad_compute": False}
        kw = {k: v for k, v in kw.items() if k in accepted or defaults.get(k, object()) != v}
    if config.kind == "GroupedLinear":
        return cls(config.num_gemms, config.in_features, config.out_features, **kw)
    return cls(config.in_features, config.out_features, **kw)


@functools.lru_cache(maxsize=256)
def keywords(fn: Any) -> frozenset[str] | None:
    """The keyword arguments ``fn`` takes (``None``: any, it has ``**kwargs``, or unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


#: The parts of SPEC §2-§6's public API the harness uses. A backend lacking one is reported
#: once (:meth:`Backend.missing_api`); the properties that need it are blocked
#: (``splitgrad.properties.checks.registry``), the others run without it. An FP8 quantizer of
#: its own (P13's) is not SPEC API: without one, P13 is n/a and the package still complete.
API_PARTS: dict[str, str] = {
    "delay": "delay_wgrad_compute=True with backward_dw() and pending_wgrad_count (SPEC §4)",
    "hooks": "register_wgrad_accumulation_and_reduce_hooks(fn) (SPEC §4)",
    "fused": "fuse_wgrad_accumulation=True, accumulating into main_grad (SPEC §3)",
    "first_microbatch": "forward(inp, is_first_microbatch=...) (SPEC §2)",
    "ub_bulk_wgrad": "the ub_bulk_wgrad constructor option (SPEC §2)",
    "constructors": "the module classes themselves, called with bad arguments (P9, P10)",
    "fp8": "fp8_autocast(enabled=True, fp8_recipe=...) (SPEC §6)",
}


def probe_library(lib: Any, name: str) -> dict[str, str]:
    """What ``lib`` (a namespace meant to have SPEC §2's API) lacks, as
    :meth:`Backend.missing_api` reports it: reads signatures and builds one tiny module of each
    kind, running no forward."""
    missing = {f"module:{k}": f"{name} does not export {k}" for k in KINDS if not hasattr(lib, k)}
    for kind in [k for k in KINDS if hasattr(lib, k)]:
        cls = getattr(lib, kind)
        accepted = keywords(cls)
        options = {"delay": "delay_wgrad_compute", "fused": "fuse_wgrad_accumulation"}
        if kind != "GroupedLinear":
            options["ub_bulk_wgrad"] = "ub_bulk_wgrad"
        for part, option in options.items():
            if accepted is not None and option not in accepted:
                missing.setdefault(part, f"{name}.{kind}() takes no {option}")
        fwd = keywords(getattr(cls, "forward", cls.__call__))
        if fwd is not None and "is_first_microbatch" not in fwd:
            missing.setdefault(
                "first_microbatch", f"{name}.{kind}.forward() takes no is_first_microbatch"
            )
        args = (2, 4, 4) if kind == "GroupedLinear" else (4, 4)
        kw = {} if "delay" in missing else {"delay_wgrad_compute": True}
        try:
            module = cls(*args, **kw)
        except Exception as exc:  # a constructor that fails on SPEC's options is a finding
            missing.setdefault("delay", f"{name}.{kind}(*{args}, **{kw}) raised {exc!r}")
            continue
        for attr in ("backward_dw", "pending_wgrad_count"):
            if not hasattr(module, attr):
                missing.setdefault("delay", f"{name}.{kind} has no {attr}")
        if not callable(getattr(module, "register_wgrad_accumulation_and_reduce_hooks", None)):
            missing.setdefault(
                "hooks", f"{name}.{kind} has no register_wgrad_accumulation_and_reduce_hooks"
            )
    if not callable(getattr(lib, "fp8_autocast", None)):
        missing["fp8"] = f"{name} does not export fp8_autocast"
    return missing


class LibraryBackend(Backend):
    """A namespace exporting the four modules with the SPEC.md API (``splitgrad.impl``,
    ``splitgrad.reference``, or a mutated copy of impl)."""

    #: Where :meth:`fp8_quantizer` looks, relative to the library (first hit wins).
    quantizer_modules: tuple[str, ...] = ("fp8", "fp8_quant")

    def __init__(self, name: str, module_name: str | None = None, lib: Any = None) -> None:
        self.name = name
        self._module_name = module_name
        self._lib = lib

    @property
    def lib(self) -> Any:
        if self._lib is None:
            if self._module_name is None:
                raise BackendUnavailable(f"backend {self.name!r} has no module to import")
            self._lib = importlib.import_module(self._module_name)
        return self._lib

    @property
    def _lib_name(self) -> str:
        return getattr(self.lib, "__name__", self.name)

    def _probed(self, attr: str, probe: Callable[[], Any]) -> Any:
        """``probe()``, run once (cached in ``attr``); the modules it builds draw their initial
        values from a forked RNG, not from the caller's stream."""
        if not hasattr(self, attr):
            with torch.random.fork_rng(devices=[]):
                setattr(self, attr, probe())
        return getattr(self, attr)

    def unavailable_reason(self) -> str | None:
        try:
            lib = self.lib
        except ImportError as exc:
            return f"cannot import {self._module_name}: {exc}"
        if not any(hasattr(lib, k) for k in KINDS):
            return f"{self._lib_name} exports none of SPEC §2's modules ({', '.join(KINDS)})"
        return None

    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        return build_library_module(self.lib, config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)

    def build_with_torch_defaults(
        self, config: ModuleConfig, *, delay: bool, omit: Collection[str]
    ) -> Any:
        return build_library_module(self.lib, config, delay=delay, omit=omit)

    def constructor(self, kind: str) -> Callable[..., Any]:
        return getattr(self.lib, kind)

    def parameters(self, module: Any) -> dict[str, torch.nn.Parameter]:
        return dict(module.named_parameters())

    def forward(self, module, x, m_splits, is_first_microbatch):
        kw = {}
        if is_first_microbatch is not None or "first_microbatch" not in self.missing_api():
            kw["is_first_microbatch"] = is_first_microbatch
        if m_splits is not None:
            return module(x, list(m_splits), **kw)
        return module(x, **kw)

    def missing_api(self) -> dict[str, str]:
        return self._probed("_missing", lambda: probe_library(self.lib, self._lib_name))

    def backward_dw(self, module: Any) -> None:
        module.backward_dw()

    def pending_wgrad_count(self, module: Any) -> int:
        return int(module.pending_wgrad_count)

    def register_hook(self, module: Any, fn: Callable[[], None]) -> None:
        module.register_wgrad_accumulation_and_reduce_hooks(fn)

    def fp8_autocast(self, config: ModuleConfig) -> contextlib.AbstractContextManager:
        if config.recipe is None:
            return contextlib.nullcontext()
        return self.lib.fp8_autocast(enabled=True, fp8_recipe=make_recipe(config.recipe))

    def fp8_state(self, module: Any) -> dict[str, torch.Tensor]:
        out = {}
        for key, state in sorted(getattr(module, "fp8_states", {}).items()):
            out[f"fp8_states[{key}].amax_history"] = state.amax_history.detach().clone()
            out[f"fp8_states[{key}].scale"] = state.scale.detach().clone()
        return out

    def fp8_quantizer(self) -> Any:
        name = self._lib_name
        for sub in self.quantizer_modules:
            try:
                mod = importlib.import_module(f"{name}.{sub}")
            except ImportError:
                continue
            if callable(getattr(mod, "quantize", None)):
                return mod
        where = " or ".join(f"{name}.{sub}.quantize" for sub in self.quantizer_modules)
        raise BackendUnavailable(
            f"{name} exposes no FP8 quantizer of its own ({where}); P13 compares one with the "
            "reference's bit for bit (the other FP8 properties run through fp8_autocast)"
        )

    def fp8_unavailable_reason(self) -> str | None:
        """``None`` when the library runs a forward and backward under ``fp8_autocast``; else
        why not (e.g. impl still raising ``NotImplementedError``). Probed once."""
        return self._probed("_fp8_why", self._probe_fp8)

    def _probe_fp8(self) -> str | None:
        lib = self.lib
        if not hasattr(lib, "fp8_autocast"):
            return f"{self._lib_name} does not export fp8_autocast"
        module = lib.Linear(32, 32)
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        try:
            with lib.fp8_autocast(enabled=True, fp8_recipe=make_recipe("delayed-max-hybrid")):
                y = module(x)
            y.sum().backward()
        except NotImplementedError as exc:
            return (
                f"{self._lib_name} raises NotImplementedError under "
                f"fp8_autocast ({str(exc).splitlines()[0][:160]})"
            )
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if config.recipe is not None:
            why = self.fp8_unavailable_reason()
            if why is None and property_id == "P13":
                try:
                    self.fp8_quantizer()
                except BackendUnavailable as exc:
                    why = str(exc)
            if why:
                return why
        return super().unsupported_reason(property_id, config)


class ImplBackend(LibraryBackend):
    """``splitgrad.impl``."""

    def __init__(self) -> None:
        super().__init__("impl", "splitgrad.impl")


def load_library_from_path(path: str | Path, package_name: str) -> Any:
    """Import the package in directory ``path`` under ``package_name`` (used for mutated copies
    of impl). Raises :class:`BackendUnavailable` naming the path when it is not a package."""
    path = Path(path)
    if not path.exists():
        raise BackendUnavailable(f"{path} does not exist")
    init = path / "__init__.py"
    if not init.is_file():
        raise BackendUnavailable(f"{path} is not a Python package (no __init__.py)")
    spec = importlib.util.spec_from_file_location(
        package_name, init, submodule_search_locations=[str(path)]
    )
    if spec is None or spec.loader is None:
        raise BackendUnavailable(f"cannot load a package from {path}")
    lib = importlib.util.module_from_spec(spec)
    sys.modules[package_name] = lib
    spec.loader.exec_module(lib)
    return lib
