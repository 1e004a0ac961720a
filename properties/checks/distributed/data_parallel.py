"""P16 (SPEC §7) alone: :class:`~splitgrad.distributed.GradientReducer` over 2 gloo replicas.

Every reduction is launched before ``finish()`` (and some before the last ``backward_dw()``);
gradients are bitwise equal to ``(replica0 + replica1) / 2`` computed in one process by the
package without delay (a sum of two is exact in either order), and within the data-parallel
budget of the float64 global-batch truth of ``splitgrad.reference``. Under a pipeline:
:mod:`.pipeline_data_parallel`; under fully_shard: :mod:`.fsdp`; next to the expert-parallel
layer: :mod:`.expert_parallel`.
"""

from __future__ import annotations

import contextlib
import time

import torch

from .library import load_library
from .model import clone, data, drain_entries, gradients, loss_of, scale, sizes, two_blocks
from .report import DistributedReport, judge_truth, mean, run_checked

__all__ = ["REDUCER", "dp_truth", "check_data_parallel"]

#: The reducer the checks build, named as a ``--backend`` names a package.
REDUCER = "splitgrad.distributed:GradientReducer"


def _dp_step(
    lib,
    rank: int,
    *,
    fused: bool,
    mode: str,
    n_mb: int,
    dtype,
    proj_twice: bool,
    reducer_cls,
    tied: bool = False,
):
    """One step of 2 Blocks on one replica, micro-batches marked by ``mode`` ("no_sync" or
    "count"), every backward_dw() deferred until after the last backward and run block by block
    (so the first block's reductions overlap the second block's wgrad GEMMs). ``proj_twice``:
    each Block applies ``proj`` twice (two entries per backward, the step's last pass too).
    Fused, ``main_grad`` starts random and the first micro-batch passes
    ``is_first_microbatch=True``."""
    hidden, ffn, rows = sizes(None)
    blocks = two_blocks(
        lib,
        fused=fused,
        dtype=dtype,
        microbatches_per_step=n_mb if fused else None,
        prefill_seed=rank + 1,
        proj_twice=proj_twice,
        tied=tied,
    )
    # about one GEMM weight per bucket; tied, the shared (hidden, hidden) weight in one alone,
    # the first delayed bucket to launch: final too early, it would launch too early
    cap = hidden * (hidden if tied else ffn) * 4
    reducer = reducer_cls(
        blocks, num_microbatches=n_mb if mode == "count" else None, bucket_cap_mb=cap / 2**20
    )
    x, target = data(100 + rank, n_mb * rows, hidden, dtype)
    for j, (xb, tb) in enumerate(zip(x.split(rows), target.split(rows))):
        last = j == n_mb - 1
        ctx = reducer.no_sync() if (mode == "no_sync" and not last) else contextlib.nullcontext()
        with ctx:
            loss_of(blocks(xb), tb).backward()
    dw_times = []
    for b in reversed(list(blocks)):
        drain_entries(b, passes=n_mb if tied else 1)
        dw_times.append(time.perf_counter())
    error = None
    try:
        reducer.finish()
    except RuntimeError as exc:
        error = str(exc)
    scale(blocks, n_mb)
    return {
        "grads": clone(gradients(blocks)),
        "launches": [(e["bucket"], e["params"], e["time"]) for e in reducer.launch_log],
        "finish": reducer.finish_time,
        "dw_times": dw_times,
        "buckets": reducer.bucket_names,
        "error": error,
    }


def _dp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = REDUCER
) -> list:
    lib = load_library(lib_name)
    reducer_cls = load_library(reducer_name)
    return [_dp_step(lib, rank, reducer_cls=reducer_cls, **cfg) for cfg in configs]


def _global_batch(package, cfg: dict, dtype, seeds: tuple[int, ...], fused: bool) -> dict:
    """The gradients of 2 Blocks of ``package`` without delay, one step over every seed's
    micro-batches (values in ``cfg``'s ``value_dtype``, computed in ``dtype``)."""
    n_mb = cfg["n_mb"]
    values = cfg.get("value_dtype", cfg["dtype"])
    hidden, _, rows = sizes(None)
    blocks = two_blocks(
        package,
        fused=fused,
        dtype=dtype,
        value_dtype=values,
        # one step over every seed's micro-batches: only the very first overwrites
        microbatches_per_step=n_mb * len(seeds) if fused else None,
        prefill_seed=99,
        delay=False,
        proj_twice=cfg.get("proj_twice", False),
        tied=cfg.get("tied", False),
    )
    for seed in seeds:
        x, target = data(seed, n_mb * rows, hidden, values)
        for xb, tb in zip(x.split(rows), target.split(rows)):
            loss_of(blocks(xb.to(dtype)), tb.to(dtype)).backward()
    return clone(gradients(blocks))


def dp_truth(rank: int, _: int, lib_name: str, configs: list[dict], world: int) -> list:
    """Per config: the replicas emulated in one process by the package without delay (their
    sum, then the two divisions the distributed run does), and the global batch through
    ``splitgrad.reference`` in the same dtype (the naive yardstick) and plain in float64 (the
    truth). A config's ``value_dtype`` (default its ``dtype``) is the values' dtype: FSDP2
    mixed precision computes in ``dtype`` from fp32 values."""
    lib = load_library(lib_name)
    ref = load_library("reference")
    out = []
    for cfg in configs:
        n_mb, fused, dtype = cfg["n_mb"], cfg["fused"], cfg["dtype"]
        replicas = [_global_batch(lib, cfg, dtype, (100 + r,), fused) for r in range(world)]
        emulated = {name: mean([rep[name] for rep in replicas], world) for name in replicas[0]}
        emulated = {n: None if g is None else g.div_(n_mb) for n, g in emulated.items()}
        seeds = tuple(100 + r for r in range(world))
        divisor = world * n_mb
        naive = _global_batch(ref, cfg, dtype, seeds, fused)
        naive = {n: g.div(divisor) for n, g in naive.items()}
        truth = _global_batch(ref, cfg, torch.float64, seeds, False)
        truth = {n: g.div(divisor) for n, g in truth.items()}
        out.append({"emulated": emulated, "naive": naive, "truth": truth})
    return out


def _check_launches(report: DistributedReport, where: str, got: dict) -> None:
    """Every bucket launched once, all before finish(), and (where backward_dw ran late) the
    first block's buckets before the second block's wgrad finished: overlap."""
    launched = [b for b, *_ in got["launches"]]
    report.counted()
    if sorted(launched) != list(range(len(got["buckets"]))):
        report.failures.append(
            f"{where}: buckets launched {launched}, expected each of {len(got['buckets'])} once"
        )
    if got["launches"] and got["finish"] is not None:
        late = [b for b, *rest in got["launches"] if rest[-1] > got["finish"]]
        if late:
            report.failures.append(f"{where}: buckets {late} launched after finish() was called")
    if len(got.get("dw_times", ())) >= 2:
        # the last block's entries run first; the first launch must precede the last drain
        if not got["launches"] or got["launches"][0][-1] >= got["dw_times"][-1]:
            report.failures.append(f"{where}: no reduction started before the last backward_dw()")


def _compare(report: DistributedReport, where: str, got: dict, truth: dict) -> None:
    """One replica's step of one config against the one-process runs ``truth``."""
    if got["error"]:
        report.failures.append(f"{where}: finish() raised: {got['error']}")
    _check_launches(report, where, got)
    for name, g in got["grads"].items():
        report.bitwise(
            f"{where} {name} vs (replica0 + replica1) / 2 without delay",
            g,
            truth["emulated"][name],
        )
    judge_truth(report, f"{where} (global batch)", got["grads"], truth["naive"], truth["truth"])


def check_data_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 3,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    timeout_s: float = 600.0,
    reducer: str = REDUCER,
) -> DistributedReport:
    """P16 alone, on 2 gloo replicas: fused and plain, no_sync() and num_microbatches; a
    delayed module applied twice per micro-batch and a weight tied between two delayed modules
    (both queue two entries in the step's last pass); fused ``main_grad`` prefilled with random
    values that the first micro-batch (``is_first_microbatch=True``) overwrites. ``reducer``
    names the reducer class (``"module:Class"``, built as ``GradientReducer`` is)."""
    configs = [
        {"fused": f, "mode": m, "n_mb": n_microbatches, "dtype": d, "proj_twice": True, "tied": t}
        for f in (False, True)
        for m in ("no_sync", "count")
        for d in dtypes
        for t in (False, True)
    ]
    world = 2
    report = DistributedReport(f"P16 {lib_name} on {world} replicas")
    results = run_checked(
        report, "replicas", _dp_rank, world, lib_name, configs, reducer, timeout_s=timeout_s
    )
    truths = run_checked(
        report,
        "single-process baseline",
        dp_truth,
        1,
        lib_name,
        configs,
        world,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        label = f"{'fused' if cfg['fused'] else 'plain'} {cfg['mode']} {cfg['dtype']}"
        label += " tied" if cfg["tied"] else ""
        for rank, per_rank in enumerate(results):
            _compare(report, f"{label} rank {rank}", per_rank[k], truth[k])
    return report
