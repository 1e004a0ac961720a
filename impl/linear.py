"""impl ``Linear``: ``y = x @ W^T + b`` with a splittable backward."""

from __future__ import annotations

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, LinearContract

from . import compiled, gemm
from . import parallel as tp_ops
from ._torch_compat import function_c_apply
from .base import (
    FP8WgradPart,
    SplitBackwardModule,
    autocast_cast,
    autocast_off,
    backward_routes,
    differentiated,
    edge_routes,
    fast_apply,
    store_grad,
    take_fp8,
    twin_backward,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .parallel import (
    GatherLater,
    TPWgradPart,
    fp8_value_of,
    gather_rows,
    gather_shard,
    reduce_partial_rows,
    refuse_differentiated,
    scale_for_requantize,
    submit_tp_fp8_wgrad,
    tp_forward,
)

__all__ = ["Linear"]


_NAMES = LinearContract._parameter_names


def linear_wgrad(module, dy, x, dests, leaves, overwrite, compiled_graph=False, direct=False):
    """The weight half of the backward of ``y = x @ weight^T + bias`` (also ``LayerNormLinear``'s,
    whose ``x`` is the norm's output): one wgrad closure writing ``dW = dy^T x`` and
    ``db = sum(dy)`` into the leaves the forward used, run now or queued; ``(dW, db)`` where
    ``torch.autograd.grad`` asked for them (``RETURN``: computed and returned, nothing written
    or queued for them). ``dests`` / ``leaves``: of (weight, bias); ``direct``: they are direct
    routes (:func:`~.base.backward_routes`): without delay the closure's writes run here."""
    (to_w, to_b), (w, b) = dests, leaves
    if direct and not module.delay_wgrad_compute:
        if w is not None:
            store_grad(w, gemm.wgrad(dy, x))
        if b is not None:
            store_grad(b, dy.sum(dim=0))
        if module._wgrad_hooks and (w is not None or b is not None):
            module._run_hooks()
        return None, None
    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
    written = (("weight", w),) * need_w + (("bias", b),) * need_b
    named_weights = written[:1] if need_w else ()
    hooked = not direct and module._begin_writes(written)
    if written:

        def wgrad_closure(dy, x=None):
            if module.fuse_wgrad_accumulation:
                module._check_main_grads(named_weights)
            if need_w:
                module._write_weight_grad(w, dy, x, overwrite)
            if need_b:
                module._write_bias_grad(b, dy)

        saved = (dy, x.detach()) if need_w else (dy,)
        module._submit_wgrad(wgrad_closure, saved, written, compiled_graph, hooked)
    dw = gemm.wgrad(dy, x) if to_w == RETURN else None
    db = dy.sum(dim=0) if to_b == RETURN else None
    return dw, db


def begin_fp8_writes(module, leaves) -> tuple:
    """The (name, leaf) pairs of (weight, bias) an FP8 backward writes (the leaves
    :func:`~.base.edge_routes` gave: those it accumulates), begun
    (:meth:`~.base.SplitBackwardModule._begin_writes`) before its dgrad updates the
    delayed-scaling state."""
    written = tuple((n, leaf) for n, leaf in zip(_NAMES, leaves) if leaf is not None)
    module._begin_writes(written)
    return written


def fp8_linear_wgrad(ctx, fp8, dy, dests, leaves, written) -> tuple:
    """:func:`linear_wgrad` under an FP8 recipe, after ``fp8``'s dgrad (``ctx``: the FP8
    Function's, with ``module``, ``weight_dtype``, ``overwrite``): one entry holding the
    column-wise FP8 copies of dy and x and the reduced bias gradient
    (:meth:`~.base.SplitBackwardModule._submit_fp8_wgrad`) writes ``written``
    (:func:`begin_fp8_writes`); ``(dW, db)`` where ``torch.autograd.grad`` asked for them."""
    module, (to_w, to_b), (w, b) = ctx.module, dests, leaves
    dy_q, x_q = fp8.take_wgrad_operands()
    dw = fp8_wgrad_value(module, ctx.weight_dtype, dy_q, x_q) if to_w == RETURN else None
    db = dy.sum(dim=0) if to_b == RETURN else None
    if written:
        part = FP8WgradPart(w, b, dy_q, x_q, None if b is None else dy.sum(dim=0))
        module._submit_fp8_wgrad([part], written[: w is not None], ctx.overwrite, written)
    return dw, db


def _backward(module, dy, x, weight, need_x, dests, leaves, overwrite, compiled_graph=False):
    """``(dx, dW, db)``: dgrad now, then :func:`linear_wgrad`. The body of both the eager
    Function's backward and the compiled op."""
    dx = torch.mm(dy, weight) if need_x else None
    return (dx, *linear_wgrad(module, dy, x, dests, leaves, overwrite, compiled_graph))


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite, autocast):
        ctx.module, ctx.overwrite, ctx.present = module, overwrite, (True, bias is not None)
        ctx.params, ctx.autocast = (weight, bias), autocast
        if autocast is not None:
            weight, bias = autocast_cast(autocast, weight, bias)  # SPEC §2: the GEMM's dtype
        ctx.save_for_backward(x, weight)
        if bias is None:
            return torch.mm(x, weight.t())
        return torch.addmm(bias, x, weight.t())  # gemm.linear_forward, one call fewer

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        if torch.compiler.is_compiling():
            out = torch.ops.splitgrad.linear_backward(
                ctx.module._handle, dy, x, weight, ctx.overwrite, need_x
            )
            return (out[0] if need_x else None), None, None, None, None, None
        if differentiated():  # create_graph, torch.func: see .twin
            return twin_backward(ctx, _NAMES, dy, x)
        module = ctx.module
        dests, leaves, direct = backward_routes(ctx, module, ctx.present)
        # _backward's body, inlined (a call fewer per backward).
        dx = torch.mm(dy, weight) if need_x else None
        dw, db = linear_wgrad(module, dy, x, dests, leaves, ctx.overwrite, direct=direct)
        return dx, dw, db, None, None, None


_apply = fast_apply(_LinearFunction)
_c_apply = function_c_apply(_LinearFunction)


@compiled.backward_op("splitgrad::linear_backward")
def _linear_backward_op(
    handle: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    overwrite: bool,
    need_x: bool,
) -> list[torch.Tensor]:
    """The backward of a compiled ``Linear`` (see :mod:`.compiled`): ``[dx]`` or ``[]``."""
    module, leaves, dests = compiled.op_targets(handle, _NAMES)
    with autocast_off(dy.device.type):
        dx, _, _ = _backward(module, dy, x, weight, need_x, dests, leaves, overwrite, True)
    return [dx] if need_x else []


@_linear_backward_op.register_fake
def _(handle, dy, x, weight, overwrite, need_x):
    return [x.new_empty(x.shape)] if need_x else []


class _LinearFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe (SPEC §6): three FP8 GEMMs, see :mod:`.fp8_gemm`."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite, recipe, autocast):
        need_x, need_w = ctx.needs_input_grad[:2]
        # SPEC §2 under torch.autocast: x comes in the autocast dtype (the output's), the bias
        # is cast to it, the weight is quantized from its own dtype.
        (bias,) = autocast_cast(autocast, bias)
        fp8 = FP8GemmOperands(module, recipe)
        y = fp8.fprop(x, weight, bias, keep_x=need_w, keep_w=need_x)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        ctx.present, ctx.weight_dtype = (True, bias is not None), weight.dtype
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module, fp8 = take_fp8(ctx)
        dests, leaves = edge_routes(ctx, ctx.present)
        written = begin_fp8_writes(module, leaves)
        dx = fp8.dgrad(dy, need_dx=ctx.needs_input_grad[0], keep_dy=dests[0] is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        dw, db = fp8_linear_wgrad(ctx, fp8, dy, dests, leaves, written)
        return dx, dw, db, None, None, None, None


_fp8_forward = compiled.eager_apply(_LinearFP8Function)


# ---- tensor parallel (SPEC §9, see .parallel) -------------------------------------------------


def tp_linear_wgrad(
    module, dy, x, dests, leaves, written, hooked, overwrite, gather=None, bias_rows=None
):
    """:func:`linear_wgrad` of a TP module: one closure writing ``dW = dy^T x`` and ``db``, run
    now or queued; ``(dW, db)`` where ``torch.autograd.grad`` asked for them. ``gather``:
    ``"x"`` or ``"dy"`` when that operand is the rank's shard of the full sequence, which the
    closure all-gathers (``wgrad_gather="backward_dw"``); ``bias_rows``: ``(start, count)`` of
    the rows of a gathered ``dy`` that are this rank's own (a row layer under SP: its bias
    gradient is the partial sum over them). ``written`` / ``hooked``: from ``_begin_writes``.
    The entry's ``saved`` is ``(dy, x)``, or ``(dy,)`` when only the bias is written."""
    tp = module._tp
    (to_w, to_b), (w, b) = dests, leaves
    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
    named_weights = written[:1] if need_w else ()
    gather_x, gather_dy = gather == "x", gather == "dy"
    if written:

        def wgrad_closure(dy, x=None):
            module._check_main_grads(named_weights)
            if need_w:
                dy_w = gather_shard(module, dy) if gather_dy else dy
                x_w = gather_shard(module, x) if gather_x else x
                module._write_weight_grad(w, dy_w, x_w, overwrite)
                del dy_w, x_w
            if need_b:
                module._write_bias_grad(b, dy if bias_rows is None else dy.narrow(0, *bias_rows))

        saved = (dy, x.detach()) if need_w else (dy,)
        module._submit_wgrad(wgrad_closure, saved, written, False, hooked)
    dw = db = None
    if to_w == RETURN:
        dy_w = gather_rows(dy, tp)[0] if gather_dy else dy
        dw = gemm.wgrad(dy_w, gather_rows(x, tp)[0] if gather_x else x)
    if to_b == RETURN:
        db = (dy if bias_rows is None else dy.narrow(0, *bias_rows)).sum(dim=0)
    return dw, db


def tp_begin_writes(module, names, leaves) -> tuple[tuple, bool]:
    """``(written, hooked)``: the (name, leaf) pairs a TP backward writes, begun
    (:meth:`~.base.SplitBackwardModule._begin_writes`: ``main_grad`` checked) before its first
    collective."""
    written = tuple((n, leaf) for n, leaf in zip(names, leaves) if leaf is not None)
    return written, module._begin_writes(written)


def column_backward(module, dy, x, weight, need_dx, dests, leaves, written, hooked, overwrite):
    """``(dx, dW, db)`` of a column GEMM ``y = x_full @ W_r^T + b_r`` (``x``: the rank's rows
    under SP, else the whole input), as TransformerEngine overlaps it: under SP the re-gather
    of x starts before the dgrad GEMM and is waited after it; the dgrad's reduction
    (reduce-scatter under SP, all-reduce otherwise) starts after it and is waited after the
    wgrad (which runs here without delay)."""
    tp = module._tp
    to_w = dests[0]
    later = tp.gather_in_backward_dw
    x_full, gathering = x, None
    if tp.sequence_parallel and to_w is not None and not later:
        x_full, gathering = gather_rows(x, tp, async_op=True)
    dx = torch.mm(dy, weight) if need_dx else None
    tp_ops.wait(gathering)
    dx, reducing = reduce_partial_rows(dx, tp)
    gather = "x" if tp.sequence_parallel and later else None
    dw, db = tp_linear_wgrad(
        module, dy, x_full, dests, leaves, written, hooked, overwrite, gather=gather
    )
    tp_ops.wait(reducing)
    return dx, dw, db


def row_backward(module, dy, x, weight, need_dx, dests, leaves, written, hooked, overwrite):
    """``(dx, dW, db)`` of a row GEMM ``y = reduce(x_r @ W_r^T) + b``: under SP ``dy`` (the
    rank's rows) is all-gathered first; dgrad and wgrad read the full ``dy``, the bias gradient
    the rank's own rows (a partial sum)."""
    tp = module._tp
    to_w = dests[0]
    dy_full = dy
    if tp.sequence_parallel and (need_dx or to_w is not None):
        dy_full, _ = gather_rows(dy, tp)
    dx = torch.mm(dy_full, weight) if need_dx else None
    if dy_full is dy or to_w is None:  # the rank's own dy serves everything left
        operand, gather, bias_rows = dy, None, None
    elif tp.gather_in_backward_dw:
        operand, gather, bias_rows = dy, "dy", None
    else:
        operand, gather, bias_rows = dy_full, None, (tp.rank * dy.shape[0], dy.shape[0])
    del dy_full
    dw, db = tp_linear_wgrad(
        module, operand, x, dests, leaves, written, hooked, overwrite, gather, bias_rows
    )
    return dx, dw, db


class _LinearTPFunction(torch.autograd.Function):
    """``Linear`` with ``parallel_mode`` "column" or "row" (SPEC §9). The forward saves the
    input as given (under column + SP: the rank's rows only, as TransformerEngine does)."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite, autocast):
        tp = module._tp
        ctx.module, ctx.overwrite, ctx.present = module, overwrite, (True, bias is not None)
        weight, bias = autocast_cast(autocast, weight, bias)
        ctx.save_for_backward(x, weight)
        if module.parallel_mode == "column":
            if tp.sequence_parallel:
                x, _ = gather_rows(x, tp)
            return gemm.linear_forward(x, weight, bias)
        y = torch.mm(x, weight.t())
        if tp.sequence_parallel:
            y, _ = tp_ops.reduce_scatter_rows(y, tp)
        else:
            tp_ops.all_reduce_(y, tp)
        return y if bias is None else y.add_(bias)  # the bias is whole: added once, after

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        x, weight = ctx.saved_tensors
        dests, leaves = edge_routes(ctx, ctx.present)
        written, hooked = tp_begin_writes(module, _NAMES, leaves)
        body = column_backward if module.parallel_mode == "column" else row_backward
        need_x = ctx.needs_input_grad[0]
        grads = body(module, dy, x, weight, need_x, dests, leaves, written, hooked, ctx.overwrite)
        return *grads, None, None, None


_tp_apply = compiled.eager_apply(_LinearTPFunction)


def tp_fp8_column_forward(ctx, fp8, module, x, weight, bias, keep_x, keep_w):
    """The FP8 forward of a column GEMM: under SP the high-precision rows are gathered and the
    full input quantized (its amax is the group's). Sets ``ctx.x_later`` (the
    :class:`~.parallel.GatherLater` of ``wgrad_gather="backward_dw"``, else None)."""
    tp = module._tp
    later = keep_x and tp.gather_in_backward_dw
    x_full = gather_rows(x, tp)[0] if tp.sequence_parallel else x
    y = fp8.fprop(x_full, weight, bias, keep_x=keep_x and not later, keep_w=keep_w)
    ctx.x_later = None
    if later:
        scale = scale_for_requantize(fp8.states, "input")
        ctx.x_later = GatherLater(x.detach(), "input", scale)
    return y


def tp_fp8_row_forward(fp8, module, x, weight, bias, keep_x, keep_w):
    """The FP8 forward of a row GEMM: ``q(x_r) q(W_r)^T`` reduced over the group (scattered
    along rows under SP), then the whole bias."""
    tp = module._tp
    y = fp8.fprop(x, weight, None, keep_x=keep_x, keep_w=keep_w)
    if tp.sequence_parallel:
        y, _ = tp_ops.reduce_scatter_rows(y, tp)
    else:
        tp_ops.all_reduce_(y, tp)
    return y if bias is None else y.add_(bias.to(y.dtype))


def tp_fp8_row_dgrad(fp8, module, dy, need_dx, keep_dy):
    """``(dx, later)`` of a row GEMM under FP8: ``dy`` all-gathered under SP (every rank
    quantizes the same full tensor, so its amax is the group's) and its dgrad; ``later``: the
    :class:`~.parallel.GatherLater` of the rank's rows under ``wgrad_gather="backward_dw"``
    (else None, and ``fp8`` keeps the quantized copy). Records dy's amax; the caller updates
    the delayed-scaling state after."""
    tp = module._tp
    later = keep_dy and tp.gather_in_backward_dw
    dy_full = gather_rows(dy, tp)[0] if tp.sequence_parallel else dy
    scale = scale_for_requantize(fp8.states, "grad_output") if later else None
    dx = fp8.dgrad(dy_full, need_dx=need_dx, keep_dy=keep_dy and not later)
    return dx, (GatherLater(dy.detach().contiguous(), "grad_output", scale) if later else None)


def tp_fp8_wgrad(ctx, module, fp8, dy, dy_op, x_op, dests, leaves, written) -> tuple:
    """:func:`fp8_linear_wgrad` of a TP module: one entry (:func:`~.parallel.
    submit_tp_fp8_wgrad`) whose operands are quantized copies or shards to gather in
    ``backward_dw()``; the bias gradient is summed from the rank's own unquantized ``dy`` (a
    partial sum for a row layer under SP). ``ctx``: the Function's, with ``overwrite`` and
    ``weight_dtype``. ``(dW, db)`` where ``torch.autograd.grad`` asked for them."""
    (to_w, to_b), (w, b) = dests, leaves
    recipe = fp8.recipe
    dw = db = None
    if to_w == RETURN:
        dy_q = fp8_value_of(module, recipe, dy_op)
        dw = fp8_wgrad_value(module, ctx.weight_dtype, dy_q, fp8_value_of(module, recipe, x_op))
    if to_b == RETURN:
        db = dy.sum(dim=0)
    if written:
        part = TPWgradPart(w, b, dy_op, x_op, None if b is None else dy.sum(dim=0))
        named_weights = written[: w is not None]
        submit_tp_fp8_wgrad(module, recipe, [part], named_weights, ctx.overwrite, written)
    return dw, db


def tp_fp8_column_backward(ctx, module, fp8, x_later, dy, need_dx, dests, leaves, written):
    """``(dx, dW, db)`` of a column GEMM under FP8: dgrad, its reduction started (reduce-scatter
    under SP, all-reduce otherwise), the wgrad entry (run now without delay), then the wait.
    The entry's x operand: the gathered input's quantized copy from the forward, or
    ``x_later`` (the rank's rows, ``wgrad_gather="backward_dw"``)."""
    dx = fp8.dgrad(dy, need_dx=need_dx, keep_dy=dests[0] is not None)
    update_delayed_scaling(module, fp8.recipe, ("grad_output",))
    dx, reducing = reduce_partial_rows(dx, module._tp)
    dy_op, x_op = fp8.take_wgrad_operands()
    x_op = x_later if x_later is not None else x_op
    dw, db = tp_fp8_wgrad(ctx, module, fp8, dy, dy_op, x_op, dests, leaves, written)
    tp_ops.wait(reducing)
    return dx, dw, db


class _LinearTPFP8Function(torch.autograd.Function):
    """``Linear`` with a parallel mode under an FP8 recipe: the high-precision operand is
    gathered and the gathered tensor quantized."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite, recipe, autocast):
        need_x, need_w = ctx.needs_input_grad[:2]
        (bias,) = autocast_cast(autocast, bias)
        fp8 = FP8GemmOperands(module, recipe)
        if module.parallel_mode == "column":
            y = tp_fp8_column_forward(ctx, fp8, module, x, weight, bias, need_w, need_x)
        else:
            ctx.x_later = None
            y = tp_fp8_row_forward(fp8, module, x, weight, bias, need_w, need_x)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        ctx.present, ctx.weight_dtype = (True, bias is not None), weight.dtype
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        fp8, ctx.fp8 = ctx.fp8, None
        x_later, ctx.x_later = ctx.x_later, None
        dests, leaves = edge_routes(ctx, ctx.present)
        written, _ = tp_begin_writes(module, _NAMES, leaves)
        need_x = ctx.needs_input_grad[0]
        if module.parallel_mode == "column":
            grads = tp_fp8_column_backward(
                ctx, module, fp8, x_later, dy, need_x, dests, leaves, written
            )
            return *grads, None, None, None, None
        dx, dy_later = tp_fp8_row_dgrad(fp8, module, dy, need_x, dests[0] is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        dy_op, x_op = fp8.take_wgrad_operands()
        dy_op = dy_later if dy_later is not None else dy_op
        dw, db = tp_fp8_wgrad(ctx, module, fp8, dy, dy_op, x_op, dests, leaves, written)
        return dx, dw, db, None, None, None, None


# (plain, FP8): what tp_forward runs; eager even under torch.compile (a graph break).
_TP_APPLY = _tp_apply, compiled.eager_apply(_LinearTPFP8Function)


class Linear(LinearContract, SplitBackwardModule):
    """``y = x @ weight^T + bias`` over the last dimension of ``inp``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.Linear`` (the
    constructor, parameters and input checks are the shared contract,
    :class:`~splitgrad.reference.contract.LinearContract`). Backward computes ``dx = dy @ W``
    now; ``dW = dy^T x`` and ``db = sum(dy)`` run now or, with ``delay_wgrad_compute=True``, at
    :meth:`backward_dw`. With a ``tp_group`` and a ``parallel_mode`` (SPEC §9) it runs the
    column or row Functions above (collectives: :mod:`.parallel`).
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        p = self._parameters
        params = (p.get("weight"), p.get("bias"))
        k = self.in_features
        if self._plain_call(inp, params, _NAMES, k):
            return self._plain_forward(
                inp, params, _LinearFunction, _c_apply, is_first_microbatch, self.out_features
            )
        x, recipe = self._check_input(inp, k)
        try:
            params = (p["weight"], p["bias"])
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        if self._tp is not None:
            return tp_forward(self, inp, x, recipe, is_first_microbatch, params, _TP_APPLY)
        y = self._run_forward(x, recipe, is_first_microbatch, _NAMES, params, _apply, _fp8_forward)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
