"""Tier 3 of the oracle: the reference's hand-written backward against autograd / finite
differences in float64 on tiny shapes, for every module and option combination."""

from __future__ import annotations

import itertools

import pytest
import splitgrad.reference as ref
import torch
from splitgrad.reference import functional as F
from torch.autograd import gradcheck

F64 = torch.float64


def _rand(*shape, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=F64) * scale).requires_grad_()


# ---- the formulas ----------------------------------------------------------------------------


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, zc):
        y, mean, rstd = F.layer_norm_fwd(x, w, b, 1e-5, zc)
        ctx.save_for_backward(x, w, mean, rstd)
        ctx.zc = zc
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, mean, rstd = ctx.saved_tensors
        return (*F.layer_norm_bwd(dy, x, w, mean, rstd, ctx.zc), None)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, zc):
        y, rstd = F.rms_norm_fwd(x, w, 1e-5, zc)
        ctx.save_for_backward(x, w, rstd)
        ctx.zc = zc
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        return (*F.rms_norm_bwd(dy, x, w, rstd, ctx.zc), None)


class _Activation(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, name):
        ctx.save_for_backward(h)
        ctx.name = name
        return F.activation_fwd(h, name)

    @staticmethod
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        return F.activation_bwd(dout, h, ctx.name), None


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return F.linear_fwd(x, w, b)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return F.linear_dgrad(dy, w), F.linear_wgrad(dy, x), F.bias_grad(dy)


@pytest.mark.parametrize("zc", [False, True])
def test_layer_norm_formulas(zc):
    x, w, b = _rand(4, 6, seed=1, scale=2), _rand(6, seed=2), _rand(6, seed=3)
    assert gradcheck(lambda x, w, b: _LayerNorm.apply(x, w, b, zc), (x, w, b))


@pytest.mark.parametrize("zc", [False, True])
def test_rms_norm_formulas(zc):
    x, w = _rand(4, 6, seed=1, scale=2), _rand(6, seed=2)
    assert gradcheck(lambda x, w: _RMSNorm.apply(x, w, zc), (x, w))


@pytest.mark.parametrize("name", F.ACTIVATIONS)
def test_activation_formulas(name):
    h = _rand(5, 8, seed=4, scale=2)
    with torch.no_grad():  # keep relu's kink away from the finite-difference steps
        h[h.abs() < 1e-2] += 0.1
    assert gradcheck(lambda h: _Activation.apply(h, name), (h,))


def test_activation_forward_matches_torch():
    """The hand-written activations are the functions TransformerEngine names them after."""
    h = _rand(5, 8, seed=5, scale=3).detach()
    a, b = h.chunk(2, dim=-1)
    tanh_gelu = torch.nn.functional.gelu
    expected = {
        "gelu": tanh_gelu(h, approximate="tanh"),
        "relu": torch.relu(h),
        "swiglu": torch.nn.functional.silu(a) * b,
        "geglu": tanh_gelu(a, approximate="tanh") * b,
    }
    for name, value in expected.items():
        torch.testing.assert_close(F.activation_fwd(h, name), value, rtol=1e-12, atol=1e-12)


def test_norm_forward_matches_torch():
    x, w, b = _rand(4, 6, seed=1).detach(), _rand(6, seed=2).detach(), _rand(6, seed=3).detach()
    ln = torch.nn.functional.layer_norm(x, (6,), w, b, 1e-5)
    torch.testing.assert_close(F.layer_norm_fwd(x, w, b, 1e-5)[0], ln, rtol=1e-12, atol=1e-12)
    rms = torch.nn.functional.rms_norm(x, (6,), w, 1e-5)
    torch.testing.assert_close(F.rms_norm_fwd(x, w, 1e-5)[0], rms, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        F.layer_norm_fwd(x, w - 1, b, 1e-5, True)[0], ln, rtol=1e-12, atol=1e-12
    )


def test_linear_formulas():
    x, w, b = _rand(5, 4, seed=1), _rand(3, 4, seed=2), _rand(3, seed=3)
    assert gradcheck(_Linear.apply, (x, w, b))


def test_empty_group_wgrad_is_zero():
    dy, x = torch.zeros(0, 3, dtype=F64), torch.zeros(0, 4, dtype=F64)
    assert torch.equal(F.linear_wgrad(dy, x), torch.zeros(3, 4, dtype=F64))
    assert torch.equal(F.bias_grad(dy), torch.zeros(3, dtype=F64))


# ---- whole modules ----------------------------------------------------------------------------


def _module_configs():
    for bias in (True, False):
        yield "Linear", {"bias": bias}
        yield "GroupedLinear", {"bias": bias}
        for norm, zc in itertools.product(("LayerNorm", "RMSNorm"), (False, True)):
            yield (
                "LayerNormLinear",
                {"bias": bias, "normalization": norm, "zero_centered_gamma": zc},
            )
            for act in F.ACTIVATIONS:
                yield (
                    "LayerNormMLP",
                    {
                        "bias": bias,
                        "normalization": norm,
                        "zero_centered_gamma": zc,
                        "activation": act,
                    },
                )


CONFIGS = list(_module_configs())
SPLITS = [2, 0, 3]


def _build(kind, delay=False, fused=False, **options):
    kw = dict(params_dtype=F64, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused, **options)
    module = {
        "Linear": lambda: ref.Linear(4, 3, **kw),
        "LayerNormLinear": lambda: ref.LayerNormLinear(4, 3, **kw),
        "LayerNormMLP": lambda: ref.LayerNormMLP(4, 3, **kw),
        "GroupedLinear": lambda: ref.GroupedLinear(3, 4, 3, **kw),
    }[kind]()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    return module


def _call(module, x):
    return module(x, SPLITS) if isinstance(module, ref.GroupedLinear) else module(x)


def _loss(module, x, dy):
    return (_call(module, x) * dy).sum()


def _finite_difference(module, x, dy, param, eps=1e-6):
    grad = torch.zeros_like(param)
    with torch.no_grad():
        flat, out = param.view(-1), grad.view(-1)
        for i in range(flat.numel()):
            orig = flat[i].item()
            flat[i] = orig + eps
            hi = _loss(module, x, dy).item()
            flat[i] = orig - eps
            lo = _loss(module, x, dy).item()
            flat[i] = orig
            out[i] = (hi - lo) / (2 * eps)
    return grad


@pytest.mark.parametrize("kind, options", CONFIGS, ids=[f"{k}-{o}" for k, o in CONFIGS])
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
def test_module_gradients_match_finite_differences(kind, options, delay):
    module = _build(kind, delay=delay, **options)
    x = _rand(5, 4, seed=21)
    # the input gradient through torch's own gradcheck (weights enter as constants)
    assert gradcheck(lambda x: _call(module, x), (x,))
    while module.pending_wgrad_count:  # gradcheck's own backwards queued entries
        module.backward_dw()
    for p in module.parameters():
        p.grad = None
    dy = _rand(*_call(module, x).shape, seed=22).detach()
    _loss(module, x, dy).backward()
    if delay:
        module.backward_dw()
    for name, p in module.named_parameters():
        expected = _finite_difference(module, x.detach(), dy, p)
        torch.testing.assert_close(p.grad, expected, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
def test_fused_float64_main_grad_equals_plain_grad(kind):
    """In float64 (the upcast truth) fused accumulation into a float64 main_grad runs the same
    GEMM as the plain path: bitwise equal."""
    plain, fused = _build(kind), _build(kind, fused=True)
    weights = [n for n, _ in fused.named_parameters() if "weight" in n and "layer_norm" not in n]
    for n in weights:
        getattr(fused, n).main_grad = torch.zeros_like(getattr(fused, n))
    x = _rand(5, 4, seed=3).detach()
    dy = _rand(*_call(plain, x).shape, seed=4).detach()
    for m in (plain, fused):
        _loss(m, x, dy).backward()
    for n in weights:
        assert getattr(fused, n).grad is None
        torch.testing.assert_close(
            getattr(fused, n).main_grad, getattr(plain, n).grad, rtol=0, atol=0
        )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [[2, 0, 3], [0, 0, 5], [5, 0, 0], [0, 0, 0]])
def test_grouped_linear_is_a_list_of_linears(dtype, splits):
    """P12 on the reference: same GEMMs, so bitwise, empty groups included."""
    grouped = ref.GroupedLinear(3, 4, 3, params_dtype=dtype)
    linears = [ref.Linear(4, 3, params_dtype=dtype) for _ in range(3)]
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for i, lin in enumerate(linears):
            for name in ("weight", "bias"):
                value = torch.randn(getattr(lin, name).shape, generator=g).to(dtype)
                getattr(lin, name).copy_(value)
                getattr(grouped, f"{name}{i}").copy_(value)
    x = torch.randn(sum(splits), 4, generator=g).to(dtype)
    dy = torch.randn(sum(splits), 3, generator=g).to(dtype)
    xg, xl = x.clone().requires_grad_(), x.clone().requires_grad_()
    grouped(xg, splits).backward(dy)
    torch.cat([lin(part) for lin, part in zip(linears, xl.split(splits))]).backward(dy)
    torch.testing.assert_close(xg.grad, xl.grad, rtol=0, atol=0)
    for i, lin in enumerate(linears):
        for name in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(grouped, f"{name}{i}").grad, getattr(lin, name).grad, rtol=0, atol=0
            )


def test_upcast_twin_has_same_values_in_float64():
    module = ref.LayerNormMLP(
        6,
        8,
        activation="swiglu",
        params_dtype=torch.bfloat16,
        fuse_wgrad_accumulation=True,
        normalization="RMSNorm",
    )
    for n in ("fc1_weight", "fc2_weight"):
        getattr(module, n).main_grad = torch.randn(getattr(module, n).shape)
    twin = ref.upcast(module)
    assert twin.activation == "swiglu" and twin.normalization == "RMSNorm"
    assert twin.fuse_wgrad_accumulation and twin.params_dtype == F64
    for (_, p), (_, q) in zip(module.named_parameters(), twin.named_parameters()):
        assert q.dtype == F64
        torch.testing.assert_close(q, p.to(F64), rtol=0, atol=0)
        if hasattr(p, "main_grad"):
            torch.testing.assert_close(q.main_grad, p.main_grad.to(F64), rtol=0, atol=0)
