"""Reference ``GroupedLinear``: ``num_gemms`` Linears over consecutive blocks of rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import functional as F
from .base import SplitBackwardModule, detached, no_forward_ad, remember_params
from .contract import GroupedLinearContract, autocast_off, without_autocast
from .fp8_gemm import FP8Gemm, update_delayed_scaling
from .linear import _gemm_operands

__all__ = ["GroupedLinear"]


class _GroupedLinearFunction(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, m_splits, module, overwrite, fp8, autocast, *params):
        n = module.num_gemms
        weights, biases = list(params[:n]), list(params[n:]) or [None] * n
        # SPEC §2, torch.autocast: as Linear, group by group.
        pairs = [_gemm_operands(autocast, fp8, w, b) for w, b in zip(weights, biases)]
        if fp8 is None:
            return F.grouped_linear_fwd(x, [w for w, _ in pairs], [b for _, b in pairs], m_splits)
        # FP8: every group quantizes its own rows and weight (own scales and amax histories).
        outs = [g.fprop(xi, w, b) for g, xi, (w, b) in zip(fp8, x.split(m_splits), pairs)]
        update_delayed_scaling(module, fp8[0].recipe, ("input", "weight"))
        return torch.cat(outs, dim=0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, m_splits, module, overwrite, fp8, autocast, *params = inputs
        ctx.module, ctx.m_splits, ctx.overwrite = module, m_splits, overwrite
        ctx.fp8, ctx.autocast = fp8, autocast
        remember_params(ctx, module.gemm_weight_names() + module.gemm_bias_names(), params)
        weights = params[: module.num_gemms]
        ctx.weight_dtypes = [w.dtype for w in weights]
        if fp8 is None:  # under FP8 the quantized copies in ``fp8`` are all the backward needs
            ctx.save_for_backward(x, *weights)

    jvp = no_forward_ad

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: GroupedLinear = ctx.module
        n, m_splits = module.num_gemms, ctx.m_splits
        fp8, targets = module._route(ctx)
        to_w, to_b = targets[:n], targets[n:] or [None] * n
        need_x = ctx.needs_input_grad[0]
        if fp8 is None:
            x, *weights = ctx.saved_tensors
            if not torch.is_grad_enabled():  # otherwise the formulas below are on the graph
                x, *weights = detached((x, *weights))
            weights = [_gemm_operands(ctx.autocast, None, w, None)[0] for w in weights]
            dx = F.grouped_linear_dgrad(dy, weights, m_splits) if need_x else None
            x_parts = x.split(m_splits)
            fp8 = [None] * n
        else:
            parts = [g.dgrad(dy_i, need_x) for g, dy_i in zip(fp8, dy.split(m_splits))]
            dx = torch.cat(parts, dim=0) if need_x else None
            update_delayed_scaling(module, fp8[0].recipe, ("grad_output",))
            x_parts = [None] * n
        dy_parts = dy.split(m_splits)
        # One entry for all groups, group by group.
        gemms = list(zip(to_w, to_b, dy_parts, x_parts, fp8))
        module._submit_gemm_wgrads(gemms, ctx.overwrite)
        dws = [
            module._returned_weight_grad(t, dtype, dy_i, x_i, g)
            for t, dtype, dy_i, x_i, g in zip(to_w, ctx.weight_dtypes, dy_parts, x_parts, fp8)
        ]
        dbs = [module._returned_bias_grad(t, dy_i) for t, dy_i in zip(targets[n:], dy_parts)]
        return (dx, None, None, None, None, None, *dws, *dbs)


class GroupedLinear(GroupedLinearContract, SplitBackwardModule):
    """``num_gemms`` independent Linears applied to consecutive row blocks of one input.

    Parameters ``weight0`` ... ``weight{n-1}`` (out_features, in_features) and, with ``bias``,
    ``bias0`` ... ``bias{n-1}`` (out_features). Forward: ``module(inp, m_splits,
    is_first_microbatch=None)``: ``m_splits`` holds ``num_gemms`` non-negative ints summing to
    the number of rows of ``inp`` (zeros allowed); group i gets rows
    ``sum(m_splits[:i]) : sum(m_splits[:i+1])``. Every group is exactly a reference ``Linear``
    on ``torch.split(x, m_splits)[i]``; an empty group gets zero gradients. One deferrable
    entry per backward covers all groups (written group by group, weight then bias).
    """

    def forward(
        self, inp: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        splits = self._check_m_splits(m_splits, x.shape[0])
        params = [getattr(self, n) for n in self.gemm_weight_names() + self.gemm_bias_names()]
        self._check_forward_params(recipe, list(zip(self.gemm_weight_names(), params)))
        fp8 = None
        if recipe is not None:
            self._check_fp8_shapes(recipe, splits)
            fp8 = [FP8Gemm(self, recipe, f"gemm{i}") for i in range(self.num_gemms)]
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = _GroupedLinearFunction.apply(x, splits, self, overwrite, fp8, autocast, *params)
        return y if inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
