"""impl ``Linear``: ``y = x @ W^T + b`` with a splittable backward."""

from __future__ import annotations

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, LinearContract

from . import compiled, gemm
from .base import (
    FP8WgradPart,
    SplitBackwardModule,
    autocast_cast,
    autocast_off,
    differentiated,
    edge_routes,
    fast_apply,
    take_fp8,
    twin_backward,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value

__all__ = ["Linear"]


_NAMES = LinearContract._parameter_names


def linear_wgrad(module, dy, x, dests, leaves, overwrite, compiled_graph=False):
    """The weight half of the backward of ``y = x @ weight^T + bias`` (also ``LayerNormLinear``'s,
    whose ``x`` is the norm's output): one wgrad closure writing ``dW = dy^T x`` and
    ``db = sum(dy)`` into the leaves the forward used, run now or queued; ``(dW, db)`` where
    ``torch.autograd.grad`` asked for them (``RETURN``: computed and returned, nothing written
    or queued for them). ``dests`` / ``leaves``: of (weight, bias)."""
    (to_w, to_b), (w, b) = dests, leaves
    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
    written = (("weight", w),) * need_w + (("bias", b),) * need_b
    named_weights = written[:1] if need_w else ()
    hooked = module._begin_writes(written)
    if written:

        def wgrad_closure(dy, x=None):
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
        dests, leaves = edge_routes(ctx, ctx.present)
        dx, dw, db = _backward(ctx.module, dy, x, weight, need_x, dests, leaves, ctx.overwrite)
        return dx, dw, db, None, None, None


_apply = fast_apply(_LinearFunction)


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


class Linear(LinearContract, SplitBackwardModule):
    """``y = x @ weight^T + bias`` over the last dimension of ``inp``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.Linear`` (the
    constructor, parameters and input checks are the shared contract,
    :class:`~splitgrad.reference.contract.LinearContract`). Backward computes ``dx = dy @ W``
    now; ``dW = dy^T x`` and ``db = sum(dy)`` run now or, with ``delay_wgrad_compute=True``, at
    :meth:`backward_dw`.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        p = self._parameters
        try:
            params = (p["weight"], p["bias"])
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        y = self._run_forward(x, recipe, is_first_microbatch, _NAMES, params, _apply, _fp8_forward)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
