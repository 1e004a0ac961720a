"""P16 (SPEC §7) alone: :class:`~splitgrad.distributed.GradientReducer` over 2 and over 3 gloo
replicas, several optimizer steps on one reducer.

Every reduction of every step is launched before ``finish()`` (and some before the last
``backward_dw()``); gradients are bitwise ``(replica0 + replica1) / 2`` of the package without
delay in one process (a sum of two is exact in either order), on 3 replicas bitwise one of the
three summation orders of their mean, and within the budget of the float64 global batch, in the
first step and in each later one.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .library import load_library
from .model import (
    blocks,
    data,
    drain_entries,
    finish_error,
    gradient_copies,
    gradients,
    loss_of,
    reference_runs,
    replica_mean,
    scale,
    sizes,
    without_delay,
)
from .report import DistributedReport, baseline, check_buckets, judge_truth, run_checked

#: The reducer the checks build, named as a ``--backend`` names a package.
REDUCER = "splitgrad.distributed:GradientReducer"


def replica_step(
    model: torch.nn.Module,
    reducer: Any,
    rank: int,
    mode: str,
    n_mb: int,
    dtype: torch.dtype,
    *,
    sharded: bool = False,
    drain: str = "late",
    passes: int = 1,
) -> dict:
    """One step of ``model`` on replica ``rank``, micro-batches marked by ``mode``: "no_sync"
    (the reducer's context, which turns FSDP2's gradient sync off too) or "count" (``sharded``:
    FSDP2's ``set_requires_gradient_sync`` set by hand, as without a reducer). Every
    ``backward_dw()`` runs block by block after the last backward, so the first block's
    reductions overlap the second block's wgrad GEMMs (``drain="each"``: each micro-batch's
    right after its backward). Returns the reducer's launches and the times of passes and
    drains."""
    hidden, _, rows = sizes(None)
    x, target = data(100 + rank, n_mb * rows, hidden, dtype)
    pass_times, dw_starts, dw_ends = [], [], []
    for j, (xb, tb) in enumerate(zip(x.split(rows), target.split(rows))):
        last = j == n_mb - 1
        ctx = contextlib.nullcontext()
        if reducer is not None and mode == "no_sync":
            ctx = contextlib.nullcontext() if last else reducer.no_sync()
        elif sharded:
            model.set_requires_gradient_sync(last)
        with ctx:
            loss_of(model(xb), tb).backward()
        pass_times.append(time.perf_counter())
        if drain == "each" and not last:
            for b in reversed(model):
                drain_entries(b)
    for b in reversed(model):
        dw_starts.append(time.perf_counter())
        drain_entries(b, passes=passes)
        dw_ends.append(time.perf_counter())
    error = None if reducer is None else finish_error(reducer)
    return {
        "error": error,
        "launches": [] if reducer is None else [dict(e) for e in reducer.launch_log],
        "buckets": [] if reducer is None else reducer.bucket_names,
        "finish": None if reducer is None else reducer.finish_time,
        "dw_starts": dw_starts,
        "dw_ends": dw_ends,
        "pass_times": pass_times,
    }


def _dp_steps(lib, rank: int, reducer_cls, cfg: dict) -> list[dict]:
    """``cfg["steps"]`` optimizer steps (:func:`replica_step`, then ``torch.optim.SGD`` with
    ``lr=0`` and ``zero_grad()``) of 2 Blocks built as ``cfg`` says, on replica ``rank``, one
    reducer throughout: each step's gradients, launches and timings. The same micro-batches
    every step and weights the zero learning rate leaves bitwise as they were, so every step
    has the same single-process twin; what changes between steps is the reducer's state
    (finality counts of tied weights, buckets, the launch log), which must start afresh."""
    hidden, ffn, _ = sizes(None)
    mode, n_mb, tied = cfg["mode"], cfg["n_mb"], cfg["tied"]
    options = {k: cfg[k] for k in ("fused", "dtype", "proj_twice", "tied")}
    model = blocks(lib, range(2), microbatches_per_step=n_mb, prefill_seed=rank + 1, **options)
    # about one GEMM weight per bucket; tied, the shared (hidden, hidden) weight in one alone,
    # the first delayed bucket to launch: final too early, it would launch too early
    cap = hidden * (hidden if tied else ffn) * 4
    reducer = reducer_cls(
        model, num_microbatches=n_mb if mode == "count" else None, bucket_cap_mb=cap / 2**20
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    steps = []
    for _ in range(cfg.get("steps", 1)):
        out = replica_step(
            model, reducer, rank, mode, n_mb, cfg["dtype"], passes=n_mb if tied else 1
        )
        scale(model, n_mb)
        steps.append({"grads": gradient_copies(model), **out})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return steps


def _dp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = REDUCER
) -> list:
    lib = load_library(lib_name)
    reducer_cls = load_library(reducer_name)
    return [_dp_steps(lib, rank, reducer_cls, cfg) for cfg in configs]


def dp_truth(rank: int, _: int, lib_name: str, configs: list[dict], world: int) -> list:
    """Per config: the replicas emulated in one process by the package without delay (each
    replica's gradients, and their mean divided by the micro-batch count, as the distributed
    run divides), and the global batch
    through :func:`~.model.reference_runs`, over ``world`` replicas (a config's ``"world"``
    where it has one). A config's ``value_dtype`` (default its ``dtype``)
    is the values' dtype: FSDP2 mixed precision computes in ``dtype`` from fp32 values."""
    lib = load_library(lib_name)
    out = []
    for cfg in configs:
        n_mb, seeds = cfg["n_mb"], tuple(100 + r for r in range(cfg.get("world", world)))
        options = {k: cfg.get(k, False) for k in ("fused", "proj_twice", "tied")}
        options.update(dtype=cfg["dtype"], value_dtype=cfg.get("value_dtype", cfg["dtype"]))
        replicas = [gradients(without_delay(lib, 2, (s,), n_mb, **options)[0]) for s in seeds]
        emulated = replica_mean(replicas, n_mb)
        naive, truth = reference_runs(2, seeds, n_mb, **options)
        out.append(
            {
                "emulated": emulated,
                "replicas": replicas,
                "naive": gradient_copies(naive),
                "truth": gradient_copies(truth),
            }
        )
    return out


def compare_replica(
    report: DistributedReport,
    where: str,
    got: dict,
    truth: dict,
    check_launches: Callable[[DistributedReport, str, dict], None],
    base: dict | None = None,
    compute: torch.dtype | None = None,
    exact_mean: bool = True,
) -> None:
    """One replica's step against the one-process runs ``truth`` (:func:`dp_truth`) and, where
    given, the run without delay ``base``; bitwise against the emulated replicas only where the
    step computed in fp32 (``compute``, default the gradients' own dtype) and ``exact_mean``
    (a mean of two replicas is exact in any order; of three, the collective's summation order
    is its own)."""
    if got["error"]:
        report.failures.append(f"{where}: finish() raised: {got['error']}")
    check_launches(report, where, got)
    for name, g in got["grads"].items():
        if base is not None:
            report.bitwise(f"{where} {name} vs FSDP2 without delay", g, base["grads"][name])
        if exact_mean and compute in (None, torch.float32):
            emulated = truth["emulated"][name]
            report.bitwise(
                f"{where} {name} vs (replica0 + replica1) / 2 without delay", g, emulated
            )
    batch = f"{where} (global batch)"
    judge_truth(report, batch, got["grads"], truth["naive"], truth["truth"], dtype=compute)


def one_of_the_orders(
    report: DistributedReport, where: str, grads: dict, replicas: list[dict], n_mb: int
) -> None:
    """Each element of every full gradient in ``grads`` bitwise one of the means of three
    ``replicas`` a collective can form, ``((x_i + x_j) + x_k) / 3 / n_mb``: on 3 ranks the
    summation order of an element depends on where it lies in the reduce-scatter's buffer
    (every order is one of these three), so the reducer's value and FSDP2's own may differ by
    order alone; a division before the sum matches none of them."""
    for name, g in grads.items():
        xs = [r[name] for r in replicas]
        if g is None or any(x is None for x in xs):
            report.bitwise(f"{where} {name} vs a mean of the replicas", g, None)
            continue
        k = len(xs)
        candidates = []
        for last in range(k):
            rest = [xs[i] for i in range(k) if i != last]
            total = sum(rest[1:], rest[0].clone()) + xs[last]
            candidates.append(total.div_(k).div_(n_mb))
        hit = torch.zeros_like(g, dtype=torch.bool)
        for c in candidates:
            hit |= g == c
        report.counted(0.0 if bool(hit.all()) else math.inf, bitwise=True)
        if not bool(hit.all()):
            i = int((~hit).flatten().nonzero()[0])
            report.failures.append(
                f"{where} {name} vs the means of the {k} replicas in each summation order: "
                f"{int((~hit).sum())} of {g.numel()} elements match none (flat index {i}: "
                f"{g.flatten()[i].item()!r}, orders give "
                f"{[c.flatten()[i].item() for c in candidates]})"
            )


def _check_launches(report: DistributedReport, where: str, got: dict) -> None:
    """:func:`~.report.check_buckets`, and the first block's buckets launched before the
    second block's wgrad finished: overlap."""
    check_buckets(report, where, got)
    # the last block's entries run first; the first launch must precede the last drain
    if not got["launches"] or got["launches"][0]["time"] >= got["dw_ends"][-1]:
        report.failures.append(f"{where}: no reduction started before the last backward_dw()")


def _dp_configs(world: int, n_mb: int, dtypes: tuple, steps: int) -> list[dict]:
    """The cells of one world size. 2 replicas: fused and plain, no_sync() and
    num_microbatches, each dtype, untied and tied, ``steps`` steps. 3 replicas: fp32 only,
    num_microbatches, fused and plain, untied and tied, 2 steps at most."""
    if world == 2:
        grid = [
            (f, m, d, t)
            for f in (False, True)
            for m in ("no_sync", "count")
            for d in dtypes
            for t in (False, True)
        ]
    else:
        grid = [(f, "count", torch.float32, t) for f in (False, True) for t in (False, True)]
        steps = min(steps, 2)
    return [
        {
            "fused": f,
            "mode": m,
            "n_mb": n_mb,
            "dtype": d,
            "proj_twice": True,
            "tied": t,
            "steps": steps,
            "world": world,
        }
        for f, m, d, t in grid
    ]


def check_data_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 3,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    steps: int = 3,
    world_sizes: tuple[int, ...] = (2, 3),
    timeout_s: float = 600.0,
    reducer: str = REDUCER,
) -> DistributedReport:
    """P16 alone, one gloo spawn per world size of ``world_sizes`` (:func:`_dp_configs`): fused
    and plain, no_sync() and num_microbatches; a delayed module applied twice per micro-batch
    and a weight tied between two delayed modules (both queue two entries in the step's last
    pass); fused ``main_grad`` prefilled with random values that the first micro-batch
    (``is_first_microbatch=True``) overwrites. Each cell runs ``steps`` optimizer steps on one
    reducer, every step checked alike: a tied weight is final (and reduced once) after both
    its modules' last entries in every step, not only the first. On 3 replicas each element
    is bitwise one of the three summation orders of the replicas' mean
    (:func:`one_of_the_orders`; a division before the all-reduce rounds otherwise). One
    single-process baseline spawn serves every world size. ``reducer`` names the reducer class
    (``"module:Class"``, built as ``GradientReducer`` is)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    bad = [w for w in world_sizes if isinstance(w, bool) or w not in (2, 3)]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be some of (2, 3), got {world_sizes!r}")
    by_world = {w: _dp_configs(w, n_microbatches, dtypes, steps) for w in world_sizes}
    ranks = " and ".join(str(w) for w in world_sizes)
    report = DistributedReport(f"P16 {lib_name} on {ranks} replicas, {steps} steps")
    results = {
        w: run_checked(
            report, f"{w} replicas", _dp_rank, w, lib_name, cfgs, reducer, timeout_s=timeout_s
        )
        for w, cfgs in by_world.items()
    }
    every = [c for cfgs in by_world.values() for c in cfgs]
    truths = baseline(report, dp_truth, lib_name, every, 2, timeout_s=timeout_s)
    if truths is None:
        return report
    truth = iter(truths)
    for world, configs in by_world.items():
        per_world = [next(truth) for _ in configs]
        if results[world] is None:
            continue
        for k, cfg in enumerate(configs):
            label = f"{'fused' if cfg['fused'] else 'plain'} {cfg['mode']} {cfg['dtype']}"
            label += " tied" if cfg["tied"] else ""
            label += f" on {world} replicas" if world != 2 else ""
            for rank, per_rank in enumerate(results[world]):
                for s, got in enumerate(per_rank[k]):
                    where = f"{label} rank {rank}" + (f" step {s + 1}" if s else "")
                    want = per_world[k]
                    compare_replica(
                        report, where, got, want, _check_launches, None, None, world == 2
                    )
                    if world != 2:
                        one_of_the_orders(
                            report, where, got["grads"], want["replicas"], cfg["n_mb"]
                        )
                    report.counted()
                    numbers = {e["step"] for e in got["launches"]}
                    if numbers and numbers != {s + 1}:
                        report.failures.append(
                            f"{where}: launch log of step {s + 1} holds launches of steps "
                            f"{sorted(numbers)}"
                        )
    return report
