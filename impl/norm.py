"""LayerNorm / RMSNorm in front of ``LayerNormLinear`` and ``LayerNormMLP``.

Norm parameters are ``layer_norm_weight`` and (LayerNorm only) ``layer_norm_bias``; with
``zero_centered_gamma`` the stored weight is ``gamma - 1``. Their gradients are returned to
autograd and land in ``.grad`` during ``backward()``.

Precision: bf16/fp16 inputs are normalized in fp32 and rounded once. torch's fused CPU kernels
are used for LayerNorm, on fp32 copies of low-precision inputs: the mixed-dtype CPU backward
(bf16 input, fp32 gamma) was measured to reduce dgamma/dbeta with ~5x the error of an fp32
reduction, and the copies cost little next to the GEMMs. RMSNorm has no CPU backward kernel in
torch 2.13, so it is written out with a handful of fp32 elementwise ops.
"""

from __future__ import annotations

import torch

__all__ = [
    "NORMALIZATIONS",
    "check_normalization",
    "create_norm_parameters",
    "norm_fwd",
    "norm_bwd",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(normalization: object) -> None:
    """Raise ``ValueError`` for anything but ``"LayerNorm"`` / ``"RMSNorm"``."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")


def create_norm_parameters(module: torch.nn.Module, features: int, device: torch.device) -> None:
    """Register ``layer_norm_weight`` (and ``layer_norm_bias`` for LayerNorm) on ``module``."""
    kw = {"dtype": module.params_dtype, "device": device}
    init = torch.zeros if module.zero_centered_gamma else torch.ones
    module.layer_norm_weight = torch.nn.Parameter(init(features, **kw))
    if module.normalization == "LayerNorm":
        module.layer_norm_bias = torch.nn.Parameter(torch.zeros(features, **kw))
    else:
        module.register_parameter("layer_norm_bias", None)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _gamma(weight: torch.Tensor, zero_centered: bool, cdt: torch.dtype) -> torch.Tensor:
    # Shift in the compute dtype: bf16(1 + small) would lose the small part.
    g = weight.to(cdt)
    return g + 1 if zero_centered else g


def norm_fwd(
    module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """``(ln_out, stats)`` for x: (N, K); ln_out in x's dtype, stats in the compute dtype."""
    cdt = _compute_dtype(x.dtype)
    xc = x.to(cdt)
    gamma = _gamma(weight, module.zero_centered_gamma, cdt)
    k = x.shape[-1]
    if module.normalization == "LayerNorm":
        y, mean, rstd = torch.native_layer_norm(xc, [k], gamma, bias.to(cdt), module.eps)
        return y.to(x.dtype), (mean, rstd)
    rstd = torch.rsqrt(xc.square().mean(dim=-1, keepdim=True).add_(module.eps))
    y = xc * rstd
    y.mul_(gamma)
    return y.to(x.dtype), (rstd,)


def norm_bwd(
    module,
    d_out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stats: tuple[torch.Tensor, ...],
    need: tuple[bool, bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dx, d_layer_norm_weight, d_layer_norm_bias)``; ``need`` masks which are computed."""
    cdt = _compute_dtype(x.dtype)
    xc, dc = x.to(cdt), d_out.to(cdt)
    gamma = _gamma(weight, module.zero_centered_gamma, cdt)
    k = x.shape[-1]
    if module.normalization == "LayerNorm":
        mean, rstd = stats
        dx, dw, db = torch.ops.aten.native_layer_norm_backward(
            dc, xc, [k], mean, rstd, gamma, bias.to(cdt), list(need)
        )
    else:
        (rstd,) = stats
        xhat = xc * rstd
        dx = dw = db = None
        if need[0]:
            g = dc * gamma
            proj = (g * xhat).mean(dim=-1, keepdim=True)
            dx = g.sub_(xhat.mul(proj)).mul_(rstd)
        if need[1]:
            dw = (dc * xhat).sum(dim=0)
    return (
        None if dx is None else dx.to(x.dtype),
        None if dw is None else dw.to(weight.dtype),
        None if db is None else db.to(weight.dtype),
    )
