"""Fast paths that are the default only on a GPU, forced on the CPU and fuzzed there.

An implementation may dispatch between a portable path and a fast one (SPEC leaves that to it);
on a CPU-only CI the fast path is never taken by default, so a bug in it would pass every
check. Where the fast path also *runs* on the CPU, :class:`ForcedPathBackend` forces it through
the implementation's own knob (impl's: ``GroupedLinear.grouped_gemm``,
``SplitBackwardModule.fp8_gemm``, ``LayerNormMLP.recompute_activation``) on every module it
builds, and the same strategies and checks run against it (``splitgrad verify --impl-path
grouped``; the default run and the pytest plugin include a slice of each).

Forcing is only worth something if the path really runs: each path names the aten operator only
it calls, and the backend counts those calls (a ``TorchDispatchMode`` around every forward and
backward); a cell in which the forced path never ran is an error, not a pass
(:func:`forced_path_error`). Shapes the fast path needs are drawn by construction
(``size_multiple``: ``torch._grouped_mm`` wants 16-byte rows).

Paths:

* ``grouped``: ``GroupedLinear.grouped_gemm = "grouped"`` — forward and dgrad as one
  ``torch._grouped_mm`` (default on sm90 CUDA in bf16). High precision, not float64 (the
  operator takes fp32/bf16/fp16 only).
* ``scaled_mm``: ``fp8_gemm = "scaled_mm"`` — FP8 GEMMs through ``torch._scaled_mm`` (default
  on CUDA). Per-tensor recipes (delayed and current scaling): the CPU refuses the block-scaled
  kinds.
* ``recompute``: ``LayerNormMLP.recompute_activation = True`` — the activation recomputed in
  backward instead of kept from the forward (a memory knob, off by default).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from ..backends import Backend, BackendUnavailable
from ..cases.case import RECIPE_FAMILIES, Case, ModuleConfig

__all__ = ["ImplPath", "IMPL_PATHS", "ForcedPathBackend", "forced_path_error"]


@dataclasses.dataclass(frozen=True)
class ImplPath:
    """One forced fast path: the module attribute that selects it and its value, the module
    kinds it applies to, the FP8 recipe names it runs under (``None``: high precision only),
    the dtypes, the feature-size multiple it needs and the aten operator only it calls."""

    name: str
    summary: str
    attribute: str
    value: Any
    kinds: tuple[str, ...]
    recipes: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
    size_multiple: int = 1
    operator: str | None = None

    def applies(self, kind: str) -> bool:
        return kind in self.kinds


_KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
IMPL_PATHS: dict[str, ImplPath] = {
    p.name: p
    for p in (
        ImplPath(
            "grouped",
            "GroupedLinear forward and dgrad as one torch._grouped_mm",
            "grouped_gemm",
            "grouped",
            ("GroupedLinear",),
            dtypes=("float32", "bfloat16", "float16"),
            size_multiple=8,
            operator="aten::_grouped_mm",
        ),
        ImplPath(
            "scaled_mm",
            "FP8 GEMMs through torch._scaled_mm (per-tensor recipes)",
            "fp8_gemm",
            "scaled_mm",
            _KINDS,
            recipes=RECIPE_FAMILIES["delayed"] + RECIPE_FAMILIES["current"],
            dtypes=("float32", "bfloat16", "float16"),
            operator="aten::_scaled_mm",
        ),
        ImplPath(
            "recompute",
            "LayerNormMLP recomputes its activation in backward",
            "recompute_activation",
            True,
            ("LayerNormMLP",),
        ),
    )
}


class _OperatorCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts calls of one aten operator; changes nothing else."""

    def __init__(self, owner: ForcedPathBackend) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == self.owner.path.operator:
            self.owner.operator_calls += 1
        return func(*args, **(kwargs or {}))


class ForcedPathBackend(Backend):
    """``inner`` (a library backend with impl's knobs) with ``path`` forced on every module it
    builds. Everything else is delegated; :attr:`operator_calls` counts the path's operator."""

    def __init__(self, inner: Backend, path: str) -> None:
        if path not in IMPL_PATHS:
            raise ValueError(f"unknown impl path {path!r}; expected one of {', '.join(IMPL_PATHS)}")
        self.inner = inner
        self.path = IMPL_PATHS[path]
        self.name = inner.name
        self.supports_fused = inner.supports_fused
        self.deviations = inner.deviations
        self.notes = (*inner.notes, f"forced path {path}: {self.path.summary}")
        self.operator_calls = 0

    # ---- what is forced where ---------------------------------------------------------------

    def knob_missing(self, kind: str) -> str | None:
        """Why ``kind``'s modules cannot be forced onto the path (no such attribute)."""
        try:
            lib = getattr(self.inner, "lib", None)
        except BackendUnavailable:
            lib = None
        if lib is None:
            return (
                f"{self.inner.name} is an adapter, not a module library with a "
                f"{self.path.attribute} knob"
            )
        cls = getattr(lib, kind, None)
        if cls is None:
            return f"{self.inner.name} has no {kind}"
        try:
            probe = (
                cls(2, 8, 8, delay_wgrad_compute=False)
                if kind == "GroupedLinear"
                else cls(8, 8, delay_wgrad_compute=False)
            )
        except Exception as exc:
            return f"cannot build a {kind} to look for its {self.path.attribute}: {exc!r}"
        if not hasattr(probe, self.path.attribute):
            return (
                f"{kind} has no {self.path.attribute} attribute: the {self.path.name} path "
                "cannot be forced"
            )
        return None

    def unavailable_reason(self) -> str | None:
        return self.inner.unavailable_reason()

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if not self.path.applies(config.kind):
            return f"the {self.path.name} path does not apply to {config.kind}"
        if config.dtype not in self.path.dtypes:
            return f"the {self.path.name} path does not run in {config.dtype}"
        if self.path.recipes is not None and config.recipe is None:
            return f"the {self.path.name} path runs under FP8 recipes only"
        if self.path.recipes is None and config.recipe is not None:
            return f"the {self.path.name} path runs in high precision only"
        why = self.knob_missing(config.kind)
        return why or self.inner.unsupported_reason(property_id, config)

    def cli_args(self) -> list[str]:
        return [*self.inner.cli_args(), "--impl-path", self.path.name]

    def missing_api(self) -> dict[str, str]:
        return self.inner.missing_api()

    def deviation_for(self, property_id: str, case: Case, message: str = ""):
        return self.inner.deviation_for(property_id, case, message)

    def p12_bitwise(self, config: ModuleConfig) -> bool:
        # Linears never take the grouped kernel: P12 is then a budget, not bitwise.
        return self.path.name != "grouped" and self.inner.p12_bitwise(config)

    # ---- building and running (delegated, counting the path's operator) -------------------

    def _counting(self) -> contextlib.AbstractContextManager:
        if self.path.operator is None:
            return contextlib.nullcontext()
        return _OperatorCounter(self)

    def _warm_up(self, config: ModuleConfig) -> None:
        """One forward and backward on the path outside the counter, once per recipe kind: an
        implementation may probe the fast kernel on first use (impl's ``scaled_mm_works``), and
        the probe's own calls must not count as the path having run."""
        key = (config.kind, config.recipe, config.dtype)
        warmed = self.__dict__.setdefault("_warmed", set())
        if key in warmed or self.path.operator is None:
            return
        warmed.add(key)
        from ..cases.case import Case, MicroBatch
        from ..cases.data import make_micro_batches, make_state

        module = self.inner.build(config, delay=False)
        setattr(module, self.path.attribute, self.path.value)
        self.inner.load_state(module, make_state(config, 0))
        rows = max(config.alignment, 2)
        splits = None
        if config.kind == "GroupedLinear":
            splits = (rows,) + (0,) * (config.num_gemms - 1)
        (d,) = make_micro_batches(Case(config, (MicroBatch((rows,), splits),), 0))
        x = d.fresh_input()
        try:
            with self.inner.fp8_autocast(config):
                y = self.inner.forward(module, x, splits, None)
            self.inner.backward(module, [y], [d.dy])
        except Exception:
            warmed.discard(key)  # a real failure shows in the checks themselves

    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        # The warm-up runs real tensors: not while torch's default device is meta (P18 builds
        # a module there with an explicit device, and runs nothing). Its module's initial
        # values come from torch's global RNG, which the caller may have just seeded (P18's
        # reset_parameters check): drawn on a fork of it.
        if self.path.applies(config.kind) and torch.get_default_device().type != "meta":
            device = torch.device(config.device)
            with torch.random.fork_rng(
                devices=[device.index or 0] if device.type == "cuda" else []
            ):
                self._warm_up(config)
        module = self.inner.build(config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)
        if self.path.applies(config.kind):
            if not hasattr(module, self.path.attribute):
                raise BackendUnavailable(self.knob_missing(config.kind) or "no knob")
            setattr(module, self.path.attribute, self.path.value)
        return module

    def build_with_torch_defaults(
        self, config: ModuleConfig, *, delay: bool, omit: Collection[str]
    ) -> Any:
        module = self.inner.build_with_torch_defaults(config, delay=delay, omit=omit)
        if self.path.applies(config.kind) and hasattr(module, self.path.attribute):
            setattr(module, self.path.attribute, self.path.value)
        return module

    def module_protocol_reason(self) -> str | None:
        return self.inner.module_protocol_reason()

    def reset_parameters(self, module: Any) -> None:
        self.inner.reset_parameters(module)

    def to_empty(self, module: Any, device: str | torch.device) -> None:
        self.inner.to_empty(module, device)

    def parameters(self, module: Any) -> dict[str, torch.nn.Parameter]:
        return self.inner.parameters(module)

    def load_state(self, module: Any, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state(module, state)

    def forward(self, module, x, m_splits, is_first_microbatch):
        with self._counting():
            return self.inner.forward(module, x, m_splits, is_first_microbatch)

    def backward(
        self,
        module,
        outputs,
        grads,
        inputs: Sequence[torch.Tensor] | None = None,
        create_graph: bool = False,
    ):
        kw: dict[str, Any] = {"create_graph": True} if create_graph else {}
        if inputs is not None:
            kw["inputs"] = inputs
        with self._counting():
            return self.inner.backward(module, outputs, grads, **kw)

    def grad(self, module, outputs, grads, inputs, create_graph: bool = False):
        kw = {"create_graph": True} if create_graph else {}
        with self._counting():
            return self.inner.grad(module, outputs, grads, inputs, **kw)

    def torch_module(self, module: Any) -> torch.nn.Module:
        return self.inner.torch_module(module)

    def parametrize(self, module: Any, name: str, parametrization: torch.nn.Module) -> None:
        self.inner.parametrize(module, name, parametrization)

    def backward_dw(self, module: Any) -> None:
        with self._counting():
            self.inner.backward_dw(module)

    def pending_wgrad_count(self, module: Any) -> int:
        return self.inner.pending_wgrad_count(module)

    def register_hook(self, module: Any, fn: Callable[[], None]) -> None:
        self.inner.register_hook(module, fn)

    def has_hooks(self) -> bool:
        return self.inner.has_hooks()

    def fp8_autocast(self, config: ModuleConfig):
        return self.inner.fp8_autocast(config)

    def fp8_state(self, module: Any) -> dict[str, torch.Tensor]:
        return self.inner.fp8_state(module)

    def fp8_quantizer(self) -> Any:
        return self.inner.fp8_quantizer()

    def constructor(self, kind: str) -> Callable[..., Any]:
        return self.inner.constructor(kind)

    def supports_ub_bulk_wgrad(self, kind: str) -> bool:
        return self.inner.supports_ub_bulk_wgrad(kind)

    @property
    def lib(self) -> Any:
        return getattr(self.inner, "lib", None)


def forced_path_error(backend: Backend, calls_before: int, examples: int) -> str | None:
    """The message for a cell of ``examples`` examples in which ``backend``'s forced path never
    called its operator (``None``: it ran, or nothing to check)."""
    if not isinstance(backend, ForcedPathBackend) or backend.path.operator is None:
        return None
    if examples == 0 or backend.operator_calls > calls_before:
        return None
    return (
        f"forced path {backend.path.name!r} never ran: {examples} example(s) and no call of "
        f"{backend.path.operator} (the implementation fell back to another path; the cell "
        "checked nothing of the path it was meant to)"
    )
