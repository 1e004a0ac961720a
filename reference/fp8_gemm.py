"""One GEMM ``y = x @ W^T + b`` of a module under an FP8 recipe (SPEC §6).

Which copy feeds which GEMM (each quantized along that GEMM's reduction dimension):

========  ==========================  ===================================
GEMM      operands                    reduction over
========  ==========================  ===================================
forward   q(x) row-wise, q(W) row-wise   K (in_features)
dgrad     q(dy) row-wise, q(W) column-wise  M (out_features)
wgrad     q(dy) column-wise, q(x) column-wise  N (tokens)
========  ==========================  ===================================

For the per-tensor recipes the row-wise and column-wise copies are one tensor; for
``Float8BlockScaling`` the weight's 128x128 blocks serve both directions. Each GEMM multiplies
the *dequantized* operands in the compute dtype (fp32; float64 for float64 parameters — the
upcast truth), and rounds the product once to the output dtype (``params_dtype``; fp32, the
``main_grad`` dtype, for fused wgrad). The bias is added afterwards in ``params_dtype``; bias
gradients are summed from the unquantized ``dy``.

A queued wgrad entry holds the :class:`FP8Gemm` object, i.e. its own quantized ``dy`` and ``x``
copies and their ``scale_inv`` tensors; the delayed-scaling update after a backward replaces the
module's scales but never touches those, so delayed and non-delayed runs are bitwise identical.
"""

from __future__ import annotations

import torch

from .fp8 import DelayedScaling, Recipe
from .fp8_quant import (
    DelayedScalingState,
    Float8BlockScaling,
    MXFP8BlockScaling,
    QuantizedTensor,
    format_for,
    quantize,
)

__all__ = ["FP8Gemm", "update_delayed_scaling"]

ROLES = ("input", "weight", "grad_output")


def _per_tensor(recipe: Recipe) -> bool:
    return not isinstance(recipe, (MXFP8BlockScaling, Float8BlockScaling))


def _states(module: torch.nn.Module, recipe: Recipe, gemm: str) -> dict[str, DelayedScalingState]:
    """The module's delayed-scaling states of ``gemm`` (created on first use, or anew when the
    recipe's history length changes)."""
    if not isinstance(recipe, DelayedScaling):
        return {}
    states = module.fp8_states
    out = {}
    for role in ROLES:
        key = f"{gemm}.{role}" if gemm else role
        state = states.get(key)
        if state is None or state.amax_history.numel() != recipe.amax_history_len:
            state = DelayedScalingState(recipe.amax_history_len, module.fp8_device)
            states[key] = state
        out[role] = state
    return out


def update_delayed_scaling(module: torch.nn.Module, recipe: Recipe, roles: tuple[str, ...]) -> None:
    """Move the amax histories of ``roles`` one step and recompute their scales."""
    if not isinstance(recipe, DelayedScaling):
        return
    for key, state in module.fp8_states.items():
        role = key.rsplit(".", 1)[-1]
        if role in roles:
            state.update(recipe, format_for(recipe, role))


class FP8Gemm:
    """The FP8 operands of one GEMM of one forward/backward, and the three GEMMs on them."""

    def __init__(self, module: torch.nn.Module, recipe: Recipe, gemm: str = "") -> None:
        self.recipe = recipe
        self.states = _states(module, recipe, gemm)
        self.compute_dtype = (
            torch.float64 if module.compute_dtype == torch.float64 else torch.float32
        )
        self.x_col: QuantizedTensor | None = None
        self.w_col: QuantizedTensor | None = None
        self.dy_col: QuantizedTensor | None = None

    def _quantize_both(self, t: torch.Tensor, role: str) -> tuple[QuantizedTensor, QuantizedTensor]:
        row = quantize(t, self.recipe, role, axis=1, state=self.states.get(role))
        if _per_tensor(self.recipe) or (
            role == "weight" and isinstance(self.recipe, Float8BlockScaling)
        ):
            return row, row
        return row, quantize(t, self.recipe, role, axis=0)

    def fprop(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``y = deq(q(x)) @ deq(q(W))^T`` rounded to x's dtype, then ``+ b``."""
        x_row, self.x_col = self._quantize_both(x, "input")
        w_row, self.w_col = self._quantize_both(weight, "weight")
        cdt = self.compute_dtype
        y = torch.mm(x_row.dequantize(cdt), w_row.dequantize(cdt).t()).to(x.dtype)
        return y if bias is None else y + bias

    def dgrad(self, dy: torch.Tensor, need_dx: bool) -> torch.Tensor | None:
        """Quantize dy (both copies, recording its amax) and return ``deq(q(dy)) @ deq(q(W))``
        rounded to dy's dtype, or None when dx is not needed. Drops the weight copy."""
        dy_row, self.dy_col = self._quantize_both(dy, "grad_output")
        dx = None
        if need_dx:
            cdt = self.compute_dtype
            dx = torch.mm(dy_row.dequantize(cdt), self.w_col.dequantize(cdt)).to(dy.dtype)
        self.w_col = None
        return dx

    def wgrad(self, out_dtype: torch.dtype) -> torch.Tensor:
        """``deq(q(dy))^T @ deq(q(x))`` (column-wise copies) rounded to ``out_dtype``."""
        cdt = torch.promote_types(self.compute_dtype, out_dtype)
        return torch.mm(self.dy_col.dequantize(cdt).t(), self.x_col.dequantize(cdt)).to(out_dtype)
