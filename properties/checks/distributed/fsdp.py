"""P16 under ``fully_shard`` (FSDP2, SPEC §8 "Fully sharded data parallel"): 2 Blocks, each and
the root wrapped with ``fully_shard``, 2 gloo ranks, 2 micro-batches.

The reducer reduce-scatters each delayed module's gradients into the sharded gradients, the
first before the last ``backward_dw()`` starts; every full (all-gathered) gradient is bitwise
equal to FSDP2 alone without delay and within the data-parallel budget of the float64 global
batch, in fp32 and under FSDP2 mixed precision (:data:`FSDP_PRECISIONS`).
"""

from __future__ import annotations

import torch

from .data_parallel import REDUCER, compare_replica, dp_truth, replica_step
from .library import load_library
from .model import blocks, gradient_copies
from .report import DistributedReport, check_buckets, run_checked

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


def _fsdp_step(
    lib, rank: int, reducer_cls, mode: str, n_mb: int, precision: str, drain: str
) -> dict:
    """One step (:func:`~.data_parallel.replica_step`) of 2 Blocks, each and the root
    fully_shard-ed under ``precision``, on one rank: delayed with ``reducer_cls``, or FSDP2
    alone without delay (``None``); the full (all-gathered) gradients are divided by the
    micro-batch count."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype, force_sum = FSDP_PRECISIONS[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = blocks(lib, range(2), fused=False, dtype=torch.float32, delay=reducer_cls is not None)
    for b in model:
        fully_shard(b, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if force_sum:
        for m in (*model, model):
            m.set_force_sum_reduction_for_comms(True)
    reducer = None
    if reducer_cls is not None:
        reducer = reducer_cls(model, num_microbatches=n_mb if mode == "count" else None)
    out = replica_step(model, reducer, rank, mode, n_mb, torch.float32, sharded=True, drain=drain)
    grads = gradient_copies(model, full=True)
    out["grads"] = {n: None if g is None else g.div_(n_mb) for n, g in grads.items()}
    return out


def _fsdp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = REDUCER
) -> dict:
    """Every config, delayed with the reducer and (the baseline) FSDP2 alone without delay; on
    rank 0 also :func:`~.data_parallel.dp_truth`: the naive yardstick in FSDP2's compute dtype
    from the fp32 values FSDP2 casts, and the float64 truth of those values."""
    lib = load_library(lib_name)
    reducer_cls = load_library(reducer_name)
    out = {"runs": [], "baseline": [], "truth": None}
    for cfg in configs:
        out["runs"].append(_fsdp_step(lib, rank, reducer_cls, **cfg))
        out["baseline"].append(_fsdp_step(lib, rank, None, **cfg))
    if rank == 0:
        fp32 = torch.float32
        computes = [FSDP_PRECISIONS[c["precision"]][0] or fp32 for c in configs]
        truth_configs = [
            {"n_mb": c["n_mb"], "dtype": d, "value_dtype": fp32} for c, d in zip(configs, computes)
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
    and num_microbatches draining after the last backward, and no_sync() draining each
    micro-batch right after its backward ("each"). In float32 compute also bitwise ``(replica0
    + replica1) / 2`` computed in one process (a sum of two, halved, is exact in either order,
    whichever side divides); bf16 or fp16 casts and accumulation have no one-process twin.
    ``reducer`` names the reducer class, built as ``GradientReducer`` is."""
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
