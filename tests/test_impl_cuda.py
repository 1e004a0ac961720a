"""CUDA-only paths of impl, each next to a CPU test of its portable twin.

* fused fp32 accumulation with bf16/fp16 operands: CUDA ``addmm(out_dtype=float32)`` straight
  into ``main_grad`` vs the portable upcast-then-``addmm_``;
* ``backward_dw(stream=...)`` on a side stream vs the CPU call that ignores the argument;
* the sm90 ``torch._grouped_mm`` default vs the forced grouped path on CPU
  (``test_impl_grouped.py``).
"""

from __future__ import annotations

import pytest
import splitgrad.impl as impl
import torch
from cases import fill, prefill_grads, snapshot
from splitgrad.impl import gemm

LOW = [torch.bfloat16, torch.float16]


def _wgrad_truth(main_grad, dy, x, overwrite):
    acc = torch.zeros_like(main_grad, dtype=torch.float64) if overwrite else main_grad.double()
    return acc + dy.double().t() @ x.double()


def _check_wgrad_into_main_grad(device, dtype, overwrite):
    gen = torch.Generator().manual_seed(0)
    dy = torch.randn(64, 24, generator=gen).to(dtype).to(device)
    x = torch.randn(64, 40, generator=gen).to(dtype).to(device)
    main_grad = torch.randn(24, 40, generator=gen).to(device)
    truth = _wgrad_truth(main_grad.cpu(), dy.cpu(), x.cpu(), overwrite)
    ptr = main_grad.data_ptr()
    gemm.wgrad_into_main_grad_(main_grad, dy, x, overwrite)
    assert main_grad.data_ptr() == ptr and main_grad.dtype == torch.float32
    # fp32 accumulation of exact products of low-precision operands: only fp32 roundings over
    # 64 terms, far below one bf16/fp16 rounding of dW (which the fused path must not incur).
    err = (main_grad.cpu().double() - truth).abs().max().item()
    assert err <= 64 * 2.0**-24 * truth.abs().max().item()


@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("overwrite", [False, True])
def test_portable_fused_wgrad_accumulates_in_fp32(dtype, overwrite):
    assert not gemm.cuda_out_dtype_supported(torch.device("cpu"), dtype)
    _check_wgrad_into_main_grad("cpu", dtype, overwrite)


def test_overwrite_ignores_nan_in_main_grad():
    main_grad = torch.full((4, 3), float("nan"))
    gemm.wgrad_into_main_grad_(
        main_grad,
        torch.ones(2, 4, dtype=torch.bfloat16),
        torch.ones(2, 3, dtype=torch.bfloat16),
        True,
    )
    assert torch.equal(main_grad, torch.full((4, 3), 2.0))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", LOW, ids=str)
@pytest.mark.parametrize("overwrite", [False, True])
def test_cuda_out_dtype_fused_wgrad(dtype, overwrite):
    assert gemm.cuda_out_dtype_supported(torch.device("cuda", torch.cuda.current_device()), dtype)
    _check_wgrad_into_main_grad("cuda", dtype, overwrite)


def _delayed_pair(device, dtype):
    mods = []
    for delay in (False, True):
        m = impl.LayerNormMLP(
            64, 128, params_dtype=dtype, fuse_wgrad_accumulation=True, delay_wgrad_compute=delay
        )
        fill(m, 0)
        prefill_grads(m, 1, fused=True)
        m.to(device)
        for p in m.parameters():
            if isinstance(getattr(p, "main_grad", None), torch.Tensor):
                p.main_grad = p.main_grad.to(device)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        mods.append(m)
    return mods


def _micro(module, device, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=gen).to(dtype).to(device).requires_grad_()
    y = module(x)
    y.backward(torch.randn(y.shape, generator=gen).to(dtype).to(device))
    return x.grad


def test_backward_dw_stream_argument_ignored_on_cpu():
    plain, delayed = _delayed_pair("cpu", torch.bfloat16)
    calls = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    for seed in (1, 2):
        _micro(plain, "cpu", torch.bfloat16, seed)
        _micro(delayed, "cpu", torch.bfloat16, seed)
    delayed.backward_dw(stream=object())
    delayed.backward_dw(stream=None)
    assert calls == [1, 1]
    for key, value in snapshot(plain).items():
        torch.testing.assert_close(snapshot(delayed)[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.cuda
def test_backward_dw_on_side_stream_is_bitwise_and_ordered():
    """The wgrad runs on a side stream; the result equals the non-delayed run bitwise, and work
    queued on the current stream after backward_dw sees the gradients."""
    dtype = torch.bfloat16
    plain, delayed = _delayed_pair("cuda", dtype)
    side = torch.cuda.Stream()
    for seed in (1, 2):
        _micro(plain, "cuda", dtype, seed)
        _micro(delayed, "cuda", dtype, seed)
    # Keep the current stream busy so a missing wait would be observable.
    busy = torch.randn(2048, 2048, device="cuda")
    for _ in range(4):
        busy = busy @ busy / 2048
    seen = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(
        lambda: seen.append(delayed.fc1_weight.main_grad.clone())
    )
    delayed.backward_dw(stream=side)
    delayed.backward_dw(stream=side)
    torch.cuda.synchronize()
    expected = snapshot(plain)
    for key, value in snapshot(delayed).items():
        torch.testing.assert_close(value, expected[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(seen[-1], expected["fc1_weight.main_grad"], rtol=0, atol=0)
    assert delayed.pending_wgrad_count == 0


@pytest.mark.cuda
def test_side_stream_entry_memory_is_freed():
    from torch.multiprocessing.reductions import StorageWeakRef

    m = impl.Linear(64, 64, delay_wgrad_compute=True, device="cuda")
    x = torch.randn(32, 64, device="cuda")
    ref = StorageWeakRef(x.untyped_storage())
    m(x).sum().backward()
    del x
    m.backward_dw(stream=torch.cuda.Stream())
    torch.cuda.synchronize()
    assert ref.expired()


@pytest.mark.cuda
def test_grouped_mm_default_on_sm90():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch._grouped_mm needs sm90+")
    module = impl.GroupedLinear(4, 64, 128, params_dtype=torch.bfloat16, device="cuda")
    x = torch.randn(40, 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    assert module._use_grouped(x)
    loop = impl.GroupedLinear(4, 64, 128, params_dtype=torch.bfloat16, device="cuda")
    loop.load_state_dict(module.state_dict())
    loop.grouped_gemm = "loop"
    splits = [10, 0, 25, 5]
    y, y_loop = module(x, splits), loop(x, splits)
    torch.testing.assert_close(y, y_loop, rtol=0, atol=2 * 2.0**-8 * y_loop.abs().max().item())
