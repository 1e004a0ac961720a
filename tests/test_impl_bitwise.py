"""impl: delayed ≡ non-delayed, bitwise, beyond the contract matrix: every module × fp32/bf16/fp16
× bias × fused, over the option space the contract tests leave at defaults (norms, activations,
zero-centred gamma, saved vs recomputed activation, grouped vs loop GEMM path), with random
non-zero ``.grad`` / ``main_grad`` prefill so accumulation is what gets compared."""

from __future__ import annotations

import itertools

import pytest
import splitgrad.impl as impl
import torch
from cases import assert_same, fill, prefill_grads, snapshot

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS, HIDDEN, OUT, FFN = 10, 16, 12, 24
SPLITS = [4, 0, 6]


def _build(kind: str, delay: bool, *, dtype, bias, fused, **options):
    common = dict(
        bias=bias, params_dtype=dtype, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay
    )
    if kind == "Linear":
        return impl.Linear(HIDDEN, OUT, **common)
    if kind == "LayerNormLinear":
        return impl.LayerNormLinear(HIDDEN, OUT, **common, **options)
    if kind == "LayerNormMLP":
        recompute = options.pop("recompute", True)
        m = impl.LayerNormMLP(HIDDEN, FFN, **common, **options)
        m.recompute_activation = recompute
        return m
    path = options.pop("path", "loop")
    # 16 output features: _grouped_mm needs 16-byte aligned rows (bf16 * 8).
    m = impl.GroupedLinear(len(SPLITS), HIDDEN, 16 if path == "grouped" else OUT, **common)
    m.grouped_gemm = path
    return m


def _run(module, seed: int, steps: int, first: bool) -> torch.Tensor:
    """``steps`` micro-batches (forward + backward); returns the concatenated input grads."""
    grads = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed + step)
        x = torch.randn(ROWS, HIDDEN, generator=gen, dtype=torch.float64)
        x = x.to(module.params_dtype).requires_grad_()
        is_first = first and step == 0
        if isinstance(module, impl.GroupedLinear):
            y = module(x, SPLITS, is_first_microbatch=is_first)
        else:
            y = module(x, is_first_microbatch=is_first)
        dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
        y.backward(dy)
        grads.append(x.grad)
    return torch.cat(grads)


def _check(kind, dtype, bias, fused, steps=2, first=False, **options):
    pair = [_build(kind, d, dtype=dtype, bias=bias, fused=fused, **dict(options)) for d in (0, 1)]
    for m in pair:
        fill(m, 0)
        prefill_grads(m, 1, fused=fused)
    plain, delayed = pair
    gx_plain = _run(plain, 5, steps, first)
    gx_delayed = _run(delayed, 5, steps, first)
    assert delayed.pending_wgrad_count == steps
    torch.testing.assert_close(gx_delayed, gx_plain, rtol=0, atol=0)
    for _ in range(steps):
        delayed.backward_dw()
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_module_dtype_bias_fused(kind, dtype, bias, fused):
    _check(kind, dtype, bias, fused, first=fused)


_MLP_OPTIONS = list(
    itertools.product(
        ["gelu", "relu", "swiglu", "geglu"], ["LayerNorm", "RMSNorm"], [False, True], [True, False]
    )
)


@pytest.mark.parametrize(
    "activation, normalization, zero_centered, recompute",
    _MLP_OPTIONS,
    ids=[f"{a}-{n}-zc{int(z)}-re{int(r)}" for a, n, z, r in _MLP_OPTIONS],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_layernorm_mlp_options(activation, normalization, zero_centered, recompute, dtype):
    _check(
        "LayerNormMLP",
        dtype,
        True,
        True,
        activation=activation,
        normalization=normalization,
        zero_centered_gamma=zero_centered,
        recompute=recompute,
    )


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layernorm_linear_options(normalization, zero_centered, dtype):
    _check(
        "LayerNormLinear",
        dtype,
        True,
        False,
        normalization=normalization,
        zero_centered_gamma=zero_centered,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.skipif(
    not impl.gemm.grouped_mm_runs(torch.float32, 16, 16),
    reason=f"torch {torch.__version__} has no CPU torch._grouped_mm (2.11+ has)",
)
def test_grouped_path_forced_on_cpu(dtype, fused):
    """The ``torch._grouped_mm`` path (sm90 default) run on CPU: still delayed ≡ non-delayed."""
    _check("GroupedLinear", dtype, True, fused, path="grouped")


def test_recompute_and_saved_activation_give_identical_gradients():
    """Recomputing ``act(h)`` in backward is the same kernel on the same input as the forward's:
    the two policies agree bitwise."""
    pair = [
        _build("LayerNormMLP", False, dtype=torch.bfloat16, bias=True, fused=True, recompute=r)
        for r in (True, False)
    ]
    for m in pair:
        fill(m, 0)
        prefill_grads(m, 1, fused=True)
    gx = [_run(m, 3, 2, False) for m in pair]
    torch.testing.assert_close(gx[0], gx[1], rtol=0, atol=0)
    assert_same(snapshot(pair[0]), snapshot(pair[1]))
