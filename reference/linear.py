"""Reference ``Linear``: ``y = x @ W^T + b`` with a hand-written, splittable backward."""

from __future__ import annotations

import torch

from . import collectives as C
from . import functional as F
from .base import SplitBackwardModule, detached, no_forward_ad, remember_params
from .contract import LinearContract, autocast_off, without_autocast
from .fp8_gemm import FP8Gemm, update_delayed_scaling
from .parallel import check_tp_backward, check_tp_forward, output_shape

__all__ = ["Linear"]


def _gemm_operands(autocast, fp8, weight, bias):
    """SPEC §2, torch.autocast: the GEMM's parameters cast to the autocast dtype (under FP8 the
    weight is quantized from its own dtype)."""
    if autocast is None:
        return weight, bias
    weight = weight if fp8 is not None else weight.to(autocast)
    return weight, None if bias is None else bias.to(autocast)


def _fp8_gemm(module, recipe, rows: int) -> FP8Gemm | None:
    """The FP8 state of a forward's one GEMM under ``recipe`` (``None``: no FP8), after checking
    that the recipe can quantize its shapes (SPEC §5)."""
    if recipe is None:
        return None
    module._check_fp8_shapes(recipe, rows)
    return FP8Gemm(module, recipe)


class _LinearFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, module, overwrite, fp8, autocast):
        weight, bias = _gemm_operands(autocast, fp8, weight, bias)
        tp, mode = module._tp, module.parallel_mode
        shard = x
        if tp is not None and mode == "column" and tp.sequence_parallel:
            x = C.gather_rows(x, tp)  # SPEC §9: the GEMM sees every rank's tokens
        # A row layer adds its (whole) bias after its output is reduced.
        row = tp is not None and mode == "row"
        gemm_bias = None if row else bias
        if fp8 is None:
            y = F.linear_fwd(x, weight, gemm_bias)
        else:
            y = fp8.fprop(x, weight, gemm_bias)
            if shard is not x and tp.gather_in_backward_dw:
                fp8.quantize_in_w("x", shard, C.gather_in_w)
            update_delayed_scaling(module, fp8.recipe, ("input", "weight"))
        if row:
            y = C.reduce_rows(y, tp)
            if bias is not None:
                y = y + bias
        return y

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias, module, overwrite, fp8, autocast = inputs
        ctx.module, ctx.overwrite, ctx.fp8, ctx.autocast = module, overwrite, fp8, autocast
        remember_params(ctx, module._parameter_names, (weight, bias))
        ctx.weight_dtype = weight.dtype
        if fp8 is None:  # under FP8 the quantized copies in ``fp8`` are all the backward needs
            ctx.save_for_backward(x, weight)

    jvp = no_forward_ad

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: Linear = ctx.module
        tp, mode = module._tp, module.parallel_mode
        if tp is not None:
            check_tp_backward(module)
        fp8, (to_w, to_b) = module._route(ctx)
        differentiable = torch.is_grad_enabled()
        need_x = ctx.needs_input_grad[0]
        sp = tp is not None and tp.sequence_parallel
        # SPEC §9, row + SP: dgrad and wgrad need every rank's tokens of dy; the bias
        # gradient sums this rank's (a partial sum, reduced by the framework).
        dy_w = C.gather_rows(dy, tp) if sp and mode == "row" else dy
        x = weight = None
        if fp8 is None:
            x, weight = ctx.saved_tensors
            if not differentiable:  # otherwise the formulas below are on the graph
                x, weight = detached((x, weight))
            weight, _ = _gemm_operands(ctx.autocast, None, weight, None)
            dx = F.linear_dgrad(dy_w, weight) if need_x else None
        else:
            dx = fp8.dgrad(dy_w, need_x)
            if dy_w is not dy and tp.gather_in_backward_dw:
                fp8.quantize_in_w("dy", dy, C.gather_in_w)
            update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        if tp is not None and mode == "column" and need_x:
            dx = C.reduce_rows(dx, tp)  # each rank's dx is its output columns' share
        if sp:  # the full-sequence wgrad operand: now, or inside backward_dw()
            if mode == "column" and x is not None:
                x = C.GatherInW(x, tp) if tp.gather_in_backward_dw else C.gather_rows(x, tp)
            elif mode == "row" and tp.gather_in_backward_dw:
                dy_w = C.GatherInW(dy, tp)
        bias_dy = dy if to_b is not None and to_b.written else None
        if sp and mode == "row":
            # The entry holds only what its GEMMs read: the bias sums this rank's rows, a view
            # into the gathered dy when the entry keeps that; under FP8 the weight's operands
            # are the quantized copies in ``fp8``.
            if bias_dy is not None and fp8 is None and not tp.gather_in_backward_dw:
                bias_dy = C.own_rows(dy_w, tp)
            if fp8 is not None:
                dy_w = None
        module._submit_gemm_wgrads([(to_w, to_b, dy_w, x, fp8, bias_dy)], ctx.overwrite)
        dw = module._returned_weight_grad(to_w, ctx.weight_dtype, dy_w, x, fp8)
        return dx, dw, module._returned_bias_grad(to_b, dy), None, None, None, None


class Linear(LinearContract, SplitBackwardModule):
    """``y = x @ weight^T + bias`` over the last dimension of ``inp``.

    Parameters: ``weight`` (out_features, in_features), ``bias`` (out_features) if ``bias``.
    Forward: ``module(inp, is_first_microbatch=None)``; ``inp`` is ``(..., in_features)`` in
    ``params_dtype`` on the module's device, flattened to rows; the output is
    ``(..., out_features)``. Backward: ``dx = dy @ W`` now; ``dW = dy^T x`` and ``db = sum(dy)``
    now or, with ``delay_wgrad_compute=True``, at ``backward_dw()`` (see :mod:`.base`: the
    gradients go to the tensors this forward used; only leaves are deferred).
    ``ub_bulk_wgrad=True`` with delay raises ``ValueError``; without delay it changes nothing.

    Tensor parallel (SPEC §9, options in :mod:`.parallel`, collectives in :mod:`.collectives`;
    ``in_features`` / ``out_features`` are then the rank's sizes), in the order they run:

    * column: forward — under SP ``x = gather_rows(x)`` (the shard is saved), ``y = x @ W_r^T +
      b_r``; backward — ``dx = reduce_rows(dy @ W_r)`` (all-reduce, or reduce-scatter under SP),
      then under SP the wgrad operand ``x`` gathered again (in ``backward()``, or inside
      ``backward_dw()`` with ``wgrad_gather="backward_dw"``).
    * row: forward — ``y = reduce_rows(x @ W_r^T) + b`` (the bias whole, after the sum);
      backward — under SP ``dy_full = gather_rows(dy)``, ``dx = dy_full @ W_r``,
      ``dW = dy_full^T x`` (``dy`` gathered again inside ``backward_dw()`` in that mode),
      ``db = sum(dy)`` over this rank's rows only (a partial sum under SP: the bias carries
      ``sequence_parallel=True``).
    * FP8: the gathered operand is quantized whole (one amax for the group); with
      ``wgrad_gather="backward_dw"`` the entry keeps the high-precision shard and the scale,
      and quantizes the gathered tensor again to the same bytes.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        if self._tp is not None:
            check_tp_forward(self, inp, recipe, scatters=self.parallel_mode == "row")
        weight, bias = self.weight, self.bias
        self._check_forward_params(recipe, [("weight", weight)])
        fp8 = _fp8_gemm(self, recipe, x.shape[0])
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = _LinearFunction.apply(x, weight, bias, self, overwrite, fp8, autocast)
        if self._tp is not None and inp.dim() != 2:
            sp_rows = "gather" if self.parallel_mode == "column" else "scatter"
            return y.reshape(output_shape(inp, self.out_features, self._tp, sp_rows))
        return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
