"""FP8 quantizers of splitgrad.impl (SPEC §6): casts, scales, delayed-scaling state.

Bit-for-bit the contract the reference states in ``splitgrad.reference.fp8_quant`` (property
P13): every quantity below is computed by the same IEEE operations in the same dtype, so the FP8
bytes and the ``scale_inv`` tensors are identical. What differs is how the work is laid out:

* a per-tensor amax without an ``abs()`` temporary: ``torch.aminmax`` reads the tensor once and
  ``max(|min|, |max|)`` is exact (NaN propagates through both; for float64 input the max rounds
  to fp32 afterwards, which equals the max of the rounded values because rounding is monotone);
* block scales broadcast through views of the (rows, blocks, 32|128) shape instead of
  materialised ``repeat_interleave`` copies;
* the scaled fp32 product is clamped and cast in place (amax, scale and cast are three passes;
  torch has no fused FP8 cast-with-amax kernel to use instead);
* per-tensor recipes quantize once for both GEMM directions; the column-wise copy of an MXFP8 or
  1x128-tile operand is a second quantization along the other axis.

Rounding points (same as the reference): the source is cast to fp32 first (float64 rounds
there). Every ``fp8_max / amax`` scale is capped at FLT_MAX (:func:`scale_for`). Per-tensor:
``data = cast(x * scale)``, ``scale_inv = 1 / scale`` (fp32); current scaling takes
``scale = min(fp8_max / amax, FLT_MAX)`` (1 when amax is 0 or not finite), delayed scaling the
state's scale from the previous update. MXFP8: per 32 values along the reduction axis
``scale_inv = 2**clamp(e - 1 - emax, -127, 127)`` with ``e`` the ``frexp`` exponent of the block
amax and ``emax`` 8 (E4M3) or 15 (E5M2) (so ``floor(log2(amax)) - emax``; 1 for an all-zero
block, NaN for a block holding inf or NaN), ``data = cast(x / scale_inv)``. Float8BlockScaling:
per 1x128 tile (activations, gradients) or 128x128 block (weights)
``scale = min(fp8_max / amax, FLT_MAX)`` (1 when amax is 0 or not finite),
``data = cast(x * scale)``, ``scale_inv = 1 / scale``. ``cast`` clamps to
``[-fp8_max, fp8_max]`` (saturation; NaN stays NaN) and rounds to nearest even. Gradients are
E5M2 under ``Format.HYBRID`` for every recipe.
"""

from __future__ import annotations

import dataclasses

import torch
from splitgrad.reference import fp8 as recipes
from splitgrad.reference.fp8 import FP8_DTYPES, FP8_MAX, MX_BLOCK, TILE, Recipe
from splitgrad.reference.fp8 import FP8_EMAX as _EMAX

__all__ = [
    "FP8_DTYPES",
    "FP8_MAX",
    "ROLES",
    "Float8Tensor",
    "DelayedScalingState",
    "fp8_format",
    "quantize",
    "is_per_tensor",
    "delayed_scaling_states",
    "update_delayed_scaling",
]

_FLT_MAX = torch.finfo(torch.float32).max
ROLES = ("input", "weight", "grad_output")
PER_TENSOR = (0, 0)


def fp8_format(recipe: Recipe, role: str) -> str:
    """``"E5M2"`` for gradients under ``Format.HYBRID`` (every recipe), else ``"E4M3"``."""
    hybrid = getattr(recipe, "fp8_format", recipes.Format.E4M3) == recipes.Format.HYBRID
    if hybrid and role == "grad_output":
        return "E5M2"
    return "E4M3"


def scale_for(amax: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """fp32 ``min(fp8_max / amax / 2**margin, FLT_MAX)`` where amax is finite and > 0, else 1.

    The cap keeps a tiny amax (< ~1e-36) from giving an infinite scale, which would turn the
    tensor's zeros into ``0 * inf = NaN``."""
    fresh = torch.clamp(FP8_MAX[fmt] / amax / (2.0**margin), max=_FLT_MAX)
    return torch.where(torch.isfinite(amax) & (amax > 0), fresh, torch.ones_like(amax))


def is_per_tensor(recipe: Recipe) -> bool:
    """Whether ``recipe`` scales whole tensors (delayed or current scaling)."""
    return isinstance(recipe, (recipes.DelayedScaling, recipes.Float8CurrentScaling))


@dataclasses.dataclass
class Float8Tensor:
    """One quantized 2-D operand.

    ``data``: FP8 values in the source's (rows, cols) layout, or, with ``transposed=True``, stored
    as the contiguous (cols, rows) transpose (the layout a CUDA FP8 GEMM wants for some operands).
    ``scale_inv``: fp32, a 0-d tensor (per-tensor) or one value per block of ``block`` =
    (rows, cols) source elements, shaped ``(rows // block[0], cols // block[1])``.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    block: tuple[int, int] = PER_TENSOR
    transposed: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        """The source's (rows, cols)."""
        r, c = self.data.shape
        return (c, r) if self.transposed else (r, c)

    def source(self) -> torch.Tensor:
        """``data`` as a (rows, cols) view (a transposed view when stored transposed)."""
        return self.data.t() if self.transposed else self.data

    def with_layout(self, transposed: bool) -> Float8Tensor:
        """The same values stored the other way round if needed (one copy of the FP8 bytes)."""
        if transposed == self.transposed:
            return self
        return dataclasses.replace(self, data=self.data.t().contiguous(), transposed=transposed)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` computed in ``dtype`` as a (rows, cols) tensor (a view of a
        transposed result when stored transposed). Rounds once per element in fp32, like the
        reference's dequantization; exact for MXFP8 (powers of two) and in float64."""
        values = self.data.to(dtype)
        scale = self.scale_inv.to(dtype)
        if self.block == PER_TENSOR:
            return values * scale
        br, bc = self.block
        if self.transposed:
            return _times_blocks(values, scale.t(), bc, br).t()
        return _times_blocks(values, scale, br, bc)


def _times_blocks(values: torch.Tensor, per_block: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """``values * per_block`` broadcast over (br, bc) blocks of a contiguous (R, C) tensor."""
    r, c = values.shape
    v = values.view(r // br, br, c // bc, bc)
    return (v * per_block.view(r // br, 1, c // bc, 1)).view(r, c)


class DelayedScalingState:
    """Amax history and scale of one tensor role of one module (``DelayedScaling``).

    Same layout and update rule as the reference's: ``amax_history[0]`` is the current step's
    slot; :meth:`record` keeps the max of what the step saw; :meth:`update` (end of the forward
    for input/weight roles, end of the backward's dgrad part for grad_output) sets
    ``scale = fp8_max / amax / 2**margin`` in fp32 when that amax (history max, or slot 0 for
    ``"most_recent"``) is finite and > 0, else keeps the scale, then rolls the history by one.
    Updates happen in place and without a host sync (``torch.where``), so a CUDA stream never
    waits for them; queued work never reads these tensors (it holds its own ``scale_inv``).
    """

    # State persists across forwards, under torch.inference_mode() or not: kept out of inference
    # mode, or a later in-place update outside it would be refused.
    @torch.inference_mode(False)
    def __init__(self, history_len: int, device: torch.device) -> None:
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    @torch.inference_mode(False)
    def record(self, amax: torch.Tensor) -> None:
        """Fold one quantized tensor's amax into the current slot."""
        torch.maximum(self.amax_history[0], amax, out=self.amax_history[0])

    @torch.inference_mode(False)
    def update(self, recipe: recipes.DelayedScaling, fmt: str) -> None:
        """Recompute the scale from the history, then move the history one step."""
        hist = self.amax_history
        amax = hist.max() if recipe.amax_compute_algo == "max" else hist[0]
        usable = torch.isfinite(amax) & (amax > 0)
        self.scale.copy_(torch.where(usable, scale_for(amax, fmt, recipe.margin), self.scale))
        hist.copy_(hist.roll(1))
        hist[0] = 0


def _amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as an fp32 0-d tensor (NaN if any NaN); x must be non-empty."""
    lo, hi = torch.aminmax(x)
    return torch.maximum(lo.abs(), hi.abs()).to(torch.float32)


def _blockwise_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    """max |x| of every (br, bc) block of a contiguous (R, C) tensor -> (R // br, C // bc)."""
    r, c = x.shape
    blocks = x.view(r // br, br, c // bc, bc)
    return blocks.abs().amax(dim=(1, 3)).to(torch.float32)


def _cast_(scaled: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of an fp32 tensor we own (clamped in place)."""
    limit = FP8_MAX[fmt]
    return scaled.clamp_(-limit, limit).to(FP8_DTYPES[fmt])


def _scaled_fp32(x: torch.Tensor, x32: torch.Tensor, scale: torch.Tensor, br: int, bc: int):
    """``x32 * scale`` as a new fp32 tensor we may modify (``scale`` per (br, bc) block, or 0-d
    when br == 0)."""
    if br == 0:
        return torch.mul(x32, scale) if x32 is x else x32.mul_(scale)
    r, c = x32.shape
    per_block = scale.view(r // br, 1, c // bc, 1)
    out = torch.mul(x32.view(r // br, br, c // bc, bc), per_block)
    return out.view(r, c)


def _as_fp32(x: torch.Tensor) -> torch.Tensor:
    """Contiguous fp32 values of x (x itself when it already is)."""
    return x.contiguous().to(torch.float32)


def _per_tensor(x: torch.Tensor, scale: torch.Tensor, fmt: str) -> Float8Tensor:
    x32 = _as_fp32(x)
    data = _cast_(_scaled_fp32(x, x32, scale, 0, 0), fmt)
    return Float8Tensor(data, torch.reciprocal(scale), fmt)


def _mxfp8(x: torch.Tensor, axis: int, fmt: str) -> Float8Tensor:
    br, bc = (1, MX_BLOCK) if axis == 1 else (MX_BLOCK, 1)
    x32 = _as_fp32(x)
    amax = _blockwise_amax(x32, br, bc)
    # E8M0: the power of two emax binades below the block amax's binade (frexp gives e with
    # amax = m * 2**e, m in [0.5, 1)); a block holding inf/NaN gets E8M0's NaN (OCP MX).
    exponent = torch.frexp(amax).exponent
    shared = torch.clamp(exponent - 1 - _EMAX[fmt], -127, 127)
    scale_inv = torch.where(
        amax > 0, torch.ldexp(torch.ones_like(amax), shared), torch.ones_like(amax)
    )
    scale_inv = torch.where(torch.isfinite(amax), scale_inv, torch.full_like(amax, torch.nan))
    r, c = x32.shape
    quotient = torch.div(x32.view(r // br, br, c // bc, bc), scale_inv.view(r // br, 1, c // bc, 1))
    data = _cast_(quotient.view(r, c), fmt)
    return Float8Tensor(data, scale_inv, fmt, (br, bc))


def _block_fp32(x: torch.Tensor, br: int, bc: int, fmt: str) -> Float8Tensor:
    x32 = _as_fp32(x)
    scale = scale_for(_blockwise_amax(x32, br, bc), fmt)
    data = _cast_(_scaled_fp32(x, x32, scale, br, bc), fmt)
    return Float8Tensor(data, torch.reciprocal(scale), fmt, (br, bc))


def quantize(
    x: torch.Tensor,
    recipe: Recipe,
    role: str,
    axis: int,
    state: DelayedScalingState | None = None,
) -> Float8Tensor:
    """Quantize a 2-D ``x`` for a GEMM that reduces along ``axis`` (1: along each row, 0: along
    each column) as tensor ``role`` (``"input"``, ``"weight"``, ``"grad_output"``).

    ``DelayedScaling`` needs the role's ``state``; ``amax(x)`` is recorded there (not for an
    empty x). Block recipes need the blocked dimensions to be multiples of 32 / 128 (see
    :func:`splitgrad.reference.contract.check_fp8_gemm_shape`). Returns data in x's layout and
    fp32 ``scale_inv``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if axis not in (0, 1):
        raise ValueError(f"axis must be 0 or 1, got {axis!r}")
    fmt = fp8_format(recipe, role)
    _check_blocks(x, recipe, role, axis)
    if isinstance(recipe, recipes.DelayedScaling):
        if state is None:
            raise ValueError("DelayedScaling needs the role's DelayedScalingState (state=None)")
        if x.numel():
            state.record(_amax(x))
        return _per_tensor(x, state.scale.clone(), fmt)
    if isinstance(recipe, recipes.Float8CurrentScaling):
        if x.numel():
            amax = _amax(x)
        else:
            amax = torch.zeros((), dtype=torch.float32, device=x.device)
        return _per_tensor(x, scale_for(amax, fmt), fmt)
    if isinstance(recipe, recipes.MXFP8BlockScaling):
        return _mxfp8(x, axis, fmt)
    if isinstance(recipe, recipes.Float8BlockScaling):
        if role == "weight":
            return _block_fp32(x, TILE, TILE, fmt)
        return _block_fp32(x, 1, TILE, fmt) if axis == 1 else _block_fp32(x, TILE, 1, fmt)
    raise TypeError(f"unknown FP8 recipe {recipe!r}")


def _check_blocks(x: torch.Tensor, recipe: Recipe, role: str, axis: int) -> None:
    if isinstance(recipe, recipes.MXFP8BlockScaling):
        dims = [(axis, MX_BLOCK)]
    elif isinstance(recipe, recipes.Float8BlockScaling):
        dims = [(0, TILE), (1, TILE)] if role == "weight" else [(axis, TILE)]
    else:
        return
    for dim, multiple in dims:
        if x.shape[dim] % multiple:
            raise ValueError(
                f"{type(recipe).__name__} cannot quantize a {role} of shape {tuple(x.shape)}: "
                f"dimension {dim} ({x.shape[dim]}) must be a multiple of {multiple}"
            )


def delayed_scaling_states(
    module: torch.nn.Module, recipe: Recipe, gemm: str
) -> dict[str, DelayedScalingState]:
    """``{role: state}`` of one GEMM of ``module`` under ``DelayedScaling`` (created on first
    use, or anew when the recipe's history length changes), keyed ``"input"`` or
    ``"fc1.input"`` in ``module.fp8_states``; ``{}`` for the other recipes."""
    if not isinstance(recipe, recipes.DelayedScaling):
        return {}
    device = next(module.parameters()).device
    states = {}
    for role in ROLES:
        key = f"{gemm}.{role}" if gemm else role
        state = module.fp8_states.get(key)
        if state is None or state.amax_history.numel() != recipe.amax_history_len:
            state = DelayedScalingState(recipe.amax_history_len, device)
            module.fp8_states[key] = state
        states[role] = state
    return states


def update_delayed_scaling(module: torch.nn.Module, recipe: Recipe, roles: tuple[str, ...]) -> None:
    """Move every history of ``roles`` in ``module.fp8_states`` one step (DelayedScaling only)."""
    if not isinstance(recipe, recipes.DelayedScaling):
        return
    for key, state in module.fp8_states.items():
        role = key.rsplit(".", 1)[-1]
        if role in roles:
            state.update(recipe, fp8_format(recipe, role))
