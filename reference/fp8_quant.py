"""FP8 casts and quantizers: every rounding point of SPEC §6, in plain torch.

Formats
  E4M3 (``torch.float8_e4m3fn``): largest finite 448, no infinities. E5M2
  (``torch.float8_e5m2``): largest finite 57344. :func:`cast_to_fp8` first clamps to
  ``[-max, max]`` (saturation: finite overflow and +-inf become +-max; NaN stays NaN), then rounds
  to nearest, ties to even (torch's cast), so subnormals and signed zeros behave as IEEE.

Which tensor gets which format (``Format.HYBRID``): activations and weights E4M3, gradients
E5M2. ``Format.E4M3``: E4M3 everywhere. This holds for every recipe (the block recipes default
to ``Format.E4M3``).

Every fp32 ``scale = fp8_max / amax`` below is capped at the largest finite fp32 value
(``FLT_MAX``), so a tensor or block whose amax is tiny (below ~1e-36) still quantizes its zeros
to zeros rather than to ``0 * inf = NaN``.

Quantizing a 2-D tensor ``x`` (N, K) always starts by casting it to float32 (exact for
bf16/fp16/fp32; float64 input rounds here). Then, by recipe:

* per-tensor (``DelayedScaling``, ``Float8CurrentScaling``): one fp32 ``scale``;
  ``data = cast(x * scale)`` (the product is rounded to fp32), ``scale_inv = 1 / scale`` (rounded
  to fp32). The row-wise and column-wise copies are the same tensor.
  Current scaling: ``scale = min(fp8_max / amax(x), FLT_MAX)`` in fp32; ``scale = 1`` when
  amax is 0 or not finite. Delayed scaling: the scale comes from the module's amax history
  (:class:`DelayedScalingState`).
* ``MXFP8BlockScaling``: blocks of 32 consecutive values along the GEMM's reduction axis
  (``axis=1``: along rows, "row-wise"; ``axis=0``: along columns, "column-wise"). Each block's
  ``scale_inv = 2 ** (floor(log2(amax_block)) - emax)`` (E8M0, a power of two; ``emax`` is the
  element format's largest exponent: 8 for E4M3, 15 for E5M2), clamped to
  ``[2**-127, 2**127]``; 1 for an all-zero block; NaN for a block holding inf or NaN (E8M0's NaN,
  as the OCP MX specification: the whole block dequantizes to NaN).
  ``data = cast(x / scale_inv)`` (exact division by a power of two, then saturation: as in the
  OCP specification a block's largest values can exceed fp8_max and saturate).
* ``Float8BlockScaling``: activations and gradients use 1x128 tiles along the reduction axis,
  weights 128x128 blocks (the same blocks serve both GEMM directions). Each tile/block has an
  fp32 ``scale = min(fp8_max / amax, FLT_MAX)`` (1 when amax is 0 or not finite),
  ``data = cast(x * scale)``, ``scale_inv = 1 / scale``.

Dequantization: ``data.to(float32) * scale_inv`` (broadcast over the block), rounded to fp32, or
computed in float64 for the upcast truth. FP8 GEMMs in the reference run on dequantized operands.
"""

from __future__ import annotations

import dataclasses

import torch

from .fp8 import (
    FP8_DTYPES,
    FP8_EMAX,
    FP8_MAX,
    MX_BLOCK,
    TILE,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
)

__all__ = [
    "FP8_DTYPES",
    "fp8_max",
    "cast_to_fp8",
    "QuantizedTensor",
    "DelayedScalingState",
    "format_for",
    "quantize",
]

FLT_MAX = torch.finfo(torch.float32).max


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """``min(fp8_max / amax / 2**margin, FLT_MAX)`` in fp32 where amax is finite and > 0, else
    1 (element-wise over a tensor of amaxes)."""
    usable = torch.isfinite(amax) & (amax > 0)
    scale = torch.clamp(fp8_max(fmt) / amax / (2.0**margin), max=FLT_MAX)
    return torch.where(usable, scale, torch.ones_like(amax))


def fp8_max(fmt: str) -> float:
    """Largest finite value of ``"E4M3"`` (448) or ``"E5M2"`` (57344)."""
    return FP8_MAX[fmt]


def cast_to_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of an fp32 tensor to FP8 ``fmt``."""
    if x.dtype != torch.float32:
        raise TypeError(f"cast_to_fp8 expects float32 input, got {x.dtype}")
    m = FP8_MAX[fmt]
    return torch.clamp(x, -m, m).to(FP8_DTYPES[fmt])


def format_for(recipe: Recipe, role: str) -> str:
    """FP8 format of a tensor of ``role`` (``"input"``, ``"weight"`` or ``"grad_output"``)."""
    fmt = getattr(recipe, "fp8_format", Format.E4M3)
    if fmt == Format.HYBRID and role == "grad_output":
        return "E5M2"
    return "E4M3"


@dataclasses.dataclass
class QuantizedTensor:
    """FP8 ``data`` (same shape as the source) with fp32 ``scale_inv``: a 0-d tensor
    (per-tensor) or one value per block, shaped so it broadcasts after
    :meth:`expanded_scale_inv`."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    block: tuple[int, int]  # (rows, cols) covered by one scale; (0, 0) = whole tensor

    def expanded_scale_inv(self) -> torch.Tensor:
        if self.block == (0, 0):
            return self.scale_inv
        br, bc = self.block
        return self.scale_inv.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` computed (and rounded) in ``dtype``."""
        return self.data.to(dtype) * self.expanded_scale_inv().to(dtype)


class DelayedScalingState:
    """Amax history and scale of one tensor role of one module (``DelayedScaling``).

    ``amax_history[0]`` is the current step's slot. Quantizing records ``amax(x)`` there (the
    max with what the step already recorded). :meth:`update` — run at the end of the module's
    forward for input and weight roles and at the end of its backward (the dgrad part) for the
    grad_output role — computes ``amax`` = max of the history (``"max"``) or
    ``amax_history[0]`` (``"most_recent"``); if it is finite and > 0,
    ``scale = min(fp8_max / amax / 2**margin, FLT_MAX)`` (fp32), else the scale is kept; then
    the history rolls by one (slot 0 becomes 0). Quantization always uses the scale computed at
    the previous update (1 at the start).
    """

    # State persists across forwards, under torch.inference_mode() or not: kept out of inference
    # mode, or a later in-place update outside it would be refused.
    @torch.inference_mode(False)
    def __init__(self, history_len: int, device: torch.device) -> None:
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    @torch.inference_mode(False)
    def record(self, amax: torch.Tensor) -> None:
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax)

    @torch.inference_mode(False)
    def update(self, recipe: DelayedScaling, fmt: str) -> None:
        if recipe.amax_compute_algo == "max":
            amax = self.amax_history.max()
        else:
            amax = self.amax_history[0]
        if torch.isfinite(amax) and amax > 0:
            self.scale = scale_from_amax(amax, fmt, recipe.margin)
        self.amax_history = torch.roll(self.amax_history, 1)
        self.amax_history[0] = 0


def _per_tensor(x32: torch.Tensor, scale: torch.Tensor, fmt: str) -> QuantizedTensor:
    data = cast_to_fp8(x32 * scale, fmt)
    return QuantizedTensor(data, torch.reciprocal(scale), fmt, (0, 0))


def _blocks(x32: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """amax of every (br, bc) block of an (R, C) matrix -> (R // br, C // bc)."""
    r, c = x32.shape
    return x32.abs().reshape(r // br, br, c // bc, bc).amax(dim=(1, 3))


def _mx(x32: torch.Tensor, axis: int, fmt: str) -> QuantizedTensor:
    br, bc = (1, MX_BLOCK) if axis == 1 else (MX_BLOCK, 1)
    amax = _blocks(x32, br, bc)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1)
    shared = torch.clamp(exponent - 1 - FP8_EMAX[fmt], -127, 127).to(torch.float32)
    scale_inv = torch.where(amax > 0, torch.exp2(shared), torch.ones_like(amax))
    scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.full_like(amax, torch.nan))
    q = QuantizedTensor(torch.empty(0), scale_inv, fmt, (br, bc))
    q.data = cast_to_fp8(x32 / q.expanded_scale_inv(), fmt)
    return q


def _block_fp32(x32: torch.Tensor, br: int, bc: int, fmt: str) -> QuantizedTensor:
    scale = scale_from_amax(_blocks(x32, br, bc), fmt)
    q = QuantizedTensor(torch.empty(0), torch.reciprocal(scale), fmt, (br, bc))
    expanded = scale.repeat_interleave(br, dim=0).repeat_interleave(bc, dim=1)
    q.data = cast_to_fp8(x32 * expanded, fmt)
    return q


def quantize(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    axis: int,
    state: DelayedScalingState | None = None,
) -> QuantizedTensor:
    """Quantize a 2-D ``x`` for a GEMM whose reduction runs along ``axis`` (1: along each row,
    0: along each column). ``state`` is required for ``DelayedScaling`` and gets ``amax(x)``
    recorded. See the module docstring for every rounding point."""
    x32 = x.to(torch.float32)
    fmt = format_for(recipe, role)
    if isinstance(recipe, DelayedScaling):
        if x32.numel():
            state.record(x32.abs().max())
        return _per_tensor(x32, state.scale.clone(), fmt)
    if isinstance(recipe, Float8CurrentScaling):
        amax = x32.abs().max() if x32.numel() else torch.zeros((), device=x.device)
        return _per_tensor(x32, scale_from_amax(amax, fmt), fmt)
    if isinstance(recipe, MXFP8BlockScaling):
        return _mx(x32, axis, fmt)
    if isinstance(recipe, Float8BlockScaling):
        if role == "weight":
            return _block_fp32(x32, TILE, TILE, fmt)
        return _block_fp32(x32, 1, TILE, fmt) if axis == 1 else _block_fp32(x32, TILE, 1, fmt)
    raise TypeError(f"unknown FP8 recipe {recipe!r}")
