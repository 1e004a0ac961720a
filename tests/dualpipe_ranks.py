"""What each gloo rank runs in tests/test_distributed_dualpipe.py: DualPipe steps over stages of
splitgrad modules (reference and impl mixed), once with ``delay_wgrad_compute=True`` connected
to ``dualpipe.WeightGradStore`` and once without delay, on the CPU.

DualPipe is written for CUDA. Two of its device choices are redirected to the CPU, nothing else:

* ``DualPipe.__init__`` asserts that the first parameter is on
  ``torch.device(torch.cuda.current_device())``: ``torch.cuda.current_device`` answers ``"cpu"``
  while the ``DualPipe`` is being built, and only then;
* ``dualpipe.comm.build_from_tensor_shapes`` makes the receive buffers with ``device="cuda"``:
  it is replaced by the same buffers (``TENSOR_SHAPES``, ``TENSOR_DTYPE``, ``requires_grad``)
  on the CPU.

The schedule itself, its P2P calls, ``WeightGradStore`` and ``run_backward`` run unchanged.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

HIDDEN = 16
ROWS_PER_CHUNK = 4
NUM_CHUNKS = 4  # DualPipe's minimum for 2 ranks: an even number >= 2 * ranks
STEPS = 2


def _cpu_receive_buffers() -> list[torch.Tensor]:
    from dualpipe import comm

    return [
        torch.empty(s, dtype=comm.TENSOR_DTYPE, device="cpu", requires_grad=True)
        for s in comm.TENSOR_SHAPES
    ]


@contextlib.contextmanager
def dualpipe_on_cpu():
    """DualPipe's two CUDA device choices pointed at the CPU (see the module docstring)."""
    from dualpipe import comm

    with mock.patch.object(comm, "build_from_tensor_shapes", _cpu_receive_buffers):
        yield


def build_dualpipe(modules):
    from dualpipe import DualPipe

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        return DualPipe(modules)


def stage(index: int, delay: bool) -> torch.nn.Sequential:
    """Stage ``index`` of the model, the same values wherever and however it is built: modules
    of both packages, non-delayed ``torch.nn`` in between."""
    from splitgrad import impl, reference

    torch.manual_seed(1000 + index)
    return torch.nn.Sequential(
        impl.LayerNormMLP(HIDDEN, 2 * HIDDEN, delay_wgrad_compute=delay),
        reference.Linear(HIDDEN, HIDDEN, delay_wgrad_compute=delay),
        torch.nn.GELU(),
        reference.LayerNormMLP(
            HIDDEN, 2 * HIDDEN, normalization="RMSNorm", delay_wgrad_compute=delay
        ),
        impl.Linear(HIDDEN, HIDDEN, delay_wgrad_compute=delay),
    )


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target).clone()


def run_variant(rank: int, world: int, delay: bool) -> dict:
    """``STEPS`` DualPipe training steps (SGD between them) of this rank's two stages; returns
    every gradient after each step, the losses, what was left pending and the store's use."""
    import dualpipe
    from splitgrad.distributed import use_weight_grad_store

    dualpipe.set_p2p_tensor_shapes([(ROWS_PER_CHUNK, HIDDEN)])
    dualpipe.set_p2p_tensor_dtype(torch.float32)
    # DualPipe: rank r runs stage r in one direction and stage world-1-r in the other
    local = torch.nn.Sequential(stage(rank, delay), stage(world - 1 - rank, delay))
    handle = use_weight_grad_store(local, dualpipe.WeightGradStore) if delay else None
    model = build_dualpipe(local)
    optimizer = torch.optim.SGD(local.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(7)
    rows = NUM_CHUNKS // 2 * ROWS_PER_CHUNK  # each end rank feeds half of the chunks
    out = {"grads": [], "losses": [], "pending": [], "outstanding": []}
    for _ in range(STEPS):
        x = torch.randn(rows, HIDDEN, generator=gen)
        y = torch.randn(rows, HIDDEN, generator=gen)
        optimizer.zero_grad()
        with dualpipe_on_cpu():
            loss, _ = model.step(x, num_chunks=NUM_CHUNKS, criterion=criterion, labels=(y,))
        out["losses"].append(loss.detach().clone())
        out["grads"].append(
            {name: p.grad.clone() for name, p in local.named_parameters() if p.grad is not None}
        )
        out["pending"].append(
            {
                name: m.pending_wgrad_count
                for name, m in local.named_modules()
                if hasattr(m, "pending_wgrad_count")
            }
        )
        out["outstanding"].append(dict(handle.outstanding) if handle else {})
        optimizer.step()
    out["params"] = [name for name, _ in local.named_parameters()]
    out["handed"] = handle.handed if handle else 0
    out["ran_at_once"] = handle.ran_at_once if handle else 0
    return out


def dualpipe_delayed_and_not(rank: int, world: int) -> dict:
    """Both variants on the same rank, one after the other (same thread count, same kernels)."""
    return {"delayed": run_variant(rank, world, True), "plain": run_variant(rank, world, False)}


def dualpipe_with_a_failing_rank(rank: int, world: int) -> None:
    """Rank 1 fails before its first step; rank 0 is left waiting in DualPipe's first receive."""
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    run_variant(rank, world, True)
