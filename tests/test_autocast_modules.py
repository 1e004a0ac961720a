"""The modules under ``torch.autocast`` (SPEC §2), in reference and impl.

What is pinned here (the property campaign's autocast cells judge the values against float64
truth within budget; these are the structural and bitwise claims):

* dtypes: the output in the autocast dtype, ``x.grad`` in ``x``'s dtype, every parameter
  gradient in the parameter's dtype (fp32), fused weight gradients in the fp32 ``main_grad``;
* delayed ≡ non-delayed, bitwise, under autocast, and the result does not depend on whether
  ``backward()`` / ``backward_dw()`` are called inside or outside the autocast region;
* impl ``Linear`` and ``LayerNormLinear`` are bitwise the ``torch.nn`` layers they stand for
  under autocast (the same casts feeding the same ATen GEMM and norm kernels);
* FP8 inside autocast (what wins): the FP8 GEMMs quantize the weights from their own dtype and
  the activations from the autocast dtype; outputs and activation gradients come in the
  autocast dtype, parameter gradients in the parameter's; delayed ≡ non-delayed bitwise;
* bad input: an input dtype that is neither the parameters', the autocast dtype nor float32,
  and an autocast dtype the modules do not compute in, raise ``TypeError`` naming them.
"""

from __future__ import annotations

import itertools

import pytest
import splitgrad.impl as impl
import splitgrad.reference as reference
import torch

PACKAGES = {"impl": impl, "reference": reference}
KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]


def _build(pkg, kind: str, **kw):
    torch.manual_seed(7)
    if kind == "Linear":
        return pkg.Linear(32, 32, **kw)
    if kind == "LayerNormLinear":
        return pkg.LayerNormLinear(32, 32, **kw)
    if kind == "LayerNormMLP":
        return pkg.LayerNormMLP(32, 64, activation="swiglu", **kw)
    return pkg.GroupedLinear(3, 32, 32, **kw)


def _gemm_weights(m) -> list[torch.nn.Parameter]:
    return [p for n, p in m.named_parameters() if "weight" in n and "layer_norm" not in n]


def _step(m, kind, dtype, *, fused, delay, inside, recipe=None, steps=2, rows=8):
    """``steps`` micro-batches of ``rows`` rows, every forward under ``torch.autocast(dtype)``
    (and ``fp8_autocast(recipe)`` when given); ``inside``: backward and backward_dw also run
    inside the autocast region. Returns (outputs and input gradients, parameter gradients,
    main_grads of the GEMM weights when fused)."""
    if fused:
        for p in _gemm_weights(m):
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    pkg = impl if type(m).__module__.startswith("splitgrad.impl") else reference
    splits = [rows // 2, 0, rows - rows // 2]
    outs = []
    gen = torch.Generator().manual_seed(11)
    for step in range(steps):
        x = torch.randn(rows, 32, generator=gen).requires_grad_()
        dy = torch.randn(rows, 32 if kind == "LayerNormMLP" else m.out_features, generator=gen)
        args = (x, splits) if kind == "GroupedLinear" else (x,)
        with torch.autocast("cpu", dtype=dtype):
            with pkg.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = m(*args, is_first_microbatch=step == 0)
            if inside:
                y.backward(dy.to(y.dtype))
                if delay:
                    m.backward_dw()
        if not inside:
            y.backward(dy.to(y.dtype))
            if delay:
                m.backward_dw()
        outs += [y, x.grad]
    grads = [p.grad for p in m.parameters()]
    mains = [p.main_grad for p in _gemm_weights(m)] if fused else []
    return outs, grads, mains


def _same_bits(a, b) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if u is None or v is None:
            assert u is None and v is None
        else:
            assert u.dtype == v.dtype
            torch.testing.assert_close(u, v, rtol=0, atol=0)


@pytest.mark.parametrize("package", list(PACKAGES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_dtypes_follow_autocast_and_the_parameters(package, kind, dtype, fused) -> None:
    m = _build(PACKAGES[package], kind, fuse_wgrad_accumulation=fused)
    (y, dx, *_), grads, mains = _step(m, kind, dtype, fused=fused, delay=False, inside=True)
    assert y.dtype == dtype
    assert dx.dtype == torch.float32
    gemm_weights = {id(p) for p in _gemm_weights(m)}
    for p, g in zip(m.parameters(), grads):
        if fused and id(p) in gemm_weights:
            assert g is None  # written into main_grad
        else:
            assert g is not None and g.dtype == p.dtype == torch.float32
    assert all(mg.dtype == torch.float32 for mg in mains)
    assert not fused or any(bool(mg.abs().sum() > 0) for mg in mains)  # weight1's group is empty


@pytest.mark.parametrize("package", list(PACKAGES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_delayed_equals_non_delayed_bitwise_under_autocast(package, kind, fused) -> None:
    pkg = PACKAGES[package]
    runs = []
    for delay, inside in itertools.product([False, True], [False, True]):
        m = _build(pkg, kind, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
        outs, grads, mains = _step(m, kind, torch.bfloat16, fused=fused, delay=delay, inside=inside)
        runs.append(outs + grads + mains)
    for other in runs[1:]:
        _same_bits(runs[0], other)


def test_autocast_changes_the_result() -> None:
    # The check above would pass for a module that ignored autocast: show it does not.
    m = _build(impl, "Linear")
    x = torch.randn(8, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    assert not torch.equal(y.float(), m(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("delay", [False, True])
def test_impl_linear_is_bitwise_torch_nn_linear_under_autocast(dtype, delay) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    m = impl.Linear(64, 48, delay_wgrad_compute=delay)
    with torch.no_grad():
        m.weight.copy_(lin.weight)
        m.bias.copy_(lin.bias)
    x = torch.randn(4, 10, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(4, 10, 48).to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        y1, y2 = lin(x1), m(x2)
    y1.backward(dy)
    y2.backward(dy)
    m.backward_dw()
    _same_bits(
        [y1, x1.grad, lin.weight.grad, lin.bias.grad], [y2, x2.grad, m.weight.grad, m.bias.grad]
    )


def test_impl_layernorm_linear_is_bitwise_torch_nn_under_autocast() -> None:
    torch.manual_seed(0)
    ln, lin = torch.nn.LayerNorm(64), torch.nn.Linear(64, 48)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
        ln.bias.uniform_(-0.1, 0.1)
    m = impl.LayerNormLinear(64, 48, delay_wgrad_compute=True)
    with torch.no_grad():
        m.weight.copy_(lin.weight)
        m.bias.copy_(lin.bias)
        m.layer_norm_weight.copy_(ln.weight)
        m.layer_norm_bias.copy_(ln.bias)
    x = torch.randn(40, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    dy = torch.randn(40, 48).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y1, y2 = lin(ln(x1)), m(x2)
    y1.backward(dy)
    y2.backward(dy)
    m.backward_dw()
    _same_bits(
        [y1, x1.grad, lin.weight.grad, lin.bias.grad, ln.weight.grad, ln.bias.grad],
        [y2, x2.grad, m.weight.grad, m.bias.grad, m.layer_norm_weight.grad, m.layer_norm_bias.grad],
    )


@pytest.mark.parametrize("package", list(PACKAGES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8"])
def test_fp8_inside_autocast(package, kind, recipe) -> None:
    """FP8 wins for the GEMMs (weights quantized from their own fp32, activations from the
    autocast dtype); autocast sets the activations' dtype; delayed ≡ non-delayed bitwise."""
    pkg = PACKAGES[package]
    make = {
        "delayed": lambda: pkg.DelayedScaling(amax_history_len=4),
        "current": pkg.Float8CurrentScaling,
        "mxfp8": pkg.MXFP8BlockScaling,
    }[recipe]
    runs = {}
    for delay, fused in itertools.product([False, True], [False, True]):
        m = _build(pkg, kind, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay)
        # MXFP8 scales 32-row blocks: one micro-batch of 64 rows (GroupedLinear: 32 + 0 + 32).
        rows, steps = (64, 1) if recipe == "mxfp8" else (8, 2)
        outs, grads, mains = _step(
            m,
            kind,
            torch.bfloat16,
            fused=fused,
            delay=delay,
            inside=True,
            recipe=make(),
            steps=steps,
            rows=rows,
        )
        y, dx = outs[0], outs[1]
        assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
        for p, g in zip(m.parameters(), grads):
            assert g is None or g.dtype == p.dtype == torch.float32
        runs[delay, fused] = outs + grads + mains
    _same_bits(runs[False, False], runs[True, False])
    _same_bits(runs[False, True], runs[True, True])


@pytest.mark.parametrize("package", list(PACKAGES))
def test_input_dtypes_under_autocast(package) -> None:
    pkg = PACKAGES[package]
    m = pkg.Linear(32, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # The autocast dtype (an upstream layer's output) and float32 are accepted.
        assert m(torch.randn(4, 32, dtype=torch.bfloat16)).dtype == torch.bfloat16
        assert m(torch.randn(4, 32)).dtype == torch.bfloat16
        with pytest.raises(TypeError, match=r"torch\.float64"):
            m(torch.randn(4, 32, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"torch\.bfloat16"):
        m(torch.randn(4, 32, dtype=torch.bfloat16))  # outside autocast: the parameters' dtype


@pytest.mark.parametrize("package", list(PACKAGES))
def test_an_autocast_dtype_the_modules_cannot_compute_in_is_refused(package, monkeypatch) -> None:
    m = PACKAGES[package].Linear(32, 16, delay_wgrad_compute=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # CPU autocast itself only takes bf16/fp16; stand in for a device whose autocast dtype
        # is something else (what torch.get_autocast_dtype would report there).
        monkeypatch.setattr(torch, "get_autocast_dtype", lambda device_type: torch.float8_e4m3fn)
        with pytest.raises(TypeError, match=r"torch\.float8_e4m3fn.*'cpu'"):
            m(torch.randn(4, 32))
    assert m.pending_wgrad_count == 0


@pytest.mark.parametrize("package", list(PACKAGES))
def test_a_float64_module_ignores_autocast(package) -> None:
    # torch.autocast leaves float64 tensors alone; so do the modules (the upcast truth).
    m = PACKAGES[package].Linear(32, 16, params_dtype=torch.float64)
    x = torch.randn(4, 32, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, m(x), rtol=0, atol=0)
