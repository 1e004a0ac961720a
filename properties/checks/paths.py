"""Fast paths that are the default only on a GPU, forced on the CPU (docs/harness.md, "forced
fast paths"): :class:`ForcedPathBackend` sets the implementation's own knob on every module it
builds and counts the aten operator only the path calls, and :func:`forced_path_error` makes a
cell in which it never ran an error, not a pass. Each path's limits are its kernel's:
``torch._grouped_mm`` takes no float64 and wants 16-byte rows (drawn so by construction), the
CPU's ``torch._scaled_mm`` refuses the block-scaled recipes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import torch

from ..backends import Backend, BackendUnavailable
from ..cases.case import KINDS, RECIPE_FAMILIES, Case, MicroBatch, ModuleConfig
from ..cases.data import make_micro_batches, make_state


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
            KINDS,
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


def _inner(name: str, counted: bool = False) -> Callable[..., Any]:
    """A :class:`ForcedPathBackend` method that calls the inner backend's ``name`` (counting
    the path's operator while it runs when ``counted``)."""

    def method(self: ForcedPathBackend, *args: Any, **kwargs: Any) -> Any:
        counting = counted and self.path.operator is not None
        with _OperatorCounter(self) if counting else contextlib.nullcontext():
            return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


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
        self._warmed: set[tuple[str, str | None, str]] = set()

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
            sizes = (2, 8, 8) if kind == "GroupedLinear" else (8, 8)
            probe = cls(*sizes, delay_wgrad_compute=False)
        except Exception as exc:
            return f"cannot build a {kind} to look for its {self.path.attribute}: {exc!r}"
        if not hasattr(probe, self.path.attribute):
            return (
                f"{kind} has no {self.path.attribute} attribute: the {self.path.name} path "
                "cannot be forced"
            )
        return None

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

    def p12_bitwise(self, config: ModuleConfig) -> bool:
        # Linears never take the grouped kernel: P12 is then a budget, not bitwise.
        return self.path.name != "grouped" and self.inner.p12_bitwise(config)

    def _warm_up(self, config: ModuleConfig) -> None:
        """One forward and backward on the path outside the counter, once per recipe kind: an
        implementation may probe the fast kernel on first use (impl's ``scaled_mm_works``), and
        the probe's own calls must not count as the path having run."""
        key = (config.kind, config.recipe, config.dtype)
        if key in self._warmed or self.path.operator is None:
            return
        self._warmed.add(key)
        module = self.inner.build(config, delay=False)
        setattr(module, self.path.attribute, self.path.value)
        self.inner.load_state(module, make_state(config, 0))
        rows = max(config.alignment, 2)
        grouped = config.kind == "GroupedLinear"
        splits = (rows,) + (0,) * (config.num_gemms - 1) if grouped else None
        (d,) = make_micro_batches(Case(config, (MicroBatch((rows,), splits),), 0))
        x = d.fresh_input()
        try:
            with self.inner.fp8_autocast(config):
                y = self.inner.forward(module, x, splits, None)
            self.inner.backward(module, [y], [d.dy])
        except Exception:
            self._warmed.discard(key)  # a real failure shows in the checks themselves

    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        # The warm-up runs real tensors: not while torch's default device is meta (P18 builds
        # a module there with an explicit device, and runs nothing). Its module's initial
        # values come from torch's global RNG, which the caller may have just seeded (P18's
        # reset_parameters check): drawn on a fork of it.
        if self.path.applies(config.kind) and torch.get_default_device().type != "meta":
            device = torch.device(config.device)
            cuda = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
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

    # Everything else is the inner backend's; the calls that run the module count the operator.
    unavailable_reason = _inner("unavailable_reason")
    missing_api = _inner("missing_api")
    deviation_for = _inner("deviation_for")
    module_protocol_reason = _inner("module_protocol_reason")
    reset_parameters = _inner("reset_parameters")
    to_empty = _inner("to_empty")
    parameters = _inner("parameters")
    load_state = _inner("load_state")
    torch_module = _inner("torch_module")
    parametrize = _inner("parametrize")
    pending_wgrad_count = _inner("pending_wgrad_count")
    register_hook = _inner("register_hook")
    has_hooks = _inner("has_hooks")
    fp8_autocast = _inner("fp8_autocast")
    fp8_state = _inner("fp8_state")
    fp8_quantizer = _inner("fp8_quantizer")
    constructor = _inner("constructor")
    forward = _inner("forward", counted=True)
    backward = _inner("backward", counted=True)
    grad = _inner("grad", counted=True)
    backward_dw = _inner("backward_dw", counted=True)

    @property
    def lib(self) -> Any:
        return getattr(self.inner, "lib", None)


def forced_path_error(backend: Backend, calls_before: int, examples: int) -> str | None:
    """The message for a cell of ``examples`` examples in which ``backend``'s forced path never
    called its operator (``None``: it ran, or nothing to check)."""
    forced = isinstance(backend, ForcedPathBackend) and backend.path.operator is not None
    if not forced or examples == 0 or backend.operator_calls > calls_before:
        return None
    return (
        f"forced path {backend.path.name!r} never ran: {examples} example(s) and no call of "
        f"{backend.path.operator} (the implementation fell back to another path; the cell "
        "checked nothing of the path it was meant to)"
    )
