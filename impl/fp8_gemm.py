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
  then stored transposed, made once when quantized). Used only where a probe on a small problem
  ran and matched the dequantize path (once per device and scaling kind); a refusal
  ("Invalid scaling configuration" for the block kinds on CPU) or a mismatch falls back.
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
        y = torch._scaled_mm(A, B, sa, sb, bias=epilogue_bias, out_dtype=out_dtype)
    else:
        y = _blockwise_scaled_mm(a, a_t, b, b_t, A, B, kind, out_dtype, epilogue_bias)
    if bias is not None and not fused_bias:
        y = y.add_(bias.to(y.dtype))
    return y


def _scale_for(q: Float8Tensor, transposed: bool) -> torch.Tensor:
    """The scale_inv blocks of ``op(q)``, one row per row of the logical operand (contiguous)."""
    s = q.scale_inv.t() if transposed else q.scale_inv
    return s.contiguous()


def _blockwise_scaled_mm(a, a_t, b, b_t, A, B, kind, out_dtype, bias):
    """Block-scaled FP8 GEMM. Not run in this repository's CI (no GPU; the CPU build refuses
    these scalings): the layouts follow torch's blockwise tests — A's scales (M, K/blk) stored
    M-major, B's given as the transpose of B^T's contiguous (N, K/blk) scales — and any mistake
    here makes the probe (:func:`scaled_mm_works`) fail and the module keep the dequantize path."""
    F = torch.nn.functional
    st = F.ScalingType
    sa = _scale_for(a, a_t)
    sb_t = _scale_for(b, not b_t)
    if kind == "mx":
        sa = sa.to(torch.float8_e8m0fnu)
        sb = sb_t.to(torch.float8_e8m0fnu).t()
        recipe_a = recipe_b = st.BlockWise1x32
    else:
        # Weights keep 128x128 blocks (one scale per block); activations/gradients 1x128 tiles.
        recipe_a = st.BlockWise128x128 if a.block == (128, 128) else st.BlockWise1x128
        recipe_b = st.BlockWise128x128 if b.block == (128, 128) else st.BlockWise1x128
        sa, sb = sa.t().contiguous().t(), sb_t.t()
    return F.scaled_mm(A, B, sa, recipe_a, sb, recipe_b, bias=bias, output_dtype=out_dtype)


@functools.cache
def scaled_mm_works(device: torch.device, kind: str) -> bool:
    """Whether torch's FP8 GEMM serves ``kind`` (``"tensor"``, ``"mx"``, ``"block"``) on
    ``device``: probed once on a small problem in all three GEMM orientations (both FP8 formats
    for per-tensor), compared with the dequantize path. Any error or a difference beyond 2^-10
    of ``|A| @ |B|`` (far above fp32 accumulation order, far below a misread scale) -> False."""
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
    try:
        for a, a_t, b, b_t in cases:
            got = _scaled_mm(a, a_t, b, b_t, torch.float32, None)
            want = _dequantized_mm(a, a_t, b, b_t, torch.float32, None)
            A, _ = _operand(a, a_t, torch.float32)
            B, _ = _operand(b, b_t, torch.float32)
            bound = (A.abs() @ B.abs()) * (2.0**-10)
            fa, fb = _operand(a, a_t, torch.float32)[1], _operand(b, b_t, torch.float32)[1]
            if fa is not None:
                bound = bound * (fa * fb)
            if got.shape != want.shape or not bool(((got - want).abs() <= bound).all()):
                return False
    except (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError):
        return False
    return True


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
    if compute_dtype == torch.float32 and _use_scaled_mm(path, a, b, out_dtype):
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
    if compute_dtype == torch.float32 and _use_scaled_mm(path, a, b, out.dtype):
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
