"""P16 under ``fully_shard`` (FSDP2, SPEC §8 "Fully sharded data parallel"): 2 Blocks, each and
the root wrapped with ``fully_shard``, on 2 and on 3 gloo ranks (one spawn per world size), 3
micro-batches.

The reducer reduce-scatters each delayed module's gradients into the sharded gradients, the
first before the last ``backward_dw()`` starts; every full (all-gathered) gradient is bitwise
equal to FSDP2 alone without delay (the same model, torch.nn's path: FSDP2 reduces every
gradient itself) and within the data-parallel budget of the float64 global batch, in fp32 and
under FSDP2 mixed precision (:data:`FSDP_PRECISIONS`). Every parameter carries a
post-accumulate-grad hook: it fires once per step on the sharded parameter, seeing the reduced
local shard, as it does under FSDP2 alone. On 2 ranks some weights are sharded on dim 1
(``shard_placement_fn``); on 3 ranks (:data:`WORLD3_PRECISIONS`) dim 0 is padded unevenly and
dividing before or after the sum rounds differently.
"""

from __future__ import annotations

import torch

from .data_parallel import REDUCER, compare_replica, dp_truth, one_of_the_orders, replica_step
from .library import load_library
from .model import blocks, gradient_copies, sizes
from .report import DistributedReport, check_buckets, run_checked

#: FSDP2 mixed precision the fully_shard cells run, by name: ``MixedPrecisionPolicy``'s
#: ``param_dtype`` and ``reduce_dtype`` and ``set_force_sum_reduction_for_comms``. They reach
#: every branch of FSDP2's averaging: AVG inside the collective (fp32, bf16), a pre-divide
#: before a SUM (an fp16 ``reduce_dtype``: ``sqrt``-ish split of the world size against
#: overflow) and a post-divide after it (forced sum); a ``reduce_dtype`` other than the
#: parameters' (bf16 parameters reduced in fp32, fp32 parameters reduced in bf16) also sums
#: the micro-batches' gradients in the ``reduce_dtype`` between passes.
FSDP_PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None, bool]] = {
    "fp32": (None, None, False),
    "bf16": (torch.bfloat16, None, False),
    "bf16/fp32": (torch.bfloat16, torch.float32, False),
    "fp16": (torch.float16, None, False),
    "bf16/fp16": (torch.bfloat16, torch.float16, False),
    "fp32 sum": (None, None, True),
    "bf16/fp32 sum": (torch.bfloat16, torch.float32, True),
    "fp32/bf16": (None, torch.bfloat16, False),
}

#: The precisions the 3-rank cells run: where a world size that is no power of two changes the
#: arithmetic. Forced sum divides by 3 after the sum (before it, it would round otherwise);
#: fp16 splits the 3 into a pre-divide by 2 and a post-divide by 1.5; fp32 averages in the
#: collective.
WORLD3_PRECISIONS = ("fp32", "fp32 sum", "fp16")

#: The precisions the ``Shard(1)`` cells run (num_microbatches, on 2 ranks): fp32, and bf16
#: parameters whose micro-batches are summed in an fp32 ``reduce_dtype`` before the
#: reduce-scatter rearranges them.
SHARD1_PRECISIONS = ("fp32", "bf16/fp32")

#: FSDP2 placements of the cells: every parameter on dim 0, or (``shard_placement_fn``) every
#: 2-D weight but the torch.nn ``gate``'s on dim 1, where the world size divides that dim.
PLACEMENTS = ("Shard(0)", "Shard(1)")


def _dim1_weights(model: torch.nn.Module, world: int) -> set[int]:
    """The weights ``Shard(1)`` cells shard on dim 1: 2-D, dim 1 divisible by ``world`` (FSDP2
    refuses uneven sharding there), all but the torch.nn ``gate``'s (its group then mixes
    placements in one reduce-scatter)."""
    return {
        id(p)
        for n, p in model.named_parameters()
        if p.ndim == 2 and p.size(1) % world == 0 and ".gate." not in f".{n}"
    }


def _hook_recorder(records: list, param: torch.nn.Parameter):
    """A post-accumulate-grad hook for the sharded ``param``: what each call sees (whether it
    was given ``param`` itself, and the local shard of its gradient then)."""

    def hook(t: torch.Tensor) -> None:
        g = t.grad
        local = None if g is None else (g.to_local() if hasattr(g, "to_local") else g)
        records.append((t is param, None if local is None else local.detach().clone()))

    return hook


def _fsdp_step(
    lib,
    rank: int,
    world: int,
    reducer_cls,
    mode: str,
    n_mb: int,
    precision: str,
    drain: str,
    placement: str = "Shard(0)",
) -> dict:
    """One step (:func:`~.data_parallel.replica_step`) of 2 Blocks, each and the root
    fully_shard-ed under ``precision`` and ``placement``, on one rank: delayed with
    ``reducer_cls``, or FSDP2 alone without delay (``None``); the full (all-gathered) gradients
    are divided by the micro-batch count. A post-accumulate-grad hook on every sharded
    parameter records each call (``"hooks"``)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Shard

    param_dtype, reduce_dtype, force_sum = FSDP_PRECISIONS[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = blocks(lib, range(2), fused=False, dtype=torch.float32, delay=reducer_cls is not None)
    placement_fn = None
    if placement == "Shard(1)":
        dim1 = _dim1_weights(model, world)
        if not dim1:
            raise ValueError(f"no weight of the model can be sharded on dim 1 over {world} ranks")
        placement_fn = lambda p: Shard(1) if id(p) in dim1 else None  # noqa: E731
    for b in model:
        fully_shard(b, mp_policy=policy, shard_placement_fn=placement_fn)
    fully_shard(model, mp_policy=policy)
    if force_sum:
        for m in (*model, model):
            m.set_force_sum_reduction_for_comms(True)
    hooks: dict[str, list] = {}
    for name, p in model.named_parameters():
        hooks[name] = []
        p.register_post_accumulate_grad_hook(_hook_recorder(hooks[name], p))
    reducer = None
    if reducer_cls is not None:
        reducer = reducer_cls(model, num_microbatches=n_mb if mode == "count" else None)
    out = replica_step(model, reducer, rank, mode, n_mb, torch.float32, sharded=True, drain=drain)
    grads = gradient_copies(model, full=True)
    out["grads"] = {n: None if g is None else g.div_(n_mb) for n, g in grads.items()}
    out["hooks"] = hooks
    out["local"] = {
        n: None if p.grad is None else p.grad.to_local().detach().clone()
        for n, p in model.named_parameters()
    }
    out["placements"] = {
        n: repr(p.placements[0]) if hasattr(p, "placements") else None
        for n, p in model.named_parameters()
    }
    return out


def _compute_dtype(precision: str) -> torch.dtype:
    """The narrowest dtype a cell's gradients pass through: FSDP2's ``param_dtype`` or its
    ``reduce_dtype`` (fp32 parameters reduced in bf16 are rounded to bf16 on the way)."""
    param_dtype, reduce_dtype, _ = FSDP_PRECISIONS[precision]
    dtypes = [d for d in (param_dtype, reduce_dtype) if d is not None] or [torch.float32]
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def _truth_key(cfg: dict) -> tuple:
    """What :func:`~.data_parallel.dp_truth` of a cell depends on: its micro-batch count and
    FSDP2's compute dtype."""
    return cfg["n_mb"], FSDP_PRECISIONS[cfg["precision"]][0] or torch.float32


def _fsdp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = REDUCER
) -> dict:
    """Every config, delayed with the reducer and (the baseline) FSDP2 alone without delay; on
    rank 0 also :func:`~.data_parallel.dp_truth` once per :func:`_truth_key`: the naive
    yardstick in FSDP2's compute dtype from the fp32 values FSDP2 casts, and the float64 truth
    of those values."""
    lib = load_library(lib_name)
    reducer_cls = load_library(reducer_name)
    out = {"runs": [], "baseline": [], "truth": None}
    for cfg in configs:
        out["runs"].append(_fsdp_step(lib, rank, world, reducer_cls, **cfg))
        out["baseline"].append(_fsdp_step(lib, rank, world, None, **cfg))
    if rank == 0:
        keys = list(dict.fromkeys(_truth_key(c) for c in configs))
        truth_configs = [{"n_mb": n, "dtype": d, "value_dtype": torch.float32} for n, d in keys]
        truths = dp_truth(0, 1, lib_name, truth_configs, world)
        out["truth"] = [truths[keys.index(_truth_key(c))] for c in configs]
    return out


def compare_hooks(
    report: DistributedReport, where: str, got: dict, base: dict, versus_base: bool
) -> None:
    """Each sharded parameter's post-accumulate-grad hook: called once in the step as under
    FSDP2 without delay, with the sharded parameter itself, seeing bitwise the local shard of
    the gradient the step ends with, and (``versus_base``: where the collectives sum in one
    order) the one FSDP2 alone shows its hook."""
    for name, calls in got["hooks"].items():
        want = base["hooks"][name]
        report.counted()
        if len(calls) != 1 or len(want) != 1:
            report.failures.append(
                f"{where} {name}: post-accumulate-grad hook called {len(calls)} times in the "
                f"step, {len(want)} under FSDP2 without delay (expected once)"
            )
            continue
        (is_param, seen), (_, seen_base) = calls[0], want[0]
        report.counted()
        if not is_param:
            report.failures.append(
                f"{where} {name}: post-accumulate-grad hook called with another tensor than "
                "the sharded parameter"
            )
        what = f"{where} {name} gradient seen by its post-accumulate-grad hook"
        report.bitwise(f"{what} vs the step's final shard", seen, got["local"][name])
        if versus_base:
            report.bitwise(f"{what} vs FSDP2's without delay", seen, seen_base)


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


def _cells(
    world: int, n_mb: int, precisions: tuple[str, ...], placements: tuple[str, ...]
) -> list[dict]:
    """The cells of one world size: every precision with no_sync() and num_microbatches
    draining after the last backward and no_sync() draining each micro-batch right after its
    backward (on 3 ranks, :data:`WORLD3_PRECISIONS` only, with num_microbatches, and forced
    sum with no_sync() each too); ``Shard(1)`` with num_microbatches for
    :data:`SHARD1_PRECISIONS`, where some weight's dim 1 divides ``world``."""
    hidden, ffn, _ = sizes(None)
    every = (("no_sync", "late"), ("count", "late"), ("no_sync", "each"))
    modes = {p: every for p in precisions}
    if world != 2:
        modes = {p: (("count", "late"),) for p in precisions if p in WORLD3_PRECISIONS}
        if "fp32 sum" in modes:
            modes["fp32 sum"] += (("no_sync", "each"),)
    cells = [
        {"mode": m, "n_mb": n_mb, "precision": p, "drain": d, "placement": "Shard(0)"}
        for p in modes
        for m, d in modes[p]
        if "Shard(0)" in placements
    ]
    if "Shard(1)" in placements and (hidden % world == 0 or ffn % world == 0):
        cells += [
            {
                "mode": "count",
                "n_mb": n_mb,
                "precision": p,
                "drain": "late",
                "placement": "Shard(1)",
            }
            for p in precisions
            if p in SHARD1_PRECISIONS
        ]
    return cells


def cell_label(cfg: dict, world: int) -> str:
    """``fully_shard PRECISION MODE[ each][ Shard(1)][ on 3 ranks]``."""
    label = f"fully_shard {cfg['precision']} {cfg['mode']}"
    label += " each" if cfg["drain"] == "each" else ""
    label += f" {cfg['placement']}" if cfg["placement"] != "Shard(0)" else ""
    return label + (f" on {world} ranks" if world != 2 else "")


def check_fully_sharded(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 3,
    precisions: tuple[str, ...] = tuple(FSDP_PRECISIONS),
    world_sizes: tuple[int, ...] = (2, 3),
    placements: tuple[str, ...] = PLACEMENTS,
    timeout_s: float = 600.0,
    reducer: str = REDUCER,
) -> DistributedReport:
    """P16 under ``fully_shard`` (FSDP2), one gloo spawn per world size of ``world_sizes``
    running all its cells (:func:`_cells`). In float32 compute on 2 ranks also bitwise
    ``(replica0 + replica1) / 2`` computed in one process (a sum of two, halved, is exact in
    either order, whichever side divides); bf16 or fp16 casts and accumulation have no
    one-process twin, nor has a mean of 3. ``reducer`` names the reducer class, built as
    ``GradientReducer`` is."""
    unknown = sorted(set(precisions) - set(FSDP_PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precisions {unknown}; expected some of {list(FSDP_PRECISIONS)}")
    wrong = sorted(set(placements) - set(PLACEMENTS))
    if wrong or not placements:
        raise ValueError(f"unknown placements {wrong or placements}; expected some of {PLACEMENTS}")
    bad = [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int) or w < 2]
    if bad or not world_sizes:
        raise ValueError(f"world_sizes must be ints >= 2, got {world_sizes!r}")
    if (
        isinstance(n_microbatches, bool)
        or not isinstance(n_microbatches, int)
        or n_microbatches < 1
    ):
        raise ValueError(f"n_microbatches must be a positive int, got {n_microbatches!r}")
    ranks = " and ".join(str(w) for w in world_sizes)
    report = DistributedReport(f"P16 fully_shard {lib_name} on {ranks} ranks")
    for world in world_sizes:
        configs = _cells(world, n_microbatches, precisions, placements)
        if not configs:
            report.notes.append(f"{world} ranks: no cell among {precisions} x {placements}")
            continue
        results = run_checked(
            report,
            f"FSDP2 on {world} ranks",
            _fsdp_rank,
            world,
            lib_name,
            configs,
            reducer,
            timeout_s=timeout_s,
        )
        if results is None:
            continue
        truth = results[0]["truth"]
        for k, cfg in enumerate(configs):
            label = cell_label(cfg, world)
            compute, exact = _compute_dtype(cfg["precision"]), world == 2
            for rank, per_rank in enumerate(results):
                got, base = per_rank["runs"][k], per_rank["baseline"][k]
                where = f"{label} rank {rank}"
                compare_replica(
                    report,
                    where,
                    got,
                    truth[k],
                    check_fsdp_launches,
                    base if exact else None,
                    compute,
                    exact,
                )
                if not exact and compute == torch.float32:
                    n_mb, replicas = cfg["n_mb"], truth[k]["replicas"]
                    one_of_the_orders(report, where, got["grads"], replicas, n_mb)
                    baseline_where = f"{where} (FSDP2 without delay)"
                    one_of_the_orders(report, baseline_where, base["grads"], replicas, n_mb)
                compare_hooks(report, where, got, base, exact)
                if cfg["placement"] == "Shard(1)":
                    report.counted()
                    if "Shard(dim=1)" not in got["placements"].values():
                        report.failures.append(f"{where}: no parameter was sharded on dim 1")
        report.notes.append(
            f"launch log ({world} ranks, rank 0, {cell_label(configs[0], world)}): "
            + launch_summary(results[0]["runs"][0])
        )
    return report
