"""Reference ``GroupedLinear``: ``num_gemms`` Linears over consecutive blocks of rows."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import functional as F
from .base import SplitBackwardModule, WgradEntry, detached
from .contract import (
    ACCUMULATE,
    RETURN,
    GroupedLinearContract,
    autocast_off,
    gradient_destinations,
    without_autocast,
)
from .fp8_gemm import FP8Gemm, update_delayed_scaling

__all__ = ["GroupedLinear"]


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, is_first_microbatch, recipe, autocast, *params):
        n = module.num_gemms
        weights, biases = list(params[:n]), list(params[n:]) or [None] * n
        if autocast is not None:
            # SPEC §2, torch.autocast: as Linear, group by group.
            if recipe is None:
                weights = [w.to(autocast) for w in weights]
            biases = [None if b is None else b.to(autocast) for b in biases]
        ctx.module, ctx.m_splits = module, m_splits
        ctx.overwrite = bool(is_first_microbatch) and module.fuse_wgrad_accumulation
        if recipe is None:
            ctx.fp8 = None
            ctx.save_for_backward(x, *weights)
            return F.grouped_linear_fwd(x, weights, biases, m_splits)
        # FP8: every group quantizes its own rows and weight (own scales and amax histories).
        ctx.fp8 = [FP8Gemm(module, recipe, f"gemm{i}") for i in range(n)]
        outs = [
            g.fprop(xi, w, b) for g, xi, w, b in zip(ctx.fp8, x.split(m_splits), weights, biases)
        ]
        update_delayed_scaling(module, recipe, ("input", "weight"))
        return torch.cat(outs, dim=0)

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module: GroupedLinear = ctx.module
        n, m_splits = module.num_gemms, ctx.m_splits
        fp8, ctx.fp8 = ctx.fp8, None
        need_x = ctx.needs_input_grad[0]
        dest = gradient_destinations(
            *(getattr(module, name) for name in module.gemm_weight_names()),
            *(getattr(module, name) for name in module.gemm_bias_names()),
        )
        to_w, to_b = dest[:n], dest[n:]
        need = [d == ACCUMULATE for d in dest]
        need_w, need_b = need[:n], need[n:]
        named_weights = [
            (f"weight{i}", getattr(module, f"weight{i}")) for i in range(n) if need_w[i]
        ]
        module._begin_wgrad(named_weights)
        if fp8 is None:
            x, *weights = detached(ctx.saved_tensors)
            dx = F.grouped_linear_dgrad(dy, weights, m_splits) if need_x else None
            x_parts = x.split(m_splits)
            fp8 = [None] * n
        else:
            parts = [g.dgrad(dy_i, need_x) for g, dy_i in zip(fp8, dy.split(m_splits))]
            dx = torch.cat(parts, dim=0) if need_x else None
            update_delayed_scaling(module, fp8[0].recipe, ("grad_output",))
            x_parts = [None] * n
        if any(need_w) or any(need_b):

            def wgrad_closure():
                module._begin_wgrad(named_weights)
                writes = []
                for i, dy_i in enumerate(dy.split(m_splits)):
                    if need_w[i]:
                        weight = getattr(module, f"weight{i}")
                        writes.append(module._weight_write(weight, dy_i, x_parts[i], fp8[i]))
                    if need_b and need_b[i]:
                        writes.append(module._bias_write(getattr(module, f"bias{i}"), dy_i))
                return writes

            module._submit_wgrad(WgradEntry(wgrad_closure, ctx.overwrite))
        returned = [None] * len(dest)
        for i, dy_i in enumerate(dy.split(m_splits)):
            if to_w[i] == RETURN:
                weight = getattr(module, f"weight{i}")
                returned[i] = module._returned_weight_grad(weight, dy_i, x_parts[i], fp8[i])
            if to_b and to_b[i] == RETURN:
                returned[n + i] = F.bias_grad(dy_i)
        return (dx, None, None, None, None, None, *returned)


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
        if recipe is not None:
            self._check_fp8_shapes(recipe, splits)
        params = [getattr(self, n) for n in self.gemm_weight_names() + self.gemm_bias_names()]
        autocast = self.autocast_dtype()
        with autocast_off(x.device.type):
            y = _GroupedLinearFunction.apply(
                x, splits, self, is_first_microbatch, recipe, autocast, *params
            )
        return y.reshape(*inp.shape[:-1], self.out_features)
