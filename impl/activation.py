"""Activations of ``LayerNormMLP`` with torch's fused elementwise kernels.

``"gelu"`` is the tanh approximation; ``"swiglu"``/``"geglu"`` split fc1's output ``h`` into
halves ``[a, b]`` and return ``act(a) * b``. Backward uses aten's ``gelu_backward`` /
``silu_backward`` / ``threshold_backward`` kernels, writing both halves of a gated gradient
straight into one (N, 2F) buffer (no ``cat``).

Precision: the kernels run in the tensor's dtype (bf16/fp16 kernels compute each element in
fp32 internally and round once). Gated activations in bf16/fp16 are computed in fp32 and rounded
once, like the reference: rounding ``act(a)`` before the product doubled the error of fc2's
wgrad operand, which the harness's P3 budget (found by ``splitgrad verify``) rejects.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from splitgrad.reference.contract import GATED_ACTIVATIONS as GATED

__all__ = ["act_fwd", "act_bwd"]


def _elementwise(a: torch.Tensor, activation: str) -> torch.Tensor:
    if activation in ("gelu", "geglu"):
        return F.gelu(a, approximate="tanh")
    if activation == "relu":
        return F.relu(a)
    return F.silu(a)


def _elementwise_bwd(d: torch.Tensor, a: torch.Tensor, activation: str, out: torch.Tensor) -> None:
    if activation in ("gelu", "geglu"):
        torch.ops.aten.gelu_backward.grad_input(d, a, approximate="tanh", grad_input=out)
    elif activation == "relu":
        torch.ops.aten.threshold_backward.grad_input(d, a, 0, grad_input=out)
    else:
        torch.ops.aten.silu_backward.grad_input(d, a, grad_input=out)


def _elementwise_bwd_new(d: torch.Tensor, a: torch.Tensor, activation: str) -> torch.Tensor:
    out = torch.empty_like(a)
    _elementwise_bwd(d, a, activation, out)
    return out


def act_fwd(h: torch.Tensor, activation: str) -> torch.Tensor:
    """(N, F) or, gated, (N, 2F) -> (N, F)."""
    if activation in GATED:
        a, b = _wide(h).chunk(2, dim=-1)
        return _elementwise(a, activation).mul_(b).to(h.dtype)
    return _elementwise(h, activation)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """fp32 view of a bf16/fp16 tensor for single-rounding gated math (no-op otherwise)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


def act_bwd(
    d_out: torch.Tensor, h: torch.Tensor, activation: str, want_out: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dh, act_fwd(h) if want_out else None)``; dh has h's shape.

    ``want_out`` recomputes the activation output for fc2's wgrad (LayerNormMLP does not keep it
    from the forward); for gated activations it costs one extra multiply.
    """
    dh = torch.empty_like(h, memory_format=torch.contiguous_format)
    if activation in GATED:
        a, b = _wide(h).chunk(2, dim=-1)
        d = _wide(d_out)
        da, db = dh.chunk(2, dim=-1)
        act_a = _elementwise(a, activation)
        db.copy_(d * act_a)
        if da.dtype == a.dtype:
            _elementwise_bwd(d * b, a, activation, da)
        else:
            da.copy_(_elementwise_bwd_new(d * b, a, activation))
        return dh, (act_a.mul_(b).to(h.dtype) if want_out else None)
    _elementwise_bwd(d_out, h, activation, dh)
    return dh, (_elementwise(h, activation) if want_out else None)
