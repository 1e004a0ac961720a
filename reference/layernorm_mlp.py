"""Reference ``LayerNormMLP``: norm, fc1, activation, fc2 — one queue entry covers fc2 and fc1."""

from __future__ import annotations

import torch

from . import functional as F
from .base import SplitBackwardModule, WgradEntry, detached
from .contract import (
    ACCUMULATE,
    RETURN,
    LayerNormMLPContract,
    autocast_off,
    gradient_destinations,
    without_autocast,
)
from .fp8_gemm import FP8Gemm, update_delayed_scaling
from .norm import norm_bwd, norm_fwd

__all__ = ["LayerNormMLP"]


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x,
        ln_weight,
        ln_bias,
        fc1_weight,
        fc1_bias,
        fc2_weight,
        fc2_bias,
        module,
        first,
        recipe,
        autocast,
    ):
        ctx.module = module
        ctx.overwrite = bool(first) and module.fuse_wgrad_accumulation
        ln_out, stats = norm_fwd(module, x)
        if autocast is not None:
            # SPEC §2, torch.autocast: the norm in the parameters' dtype, both GEMMs (and the
            # activation between them, on their dtype) in the autocast dtype; under FP8 the
            # weights are quantized from their own dtype.
            ln_out = ln_out.to(autocast)
            if recipe is None:
                fc1_weight, fc2_weight = fc1_weight.to(autocast), fc2_weight.to(autocast)
            fc1_bias = None if fc1_bias is None else fc1_bias.to(autocast)
            fc2_bias = None if fc2_bias is None else fc2_bias.to(autocast)
        if recipe is None:
            ctx.fp8 = None
            fc1_out = F.linear_fwd(ln_out, fc1_weight, fc1_bias)
            act_out = F.activation_fwd(fc1_out, module.activation)
            ctx.save_for_backward(
                x, ln_weight, ln_out, fc1_weight, fc1_out, act_out, fc2_weight, *stats
            )
            return F.linear_fwd(act_out, fc2_weight, fc2_bias)
        # FP8: both GEMMs quantized; the activation runs in high precision between them.
        ctx.fp8 = (FP8Gemm(module, recipe, "fc1"), FP8Gemm(module, recipe, "fc2"))
        fc1_out = ctx.fp8[0].fprop(ln_out, fc1_weight, fc1_bias)
        act_out = F.activation_fwd(fc1_out, module.activation)
        y = ctx.fp8[1].fprop(act_out, fc2_weight, fc2_bias)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.save_for_backward(x, ln_weight, None, None, fc1_out, None, None, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: LayerNormMLP = ctx.module
        fp8, ctx.fp8 = ctx.fp8, None
        saved = detached(ctx.saved_tensors)
        x, ln_weight, ln_out, fc1_weight, fc1_out, act_out, fc2_weight, *stats = saved
        need_x = ctx.needs_input_grad[0]
        dest = gradient_destinations(
            module.layer_norm_weight,
            module.layer_norm_bias,
            module.fc1_weight,
            module.fc1_bias,
            module.fc2_weight,
            module.fc2_bias,
        )
        to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
        need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
        need_w1, need_b1, need_w2, need_b2 = (d == ACCUMULATE for d in dest[2:])
        named_weights = [("fc2_weight", module.fc2_weight)] if need_w2 else []
        if need_w1:
            named_weights.append(("fc1_weight", module.fc1_weight))
        module._begin_wgrad(named_weights)
        fc1_fp8, fc2_fp8 = fp8 if fp8 is not None else (None, None)

        need_norm_grads = need_x or need_lnw or need_lnb
        need_d_fc1 = need_norm_grads or to_w1 is not None or to_b1 is not None
        dx = d_lnw = d_lnb = d_fc1_out = d_ln_out = None
        if fp8 is None:
            if need_d_fc1:
                d_act = F.linear_dgrad(dy, fc2_weight)
                d_fc1_out = F.activation_bwd(d_act, fc1_out, module.activation)
            if need_norm_grads:
                d_ln_out = F.linear_dgrad(d_fc1_out, fc1_weight)
        else:
            d_act = fc2_fp8.dgrad(dy, need_d_fc1)
            if need_d_fc1:
                d_fc1_out = F.activation_bwd(d_act, fc1_out, module.activation)
                d_ln_out = fc1_fp8.dgrad(d_fc1_out, need_norm_grads)
            update_delayed_scaling(module, fc1_fp8.recipe, ("grad_output",))
        if need_norm_grads:
            dx, d_lnw, d_lnb = norm_bwd(module, d_ln_out, x, ln_weight, stats)

        if named_weights or need_b1 or need_b2:

            def wgrad_closure():
                module._begin_wgrad(named_weights)
                writes = []
                if need_w2:
                    writes.append(module._weight_write(module.fc2_weight, dy, act_out, fc2_fp8))
                if need_b2:
                    writes.append(module._bias_write(module.fc2_bias, dy))
                if need_w1:
                    writes.append(
                        module._weight_write(module.fc1_weight, d_fc1_out, ln_out, fc1_fp8)
                    )
                if need_b1:
                    writes.append(module._bias_write(module.fc1_bias, d_fc1_out))
                return writes

            module._submit_wgrad(WgradEntry(wgrad_closure, ctx.overwrite))
        returned = [
            module._returned_weight_grad(module.fc1_weight, d_fc1_out, ln_out, fc1_fp8)
            if to_w1 == RETURN
            else None,
            F.bias_grad(d_fc1_out) if to_b1 == RETURN else None,
            module._returned_weight_grad(module.fc2_weight, dy, act_out, fc2_fp8)
            if to_w2 == RETURN
            else None,
            F.bias_grad(dy) if to_b2 == RETURN else None,
        ]
        return (
            dx if need_x else None,
            d_lnw if need_lnw else None,
            d_lnb if need_lnb else None,
            *returned,
            *([None] * 4),
        )


class LayerNormMLP(LayerNormMLPContract, SplitBackwardModule):
    """``y = fc2(act(fc1(norm(x))))``.

    Parameters: ``layer_norm_weight`` (hidden), ``layer_norm_bias`` (hidden, LayerNorm only),
    ``fc1_weight`` (ffn, hidden) — (2*ffn, hidden) for the gated ``"swiglu"``/``"geglu"``, whose
    fc1 output is split into halves ``[a, b]`` and becomes ``act(a) * b`` — ``fc1_bias``,
    ``fc2_weight`` (hidden, ffn), ``fc2_bias`` (hidden). ``activation``: ``"gelu"`` (tanh
    approximation), ``"relu"``, ``"swiglu"``, ``"geglu"``.

    Backward: ``d_act = dy @ W2``, ``d_fc1 = act'(...)``, ``d_ln = d_fc1 @ W1``, then the norm
    backward. One deferrable entry per backward covers ``dW2 = dy^T act_out``, ``db2 = sum(dy)``,
    ``dW1 = d_fc1^T ln_out``, ``db1 = sum(d_fc1)``, written in that order; a frozen fc weight is
    skipped while the other one still gets its gradient.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.hidden_size)
        if recipe is not None:
            self._check_fp8_shapes(recipe, x.shape[0])
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = self._function(x, is_first_microbatch, recipe, autocast)
        return y.reshape(*inp.shape[:-1], self.hidden_size)

    def _function(self, x, is_first_microbatch, recipe, autocast) -> torch.Tensor:
        return _LayerNormMLPFunction.apply(
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.fc1_weight,
            self.fc1_bias,
            self.fc2_weight,
            self.fc2_bias,
            self,
            is_first_microbatch,
            recipe,
            autocast,
        )
