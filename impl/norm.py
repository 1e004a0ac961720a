"""LayerNorm / RMSNorm in front of ``LayerNormLinear`` and ``LayerNormMLP``.

Norm parameters are ``layer_norm_weight`` and (LayerNorm only) ``layer_norm_bias``; with
``zero_centered_gamma`` the stored weight is ``gamma - 1``. Their gradients are returned to
autograd and land in ``.grad`` during ``backward()``.

Precision and speed (measured on CPU, torch 2.13, 2048 x 1024 bf16):

* LayerNorm forward and input gradient use torch's fused kernels directly on bf16/fp16 input with
  fp32 gamma/beta (mixed-dtype mode: statistics and arithmetic in fp32, one rounding of the
  output, at most one ulp from the correctly rounded value). Upcasting the input to fp32 first
  cost ~2.5x more time for LayerNormLinear's norm.
* dgamma/dbeta are reduced from fp32 copies of x and dy: the mixed-dtype CPU backward was
  measured to reduce them with ~5x the error of an fp32 reduction (it accumulates in the
  input dtype), so it only serves dx.
* RMSNorm has no CPU backward kernel in torch 2.13: it is written out with fp32 elementwise ops.
* fp32/fp64 LayerNorm on CPU, ill-conditioned rows: torch's backward kernel evaluates
  ``dx = rstd*g + b*x + c`` with ``c = -b*mean - ...`` on the *uncentred* x and reduces
  ``sum(g*x) - mean*sum(g)``; both are differences of terms ``|mean|*rstd`` times larger than
  the centred ones, so its rounding error grows by ``1 + |mean|*rstd`` (17.7x the reference's
  error on a 3-feature row with mean 0.87 and std 0.22). The forward's statistics of such rows
  (Welford updates in fp32) also carry ``|mean|*rstd`` times more relative error than a two-pass
  mean. So when some row has ``|mean|*rstd > 1`` after the fused forward, the forward is redone
  on ``x - shift`` with ``shift`` = that first mean (each difference rounds once, relative to
  the small centred value; the kernel's own mean of the centred rows is then tiny and exact
  enough), and the backward gets the same centred input, which is the same derivative without
  the cancellation. Measured at 2048x1024->4096 fp32: no cost on typical activations (``|mean|
  < std``: the test is one reduction over N values); ~5% of LayerNormLinear's forward and ~1%
  of its backward when every row is ill-conditioned. CUDA's kernels already centre; bf16/fp16
  outputs round to 8/11 bits, far above the fp32 noise this amplifies: both keep plain calls.

CUDA's LayerNorm kernels have no mixed-dtype mode (gamma/beta must be in the input's dtype:
"expected scalar type BFloat16 but found Float", found by the fake-CUDA trace tier): there the
forward and the input gradient take the bf16/fp16 parameters themselves (statistics and
arithmetic still in fp32 inside the kernel), or, for a zero-centred gamma, run on fp32 copies.
``module.norm_kernel = "cuda"`` takes that branch on any device (``"auto"``, the default: on CUDA
only), so the harness fuzzes it on the CPU against the reference (``splitgrad verify --impl-path
norm_cuda``). There the same-dtype call runs the mixed kernel on the same values, widened
(:func:`_widened`: the CPU's same-dtype kernels keep their statistics in the input's dtype).
"""

from __future__ import annotations

import torch

__all__ = ["norm_fwd", "norm_bwd"]


#: The compute dtype of a norm on input of a dtype: float64 for float64, else float32 (a dict
#: lookup, not a call: the norm runs once per forward and backward).
_COMPUTE_DTYPE = {torch.float64: torch.float64}
_F32 = torch.float32


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``t.to(dtype)`` costs a dispatch even when it returns ``t``: ~1 us a call. (The usual
    # path tests the dtype inline instead of calling this.)
    return t if t.dtype == dtype else t.to(dtype)


def _gamma(weight: torch.Tensor, zero_centered: bool, cdt: torch.dtype) -> torch.Tensor:
    # Shift in the compute dtype: bf16(1 + small) would lose the small part.
    g = weight if weight.dtype == cdt else weight.to(cdt)
    return g + 1 if zero_centered else g


NORM_KERNELS = ("auto", "cuda")


def _forced_cuda(module) -> bool:
    """Whether ``module.norm_kernel`` asks for CUDA's branch off CUDA (``"cuda"``)."""
    kernel = module.norm_kernel
    if kernel == "auto":
        return False
    if kernel == "cuda":
        return True
    raise ValueError(f"norm_kernel must be one of {NORM_KERNELS}, got {kernel!r}")


def _widened(affine: tuple, cdt: torch.dtype) -> tuple:
    """CUDA's ``affine`` for the CPU (the forced branch): the CPU's same-dtype kernels keep
    their statistics in x's dtype, CUDA's in fp32; its mixed kernels on the same values, widened
    exactly, do CUDA's arithmetic."""
    return tuple(None if a is None else _cast(a, cdt) for a in affine)


def _cuda_affine(
    weight: torch.Tensor, bias: torch.Tensor | None, zero_centered: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``(gamma, beta)`` in ``dtype`` for CUDA's LayerNorm kernels, which take them only in the
    input's dtype (no mixed-dtype mode, unlike the CPU's): the parameters themselves where they
    already are in it (the very values the mixed mode would widen); ``None`` where they are not
    (zero-centred gamma, parameters in another dtype), and the caller upcasts x instead."""
    if zero_centered or weight.dtype != dtype or (bias is not None and bias.dtype != dtype):
        return None
    return weight, bias


def norm_fwd(
    module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(ln_out, stats)`` for x: (N, K); ln_out in x's dtype, stats in the compute dtype."""
    cdt = _COMPUTE_DTYPE.get(x.dtype, _F32)
    gamma = _gamma(weight, module.zero_centered_gamma, cdt)
    k = x.shape[-1]
    if module.normalization == "LayerNorm":
        beta = bias if bias.dtype == cdt else bias.to(cdt)
        if x.dtype != cdt and torch.compiler.is_compiling():
            # Traced, native_layer_norm returns its statistics in x's dtype (eager's CPU kernel:
            # fp32), so the graph normalizes an fp32 copy; it fuses the casts.
            y, mean, rstd = torch.native_layer_norm(x.to(cdt), [k], gamma, beta, module.eps)
            return y.to(x.dtype), (mean, rstd)
        if x.dtype != cdt and (x.is_cuda or module.norm_kernel != "auto" and _forced_cuda(module)):
            affine = _cuda_affine(weight, bias, module.zero_centered_gamma, x.dtype)
            if affine is not None:
                if not x.is_cuda:
                    affine = _widened(affine, cdt)
                y, mean, rstd = torch.native_layer_norm(x, [k], *affine, module.eps)
                return y, (mean, rstd)
            y, mean, rstd = torch.native_layer_norm(x.to(cdt), [k], gamma, beta, module.eps)
            return y.to(x.dtype), (mean, rstd)
        # Mixed-dtype kernel (CPU): x stays in its dtype, gamma/beta in fp32.
        y, mean, rstd = torch.native_layer_norm(x, [k], gamma, beta, module.eps)
        if x.dtype == cdt and _ill_conditioned(x, mean, rstd):
            # Any value near the row mean centres well enough: the fused kernel's own mean.
            # The discarded output's storage holds the centred input (no new allocation).
            shift = mean
            centred = torch.sub(x, shift, out=y)
            y, mean, rstd = torch.native_layer_norm(centred, [k], gamma, beta, module.eps)
            return y, (mean, rstd, shift)
        return y, (mean, rstd)
    xc = _cast(x, cdt)
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True).add_(module.eps))
    y = xc * rstd
    y.mul_(gamma)
    return _cast(y, x.dtype), (rstd,)


def _ill_conditioned(x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor) -> bool:
    """Whether CPU's LayerNorm kernels would amplify their fp32 rounding error by more than 2x on
    some row (``|mean| * rstd > 1``); see the module docstring. Never on CUDA (its kernels
    centre, and the test would cost a device sync). Always inside a ``torch.compile``-d graph:
    the answer is data the graph cannot branch on without a break, and centring well-conditioned
    rows costs one fused subtraction and changes no derivative."""
    if not x.is_cpu or mean.numel() == 0:
        return False
    if torch.compiler.is_compiling():
        return True
    # rstd > 0, so max |mean * rstd| > 1 iff the product leaves [-1, 1] (NaN: neither).
    lo, hi = torch.aminmax(mean * rstd)
    return lo.item() < -1 or hi.item() > 1


def norm_bwd(
    module,
    d_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: tuple[torch.Tensor, ...],
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, d_layer_norm_weight, d_layer_norm_bias)``; ``need`` masks which are computed
    (none needed: ``d_out`` may be ``None``). ``d_out`` may come in another dtype than ``x``
    (the autocast dtype of the GEMM that read the norm's output, SPEC §2): it is cast to
    ``x``'s, exactly (a widening)."""
    if not any(need):
        return None, None, None
    if d_out.dtype != x.dtype:
        d_out = d_out.to(x.dtype)
    cdt = _COMPUTE_DTYPE.get(x.dtype, _F32)
    gamma = _gamma(weight, module.zero_centered_gamma, cdt)
    k = x.shape[-1]
    if module.normalization == "LayerNorm":
        mean, rstd, *shift = stats
        beta = bias if bias.dtype == cdt else bias.to(cdt)
        if shift:
            # The forward ran on x - shift (ill-conditioned rows): same input here.
            x = x - shift[0]
        if x.dtype == cdt:
            dx, dw, db = torch.ops.aten.native_layer_norm_backward(
                d_out, x, [k], mean, rstd, gamma, beta, list(need)
            )
        else:
            dx = dw = db = None
            affine = (gamma, beta)
            if need[0] and (x.is_cuda or module.norm_kernel != "auto" and _forced_cuda(module)):
                # CUDA: gamma/beta in x's dtype (see _cuda_affine), else on fp32 copies.
                affine = _cuda_affine(weight, bias, module.zero_centered_gamma, x.dtype)
                if affine is None:
                    dx = torch.ops.aten.native_layer_norm_backward(
                        d_out.to(cdt), x.to(cdt), [k], mean, rstd, gamma, beta, [True, False, False]
                    )[0]
                elif not x.is_cuda:
                    affine = _widened(affine, cdt)
            if need[0] and dx is None:
                dx = torch.ops.aten.native_layer_norm_backward(
                    d_out, x, [k], mean, rstd, *affine, [True, False, False]
                )[0]
            if need[1] or need[2]:
                _, dw, db = torch.ops.aten.native_layer_norm_backward(
                    d_out.to(cdt), x.to(cdt), [k], mean, rstd, gamma, beta, [False, *need[1:]]
                )
    else:
        xc, dc = _cast(x, cdt), _cast(d_out, cdt)
        (rstd,) = stats
        xhat = xc * rstd
        dx = dw = db = None
        if need[0]:
            g = dc * gamma
            proj = (g * xhat).mean(dim=-1, keepdim=True)
            dx = g.sub_(xhat.mul(proj)).mul_(rstd)
        if need[1]:
            dw = (dc * xhat).sum(dim=0)
    # In x's dtype and the parameters' (a cast only where the dtype differs).
    if dx is not None and dx.dtype != x.dtype:
        dx = dx.to(x.dtype)
    if dw is not None and dw.dtype != weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and db.dtype != weight.dtype:
        db = db.to(weight.dtype)
    return dx, dw, db
