"""The trainer sequence of SPEC §2 and §8 (torchtitan's, FSDP2's documented recipe): build on the
meta device, ``convert_linears``, ``fully_shard``, ``GradientReducer``, ``to_empty``, load. The
``trainer-sequence`` example of docs/distributed.md runs it end to end on a Hugging Face Llama
(``tests/test_readme_examples.py``); these pin its pieces on a small model: the reducer built on
meta still reduces after materialization, and what contradicts a meta model is refused by name.

Each rank function is at module level (the spawned processes import it by name); every run has
a timeout on each collective and on the whole run, so a failing rank fails the test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from splitgrad.distributed import GradientReducer, fsdp, run_ranks
from splitgrad.impl import convert_linears

WORLD = 2


def _build() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8)),
        torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()),
    )


def _eager() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return _build()


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(2)]


def _delayed_sharded_params(model: torch.nn.Module) -> list[tuple[str, bool]]:
    """(name, carries the reducer's mark) for every sharded GEMM parameter of a delayed module."""
    out = []
    for name, m in model.named_modules():
        if getattr(m, "delay_wgrad_compute", False):
            for local, p in m.named_parameters(recurse=False):
                out.append((f"{name}.{local}", getattr(p, fsdp.REDUCED_FROM_MODULE_HOOKS, False)))
    return out


def _meta_sequence_rank(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    with torch.device("meta"):
        model = _build()
    convert_linears(model, delay_wgrad_compute=True)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    reducer = GradientReducer(model)
    marked_on_meta = _delayed_sharded_params(model)
    model.to_empty(device="cpu")  # swap_tensors: the parameters' __dict__ is replaced
    marked_after_to_empty = _delayed_sharded_params(model)
    eager = _eager()
    set_model_state_dict(model, eager.state_dict(), options=StateDictOptions(full_state_dict=True))
    model.to(torch.float32)  # one more _apply, as a trainer's .to(device, dtype) does
    marked_after_load = _delayed_sharded_params(model)
    delayed = [m for m in model.modules() if getattr(m, "delay_wgrad_compute", False)]
    for i, (x, y) in enumerate(_batches(rank)):
        with reducer.no_sync() if i == 0 else torch.enable_grad():
            F.mse_loss(model(x), y).backward()
    for m in reversed(delayed):  # both micro-batches' entries after the last backward
        while m.pending_wgrad_count:
            m.backward_dw()
    reducer.finish()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    # fused accumulation contradicts fully_shard: refused on meta, before anything is allocated
    with torch.device("meta"):
        fused = _build()
    convert_linears(fused, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    fully_shard(fused)
    try:
        GradientReducer(fused)
        refusal = "no error"
    except ValueError as exc:
        refusal = str(exc)
    return {
        "marked": (marked_on_meta, marked_after_to_empty, marked_after_load),
        "grads": grads,
        "fused_refusal": refusal,
    }


def _eager_data_parallel() -> dict[str, torch.Tensor]:
    """The same step unconverted, unsharded, in one process: every micro-batch of both
    replicas into ``.grad``, in replica order, then averaged as the reduce-scatter averages."""
    model = _eager()
    per_replica = []
    for rank in range(WORLD):
        model.zero_grad(set_to_none=True)
        for x, y in _batches(rank):
            F.mse_loss(model(x), y).backward()
        per_replica.append({n: p.grad.clone() for n, p in model.named_parameters()})
    return {n: (per_replica[0][n] + per_replica[1][n]) / WORLD for n in per_replica[0]}


def test_a_reducer_built_on_meta_reduces_after_to_empty_and_load():
    """to_empty() swaps the sharded parameters' contents and __dict__ (swap_tensors), which
    dropped the mark the delayed modules look for; the reducer re-marks them whenever FSDP2
    resets its sharded parameters. Two micro-batches later, every gradient is bitwise the
    eager, unconverted, unsharded run of both replicas (a sum of two, halved, is exact in either
    order); fused accumulation is refused while the model is still on meta."""
    torch.set_num_threads(1)  # the ranks' thread count: the same CPU reduction order
    results = run_ranks(_meta_sequence_rank, WORLD, timeout_s=120, collective_timeout_s=30)
    want = _eager_data_parallel()
    for rank, got in enumerate(results):
        for stage, marks in zip(
            ("on meta", "after to_empty", "after load and .to()"), got["marked"]
        ):
            assert len(marks) == 6, marks  # weight and bias of 3 converted linears
            unmarked = [name for name, marked in marks if not marked]
            assert not unmarked, f"rank {rank} {stage}: {unmarked} lost the reducer's mark"
        assert got["grads"].keys() == want.keys()
        for name, g in got["grads"].items():
            torch.testing.assert_close(g, want[name], rtol=0, atol=0, msg=f"rank {rank} {name}")
        assert got["fused_refusal"].startswith(
            "0.0.weight: fuse_wgrad_accumulation=True under fully_shard is not supported"
        ), got["fused_refusal"]


def test_a_partly_materialized_layer_is_named():
    """A layer whose weight is still on meta and whose bias is not (a half-done load): refused
    with both devices, nothing converted."""
    with torch.device("meta"):
        model = _build()
    model[1][0].bias = torch.nn.Parameter(torch.zeros(8))
    with pytest.raises(
        ValueError,
        match=r"1\.0 .*bias \(torch\.float32 on cpu\) differs from its "
        r"weight \(torch\.float32 on meta\)",
    ):
        convert_linears(model, delay_wgrad_compute=True)
    assert all(type(m) is torch.nn.Linear for m in (model[0][0], model[0][2], model[1][0]))


def test_a_forward_before_materializing_computes_shapes_on_meta():
    """As torch.nn.Linear: a converted model still on meta runs its forward on meta tensors
    (shape tracing), and queues nothing it could not run later."""
    with torch.device("meta"):
        model = convert_linears(_build(), delay_wgrad_compute=True)
        x = torch.randn(4, 8)
        y = model(x)
    assert y.is_meta and y.shape == (4, model(x).shape[-1])
