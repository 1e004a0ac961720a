"""The formulas of splitgrad, one small function each, with hand-written backward passes.

Every function here works on 2-D row matrices: ``x`` is ``(tokens, features)``. Shapes are given
as ``(N, K)`` with ``N`` tokens, ``K`` input features, ``M`` output features.

Rounding points (the low-precision part of the contract):

* GEMMs (``linear_*``) run in the dtype of their operands. torch accumulates the products of a
  bf16/fp16 GEMM in fp32 and rounds the result once to the operand dtype; float32 and float64 GEMMs
  accumulate in their own dtype.
* The bias is added *after* the GEMM result has been rounded: ``round(round(x @ W^T) + b)``.
* Normalizations and activations are computed in the *compute dtype*
  (:func:`compute_dtype`: float32 for bf16/fp16/fp32 inputs, float64 for float64 inputs) and
  rounded once to the input dtype at the end. Their backward passes do the same: every input is
  upcast to the compute dtype, the formula runs there, each result is rounded once.
* Fused weight-gradient accumulation (:func:`linear_wgrad_fp32`) upcasts both operands to the
  accumulator dtype first, so a bf16 ``dW`` is never rounded to bf16 on its way into ``main_grad``.

Passing float64 tensors runs exactly the same code in float64: that is the "upcast" truth the
harness measures errors against (see :func:`splitgrad.reference.upcast`).
"""

from __future__ import annotations

import math

import torch

from .contract import ACTIVATIONS, GATED_ACTIVATIONS

__all__ = [
    "compute_dtype",
    "linear_fwd",
    "linear_dgrad",
    "linear_wgrad",
    "linear_wgrad_fp32",
    "bias_grad",
    "layer_norm_fwd",
    "layer_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "gelu_tanh",
    "gelu_tanh_grad",
    "relu",
    "relu_grad",
    "silu",
    "silu_grad",
    "activation_fwd",
    "activation_bwd",
    "GATED_ACTIVATIONS",
    "ACTIVATIONS",
    "grouped_linear_fwd",
    "grouped_linear_dgrad",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype that normalizations and activations run in: float64 stays, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# Linear
# --------------------------------------------------------------------------------------------


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``y = x @ W^T + b``.

    x: (N, K), weight: (M, K), bias: (M,) or None -> y: (N, M), all in one dtype.
    The GEMM result is rounded to the dtype, then the bias is added and the sum rounded again.
    """
    y = torch.mm(x, weight.t())
    if bias is not None:
        y = y + bias
    return y


def linear_dgrad(dy: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Input gradient ``dx = dy @ W``. dy: (N, M), weight: (M, K) -> dx: (N, K), rounded once."""
    return torch.mm(dy, weight)


def linear_wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Weight gradient ``dW = dy^T @ x``, reduced over all N tokens.

    dy: (N, M), x: (N, K) -> dW: (M, K) in the operands' dtype, rounded once. With N == 0 the
    result is a zero matrix (an empty group still gets a gradient, as autograd would give it).
    """
    return torch.mm(dy.t(), x)


def linear_wgrad_fp32(dy: torch.Tensor, x: torch.Tensor, accum_dtype: torch.dtype) -> torch.Tensor:
    """Weight gradient for fused accumulation: both operands upcast to ``accum_dtype`` first.

    ``accum_dtype`` is the dtype of ``main_grad`` (float32, or float64 for the float64 truth).
    When the operands are wider than ``accum_dtype`` (float64 parameters with an fp32
    ``main_grad``) the GEMM runs in the operands' dtype and the result is rounded once to
    ``accum_dtype``.
    """
    wide = torch.promote_types(dy.dtype, accum_dtype)
    return linear_wgrad(dy.to(wide), x.to(wide)).to(accum_dtype)


def bias_grad(dy: torch.Tensor) -> torch.Tensor:
    """``db = sum over tokens of dy``: (N, M) -> (M,), summed in dy's dtype (torch's reduction
    accumulates bf16/fp16 in fp32 and rounds once). Zero tokens give zeros."""
    return dy.sum(dim=0)


# --------------------------------------------------------------------------------------------
# Normalizations
# --------------------------------------------------------------------------------------------


def _gamma(weight: torch.Tensor, zero_centered_gamma: bool, dtype: torch.dtype) -> torch.Tensor:
    """The effective scale: the stored weight, or ``weight + 1`` when gamma is zero-centred."""
    g = weight.to(dtype)
    return g + 1 if zero_centered_gamma else g


def layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    zero_centered_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dimension: ``y = (x - mean) * rstd * gamma + beta``.

    x: (N, K); weight, bias: (K,). ``gamma = weight`` or ``weight + 1`` when zero-centred.
    ``rstd = 1 / sqrt(var + eps)`` with the biased variance. Everything runs in the compute dtype;
    y is rounded once to x's dtype. Returns ``(y, mean, rstd)``; mean and rstd (N, 1) stay in the
    compute dtype for the backward.
    """
    cdt = compute_dtype(x.dtype)
    xc = x.to(cdt)
    mean = xc.mean(dim=-1, keepdim=True)
    var = ((xc - mean) ** 2).mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    y = (xc - mean) * rstd * _gamma(weight, zero_centered_gamma, cdt) + bias.to(cdt)
    return y.to(x.dtype), mean, rstd


def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`layer_norm_fwd`.

    With ``xhat = (x - mean) * rstd`` and ``g = dy * gamma``:
    ``dx = rstd * (g - mean(g) - xhat * mean(g * xhat))``, ``dgamma = sum_N dy * xhat``,
    ``dbeta = sum_N dy``. Computed in the compute dtype; dx rounded once to x's dtype, dgamma and
    dbeta rounded once to the parameter dtype. (The derivative with respect to the stored weight
    equals dgamma whether or not gamma is zero-centred.)
    """
    cdt = compute_dtype(x.dtype)
    dyc = dy.to(cdt)
    xhat = (x.to(cdt) - mean) * rstd
    g = dyc * _gamma(weight, zero_centered_gamma, cdt)
    dx = rstd * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dgamma = (dyc * xhat).sum(dim=0)
    dbeta = dyc.sum(dim=0)
    return dx.to(x.dtype), dgamma.to(weight.dtype), dbeta.to(weight.dtype)


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension: ``y = x * rstd * gamma``, ``rstd = 1/sqrt(mean(x^2)+eps)``.

    x: (N, K); weight: (K,). Compute dtype inside, y rounded once to x's dtype.
    Returns ``(y, rstd)`` with rstd (N, 1) in the compute dtype.
    """
    cdt = compute_dtype(x.dtype)
    xc = x.to(cdt)
    rstd = torch.rsqrt((xc * xc).mean(dim=-1, keepdim=True) + eps)
    y = xc * rstd * _gamma(weight, zero_centered_gamma, cdt)
    return y.to(x.dtype), rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    zero_centered_gamma: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`rms_norm_fwd`.

    With ``xhat = x * rstd`` and ``g = dy * gamma``: ``dx = rstd * (g - xhat * mean(g * xhat))``,
    ``dgamma = sum_N dy * xhat``. Compute dtype inside; dx rounded to x's dtype, dgamma to the
    parameter dtype.
    """
    cdt = compute_dtype(x.dtype)
    dyc = dy.to(cdt)
    xhat = x.to(cdt) * rstd
    g = dyc * _gamma(weight, zero_centered_gamma, cdt)
    dx = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    dgamma = (dyc * xhat).sum(dim=0)
    return dx.to(x.dtype), dgamma.to(weight.dtype)


# --------------------------------------------------------------------------------------------
# Activations (inputs already in the compute dtype)
# --------------------------------------------------------------------------------------------

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def gelu_tanh(a: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (as TransformerEngine):
    ``0.5 * a * (1 + tanh(sqrt(2/pi) * (a + 0.044715 a^3)))``."""
    return 0.5 * a * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_C * a**3)))


def gelu_tanh_grad(a: torch.Tensor) -> torch.Tensor:
    """d gelu_tanh / da = ``0.5 (1 + t) + 0.5 a (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 a^2)``."""
    t = torch.tanh(_SQRT_2_OVER_PI * (a + _GELU_C * a**3))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * _GELU_C * a * a)


def relu(a: torch.Tensor) -> torch.Tensor:
    """``max(a, 0)``."""
    return torch.clamp_min(a, 0)


def relu_grad(a: torch.Tensor) -> torch.Tensor:
    """1 where a > 0, else 0 (the subgradient at 0 is 0, as torch)."""
    return (a > 0).to(a.dtype)


def silu(a: torch.Tensor) -> torch.Tensor:
    """``a * sigmoid(a)``."""
    return a * torch.sigmoid(a)


def silu_grad(a: torch.Tensor) -> torch.Tensor:
    """``s + a s (1 - s)`` with ``s = sigmoid(a)``."""
    s = torch.sigmoid(a)
    return s + a * s * (1.0 - s)


_ELEMENTWISE = {
    "gelu": (gelu_tanh, gelu_tanh_grad),
    "relu": (relu, relu_grad),
    "swiglu": (silu, silu_grad),
    "geglu": (gelu_tanh, gelu_tanh_grad),
}
# The names (and which are gated) are the contract's (SPEC §2); this table gives their formulas.
assert set(_ELEMENTWISE) == set(ACTIVATIONS) and GATED_ACTIVATIONS <= set(ACTIVATIONS)


def activation_fwd(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Apply ``activation`` to fc1's output h: (N, F) or, gated, (N, 2F) -> (N, F).

    Gated activations split h into halves ``[a, b]`` along the last dimension and return
    ``act(a) * b`` (the first half is activated: swiglu = silu(a) * b, geglu = gelu_tanh(a) * b).
    Runs in the compute dtype, rounded once to h's dtype.
    """
    fn, _ = _ELEMENTWISE[activation]
    hc = h.to(compute_dtype(h.dtype))
    if activation in GATED_ACTIVATIONS:
        a, b = hc.chunk(2, dim=-1)
        out = fn(a) * b
    else:
        out = fn(hc)
    return out.to(h.dtype)


def activation_bwd(dout: torch.Tensor, h: torch.Tensor, activation: str) -> torch.Tensor:
    """Backward of :func:`activation_fwd`: returns dh, same shape as h, rounded once to h's dtype.

    Gated: ``da = dout * act'(a) * b``, ``db = dout * act(a)``, ``dh = [da, db]``.
    """
    fn, grad = _ELEMENTWISE[activation]
    cdt = compute_dtype(h.dtype)
    hc, dc = h.to(cdt), dout.to(cdt)
    if activation in GATED_ACTIVATIONS:
        a, b = hc.chunk(2, dim=-1)
        dh = torch.cat([dc * grad(a) * b, dc * fn(a)], dim=-1)
    else:
        dh = dc * grad(hc)
    return dh.to(h.dtype)


# --------------------------------------------------------------------------------------------
# Grouped linear: one Linear per contiguous block of rows
# --------------------------------------------------------------------------------------------


def grouped_linear_fwd(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    m_splits: list[int],
) -> torch.Tensor:
    """Rows ``x[sum(m_splits[:i]) : sum(m_splits[:i+1])]`` go through group i's Linear.

    x: (N, K) with N == sum(m_splits); weights[i]: (M, K) -> y: (N, M). Each group is exactly
    :func:`linear_fwd` on its rows, so the result equals a list of Linears on ``torch.split``.
    """
    outs = [linear_fwd(xi, w, b) for xi, w, b in zip(x.split(m_splits), weights, biases)]
    return torch.cat(outs, dim=0) if outs else x.new_empty(0, weights[0].shape[0])


def grouped_linear_dgrad(
    dy: torch.Tensor, weights: list[torch.Tensor], m_splits: list[int]
) -> torch.Tensor:
    """dx rows of group i = :func:`linear_dgrad` of that group's rows of dy."""
    return torch.cat([linear_dgrad(g, w) for g, w in zip(dy.split(m_splits), weights)], dim=0)
