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
    edge_routes,
    fast_apply,
    fp8_not_differentiable,
    functorch_active,
    take_fp8,
    twin,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value

__all__ = ["Linear"]


_NAMES = ("weight", "bias")


def _backward(module, dy, x, weight, need_x, dests, leaves, overwrite, compiled_graph=False):
    """``(dx, dW, db)``: dgrad now; the wgrad closure run now or queued, writing the leaves the
    forward used (gradients it writes are returned as ``None``); the gradients
    ``torch.autograd.grad`` asked for (``RETURN``) computed and returned, nothing written or
    queued for them. The body of both the eager Function's backward and the compiled op."""
    (to_w, to_b), (w, b) = dests, leaves
    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
    written = (("weight", w),) * need_w + (("bias", b),) * need_b
    named_weights = written[:1] if need_w else ()
    hooked = module._begin_writes(written)
    dx = torch.mm(dy, weight) if need_x else None
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
    return dx, dw, db


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
        if torch.is_grad_enabled() or functorch_active():  # create_graph, torch.func: see .twin
            ctx.param_names, ctx.param_present = _NAMES, ctx.present
            grads = twin.differentiable_backward(ctx, ctx.module, dy, x, ctx.params, ctx.autocast)
            return (*grads, None, None, None)
        dests, leaves = edge_routes(ctx, ctx.present)
        dx, dw, db = _backward(ctx.module, dy, x, weight, need_x, dests, leaves, ctx.overwrite)
        return dx, dw, db, None, None, None


_apply = fast_apply(_LinearFunction)


@compiled.effectful
@torch.library.custom_op("splitgrad::linear_backward", mutates_args=())
def _linear_backward_op(
    handle: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    overwrite: bool,
    need_x: bool,
) -> list[torch.Tensor]:
    """The backward of a compiled ``Linear`` (see :mod:`.compiled`): ``[dx]`` or ``[]``."""
    module = compiled.module_of(handle)
    leaves = compiled.parameters(module, _NAMES)
    dests = compiled.destinations(*leaves)
    compiled.no_returned_gemm_grads(module, zip(_NAMES, dests))
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
        need_x = ctx.needs_input_grad[0]
        if torch.is_grad_enabled() or functorch_active():  # create_graph, torch.func
            fp8_not_differentiable(module)
        (to_w, to_b), (w, b) = edge_routes(ctx, ctx.present)
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        written = (("weight", w),) * need_w + (("bias", b),) * need_b
        module._begin_writes(written)
        dx = fp8.dgrad(dy, need_dx=need_x, keep_dy=to_w is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        dy_q, x_q = fp8.take_wgrad_operands()
        dw = fp8_wgrad_value(module, ctx.weight_dtype, dy_q, x_q) if to_w == RETURN else None
        db = dy.sum(dim=0) if to_b == RETURN else None
        if written:
            part = FP8WgradPart(w, b, dy_q, x_q, dy.sum(dim=0) if need_b else None)
            module._submit_fp8_wgrad([part], written[:need_w], ctx.overwrite, written)
        return dx, dw, db, None, None, None, None


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
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        p = self._parameters
        try:
            weight, bias = p["weight"], p["bias"]
        except KeyError:  # parametrized
            weight, bias = self._params_of(_NAMES)
        if self.fuse_wgrad_accumulation or recipe is not None:
            self._check_forward_params(recipe, (("weight", weight),))
        autocast = self.autocast_dtype()
        if functorch_active():
            with autocast_off(x.device.type):
                y = self._twin_forward(x, _NAMES, (weight, bias), autocast, recipe)
        elif recipe is None and autocast is None:
            y = _apply(x, weight, bias, self, overwrite, None)
        elif recipe is None:
            with autocast_off(x.device.type):
                y = _apply(x, weight, bias, self, overwrite, autocast)
        else:
            self._check_fp8_shapes(recipe, x.shape[0])
            with autocast_off(x.device.type):
                y = _fp8_forward(x, weight, bias, self, overwrite, recipe, autocast)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)


@compiled.eager_only
def _fp8_forward(*args):
    # FP8 runs eagerly inside a compiled graph (one graph break): its quantized operands and
    # delayed-scaling state live in Python objects the compiled backward op cannot take.
    return _LinearFP8Function.apply(*args)
