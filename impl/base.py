"""What every impl module shares on top of the contract
(:class:`splitgrad.reference.contract.ModuleContract`: options, parameters, validation, §5
errors): gradient routing (SPEC §3), the queue and its hooks (§4), and
``backward_dw(stream=None)``.

Each autograd Function builds one wgrad closure per backward that writes every GEMM-parameter
gradient itself (the Function returns ``None`` for them, in both modes). Without delay the
closure runs inside backward; with delay it is queued as a :class:`~.store.WgradEntry`. It is the
same closure either way, so delayed and non-delayed execute the same instructions and their
gradients are bitwise identical on any device (tied weights included: autograd never sums two
uses). Hooks fire after each entry's gradients are written: in :meth:`backward_dw` under delay,
at the end of the module's backward otherwise (GEMM gradients never reach autograd's
AccumulateGrad, so these hooks are the only signal a data-parallel wrapper gets).

Per-call cost (``splitgrad bench``, small-shape rows): a Function's backward learns where each
parameter's gradient goes from its own autograd edges (``ctx.next_functions``, one engine query
per parameter) instead of building a gradient edge per parameter, and without delay the closure
runs directly, with no entry object and no grad-mode switch (a backward already runs without
grad). Under ``torch.compile`` the backward runs through :mod:`.compiled`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from splitgrad.reference.contract import (
    ModuleContract,
    autocast_off,
    node_destination,
    without_autocast,
)

from . import compiled, gemm
from .fp8 import Float8Tensor
from .fp8_gemm import fp8_wgrad_write, pack, unpack
from .store import WeightGradStore, WgradEntry

__all__ = [
    "SplitBackwardModule",
    "FP8WgradPart",
    "autocast_cast",
    "autocast_off",
    "edge_destinations",
    "fast_apply",
    "take_fp8",
    "without_autocast",
]


def autocast_cast(dtype: torch.dtype | None, *tensors: torch.Tensor | None) -> tuple:
    """``tensors`` cast to ``dtype`` for a GEMM under ``torch.autocast`` (SPEC §2; ``None``
    stays ``None``); unchanged when ``dtype`` is ``None`` (no autocast). Called inside a
    Function's forward, so the casts are plain tensors, not autograd nodes: each parameter
    keeps its own gradient edge."""
    if dtype is None:
        return tensors
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def edge_destinations(ctx, present: Sequence[bool]) -> list[str | None]:
    """Where the running backward wants the gradients of the Function's parameters: the inputs
    after ``x``, ``present[i]`` telling whether parameter ``i`` was a tensor (``None``, e.g. no
    bias, has no autograd edge). Each is
    :func:`~splitgrad.reference.contract.node_destination` of that input's autograd edge (the
    same node ``torch.autograd.graph.get_gradient_edge`` finds, without building a view to find
    it). Call it inside the Function's backward."""
    edges = ctx.next_functions
    out: list[str | None] = []
    i = 1  # edge 0 is x
    for is_tensor in present:
        if is_tensor:
            out.append(node_destination(edges[i][0]))
            i += 1
        else:
            out.append(None)
    return out


def take_fp8(ctx) -> tuple[torch.nn.Module, object]:
    """``(module, FP8 operands)`` that an FP8 Function's forward left on ``ctx``, handed over:
    from here on the queued entry, not the autograd graph, keeps the quantized copies alive
    (so ``backward_dw()`` is what frees them)."""
    fp8, ctx.fp8 = ctx.fp8, None
    return ctx.module, fp8


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def fast_apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """``function.apply`` for impl's Functions, whose first argument is the input and the rest
    are parameters and plain values. Eagerly it calls autograd's C++ ``apply`` directly: the
    Python wrapper's per-call work (default-argument binding, a dead-functorch-wrapper check on
    every tensor argument: 128 of them in a 64-group ``GroupedLinear``) costs more than the
    Function itself at small shapes; only the input can be such a wrapper. Under
    ``torch.compile`` and functorch transforms it is ``function.apply``."""
    c_apply = _C_APPLY.__get__(None, function)

    def apply(x: torch.Tensor, *args) -> torch.Tensor:
        if torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active():
            if not compiled.SUPPORTED and torch.compiler.is_compiling():
                compiled.check_supported()
            return function.apply(x, *args)
        return c_apply(_unwrap_if_dead(x), *args)

    return apply


_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


@dataclasses.dataclass
class FP8WgradPart:
    """One FP8 GEMM's share of a wgrad entry: ``weight`` gets ``q(dy)^T q(x)`` (None: frozen),
    ``bias`` gets ``db`` (None: no bias or frozen), summed from the unquantized dy in backward."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    dy: Float8Tensor | None
    x: Float8Tensor | None
    db: torch.Tensor | None


class SplitBackwardModule(ModuleContract):
    """Base of the four impl modules."""

    #: How FP8 GEMMs run: ``"auto"``, ``"scaled_mm"`` or ``"dequantize"`` (see :mod:`.fp8_gemm`).
    fp8_gemm: str = "auto"

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._wgrad_store = WeightGradStore()
        # Names this module to the opaque ops of a compiled backward (see .compiled).
        self._handle = compiled.register(self)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and unpickling rebuild a module from its state: the copy gets a handle
        # of its own, or a compiled backward of the copy would write the original's gradients.
        super().__setstate__(state)
        self._handle = compiled.register(self)

    # ---- gradient routing (§3) ------------------------------------------------------------

    def _write_weight_grad(
        self, param: torch.nn.Parameter, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
    ) -> None:
        """Write ``dy^T x`` to ``param.main_grad`` (fused) or ``param.grad`` (plain)."""
        if self.fuse_wgrad_accumulation:
            gemm.wgrad_into_main_grad_(param.main_grad, dy, x, overwrite)
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
        elif param.grad is None:
            param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))
        else:
            gemm.wgrad_accumulate_(param.grad, dy, x)

    @classmethod
    def _write_bias_grad(cls, param: torch.nn.Parameter, dy: torch.Tensor) -> None:
        """Write ``sum over rows of dy`` to ``param.grad`` (biases never use ``main_grad``)."""
        cls._write_bias_value(param, dy.sum(dim=0))

    @staticmethod
    def _write_bias_value(param: torch.nn.Parameter, db: torch.Tensor) -> None:
        """Set or accumulate an already reduced bias gradient into ``param.grad``."""
        if param.grad is None:
            param.grad = _in_dtype_of(param, db)
        else:
            param.grad.add_(db)

    def _submit_fp8_wgrad(
        self,
        parts: Sequence[FP8WgradPart],
        named_weights: Sequence[tuple[str, torch.nn.Parameter]],
        overwrite: bool,
    ) -> None:
        """Queue (or run) one entry that writes every part's weight and bias gradient, in order.

        The entry holds each part's two column-wise FP8 copies with their ``scale_inv`` and its
        reduced bias gradient; the closure captures layouts and parameters, no tensor."""
        quantized = []
        for part in parts:
            keep = part.weight is not None
            quantized += [part.dy if keep else None, part.x if keep else None]
        tensors, layouts = pack(*quantized)
        dbs = tuple(part.db if part.bias is not None else None for part in parts)
        targets = [(part.weight, part.bias) for part in parts]
        n = len(tensors)

        def wgrad_closure(*saved):
            self._check_main_grads(named_weights)
            operands = unpack(saved[:n], layouts)
            for i, (weight, bias) in enumerate(targets):
                if weight is not None:
                    dy_q, x_q = operands[2 * i], operands[2 * i + 1]
                    fp8_wgrad_write(self, weight, dy_q, x_q, overwrite)
                if bias is not None:
                    self._write_bias_value(bias, saved[n + i])

        params = tuple(p for pair in targets for p in pair if p is not None)
        self._submit_wgrad(wgrad_closure, tensors + dbs, params)

    # ---- the queue (§4) -----------------------------------------------------------------

    @property
    def pending_wgrad_count(self) -> int:
        """How many weight-gradient entries wait for :meth:`backward_dw`."""
        return len(self._wgrad_store)

    def backward_dw(self, stream: torch.cuda.Stream | None = None) -> None:
        """Run the oldest queued weight-gradient entry (FIFO), then the hooks.

        No-op on a module built without delay; ``RuntimeError`` when nothing is pending. If the
        wgrad raises, nothing is written and the entry stays at the head of the queue; if a hook
        raises, the gradients are written, the entry is consumed and the error propagates.

        ``stream`` (CUDA only; ignored on CPU): run the wgrad GEMMs on this side stream so they
        overlap work already queued on the current stream (e.g. an all-to-all). The side stream
        first waits for the current stream (the operands are produced there); afterwards the
        current stream waits for the side stream, so whatever is queued *after* this call
        (hooks, optimizer) sees the gradients while work queued *before* it still overlaps.
        The entry's tensors are ``record_stream``-ed so the caching allocator does not hand
        their memory to the current stream while the side stream may still read them.
        """
        if not self.delay_wgrad_compute:
            return
        if not len(self._wgrad_store):
            raise self._nothing_pending()
        entry = self._wgrad_store.head()
        # With torch.autocast off: the entry computes what the non-delayed backward would have
        # (its backward runs with autocast off too), whatever context the caller is in.
        with autocast_off(self.fp8_device.type):
            if stream is not None and _on_cuda(entry):
                _run_on_side_stream(entry, stream)
            else:
                entry.run()  # raises -> the entry stays at the head, nothing written
        self._wgrad_store.pop_and_release()
        del entry
        self._run_hooks()

    def _submit_wgrad(
        self,
        closure: Callable[..., None],
        saved: tuple[torch.Tensor | None, ...],
        params: tuple[torch.nn.Parameter, ...],
        own_copies: bool = False,
    ) -> None:
        """Called at the end of the autograd backward: queue ``closure(*saved)`` as an entry
        writing ``params``, or run it now (then the hooks). ``own_copies``: the entry keeps
        copies of ``saved`` (a compiled backward, see :mod:`.compiled`)."""
        if self.delay_wgrad_compute:
            if own_copies:
                saved = tuple(None if t is None else t.clone() for t in saved)
            self._wgrad_store.push(WgradEntry(closure, saved, params))
            return
        if torch.is_grad_enabled():  # backward(create_graph=True)
            with torch.no_grad():
                closure(*saved)
        else:
            closure(*saved)
        if self._wgrad_hooks:
            self._run_hooks()


def _in_dtype_of(param: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as ``param``'s gradient: under torch.autocast a GEMM's result comes in the
    autocast dtype, and a parameter's gradient is in the parameter's dtype (SPEC §2)."""
    return grad if grad.dtype == param.dtype else grad.to(param.dtype)


def _on_cuda(entry: WgradEntry) -> bool:
    return any(t is not None and t.is_cuda for t in entry.saved)


def _run_on_side_stream(entry: WgradEntry, stream: torch.cuda.Stream) -> None:
    """Run ``entry`` on ``stream`` with the event waits and allocator bookkeeping it needs."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        entry.run()
    for t in entry.saved:
        if t is not None and t.is_cuda:
            t.record_stream(stream)
    for p in entry.params:
        # A .grad first created inside the side-stream block belongs to that stream's pool;
        # it is read on the current stream from now on.
        if p.grad is not None and p.grad.is_cuda:
            p.grad.record_stream(main)
    main.wait_stream(stream)
