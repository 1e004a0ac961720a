"""The Backend protocol and its adapters: ``impl``, ``reference``, ``torch-split``,
``transformer_engine``.

A backend turns a :class:`~splitgrad.properties.cases.case.ModuleConfig` into a live module and
drives it (forward, backward, ``backward_dw``, hooks, gradients), so the property checks (listed in
:mod:`.registry`) never touch a concrete API. Parameters are always addressed by their
TransformerEngine names (``fc1_weight``, ``weight3``...).

Each backend lists what it is known to do differently from SPEC.md in :attr:`Backend.deviations`
— the one place where that is written down. A check that fails where a deviation is declared is
*reported* as a known deviation (never turned into a pass), and a declared deviation that never
shows is reported too, so the list cannot rot. :attr:`Backend.notes` lists what the adapter
itself supplies (e.g. an emulated queue), which the reader should know when judging a green row.

The protocol is deliberately per-process and per-module (no global state), so a distributed
backend for P14 can implement the same methods on each rank.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import enum
import functools
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from ..cases.case import GATED, KINDS, Case, ModuleConfig, make_recipe
from ..cases.variants import PartialBackward

__all__ = [
    "Deviation",
    "BackendUnavailable",
    "Backend",
    "LibraryBackend",
    "TorchSplitBackend",
    "TransformerEngineBackend",
    "RecipeMappingError",
    "to_transformer_engine_recipe",
    "BACKEND_NAMES",
    "get_backend",
    "load_library_from_path",
]


class BackendUnavailable(RuntimeError):
    """The backend cannot run here (not installed, no GPU, impl not written yet)."""


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A known difference from SPEC.md: which property shows it, what it is, where it is
    tracked, and for which cases it is expected (``applies``; default: every case)."""

    property_id: str
    summary: str
    reference: str = ""
    applies: Callable[[Case], bool] = lambda case: True
    matches: str = ""
    #: The module kinds / dtypes whose cells show it (empty: all), so that a test runner can
    #: mark those cells as expected failures before running them.
    kinds: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    #: ``False``: the deviation shows only on some drawn cases (a test runner must not expect
    #: every cell of those kinds to show it; it is still reported as a deviation when it does).
    strict: bool = True

    def explains(self, case: Case, message: str) -> bool:
        """Whether a failure of this property on ``case`` with ``message`` is this deviation."""
        return self.applies(case) and self.matches in message

    def expected_in(self, property_id: str, kind: str, dtype: str) -> bool:
        """Whether a cell (property, module kind, dtype) is expected to show this deviation
        (always ``False`` for a non-strict one)."""
        return (
            self.strict
            and self.property_id == property_id
            and (not self.kinds or kind in self.kinds)
            and (not self.dtypes or dtype in self.dtypes)
        )


class Backend(abc.ABC):
    """How the harness drives one split-backward implementation.

    ``module`` below is whatever :meth:`build` returns (a module, or an adapter's handle).
    """

    name: str = "?"
    supports_fused: bool = True
    deviations: tuple[Deviation, ...] = ()
    notes: tuple[str, ...] = ()

    # ---- availability ------------------------------------------------------------------

    def unavailable_reason(self) -> str | None:
        """``None`` when usable here, else a sentence saying why not."""
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        """``None`` when ``property_id`` can run on ``config``, else why not (reported as
        "n/a", never as a pass)."""
        if config.device == "cuda" and not torch.cuda.is_available():
            return "config asks for CUDA but torch.cuda.is_available() is False"
        if property_id == "P18":
            try:
                self.torch_module(self.build(config, delay=False))
            except NotImplementedError as exc:
                return f"P18 substitutes, parametrizes and hooks torch.nn.Module parameters: {exc}"
        return None

    def deviation_for(self, property_id: str, case: Case, message: str = "") -> Deviation | None:
        """The declared deviation that explains a failure of ``property_id`` on ``case`` whose
        message is ``message`` (``None``: an undeclared failure)."""
        for dev in self.deviations:
            if dev.property_id == property_id and dev.explains(case, message):
                return dev
        return None

    # ---- building ----------------------------------------------------------------------

    @abc.abstractmethod
    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        """A fresh module for ``config``; ``delay`` is ``delay_wgrad_compute``."""

    @abc.abstractmethod
    def parameters(self, module: Any) -> dict[str, torch.nn.Parameter]:
        """Every parameter by TransformerEngine name (frozen ones included)."""

    def gemm_weight_names(self, module: Any) -> list[str]:
        """Names of the GEMM weights (those that use ``main_grad`` when fused), from SPEC §2's
        parameter names (never from an implementation's private API)."""
        from ..cases.data import GEMM_WEIGHT, role_of

        return [n for n in self.parameters(module) if _spec_role(n, role_of) == GEMM_WEIGHT]

    def gemm_bias_names(self, module: Any) -> list[str]:
        """Names of the GEMM biases, from SPEC §2's parameter names."""
        from ..cases.data import GEMM_BIAS, role_of

        return [n for n in self.parameters(module) if _spec_role(n, role_of) == GEMM_BIAS]

    def load_state(self, module: Any, state: dict[str, torch.Tensor]) -> None:
        """Copy parameter values (names as :meth:`parameters`); raise ``KeyError`` on a gap."""
        params = self.parameters(module)
        missing = set(params) ^ set(state)
        if missing:
            raise KeyError(f"{self.name}: parameter names differ from the state: {sorted(missing)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])

    # ---- running -----------------------------------------------------------------------

    @abc.abstractmethod
    def forward(
        self,
        module: Any,
        x: torch.Tensor,
        m_splits: Sequence[int] | None,
        is_first_microbatch: bool | None,
    ) -> torch.Tensor:
        """``module(x[, m_splits], is_first_microbatch=...)``."""

    def backward(
        self,
        module: Any,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor] | None = None,
        create_graph: bool = False,
    ) -> None:
        """The autograd backward of ``outputs`` (one call, possibly several outputs of one
        module, e.g. a tied weight used twice); ``inputs``: only these leaves' gradients
        (``backward(inputs=...)``, P17); ``create_graph``: the gradients keep a graph of their
        own (double backward, P18)."""
        kw: dict[str, Any] = {"create_graph": True} if create_graph else {}
        if inputs is not None:
            kw["inputs"] = list(inputs)
        torch.autograd.backward(list(outputs), list(grads), **kw)

    def grad(
        self,
        module: Any,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor],
        create_graph: bool = False,
    ) -> tuple[torch.Tensor | None, ...]:
        """``torch.autograd.grad(outputs, inputs, grads)``: the gradients returned, nothing
        written (P17); with ``create_graph`` they are differentiable themselves (P18)."""
        return torch.autograd.grad(
            list(outputs), list(inputs), list(grads), allow_unused=True, create_graph=create_graph
        )

    # ---- autograd fidelity (SPEC §2, §3; P18) --------------------------------------------

    def torch_module(self, module: Any) -> torch.nn.Module:
        """The ``torch.nn.Module`` whose parameters :meth:`parameters` returns: what
        ``torch.func.functional_call``, ``torch.nn.utils.parametrize`` and tensor hooks act on
        (``module`` itself by default). Raises ``NotImplementedError`` saying why when the
        backend has none (P18 is then n/a)."""
        if isinstance(module, torch.nn.Module):
            return module
        raise NotImplementedError(
            f"{self.name}: {type(module).__name__} is not a torch.nn.Module (override "
            "Backend.torch_module to name the one holding the parameters)"
        )

    def functional_forward(
        self,
        module: Any,
        tensors: dict[str, torch.Tensor],
        x: torch.Tensor,
        m_splits: Sequence[int] | None,
        is_first_microbatch: bool | None,
    ) -> torch.Tensor:
        """:meth:`forward` with the parameters named in ``tensors`` replaced by those tensors
        for this call only, through ``torch.func.functional_call`` on :meth:`torch_module`
        (the module's own are back in place when it returns; SPEC §3). Inside a ``torch.func``
        transform this is the function the transform differentiates."""
        call = _ForwardCall(self, module)
        named = {f"module.{name}": t for name, t in tensors.items()}
        return torch.func.functional_call(call, named, (x, m_splits, is_first_microbatch))

    def parametrize(self, module: Any, name: str, parametrization: torch.nn.Module) -> None:
        """``torch.nn.utils.parametrize.register_parametrization`` of parameter ``name``: the
        forward then uses ``parametrization(original)``, a tensor that is not a leaf, and the
        ``Parameter`` becomes its ``original``."""
        torch.nn.utils.parametrize.register_parametrization(
            self.torch_module(module), name, parametrization
        )

    # ---- the module protocol (SPEC §2; P18's module-protocol kinds) ---------------------

    def module_protocol_reason(self) -> str | None:
        """Why P18's module-protocol kinds (where parameters are created, ``reset_parameters``,
        ``repr``, outputs that are not views, copies; :mod:`.protocol`) do not apply to this
        backend's modules, or ``None`` when they do. Where they do not, they are left out of
        P18's cases and the reason is among the backend's :attr:`notes`."""
        return None

    def build_with_torch_defaults(
        self, config: ModuleConfig, *, delay: bool, omit: Collection[str]
    ) -> Any:
        """:meth:`build` without passing the constructor the options named in ``omit``
        (``"device"``, ``"params_dtype"``): torch's current default device (``with
        torch.device("meta"):``, ``torch.set_default_device``) and default dtype decide
        (SPEC §2)."""
        raise NotImplementedError(
            f"{self.name}: override Backend.build_with_torch_defaults to build a module without "
            "device= or params_dtype=, or Backend.module_protocol_reason to say why P18's "
            "module-protocol kinds do not apply"
        )

    def reset_parameters(self, module: Any) -> None:
        """``module.reset_parameters()`` (on :meth:`torch_module`)."""
        self.torch_module(module).reset_parameters()

    def to_empty(self, module: Any, device: str | torch.device) -> None:
        """``module.to_empty(device=device)`` (on :meth:`torch_module`), in place."""
        self.torch_module(module).to_empty(device=device)

    def has_hooks(self) -> bool:
        """Whether :meth:`register_hook` works (SPEC §4's hooks)."""
        return "hooks" not in self.missing_api()

    def missing_api(self) -> dict[str, str]:
        """The parts of SPEC §2-§6's API this backend lacks, by name in :data:`API_PARTS` (or
        ``"module:<Kind>"``), each with a sentence saying what is missing. Empty: complete."""
        return {}

    def cli_args(self) -> list[str]:
        """The ``splitgrad verify`` arguments that select this backend (for replay lines)."""
        return ["--backend", self.name]

    @abc.abstractmethod
    def backward_dw(self, module: Any) -> None:
        """Run the oldest queued weight-gradient entry."""

    @abc.abstractmethod
    def pending_wgrad_count(self, module: Any) -> int:
        """Queued entries."""

    @abc.abstractmethod
    def register_hook(self, module: Any, fn: Callable[[], None]) -> None:
        """``register_wgrad_accumulation_and_reduce_hooks(fn)``."""

    # ---- FP8 (SPEC §6) ------------------------------------------------------------------

    def fp8_autocast(self, config: ModuleConfig) -> contextlib.AbstractContextManager:
        """The context a forward of ``config`` runs in: ``fp8_autocast(enabled=True,
        fp8_recipe=...)`` when ``config.recipe`` is set, nothing otherwise."""
        if config.recipe is None:
            return contextlib.nullcontext()
        raise BackendUnavailable(f"{self.name} has no FP8 support")

    def fp8_state(self, module: Any) -> dict[str, torch.Tensor]:
        """Clones of the module's delayed-scaling state, ``"fp8_states[fc1.input].scale"`` etc.
        (empty when the module keeps none)."""
        return {}

    def fp8_quantizer(self) -> Any:
        """A namespace with the backend's FP8 ``quantize(x, recipe, role, axis, state=None)``
        (P13); raises :class:`BackendUnavailable` saying why there is none."""
        raise BackendUnavailable(f"{self.name} exposes no FP8 quantizer")

    def p12_bitwise(self, config: ModuleConfig) -> bool:
        """Whether ``GroupedLinear`` and ``Linear`` run the same GEMM kernel for ``config``
        (P12 is then bitwise, otherwise within :data:`~.budgets.GROUPED_GEMM`)."""
        return config.device == "cpu"

    def constructor(self, kind: str) -> Callable[..., Any]:
        """The raw constructor of ``kind`` (P9/P10 call it with bad arguments)."""
        raise NotImplementedError(f"{self.name} exposes no constructors")

    def supports_ub_bulk_wgrad(self, kind: str) -> bool:
        return kind != "GroupedLinear"


class _ForwardCall(torch.nn.Module):
    """``backend.forward(handle, ...)`` as a module whose submodule ``module`` is the
    backend's :meth:`Backend.torch_module`: ``torch.func.functional_call`` on it replaces that
    module's parameters for one call of the backend's own forward (whatever bookkeeping the
    backend does there)."""

    def __init__(self, backend: Backend, handle: Any) -> None:
        super().__init__()
        self.module = backend.torch_module(handle)
        # Plain attributes, not submodules: the handle may be the module itself.
        object.__setattr__(self, "_call", (backend, handle))

    def forward(self, x, m_splits, is_first_microbatch):
        backend, handle = self._call
        return backend.forward(handle, x, m_splits, is_first_microbatch)


# -------------------------------------------------------------------------------------------
# impl / reference: the splitgrad module API itself
# -------------------------------------------------------------------------------------------


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
    accepted = _keywords(cls)
    if accepted is not None:
        # A constructor without an option SPEC lists still builds the default configuration.
        defaults = {"fuse_wgrad_accumulation": False, "delay_wgrad_compute": False}
        kw = {k: v for k, v in kw.items() if k in accepted or defaults.get(k, object()) != v}
    if config.kind == "GroupedLinear":
        return cls(config.num_gemms, config.in_features, config.out_features, **kw)
    return cls(config.in_features, config.out_features, **kw)


@functools.lru_cache(maxsize=256)
def _keywords(fn: Any) -> frozenset[str] | None:
    """The keyword arguments ``fn`` takes (``None``: any, it has ``**kwargs``, or unknown)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values()):
        return None
    return frozenset(sig.parameters)


def _spec_role(name: str, role_of: Callable[[str], str]) -> str | None:
    try:
        return role_of(name)
    except ValueError:
        return None


#: The parts of SPEC §2-§6's public API the harness uses, with what each is. A backend lacking
#: one is reported once (:meth:`Backend.missing_api`); the properties that need it are blocked
#: (``splitgrad.properties.checks.registry``), the others run without it.
API_PARTS: dict[str, str] = {
    "delay": "delay_wgrad_compute=True with backward_dw() and pending_wgrad_count (SPEC §4)",
    "hooks": "register_wgrad_accumulation_and_reduce_hooks(fn) (SPEC §4)",
    "fused": "fuse_wgrad_accumulation=True, accumulating into main_grad (SPEC §3)",
    "first_microbatch": "forward(inp, is_first_microbatch=...) (SPEC §2)",
    "ub_bulk_wgrad": "the ub_bulk_wgrad constructor option (SPEC §2)",
    "constructors": "the module classes themselves, called with bad arguments (P9, P10)",
    "fp8": "fp8_autocast(enabled=True, fp8_recipe=...) (SPEC §6)",
}
# An FP8 quantizer of its own (``quantize(x, recipe, role, axis, state=None)``, what P13
# compares with the reference's bit for bit) is not SPEC API: a package with ``fp8_autocast``
# and no quantizer module (a plain re-export of splitgrad.impl, TransformerEngine) is complete,
# and its P13 cells are n/a with the reason (:meth:`Backend.unsupported_reason`).


def probe_library(lib: Any, name: str) -> dict[str, str]:
    """What ``lib`` (a namespace meant to have SPEC §2's API) lacks, as
    :meth:`Backend.missing_api` reports it. Reads signatures and builds one tiny module of each
    kind; runs no forward."""
    missing: dict[str, str] = {}
    kinds = [k for k in KINDS if hasattr(lib, k)]
    for kind in KINDS:
        if kind not in kinds:
            missing[f"module:{kind}"] = f"{name} does not export {kind}"
    needs = {
        "delay": ["delay_wgrad_compute"],
        "fused": ["fuse_wgrad_accumulation"],
    }
    for kind in kinds:
        cls = getattr(lib, kind)
        accepted = _keywords(cls)
        for part, options in needs.items():
            lacking = [o for o in options if accepted is not None and o not in accepted]
            if lacking and part not in missing:
                missing[part] = f"{name}.{kind}() takes no {', '.join(lacking)}"
        if kind != "GroupedLinear" and accepted is not None and "ub_bulk_wgrad" not in accepted:
            missing.setdefault("ub_bulk_wgrad", f"{name}.{kind}() takes no ub_bulk_wgrad")
        fwd = _keywords(getattr(cls, "forward", cls.__call__))
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
            if not hasattr(module, attr) and "delay" not in missing:
                missing["delay"] = f"{name}.{kind} has no {attr}"
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

    def unavailable_reason(self) -> str | None:
        try:
            lib = self.lib
        except ImportError as exc:
            return f"cannot import {self._module_name}: {exc}"
        if not any(hasattr(lib, k) for k in KINDS):
            return (
                f"{getattr(lib, '__name__', self.name)} exports none of SPEC §2's modules "
                f"({', '.join(KINDS)})"
            )
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
        if not hasattr(self, "_missing"):
            # The probe's modules draw their initial values: not from the caller's RNG stream.
            with torch.random.fork_rng(devices=[]):
                self._missing = probe_library(self.lib, getattr(self.lib, "__name__", self.name))
        return self._missing

    def backward_dw(self, module: Any) -> None:
        module.backward_dw()

    def pending_wgrad_count(self, module: Any) -> int:
        return int(module.pending_wgrad_count)

    def register_hook(self, module: Any, fn: Callable[[], None]) -> None:
        module.register_wgrad_accumulation_and_reduce_hooks(fn)

    # ---- FP8 -----------------------------------------------------------------------------

    #: Where :meth:`fp8_quantizer` looks, relative to the library (first hit wins).
    quantizer_modules: tuple[str, ...] = ("fp8", "fp8_quant")

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
        name = getattr(self.lib, "__name__", self.name)
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
        if not hasattr(self, "_fp8_why"):
            with torch.random.fork_rng(devices=[]):
                self._fp8_why = self._probe_fp8()
        return self._fp8_why

    def _probe_fp8(self) -> str | None:
        lib = self.lib
        if not hasattr(lib, "fp8_autocast"):
            return f"{getattr(lib, '__name__', self.name)} does not export fp8_autocast"
        module = lib.Linear(32, 32)
        x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
        try:
            with lib.fp8_autocast(enabled=True, fp8_recipe=make_recipe("delayed-max-hybrid")):
                y = module(x)
            y.sum().backward()
        except NotImplementedError as exc:
            return (
                f"{getattr(lib, '__name__', self.name)} raises NotImplementedError under "
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


# -------------------------------------------------------------------------------------------
# torch-split: PyTorch's generic split on torch.nn twins
# -------------------------------------------------------------------------------------------


class _TwinNorm:
    """LayerNorm/RMSNorm forward with TE's parameterisation, in torch.nn.functional."""

    @staticmethod
    def apply(
        config: ModuleConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if config.zero_centered_gamma and x.dtype in (torch.bfloat16, torch.float16):
            # gamma = 1 + stored in fp32 (as TE and the reference), not rounded to bf16; torch's
            # CPU norms accept fp32 affine parameters next to a bf16/fp16 input.
            weight = weight.float() + 1
            bias = None if bias is None else bias.float()
        elif config.zero_centered_gamma:
            weight = weight + 1
        gamma = weight
        k = (config.in_features,)
        if config.normalization == "LayerNorm":
            return torch.nn.functional.layer_norm(x, k, gamma, bias, eps=1e-5)
        return torch.nn.functional.rms_norm(x, k, gamma, eps=1e-5)


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    fn = {
        "gelu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "geglu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "relu": torch.nn.functional.relu,
        "swiglu": torch.nn.functional.silu,
    }[name]
    if name in GATED:
        a, b = h.chunk(2, dim=-1)
        return fn(a) * b
    return fn(h)


class TorchTwin(torch.nn.Module):
    """A plain ``torch.nn`` module equal to ``config``'s splitgrad module, parameters under the
    TransformerEngine names, built from ``torch.nn.functional`` only."""

    def __init__(self, config: ModuleConfig) -> None:
        super().__init__()
        from ..cases.data import param_specs

        self.config = config
        for spec in param_specs(config):
            p = torch.nn.Parameter(
                torch.zeros(spec.shape, dtype=config.torch_dtype, device=config.device)
            )
            self.register_parameter(spec.name, p)

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | None = None) -> torch.Tensor:
        c = self.config
        lin = torch.nn.functional.linear
        if c.kind == "GroupedLinear":
            rows = x.reshape(-1, c.in_features)
            parts = [
                lin(xi, getattr(self, f"weight{i}"), getattr(self, f"bias{i}", None))
                for i, xi in enumerate(rows.split(list(m_splits or ())))
            ]
            return torch.cat(parts, dim=0) if parts else rows.new_zeros(0, c.out_features)
        if c.has_norm:
            x = _TwinNorm.apply(
                c, x, self.layer_norm_weight, getattr(self, "layer_norm_bias", None)
            )
        if c.kind == "LayerNormMLP":
            h = lin(x, self.fc1_weight, getattr(self, "fc1_bias", None))
            y = lin(_activation(c.activation, h), self.fc2_weight, getattr(self, "fc2_bias", None))
        else:
            y = lin(x, self.weight, getattr(self, "bias", None))
        # stage_backward_input detach_()es the stage outputs, which torch refuses for views
        # (F.linear on a 3-D input returns one); a pipeline stage would hand over a copy too.
        return y.clone() if y._is_view() else y


@dataclasses.dataclass
class TorchSplitHandle:
    """A twin plus what the adapter keeps for the split: inputs seen since the last backward,
    the FIFO of ``param_groups`` from ``stage_backward_input``, and the hooks."""

    twin: TorchTwin
    delay: bool
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    hooks: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    routes: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


def _delayed_norm_case(case: Case) -> bool:
    return case.config.has_norm and case.delay


_NORM_KINDS = ("LayerNormLinear", "LayerNormMLP")
_PIPELINING = "torch.distributed.pipelining._backward"


def _delayed(variant: str) -> Callable[[Case], bool]:
    return lambda case: case.delay and case.variant == variant


def _delayed_p18(variant: str, summary: str, reference: str, strict: bool = False) -> Deviation:
    """A P18 deviation that shows on ``variant``'s cases under delay (their messages name the
    variant and the delay)."""
    return Deviation(
        "P18",
        summary,
        reference,
        applies=_delayed(variant),
        matches=f"P18 {variant} (delay",
        strict=strict,
    )


# P18 (autograd fidelity) under delay: what stage_backward_input / stage_backward_weight do with
# substituted, parametrized and hooked parameters and with a second backward.
_TORCH_SPLIT_P18 = (
    _delayed_p18(
        "functional_call",
        "leaves substituted by torch.func.functional_call never get their gradient under "
        "delay: stage_backward_input / stage_backward_weight are handed the stage module's "
        "own parameters() (as a PipelineStage hands them), and the substituted leaves are "
        "not among them",
        _PIPELINING,
        strict=True,
    ),
    _delayed_p18(
        "parametrize",
        "under delay a parametrized weight's original waits for stage_backward_weight like "
        "every parameter: original.grad is not there after backward() and an entry is "
        "queued for it (SPEC §3: a weight that is not a leaf gets its gradient during "
        "backward, nothing queued)",
        _PIPELINING,
    ),
    Deviation(
        "P18",
        "norm-parameter gradients are deferred too, so their tensor hooks run in "
        "backward_dw() (stage_backward_weight) rather than in backward()",
        _PIPELINING,
        applies=lambda case: (
            case.delay
            and case.variant == "tensor_hook"
            and any(n.startswith("layer_norm_") for n in case.asked)
        ),
        matches="P18 tensor_hook (delay",
        strict=False,
    ),
    _delayed_p18(
        "tensor_hook_wrong_size",
        "a W step that raises (a tensor hook returning a tensor of another size) has "
        "consumed its entry: the parameter groups are popped before stage_backward_weight "
        "runs them, as PipelineStage's backward_weight_one_chunk pops them",
        _PIPELINING,
    ),
    _delayed_p18(
        "post_accumulate_hook",
        "post-accumulate hooks of deferred parameters never fire: stage_backward_weight "
        "takes their gradients with torch.autograd.grad and adds them into .grad itself, "
        "past autograd's accumulator (norm parameters, deferred too, never fire either)",
        _PIPELINING,
    ),
    _delayed_p18(
        "grad_of_grad",
        "the backward of a penalty on gradients taken with create_graph=True goes through "
        "stage_backward_input / stage_backward_weight like any backward under delay: no "
        "stage input of that pass is left, and the second-order gradients are lost",
        _PIPELINING,
    ),
    Deviation(
        "P18",
        "torch.func.vmap and jacrev of the twin's LayerNorm fail inside torch ('expected "
        "scalar type BFloat16 but found Float'): with a zero-centred gamma the twin keeps "
        "gamma + 1 and beta in float32 next to a bf16/fp16 input, as TE does, which "
        "torch.nn.functional.layer_norm accepts on the CPU but its batching rule does not",
        "torch.nn.functional.layer_norm",
        applies=lambda case: (
            case.config.zero_centered_gamma
            and case.config.normalization == "LayerNorm"
            and case.config.dtype in ("bfloat16", "float16")
            and case.variant in ("func.vmap", "func.jacrev")
        ),
        matches="expected scalar type",
        kinds=_NORM_KINDS,
        strict=False,
    ),
    _delayed_p18(
        "backward_create_graph",
        "stage_backward_input has no create_graph: under delay the gradients it writes carry "
        "no graph, so a second backward through them fails (no clear error naming the "
        "module)",
        _PIPELINING,
    ),
)


def _torch_split_norm_deviations() -> list[Deviation]:
    """The norm parameters under torch's split: deferred with the GEMMs, and torch's CPU
    LayerNorm backward in low precision."""
    out = [
        Deviation(
            pid,
            "norm-parameter gradients are deferred too: stage_backward_input computes input "
            "gradients only, every parameter (norm gamma/beta included) waits for "
            "stage_backward_weight",
            _PIPELINING,
            applies=_delayed_norm_case,
            matches="layer_norm_",
            kinds=_NORM_KINDS,
            strict=pid != "P17",
        )
        for pid in ("P2", "P5", "P6", "P17")
    ]
    for pid in ("P2", "P4", "P5", "P6", "P7", "P8", "P17", "P18"):
        tags = ("[dgrad budget]", "[norm_grad budget]")
        for tag in tags + (("[second_order budget]",) if pid == "P18" else ()):
            out.append(
                Deviation(
                    pid,
                    "torch's CPU LayerNorm backward in bf16/fp16 (gamma and beta in the same low "
                    "precision, zero-centred gamma + 1 rounded to it) has several times the "
                    "reference's error on dx and dgamma (e.g. dx -0.115 vs truth -0.036 at "
                    "in_features=3)",
                    "torch.nn.functional.layer_norm",
                    applies=_low_precision_norm_case,
                    matches=tag,
                    kinds=_NORM_KINDS,
                    dtypes=("bfloat16", "float16"),
                    strict=pid == "P2" and tag == "[dgrad budget]",
                )
            )
    return out + [
        Deviation(
            pid,
            "with every GEMM parameter frozen, the norm parameters' gradients still wait for "
            "stage_backward_weight: one entry is queued per backward (SPEC §4: none)",
            _PIPELINING,
            applies=lambda case: case.config.has_norm and bool(case.frozen),
            matches="pending_wgrad_count after ",
            kinds=_NORM_KINDS,
            strict=False,
        )
        for pid in ("P4", "P7")
    ]


_TORCH_SPLIT_OTHERS = (
    Deviation(
        "P7",
        "one stage_backward_input call covers every use of the module in the graph: a "
        "weight used twice queues one entry, not two (the gradients themselves are checked "
        "first)",
        _PIPELINING,
        matches="pending_wgrad_count after one backward through two uses",
    ),
    Deviation(
        "P7",
        "a module chained on itself (y = m(m(x))) with a norm in front cannot be split: "
        "stage_backward_weight fails with 'Trying to backward through the graph a second "
        "time'",
        _PIPELINING,
        applies=lambda case: case.variant == "tied-chain",
        matches="backward through the graph a second time",
        kinds=_NORM_KINDS,
        strict=False,
    ),
    Deviation(
        "P11",
        "with a norm in front (torch.nn.functional.layer_norm / rms_norm), the input and "
        "saved activations of a micro-batch are still alive after stage_backward_weight",
        _PIPELINING,
        applies=lambda case: case.config.has_norm and case.delay,
        matches="still alive",
        kinds=_NORM_KINDS,
        strict=False,
    ),
    Deviation(
        "P17",
        "backward(inputs=[parameters]) without a stage input, under delay: "
        "stage_backward_input builds its parameter groups from the stage inputs' "
        "gradients, so with none asked stage_backward_weight writes nothing and the asked "
        "parameters never get their gradient",
        _PIPELINING,
        applies=lambda case: (
            case.delay
            and isinstance(case.variant, PartialBackward)
            and case.variant.mode == "inputs"
            and "inp" not in case.asked
        ),
        matches="P17 inputs: ",
        strict=False,
    ),
    Deviation(
        "P10",
        "no input validation: a wrong last dimension, dtype, device or m_splits fails "
        "inside torch.nn.functional with RuntimeError, or not at all, instead of "
        "ValueError/TypeError naming expected and actual",
    ),
)


def _torch_split_deviations() -> list[Deviation]:
    """What PyTorch's generic split (as the ``torch-split`` adapter drives it) does differently
    from SPEC.md. P18's own come first: a delayed substitution's failure may also be over a
    budget, which a budget deviation would otherwise claim."""
    return [*_TORCH_SPLIT_P18, *_torch_split_norm_deviations(), *_TORCH_SPLIT_OTHERS]


def _low_precision_norm_case(case: Case) -> bool:
    return case.config.has_norm and case.config.dtype in ("bfloat16", "float16")


_TORCH_SPLIT_PROTOCOL = (
    "the module is the adapter's own torch.nn twin (built with an explicit device and dtype, "
    "filled by load_state, views cloned), not torch's: where its parameters are created, "
    "reset_parameters, repr, output views and copies would check the adapter, not "
    "torch.distributed.pipelining's split"
)


class TorchSplitBackend(Backend):
    """``torch.distributed.pipelining._backward.stage_backward_input`` /
    ``stage_backward_weight`` applied to :class:`TorchTwin` modules with the same weights.

    ``backward()`` runs ``stage_backward_input`` over every parameter of the twin (as a
    ``PipelineStage`` does) and queues its ``param_groups``; ``backward_dw()`` pops the oldest and
    runs ``stage_backward_weight``.
    """

    name = "torch-split"
    supports_fused = False
    notes = (
        "outputs that are views are cloned by the twin: stage_backward_input detach_()es stage "
        "outputs and fails on views",
        "the FIFO queue, pending_wgrad_count, the empty-queue RuntimeError and the hooks are "
        "supplied by the adapter (torch's split has none of them)",
        "fused wgrad accumulation (main_grad, is_first_microbatch) does not exist in torch.nn: "
        "fused configs and P8 are reported n/a",
        "P18's module-protocol kinds are n/a: " + _TORCH_SPLIT_PROTOCOL,
    )
    deviations = tuple(_torch_split_deviations())

    def module_protocol_reason(self) -> str | None:
        return _TORCH_SPLIT_PROTOCOL

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module("torch.distributed.pipelining._backward")
        except ImportError as exc:
            return (
                f"torch {torch.__version__} has no torch.distributed.pipelining._backward ({exc})"
            )
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if config.recipe is not None or property_id == "P13":
            return "torch.nn modules have no FP8 recipes"
        if config.fuse_wgrad_accumulation or property_id == "P8":
            return "torch.nn has no fused wgrad accumulation into main_grad"
        if property_id == "P9":
            return "torch.nn has no ub_bulk_wgrad option"
        return super().unsupported_reason(property_id, config)

    def build(
        self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False
    ) -> TorchSplitHandle:
        if config.fuse_wgrad_accumulation:
            raise BackendUnavailable("torch-split: fuse_wgrad_accumulation is not supported")
        return TorchSplitHandle(TorchTwin(config), delay)

    def parameters(self, module: TorchSplitHandle) -> dict[str, torch.nn.Parameter]:
        return dict(module.twin.named_parameters())

    def torch_module(self, module: TorchSplitHandle) -> torch.nn.Module:
        return module.twin

    def forward(self, module: TorchSplitHandle, x, m_splits, is_first_microbatch):
        # Stage inputs are leaves (a pipeline stage receives detached activations); an input
        # produced by this module itself (a chained, tied use) is part of the stage's graph.
        if x.grad_fn is None:
            module.inputs.append(x)
        elif x._base is not None and x._base.is_leaf and x.requires_grad:
            # A view of a leaf (P12 feeds the Linears torch.split views): the stage gets a
            # detached copy, and its input gradient is sent back through the view.
            leaf = x.detach().requires_grad_(True)
            module.inputs.append(leaf)
            module.routes.append((leaf, x))
            x = leaf
        return module.twin(x, m_splits)

    def _trainable(self, module: TorchSplitHandle) -> list[torch.nn.Parameter]:
        return [p for p in module.twin.parameters() if p.requires_grad]

    def backward(
        self, module: TorchSplitHandle, outputs, grads, inputs=None, create_graph=False
    ) -> None:
        stage_inputs, module.inputs = module.inputs, []
        gemm = set(self.gemm_weight_names(module) + self.gemm_bias_names(module))
        if inputs is not None:
            # backward(inputs=...): only what is asked (a stage input, some parameters).
            asked = {id(t) for t in inputs}
            stage_inputs = [x for x in stage_inputs if id(x) in asked]
            weights = [p for p in self._trainable(module) if id(p) in asked]
        else:
            weights = self._trainable(module)
        asked_gemm = any(
            p.requires_grad and id(p) in {id(w) for w in weights}
            for n, p in module.twin.named_parameters()
            if n in gemm
        )
        routes, module.routes = module.routes, []
        if not module.delay:
            torch.autograd.backward(
                list(outputs), list(grads), inputs=inputs, create_graph=create_graph
            )
            self._send_back(routes)
            if asked_gemm:
                self._run_hooks(module)
            return
        from torch.distributed.pipelining._backward import stage_backward_input

        # stage_backward_input has no create_graph: its gradients never carry a graph.
        _, param_groups = stage_backward_input(
            list(outputs), list(grads), stage_inputs, iter(weights)
        )
        self._send_back(routes)
        # Norm parameters wait for stage_backward_weight too: queue whenever any weight trains.
        if weights:
            module.queue.append((weights, param_groups))

    @staticmethod
    def _send_back(routes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for leaf, view in routes:
            if leaf.grad is not None:
                torch.autograd.backward([view], [leaf.grad])

    def grad(self, module: TorchSplitHandle, outputs, grads, inputs, create_graph=False):
        module.inputs, module.routes = [], []  # a partial backward consumes the stage inputs
        return super().grad(module, outputs, grads, inputs, create_graph)

    def backward_dw(self, module: TorchSplitHandle) -> None:
        if not module.delay:
            return
        if not module.queue:
            raise RuntimeError(
                "torch-split backward_dw(): nothing is pending (pending_wgrad_count=0)"
            )
        from torch.distributed.pipelining._backward import stage_backward_weight

        weights, param_groups = module.queue.popleft()
        stage_backward_weight(iter(weights), param_groups)
        del param_groups, weights
        self._run_hooks(module)

    @staticmethod
    def _run_hooks(module: TorchSplitHandle) -> None:
        for hook in list(module.hooks):
            hook()

    def pending_wgrad_count(self, module: TorchSplitHandle) -> int:
        return len(module.queue)

    def register_hook(self, module: TorchSplitHandle, fn: Callable[[], None]) -> None:
        module.hooks.append(fn)

    def supports_ub_bulk_wgrad(self, kind: str) -> bool:
        return False


# -------------------------------------------------------------------------------------------
# TransformerEngine
# -------------------------------------------------------------------------------------------


def _plain_case(case: Case) -> bool:
    return not case.config.fuse_wgrad_accumulation


class RecipeMappingError(ValueError):
    """A splitgrad recipe (or one of its fields or values) has no counterpart in
    TransformerEngine's recipe module: the harness cannot say what to run, so it refuses."""


def _recipe_fields(cls: Any) -> frozenset[str] | None:
    """The fields a recipe class takes (dataclass fields, else its constructor's keywords;
    ``None``: it takes any)."""
    if dataclasses.is_dataclass(cls):
        return frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    return _keywords(cls)


def to_transformer_engine_recipe(recipe: Any, te_recipe: Any) -> Any:
    """TransformerEngine's recipe for splitgrad's ``recipe`` (a dataclass of
    :mod:`splitgrad.reference.fp8`), built from ``te_recipe`` (the module
    ``transformer_engine.common.recipe``, passed in so the mapping runs without TE): the class
    of the same name (``DelayedScaling``, ``Float8CurrentScaling``, ``MXFP8BlockScaling``,
    ``Float8BlockScaling``), every field under its own name (``margin``, ``fp8_format``,
    ``amax_history_len``, ``amax_compute_algo``), enum values by member name (``Format.HYBRID``
    -> ``te_recipe.Format.HYBRID``). TE's fields that splitgrad's recipe lacks keep TE's
    defaults. Raises :class:`RecipeMappingError` naming the class, field or value without a
    counterpart."""
    if not dataclasses.is_dataclass(recipe) or isinstance(recipe, type):
        raise RecipeMappingError(f"expected a splitgrad recipe instance, got {recipe!r}")
    name = type(recipe).__name__
    where = getattr(te_recipe, "__name__", "transformer_engine.common.recipe")
    te_cls = getattr(te_recipe, name, None)
    if te_cls is None:
        raise RecipeMappingError(f"{where} has no {name}: cannot run splitgrad's {recipe!r}")
    accepted = _recipe_fields(te_cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(recipe):
        value = getattr(recipe, field.name)
        if accepted is not None and field.name not in accepted:
            raise RecipeMappingError(
                f"{name}.{field.name} (= {value!r}) has no counterpart in {where}.{name}, whose "
                f"fields are {', '.join(sorted(accepted))}"
            )
        if isinstance(value, enum.Enum):
            te_enum = getattr(te_recipe, type(value).__name__, None)
            members = getattr(te_enum, "__members__", {})
            if value.name not in members:
                raise RecipeMappingError(
                    f"{name}.{field.name} = {value!r}: {where} has no "
                    f"{type(value).__name__}.{value.name}"
                )
            value = members[value.name]
        kwargs[field.name] = value
    return te_cls(**kwargs)


_TE_BACKWARD_DW = (
    "TransformerEngine transformer_engine/pytorch/module/base.py, "
    "TransformerEngineBaseModule.backward_dw"
)
_TE_LINEAR_BACKWARD = (
    "TransformerEngine transformer_engine/pytorch/module/linear.py, _Linear.backward"
)
_TE_UNRUN = (
    "; read from TE's source, not yet run against TE (no GPU lent), so only the cases that show "
    "it are reported as a deviation"
)


# P18 (autograd fidelity) as TransformerEngine's source reads, from the search index:
# TransformerEngineBaseModule.backward_dw (2025 module/base.py): `(wgrad, bgrad), _ =
# self.wgrad_store.pop()`, then without fusion `weight_tensor = noop_cat(
# self._get_weight_tensors()); weight_tensor.grad = wgrad.to(...)`. _Linear.backward (a 2025 copy
# of module/linear.py; the NVIDIA revisions indexed predate delay_wgrad_compute): under delay the
# wgrad GEMM goes to ctx.wgrad_store.put(...) and the weight's gradient returned is None, or
# get_dummy_wgrad(...) when fused and the weight has grad_added_to_main_grad. _Linear is an
# autograd.Function with forward(ctx, ...) and no setup_context (every indexed revision; the
# module calls _Linear.forward(None, ...) without grad). None was run here (no GPU): non-strict.
_TE_P18 = (
    _delayed_p18(
        "functional_call",
        "under delay backward_dw() sets .grad on the module's own weight attribute as it is "
        "when backward_dw() runs (weight_tensor = noop_cat(self._get_weight_tensors()); "
        "weight_tensor.grad = wgrad), not on the tensor the forward used: a leaf substituted "
        "by torch.func.functional_call gets nothing, the module's own parameter gets its "
        "gradient (and .grad is overwritten, issue #3437)" + _TE_UNRUN,
        _TE_BACKWARD_DW,
    ),
    _delayed_p18(
        "parametrize",
        "under delay a parametrized weight is queued like a Parameter (_Linear.backward "
        "returns None for it) and backward_dw() assigns .grad to the parametrization's output "
        "recomputed at that moment, a non-leaf: original.grad stays None" + _TE_UNRUN,
        _TE_BACKWARD_DW,
    ),
    Deviation(
        "P18",
        "under delay _Linear.backward returns None for the weight, so autograd's accumulator "
        "calls the weight's tensor hooks with None in backward() (a hook that computes with "
        "the gradient raises there), and backward_dw() writes .grad past the hooks: they "
        "never see or replace the gradient, and a hook returning a wrong size raises "
        "nothing" + _TE_UNRUN,
        f"{_TE_LINEAR_BACKWARD}; {_TE_BACKWARD_DW}",
        applies=lambda case: (
            case.delay and case.variant in ("tensor_hook", "tensor_hook_wrong_size")
        ),
        matches="P18 tensor_hook",
        strict=False,
    ),
    _delayed_p18(
        "post_accumulate_hook",
        "under delay a weight's post-accumulate hooks fire in backward() (autograd's "
        "accumulator runs on the None gradient _Linear.backward returns), before the "
        "deferred gradient exists, and not in backward_dw(), which sets .grad itself" + _TE_UNRUN,
        f"{_TE_LINEAR_BACKWARD}; {_TE_BACKWARD_DW}",
    ),
    Deviation(
        "P18",
        "with fuse_wgrad_accumulation and a weight carrying grad_added_to_main_grad, "
        "_Linear.backward returns a placeholder from get_dummy_wgrad(): a tensor hook on the "
        "weight sees that placeholder instead of being refused, and its post-accumulate "
        "hooks fire on it in backward(), before a delayed main_grad write" + _TE_UNRUN,
        _TE_LINEAR_BACKWARD,
        applies=lambda case: (
            case.config.fuse_wgrad_accumulation
            and case.variant in ("tensor_hook", "post_accumulate_hook")
        ),
        matches="P18 ",
        strict=False,
    ),
    Deviation(
        "P18",
        "torch.func transforms fail inside torch ('In order to use an autograd.Function with "
        "functorch transforms ... it must override the setup_context staticmethod'), "
        "without naming the module: TE's autograd Functions (_Linear, _LayerNormLinear, "
        "_LayerNormMLP, _GroupedLinear) define forward(ctx, ...) and no setup_context" + _TE_UNRUN,
        _TE_LINEAR_BACKWARD,
        applies=lambda case: case.variant.startswith("func."),
        matches="P18 func.",
        strict=False,
    ),
    Deviation(
        "P18",
        "a double backward (create_graph=True) differentiates nothing of TE's backward: it "
        "runs TE's own GEMM and norm kernels, which autograd does not record, so the "
        "second-order terms are missing or the second backward fails inside torch, without "
        "naming the module (not confirmed: which of the two happens was not seen in the "
        "source)" + _TE_UNRUN,
        _TE_LINEAR_BACKWARD,
        applies=lambda case: case.variant in ("grad_of_grad", "backward_create_graph"),
        matches="P18 ",
        strict=False,
    ),
)


_TE_LINEAR_MODULE = (
    "TransformerEngine transformer_engine/pytorch/module/linear.py, Linear.__init__ and "
    "_Linear.forward"
)

# P18's module-protocol kinds as TransformerEngine's source reads (a 2025 module/linear.py from
# the search index): Linear.__init__(..., device: Union[torch.device, str] = "cuda", ...) creates
# `weight_tensor = torch.empty(..., device=device, ...)` and calls
# `self.reset_parameters(defer_init=device == "meta")`; _Linear.forward ends with
# `return out.view(-1, *inp_shape[1:-1], out_features)`. Not run here (no GPU): non-strict.
_TE_PROTOCOL = (
    Deviation(
        "P18",
        "the constructors default to device='cuda' rather than None: inside "
        '`with torch.device("meta")` or after torch.set_default_device(...), a module '
        "built without device= is created on CUDA (TE's own deferred initialization is "
        "device='meta', then reset_parameters())" + _TE_UNRUN,
        _TE_LINEAR_MODULE,
        applies=lambda case: case.variant in ("module.placement", "module.reset_parameters"),
        matches="P18 module.",
        strict=False,
    ),
    Deviation(
        "P18",
        "_Linear.forward returns out.view(-1, *inp_shape[1:-1], out_features): the output "
        "for a 2-D input is a view (DualPipe frees stage outputs in place and refuses "
        "views)" + _TE_UNRUN,
        _TE_LINEAR_MODULE,
        applies=lambda case: case.variant == "module.output_not_view",
        matches="P18 module.output_not_view",
        strict=False,
    ),
)


class TransformerEngineBackend(LibraryBackend):
    """``transformer_engine.pytorch`` (needs TE and a CUDA GPU). Its modules share the splitgrad
    API names; the pending count is read from TE's ``wgrad_store`` when it has no
    ``pending_wgrad_count``."""

    notes = ("pending_wgrad_count is read from TE's internal wgrad_store when TE lacks it",)
    deviations = (
        Deviation(
            "P4",
            "non-fused backward_dw() overwrites weight.grad instead of accumulating (a random "
            ".grad prefill or a second micro-batch is lost)",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P6",
            "non-fused backward_dw() overwrites weight.grad, so interleaved micro-batches lose "
            "all but the last contribution",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P7",
            "a weight used twice queues two entries whose non-fused backward_dw() overwrite "
            "each other",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P3",
            "the bias gradient is filled in backward_dw() only when bias.grad is still None",
            "TransformerEngine issue #3400",
            applies=lambda case: case.config.bias,
        ),
        Deviation(
            "P10",
            "backward_dw() on an empty GroupedLinear queue returns silently instead of raising",
            "SPEC.md §4",
            applies=lambda case: case.config.kind == "GroupedLinear",
        ),
        *_TE_P18,
        *_TE_PROTOCOL,
    )

    def __init__(self) -> None:
        super().__init__("transformer_engine", "transformer_engine.pytorch")

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module("transformer_engine.pytorch")
        except Exception as exc:  # TE raises assorted errors when its CUDA libs are missing
            return f"TransformerEngine is not importable here ({type(exc).__name__}: {exc})"
        if not torch.cuda.is_available():
            return "TransformerEngine needs a CUDA GPU; torch.cuda.is_available() is False"
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if config.device != "cuda":
            return "TransformerEngine modules run on CUDA only"
        if property_id == "P13":
            try:
                self.fp8_quantizer()
            except BackendUnavailable as exc:
                return str(exc)
        if config.recipe is not None:
            why = self._fp8_support(config.recipe)
            if why:
                return why
        return Backend.unsupported_reason(self, property_id, config)

    @property
    def recipe_module(self) -> Any:
        """``transformer_engine.common.recipe``."""
        return importlib.import_module("transformer_engine.common.recipe")

    def fp8_autocast(self, config: ModuleConfig) -> contextlib.AbstractContextManager:
        """TE's ``fp8_autocast`` with TE's own recipe, mapped by name from splitgrad's
        (:func:`to_transformer_engine_recipe`)."""
        if config.recipe is None:
            return contextlib.nullcontext()
        recipe = to_transformer_engine_recipe(make_recipe(config.recipe), self.recipe_module)
        return self.lib.fp8_autocast(enabled=True, fp8_recipe=recipe)

    #: TE's own probe of the GPU for each recipe class (``transformer_engine.pytorch.fp8``),
    #: each returning ``(supported, reason)``.
    _SUPPORT_PROBES = {
        "DelayedScaling": "check_fp8_support",
        "Float8CurrentScaling": "check_fp8_support",
        "MXFP8BlockScaling": "check_mxfp8_support",
        "Float8BlockScaling": "check_fp8_block_scaling_support",
    }

    def _fp8_support(self, recipe_name: str) -> str | None:
        """Why TE cannot run ``recipe_name`` on this GPU (``None``: it can, or TE has no probe
        for it, in which case the cells run and show)."""
        cls = type(make_recipe(recipe_name)).__name__
        try:
            fp8 = importlib.import_module("transformer_engine.pytorch.fp8")
        except ImportError:
            return None
        probe = getattr(fp8, self._SUPPORT_PROBES.get(cls, ""), None)
        if probe is None:
            return None
        supported, reason = probe()
        return None if supported else f"TransformerEngine cannot run {cls} here: {reason}"

    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        return build_library_module(self.lib, config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)

    def pending_wgrad_count(self, module: Any) -> int:
        if hasattr(module, "pending_wgrad_count"):
            return int(module.pending_wgrad_count)
        store = getattr(module, "wgrad_store", None)
        ctx = getattr(store, "context", None)
        queue = getattr(ctx, "queue", None) if ctx is not None else None
        if queue is None:
            raise BackendUnavailable("cannot read the pending wgrad count from this TE version")
        return len(queue) if not hasattr(queue, "qsize") else int(queue.qsize())


# -------------------------------------------------------------------------------------------


BACKEND_NAMES = ("impl", "reference", "torch-split", "transformer_engine")


def get_backend(name: str) -> Backend:
    """The backend called ``name``: one of :data:`BACKEND_NAMES`, ``path:DIR`` (a package
    directory with SPEC §2's API, e.g. a mutated copy of impl), ``module:NAME`` (an importable
    package with that API, e.g. ``module:mypkg.modules``) or ``class:MODULE:ATTR`` (a
    :class:`Backend` subclass, built without arguments, for an API that differs from SPEC's).
    Raises ``ValueError`` naming unknown backends and :class:`BackendUnavailable` when the
    package cannot be imported."""
    if name == "impl":
        return ImplBackend()
    if name == "reference":
        return LibraryBackend("reference", "splitgrad.reference")
    if name == "torch-split":
        return TorchSplitBackend()
    if name == "transformer_engine":
        return TransformerEngineBackend()
    if name.startswith("path:"):
        path = Path(name[5:])
        pkg = "splitgrad_under_test_" + "".join(c if c.isalnum() else "_" for c in path.name)
        try:
            lib = load_library_from_path(path, pkg)
        except BackendUnavailable:
            raise
        except Exception as exc:
            raise BackendUnavailable(
                f"cannot import the package at {path}: {type(exc).__name__}: {exc}"
            ) from exc
        return LibraryBackend(name, lib=lib)
    if name.startswith("module:"):
        module_name = name[len("module:") :]
        if not module_name:
            raise ValueError("module:NAME needs a package name, e.g. module:mypkg")
        try:
            lib = importlib.import_module(module_name)
        except Exception as exc:
            raise BackendUnavailable(
                f"cannot import {module_name}: {type(exc).__name__}: {exc}"
            ) from exc
        return LibraryBackend(name, module_name, lib=lib)
    if name.startswith("class:"):
        module_name, _, attr = name[len("class:") :].rpartition(":")
        if not module_name or not attr:
            raise ValueError(f"class:MODULE:ATTR needs a module and a class, got {name!r}")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:
            raise BackendUnavailable(
                f"cannot load {module_name}:{attr}: {type(exc).__name__}: {exc}"
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ValueError(f"{name}: {attr} is not a splitgrad.properties Backend subclass")
        backend = cls()
        backend.name = name
        return backend
    raise ValueError(
        f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}, path:DIR, "
        "module:NAME or class:MODULE:ATTR"
    )
