"""What one GPU can check of tensor parallelism (SPEC §9), for ``ci/device.sh``: every TP
module built with a one-rank NCCL group (``tp_size`` 1: the options must change nothing) is
bitwise the module built without them, on CUDA, in bf16 and fp32, delayed. The TP code paths
themselves (collectives on CUDA tensors, the GEMMs between them) run in
``tests/test_bench_tensor_parallel.py::test_gpu_holds_what_fake_tensors_do`` on torch's fake
process group; real multi-rank NCCL needs a machine with two GPUs."""

from __future__ import annotations

import pytest
import torch
from splitgrad.distributed import run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.distributed]


def _one_rank_nccl(rank: int, world: int) -> int:
    import splitgrad.impl as impl
    import torch.distributed as dist

    torch.cuda.set_device(0)
    group = dist.group.WORLD
    checked = 0
    cases = (
        (lambda **k: impl.Linear(64, 32, **k), dict(parallel_mode="column")),
        (lambda **k: impl.Linear(64, 32, **k), dict(parallel_mode="row")),
        (lambda **k: impl.LayerNormLinear(64, 32, **k), dict(parallel_mode="column")),
        (lambda **k: impl.LayerNormMLP(64, 128, **k), dict(set_parallel_mode=True)),
    )
    for dtype in (torch.bfloat16, torch.float32):
        for build, mode in cases:
            for sp, gather in ((False, "backward"), (True, "backward"), (True, "backward_dw")):
                tp = dict(tp_group=group, sequence_parallel=sp, wgrad_gather=gather, **mode)
                results = []
                for kwargs in ({}, tp):
                    torch.manual_seed(0)
                    m = build(delay_wgrad_compute=True, params_dtype=dtype, device="cuda", **kwargs)
                    if kwargs and (m._tp is not None or m.tp_size != 1):
                        raise AssertionError(f"{type(m).__name__} {kwargs}: tp_size 1 communicates")
                    x = torch.randn(8, 4, 64, dtype=dtype, device="cuda", requires_grad=True)
                    y = m(x)
                    y.float().square().sum().backward()
                    m.backward_dw()
                    results.append([y, x.grad, *(p.grad for p in m.parameters())])
                for a, b in zip(*results, strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
                    checked += 1
    return checked


def test_one_rank_nccl_group_changes_nothing():
    (checked,) = run_ranks(_one_rank_nccl, 1, backend="nccl", timeout_s=180)
    # 2 dtypes x 3 option sets x (Linear 2 modes: 4 tensors; LayerNormLinear 6; LayerNormMLP 8)
    assert checked == 2 * 3 * (4 + 4 + 6 + 8)
