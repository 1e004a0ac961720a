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

    def wgrad(self, out_dtype: torch.dtype, module: torch.nn.Module | None = None) -> torch.Tensor:
        """``deq(q(dy))^T @ deq(q(x))`` (column-wise copies) rounded to ``out_dtype``; a copy
        kept as a shard (:meth:`quantize_in_w`) is gathered and quantized first."""
        cdt = torch.promote_types(self.compute_dtype, out_dtype)
        dy_col, x_col = (
            c.quantized(module) if isinstance(c, _QuantizeInW) else c
            for c in (self.dy_col, self.x_col)
        )
        return torch.mm(dy_col.dequantize(cdt).t(), x_col.dequantize(cdt)).to(out_dtype)

    def quantize_in_w(self, operand: str, shard: torch.Tensor, gather) -> None:
        """SPEC §9, ``wgrad_gather="backward_dw"``: drop the column-wise copy of ``operand``
        (``"x"`` or ``"dy"``), quantized from the gathered tensor a moment ago, and keep this
        rank's high-precision ``shard`` instead; the wgrad gathers it again (``gather(shard,
        module)``) and quantizes it the same way: with the scale used just now (delayed
        scaling; recording no amax), or from the data itself (the other recipes), so the bytes
        are the same. Call it before the delayed-scaling update that follows the quantization."""
        role = "input" if operand == "x" else "grad_output"
        state = self.states.get(role)
        scale = None if state is None else state.scale.clone()
        setattr(self, f"{operand}_col", _QuantizeInW(shard, gather, self.recipe, role, scale))


class _FixedScale:
    """A delayed-scaling state for quantizing again with a scale already used: it records
    nothing (the amax was recorded when the tensor was first quantized)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def record(self, amax: torch.Tensor) -> None:
        pass


class _QuantizeInW:
    """A column-wise FP8 copy kept as a high-precision shard until the wgrad runs."""

    def __init__(self, shard, gather, recipe, role, scale) -> None:
        self.shard, self.gather, self.recipe, self.role, self.scale = (
            shard,
            gather,
            recipe,
            role,
            scale,
        )

    def quantized(self, module: torch.nn.Module) -> QuantizedTensor:
        full = self.gather(self.shard, module)
        state = None if self.scale is None else _FixedScale(self.scale)
        return quantize(full, self.recipe, self.role, axis=0, state=state)
