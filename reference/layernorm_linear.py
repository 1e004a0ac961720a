"""Reference ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch

from . import functional as F
from .base import SplitBackwardModule, WgradEntry, detached
from .contract import (
    ACCUMULATE,
    RETURN,
    LayerNormLinearContract,
    autocast_off,
    gradient_destinations,
    without_autocast,
)
from .fp8_gemm import FP8Gemm, update_delayed_scaling
from .norm import norm_bwd, norm_fwd

__all__ = ["LayerNormLinear"]


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, ln_weight, ln_bias, weight, bias, module, is_first_microbatch, recipe, autocast
    ):
        ctx.module = module
        ctx.overwrite = bool(is_first_microbatch) and module.fuse_wgrad_accumulation
        ln_out, stats = norm_fwd(module, x)
        if autocast is not None:
            # SPEC §2, torch.autocast: the norm in the parameters' dtype, the GEMM in the
            # autocast dtype (under FP8 the weight is quantized from its own dtype).
            ln_out = ln_out.to(autocast)
            weight = weight if recipe is not None else weight.to(autocast)
            bias = None if bias is None else bias.to(autocast)
        if recipe is None:
            ctx.fp8 = None
            ctx.save_for_backward(x, ln_weight, ln_out, weight, *stats)
            return F.linear_fwd(ln_out, weight, bias)
        ctx.fp8 = FP8Gemm(module, recipe)
        ctx.save_for_backward(x, ln_weight, None, None, *stats)
        y = ctx.fp8.fprop(ln_out, weight, bias)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: LayerNormLinear = ctx.module
        fp8, ctx.fp8 = ctx.fp8, None
        x, ln_weight, ln_out, weight, *stats = detached(ctx.saved_tensors)
        need_x = ctx.needs_input_grad[0]
        to_lnw, to_lnb, to_w, to_b = gradient_destinations(
            module.layer_norm_weight, module.layer_norm_bias, module.weight, module.bias
        )
        need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        named_weights = [("weight", module.weight)] if need_w else []
        module._begin_wgrad(named_weights)
        dx = d_lnw = d_lnb = None
        need_norm_grads = need_x or need_lnw or need_lnb
        if fp8 is None:
            d_ln_out = F.linear_dgrad(dy, weight) if need_norm_grads else None
        else:
            d_ln_out = fp8.dgrad(dy, need_norm_grads)
            update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        if need_norm_grads:
            dx, d_lnw, d_lnb = norm_bwd(module, d_ln_out, x, ln_weight, stats)
        if need_w or need_b:

            def wgrad_closure():
                module._begin_wgrad(named_weights)
                writes = [module._weight_write(module.weight, dy, ln_out, fp8)] if need_w else []
                if need_b:
                    writes.append(module._bias_write(module.bias, dy))
                return writes

            module._submit_wgrad(WgradEntry(wgrad_closure, ctx.overwrite))
        dw = (
            module._returned_weight_grad(module.weight, dy, ln_out, fp8) if to_w == RETURN else None
        )
        db = F.bias_grad(dy) if to_b == RETURN else None
        return (
            dx if need_x else None,
            d_lnw if need_lnw else None,
            d_lnb if need_lnb else None,
            dw,
            db,
            *([None] * 4),
        )


class LayerNormLinear(LayerNormLinearContract, SplitBackwardModule):
    """``y = norm(x) @ weight^T + bias``.

    Parameters: ``layer_norm_weight`` (in_features), ``layer_norm_bias`` (in_features, LayerNorm
    only), ``weight`` (out_features, in_features), ``bias`` (out_features) if ``bias``.
    ``normalization`` is ``"LayerNorm"`` or ``"RMSNorm"`` (see :mod:`.norm`), ``eps`` is added to
    the variance / mean square, ``zero_centered_gamma`` stores ``gamma - 1``.
    Backward writes dx and the norm-parameter gradients; ``dW = dy^T norm(x)`` and
    ``db = sum(dy)`` are the deferrable part (see :mod:`.base`).
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        if recipe is not None:
            self._check_fp8_shapes(recipe, x.shape[0])
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = self._function(x, is_first_microbatch, recipe, autocast)
        return y.reshape(*inp.shape[:-1], self.out_features)

    def _function(self, x, is_first_microbatch, recipe, autocast) -> torch.Tensor:
        return _LayerNormLinearFunction.apply(
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.weight,
            self.bias,
            self,
            is_first_microbatch,
            recipe,
            autocast,
        )
