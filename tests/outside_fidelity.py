"""A toy outside package whose ``Linear`` splits its backward the way TransformerEngine's source
reads (``TransformerEngineBaseModule.backward_dw``, ``_Linear.backward``): under delay the
autograd Function returns ``None`` for the weight and bias and queues their gradients;
``backward_dw()`` sets ``.grad`` on the module's weight and bias attributes as they are then.
Its Function has the old ``forward(ctx, ...)`` form (no ``setup_context``) and a backward that
is ``once_differentiable``, as TE's kernels are. Without delay it returns every gradient through
autograd, so everything P18 checks holds there.

P18's meta-tests (``tests/test_properties_fidelity.py``) drive it as a backend: each P18 kind
fails on it under delay, naming what went wrong, while the same cases pass without delay.
"""

from __future__ import annotations

import collections

import torch


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module):
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.has_bias = module, bias is not None
        y = x @ weight.t()
        return y if bias is None else y + bias

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dw = dy.t() @ x
        db = dy.sum(0) if ctx.has_bias else None
        if ctx.module.delay_wgrad_compute:
            ctx.module._queue.append((dw, db))
            return dy @ weight, None, None, None
        return dy @ weight, dw, db, None


class Linear(torch.nn.Module):
    """``y = x @ weight^T + bias`` with a TransformerEngine-style split backward."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device=None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        if fuse_wgrad_accumulation:
            raise NotImplementedError("outside_fidelity.Linear has no fused accumulation")
        kw = {"dtype": params_dtype or torch.get_default_dtype(), "device": device}
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.zeros(out_features, in_features, **kw))
        self.bias = torch.nn.Parameter(torch.zeros(out_features, **kw)) if bias else None
        self.fuse_wgrad_accumulation = False
        self.delay_wgrad_compute = delay_wgrad_compute
        self.ub_bulk_wgrad = ub_bulk_wgrad
        self._queue: collections.deque = collections.deque()
        self._hooks: list = []

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x = inp.reshape(-1, self.in_features)
        y = _Function.apply(x, self.weight, self.bias, self)
        return y.reshape(*inp.shape[:-1], self.out_features)

    @property
    def pending_wgrad_count(self) -> int:
        return len(self._queue)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, hook) -> None:
        self._hooks.append(hook)

    def backward_dw(self) -> None:
        if not self.delay_wgrad_compute:
            return
        if not self._queue:
            raise RuntimeError("outside_fidelity.Linear.backward_dw(): nothing is pending")
        dw, db = self._queue.popleft()
        for target, value in ((self.weight, dw), (self.bias, db)):
            if value is None or target is None:
                continue
            with torch.no_grad():
                # The module's attribute as it is now: SPEC §3's "the tensor the forward used"
                # is lost, and autograd's hooks are bypassed.
                target.grad = value.clone() if target.grad is None else target.grad + value
        for hook in self._hooks:
            hook()
