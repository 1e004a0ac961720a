"""impl ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch
from splitgrad.reference.base import ACCUMULATE, RETURN, gradient_destinations

from . import gemm
from .base import FP8WgradPart, SplitBackwardModule, check_positive
from .fp8 import check_fp8_gemm_shape, update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .norm import check_normalization, create_norm_parameters, norm_bwd, norm_fwd
from .store import WgradEntry

__all__ = ["LayerNormLinear"]


class _LayerNormLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite):
        ctx.module, ctx.overwrite = module, overwrite
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        ctx.save_for_backward(x, ln_weight, ln_bias, ln_out, weight, *stats)
        return gemm.linear_forward(ln_out, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        module: LayerNormLinear = ctx.module
        x, ln_weight, ln_bias, ln_out, weight, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        to_lnw, to_lnb, to_w, to_b = gradient_destinations(
            module.layer_norm_weight, module.layer_norm_bias, module.weight, module.bias
        )
        need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        named_weights = [("weight", module.weight)] if need_w else []
        module._check_main_grads(named_weights)
        dx = d_lnw = d_lnb = None
        if need_x or need_lnw or need_lnb:
            d_ln_out = torch.mm(dy, weight)
            dx, d_lnw, d_lnb = norm_bwd(
                module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
            )
        if need_w or need_b:
            w, b, overwrite = module.weight, module.bias, ctx.overwrite

            def wgrad_closure(dy, ln_out=None):
                module._check_main_grads(named_weights)
                if need_w:
                    module._write_weight_grad(w, dy, ln_out, overwrite)
                if need_b:
                    module._write_bias_grad(b, dy)

            saved = (dy, ln_out.detach()) if need_w else (dy,)
            params = tuple(p for p, n in ((w, need_w), (b, need_b)) if n)
            module._submit_wgrad(WgradEntry(wgrad_closure, saved, params))
        # Asked for by torch.autograd.grad: returned now, nothing written or queued.
        dw = gemm.wgrad(dy, ln_out) if to_w == RETURN else None
        db = dy.sum(dim=0) if to_b == RETURN else None
        return dx, d_lnw, d_lnb, dw, db, None, None


class _LayerNormLinearFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe: the norm in high precision, its output quantized as
    the GEMM input (only its column-wise FP8 copy is kept for wgrad)."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, weight, bias, module, overwrite, recipe):
        need_norm = any(ctx.needs_input_grad[:3])
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        fp8 = FP8GemmOperands(module, recipe)
        y = fp8.fprop(ln_out, weight, bias, keep_x=ctx.needs_input_grad[3], keep_w=need_norm)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        ctx.save_for_backward(x, ln_weight, ln_bias, *stats)
        return y

    @staticmethod
    def backward(ctx, dy):
        module: LayerNormLinear = ctx.module
        fp8, ctx.fp8 = ctx.fp8, None
        x, ln_weight, ln_bias, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        to_lnw, to_lnb, to_w, to_b = gradient_destinations(
            module.layer_norm_weight, module.layer_norm_bias, module.weight, module.bias
        )
        need_lnw, need_lnb = to_lnw is not None, to_lnb is not None
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        need_norm = need_x or need_lnw or need_lnb
        named_weights = [("weight", module.weight)] if need_w else []
        module._check_main_grads(named_weights)
        d_ln_out = fp8.dgrad(dy, need_dx=need_norm, keep_dy=to_w is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
        dx = d_lnw = d_lnb = None
        if need_norm:
            dx, d_lnw, d_lnb = norm_bwd(
                module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
            )
        dy_q, x_q = fp8.take_wgrad_operands()
        dw = fp8_wgrad_value(module, module.weight, dy_q, x_q) if to_w == RETURN else None
        db = dy.sum(dim=0) if to_b == RETURN else None
        if need_w or need_b:
            part = FP8WgradPart(
                module.weight if need_w else None,
                module.bias if need_b else None,
                dy_q,
                x_q,
                dy.sum(dim=0) if need_b else None,
            )
            module._submit_fp8_wgrad([part], named_weights, ctx.overwrite)
        return dx, d_lnw, d_lnb, dw, db, None, None, None


class LayerNormLinear(SplitBackwardModule):
    """``y = norm(x) @ weight^T + bias``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.LayerNormLinear``:
    ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``weight``, ``bias``. Backward
    writes dx and the norm-parameter gradients; ``dW = dy^T norm(x)`` and ``db = sum(dy)`` are
    the deferrable part.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        bias: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        check_positive("in_features", in_features)
        check_positive("out_features", out_features)
        check_normalization(normalization)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        self.in_features, self.out_features = in_features, out_features
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = bool(zero_centered_gamma)
        create_norm_parameters(self, in_features, self._device)
        kw = {"dtype": params_dtype, "device": device}
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        torch.nn.init.normal_(self.weight, std=0.02)
        if self.use_bias:
            self.bias = torch.nn.Parameter(torch.zeros(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        self._init_gemm_parameter_flags()

    def gemm_weight_names(self) -> list[str]:
        return ["weight"]

    def gemm_bias_names(self) -> list[str]:
        return ["bias"] if self.use_bias else []

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        args = (x, self.layer_norm_weight, self.layer_norm_bias, self.weight, self.bias, self)
        if recipe is not None:
            check_fp8_gemm_shape(recipe, "", x.shape[0], self.in_features, self.out_features)
            y = _LayerNormLinearFP8Function.apply(*args, overwrite, recipe)
        else:
            y = _LayerNormLinearFunction.apply(*args, overwrite)
        return y.reshape(*inp.shape[:-1], self.out_features)
