"""impl ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, LayerNormLinearContract

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
from .norm import norm_bwd, norm_fwd

__all__ = ["LayerNormLinear"]


_NAMES = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")


def _backward(module, dy, saved, need_x, dests, leaves, overwrite, compiled_graph=False):
    """``(dx, d_layer_norm_weight, d_layer_norm_bias, dW, db)`` from the forward's ``saved``
    tensors: dgrad and the norm backward now; the wgrad closure run now or queued, writing the
    leaves the forward used; the gradients ``torch.autograd.grad`` asked for returned. The body
    of both the eager Function's backward and the compiled op."""
    x, ln_weight, ln_bias, ln_out, weight, *stats = saved
    to_lnw, to_lnb, to_w, to_b = dests
    w, b = leaves[2:]
    need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
    written = (("weight", w),) * need_w + (("bias", b),) * need_b
    named_weights = written[:1] if need_w else ()
    hooked = module._begin_writes(written)
    dx = d_lnw = d_lnb = None
    if need_x or need_lnw or need_lnb:
        d_ln_out = torch.mm(dy, weight)
        dx, d_lnw, d_lnb = norm_bwd(
            module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
        )
    if written:

        def wgrad_closure(dy, ln_out=None):
            module._check_main_grads(named_weights)
            if need_w:
                module._write_weight_grad(w, dy, ln_out, overwrite)
            if need_b:
                module._write_bias_grad(b, dy)

        saved = (dy, ln_out.detach()) if need_w else (dy,)
        module._submit_wgrad(wgrad_closure, saved, written, compiled_graph, hooked)
    # Asked for by torch.autograd.grad: returned now, nothing written or queued.
    dw = gemm.wgrad(dy, ln_out) if to_w == RETURN else None
    db = dy.sum(dim=0) if to_b == RETURN else None
    return dx, d_lnw, d_lnb, dw, db


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, autocast):
        ctx.module, ctx.overwrite = module, overwrite
        ctx.present = (True, ln_bias is not None, True, bias is not None)
        ctx.params, ctx.autocast = (ln_weight, ln_bias, weight, bias), autocast
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: the norm in the parameters' dtype, the GEMM in the
        # autocast dtype.
        ln_out, weight, bias = autocast_cast(autocast, ln_out, weight, bias)
        ctx.save_for_backward(x, ln_weight, ln_bias, ln_out, weight, *stats)
        return gemm.linear_forward(ln_out, weight, bias)

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        saved = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        if torch.compiler.is_compiling():
            needs = list(ctx.needs_input_grad[:3])
            x, ln_weight, ln_bias, ln_out, weight, *stats = saved
            out = iter(
                torch.ops.splitgrad.layernorm_linear_backward(
                    ctx.module._handle,
                    dy,
                    x,
                    ln_weight,
                    ln_bias,
                    ln_out,
                    weight,
                    stats,
                    ctx.overwrite,
                    needs,
                )
            )
            return (*(next(out) if n else None for n in needs), *(None,) * 5)
        if torch.is_grad_enabled() or functorch_active():  # create_graph, torch.func: see .twin
            ctx.param_names, ctx.param_present = _NAMES, ctx.present
            grads = twin.differentiable_backward(
                ctx, ctx.module, dy, saved[0], ctx.params, ctx.autocast
            )
            return (*grads, None, None, None)
        dests, leaves = edge_routes(ctx, ctx.present)
        grads = _backward(ctx.module, dy, saved, need_x, dests, leaves, ctx.overwrite)
        return (*grads, None, None, None)


_apply = fast_apply(_LayerNormLinearFunction)


@compiled.effectful
@torch.library.custom_op("splitgrad::layernorm_linear_backward", mutates_args=())
def _layernorm_linear_backward_op(
    handle: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    ln_weight: torch.Tensor,
    ln_bias: torch.Tensor | None,
    ln_out: torch.Tensor,
    weight: torch.Tensor,
    stats: list[torch.Tensor],
    overwrite: bool,
    needs: list[bool],
) -> list[torch.Tensor]:
    """The backward of a compiled ``LayerNormLinear`` (see :mod:`.compiled`): the gradients of
    x, layer_norm_weight, layer_norm_bias for which ``needs`` is true."""
    module = compiled.module_of(handle)
    leaves = compiled.parameters(module, _NAMES)
    dests = compiled.destinations(*leaves)
    compiled.no_returned_gemm_grads(module, [("weight", dests[2]), ("bias", dests[3])])
    saved = (x, ln_weight, ln_bias, ln_out, weight, *stats)
    with autocast_off(dy.device.type):
        grads = _backward(module, dy, saved, needs[0], dests, leaves, overwrite, True)[:3]
    likes = (x, ln_weight, ln_bias)
    return compiled.zeros_for_unwanted(
        [g for g, n in zip(grads, needs) if n], [t for t, n in zip(likes, needs) if n]
    )


@_layernorm_linear_backward_op.register_fake
def _(handle, dy, x, ln_weight, ln_bias, ln_out, weight, stats, overwrite, needs):
    return [t.new_empty(t.shape) for t, n in zip((x, ln_weight, ln_bias), needs) if n]


class _LayerNormLinearFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe: the norm in high precision, its output quantized as
    the GEMM input (only its column-wise FP8 copy is kept for wgrad)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, recipe, autocast):
        need_norm = any(ctx.needs_input_grad[:3])
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: the GEMM input (quantized) and the bias in the autocast
        # dtype, the weight quantized from its own dtype.
        ln_out, bias = autocast_cast(autocast, ln_out, bias)
        fp8 = FP8GemmOperands(module, recipe)
        y = fp8.fprop(ln_out, weight, bias, keep_x=ctx.needs_input_grad[3], keep_w=need_norm)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        ctx.present = (True, ln_bias is not None, True, bias is not None)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(x, ln_weight, ln_bias, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module, fp8 = take_fp8(ctx)
        x, ln_weight, ln_bias, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        if torch.is_grad_enabled() or functorch_active():  # create_graph, torch.func
            fp8_not_differentiable(module)
        (to_lnw, to_lnb, to_w, to_b), (_, _, w, b) = edge_routes(ctx, ctx.present)
        need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        need_norm = need_x or need_lnw or need_lnb
        written = (("weight", w),) * need_w + (("bias", b),) * need_b
        module._begin_writes(written)
        d_ln_out = fp8.dgrad(dy, need_dx=need_norm, keep_dy=to_w is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        dx = d_lnw = d_lnb = None
        if need_norm:
            dx, d_lnw, d_lnb = norm_bwd(
                module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
            )
        dy_q, x_q = fp8.take_wgrad_operands()
        dw = fp8_wgrad_value(module, ctx.weight_dtype, dy_q, x_q) if to_w == RETURN else None
        db = dy.sum(dim=0) if to_b == RETURN else None
        if written:
            part = FP8WgradPart(w, b, dy_q, x_q, dy.sum(dim=0) if need_b else None)
            module._submit_fp8_wgrad([part], written[:need_w], ctx.overwrite, written)
        return dx, d_lnw, d_lnb, dw, db, None, None, None, None


class LayerNormLinear(LayerNormLinearContract, SplitBackwardModule):
    """``y = norm(x) @ weight^T + bias``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.LayerNormLinear`` (the
    shared contract: :class:`~splitgrad.reference.contract.LayerNormLinearContract`). Backward
    writes dx and the norm-parameter gradients; ``dW = dy^T norm(x)`` and ``db = sum(dy)`` are
    the deferrable part.
    """

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        p = self._parameters
        try:
            params = (p["layer_norm_weight"], p["layer_norm_bias"], p["weight"], p["bias"])
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        if self.fuse_wgrad_accumulation or recipe is not None:
            self._check_forward_params(recipe, (("weight", params[2]),))
        args = (x, *params, self)
        autocast = self.autocast_dtype()
        if functorch_active():
            with autocast_off(x.device.type):
                y = self._twin_forward(x, _NAMES, params, autocast, recipe)
        elif recipe is None and autocast is None:
            y = _apply(*args, overwrite, None)
        elif recipe is None:
            with autocast_off(x.device.type):
                y = _apply(*args, overwrite, autocast)
        else:
            self._check_fp8_shapes(recipe, x.shape[0])
            with autocast_off(x.device.type):
                y = _fp8_forward(*args, overwrite, recipe, autocast)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)


@compiled.eager_only
def _fp8_forward(*args):
    # FP8 runs eagerly inside a compiled graph (one graph break), see impl.linear.
    return _LayerNormLinearFP8Function.apply(*args)
