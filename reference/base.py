"""What every reference module shares: gradient routing (SPEC §3) and the wgrad queue (§4), on
top of the contract of :mod:`.contract` (options, parameters, input validation, §5 errors).

Contract, as code states it below:

Gradient routing (§3)
  * Plain (``fuse_wgrad_accumulation=False``): like autograd, ``param.grad`` is set when it is
    ``None`` and accumulated with ``+=`` otherwise. Biases and norm parameters always use ``.grad``.
  * Fused: every GEMM weight that needs a gradient must carry ``main_grad`` (same shape and
    device; float32, or float64 when the parameters are float64) before backward. Its gradient is
    accumulated in fp32 into ``main_grad``; ``weight.grad`` stays ``None``. If the forward of that
    micro-batch got ``is_first_microbatch=True`` the contribution overwrites ``main_grad``. If the
    weight has an attribute ``grad_added_to_main_grad`` it is set to ``True`` afterwards.
    ``is_first_microbatch`` changes nothing in plain mode.
  * Only what the backward asks for, as autograd does (:func:`.contract.gradient_destination`): a
    parameter the running backward does not compute — ``backward(inputs=[...])`` without it,
    ``torch.autograd.grad(outputs, inputs)`` without it — gets nothing written and, under
    delay, nothing queued (no entry at all when no GEMM parameter is asked for, and then no
    hook fires). A GEMM parameter that ``torch.autograd.grad`` asks for gets its gradient
    *returned*, computed in the backward in the parameter's dtype, as autograd returns it:
    nothing is written to ``.grad`` or ``main_grad``, nothing queued, no hook fires.

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
  * If computing the entry's gradients raises, nothing is written and the entry stays at the head
    of the queue. If a hook raises, the gradients are written, the entry is consumed, and the
    exception propagates (the remaining hooks do not run).
  * Deferred parameters carry ``skip_backward_post_hook = True``; frozen parameters are skipped
    and a backward in which no GEMM parameter needs a gradient queues nothing.
  * ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises ``ValueError`` in the
    constructor (an exception, so it holds under ``python -O``); without delay it is accepted and
    changes no result in one process.

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

from . import functional as F
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

__all__ = [
    "GradWrite",
    "WgradEntry",
    "SplitBackwardModule",
    "ACCUMULATE",
    "RETURN",
    "gradient_destination",
    "gradient_destinations",
    "check_not_under_ddp",
]


@dataclasses.dataclass
class GradWrite:
    """One gradient to write: ``value`` goes to ``param.main_grad`` if ``to_main_grad``, else to
    ``param.grad``."""

    param: torch.nn.Parameter
    value: torch.Tensor
    to_main_grad: bool


@dataclasses.dataclass
class WgradEntry:
    """One queued unit of weight-gradient work (one module, one backward).

    ``wgrad_closure()`` computes and returns the :class:`GradWrite` list without writing anything;
    ``overwrite_main_grad`` is the ``is_first_microbatch`` flag of that micro-batch's forward
    under fused accumulation.
    """

    wgrad_closure: Callable[[], list[GradWrite]]
    overwrite_main_grad: bool


def detached(tensors) -> list[torch.Tensor | None]:
    """Saved tensors without their autograd history (``None`` stays ``None``)."""
    return [None if t is None else t.detach() for t in tensors]


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
        del entry
        self._write(writes)
        del writes
        self._run_hooks()

    def _submit_wgrad(self, entry: WgradEntry) -> None:
        """Called from the autograd backward: queue the entry, or run it now."""
        if self.delay_wgrad_compute:
            self._wgrad_queue.append(entry)
            return
        writes = self._compute(entry)
        self._write(writes)
        self._run_hooks()

    def _compute(self, entry: WgradEntry) -> list[tuple[GradWrite, bool]]:
        with torch.no_grad(), autocast_off(self.fp8_device.type):
            return [(w, entry.overwrite_main_grad) for w in entry.wgrad_closure()]

    @staticmethod
    def _write(writes: list[tuple[GradWrite, bool]]) -> None:
        with torch.no_grad():
            for w, overwrite in writes:
                p = w.param
                if w.to_main_grad:
                    if overwrite:
                        p.main_grad.copy_(w.value)
                    else:
                        p.main_grad.add_(w.value)
                    if hasattr(p, "grad_added_to_main_grad"):
                        p.grad_added_to_main_grad = True
                elif p.grad is None:
                    # Under torch.autocast a GEMM's gradient comes in the autocast dtype; the
                    # parameter's gradient is in the parameter's dtype (SPEC §2).
                    p.grad = w.value.to(p.dtype)
                else:
                    p.grad += w.value

    # ---- helpers for subclasses -----------------------------------------------------------

    def _weight_write(
        self,
        param: torch.nn.Parameter,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> GradWrite:
        """The gradient of one GEMM weight: ``dy^T x`` in the parameter dtype (plain), or with
        both operands upcast to ``main_grad``'s dtype (fused). Under FP8 the GEMM runs on the
        quantized column-wise copies that ``fp8`` holds (dy and x are then unused)."""
        fused = self.fuse_wgrad_accumulation
        if fp8 is not None:
            out_dtype = param.main_grad.dtype if fused else param.dtype
            return GradWrite(param, fp8.wgrad(out_dtype), fused)
        if fused:
            return GradWrite(param, F.linear_wgrad_fp32(dy, x, param.main_grad.dtype), True)
        return GradWrite(param, F.linear_wgrad(dy, x), False)

    def _returned_weight_grad(
        self,
        param: torch.nn.Parameter,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> torch.Tensor:
        """``dy^T x`` in the parameter's dtype, for a weight ``torch.autograd.grad`` asked for
        (:data:`RETURN`): the plain-mode formula, never ``main_grad``."""
        if fp8 is not None:
            return fp8.wgrad(param.dtype)
        return F.linear_wgrad(dy, x)

    def _bias_write(self, param: torch.nn.Parameter, dy: torch.Tensor) -> GradWrite:
        """The gradient of one GEMM bias, always to ``.grad``."""
        return GradWrite(param, F.bias_grad(dy), False)

    def _begin_wgrad(self, named_weights: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """First step of every wgrad closure (and of every backward): validate ``main_grad``."""
        self._check_main_grads(named_weights)
