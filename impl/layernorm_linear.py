"""impl ``LayerNormLinear``: a LayerNorm or RMSNorm, then a ``Linear``."""

from __future__ import annotations

import torch

from . import gemm
from .base import SplitBackwardModule, check_positive
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
        need_x, need_lnw, need_lnb, need_w, need_b = ctx.needs_input_grad[:5]
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
        return dx, d_lnw, d_lnb, None, None, None, None


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
        x = self._check_input(inp, self.in_features)
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        y = _LayerNormLinearFunction.apply(
            x,
            self.layer_norm_weight,
            self.layer_norm_bias,
            self.weight,
            self.bias,
            self,
            overwrite,
        )
        return y.reshape(*inp.shape[:-1], self.out_features)
