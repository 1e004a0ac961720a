"""impl ``Linear``: ``y = x @ W^T + b`` with a splittable backward."""

from __future__ import annotations

import torch

from . import gemm
from .base import SplitBackwardModule, check_positive
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
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
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
        return dx, None, None, None, None


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
        x = self._check_input(inp, self.in_features)
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        y = _LinearFunction.apply(x, self.weight, self.bias, self, overwrite)
        return y.reshape(*inp.shape[:-1], self.out_features)
