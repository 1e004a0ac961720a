"""impl GroupedLinear: grouped path vs loop, empty groups, and the loop ≡ a list of Linears."""

from __future__ import annotations

import pytest
import splitgrad.impl as impl
import torch
from cases import fill, prefill_grads, snapshot
from splitgrad.impl import gemm
from splitgrad.impl.grouped_linear import _stacked

K, M = 16, 32
SPLITS = [5, 0, 7, 0]

# torch 2.8 has ``_grouped_mm`` for CUDA only: a forced "grouped" path then runs the loop, and
# comparing the loop with itself would prove nothing.
needs_cpu_grouped_mm = pytest.mark.skipif(
    not gemm.grouped_mm_runs(torch.float32, K, M),
    reason=f"torch {torch.__version__} has no CPU torch._grouped_mm (2.11+ has)",
)


def _pair(dtype, fused):
    mods = []
    for path in ("loop", "grouped"):
        m = impl.GroupedLinear(len(SPLITS), K, M, params_dtype=dtype, fuse_wgrad_accumulation=fused)
        m.grouped_gemm = path
        fill(m, 0)
        prefill_grads(m, 1, fused=fused)
        mods.append(m)
    return mods


def _run(module, splits):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(splits), K, generator=gen, dtype=torch.float64)
    x = x.to(module.params_dtype).requires_grad_()
    y = module(x, splits)
    y.backward(torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype))
    return y, x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("splits", [SPLITS, [0, 0, 0, 0], [12, 0, 0, 0]], ids=str)
@needs_cpu_grouped_mm
def test_grouped_path_matches_loop(dtype, fused, splits):
    """Different kernels (one grouped GEMM vs one GEMM per group): equal within a few roundings
    of the dtype (fp32: 1e-5 relative, bf16: 2 ulps at the output scale). The wgrad is the same
    per-group code on both paths, so weight gradients agree bitwise."""
    loop, grouped = _pair(dtype, fused)
    assert grouped._use_grouped(torch.empty(0, K, dtype=dtype))
    assert not loop._use_grouped(torch.empty(0, K, dtype=dtype))
    (y_l, gx_l), (y_g, gx_g) = _run(loop, splits), _run(grouped, splits)
    tol = 1e-5 if dtype == torch.float32 else 2 * 2.0**-8
    for a, b in ((y_g, y_l), (gx_g, gx_l)):
        scale = max(b.abs().max().item(), 1.0) if b.numel() else 1.0
        torch.testing.assert_close(a, b, rtol=0, atol=tol * scale)
    s_l, s_g = snapshot(loop), snapshot(grouped)
    for key in s_l:
        torch.testing.assert_close(s_g[key], s_l[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_loop_path_bitwise_equals_list_of_linears(dtype):
    """P12 where both run the same kernel: each group is exactly a ``Linear``'s addmm/mm."""
    grouped = impl.GroupedLinear(len(SPLITS), K, M, params_dtype=dtype)
    grouped.grouped_gemm = "loop"
    fill(grouped, 0)
    linears = [impl.Linear(K, M, params_dtype=dtype) for _ in SPLITS]
    with torch.no_grad():
        for i, lin in enumerate(linears):
            lin.weight.copy_(getattr(grouped, f"weight{i}"))
            lin.bias.copy_(getattr(grouped, f"bias{i}"))
    y, gx = _run(grouped, SPLITS)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(sum(SPLITS), K, generator=gen, dtype=torch.float64).to(dtype)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    x.requires_grad_()
    ys = [lin(xi) for lin, xi in zip(linears, x.split(SPLITS))]
    torch.cat(ys).backward(dy)
    torch.testing.assert_close(y, torch.cat(ys), rtol=0, atol=0)
    torch.testing.assert_close(gx, x.grad, rtol=0, atol=0)
    for i, lin in enumerate(linears):
        torch.testing.assert_close(
            getattr(grouped, f"weight{i}").grad, lin.weight.grad, rtol=0, atol=0
        )
        torch.testing.assert_close(getattr(grouped, f"bias{i}").grad, lin.bias.grad, rtol=0, atol=0)


def test_empty_group_gets_zero_gradients():
    module = impl.GroupedLinear(3, K, M)
    x = torch.randn(4, K)
    module(x, [4, 0, 0]).sum().backward()
    assert torch.count_nonzero(module.weight1.grad) == 0
    assert torch.count_nonzero(module.bias2.grad) == 0
    assert torch.count_nonzero(module.weight0.grad) > 0


def test_weights_share_one_storage_and_stack_as_a_view():
    module = impl.GroupedLinear(3, K, M)
    weights = [module.weight0, module.weight1, module.weight2]
    stacked = _stacked(weights)
    assert stacked.untyped_storage().data_ptr() == weights[0].untyped_storage().data_ptr()
    torch.testing.assert_close(stacked, torch.stack([w.detach() for w in weights]), rtol=0, atol=0)
    # Once the layout is lost, the weights are stacked by copy, with the same values.
    module.weight1.data = module.weight1.data.clone()
    weights = [module.weight0, module.weight1, module.weight2]
    stacked = _stacked(weights)
    assert stacked.untyped_storage().data_ptr() != weights[0].untyped_storage().data_ptr()
    torch.testing.assert_close(stacked, torch.stack([w.detach() for w in weights]), rtol=0, atol=0)


def test_unaligned_shapes_fall_back_to_loop():
    module = impl.GroupedLinear(2, 6, 10, params_dtype=torch.bfloat16)
    module.grouped_gemm = "grouped"
    assert not gemm.grouped_mm_runs(torch.bfloat16, 6, 10)
    assert not module._use_grouped(torch.empty(0, 6, dtype=torch.bfloat16))
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    module(x, [2, 3]).sum().backward()


def test_missing_grouped_kernel_falls_back_to_loop(monkeypatch):
    """A torch whose ``_grouped_mm`` has no kernel for the device (2.8 on CPU): the probe says
    so once, and a forced "grouped" module runs the loop with the loop's exact results."""
    loop, grouped = _pair(torch.float32, False)
    want_y, want_dx = _run(loop, SPLITS)

    def no_kernel(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_grouped_mm' with arguments from the 'CPU'")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    gemm._grouped_mm_available.cache_clear()
    try:
        assert not gemm.grouped_mm_runs(torch.float32, K, M)
        assert not grouped._use_grouped(torch.empty(0, K))
        got_y, got_dx = _run(grouped, SPLITS)
    finally:
        monkeypatch.undo()
        gemm._grouped_mm_available.cache_clear()
    torch.testing.assert_close(got_y, want_y, rtol=0, atol=0)
    torch.testing.assert_close(got_dx, want_dx, rtol=0, atol=0)


def test_invalid_path_name():
    module = impl.GroupedLinear(2, K, M)
    module.grouped_gemm = "fast"
    with pytest.raises(ValueError, match="fast"):
        module(torch.randn(2, K), [1, 1])


def test_auto_is_loop_on_cpu():
    assert not gemm.grouped_mm_supported(torch.device("cpu"), torch.bfloat16, K, M)
