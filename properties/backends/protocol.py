"""The :class:`Backend` protocol every adapter implements, and the :class:`Deviation` records
with which a backend declares where it differs from SPEC.md."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..cases.case import Case, ModuleConfig
from ..cases.data import GEMM_BIAS, GEMM_WEIGHT, role_of


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
    #: ``False``: it shows only on some drawn cases, so a runner must not expect every cell of
    #: those kinds to show it (it is still reported as a deviation when it does).
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


def delayed_p18(variant: str, summary: str, reference: str, strict: bool = False) -> Deviation:
    """A P18 deviation shown by ``variant``'s cases under delay (their messages name both)."""
    return Deviation(
        "P18",
        summary,
        reference,
        applies=lambda case: case.delay and case.variant == variant,
        matches=f"P18 {variant} (delay",
        strict=strict,
    )


def _role(name: str) -> str | None:
    try:
        return role_of(name)
    except ValueError:
        return None


class Backend(abc.ABC):
    """How the harness drives one split-backward implementation; ``module`` below is whatever
    :meth:`build` returns (a module, or an adapter's handle)."""

    name: str = "?"
    supports_fused: bool = True
    deviations: tuple[Deviation, ...] = ()
    notes: tuple[str, ...] = ()

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

    @abc.abstractmethod
    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        """A fresh module for ``config``; ``delay`` is ``delay_wgrad_compute``."""

    @abc.abstractmethod
    def parameters(self, module: Any) -> dict[str, torch.nn.Parameter]:
        """Every parameter by TransformerEngine name (frozen ones included)."""

    def gemm_weight_names(self, module: Any) -> list[str]:
        """Names of the GEMM weights (those that use ``main_grad`` when fused), from SPEC §2's
        parameter names (never from an implementation's private API)."""
        return [n for n in self.parameters(module) if _role(n) == GEMM_WEIGHT]

    def gemm_bias_names(self, module: Any) -> list[str]:
        """Names of the GEMM biases, from SPEC §2's parameter names."""
        return [n for n in self.parameters(module) if _role(n) == GEMM_BIAS]

    def load_state(self, module: Any, state: dict[str, torch.Tensor]) -> None:
        """Copy parameter values (names as :meth:`parameters`); raise ``KeyError`` on a gap."""
        params = self.parameters(module)
        missing = set(params) ^ set(state)
        if missing:
            raise KeyError(f"{self.name}: parameter names differ from the state: {sorted(missing)}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(state[name])

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
        """One autograd backward of ``outputs`` (several for a weight used twice); ``inputs``:
        only these leaves' gradients (P17); ``create_graph``: for a double backward (P18)."""
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

    def torch_module(self, module: Any) -> torch.nn.Module:
        """The ``torch.nn.Module`` holding :meth:`parameters`, which P18 substitutes,
        parametrizes and hooks (``module`` itself by default); raises ``NotImplementedError``
        saying why when there is none (P18 is then n/a)."""
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
        for this call only (``torch.func.functional_call`` on :meth:`torch_module`, SPEC §3)."""
        call = _ForwardCall(self, module)
        named = {f"module.{name}": t for name, t in tensors.items()}
        return torch.func.functional_call(call, named, (x, m_splits, is_first_microbatch))

    def parametrize(self, module: Any, name: str, parametrization: torch.nn.Module) -> None:
        """``torch.nn.utils.parametrize.register_parametrization`` of parameter ``name``."""
        torch.nn.utils.parametrize.register_parametrization(
            self.torch_module(module), name, parametrization
        )

    def module_protocol_reason(self) -> str | None:
        """Why P18's module-protocol kinds (parameter creation, ``reset_parameters``, ``repr``,
        outputs that are not views, copies) do not apply to this backend's modules, or ``None``
        when they do; where they do not, the reason belongs among :attr:`notes`."""
        return None

    def build_with_torch_defaults(
        self, config: ModuleConfig, *, delay: bool, omit: Collection[str]
    ) -> Any:
        """:meth:`build` without the constructor options named in ``omit`` (``"device"``,
        ``"params_dtype"``): torch's default device and dtype decide (SPEC §2)."""
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

    def fp8_autocast(self, config: ModuleConfig) -> contextlib.AbstractContextManager:
        """The context a forward of ``config`` runs in: ``fp8_autocast(enabled=True,
        fp8_recipe=...)`` when ``config.recipe`` is set, nothing otherwise (SPEC §6)."""
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


class _ForwardCall(torch.nn.Module):
    """``backend.forward(handle, ...)`` as a module whose submodule ``module`` is the backend's
    :meth:`Backend.torch_module`, so that ``functional_call`` on it runs the backend's forward."""

    def __init__(self, backend: Backend, handle: Any) -> None:
        super().__init__()
        self.module = backend.torch_module(handle)
        # Plain attributes, not submodules: the handle may be the module itself.
        object.__setattr__(self, "_call", (backend, handle))

    def forward(self, x, m_splits, is_first_microbatch):
        backend, handle = self._call
        return backend.forward(handle, x, m_splits, is_first_microbatch)
