"""impl ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch
from splitgrad.reference.contract import LayerNormLinearContract

from . import compiled, gemm
from ._torch_compat import function_c_apply
from .base import (
    SplitBackwardModule,
    autocast_cast,
    edge_routes,
    fast_apply,
    norm_module_backward,
    take_fp8,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands
from .linear import (
    begin_fp8_writes,
    column_backward,
    fp8_linear_wgrad,
    linear_wgrad,
    tp_begin_writes,
    tp_fp8_column_backward,
    tp_fp8_column_forward,
)
from .norm import norm_bwd, norm_fwd
from .parallel import gather_rows, refuse_differentiated, tp_forward

__all__ = ["LayerNormLinear"]


_NAMES = LayerNormLinearContract._parameter_names


def _backward(
    module, dy, saved, need_x, dests, leaves, overwrite, compiled_graph=False, direct=False
):
    """``(dx, d_layer_norm_weight, d_layer_norm_bias, dW, db)`` from the forward's ``saved``
    tensors: dgrad and the norm backward now, then the ``Linear``'s weight half
    (:func:`.linear.linear_wgrad`) on the norm's output. The body of both the eager Function's
    backward and the compiled op."""
    x, ln_weight, ln_bias, ln_out, weight, *stats = saved
    needs = (need_x, dests[0] is not None, dests[1] is not None)
    d_ln_out = torch.mm(dy, weight) if any(needs) else None
    norm = norm_bwd(module, d_ln_out, x, ln_weight, ln_bias, stats, needs)
    wgrad = linear_wgrad(
        module, dy, ln_out, dests[2:], leaves[2:], overwrite, compiled_graph, direct
    )
    return (*norm, *wgrad)


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, autocast):
        ctx.module, ctx.overwrite = module, overwrite
        ctx.present = (True, ln_bias is not None, True, bias is not None)
        ctx.params, ctx.autocast = (ln_weight, ln_bias, weight, bias), autocast
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: the norm in the parameters' dtype, the GEMM in the
        # autocast dtype.
        if autocast is not None:
            ln_out, weight, bias = autocast_cast(autocast, ln_out, weight, bias)
        ctx.save_for_backward(x, ln_weight, ln_bias, ln_out, weight, *stats)
        return gemm.linear_forward(ln_out, weight, bias)

    # Compiled, it calls the op splitgrad::layernorm_linear_backward (see :mod:`.compiled`).
    backward = norm_module_backward("splitgrad::layernorm_linear_backward", _NAMES, 5, _backward)


_apply = fast_apply(_LayerNormLinearFunction)
_c_apply = function_c_apply(_LayerNormLinearFunction)


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
        dests, leaves = edge_routes(ctx, ctx.present)
        needs = (ctx.needs_input_grad[0], dests[0] is not None, dests[1] is not None)
        written = begin_fp8_writes(module, leaves[2:])
        d_ln_out = fp8.dgrad(dy, need_dx=any(needs), keep_dy=dests[2] is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        norm = norm_bwd(module, d_ln_out, x, ln_weight, ln_bias, stats, needs)
        wgrad = fp8_linear_wgrad(ctx, fp8, dy, dests[2:], leaves[2:], written)
        return *norm, *wgrad, None, None, None, None


_fp8_forward = compiled.eager_apply(_LayerNormLinearFP8Function)


# ---- tensor parallel (SPEC §9, see .parallel): column only --------------------------------

_GEMM_NAMES = _NAMES[2:]


class _LayerNormLinearTPFunction(torch.autograd.Function):
    """``LayerNormLinear`` with ``parallel_mode="column"``: the norm on the rank's rows (under
    SP), its output all-gathered, then the column GEMM. The forward saves the norm's output
    before the gather (the rank's rows, as TransformerEngine does)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, autocast):
        tp = module._tp
        ctx.module, ctx.overwrite = module, overwrite
        ctx.present = (True, ln_bias is not None, True, bias is not None)
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        ln_out, weight, bias = autocast_cast(autocast, ln_out, weight, bias)
        ctx.save_for_backward(x, ln_weight, ln_bias, ln_out, weight, *stats)
        if tp.sequence_parallel:
            ln_out, _ = gather_rows(ln_out, tp)
        return gemm.linear_forward(ln_out, weight, bias)

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        x, ln_weight, ln_bias, ln_out, weight, *stats = ctx.saved_tensors
        dests, leaves = edge_routes(ctx, ctx.present)
        written, hooked = tp_begin_writes(module, _GEMM_NAMES, leaves[2:])
        needs = (ctx.needs_input_grad[0], dests[0] is not None, dests[1] is not None)
        # dgrad, its reduction overlapped with the wgrad, then the norm on the rank's rows.
        d_ln_out, dw, db = column_backward(
            module,
            dy,
            ln_out,
            weight,
            any(needs),
            dests[2:],
            leaves[2:],
            written,
            hooked,
            ctx.overwrite,
        )
        norm = norm_bwd(module, d_ln_out, x, ln_weight, ln_bias, stats, needs)
        return *norm, dw, db, None, None, None


_tp_apply = compiled.eager_apply(_LayerNormLinearTPFunction)


class _LayerNormLinearTPFP8Function(torch.autograd.Function):
    """The column ``LayerNormLinear`` under an FP8 recipe: the norm's high-precision output is
    gathered and the gathered tensor quantized."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, recipe, autocast):
        need_norm = any(ctx.needs_input_grad[:3])
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        ln_out, bias = autocast_cast(autocast, ln_out, bias)
        fp8 = FP8GemmOperands(module, recipe)
        keep_x = ctx.needs_input_grad[3]
        y = tp_fp8_column_forward(ctx, fp8, module, ln_out, weight, bias, keep_x, need_norm)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        ctx.present = (True, ln_bias is not None, True, bias is not None)
        ctx.weight_dtype = weight.dtype
        ctx.save_for_backward(x, ln_weight, ln_bias, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module = ctx.module
        refuse_differentiated(module)
        fp8, ctx.fp8 = ctx.fp8, None
        x_later, ctx.x_later = ctx.x_later, None
        x, ln_weight, ln_bias, *stats = ctx.saved_tensors
        dests, leaves = edge_routes(ctx, ctx.present)
        needs = (ctx.needs_input_grad[0], dests[0] is not None, dests[1] is not None)
        written, _ = tp_begin_writes(module, _GEMM_NAMES, leaves[2:])
        d_ln_out, dw, db = tp_fp8_column_backward(
            ctx, module, fp8, x_later, dy, any(needs), dests[2:], leaves[2:], written
        )
        norm = norm_bwd(module, d_ln_out, x, ln_weight, ln_bias, stats, needs)
        return *norm, dw, db, None, None, None, None


# (plain, FP8): what tp_forward runs; eager even under torch.compile (a graph break).
_TP_APPLY = _tp_apply, compiled.eager_apply(_LayerNormLinearTPFP8Function)


class LayerNormLinear(LayerNormLinearContract, SplitBackwardModule):
    """``y = norm(x) @ weight^T + bias``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.LayerNormLinear`` (the
    shared contract: :class:`~splitgrad.reference.contract.LayerNormLinearContract`). Backward
    writes dx and the norm-parameter gradients; ``dW = dy^T norm(x)`` and ``db = sum(dy)`` are
    the deferrable part.
    """

    #: ``"auto"`` or ``"cuda"``: whether the norm takes CUDA's gamma/beta branch on
    #: CUDA only or on every device (see :mod:`.norm`).
    norm_kernel: str = "auto"

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        p = self._parameters
        params = (p.get("layer_norm_weight"), p.get("layer_norm_bias"), p.get("weight"))
        params += (p.get("bias"),)
        if self._plain_call(inp, params, _NAMES, self.in_features):
            return self._plain_forward(
                inp,
                params,
                _LayerNormLinearFunction,
                _c_apply,
                is_first_microbatch,
                self.out_features,
            )
        x, recipe = self._check_input(inp, self.in_features)
        try:
            params = (p["layer_norm_weight"], p["layer_norm_bias"], p["weight"], p["bias"])
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        if self._tp is not None:
            return tp_forward(self, inp, x, recipe, is_first_microbatch, params, _TP_APPLY)
        y = self._run_forward(x, recipe, is_first_microbatch, _NAMES, params, _apply, _fp8_forward)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
