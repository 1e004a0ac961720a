"""Reference ``LayerNormMLP``: norm, fc1, activation, fc2 — one queue entry covers fc2 and fc1."""

from __future__ import annotations

import torch

from . import collectives as C
from . import functional as F
from .base import SplitBackwardModule, detached, no_forward_ad, remember_params
from .contract import LayerNormMLPContract, autocast_off, without_autocast
from .fp8_gemm import FP8Gemm, update_delayed_scaling
from .layernorm_linear import _normed
from .linear import _gemm_operands
from .norm import norm_bwd
from .parallel import check_tp_backward, check_tp_forward

__all__ = ["LayerNormMLP"]


def _mlp_forward(module, x, ln_weight, ln_bias, w1, b1, w2, b2, autocast):
    """``(y, ln_out, fc1_out, act_out, stats)`` without FP8. Under torch.autocast (SPEC §2) the
    norm runs in the parameters' dtype, both GEMMs and the activation between them in the
    autocast dtype."""
    ln_out, stats = _normed(module, x, ln_weight, ln_bias, autocast)
    w1, b1 = _gemm_operands(autocast, None, w1, b1)
    w2, b2 = _gemm_operands(autocast, None, w2, b2)
    fc1_out = F.linear_fwd(_fc1_input(module, ln_out), w1, b1)
    act_out = F.activation_fwd(fc1_out, module.activation)
    if module._tp is None:
        return F.linear_fwd(act_out, w2, b2), ln_out, fc1_out, act_out, stats
    y = _fc2_output(module, F.linear_fwd(act_out, w2, None), b2)
    return y, ln_out, fc1_out, act_out, stats


def _fc1_input(module, ln_out: torch.Tensor) -> torch.Tensor:
    """SPEC §9, fc1 column-parallel: under SP the norm ran on this rank's tokens, fc1 runs on
    all of them (the shard is what is saved; the backward gathers it again)."""
    tp = module._tp
    return C.gather_rows(ln_out, tp) if tp is not None and tp.sequence_parallel else ln_out


def _fc2_output(module, partial: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """SPEC §9, fc2 row-parallel: the ranks' partial outputs summed (reduce-scattered along
    the tokens under SP), then the whole bias added."""
    y = C.reduce_rows(partial, module._tp)
    return y if bias is None else y + bias


class _LayerNormMLPFunction(torch.autograd.Function):
    """Returns ``(y, ln_out, fc1_out, act_out, *stats)``: the intermediates the backward needs
    are outputs (autograd's ``setup_context`` form), marked non-differentiable."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, ln_weight, ln_bias, w1, b1, w2, b2, module, overwrite, fp8, autocast):
        if fp8 is None:
            y, ln_out, fc1_out, act_out, stats = _mlp_forward(
                module, x, ln_weight, ln_bias, w1, b1, w2, b2, autocast
            )
            return (y, ln_out, fc1_out, act_out, *stats)
        # FP8: both GEMMs quantized (weights from their own dtype); the activation runs in high
        # precision between them.
        fc1_fp8, fc2_fp8 = fp8
        ln_out, stats = _normed(module, x, ln_weight, ln_bias, autocast)
        _, b1 = _gemm_operands(autocast, fp8, w1, b1)
        _, b2 = _gemm_operands(autocast, fp8, w2, b2)
        fc1_in = _fc1_input(module, ln_out)
        fc1_out = fc1_fp8.fprop(fc1_in, w1, b1)
        if fc1_in is not ln_out and module._tp.gather_in_backward_dw:
            fc1_fp8.quantize_in_w("x", ln_out, C.gather_in_w)
        act_out = F.activation_fwd(fc1_out, module.activation)
        if module._tp is None:
            y = fc2_fp8.fprop(act_out, w2, b2)
        else:
            y = _fc2_output(module, fc2_fp8.fprop(act_out, w2, None), b2)
        update_delayed_scaling(module, fc1_fp8.recipe, ("input", "weight"))
        return (y, ln_out, fc1_out, act_out, *stats)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, ln_weight, ln_bias, w1, b1, w2, b2, module, overwrite, fp8, autocast = inputs
        _, ln_out, fc1_out, act_out, *stats = output
        ctx.mark_non_differentiable(ln_out, fc1_out, act_out, *stats)
        ctx.module, ctx.overwrite, ctx.fp8, ctx.autocast = module, overwrite, fp8, autocast
        remember_params(ctx, module._parameter_names, (ln_weight, ln_bias, w1, b1, w2, b2))
        ctx.weight_dtypes = (w1.dtype, w2.dtype)
        if fp8 is not None:  # the quantized copies in ``fp8`` replace these
            ln_out = act_out = w1 = w2 = None
        ctx.save_for_backward(
            x, ln_weight, ln_bias, w1, b1, w2, b2, ln_out, fc1_out, act_out, *stats
        )

    jvp = no_forward_ad

    @staticmethod
    @without_autocast
    def backward(ctx, dy, *_):
        module: LayerNormMLP = ctx.module
        tp = module._tp
        if tp is not None:
            check_tp_backward(module)
        fp8, (to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2) = module._route(ctx)
        x, ln_weight, ln_bias, w1, b1, w2, b2, ln_out, fc1_out, act_out, *stats = ctx.saved_tensors
        if torch.is_grad_enabled():  # recompute, so that the formulas below are on the graph
            _, ln_out, fc1_out, act_out, stats = _mlp_forward(
                module, x, ln_weight, ln_bias, w1, b1, w2, b2, ctx.autocast
            )
        else:
            x, ln_weight, w1, w2, ln_out, fc1_out, act_out, *stats = detached(
                (x, ln_weight, w1, w2, ln_out, fc1_out, act_out, *stats)
            )
        fc1_fp8, fc2_fp8 = fp8 if fp8 is not None else (None, None)
        sp = tp is not None and tp.sequence_parallel
        # SPEC §9, fc2 row + SP: its dgrad and wgrad need every rank's tokens of dy; its bias
        # gradient sums this rank's (a partial sum, reduced by the framework).
        dy_local, dy = dy, (C.gather_rows(dy, tp) if sp else dy)
        need_x = ctx.needs_input_grad[0]
        need_norm_grads = need_x or to_lnw.needed or to_lnb.needed
        need_d_fc1 = need_norm_grads or to_w1.needed or to_b1.needed
        dx = d_lnw = d_lnb = d_fc1_out = d_ln_out = None
        if fp8 is None:
            (w1, _), (w2, _) = (_gemm_operands(ctx.autocast, None, w, None) for w in (w1, w2))
            if need_d_fc1:
                d_act = F.linear_dgrad(dy, w2)
                d_fc1_out = F.activation_bwd(d_act, fc1_out, module.activation)
            if need_norm_grads:
                d_ln_out = F.linear_dgrad(d_fc1_out, w1)
        else:
            d_act = fc2_fp8.dgrad(dy, need_d_fc1)
            if sp and tp.gather_in_backward_dw:
                fc2_fp8.quantize_in_w("dy", dy_local, C.gather_in_w)
            if need_d_fc1:
                d_fc1_out = F.activation_bwd(d_act, fc1_out, module.activation)
                d_ln_out = fc1_fp8.dgrad(d_fc1_out, need_norm_grads)
            update_delayed_scaling(module, fc1_fp8.recipe, ("grad_output",))
        if tp is not None and need_norm_grads:  # fc1 column: summed over the ranks' rows of W1
            d_ln_out = C.reduce_rows(d_ln_out, tp)
        if need_norm_grads:
            dx, d_lnw, d_lnb = norm_bwd(module, d_ln_out, x, ln_weight, stats)
        dy_w2 = dy
        if sp:  # the full-sequence wgrad operands: now, or inside backward_dw()
            if tp.gather_in_backward_dw:
                dy_w2 = C.GatherInW(dy_local, tp)
                ln_out = None if ln_out is None else C.GatherInW(ln_out, tp)
            elif ln_out is not None:
                ln_out = C.gather_rows(ln_out, tp)

        db2_dy = dy_local if to_b2 is not None and to_b2.written else None
        if sp:
            # The entry holds only what its GEMMs read (see Linear's backward).
            if db2_dy is not None and fp8 is None and not tp.gather_in_backward_dw:
                db2_dy = C.own_rows(dy, tp)
            if fp8 is not None:
                dy_w2 = None

        # One entry: fc2's gradients, then fc1's.
        gemms = [
            (to_w2, to_b2, dy_w2, act_out, fc2_fp8, db2_dy),
            (to_w1, to_b1, d_fc1_out, ln_out, fc1_fp8),
        ]
        module._submit_gemm_wgrads(gemms, ctx.overwrite)
        w1_dtype, w2_dtype = ctx.weight_dtypes
        return (
            dx if need_x else None,
            d_lnw if to_lnw.needed else None,
            d_lnb if to_lnb.needed else None,
            module._returned_weight_grad(to_w1, w1_dtype, d_fc1_out, ln_out, fc1_fp8),
            module._returned_bias_grad(to_b1, d_fc1_out),
            module._returned_weight_grad(to_w2, w2_dtype, dy, act_out, fc2_fp8),
            module._returned_bias_grad(to_b2, dy_local),
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

    Tensor parallel (SPEC §9, ``set_parallel_mode=True``): fc1 column-parallel (the rank's
    ``size_per_partition`` rows; gated: its rows of the gate, then its rows of the up
    projection), fc2 row-parallel. Forward: norm (on this rank's tokens under SP), ``ln_out``
    gathered under SP, fc1, activation, ``reduce_rows(act_out @ W2_r^T) + b2``. Backward: ``dy``
    gathered under SP; ``db2 = sum`` of this rank's ``dy`` rows (a partial sum under SP);
    ``d_ln_out = reduce_rows(d_fc1 @ W1_r)`` into the norm backward. The wgrad operands that
    need every token (fc2's ``dy``, fc1's ``ln_out``) are gathered in ``backward()`` or, with
    ``wgrad_gather="backward_dw"``, inside ``backward_dw()``.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.hidden_size)
        if self._tp is not None:
            check_tp_forward(self, inp, recipe, scatters=False)
        w1, w2 = self.fc1_weight, self.fc2_weight
        self._check_forward_params(recipe, [("fc1_weight", w1), ("fc2_weight", w2)])
        fp8 = None
        if recipe is not None:
            self._check_fp8_shapes(recipe, x.shape[0])
            fp8 = (FP8Gemm(self, recipe, "fc1"), FP8Gemm(self, recipe, "fc2"))
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        autocast = self.autocast_dtype()
        params = (
            self.layer_norm_weight,
            self.layer_norm_bias,
            w1,
            self.fc1_bias,
            w2,
            self.fc2_bias,
        )
        with autocast_off(x.device.type):
            y = _LayerNormMLPFunction.apply(x, *params, self, overwrite, fp8, autocast)[0]
        return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.hidden_size)
