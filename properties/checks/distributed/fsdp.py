"""P16 under ``fully_shard`` (FSDP2, SPEC §8 "Fully sharded data parallel"): 2 Blocks, each and
the root wrapped with ``fully_shard``, 2 gloo ranks, 2 micro-batches.

The reducer reduce-scatters each delayed module's gradients into the sharded gradients, the
first before the last ``backward_dw()`` starts; every full (all-gathered) gradient is bitwise
equal to FSDP2 alone without delay and within the data-parallel budget of the float64 global
batch, in fp32 and under FSDP2 mixed precision (:data:`FSDP_PRECISIONS`).
"""

from __future__ import annotations

import contextlib
import time

import torch
from splitgrad.distributed import GradientReducer

from .data_parallel import REDUCER, compare_replica, dp_truth
from .library import load_library
from .model import blocks, data, drain_entries, finish_error, loss_of, sizes
from .report import DistributedReport, check_buckets, run_checked

__all__ = ["FSDP_PRECISIONS", "check_fully_sharded", "check_fsdp_launches", "launch_summary"]

#: FSDP2 mixed precision the fully_shard cells run, by name: ``MixedPrecisionPolicy``'s
#: ``param_dtype`` and ``reduce_dtype`` and ``set_force_sum_reduction_for_comms``. They reach
#: every branch of FSDP2's averaging: AVG inside the collective (fp32, bf16), a pre-divide
#: before a SUM (an fp16 ``reduce_dtype``: ``sqrt``-ish split of the world size against
#: overflow) and a post-divide after it (forced sum); bf16 parameters with an fp32
#: ``reduce_dtype`` also accumulate the micro-batches' gradients in fp32 between passes.
FSDP_PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None, bool]] = {
    "fp32": (None, None, False),
    "bf16": (torch.bfloat16, None, False),
    "bf16/fp32": (torch.bfloat16, torch.float32, False),
    "fp16": (torch.float16, None, False),
    "bf16/fp16": (torch.bfloat16, torch.float16, False),
    "fp32 sum": (None, None, True),
    "bf16/fp32 sum": (torch.bfloat16, torch.float32, True),
}


def _sharded_blocks(lib, precision: str, delay: bool) -> torch.nn.Sequential:
    """2 Blocks of ``lib``, each and the root fully_shard-ed under ``precision``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype, force_sum = FSDP_PRECISIONS[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = blocks(lib, range(2), fused=False, dtype=torch.float32, delay=delay)
    for b in model:
        fully_shard(b, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if force_sum:
        for m in (*model, model):
            m.set_force_sum_reduction_for_comms(True)
    return model


def _fsdp_step(
    lib,
    rank: int,
    *,
    mode: str,
    n_mb: int,
    delay: bool,
    precision: str = "fp32",
    drain: str = "late",
    reducer_cls=GradientReducer,
) -> dict:
    """One step of 2 Blocks fully_shard-ed under ``precision`` (:data:`FSDP_PRECISIONS`) on one
    rank. Delayed: a reducer, micro-batches marked by ``mode`` ("no_sync": the reducer's
    context, which turns FSDP2's gradient sync off too; "count": ``num_microbatches`` and
    ``set_requires_gradient_sync`` set by hand), every ``backward_dw()`` run block by block
    after the last backward (``drain="late"``) or each micro-batch's right after its backward
    (``"each"``). Not delayed: FSDP2 alone. Returns the full (all-gathered) gradients divided by
    the micro-batch count, the launch log and the times of passes and drains."""
    model = _sharded_blocks(lib, precision, delay)
    reducer = None
    if delay:
        reducer = reducer_cls(model, num_microbatches=n_mb if mode == "count" else None)
    hidden, _, rows = sizes(None)
    x, target = data(100 + rank, n_mb * rows, hidden, torch.float32)
    pass_times = []
    for j, (xb, tb) in enumerate(zip(x.split(rows), target.split(rows))):
        last = j == n_mb - 1
        ctx = contextlib.nullcontext()
        if reducer is not None and mode == "no_sync":
            ctx = contextlib.nullcontext() if last else reducer.no_sync()
        else:
            model.set_requires_gradient_sync(last)
        with ctx:
            loss_of(model(xb), tb).backward()
        pass_times.append(time.perf_counter())
        if drain == "each" and not last:
            for b in reversed(model):
                drain_entries(b)
    dw_starts, dw_ends = [], []
    for b in reversed(model):
        dw_starts.append(time.perf_counter())
        drain_entries(b)
        dw_ends.append(time.perf_counter())
    error = None if reducer is None else finish_error(reducer)
    with torch.no_grad():  # a gradient that requires grad (some packages') stays outside
        grads = {
            name: None if p.grad is None else p.grad.detach().full_tensor().div(n_mb)
            for name, p in model.named_parameters()
        }
    return {
        "grads": grads,
        "launches": [] if reducer is None else [dict(e) for e in reducer.launch_log],
        "buckets": [] if reducer is None else reducer.bucket_names,
        "finish": None if reducer is None else reducer.finish_time,
        "dw_starts": dw_starts,
        "dw_ends": dw_ends,
        "pass_times": pass_times,
        "error": error,
    }


def _fsdp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = REDUCER
) -> dict:
    """Every config, delayed with the reducer and (the baseline) FSDP2 alone without delay; on
    rank 0 also the single-process baselines of :func:`~.data_parallel.dp_truth` (same thread
    count): the global batch in FSDP2's compute dtype (the naive yardstick) from the fp32
    values FSDP2 casts, and the float64 truth of those fp32 values."""
    lib = load_library(lib_name)
    reducer_cls = load_library(reducer_name)
    out = {"runs": [], "baseline": [], "truth": None}
    for cfg in configs:
        out["runs"].append(_fsdp_step(lib, rank, delay=True, reducer_cls=reducer_cls, **cfg))
        out["baseline"].append(_fsdp_step(lib, rank, delay=False, **cfg))
    if rank == 0:
        truth_configs = [
            {
                "n_mb": c["n_mb"],
                "fused": False,
                "dtype": FSDP_PRECISIONS[c["precision"]][0] or torch.float32,
                "value_dtype": torch.float32,
            }
            for c in configs
        ]
        out["truth"] = dp_truth(0, 1, lib_name, truth_configs, world)
    return out


def launch_summary(run: dict) -> str:
    """The launches of one rank's fully_shard step, in ms after the last backward pass ended,
    next to when each block's ``backward_dw()`` started and ended."""
    t0 = run["pass_times"][-1]
    ms = lambda t: f"{1e3 * (t - t0):.2f} ms"  # noqa: E731
    parts = [f"{e['collective']} {e['params']} at {ms(e['time'])}" for e in run["launches"]]
    drains = [
        f"backward_dw of block {len(run['dw_starts']) - 1 - i} {ms(a)}-{ms(b)}"
        for i, (a, b) in enumerate(zip(run["dw_starts"], run["dw_ends"]))
    ]
    return "; ".join(drains + parts) + f"; finish() at {ms(run['finish'])}"


def check_fsdp_launches(report: DistributedReport, where: str, got: dict) -> None:
    """:func:`~.report.check_buckets`, each a reduce-scatter, the first launched before the last
    block's ``backward_dw()`` started."""
    check_buckets(report, where, got, "reduce_scatter")
    if not got["launches"] or got["launches"][0]["time"] >= got["dw_starts"][-1]:
        report.failures.append(
            f"{where}: no reduce-scatter started before the last backward_dw() began"
        )


def check_fully_sharded(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 2,
    precisions: tuple[str, ...] = tuple(FSDP_PRECISIONS),
    timeout_s: float = 600.0,
    reducer: str = REDUCER,
) -> DistributedReport:
    """P16 under ``fully_shard`` (FSDP2) on 2 gloo ranks, for each of ``precisions``: no_sync()
    and num_microbatches with every ``backward_dw()`` after the last backward, and no_sync()
    with each micro-batch's right after its backward (label suffix "each"); the yardstick of
    the float64 truth is the reference in FSDP2's compute dtype. In float32 compute (plain and
    forced sum) also bitwise ``(replica0 + replica1) / 2`` computed in one process: a sum of
    two, halved, is exact in either order, whichever side divides; in bf16 or fp16 FSDP2's
    casts and accumulation dtype have no one-process twin. ``reducer`` names the reducer class
    (``"module:Class"``, built as ``GradientReducer`` is)."""
    unknown = sorted(set(precisions) - set(FSDP_PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precisions {unknown}; expected some of {list(FSDP_PRECISIONS)}")
    configs = [
        {"mode": m, "n_mb": n_microbatches, "precision": p, "drain": d}
        for p in precisions
        for m, d in (("no_sync", "late"), ("count", "late"), ("no_sync", "each"))
    ]
    world = 2
    report = DistributedReport(f"P16 fully_shard {lib_name} on {world} ranks")
    results = run_checked(
        report, "FSDP2 ranks", _fsdp_rank, world, lib_name, configs, reducer, timeout_s=timeout_s
    )
    if results is None:
        return report
    truth = results[0]["truth"]
    for k, cfg in enumerate(configs):
        label = f"fully_shard {cfg['precision']} {cfg['mode']}"
        label += " each" if cfg["drain"] == "each" else ""
        compute = FSDP_PRECISIONS[cfg["precision"]][0] or torch.float32
        for rank, per_rank in enumerate(results):
            got, base = per_rank["runs"][k], per_rank["baseline"][k]
            where = f"{label} rank {rank}"
            compare_replica(report, where, got, truth[k], check_fsdp_launches, base, compute)
    report.notes.append("launch log (rank 0, no_sync): " + launch_summary(results[0]["runs"][0]))
    return report
