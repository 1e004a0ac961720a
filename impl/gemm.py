"""The small device dispatch: CUDA fast paths next to the portable path that always works.

Every function here has one portable implementation (plain ``torch.mm``/``addmm`` calls that run
on CPU and everywhere) and, where a device offers something better, a fast path chosen at run
time. Fast paths are probed once per (device, dtype) with a tiny GEMM and fall back to the
portable path when the running torch/GPU does not run them; :mod:`.gemm_paths` says which path
should run on which device, records every decision (``splitgrad bench`` prints them) and warns
loudly when a GPU falls back where its capability says the fast path runs.

Choices (measured on CPU, torch 2.13, see ``splitgrad bench``):

* Forward ``y = x W^T + b`` is one ``addmm`` (bias added inside the GEMM epilogue, rounded once).
* Plain wgrad accumulation ``grad += dy^T x`` is a fresh ``mm`` then ``grad.add_``, exactly as
  autograd accumulates (SPEC §3: plain mode is autograd's ``+=``). ``grad.addmm_`` would save the
  weight-sized temporary but rounds once instead of twice in bf16/fp16, and even in fp32 MKL's
  K-blocked ``addmm_`` differs from ``G0 + mm`` in the last bit on large shapes (measured at
  2048x1024x1024), so it is not used for plain accumulation.
* Fused wgrad (fp32 ``main_grad``): with fp32 operands ``main_grad.addmm_(dy.t(), x)``. With
  bf16/fp16 operands on CUDA the GEMM reads the low-precision operands and accumulates straight
  into ``main_grad`` in fp32 (``torch.addmm(..., out_dtype=torch.float32, out=main_grad)``).
  CPU has no GEMM with a wider output than its inputs, so the portable path upcasts the two
  *activation-sized* operands to fp32 and runs an fp32 ``addmm_`` into ``main_grad``. A bf16 GEMM
  followed by ``main_grad.add_(dW.float())`` is faster on CPU but rounds dW to bf16 before it
  reaches the fp32 accumulator, which is what fused accumulation exists to avoid; rejected.
* ``is_first_microbatch`` overwrite uses ``beta=0`` / ``mm(out=main_grad)``, so stale values
  (even NaN) in ``main_grad`` never leak in.
* Empty problems (an expert with no tokens: K=0 in its wgrad; a micro-batch with no rows) take
  the same calls: torch's ``mm``/``addmm`` (CPU, and CUDA's, ``out_dtype=`` included, which
  share ``addmm_out_cuda_impl``) write zeros, or ``beta * self``, for K=0 without a kernel, and
  ``_grouped_mm`` here only ever has M=0 groups (rows that do not exist; its K is a feature
  size). The FP8 GEMMs skip empty problems explicitly (:mod:`.fp8_gemm`).
"""

from __future__ import annotations

import functools

import torch

from . import _torch_compat, gemm_paths
from .gemm_paths import RECORDERS

__all__ = [
    "linear_forward",
    "wgrad",
    "wgrad_accumulate_",
    "wgrad_into_main_grad_",
    "cuda_out_dtype_supported",
    "grouped_mm_runs",
    "grouped_mm_supported",
    "grouped_mm_choice",
    "grouped_mm_aligned",
    "grouped_mm_forward",
    "grouped_mm_dgrad",
]

_LOW_PRECISION = (torch.bfloat16, torch.float16)
_ELEMENT_SIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.float64: 8}


def linear_forward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``x @ weight^T + bias`` as a single GEMM. x: (N, K), weight: (M, K) -> (N, M)."""
    if bias is None:
        return torch.mm(x, weight.t())
    return torch.addmm(bias, x, weight.t())


def wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A fresh ``dy^T @ x`` in the operands' dtype. dy: (N, M), x: (N, K) -> (M, K)."""
    return torch.mm(dy.t(), x)


def wgrad_accumulate_(grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """``grad += dy^T @ x`` as autograd does it: the product rounded to ``grad``'s dtype first,
    then one in-place add (bitwise ``G0 + g``)."""
    grad.add_(torch.mm(dy.t(), x))


@functools.cache
def cuda_out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32, out=c)`` with ``dtype`` operands runs
    on ``device`` and accumulates into ``c`` (probed once with a 16x16 GEMM; from the
    capability alone under :func:`.gemm_paths.capability_probes`)."""
    if device.type != "cuda" or dtype not in _LOW_PRECISION:
        return False
    if gemm_paths.probe_mode() == "capability":
        runs, why = gemm_paths.expected("out_dtype", device, dtype)
        return gemm_paths.probe_verdict("out_dtype", device, dtype, runs, why)
    try:
        a = torch.ones(16, 16, dtype=dtype, device=device)
        c = torch.full((16, 16), 0.5, dtype=torch.float32, device=device)
        torch.addmm(c, a.t(), a, out_dtype=torch.float32, out=c)
        runs = bool(torch.all(c == 16.5).item())
        why = "16x16 probe ran" if runs else "16x16 probe ran but did not accumulate into out"
    except (RuntimeError, TypeError, NotImplementedError) as exc:
        runs, why = False, f"16x16 probe raised {type(exc).__name__}: {str(exc)[:200]}"
    return gemm_paths.probe_verdict("out_dtype", device, dtype, runs, why)


def wgrad_into_main_grad_(
    main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
) -> None:
    """``main_grad (+)= dy^T @ x`` accumulated in ``main_grad``'s dtype (fp32, or fp64).

    ``overwrite`` (the ``is_first_microbatch`` of that micro-batch) replaces the old contents.
    """
    acc = main_grad.dtype
    if dy.dtype == acc:
        if RECORDERS:
            _note_main_grad("mm/addmm_ in main_grad's dtype", "only", "fp32 operands", dy, x)
        if overwrite:
            torch.mm(dy.t(), x, out=main_grad)
        else:
            main_grad.addmm_(dy.t(), x)
        return
    if dy.dtype in _LOW_PRECISION and cuda_out_dtype_supported(main_grad.device, dy.dtype):
        # CUDA: bf16/fp16 operands, fp32 accumulation straight into main_grad.
        if RECORDERS:
            _note_main_grad(
                "addmm(out_dtype=float32, out=main_grad)",
                "fast",
                "fp32 accumulate in the GEMM",
                dy,
                x,
            )
        torch.addmm(main_grad, dy.t(), x, out_dtype=acc, beta=0 if overwrite else 1, out=main_grad)
        return
    wide = torch.promote_types(dy.dtype, acc)
    if wide != acc:
        # float64 operands with an fp32 main_grad: GEMM in fp64, rounded once into main_grad.
        if RECORDERS:
            _note_main_grad("mm in float64, then add", "only", "operands wider than fp32", dy, x)
        dw = torch.mm(dy.t(), x)
        if overwrite:
            main_grad.copy_(dw)
        else:
            main_grad.add_(dw)
        return
    if main_grad.is_cuda:
        gemm_paths.fast_path_missed("out_dtype", main_grad.device, dy.dtype, _main_grad_call(dy, x))
    if RECORDERS:
        why = gemm_paths.verdict("out_dtype", main_grad.device, dy.dtype) or (
            f"{main_grad.device.type}: no GEMM with an output wider than its inputs"
        )
        label = gemm_paths.path_label(False, main_grad.device)
        _note_main_grad("upcast to fp32, then addmm_", label, why, dy, x)
    # Portable path: upcast the activation-sized operands, fp32 GEMM into main_grad.
    a, b = dy.t().to(acc), x.to(acc)
    if overwrite:
        torch.mm(a, b, out=main_grad)
    else:
        main_grad.addmm_(a, b)


def _main_grad_call(dy: torch.Tensor, x: torch.Tensor) -> str:
    """The fused wgrad named for a report: GEMM, layout, shape."""
    return (
        f"wgrad->main_grad dy^T @ x, A = dy^T {_layout(dy.t())}, B = x {_layout(x)}, "
        f"(M, N, K) = ({dy.shape[1]}, {x.shape[1]}, {dy.shape[0]}), {dy.dtype}"
    )


def _layout(t: torch.Tensor) -> str:
    """``row-major``, ``column-major`` or the strides, for a 2-D operand."""
    rows, cols = t.stride()
    if cols == 1 and rows >= max(1, t.shape[1]):
        return "row-major"
    if rows == 1 and cols >= max(1, t.shape[0]):
        return "column-major"
    return f"strides {tuple(t.stride())}"


def _note_main_grad(call: str, path: str, reason: str, dy: torch.Tensor, x: torch.Tensor) -> None:
    gemm_paths.note(
        "wgrad->main_grad",
        call,
        path,
        reason,
        dy.device,
        dy.dtype,
        (dy.shape[1], x.shape[1], dy.shape[0]),
        f"A=dy^T {_layout(dy.t())}, B=x {_layout(x)}",
    )


# ---- grouped GEMM ---------------------------------------------------------------------------


def grouped_mm_runs(dtype: torch.dtype, k: int, m: int, device: torch.device | str = "cpu") -> bool:
    """Whether ``torch._grouped_mm`` accepts these operands on ``device`` at all: the running
    torch must have it for that device and dtype (torch 2.8 ships it for CUDA only; 2.11 and
    later run it on the CPU too: probed once, :func:`_grouped_mm_available`), and it needs every
    row stride to be a multiple of 16 bytes (checked on CPU too), i.e. ``k`` and ``m`` aligned."""
    if not grouped_mm_aligned(dtype, k, m):
        return False
    return _grouped_mm_available(torch.device(device), dtype)


def grouped_mm_aligned(dtype: torch.dtype, k: int, m: int) -> bool:
    """Whether rows of ``k`` and of ``m`` elements of ``dtype`` are multiples of 16 bytes."""
    size = _ELEMENT_SIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()
    return not ((k * size) % 16 or (m * size) % 16)


@functools.cache
def _grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """One tiny ``torch._grouped_mm`` call on ``device``: False where the op is missing, or has
    no kernel for this backend or dtype (``NotImplementedError``/``RuntimeError``). On CUDA
    under :func:`.gemm_paths.capability_probes`: the capability's answer, no kernel."""
    if device.type == "cuda" and gemm_paths.probe_mode() == "capability":
        runs, why = gemm_paths.expected("grouped_mm", device, dtype)
        return gemm_paths.probe_verdict("grouped_mm", device, dtype, runs, why)
    if not _torch_compat.has_grouped_mm():
        why = f"torch {torch.__version__} has no _grouped_mm"
        return gemm_paths.probe_verdict("grouped_mm", device, dtype, False, why)
    try:
        x = torch.zeros(16, 16, dtype=dtype, device=device)
        w = torch.zeros(2, 16, 16, dtype=dtype, device=device)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        _torch_compat.grouped_mm(x, w.transpose(1, 2), offs)
    except (RuntimeError, NotImplementedError) as exc:
        why = f"16x16 probe raised {type(exc).__name__}: {str(exc)[:200]}"
        return gemm_paths.probe_verdict("grouped_mm", device, dtype, False, why)
    return gemm_paths.probe_verdict("grouped_mm", device, dtype, True, "16x16 probe ran")


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, k: int, m: int) -> bool:
    """Whether ``torch._grouped_mm`` serves this GroupedLinear's forward and dgrad by default.

    CUDA: sm90+ with bf16 operands and aligned sizes (:func:`grouped_mm_runs`).
    CPU: ``_grouped_mm`` runs in torch 2.13 but was measured no faster than a loop of GEMMs (see
    ``splitgrad bench``), so the loop is the default there; the grouped path can still be forced
    per module (``GroupedLinear.grouped_gemm = "grouped"``) and is tested on CPU that way.
    """
    if device.type != "cuda" or dtype != torch.bfloat16:
        return False  # the CPU eager path: no cache lookup (the reason is built when recording)
    return grouped_mm_choice(device, dtype, k, m)[0]


@functools.cache
def grouped_mm_choice(device: torch.device, dtype: torch.dtype, k: int, m: int) -> tuple[bool, str]:
    """``(grouped, why)``: :func:`grouped_mm_supported` with its reason (cached per shape)."""
    if device.type != "cuda":
        return False, f"auto on {device.type}: the loop measured as fast (splitgrad bench)"
    if dtype != torch.bfloat16:
        return False, f"auto: {str(dtype).replace('torch.', '')}, the grouped GEMM serves bf16"
    cap = gemm_paths.capability_of(device)
    if cap < (9, 0):
        return False, f"sm{cap[0]}{cap[1]}: the grouped GEMM needs sm90+"
    size = _ELEMENT_SIZE.get(dtype) or torch.empty((), dtype=dtype).element_size()
    unaligned = [f"{n}={v}" for n, v in (("in_features", k), ("out_features", m)) if v * size % 16]
    if unaligned:
        return False, f"{', '.join(unaligned)}: rows not a multiple of 16 bytes"
    if not _grouped_mm_available(device, dtype):
        return False, gemm_paths.verdict("grouped_mm", device, dtype) or "probe failed"
    return True, "sm90+ bf16, aligned"


def _offsets(m_splits: list[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends as int32, the ``offs`` argument of ``torch._grouped_mm``."""
    ends, total = [], 0
    for m in m_splits:
        total += m
        ends.append(total)
    return torch.tensor(ends, dtype=torch.int32, device=device)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """``t`` with strides exactly ``(K, 1)``, as ``torch._grouped_mm`` wants: ``contiguous()``
    keeps the strides of a dimension of size 0 or 1 (0 from ``expand``, a slice's step, a
    padded row), and autograd may hand any of them (the expanded dy of ``loss.sum()``)."""
    if t.stride() == (t.shape[1], 1):
        return t
    return t.clone(memory_format=torch.contiguous_format) if t.numel() else t.new_empty(t.shape)


def grouped_mm_forward(
    x: torch.Tensor,
    stacked_weights: torch.Tensor,
    biases: list[torch.Tensor] | None,
    m_splits: list[int],
) -> torch.Tensor:
    """``y_g = x_g W_g^T + b_g`` for all groups in one grouped GEMM.

    x: (N, K); stacked_weights: (G, M, K) -> (N, M). Biases are added per group afterwards
    (``_grouped_mm`` has no bias epilogue), in place on the output rows.
    """
    offs = _offsets(m_splits, x.device)
    y = _torch_compat.grouped_mm(_row_major(x), stacked_weights.transpose(1, 2), offs)
    if biases is not None:
        for y_g, b in zip(y.split(m_splits), biases):
            if y_g.shape[0]:
                y_g.add_(b)
    return y


def grouped_mm_dgrad(
    dy: torch.Tensor, stacked_weights: torch.Tensor, m_splits: list[int]
) -> torch.Tensor:
    """``dx_g = dy_g W_g`` for all groups in one grouped GEMM. dy: (N, M) -> (N, K)."""
    offs = _offsets(m_splits, dy.device)
    return _torch_compat.grouped_mm(_row_major(dy), stacked_weights, offs)
