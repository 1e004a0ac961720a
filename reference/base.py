"""What every reference module shares: where gradients go (SPEC §3) and the wgrad queue (§4), on
top of the contract of :mod:`.contract` (options, parameters, input validation, §5 errors).

Contract, as code states it below:

Where each gradient goes (§3), decided by the Function's own autograd edges
  * The gradient belongs to the tensor the forward was given, never to whatever the module's
    attribute holds when backward runs (``torch.func.functional_call`` substitutes tensors and
    restores the originals before backward). Each parameter input's autograd edge tells
    (:func:`param_targets`): a leaf that the running backward accumulates (:data:`ACCUMULATE`:
    the module's ``Parameter`` or a substituted leaf) is written by the module, by the rules
    below, now or at ``backward_dw()``; a leaf that ``torch.autograd.grad`` captures, or a weight
    that is not a leaf (``torch.nn.utils.parametrize``, a weight computed from another tensor),
    gets its gradient *returned* through autograd during backward (:data:`RETURN`), exactly as
    without delay: nothing is written, nothing queued, no module hook fires. Only leaves can be
    deferred. A parameter the running backward does not compute (``backward(inputs=[...])``
    without it) gets nothing at all (no entry when no GEMM parameter is asked for).
  * Plain (``fuse_wgrad_accumulation=False``): the module writes a leaf's gradient as autograd's
    accumulator does (:mod:`.accumulate`): the leaf's tensor hooks see it and may replace it,
    ``.grad`` is set when ``None`` and accumulated with ``+=`` otherwise, then the leaf's
    post-accumulate hooks run — in ``backward()``, or in ``backward_dw()`` under delay (never in
    ``backward()`` then). Biases and norm parameters always use ``.grad``; norm parameters are
    returned through autograd.
  * Fused: every GEMM weight the module writes must be a leaf carrying ``main_grad`` (same shape
    and device; float32, or float64 when the parameters are float64) and no tensor hook. Its
    gradient is accumulated in fp32 into ``main_grad``; ``weight.grad`` stays ``None``. If the
    forward of that micro-batch got ``is_first_microbatch=True`` the contribution overwrites
    ``main_grad``. If the weight has an attribute ``grad_added_to_main_grad`` it is set to
    ``True`` afterwards; its post-accumulate hooks then run. A non-leaf weight under fused
    accumulation is refused by the forward. ``is_first_microbatch`` changes nothing in plain mode.

Split backward (§4, ``delay_wgrad_compute=True``)
  * ``backward()`` writes input and norm-parameter gradients only. The GEMM-parameter work of one
    backward of one module becomes one queue entry (a closure over the saved operands), appended
    to this module's own FIFO queue. A module applied twice queues two entries.
  * ``backward_dw()`` runs the oldest entry, writes its gradients by the rules above, calls the
    registered hooks once each in registration order with no arguments, and drops the entry.
  * Without delay the same closure runs inside ``backward()``, followed by the same hooks: both
    modes execute the same instructions, so their gradients are bitwise identical.
  * ``backward_dw()`` with an empty queue raises ``RuntimeError``; on a module built without
    delay it does nothing.
  * An optimizer step over a parameter that a queued entry will still write raises
    ``RuntimeError`` naming the module, the parameter and the count, and changes nothing (the
    optimizer guard, :mod:`.pending`; the module tells it when its queue becomes non-empty and
    empty again).
  * Computing an entry's gradients includes running the leaves' tensor hooks on them. If that
    raises, nothing is written and the entry stays at the head of the queue. If a
    post-accumulate hook or a module hook raises, the gradients are written, the entry is
    consumed, and the exception propagates (the remaining hooks do not run).
  * Deferred parameters carry ``skip_backward_post_hook = True``; frozen parameters are skipped
    and a backward in which no GEMM parameter needs a gradient queues nothing.
  * ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises ``ValueError`` in the
    constructor (an exception, so it holds under ``python -O``); without delay it is accepted and
    changes no result in one process.

Double backward and ``torch.func`` (§2)
  * A backward that runs with grad mode on (``create_graph=True``, or a ``torch.func``
    transform) differentiates the hand-written backward itself: the forward's intermediates are
    recomputed from the saved inputs so that every formula is on the graph. A gradient the module
    writes then carries its graph as autograd's would. Deferring it is impossible (``RuntimeError``
    naming the module: build it without delay, or ask ``torch.autograd.grad`` for the gradients),
    and FP8 GEMMs are not differentiable twice (``RuntimeError``).
  * Forward-mode AD (``torch.func.jvp``, ``jacfwd``, ``hessian``) raises ``RuntimeError`` naming
    the module. ``torch.func.vmap`` works through autograd's generated vmap rule, except under
    FP8 (``RuntimeError``).

Distributed (§8)
  * Inside the forward of torch's ``DistributedDataParallel``, a module with delay or fused
    accumulation raises ``RuntimeError`` (:func:`.contract.check_not_under_ddp`): DDP's
    reduction hooks run before such gradients exist, so they would stay unreduced.

Options, parameters, input validation and the error messages of §4–§5 are the contract both
packages share; they are stated in :mod:`.contract`, on which this base builds.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import torch

from . import accumulate as acc
from . import functional as F
from . import pending
from .collectives import operand
from .contract import (
    ACCUMULATE,
    RETURN,
    ModuleContract,
    autocast_off,
    check_not_under_ddp,
    gradient_destination,
    gradient_destinations,
)
from .fp8_gemm import FP8Gemm
from .routing import (
    Target,
    differentiated,
    param_targets,
    qualified_name,
    remember_params,
    route_differentiable,
)

__all__ = [
    "Target",
    "param_targets",
    "remember_params",
    "GradWrite",
    "WgradEntry",
    "SplitBackwardModule",
    "no_forward_ad",
    "ACCUMULATE",
    "RETURN",
    "gradient_destination",
    "gradient_destinations",
    "check_not_under_ddp",
]


@dataclasses.dataclass
class GradWrite:
    """One gradient to write: ``value`` goes to ``target.leaf.main_grad`` if ``to_main_grad``,
    else to ``target.leaf.grad`` by autograd's rules. ``own``: no tensor hook has seen ``value``
    (it may become ``.grad`` without a copy)."""

    target: Target
    value: torch.Tensor
    to_main_grad: bool
    own: bool = True
    overwrite: bool = False


@dataclasses.dataclass
class WgradEntry:
    """One queued unit of weight-gradient work (one module, one backward).

    ``wgrad_closure()`` computes and returns the :class:`GradWrite` list without writing anything;
    ``overwrite_main_grad`` is the ``is_first_microbatch`` flag of that micro-batch's forward
    under fused accumulation; ``targets``: the :class:`Target` of every gradient it writes (what
    the optimizer guard reads, :mod:`.pending`).
    """

    wgrad_closure: Callable[[], list[GradWrite]]
    overwrite_main_grad: bool
    targets: tuple[Target, ...] = ()


def detached(tensors) -> list[torch.Tensor | None]:
    """Saved tensors without their autograd history (``None`` stays ``None``)."""
    return [None if t is None else t.detach() for t in tensors]


def no_forward_ad(ctx, *tangents):
    """The ``jvp`` of every reference Function: forward-mode AD is not supported."""
    raise RuntimeError(
        f"{qualified_name(ctx.module)} does not support forward-mode AD (torch.func.jvp, "
        "jacfwd, hessian, torch.autograd.forward_ad)"
    )


class SplitBackwardModule(ModuleContract):
    """Base of the four reference modules: the queue, hooks and gradient routing on top of the
    shared contract (options, parameters, validation: :class:`.contract.ModuleContract`)."""

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._wgrad_queue: collections.deque[WgradEntry] = collections.deque()

    # ---- the queue (§4) -----------------------------------------------------------------

    @property
    def pending_wgrad_count(self) -> int:
        """How many weight-gradient entries wait for :meth:`backward_dw`."""
        return len(self._wgrad_queue)

    def backward_dw(self) -> None:
        """Run the oldest queued weight-gradient entry (FIFO). See the module docstring."""
        if not self.delay_wgrad_compute:
            return
        if not self._wgrad_queue:
            raise self._nothing_pending()
        entry = self._wgrad_queue[0]
        writes = self._compute(entry)  # raises -> entry stays at the head, nothing written
        self._wgrad_queue.popleft()
        if not self._wgrad_queue:
            pending.drained(self)
        del entry
        self._write(writes)
        self._run_post_accumulate_hooks(writes)
        del writes
        self._run_hooks()

    def _pending_writes(self) -> list[tuple[tuple[str, torch.Tensor], ...]]:
        """For each queued entry, oldest first, the ``(name, leaf)`` pairs it will write (read by
        the optimizer guard, :mod:`.pending`)."""
        return [tuple((t.name, t.leaf) for t in entry.targets) for entry in self._wgrad_queue]

    def _submit_wgrad(self, entry: WgradEntry) -> None:
        """Called from the autograd backward: queue the entry, or run it now."""
        if self.delay_wgrad_compute:
            if not self._wgrad_queue:
                pending.queued(self)
            self._wgrad_queue.append(entry)
            return
        writes = self._compute(entry)
        self._write(writes)
        self._run_hooks()

    def _compute(self, entry: WgradEntry) -> list[GradWrite]:
        """The entry's gradients, after the tensor hooks of the leaves they go to (step 1 of
        autograd's accumulation, for every gradient before any is written)."""
        with torch.no_grad(), autocast_off(self.fp8_device.type):
            writes = entry.wgrad_closure()
            for w in writes:
                w.overwrite = entry.overwrite_main_grad
                if not w.to_main_grad and acc.has_hooks(w.target.leaf):
                    w.value = acc.apply_tensor_hooks(w.target.leaf, w.value, w.target.where)
                    w.own = False
            return writes

    @staticmethod
    def _write(writes: list[GradWrite]) -> None:
        """Store every gradient (step 2 of autograd's accumulation). Without delay, autograd's
        own call on each leaf, which follows this backward, runs its post-accumulate hooks."""
        for w in writes:
            leaf = w.target.leaf
            if w.to_main_grad:
                with torch.no_grad():
                    if w.overwrite:
                        leaf.main_grad.copy_(w.value)
                    else:
                        leaf.main_grad.add_(w.value)
                if hasattr(leaf, "grad_added_to_main_grad"):
                    leaf.grad_added_to_main_grad = True
            else:
                acc.accumulate(leaf, w.value, own=w.own)

    @staticmethod
    def _run_post_accumulate_hooks(writes: list[GradWrite]) -> None:
        """Step 3 for a deferred entry: each written leaf's post-accumulate hooks, once."""
        for leaf in {id(w.target.leaf): w.target.leaf for w in writes}.values():
            acc.run_post_accumulate_hooks(leaf)

    # ---- helpers for the Functions ----------------------------------------------------------

    def _route(self, ctx) -> tuple[object, list[Target]]:
        """``(fp8, targets)`` at the start of every backward, before anything is computed,
        written or queued: the FP8 GEMM state the forward left on ``ctx`` (``None`` without
        FP8), handed over (from here on the queued entry, not the autograd graph, keeps the
        quantized copies alive), and the :class:`Target` of each parameter input
        (:mod:`.routing`). A backward with grad mode on (``create_graph=True``, a ``torch.func``
        transform) is differentiated itself (:func:`.routing.route_differentiable`). The leaves
        the module writes get their hooks muted for autograd's call without a gradient
        (:func:`.accumulate.mute_empty_calls`)."""
        fp8, ctx.fp8 = ctx.fp8, None
        targets = param_targets(ctx, self)
        if differentiated():
            targets = route_differentiable(self, targets, fp8 is not None)
        weights = set(self.gemm_weight_names())
        self._begin_wgrad([t for t in targets if t.written and t.name in weights])
        for t in targets:
            if t.written and t.gemm and acc.has_hooks(t.leaf):
                acc.mute_empty_calls(t.leaf, deferred=self.delay_wgrad_compute)
        return fp8, targets

    def _begin_wgrad(self, weights: Sequence[Target]) -> None:
        """First step of every backward and of every wgrad closure: under fused accumulation,
        each written GEMM weight needs a usable ``main_grad`` and no tensor hook."""
        self._check_main_grads([(t.name, t.leaf) for t in weights])

    def _submit_gemm_wgrads(self, gemms: Sequence[tuple], overwrite: bool) -> None:
        """Queue (or, without delay, run now) the one wgrad entry of a backward: for each GEMM
        ``(to_w, to_b, dy, x, fp8)`` in order, ``dW = dy^T x`` to the weight's target and
        ``db = sum(dy)`` to the bias's (``None``: no bias), each where the module writes it
        (:attr:`Target.written`); no entry when it writes none. ``overwrite``: the
        ``is_first_microbatch`` flag of the forward, under fused accumulation. Under tensor
        parallelism (SPEC §9) a GEMM may carry a sixth item, the ``dy`` its bias gradient sums
        (a row layer's local ``dy``, when ``dy`` is the gathered one), and ``dy`` or ``x`` may
        be a :class:`.collectives.GatherInW` shard, gathered when the entry runs."""
        weights = [to_w for to_w, *_ in gemms if to_w.written]
        biases = [to_b for _, to_b, *_ in gemms if to_b is not None and to_b.written]
        if not weights and not biases:
            return

        def wgrad_closure():
            self._begin_wgrad(weights)
            writes = []
            for to_w, to_b, dy, x, fp8, *bias_dy in gemms:
                if to_w.written:
                    dy_w, x_w = operand(dy, self), operand(x, self)
                    writes.append(self._weight_write(to_w, dy_w, x_w, fp8))
                if to_b is not None and to_b.written:
                    writes.append(self._bias_write(to_b, bias_dy[0] if bias_dy else dy))
            return writes

        self._submit_wgrad(WgradEntry(wgrad_closure, overwrite, (*weights, *biases)))

    def _weight_write(
        self,
        target: Target,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> GradWrite:
        """The gradient of one GEMM weight: ``dy^T x`` in the parameter dtype (plain), or with
        both operands upcast to ``main_grad``'s dtype (fused). Under FP8 the GEMM runs on the
        quantized column-wise copies that ``fp8`` holds (dy and x are then unused)."""
        fused = self.fuse_wgrad_accumulation
        leaf = target.leaf
        if fp8 is not None:
            out_dtype = leaf.main_grad.dtype if fused else leaf.dtype
            return GradWrite(target, fp8.wgrad(out_dtype, self), fused)
        if fused:
            return GradWrite(target, F.linear_wgrad_fp32(dy, x, leaf.main_grad.dtype), True)
        return GradWrite(target, F.linear_wgrad(dy, x), False)

    def _returned_weight_grad(
        self,
        target: Target,
        dtype: torch.dtype,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> torch.Tensor | None:
        """``dy^T x`` in ``dtype`` (the weight's), for a weight whose gradient is returned
        through autograd (:data:`RETURN`): the plain-mode formula, never ``main_grad``."""
        if not target.returned:
            return None
        if fp8 is not None:
            return fp8.wgrad(dtype, self)
        return F.linear_wgrad(operand(dy, self), operand(x, self))

    def _bias_write(self, target: Target, dy: torch.Tensor) -> GradWrite:
        """The gradient of one GEMM bias, always to ``.grad``."""
        return GradWrite(target, F.bias_grad(dy), False)

    @staticmethod
    def _returned_bias_grad(target: Target, dy: torch.Tensor) -> torch.Tensor | None:
        return F.bias_grad(dy) if target.returned else None
