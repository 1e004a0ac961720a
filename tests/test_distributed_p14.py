"""P14 (SPEC §8): an expert-parallel MoE layer across 2 gloo ranks gives the single-process
gradients, with each rank's experts' ``backward_dw()`` running while the dispatch all-to-all of
the backward is in flight, and a data-parallel projection reduced from the module hooks.

Layout per rank r (world size 2, 4 experts, 2 per rank):
  x_r -> proj (Linear, replicated, data-parallel) -> route tokens to experts (fixed assignment)
      -> all_to_all dispatch -> experts (GroupedLinear, the rank's 2 experts)
      -> all_to_all combine -> y_r
Expert gradients must be *bitwise* the single-process ones (the owner rank sees exactly the same
rows in the same order); the data-parallel projection's gradient is a sum of two partial GEMMs
instead of one, so it is compared within a float32 budget of a few rounding steps.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, EXPERTS, HIDDEN, TOKENS = 2, 4, 16, 12
LOCAL = EXPERTS // WORLD


def _data(seed: int = 0):
    """Global weights, per-rank inputs, expert assignments and upstream gradients."""
    g = torch.Generator().manual_seed(seed)
    proj_w = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3
    proj_b = torch.randn(HIDDEN, generator=g) * 0.1
    expert_w = [torch.randn(HIDDEN, HIDDEN, generator=g) * 0.3 for _ in range(EXPERTS)]
    expert_b = [torch.randn(HIDDEN, generator=g) * 0.1 for _ in range(EXPERTS)]
    xs = [torch.randn(TOKENS, HIDDEN, generator=g) for _ in range(WORLD)]
    # expert 3 gets no token from rank 0: an empty group on purpose
    experts = [
        torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2]),
        torch.randint(0, EXPERTS, (TOKENS,), generator=g),
    ]
    dys = [torch.randn(TOKENS, HIDDEN, generator=g) for _ in range(WORLD)]
    return proj_w, proj_b, expert_w, expert_b, xs, experts, dys


def _load(module, names_values):
    with torch.no_grad():
        for name, value in names_values:
            getattr(module, name).copy_(value)


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all whose backward starts the reverse all-to-all asynchronously and
    runs ``during_backward()`` (the experts' ``backward_dw``) before waiting for it."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, during_backward):
        ctx.splits, ctx.during_backward = (out_splits, in_splits), during_backward
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        dx = grad.new_empty(sum(in_splits), grad.shape[1])
        work = dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, async_op=True)
        if ctx.during_backward is not None:
            ctx.during_backward()  # overlaps the in-flight all-to-all
        work.wait()
        return dx, None, None, None


def _rank_main(rank: int, lib_name: str, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    lib = __import__(f"splitgrad.{lib_name}", fromlist=["Linear"])
    proj_w, proj_b, expert_w, expert_b, xs, experts, dys = _data()
    proj = lib.Linear(HIDDEN, HIDDEN, delay_wgrad_compute=True)
    _load(proj, [("weight", proj_w), ("bias", proj_b)])
    local = list(range(rank * LOCAL, (rank + 1) * LOCAL))
    moe = lib.GroupedLinear(LOCAL, HIDDEN, HIDDEN, delay_wgrad_compute=True)
    _load(moe, [(f"weight{i}", expert_w[e]) for i, e in enumerate(local)])
    _load(moe, [(f"bias{i}", expert_b[e]) for i, e in enumerate(local)])

    # data-parallel reduction of the replicated projection, driven by the module hook
    reduced = []

    def reduce_proj():
        for p in (proj.weight, proj.bias):
            dist.all_reduce(p.grad)
        reduced.append(True)

    proj.register_wgrad_accumulation_and_reduce_hooks(reduce_proj)
    dw_during_dispatch = []

    def experts_backward_dw():
        dw_during_dispatch.append(moe.pending_wgrad_count)
        moe.backward_dw()

    x = xs[rank].clone().requires_grad_()
    h = proj(x)
    order = torch.argsort(experts[rank], stable=True)
    counts = torch.bincount(experts[rank], minlength=EXPERTS)
    send = [int(counts[r * LOCAL : (r + 1) * LOCAL].sum()) for r in range(WORLD)]
    # how many tokens each source rank sends to each of my experts
    mine = torch.tensor(counts.tolist())
    table = [torch.zeros(EXPERTS, dtype=torch.long) for _ in range(WORLD)]
    dist.all_gather(table, mine)
    per_src = [[int(table[s][e]) for e in local] for s in range(WORLD)]
    recv = [sum(row) for row in per_src]

    dispatched = _AllToAll.apply(h[order], recv, send, experts_backward_dw)
    # received rows are (source, expert)-major; regroup them expert-major for GroupedLinear
    blocks = dispatched.split([n for row in per_src for n in row])
    by_expert = [blocks[s * LOCAL + i] for i in range(LOCAL) for s in range(WORLD)]
    m_splits = [sum(per_src[s][i] for s in range(WORLD)) for i in range(LOCAL)]
    y_local = moe(torch.cat(by_expert), m_splits)
    # undo the regrouping, send results home, undo the sort
    parts = y_local.split([per_src[s][i] for i in range(LOCAL) for s in range(WORLD)])
    back = torch.cat([parts[i * WORLD + s] for s in range(WORLD) for i in range(LOCAL)])
    combined = _AllToAll.apply(back, send, recv, None)
    y = torch.empty_like(combined).index_copy(0, order, combined)

    y.backward(dys[rank])
    proj.backward_dw()
    torch.save(
        {
            "y": y.detach(),
            "x.grad": x.grad,
            "proj.weight": proj.weight.grad,
            "proj.bias": proj.bias.grad,
            "experts": {
                e: (getattr(moe, f"weight{i}").grad, getattr(moe, f"bias{i}").grad)
                for i, e in enumerate(local)
            },
            "dw_during_dispatch": dw_during_dispatch,
            "reduced": reduced,
            "pending": (proj.pending_wgrad_count, moe.pending_wgrad_count),
        },
        os.path.join(out_dir, f"rank{rank}.pt"),
    )
    dist.destroy_process_group()


def _single_process(lib):
    proj_w, proj_b, expert_w, expert_b, xs, experts, dys = _data()
    proj = lib.Linear(HIDDEN, HIDDEN)
    _load(proj, [("weight", proj_w), ("bias", proj_b)])
    moe = lib.GroupedLinear(EXPERTS, HIDDEN, HIDDEN)
    _load(moe, [(f"weight{e}", expert_w[e]) for e in range(EXPERTS)])
    _load(moe, [(f"bias{e}", expert_b[e]) for e in range(EXPERTS)])
    x = torch.cat(xs).requires_grad_()
    assign = torch.cat(experts)
    order = torch.argsort(assign, stable=True)  # rank 0's tokens before rank 1's per expert
    h = proj(x)
    m_splits = torch.bincount(assign, minlength=EXPERTS).tolist()
    y_sorted = moe(h[order], m_splits)
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
    y.backward(torch.cat(dys))
    return y.detach(), x.grad, proj, moe


@pytest.mark.distributed
@pytest.mark.parametrize("lib_name", ["reference", "impl"])
def test_expert_parallel_moe_matches_single_process(lib_name, tmp_path):
    lib = __import__(f"splitgrad.{lib_name}", fromlist=["Linear"])
    init_file = tempfile.mktemp(dir=tmp_path)
    mp.spawn(_rank_main, args=(lib_name, init_file, str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    y, x_grad, proj, moe = _single_process(lib)

    for rank, res in enumerate(results):
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        torch.testing.assert_close(res["y"], y[rows], rtol=0, atol=0)
        torch.testing.assert_close(res["x.grad"], x_grad[rows], rtol=0, atol=0)
        # each rank ran its experts' backward_dw once, inside the dispatch all-to-all
        assert res["dw_during_dispatch"] == [1]
        assert res["reduced"] == [True]
        assert res["pending"] == (0, 0)
        for e, (w_grad, b_grad) in res["experts"].items():
            torch.testing.assert_close(w_grad, getattr(moe, f"weight{e}").grad, rtol=0, atol=0)
            torch.testing.assert_close(b_grad, getattr(moe, f"bias{e}").grad, rtol=0, atol=0)
        # data-parallel: two partial GEMMs summed by all_reduce vs one GEMM over all tokens;
        # float32 summation order only, so a few rounding steps of the largest value
        for name, expected in (("proj.weight", proj.weight.grad), ("proj.bias", proj.bias.grad)):
            tol = 8 * torch.finfo(torch.float32).eps * expected.abs().max().item()
            torch.testing.assert_close(res[name], expected, rtol=0, atol=tol, msg=name)
    # the all_reduce left both replicas identical
    torch.testing.assert_close(results[0]["proj.weight"], results[1]["proj.weight"], rtol=0, atol=0)
