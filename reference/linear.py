"""Reference ``Linear``: ``y = x @ W^T + b`` with a hand-written, splittable backward."""

from __future__ import annotations

import torch

from . import functional as F
from .base import SplitBackwardModule, WgradEntry, detached
from .contract import (
    ACCUMULATE,
    RETURN,
    LinearContract,
    autocast_off,
    gradient_destinations,
    without_autocast,
)
from .fp8_gemm import FP8Gemm, update_delayed_scaling

__all__ = ["Linear"]


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, is_first_microbatch, recipe, autocast):
        ctx.module = module
        ctx.overwrite = bool(is_first_microbatch) and module.fuse_wgrad_accumulation
        if autocast is not None:
            # SPEC §2, torch.autocast: x arrives in the autocast dtype; the GEMM's parameters
            # are cast to it too (under FP8 the weight is quantized from its own dtype).
            weight = weight if recipe is not None else weight.to(autocast)
            bias = None if bias is None else bias.to(autocast)
        if recipe is None:
            ctx.fp8 = None
            ctx.save_for_backward(x, weight)
            return F.linear_fwd(x, weight, bias)
        ctx.fp8 = FP8Gemm(module, recipe)
        y = ctx.fp8.fprop(x, weight, bias)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: Linear = ctx.module
        fp8, ctx.fp8 = ctx.fp8, None
        need_x = ctx.needs_input_grad[0]
        to_w, to_b = gradient_destinations(module.weight, module.bias)
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        named_weights = [("weight", module.weight)] if need_w else []
        module._begin_wgrad(named_weights)
        x = weight = None
        if fp8 is None:
            x, weight = detached(ctx.saved_tensors)
            dx = F.linear_dgrad(dy, weight) if need_x else None
        else:
            dx = fp8.dgrad(dy, need_x)
            update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        if need_w or need_b:

            def wgrad_closure():
                module._begin_wgrad(named_weights)
                writes = [module._weight_write(module.weight, dy, x, fp8)] if need_w else []
                if need_b:
                    writes.append(module._bias_write(module.bias, dy))
                return writes

            module._submit_wgrad(WgradEntry(wgrad_closure, ctx.overwrite))
        dw = module._returned_weight_grad(module.weight, dy, x, fp8) if to_w == RETURN else None
        db = F.bias_grad(dy) if to_b == RETURN else None
        return dx, dw, db, None, None, None, None


class Linear(LinearContract, SplitBackwardModule):
    """``y = x @ weight^T + bias`` over the last dimension of ``inp``.

    Parameters: ``weight`` (out_features, in_features), ``bias`` (out_features) if ``bias``.
    Forward: ``module(inp, is_first_microbatch=None)``; ``inp`` is ``(..., in_features)`` in
    ``params_dtype`` on the module's device, flattened to rows; the output is
    ``(..., out_features)``. Backward: ``dx = dy @ W`` now; ``dW = dy^T x`` and ``db = sum(dy)``
    now or, with ``delay_wgrad_compute=True``, at ``backward_dw()`` (see :mod:`.base`).
    ``ub_bulk_wgrad=True`` with delay raises ``ValueError``; without delay it changes nothing.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        if recipe is not None:
            self._check_fp8_shapes(recipe, x.shape[0])
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = _LinearFunction.apply(
                x, self.weight, self.bias, self, is_first_microbatch, recipe, autocast
            )
        return y.reshape(*inp.shape[:-1], self.out_features)
