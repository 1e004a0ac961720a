"""impl ``LayerNormMLP``: norm, fc1, activation, fc2 — one queue entry covers fc2 and fc1.

Saved vs recomputed activation (measured with ``splitgrad bench``, CPU, 2048 tokens, hidden 1024,
ffn 4096): the forward keeps ``ln_out``, fc1's output ``h`` (the activation backward needs it)
and ``act(h)`` (fc2's wgrad operand), like a ``torch.nn`` MLP does. Recomputing ``act(h)`` in
backward instead saves one (N, ffn) tensor per micro-batch between forward and backward (40 vs
72 MB kept at fp32, 20 vs 36 MB at bf16) but made the backward 6% (fp32) to 14% (bf16) slower,
because the tanh-GELU pass costs as much as half a bf16 GEMM on CPU; speed wins by default. Set
``LayerNormMLP.recompute_activation = True`` (class or instance) to trade it back. Either way a
queued entry holds exactly ``dy, act(h), d_fc1, ln_out`` (the wgrad operands), so delay keeps
nothing the non-delayed backward would not have kept.
"""

from __future__ import annotations

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, LayerNormMLPContract

from . import compiled, gemm
from ._torch_compat import function_c_apply
from .activation import act_bwd, act_fwd
from .base import (
    FP8WgradPart,
    SplitBackwardModule,
    autocast_cast,
    edge_routes,
    fast_apply,
    norm_module_backward,
    store_grad,
    take_fp8,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .linear import tp_fp8_column_forward, tp_fp8_row_dgrad, tp_fp8_row_forward
from .norm import norm_bwd, norm_fwd
from .parallel import (
    TPWgradPart,
    all_reduce_,
    fp8_value_of,
    gather_rows,
    gather_shard,
    reduce_partial_rows,
    reduce_scatter_rows,
    refuse_differentiated,
    submit_tp_fp8_wgrad,
    tp_forward,
    wait,
)

__all__ = ["LayerNormMLP"]


def _needs(dest) -> tuple[bool, ...]:
    """From the destinations of (layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias,
    fc2_weight, fc2_bias): whether each norm gradient is computed at all, and whether each GEMM
    parameter's is written (accumulated) by the wgrad closure."""
    return (dest[0] is not None, dest[1] is not None, *(d == ACCUMULATE for d in dest[2:]))


_NAMES = LayerNormMLPContract._parameter_names


def _written(leaves, need_w1: bool, need_b1: bool, need_w2: bool, need_b2: bool) -> tuple:
    """The (name, leaf) pairs the closure writes, in writing order: fc2's, then fc1's."""
    _, _, w1, b1, w2, b2 = leaves
    pairs = (("fc2_weight", w2, need_w2), ("fc2_bias", b2, need_b2))
    pairs += (("fc1_weight", w1, need_w1), ("fc1_bias", b1, need_b1))
    return tuple([(name, leaf) for name, leaf, need in pairs if need])


def _backward(
    module, dy, saved, need_x, dest, leaves, overwrite, compiled_graph=False, direct=False
):
    """``(dx, d_layer_norm_weight, d_layer_norm_bias, dW1, db1, dW2, db2)`` from the forward's
    ``saved`` tensors: fc2 dgrad, activation, fc1 dgrad and norm backward now; one wgrad
    closure for fc2 and fc1 run now or queued (``direct``: direct routes, see
    :func:`~.base.backward_routes`: without delay its writes run here); the gradients
    ``torch.autograd.grad`` asked for returned. The body of both the eager Function's backward
    and the compiled op."""
    x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, act_out, fc2_weight, *stats = saved
    to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
    # _needs(dest) and _written(...), inlined: this runs once per backward.
    need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
    need_w1, need_b1 = to_w1 == ACCUMULATE, to_b1 == ACCUMULATE
    need_w2, need_b2 = to_w2 == ACCUMULATE, to_b2 == ACCUMULATE
    _, _, w1, b1, w2, b2 = leaves
    now = direct and not module.delay_wgrad_compute  # the closure's writes, here
    if not now:
        written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
        hooked = not direct and module._begin_writes(written)

    need_norm = need_x or need_lnw or need_lnb
    d_fc1_out = None
    if need_norm or to_w1 is not None or to_b1 is not None:
        d_act = torch.mm(dy, fc2_weight)
        d_fc1_out, recomputed = act_bwd(
            d_act, fc1_out, module.activation, want_out=to_w2 is not None and act_out is None
        )
        del d_act
        if recomputed is not None:
            act_out = recomputed
    elif to_w2 is not None and act_out is None:
        act_out = act_fwd(fc1_out, module.activation)
    d_ln_out = torch.mm(d_fc1_out, fc1_weight) if need_norm else None
    dx, d_lnw, d_lnb = norm_bwd(
        module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
    )
    del d_ln_out

    if now:
        if need_w2:
            store_grad(w2, gemm.wgrad(dy, act_out))
        if need_b2:
            store_grad(b2, dy.sum(dim=0))
        if need_w1:
            store_grad(w1, gemm.wgrad(d_fc1_out, ln_out))
        if need_b1:
            store_grad(b1, d_fc1_out.sum(dim=0))
        if module._wgrad_hooks and (need_w1 or need_b1 or need_w2 or need_b2):
            module._run_hooks()
        return dx, d_lnw, d_lnb, None, None, None, None
    if written:

        def wgrad_closure(dy, act_out, d_fc1_out, ln_out):
            if module.fuse_wgrad_accumulation:
                module._check_main_grads([(n, w) for n, w in written if n.endswith("weight")])
            if need_w2:
                module._write_weight_grad(w2, dy, act_out, overwrite)
            if need_b2:
                module._write_bias_grad(b2, dy)
            if need_w1:
                module._write_weight_grad(w1, d_fc1_out, ln_out, overwrite)
            if need_b1:
                module._write_bias_grad(b1, d_fc1_out)

        # Keep only what this entry reads; None for operands of frozen parameters.
        saved = (
            dy if (need_w2 or need_b2) else None,
            act_out.detach() if need_w2 else None,
            d_fc1_out if (need_w1 or need_b1) else None,
            ln_out.detach() if need_w1 else None,
        )
        module._submit_wgrad(wgrad_closure, saved, written, compiled_graph, hooked)
    # Asked for by torch.autograd.grad: returned now, nothing written or queued.
    returned = (
        gemm.wgrad(d_fc1_out, ln_out) if to_w1 == RETURN else None,
        d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
        gemm.wgrad(dy, act_out) if to_w2 == RETURN else None,
        dy.sum(dim=0) if to_b2 == RETURN else None,
    )
    return dx, d_lnw, d_lnb, *returned


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, module, ow, autocast
    ):
        ctx.module, ctx.overwrite, ctx.autocast = module, ow, autocast
        ctx.params = (ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
        ctx.present = (True, ln_bias is not None, True, fc1_bias is not None, True)
        ctx.present += (fc2_bias is not None,)
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: the norm in the parameters' dtype; both GEMMs, and the
        # activation between them (on fc1's output), in the autocast dtype.
        if autocast is not None:
            ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias = autocast_cast(
                autocast, ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias
            )
        fc1_out = gemm.linear_forward(ln_out, fc1_weight, fc1_bias)
        act_out = act_fwd(fc1_out, module.activation)
        kept_act = None if module.recompute_activation else act_out
        ctx.save_for_backward(
            x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, kept_act, fc2_weight, *stats
        )
        return gemm.linear_forward(act_out, fc2_weight, fc2_bias)

    # Compiled, it calls the op splitgrad::layernorm_mlp_backward (see :mod:`.compiled`) on the
    # saved x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, act_out (None when recomputed),
    # fc2_weight.
    backward = norm_module_backward("splitgrad::layernorm_mlp_backward", _NAMES, 8, _backward)


_apply = fast_apply(_LayerNormMLPFunction)
_c_apply = function_c_apply(_LayerNormMLPFunction)


class _LayerNormMLPFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe: fc1 and fc2 are FP8 GEMMs (states ``fc1.*``,
    ``fc2.*``); norm and activation run in high precision between them. The entry holds fc2's
    and fc1's column-wise FP8 operands and the two bias gradients."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, module, overwrite, recipe, autocast):
        needs = ctx.needs_input_grad
        need_norm = any(needs[:3])
        need_d_fc1 = need_norm or needs[3] or needs[4]
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: fc1's input and both biases in the autocast dtype (so
        # are fc1's output, the activation and fc2's output); weights quantized from their own.
        ln_out, b1, b2 = autocast_cast(autocast, ln_out, b1, b2)
        fc1 = FP8GemmOperands(module, recipe, "fc1")
        fc2 = FP8GemmOperands(module, recipe, "fc2")
        fc1_out = fc1.fprop(ln_out, w1, b1, keep_x=needs[3], keep_w=need_norm)
        del ln_out
        act_out = act_fwd(fc1_out, module.activation)
        y = fc2.fprop(act_out, w2, b2, keep_x=needs[5], keep_w=need_d_fc1)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, (fc1, fc2)
        ctx.present = tuple(p is not None for p in (ln_weight, ln_bias, w1, b1, w2, b2))
        ctx.weight_dtypes = (w1.dtype, w2.dtype)
        ctx.save_for_backward(x, ln_weight, ln_bias, fc1_out, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module, (fc1, fc2) = take_fp8(ctx)
        x, ln_weight, ln_bias, fc1_out, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dest, leaves = edge_routes(ctx, ctx.present)
        to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
        need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = _needs(dest)
        _, _, w1, b1, w2, b2 = leaves
        written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
        named_weights = [(n, leaf) for n, leaf in written if n.endswith("weight")]
        module._begin_writes(written)
        need_norm = need_x or need_lnw or need_lnb
        need_d_fc1 = need_norm or to_w1 is not None or to_b1 is not None
        d_act = fc2.dgrad(dy, need_dx=need_d_fc1, keep_dy=to_w2 is not None)
        d_fc1_out = d_ln_out = None
        if need_d_fc1:
            d_fc1_out, _ = act_bwd(d_act, fc1_out, module.activation, want_out=False)
            del d_act
            d_ln_out = fc1.dgrad(d_fc1_out, need_dx=need_norm, keep_dy=to_w1 is not None)
        update_delayed_scaling(module, fc2.recipe, ("grad_output",))
        dx, d_lnw, d_lnb = norm_bwd(
            module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
        )
        del d_ln_out
        dy2, act_q = fc2.take_wgrad_operands()
        dy1, ln_q = fc1.take_wgrad_operands()
        # Asked for by torch.autograd.grad: returned now, nothing written or queued.
        w1_dtype, w2_dtype = ctx.weight_dtypes
        returned = (
            fp8_wgrad_value(module, w1_dtype, dy1, ln_q) if to_w1 == RETURN else None,
            d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
            fp8_wgrad_value(module, w2_dtype, dy2, act_q) if to_w2 == RETURN else None,
            dy.sum(dim=0) if to_b2 == RETURN else None,
        )
        if written:
            parts = [
                FP8WgradPart(w2, b2, dy2, act_q, dy.sum(dim=0) if need_b2 else None),
                FP8WgradPart(w1, b1, dy1, ln_q, d_fc1_out.sum(dim=0) if need_b1 else None),
            ]
            module._submit_fp8_wgrad(parts, named_weights, ctx.overwrite, written)
        return dx, d_lnw, d_lnb, *returned, None, None, None, None


_fp8_forward = compiled.eager_apply(_LayerNormMLPFP8Function)


# ---- tensor parallel (SPEC §9, see .parallel): fc1 column, fc2 row -----------------------------


def _tp_backward(module, dy, saved, need_x, dest, leaves, overwrite):
    """The backward of the TP ``LayerNormMLP`` from its forward's ``saved`` tensors (``ln_out``:
    the rank's rows under SP). fc2 is a row GEMM: under SP ``dy`` is all-gathered first. fc1 is
    a column GEMM: under SP the re-gather of ``ln_out`` for its wgrad starts before the fc2 and
    fc1 dgrad GEMMs and is waited after them; the reduction of ``d_ln_out`` (reduce-scatter
    under SP, all-reduce otherwise) starts next and is waited after the wgrad closure (run here
    without delay), then the norm backward runs on the rank's rows. The entry's ``saved`` is
    ``(dy, act_out, d_fc1_out, ln_out)`` as without TP, ``dy`` and ``ln_out`` being the full
    sequence (``wgrad_gather="backward"``) or the rank's rows, which the closure all-gathers
    (``"backward_dw"``)."""
    tp = module._tp
    x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, act_out, fc2_weight, *stats = saved
    to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
    need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = _needs(dest)
    _, _, w1, b1, w2, b2 = leaves
    written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
    named_weights = [(n, leaf) for n, leaf in written if n.endswith("weight")]
    hooked = module._begin_writes(written)
    sp, later = tp.sequence_parallel, tp.gather_in_backward_dw
    need_norm = need_x or need_lnw or need_lnb
    need_d_fc1 = need_norm or to_w1 is not None or to_b1 is not None

    dy_full = dy
    if sp and (need_d_fc1 or to_w2 is not None):
        dy_full, _ = gather_rows(dy, tp)
    ln_full, gathering = ln_out, None
    if sp and to_w1 is not None and not later:
        ln_full, gathering = gather_rows(ln_out, tp, async_op=True)
    d_fc1_out = None
    if need_d_fc1:
        d_act = torch.mm(dy_full, fc2_weight)
        d_fc1_out, recomputed = act_bwd(
            d_act, fc1_out, module.activation, want_out=to_w2 is not None and act_out is None
        )
        del d_act
        if recomputed is not None:
            act_out = recomputed
    elif to_w2 is not None and act_out is None:
        act_out = act_fwd(fc1_out, module.activation)
    d_ln_out = torch.mm(d_fc1_out, fc1_weight) if need_norm else None
    wait(gathering)
    d_ln_out, reducing = reduce_partial_rows(d_ln_out, tp)

    # fc2's operand: the gathered dy (its bias sums the rank's own rows), or the rank's dy.
    gather_later = sp and later
    dy_op, bias_rows = dy, None
    if sp and need_w2 and not later:
        dy_op, bias_rows = dy_full, (tp.rank * dy.shape[0], dy.shape[0])
    if written:

        def wgrad_closure(dy, act_out, d_fc1_out, ln_out):
            module._check_main_grads(named_weights)
            if need_w2:
                dy_w = gather_shard(module, dy) if gather_later else dy
                module._write_weight_grad(w2, dy_w, act_out, overwrite)
                del dy_w
            if need_b2:
                module._write_bias_grad(b2, dy if bias_rows is None else dy.narrow(0, *bias_rows))
            if need_w1:
                ln_w = gather_shard(module, ln_out) if gather_later else ln_out
                module._write_weight_grad(w1, d_fc1_out, ln_w, overwrite)
                del ln_w
            if need_b1:
                module._write_bias_grad(b1, d_fc1_out)

        entry = (
            dy_op if (need_w2 or need_b2) else None,
            act_out.detach() if need_w2 else None,
            d_fc1_out if (need_w1 or need_b1) else None,
            ln_full.detach() if need_w1 else None,
        )
        module._submit_wgrad(wgrad_closure, entry, written, False, hooked)
    if to_w1 == RETURN and ln_full is ln_out and sp:
        ln_full, _ = gather_rows(ln_out, tp)
    returned = (
        gemm.wgrad(d_fc1_out, ln_full) if to_w1 == RETURN else None,
        d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
        gemm.wgrad(dy_full, act_out) if to_w2 == RETURN else None,
        dy.sum(dim=0) if to_b2 == RETURN else None,
    )
    del dy_full, ln_full
    wait(reducing)
    dx, d_lnw, d_lnb = norm_bwd(
        module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
    )
    return dx, d_lnw, d_lnb, *returned


def _tp_reduce_output(module, y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fc2's partial output summed over the group (scattered along rows under SP), then the
    whole bias."""
    tp = module._tp
    if tp.sequence_parallel:
        y, _ = reduce_scatter_rows(y, tp)
    else:
        all_reduce_(y, tp)
    return y if bias is None else y.add_(bias.to(y.dtype))


class _LayerNormMLPTPFunction(torch.autograd.Function):
    """``LayerNormMLP`` with ``set_parallel_mode=True``: the norm on the rank's rows (under SP),
    its output all-gathered, fc1 on the rank's ``ffn / tp`` features (gated: its gate rows then
    its up rows, so the activation's halves are local), fc2 on them, the output reduced, then
    fc2's bias."""

    @staticmethod
    def forward(
        ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, module, ow, autocast
    ):
        tp = module._tp
        ctx.module, ctx.overwrite = module, ow
        params = (ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
        ctx.present = tuple(p is not None for p in params)
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias = autocast_cast(
            autocast, ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias
        )
        ln_full = gather_rows(ln_out, tp)[0] if tp.sequence_parallel else ln_out
        fc1_out = gemm.linear_forward(ln_full, fc1_weight, fc1_bias)
        del ln_full
        act_out = act_fwd(fc1_out, module.activation)
        kept_act = None if module.recompute_activation else act_out
        ctx.save_for_backward(
            x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, kept_act, fc2_weight, *stats
        )
        return _tp_reduce_output(module, torch.mm(act_out, fc2_weight.t()), fc2_bias)

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        dest, leaves = edge_routes(ctx, ctx.present)
        need_x = ctx.needs_input_grad[0]
        grads = _tp_backward(module, dy, ctx.saved_tensors, need_x, dest, leaves, ctx.overwrite)
        return *grads, None, None, None


_tp_apply = compiled.eager_apply(_LayerNormMLPTPFunction)


class _LayerNormMLPTPFP8Function(torch.autograd.Function):
    """The TP ``LayerNormMLP`` under an FP8 recipe: fc1's high-precision input gathered and the
    gathered tensor quantized; fc2's ``dy`` likewise in backward."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, module, overwrite, recipe, autocast):
        needs = ctx.needs_input_grad
        need_norm = any(needs[:3])
        need_d_fc1 = need_norm or needs[3] or needs[4]
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        ln_out, b1, b2 = autocast_cast(autocast, ln_out, b1, b2)
        fc1 = FP8GemmOperands(module, recipe, "fc1")
        fc2 = FP8GemmOperands(module, recipe, "fc2")
        fc1_out = tp_fp8_column_forward(ctx, fc1, module, ln_out, w1, b1, needs[3], need_norm)
        del ln_out
        act_out = act_fwd(fc1_out, module.activation)
        y = tp_fp8_row_forward(fc2, module, act_out, w2, b2, needs[5], need_d_fc1)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, (fc1, fc2)
        ctx.present = tuple(p is not None for p in (ln_weight, ln_bias, w1, b1, w2, b2))
        ctx.weight_dtypes = (w1.dtype, w2.dtype)
        ctx.save_for_backward(x, ln_weight, ln_bias, fc1_out, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        (fc1, fc2), ctx.fp8 = ctx.fp8, None
        ln_later, ctx.x_later = ctx.x_later, None
        x, ln_weight, ln_bias, fc1_out, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dest, leaves = edge_routes(ctx, ctx.present)
        to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
        need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = _needs(dest)
        _, _, w1, b1, w2, b2 = leaves
        written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
        named_weights = [(n, leaf) for n, leaf in written if n.endswith("weight")]
        module._begin_writes(written)
        need_norm = need_x or need_lnw or need_lnb
        need_d_fc1 = need_norm or to_w1 is not None or to_b1 is not None
        d_act, dy_later = tp_fp8_row_dgrad(fc2, module, dy, need_d_fc1, to_w2 is not None)
        d_fc1_out = d_ln_out = None
        if need_d_fc1:
            d_fc1_out, _ = act_bwd(d_act, fc1_out, module.activation, want_out=False)
            del d_act
            d_ln_out = fc1.dgrad(d_fc1_out, need_dx=need_norm, keep_dy=to_w1 is not None)
        update_delayed_scaling(module, fc2.recipe, ("grad_output",))
        d_ln_out, reducing = reduce_partial_rows(d_ln_out, module._tp)
        dy2, act_q = fc2.take_wgrad_operands()
        dy1, ln_q = fc1.take_wgrad_operands()
        dy2 = dy_later if dy_later is not None else dy2
        ln_q = ln_later if ln_later is not None else ln_q
        recipe = fc2.recipe
        w1_dtype, w2_dtype = ctx.weight_dtypes
        returned = (
            fp8_wgrad_value(module, w1_dtype, dy1, fp8_value_of(module, recipe, ln_q))
            if to_w1 == RETURN
            else None,
            d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
            fp8_wgrad_value(module, w2_dtype, fp8_value_of(module, recipe, dy2), act_q)
            if to_w2 == RETURN
            else None,
            dy.sum(dim=0) if to_b2 == RETURN else None,
        )
        if written:
            parts = [
                TPWgradPart(w2, b2, dy2, act_q, dy.sum(dim=0) if need_b2 else None),
                TPWgradPart(w1, b1, dy1, ln_q, d_fc1_out.sum(dim=0) if need_b1 else None),
            ]
            submit_tp_fp8_wgrad(module, recipe, parts, named_weights, ctx.overwrite, written)
        wait(reducing)
        dx, d_lnw, d_lnb = norm_bwd(
            module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
        )
        return dx, d_lnw, d_lnb, *returned, None, None, None, None


# (plain, FP8): what tp_forward runs; eager even under torch.compile (a graph break).
_TP_APPLY = _tp_apply, compiled.eager_apply(_LayerNormMLPTPFP8Function)


class LayerNormMLP(LayerNormMLPContract, SplitBackwardModule):
    """``y = fc2(act(fc1(norm(x))))``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.LayerNormMLP`` (the
    shared contract: :class:`~splitgrad.reference.contract.LayerNormMLPContract`). One
    deferrable entry per backward writes ``dW2``, ``db2``, ``dW1``, ``db1`` in that order. See
    the module docstring for the saved-vs-recomputed activation choice.
    """

    #: Recompute ``act(fc1_out)`` in backward instead of keeping it from the forward.
    recompute_activation: bool = False
    #: ``"auto"`` or ``"cuda"``: whether the norm takes CUDA's gamma/beta branch on
    #: CUDA only or on every device (see :mod:`.norm`).
    norm_kernel: str = "auto"

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        p = self._parameters
        params = (p.get("layer_norm_weight"), p.get("layer_norm_bias"), p.get("fc1_weight"))
        params += (p.get("fc1_bias"), p.get("fc2_weight"), p.get("fc2_bias"))
        if self._plain_call(inp, params, _NAMES, self.hidden_size):
            return self._plain_forward(
                inp,
                params,
                _LayerNormMLPFunction,
                _c_apply,
                is_first_microbatch,
                self.hidden_size,
            )
        x, recipe = self._check_input(inp, self.hidden_size)
        try:
            params = tuple(p[name] for name in _NAMES)
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        if self._tp is not None:
            return tp_forward(self, inp, x, recipe, is_first_microbatch, params, _TP_APPLY)
        y = self._run_forward(x, recipe, is_first_microbatch, _NAMES, params, _apply, _fp8_forward)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.hidden_size)
