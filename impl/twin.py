"""impl's modules written with ``torch.nn.functional``, for the backwards that differentiate
themselves (SPEC §2).

impl's fast backward writes into preallocated buffers, runs out-variant kernels and reads
host-side statistics, none of which autograd can differentiate or ``torch.func`` can
transform. So a backward with grad mode on (``create_graph=True``, a ``torch.func`` transform)
takes this path instead: the module's forward recomputed in differentiable ``torch`` functions
and differentiated with ``torch.func.vjp``, which composes with both. Every gradient is then
returned through autograd (:func:`splitgrad.reference.routing.route_differentiable`: delay,
fused accumulation and FP8 raise there). Under a ``torch.func`` transform the forward runs here
too (:class:`TwinFunction`, with autograd's generated vmap rule), since impl's fast forward
reads host-side statistics that ``vmap`` cannot batch.

Numerics are torch's own kernels, within the budgets of the fast path; nothing here is shared
with the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from splitgrad.reference.contract import GATED_ACTIVATIONS, qualified_name
from splitgrad.reference.routing import param_targets, route_differentiable

__all__ = ["forward_of", "TwinFunction", "differentiable_backward"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _norm(module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    cdt = _compute_dtype(x.dtype)
    gamma = weight.to(cdt) + 1 if module.zero_centered_gamma else weight.to(cdt)
    k = (x.shape[-1],)
    xc = x.to(cdt)
    if module.normalization == "LayerNorm":
        y = F.layer_norm(xc, k, gamma, bias.to(cdt), module.eps)
    else:
        y = F.rms_norm(xc, k, gamma, module.eps)
    return y.to(x.dtype)


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    cdt = _compute_dtype(h.dtype)
    fn = {
        "gelu": lambda a: F.gelu(a, approximate="tanh"),
        "geglu": lambda a: F.gelu(a, approximate="tanh"),
        "relu": F.relu,
        "swiglu": F.silu,
    }[name]
    if name in GATED_ACTIVATIONS:
        a, b = h.to(cdt).chunk(2, dim=-1)
        return (fn(a) * b).to(h.dtype)
    return fn(h)


def _linear(x, weight, bias, autocast):
    if autocast is not None:  # SPEC §2: the GEMM in the autocast dtype
        x, weight = x.to(autocast), weight.to(autocast)
        bias = None if bias is None else bias.to(autocast)
    return F.linear(x, weight, bias)


def forward_of(
    module,
    x: torch.Tensor,
    params: Sequence[torch.Tensor | None],
    autocast: torch.dtype | None,
    m_splits: Sequence[int] | None = None,
) -> torch.Tensor:
    """``module``'s output for rows ``x`` and the parameters ``params`` (the forward's
    parameter inputs, in the Function's order), in differentiable ``torch`` functions."""
    kind = type(module).__name__
    if kind == "Linear":
        return _linear(x, *params, autocast)
    if kind == "GroupedLinear":
        n = module.num_gemms
        weights, biases = params[:n], list(params[n:]) or [None] * n
        parts = [
            _linear(x_g, w, b, autocast)
            for x_g, w, b in zip(x.split(list(m_splits)), weights, biases)
        ]
        return torch.cat(parts, dim=0)
    ln_weight, ln_bias, *gemm = params
    h = _norm(module, x, ln_weight, ln_bias)
    if kind == "LayerNormLinear":
        return _linear(h, *gemm, autocast)
    w1, b1, w2, b2 = gemm
    return _linear(_activation(module.activation, _linear(h, w1, b1, autocast)), w2, b2, autocast)


def differentiable_backward(
    ctx,
    module,
    dy: torch.Tensor,
    x: torch.Tensor,
    params: Sequence[torch.Tensor | None],
    autocast: torch.dtype | None,
    m_splits: Sequence[int] | None = None,
) -> list[torch.Tensor | None]:
    """The gradients of ``x`` and of each parameter input, returned through autograd and
    differentiable themselves. ``ctx`` carries ``param_names`` / ``param_present``
    (:func:`splitgrad.reference.routing.remember_params`)."""
    targets = route_differentiable(module, param_targets(ctx, module), fp8=False)
    tensors = [p for p in params if p is not None]

    def f(x, *tensors):
        it = iter(tensors)
        given = [None if p is None else next(it) for p in params]
        return forward_of(module, x, given, autocast, m_splits)

    _, vjp = torch.func.vjp(f, x, *tensors)
    dx, *grads = vjp(dy)
    it = iter(grads)
    out = [next(it) if p is not None else None for p in params]
    return [dx if ctx.needs_input_grad[0] else None] + [
        g if t.needed else None for g, t in zip(out, targets)
    ]


class TwinFunction(torch.autograd.Function):
    """An impl module under a ``torch.func`` transform: :func:`forward_of`, differentiated by
    :func:`differentiable_backward`."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, module, autocast, m_splits, names, *params):
        return forward_of(module, x, params, autocast, m_splits)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, module, autocast, m_splits, names, *params = inputs
        ctx.module, ctx.autocast, ctx.m_splits = module, autocast, m_splits
        ctx.param_names = names
        ctx.param_present = tuple(p is not None for p in params)
        ctx.save_for_backward(x, *params)

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        grads = differentiable_backward(ctx, ctx.module, dy, x, params, ctx.autocast, ctx.m_splits)
        return (grads[0], None, None, None, None, *grads[1:])

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError(
            f"{qualified_name(ctx.module)} does not support forward-mode AD (torch.func.jvp, "
            "jacfwd, hessian, torch.autograd.forward_ad)"
        )
