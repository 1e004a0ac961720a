"""FP8 GEMMs of splitgrad.impl: which quantized copy feeds which GEMM, and how each one runs.

========  =====================================  ====================
GEMM      operands (quantized along K)           K
========  =====================================  ====================
forward   q(x) row-wise, q(W) row-wise           in_features
dgrad     q(dy) row-wise, q(W) column-wise       out_features
wgrad     q(dy) column-wise, q(x) column-wise    tokens
========  =====================================  ====================

:class:`FP8GemmOperands` quantizes each tensor once per direction: the forward makes the row-wise
copies of x and W and keeps x's column-wise copy (for wgrad) and W's (for dgrad); the backward
quantizes dy once for dgrad and keeps its column-wise copy for wgrad. Per-tensor recipes and the
128x128 weight blocks serve both directions with one quantization. A queued wgrad entry holds
only the two column-wise FP8 copies, their ``scale_inv`` and the bias gradient (summed from the
unquantized dy during backward, an (M,) vector), i.e. half the bytes of a bf16 entry.

Two ways to run a GEMM; ``module.fp8_gemm`` picks one:

* ``"scaled_mm"``: ``torch._scaled_mm`` (per-tensor scales) or ``torch.nn.functional.scaled_mm``
  (``BlockWise1x32`` for MXFP8, ``BlockWise1x128``/``BlockWise128x128`` for Float8BlockScaling),
  in the operand layouts cuBLAS wants (A row-major, B column-major: the column-wise copies are
  then stored transposed, made once when quantized), with the scale layouts torch checks
  (:func:`_blockwise_scaled_mm`). Used only where a probe on a small problem ran and matched
  the dequantize path (once per device and scaling kind); a refusal ("Invalid scaling
  configuration" for the block kinds on CPU) or a mismatch falls back, loudly on a GPU whose
  capability says the path runs (:mod:`.gemm_paths`).
* ``"dequantize"``: the portable path. Per-tensor: the FP8 values converted exactly to fp32 (or
  float64 for float64 parameters), one GEMM, ``scale_inv_a * scale_inv_b`` applied in the GEMM's
  ``alpha`` (CPU) — the same mathematics as ``_scaled_mm``. Block recipes: each operand
  dequantized (``data * scale_inv``, exact for MXFP8's powers of two, one fp32 rounding for
  Float8BlockScaling, as in the reference), then one GEMM.
* ``"auto"`` (default): ``"scaled_mm"`` on CUDA where the probe passes and every dimension is
  a multiple of 16 (512 for Float8BlockScaling); ``"dequantize"`` elsewhere. On CPU torch
  2.13's ``_scaled_mm`` runs but is a naive kernel: 30 ms at 128^3 and 265 ms at 256^3 against
  0.4 ms for dequantize + fp32 GEMM (measured), so CPU never takes it unless forced (the tests
  force it as the CUDA path's twin). CPU FP8 is for correctness and for the memory of queued
  entries, not speed: converting FP8 bytes is a scalar loop in torch 2.13 (~4.5 ns per value,
  as slow as a lookup table or bit tricks, measured) and the fp32 GEMM has no AMX.

Empty problems (M, N or K of 0: an expert with no tokens, a micro-batch with no rows) never
reach a kernel: :func:`fp8_mm` returns zeros (plus the bias) and :func:`fp8_mm_accumulate_`
zeroes ``out`` when overwriting and leaves it alone otherwise, on every path and recipe. The
check reads the operands' shapes (host ints, no device sync).

Output rounding: fp32 accumulation, scaled, bias added in the compute dtype, then one rounding
to ``params_dtype`` (the reference rounds the product, then adds the bias in ``params_dtype``).
Weight gradients: plain mode rounds ``dW`` to ``params_dtype`` and adds it to ``.grad`` like
autograd; fused mode accumulates into fp32 ``main_grad`` (CPU dequantize path: ``addmm_`` into
it, no temporary; ``_scaled_mm`` has no accumulate, so the scaled path adds a fp32 temporary).
"""

from __future__ import annotations

import functools

import torch

from . import _torch_compat, gemm_paths
from .fp8 import (
    PER_TENSOR,
    Float8Tensor,
    delayed_scaling_states,
    is_per_tensor,
    quantize,
)

__all__ = [
    "FP8_GEMM_PATHS",
    "FP8GemmOperands",
    "fp8_mm",
    "fp8_mm_accumulate_",
    "scaled_mm_works",
    "pack",
    "unpack",
]

FP8_GEMM_PATHS = ("auto", "scaled_mm", "dequantize")
# Alignment torch's FP8 GEMMs get from this module: 16 for per-tensor and MXFP8 (cuBLAS); 512
# for the 128-blocks, so that every scale tensor has a multiple of 4 blocks per dimension (what
# cuBLAS's block-scaled kernels are documented to want; unverified here, see the probe).
_ALIGN = 16
_BLOCK_ALIGN = 512
_SCALED_OUT = (torch.float32, torch.bfloat16, torch.float16)


def _kind(q: Float8Tensor) -> str:
    """``"tensor"``, ``"mx"`` (1x32 E8M0 blocks) or ``"block"`` (1x128 / 128x128 fp32)."""
    if q.block == PER_TENSOR:
        return "tensor"
    return "mx" if 32 in q.block else "block"


# ---- the portable path ---------------------------------------------------------------------


def _operand(q: Float8Tensor, transposed: bool, cdt: torch.dtype):
    """(values in ``cdt`` as the logical GEMM operand, per-tensor factor or None)."""
    if q.block == PER_TENSOR:
        values = q.data.to(cdt)  # exact: every FP8 value is an fp32 value
        values = values.t() if q.transposed else values
        factor = q.scale_inv.to(cdt)
    else:
        values, factor = q.dequantize(cdt), None
    return (values.t() if transposed else values), factor


def _dequantized_mm(a, a_t, b, b_t, cdt, bias, into=None, overwrite=False) -> torch.Tensor:
    """``op(a) @ op(b) (+ bias)`` in ``cdt``; with ``into`` (a ``cdt`` tensor), accumulated into
    it (``overwrite``: replaces it, stale NaN included)."""
    A, fa = _operand(a, a_t, cdt)
    B, fb = _operand(b, b_t, cdt)
    factor = None if fa is None else fa * fb
    on_cpu = A.device.type == "cpu"
    # CPU: the scale rides in the GEMM's alpha (a host float costs nothing there); elsewhere
    # a tensor multiply, so no device sync.
    alpha = float(factor) if factor is not None and on_cpu else 1.0
    if into is not None and (factor is None or on_cpu):
        into.addmm_(A, B, beta=0 if overwrite else 1, alpha=alpha)
        return into
    if factor is None or on_cpu:
        base = bias.to(cdt) if bias is not None else torch.zeros((), dtype=cdt, device=A.device)
        y = torch.addmm(base, A, B, beta=1 if bias is not None else 0, alpha=alpha)
    else:
        y = torch.mm(A, B).mul_(factor)
        if bias is not None:
            y.add_(bias.to(cdt))
    if into is not None:
        return into.copy_(y) if overwrite else into.add_(y)
    return y


# ---- the scaled-GEMM path ------------------------------------------------------------------


def _scaled_mm(a: Float8Tensor, a_t: bool, b: Float8Tensor, b_t: bool, out_dtype, bias):
    """``op(a) @ op(b)`` through torch's FP8 GEMM: A row-major, B column-major."""
    A = a.with_layout(a_t).data
    B = b.with_layout(not b_t).data.t()
    kind = _kind(a)
    fused_bias = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    epilogue_bias = bias if fused_bias else None
    if kind == "tensor":
        sa, sb = a.scale_inv.reshape(()), b.scale_inv.reshape(())
        y = _torch_compat.scaled_mm(A, B, sa, sb, bias=epilogue_bias, out_dtype=out_dtype)
    else:
        y = _blockwise_scaled_mm(a, a_t, b, b_t, A, B, kind, out_dtype, epilogue_bias)
    if bias is not None and not fused_bias:
        y = y.add_(bias.to(y.dtype))
    return y


def _scale_for(q: Float8Tensor, transposed: bool) -> torch.Tensor:
    """The scale_inv blocks of ``op(q)``, one row per row of the logical operand (contiguous)."""
    s = q.scale_inv.t() if transposed else q.scale_inv
    return s.contiguous()


def _mx_blocked(scale: torch.Tensor) -> torch.Tensor:
    """(rows, K/32) E8M0 scales in cuBLAS's block-scaling-factor layout (torch's
    ``SwizzleType.SWIZZLE_32_4_4``), flat: padded to whole 128x4 tiles, tiles in row-major
    order, each tile stored as 32 lines of 16 values where row ``r`` of the tile sits in line
    ``r % 32`` at column ``4 * (r // 32) + c``. Rearranged in fp32 (exact: powers of two),
    padded with 1, cast to E8M0 last."""
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    if (padded_rows, padded_cols) != (rows, cols):
        scale = torch.nn.functional.pad(
            scale, (0, padded_cols - cols, 0, padded_rows - rows), value=1.0
        )
    tiles = scale.reshape(padded_rows // 128, 4, 32, padded_cols // 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(-1).to(torch.float8_e8m0fnu)


def _blockwise_scaled_mm(a, a_t, b, b_t, A, B, kind, out_dtype, bias):
    """Block-scaled FP8 GEMM through ``torch.nn.functional.scaled_mm`` (``A @ B``, A (M, K)
    row-major, B (K, N) column-major), the scales laid out as torch checks them (its meta
    functions and ``aten/src/ATen/native/cuda/ScaledBlas.cpp``; traced on fake CUDA tensors
    by ``tests/test_cuda_trace.py``):

    * MXFP8 (``BlockWise1x32``): A's (M, K/32) and B^T's (N, K/32) E8M0 scales, each in the
      ``SWIZZLE_32_4_4`` tile layout (:func:`_mx_blocked`);
    * ``BlockWise1x128`` A: (M, K/128), M-major (strides (1, M));
    * ``BlockWise1x128`` B: B^T's (N, K/128), N-major (strides (1, N));
    * ``BlockWise128x128`` B (a weight): (K/128, N/128), K-major (strides (1, K/128)), K/128
      a multiple of 4 (the 512 alignment).

    A mistake here makes the probe (:func:`scaled_mm_works`) fail on the GPU and the module keep
    the dequantize path, with a :class:`~.gemm_paths.FastPathMissed` warning."""
    F = torch.nn.functional
    st = F.ScalingType
    sa = _scale_for(a, a_t)
    sb_t = _scale_for(b, not b_t)
    if kind == "mx":
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        return F.scaled_mm(
            A,
            B,
            _mx_blocked(sa),
            st.BlockWise1x32,
            _mx_blocked(sb_t),
            st.BlockWise1x32,
            swizzle_a=swizzle,
            swizzle_b=swizzle,
            bias=bias,
            output_dtype=out_dtype,
        )
    # Activations and gradients carry 1x128 tiles; only a weight keeps 128x128 blocks (as B).
    recipe_a = st.BlockWise128x128 if a.block == (128, 128) else st.BlockWise1x128
    sa = sa.t().contiguous().t()
    if b.block == (128, 128):
        recipe_b, sb = st.BlockWise128x128, sb_t.t()
    else:
        recipe_b, sb = st.BlockWise1x128, sb_t.t().contiguous().t()
    return F.scaled_mm(A, B, sa, recipe_a, sb, recipe_b, bias=bias, output_dtype=out_dtype)


@functools.cache
def scaled_mm_works(device: torch.device, kind: str) -> bool:
    """Whether torch's FP8 GEMM serves ``kind`` (``"tensor"``, ``"mx"``, ``"block"``) on
    ``device``: probed once on a small problem in all three GEMM orientations (both FP8 formats
    for per-tensor), compared with the dequantize path. Any error or a difference beyond 2^-10
    of ``|A| @ |B|`` (far above fp32 accumulation order, far below a misread scale) -> False.
    On CUDA under :func:`.gemm_paths.capability_probes`: the capability's answer, no kernel."""
    if device.type == "cuda" and gemm_paths.probe_mode() == "capability":
        runs, why = gemm_paths.expected("scaled_mm", device, kind)
        return gemm_paths.probe_verdict("scaled_mm", device, kind, runs, why)
    runs, why = _probe_scaled_mm(device, kind)
    return gemm_paths.probe_verdict("scaled_mm", device, kind, runs, why)


def _probe_scaled_mm(device: torch.device, kind: str) -> tuple[bool, str]:
    from splitgrad.reference.fp8 import (
        Float8BlockScaling,
        Float8CurrentScaling,
        Format,
        MXFP8BlockScaling,
    )

    size = {"tensor": 32, "mx": 128, "block": _BLOCK_ALIGN}[kind]
    recipe = {
        "tensor": Float8CurrentScaling(fp8_format=Format.HYBRID),
        "mx": MXFP8BlockScaling(),
        "block": Float8BlockScaling(),
    }[kind]
    g = torch.Generator().manual_seed(0)

    def rand():
        return torch.randn(size, size, generator=g).to(device)

    x, w, dy = rand(), rand(), rand()
    cases = [
        (quantize(x, recipe, "input", 1), False, quantize(w, recipe, "weight", 1), True),
        (quantize(dy, recipe, "grad_output", 1), False, quantize(w, recipe, "weight", 0), False),
        (quantize(dy, recipe, "grad_output", 0), True, quantize(x, recipe, "input", 0), False),
    ]
    for a, a_t, b, b_t in cases:
        gemm = f"{gemm_paths.gemm_role(a_t, b_t)} {size}x{size}x{size}"
        try:
            got = _scaled_mm(a, a_t, b, b_t, torch.float32, None)
        except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError) as exc:
            return False, f"{gemm} probe raised {type(exc).__name__}: {str(exc)[:300]}"
        want = _dequantized_mm(a, a_t, b, b_t, torch.float32, None)
        A, fa = _operand(a, a_t, torch.float32)
        B, fb = _operand(b, b_t, torch.float32)
        bound = (A.abs() @ B.abs()) * (2.0**-10)
        if fa is not None:
            bound = bound * (fa * fb)
        if got.shape != want.shape or not bool(((got - want).abs() <= bound).all()):
            return False, f"{gemm} probe ran but differs from the dequantize path"
    return True, f"{size}x{size} probe ran in all three orientations"


def _scaled_mm_choice(
    path: str, a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype
) -> tuple[bool, str]:
    """``(scaled, why)``: whether ``torch``'s FP8 GEMM runs this call (see the module
    docstring), with the reason."""
    device = a.data.device
    if path == "dequantize":
        return False, "fp8_gemm='dequantize'"
    if out_dtype not in _SCALED_OUT:
        return False, f"output dtype {out_dtype}: the scaled GEMM writes fp32/bf16/fp16"
    kind = _kind(a)
    if path == "auto" and device.type != "cuda":
        return False, f"auto on {device.type}: _scaled_mm is a naive kernel there"
    if device.type == "cuda":
        align = _BLOCK_ALIGN if kind == "block" else _ALIGN
        bad = sorted({d for d in (*a.shape, *b.shape) if d % align})
        if bad:
            sizes = ", ".join(map(str, bad))
            return False, f"size {sizes} of A {a.shape} / B {b.shape} not a multiple of {align}"
    if not scaled_mm_works(device, kind):
        return False, gemm_paths.verdict("scaled_mm", device, kind) or "probe failed"
    return True, f"{kind} scaling, aligned"


def _problem(a: Float8Tensor, a_t: bool, b: Float8Tensor, b_t: bool) -> tuple[int, int, int]:
    """``(M, N, K)`` of ``op(a) @ op(b)``."""
    m, k = a.shape[::-1] if a_t else a.shape
    n = b.shape[0] if b_t else b.shape[1]
    return m, n, k


_SCALED_CALL = {
    "tensor": "torch._scaled_mm TensorWise",
    "mx": "F.scaled_mm BlockWise1x32",
    "block": "F.scaled_mm BlockWise1x128",
}


def _describe(a: Float8Tensor, a_t: bool, b: Float8Tensor, b_t: bool) -> str:
    """The GEMM named for a warning: role, formats, layouts, shape."""
    m, n, k = _problem(a, a_t, b, b_t)
    return (
        f"FP8 {gemm_paths.gemm_role(a_t, b_t)} GEMM {a.fmt} A ({m}, {k}) row-major @ "
        f"{b.fmt} B ({k}, {n}) column-major, {_kind(a)} scaling {a.block}/{b.block}"
    )


def _choose_scaled(
    a: Float8Tensor,
    a_t: bool,
    b: Float8Tensor,
    b_t: bool,
    path: str,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype,
) -> bool:
    """Whether this call takes the scaled path (never for float64 parameters, which compute in
    float64). Records the decision (when recording) and, on CUDA, warns where the probe refused
    a call that could have taken it (:func:`.gemm_paths.fast_path_missed`)."""
    scaled = compute_dtype == torch.float32 and _use_scaled_mm(path, a, b, out_dtype)
    if not (gemm_paths.RECORDERS or (not scaled and a.data.is_cuda)):
        return scaled
    device = a.data.device
    if compute_dtype != torch.float32:
        why = "float64 parameters compute in float64"
    elif scaled:
        why = _scaled_mm_choice(path, a, b, out_dtype)[1]
    else:
        why = _scaled_mm_choice(path, a, b, out_dtype)[1]
        kind = _kind(a)
        if device.type == "cuda" and why == gemm_paths.verdict("scaled_mm", device, kind):
            gemm_paths.fast_path_missed("scaled_mm", device, kind, _describe(a, a_t, b, b_t))
    if gemm_paths.RECORDERS:
        kind = _kind(a)
        call = _SCALED_CALL[kind] if scaled else "dequantize + mm"
        if scaled and kind == "block" and b.block == (128, 128):
            call = "F.scaled_mm BlockWise1x128 x BlockWise128x128"
        gemm_paths.note(
            gemm_paths.gemm_role(a_t, b_t),
            call,
            gemm_paths.path_label(scaled, device, forced=path == "dequantize"),
            why,
            device,
            a.data.dtype,
            _problem(a, a_t, b, b_t),
            f"{a.fmt} A row-major, {b.fmt} B column-major" if scaled else "",
        )
    return scaled


def _use_scaled_mm(path: str, a: Float8Tensor, b: Float8Tensor, out_dtype: torch.dtype) -> bool:
    device = a.data.device
    if path == "dequantize" or out_dtype not in _SCALED_OUT:
        return False
    kind = _kind(a)
    if path == "auto" and device.type != "cuda":
        return False
    if device.type == "cuda":
        align = _BLOCK_ALIGN if kind == "block" else _ALIGN
        if any(d % align for d in (*a.shape, *b.shape)):
            return False
    return scaled_mm_works(device, kind)


def wants_transposed_storage(path: str, device: torch.device, kind: str) -> bool:
    """Whether column-wise copies should be stored transposed (the scaled path will run)."""
    if path == "dequantize" or (path == "auto" and device.type != "cuda"):
        return False
    return scaled_mm_works(device, kind)


# ---- the entry points ----------------------------------------------------------------------


def _empty_product(
    a: Float8Tensor, a_t: bool, b: Float8Tensor, b_t: bool
) -> tuple[int, int] | None:
    """``(M, N)`` of ``op(a) @ op(b)`` when M, N or K is 0 (nothing to multiply), else None."""
    m, k = a.shape[::-1] if a_t else a.shape
    n = b.shape[0] if b_t else b.shape[1]
    # torch._scaled_mm with K=0 returns uninitialized memory (torch 2.13): no FP8 kernel runs.
    return (m, n) if 0 in (m, k, n) else None


def fp8_mm(
    a: Float8Tensor,
    a_t: bool,
    b: Float8Tensor,
    b_t: bool,
    *,
    out_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """``op(a) @ op(b) + bias`` rounded once to ``out_dtype`` (``op`` transposes where the flag
    says). Both operands must be quantized along the contracted dimension. An empty problem
    gives ``0 + bias`` without calling a GEMM."""
    empty = _empty_product(a, a_t, b, b_t)
    if empty is not None:
        y = torch.zeros(empty, dtype=compute_dtype, device=a.data.device)
        return (y if bias is None else y + bias.to(compute_dtype)).to(out_dtype)
    if _choose_scaled(a, a_t, b, b_t, path, out_dtype, compute_dtype):
        return _scaled_mm(a, a_t, b, b_t, out_dtype, bias)
    return _dequantized_mm(a, a_t, b, b_t, compute_dtype, bias).to(out_dtype)


def fp8_mm_accumulate_(
    out: torch.Tensor,
    a: Float8Tensor,
    a_t: bool,
    b: Float8Tensor,
    b_t: bool,
    *,
    overwrite: bool,
    compute_dtype: torch.dtype,
    path: str = "auto",
) -> None:
    """``out (+)= op(a) @ op(b)`` accumulated in ``out``'s dtype (fp32 ``main_grad``). An empty
    problem (K=0: no tokens) zeroes ``out`` when overwriting and adds nothing otherwise."""
    if _empty_product(a, a_t, b, b_t) is not None:
        if overwrite:
            out.zero_()
        return
    if _choose_scaled(a, a_t, b, b_t, path, out.dtype, compute_dtype):
        product = _scaled_mm(a, a_t, b, b_t, out.dtype, None)
        out.copy_(product) if overwrite else out.add_(product)
        return
    cdt = torch.promote_types(compute_dtype, out.dtype)
    if cdt == out.dtype:
        _dequantized_mm(a, a_t, b, b_t, cdt, None, into=out, overwrite=overwrite)
        return
    product = _dequantized_mm(a, a_t, b, b_t, cdt, None).to(out.dtype)
    out.copy_(product) if overwrite else out.add_(product)


# ---- what a queued entry holds ---------------------------------------------------------------


def pack(*qs: Float8Tensor | None) -> tuple[tuple, tuple]:
    """``(tensors, layouts)``: the FP8 data and scale_inv of each operand (None stays None),
    so an entry's ``saved`` holds tensors only and its closure captures none."""
    tensors, layouts = [], []
    for q in qs:
        if q is None:
            tensors += [None, None]
            layouts.append(None)
        else:
            tensors += [q.data, q.scale_inv]
            layouts.append((q.fmt, q.block, q.transposed))
    return tuple(tensors), tuple(layouts)


def unpack(tensors: tuple, layouts: tuple) -> list[Float8Tensor | None]:
    """Inverse of :func:`pack`."""
    out = []
    for i, layout in enumerate(layouts):
        data, scale_inv = tensors[2 * i], tensors[2 * i + 1]
        out.append(None if layout is None else Float8Tensor(data, scale_inv, *layout))
    return out


class FP8GemmOperands:
    """The quantized operands of one GEMM ``y = x @ W^T + b`` of one forward and its backward.

    ``gemm`` names the GEMM inside the module (``""``, ``"fc1"``, ``"gemm3"``) for the keys of
    ``module.fp8_states``. Delayed-scaling amaxes are recorded at the same points as the
    reference: x and W in :meth:`fprop`, dy in :meth:`dgrad` (even when dx is not needed).
    """

    def __init__(self, module: torch.nn.Module, recipe, gemm: str = "") -> None:
        path = module.fp8_gemm
        if path not in FP8_GEMM_PATHS:
            raise ValueError(f"fp8_gemm must be one of {FP8_GEMM_PATHS}, got {path!r}")
        self.recipe = recipe
        self.path = path
        self.states = delayed_scaling_states(module, recipe, gemm)
        wide = module.compute_dtype == torch.float64
        self.compute_dtype = torch.float64 if wide else torch.float32
        self._w_dgrad: Float8Tensor | None = None
        self._x_wgrad: Float8Tensor | None = None
        self._dy_wgrad: Float8Tensor | None = None

    def _quantize(self, t: torch.Tensor, role: str, axis: int) -> Float8Tensor:
        return quantize(t, self.recipe, role, axis, state=self.states.get(role))

    def _other_axis(self, t: torch.Tensor, row: Float8Tensor, role: str) -> Float8Tensor:
        """The column-wise copy: the row-wise one where the recipe's scales serve both
        directions, else a second quantization (records nothing: only block recipes do it)."""
        if is_per_tensor(self.recipe) or row.block == (128, 128):
            copy = row
        else:
            copy = quantize(t, self.recipe, role, axis=0)
        kind = _kind(copy)
        # The scaled GEMM reads every column-wise copy as the transposed, contiguous operand.
        transposed = wants_transposed_storage(self.path, t.device, kind)
        return copy.with_layout(transposed)

    def fprop(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        keep_x: bool,
        keep_w: bool,
    ) -> torch.Tensor:
        """``y = q(x) @ q(W)^T + b`` in x's dtype; keeps x's column-wise copy if ``keep_x``
        (a wgrad will follow) and W's if ``keep_w`` (a dgrad will follow)."""
        x_row = self._quantize(x, "input", 1)
        w_row = self._quantize(weight, "weight", 1)
        y = fp8_mm(
            x_row,
            False,
            w_row,
            True,
            out_dtype=x.dtype,
            compute_dtype=self.compute_dtype,
            bias=bias,
            path=self.path,
        )
        self._x_wgrad = self._other_axis(x, x_row, "input") if keep_x else None
        self._w_dgrad = self._other_axis(weight, w_row, "weight") if keep_w else None
        return y

    def dgrad(self, dy: torch.Tensor, *, need_dx: bool, keep_dy: bool) -> torch.Tensor | None:
        """Quantize dy (recording its amax), return ``q(dy) @ q(W)`` in dy's dtype if
        ``need_dx``; keep dy's column-wise copy if ``keep_dy``. Drops W's copy."""
        dy_row = self._quantize(dy, "grad_output", 1)
        dx = None
        if need_dx:
            dx = fp8_mm(
                dy_row,
                False,
                self._w_dgrad,
                False,
                out_dtype=dy.dtype,
                compute_dtype=self.compute_dtype,
                path=self.path,
            )
        self._w_dgrad = None
        self._dy_wgrad = self._other_axis(dy, dy_row, "grad_output") if keep_dy else None
        return dx

    def take_wgrad_operands(self) -> tuple[Float8Tensor | None, Float8Tensor | None]:
        """``(q(dy) column-wise, q(x) column-wise)``, handed over (this object forgets them)."""
        ops = (self._dy_wgrad, self._x_wgrad)
        self._dy_wgrad = self._x_wgrad = None
        return ops


def fp8_wgrad_value(
    module, dtype: torch.dtype, dy_q: Float8Tensor, x_q: Float8Tensor
) -> torch.Tensor:
    """``q(dy)^T @ q(x)`` rounded to ``dtype``, the weight's: the plain-mode value, also what
    ``torch.autograd.grad`` gets back for a weight it asks for."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    return fp8_mm(dy_q, True, x_q, False, out_dtype=dtype, compute_dtype=cdt, path=module.fp8_gemm)


def fp8_wgrad_write(
    module, param: torch.nn.Parameter, dy_q: Float8Tensor, x_q: Float8Tensor, overwrite: bool
) -> None:
    """Write ``q(dy)^T @ q(x)`` to ``param.main_grad`` (fused, fp32) or ``param.grad`` (plain,
    rounded to the parameter dtype and added like autograd). While the module collects an
    entry's writes (its leaves have hooks: ``SplitBackwardModule._execute``), the write is
    handed to it instead."""
    collected = module._collected
    if collected is not None:
        if module.fuse_wgrad_accumulation:  # runs once the collection is over
            later = functools.partial(fp8_wgrad_write, module, param, dy_q, x_q, overwrite)
            collected.append((param, None, later))
        else:
            collected.append((param, fp8_wgrad_value(module, param.dtype, dy_q, x_q), None))
        return
    cdt = torch.float64 if param.dtype == torch.float64 else torch.float32
    path = module.fp8_gemm
    if module.fuse_wgrad_accumulation:
        fp8_mm_accumulate_(
            param.main_grad,
            dy_q,
            True,
            x_q,
            False,
            overwrite=overwrite,
            compute_dtype=cdt,
            path=path,
        )
        if hasattr(param, "grad_added_to_main_grad"):
            param.grad_added_to_main_grad = True
        return
    g = fp8_wgrad_value(module, param.dtype, dy_q, x_q)
    if param.grad is None:
        param.grad = g
    else:
        param.grad.add_(g)
