"""Reference ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch

from . import collectives as C
from . import functional as F
from .base import SplitBackwardModule, detached, no_forward_ad, remember_params
from .contract import LayerNormLinearContract, autocast_off, without_autocast
from .fp8_gemm import update_delayed_scaling
from .linear import _fp8_gemm, _gemm_operands
from .norm import norm_bwd, norm_fwd
from .parallel import check_tp_backward, check_tp_forward, output_shape

__all__ = ["LayerNormLinear"]


def _normed(module, x, ln_weight, ln_bias, autocast):
    """``(ln_out, stats)``: the norm in the parameters' dtype; its output cast to the autocast
    dtype, where the GEMM runs (SPEC §2)."""
    ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
    return (ln_out if autocast is None else ln_out.to(autocast)), stats


class _LayerNormLinearFunction(torch.autograd.Function):
    """Returns ``(y, ln_out, *stats)``: the intermediates the backward needs are outputs
    (autograd's ``setup_context`` form), marked non-differentiable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, ln_weight, ln_bias, weight, bias, module, overwrite, fp8, autocast):
        ln_out, stats = _normed(module, x, ln_weight, ln_bias, autocast)
        weight, bias = _gemm_operands(autocast, fp8, weight, bias)
        tp = module._tp
        # SPEC §9, column + SP: the norm runs on this rank's tokens, the GEMM on all of them
        # (the shard is what is saved; the backward gathers it again).
        gemm_in = C.gather_rows(ln_out, tp) if tp is not None and tp.sequence_parallel else ln_out
        if fp8 is None:
            return (F.linear_fwd(gemm_in, weight, bias), ln_out, *stats)
        y = fp8.fprop(gemm_in, weight, bias)
        if gemm_in is not ln_out and tp.gather_in_backward_dw:
            fp8.quantize_in_w("x", ln_out, C.gather_in_w)
        update_delayed_scaling(module, fp8.recipe, ("input", "weight"))
        return (y, ln_out, *stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ln_weight, ln_bias, weight, bias, module, overwrite, fp8, autocast = inputs
        _, ln_out, *stats = output
        ctx.mark_non_differentiable(ln_out, *stats)
        ctx.module, ctx.overwrite, ctx.fp8, ctx.autocast = module, overwrite, fp8, autocast
        remember_params(ctx, module._parameter_names, (ln_weight, ln_bias, weight, bias))
        ctx.weight_dtype = weight.dtype
        if fp8 is not None:  # the quantized copies in ``fp8`` replace ln_out and the weight
            ln_out = weight = None
        ctx.save_for_backward(x, ln_weight, ln_bias, ln_out, weight, *stats)

    jvp = no_forward_ad

    @staticmethod
    @without_autocast
    def backward(ctx, dy, *_):
        module: LayerNormLinear = ctx.module
        if module._tp is not None:
            check_tp_backward(module)
        fp8, (to_lnw, to_lnb, to_w, to_b) = module._route(ctx)
        x, ln_weight, ln_bias, ln_out, weight, *stats = ctx.saved_tensors
        if torch.is_grad_enabled():  # recompute, so that the formulas below are on the graph
            ln_out, stats = _normed(module, x, ln_weight, ln_bias, ctx.autocast)
        else:
            x, ln_weight, ln_out, weight, *stats = detached((x, ln_weight, ln_out, weight, *stats))
        need_x = ctx.needs_input_grad[0]
        need_norm_grads = need_x or to_lnw.needed or to_lnb.needed
        dx = d_lnw = d_lnb = None
        if fp8 is None:
            weight, _ = _gemm_operands(ctx.autocast, None, weight, None)
            d_ln_out = F.linear_dgrad(dy, weight) if need_norm_grads else None
        else:
            d_ln_out = fp8.dgrad(dy, need_norm_grads)
            update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        tp = module._tp
        if tp is not None:
            if need_norm_grads:  # SPEC §9: summed over the ranks' output columns
                d_ln_out = C.reduce_rows(d_ln_out, tp)
            if tp.sequence_parallel and ln_out is not None:  # the wgrad's operand: all tokens
                ln_out = (
                    C.GatherInW(ln_out, tp)
                    if tp.gather_in_backward_dw
                    else (C.gather_rows(ln_out, tp))
                )
        if need_norm_grads:
            dx, d_lnw, d_lnb = norm_bwd(module, d_ln_out, x, ln_weight, stats)
        module._submit_gemm_wgrads([(to_w, to_b, dy, ln_out, fp8)], ctx.overwrite)
        return (
            dx if need_x else None,
            d_lnw if to_lnw.needed else None,
            d_lnb if to_lnb.needed else None,
            module._returned_weight_grad(to_w, ctx.weight_dtype, dy, ln_out, fp8),
            module._returned_bias_grad(to_b, dy),
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

    Tensor parallel (SPEC §9): column only (``parallel_mode="row"`` is refused: the norm needs
    every feature). Under SP the norm runs on this rank's tokens and ``ln_out`` is gathered for
    the GEMM (the shard is saved); backward ``d_ln_out = reduce_rows(dy @ W_r)`` (reduce-scattered
    under SP, all-reduced otherwise) feeds the norm backward, so under SP the norm parameters'
    gradients are partial sums (``sequence_parallel=True``); the wgrad operand ``ln_out`` is
    gathered again as :class:`.linear.Linear`'s ``x`` is.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        if self._tp is not None:
            check_tp_forward(self, inp, recipe, scatters=False)
        weight = self.weight
        self._check_forward_params(recipe, [("weight", weight)])
        fp8 = _fp8_gemm(self, recipe, x.shape[0])
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        autocast = self.autocast_dtype()
        params = (self.layer_norm_weight, self.layer_norm_bias, weight, self.bias)
        with autocast_off(x.device.type):
            y = _LayerNormLinearFunction.apply(x, *params, self, overwrite, fp8, autocast)[0]
        if self._tp is not None and inp.dim() != 2:
            return y.reshape(output_shape(inp, self.out_features, self._tp, "gather"))
        return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
