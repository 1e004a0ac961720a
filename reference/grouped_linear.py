"""Reference ``GroupedLinear``: ``num_gemms`` Linears over consecutive blocks of rows."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from . import functional as F
from .base import (
    ACCUMULATE,
    RETURN,
    SplitBackwardModule,
    WgradEntry,
    _check_positive,
    detached,
    gradient_destinations,
)
from .fp8_gemm import FP8Gemm, check_fp8_gemm_shape, update_delayed_scaling

__all__ = ["GroupedLinear"]


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, is_first_microbatch, recipe, *params):
        n = module.num_gemms
        weights, biases = list(params[:n]), list(params[n:]) or [None] * n
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
        return (dx, None, None, None, None, *returned)


class GroupedLinear(SplitBackwardModule):
    """``num_gemms`` independent Linears applied to consecutive row blocks of one input.

    Parameters ``weight0`` ... ``weight{n-1}`` (out_features, in_features) and, with ``bias``,
    ``bias0`` ... ``bias{n-1}`` (out_features). Forward: ``module(inp, m_splits,
    is_first_microbatch=None)``: ``m_splits`` holds ``num_gemms`` non-negative ints summing to
    the number of rows of ``inp`` (zeros allowed); group i gets rows
    ``sum(m_splits[:i]) : sum(m_splits[:i+1])``. Every group is exactly a reference ``Linear``
    on ``torch.split(x, m_splits)[i]``; an empty group gets zero gradients. One deferrable
    entry per backward covers all groups (written group by group, weight then bias).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
    ) -> None:
        _check_positive("num_gemms", num_gemms)
        _check_positive("in_features", in_features)
        _check_positive("out_features", out_features)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        for i in range(num_gemms):
            self._add_gemm_weight(f"weight{i}", out_features, in_features)
        for i in range(num_gemms):
            self._add_gemm_bias(f"bias{i}", out_features)

    def _check_m_splits(self, m_splits: object, rows: int) -> list[int]:
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise ValueError(f"m_splits must be a list of {self.num_gemms} ints, got {m_splits!r}")
        try:
            splits = [operator.index(s) for s in m_splits]
        except TypeError:
            raise ValueError(f"m_splits entries must be ints, got {list(m_splits)!r}") from None
        if len(splits) != self.num_gemms:
            raise ValueError(
                f"m_splits must have num_gemms={self.num_gemms} entries, "
                f"got {len(splits)}: {splits}"
            )
        if any(isinstance(s, bool) for s in m_splits) or min(splits) < 0:
            raise ValueError(f"m_splits entries must be non-negative ints, got {splits}")
        if sum(splits) != rows:
            raise ValueError(f"m_splits {splits} sum to {sum(splits)}, but inp has {rows} rows")
        return splits

    def forward(
        self, inp: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.in_features)
        splits = self._check_m_splits(m_splits, x.shape[0])
        if recipe is not None:
            for i, rows in enumerate(splits):
                check_fp8_gemm_shape(recipe, f"gemm{i}", rows, self.in_features, self.out_features)
        params = [getattr(self, n) for n in self.gemm_weight_names() + self.gemm_bias_names()]
        y = _GroupedLinearFunction.apply(x, splits, self, is_first_microbatch, recipe, *params)
        return y.reshape(*inp.shape[:-1], self.out_features)
