"""impl ``Linear``: ``y = x @ W^T + b`` with a splittable backward."""

from __future__ import annotations

import torch
from splitgrad.reference.base import ACCUMULATE, RETURN, gradient_destinations

from . import gemm
from .base import FP8WgradPart, SplitBackwardModule, check_positive
from .fp8 import check_fp8_gemm_shape, update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .store import WgradEntry

__all__ = ["Linear"]


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite):
        ctx.module, ctx.overwrite = module, overwrite
        ctx.save_for_backward(x, weight)
        return gemm.linear_forward(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        module: Linear = ctx.module
        x, weight = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        to_w, to_b = gradient_destinations(module.weight, module.bias)
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        named_weights = [("weight", module.weight)] if need_w else []
        module._check_main_grads(named_weights)
        dx = torch.mm(dy, weight) if need_x else None
        if need_w or need_b:
            w, b, overwrite = module.weight, module.bias, ctx.overwrite

            def wgrad_closure(dy, x=None):
                module._check_main_grads(named_weights)
                if need_w:
                    module._write_weight_grad(w, dy, x, overwrite)
                if need_b:
                    module._write_bias_grad(b, dy)

            saved = (dy, x.detach()) if need_w else (dy,)
            params = tuple(p for p, n in ((w, need_w), (b, need_b)) if n)
            module._submit_wgrad(WgradEntry(wgrad_closure, saved, params))
        # Asked for by torch.autograd.grad: returned now, nothing written or queued.
        dw = gemm.wgrad(dy, x) if to_w == RETURN else None
        db = dy.sum(dim=0) if to_b == RETURN else None
        return dx, dw, db, None, None


class _LinearFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe (SPEC §6): three FP8 GEMMs, see :mod:`.fp8_gemm`."""

    @staticmethod
    def forward(ctx, x, weight, bias, module, overwrite, recipe):
        need_x, need_w = ctx.needs_input_grad[:2]
        fp8 = FP8GemmOperands(module, recipe)
        y = fp8.fprop(x, weight, bias, keep_x=need_w, keep_w=need_x)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, fp8
        return y

    @staticmethod
    def backward(ctx, dy):
        module: Linear = ctx.module
        fp8, ctx.fp8 = ctx.fp8, None
        need_x = ctx.needs_input_grad[0]
        to_w, to_b = gradient_destinations(module.weight, module.bias)
        need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE
        named_weights = [("weight", module.weight)] if need_w else []
        module._check_main_grads(named_weights)
        dx = fp8.dgrad(dy, need_dx=need_x, keep_dy=to_w is not None)
        update_delayed_scaling(module, fp8.recipe, ("grad_output",))
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
        return dx, dw, db, None, None, None


class Linear(SplitBackwardModule):
    """``y = x @ weight^T + bias`` over the last dimension of ``inp``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.Linear``: ``weight``
    (out_features, in_features), ``bias`` (out_features) if ``bias``. Backward computes
    ``dx = dy @ W`` now; ``dW = dy^T x`` and ``db = sum(dy)`` run now or, with
    ``delay_wgrad_compute=True``, at :meth:`backward_dw`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        check_positive("in_features", in_features)
        check_positive("out_features", out_features)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        self.in_features, self.out_features = in_features, out_features
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
        if recipe is not None:
            check_fp8_gemm_shape(recipe, "", x.shape[0], self.in_features, self.out_features)
            y = _LinearFP8Function.apply(x, self.weight, self.bias, self, overwrite, recipe)
        else:
            y = _LinearFunction.apply(x, self.weight, self.bias, self, overwrite)
        return y.reshape(*inp.shape[:-1], self.out_features)
