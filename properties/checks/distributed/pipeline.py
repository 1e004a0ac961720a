"""P15 (SPEC §7): stages of split-backward modules under ``torch.distributed.pipelining``
schedules with :func:`~splitgrad.distributed.dw_builder`.

Loss and every gradient are bitwise equal to running the same stages on the same micro-batches
in one process *without delay* (SPEC §7), then dividing by the micro-batch count as the schedule
does. Bitwise holds because each parameter's micro-batch contributions are added in micro-batch
order (W steps run FIFO) by the same kernels on the same shapes (delayed ≡ non-delayed, P4), and
the stage boundaries only copy tensors. Without FP8, every gradient is also judged against
``splitgrad.reference``'s float64 truth, within the data-parallel budget scaled by the
reference's own same-dtype error (not the package's: a bug its delayed and non-delayed paths
share must still show).

One rank's step (:func:`run_pipeline`) and the one-process baseline (:func:`single_pipeline`)
also serve P16 composed with P15 (:mod:`.pipeline_data_parallel`).
"""

from __future__ import annotations

import dataclasses

import torch
from splitgrad.distributed import GradientReducer, dw_builder, split_modules

from .library import load_library
from .model import (
    Block,
    autocast,
    clone,
    data,
    drain_entries,
    gradients,
    loss_of,
    make_recipe,
    scale,
    sizes,
)
from .report import DistributedReport, judge_truth, run_checked

__all__ = [
    "SCHEDULES",
    "PipelineConfig",
    "stage_layout",
    "run_pipeline",
    "single_pipeline",
    "reference_runs",
    "check_pipeline",
]

#: The torch.distributed.pipelining schedules P15 runs (by class name).
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str
    fused: bool = False
    recipe: str | None = None
    dtype: torch.dtype = torch.float32
    n_microbatches: int = 4

    @property
    def label(self) -> str:
        parts = [self.schedule, "fused" if self.fused else "plain", str(self.dtype)[6:]]
        if self.recipe:
            parts.append(f"fp8:{self.recipe}")
        return " ".join(parts) + f" n_mb={self.n_microbatches}"


def stage_layout(schedule: str, rank: int, pp: int) -> tuple[list[int], int]:
    """The stage indices rank ``rank`` holds under ``schedule`` with ``pp`` ranks, and the number
    of stages: one per rank (GPipe, 1F1B), two looped (interleaved), two in a V (ZBV,
    DualPipeV)."""
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        return [rank], pp
    if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return [rank, rank + pp], 2 * pp
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [rank, 2 * pp - 1 - rank], 2 * pp
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


# ---- one rank's step -----------------------------------------------------------------------


def _stage_blocks(lib, cfg: PipelineConfig, indices: list[int], rank: int) -> dict[int, Block]:
    hidden, ffn, _ = sizes(cfg.recipe)
    return {
        i: Block(
            lib,
            hidden,
            ffn,
            i,
            fused=cfg.fused,
            dtype=cfg.dtype,
            microbatches_per_step=cfg.n_microbatches if cfg.fused else None,
            prefill_seed=rank + 1,
        )
        for i in indices
    }


def _stage_reducers(blocks: dict, cfg: PipelineConfig, reducer_group, fsdp_mesh) -> dict:
    """A reducer per stage module: over ``reducer_group``, or over FSDP2's group once the
    module is fully_shard-ed over ``fsdp_mesh``; none without either."""
    reducers = {}
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for i, b in blocks.items():
            fully_shard(b, mesh=fsdp_mesh)
            reducers[i] = GradientReducer(b, num_microbatches=cfg.n_microbatches)
    elif reducer_group is not None:
        for i, b in blocks.items():
            reducers[i] = GradientReducer(b, reducer_group, num_microbatches=cfg.n_microbatches)
    return reducers


def _schedule(cfg: PipelineConfig, blocks: dict, builders: dict, num_stages: int, group):
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    stages = [
        PipelineStage(b, i, num_stages, torch.device("cpu"), group=group, dw_builder=builders[i])
        for i, b in blocks.items()
    ]
    schedule_cls = getattr(schedules, cfg.schedule)
    return schedule_cls(
        stages if len(stages) > 1 else stages[0], cfg.n_microbatches, loss_fn=loss_of
    )


def _finish(reducers: dict) -> list[str]:
    errors = []
    for i, r in reducers.items():
        try:
            r.finish()  # a no-op where the schedule's gradient scaling finished it already
        except RuntimeError as exc:
            errors.append(f"stage {i}: {exc}")
    return errors


def _stage_outcome(blocks: dict, builders: dict, reducers: dict, sharded: bool) -> dict:
    """The stages' gradients (all-gathered where ``sharded``), what was left pending, and the
    reducers' launches."""
    grads = {i: clone(gradients(b)) for i, b in blocks.items()}
    if sharded:
        grads = {
            i: {n: None if g is None else g.detach().full_tensor() for n, g in per.items()}
            for i, per in grads.items()
        }
    return {
        "grads": grads,
        "pending": {
            i: {sm.name: sm.module.pending_wgrad_count for sm in split_modules(b)}
            for i, b in blocks.items()
        },
        "runners_left": {i: builders[i].pending_runners for i in blocks},
        "launches": {
            i: [(e["bucket"], e["time"]) for e in r.launch_log] for i, r in reducers.items()
        },
        "finish": {i: r.finish_time for i, r in reducers.items()},
    }


def run_pipeline(
    lib,
    cfg: PipelineConfig,
    rank: int,
    pp: int,
    group=None,
    reducer_group=None,
    data_seed=0,
    fsdp_mesh=None,
) -> dict:
    """One ``schedule.step`` on this rank; returns its stages' gradients, losses and what was
    left pending. ``fsdp_mesh``: each stage module is wrapped with ``fully_shard`` over it (its
    reducer then reduce-scatters over FSDP2's group, and the gradients returned are the
    all-gathered full ones)."""
    indices, num_stages = stage_layout(cfg.schedule, rank, pp)
    blocks = _stage_blocks(lib, cfg, indices, rank)
    reducers = _stage_reducers(blocks, cfg, reducer_group, fsdp_mesh)
    builders = {i: dw_builder(b) for i, b in blocks.items()}
    schedule = _schedule(cfg, blocks, builders, num_stages, group)
    hidden, _, rows = sizes(cfg.recipe)
    x, target = data(data_seed, cfg.n_microbatches * rows, hidden, cfg.dtype)
    first, last = 0 in indices, num_stages - 1 in indices
    losses: list[torch.Tensor] = []
    with autocast(lib, make_recipe(lib, cfg.recipe)):
        schedule.step(
            *((x,) if first else ()),
            target=target if last else None,
            losses=losses if last else None,
        )
    errors = _finish(reducers)
    return {
        "errors": errors,
        "losses": [loss.detach().clone() for loss in losses],
        **_stage_outcome(blocks, builders, reducers, sharded=fsdp_mesh is not None),
    }


# ---- the one-process baselines -------------------------------------------------------------


def single_pipeline(
    lib,
    cfg: PipelineConfig,
    num_stages: int,
    data_seeds=(0,),
    *,
    dtype: torch.dtype | None = None,
    fused: bool | None = None,
) -> dict:
    """The same stages run one after the other on every micro-batch in one process, without
    delay (SPEC §7: the baseline of P15 and P16), gradients divided by the micro-batch count by
    the caller. ``dtype``/``fused`` override the config's (the float64 truth runs plain in
    float64 on values rounded to the config's dtype)."""
    hidden, ffn, rows = sizes(cfg.recipe)
    dtype = cfg.dtype if dtype is None else dtype
    fused = cfg.fused if fused is None else fused
    blocks = [
        Block(
            lib,
            hidden,
            ffn,
            i,
            fused=fused,
            dtype=dtype,
            value_dtype=cfg.dtype,
            # one step over every seed's micro-batches: only the very first overwrites
            microbatches_per_step=cfg.n_microbatches * len(data_seeds) if fused else None,
            prefill_seed=99,
            delay=False,
        )
        for i in range(num_stages)
    ]
    losses = []
    recipe = make_recipe(lib, cfg.recipe)
    for seed in data_seeds:
        x, target = data(seed, cfg.n_microbatches * rows, hidden, cfg.dtype)
        for xb, tb in zip(x.to(dtype).split(rows), target.to(dtype).split(rows)):
            h = xb
            with autocast(lib, recipe):
                for b in blocks:
                    h = b(h)
            loss = loss_of(h, tb)
            losses.append(loss.detach().clone())
            loss.backward()
            for b in reversed(blocks):
                drain_entries(b)
    return {"blocks": blocks, "losses": losses}


def _scaled_grads(run: dict, divisor: int) -> list[dict]:
    for b in run["blocks"]:
        scale(b, divisor)
    return [clone(gradients(b)) for b in run["blocks"]]


def reference_runs(cfg: PipelineConfig, num_stages: int, data_seeds=(0,)) -> dict:
    """``splitgrad.reference`` without delay on the same stages and micro-batches: in the
    config's dtype and accumulation (the naive yardstick) and plain in float64 (the truth);
    ``None`` under FP8, whose truth is the same-recipe one that P3 and P13 judge."""
    if cfg.recipe is not None:
        return {"naive": None, "truth": None}
    ref = load_library("reference")
    divisor = cfg.n_microbatches * len(data_seeds)
    naive = single_pipeline(ref, cfg, num_stages, data_seeds)
    truth = single_pipeline(ref, cfg, num_stages, data_seeds, dtype=torch.float64, fused=False)
    return {"naive": _scaled_grads(naive, divisor), "truth": _scaled_grads(truth, divisor)}


# ---- the check -----------------------------------------------------------------------------


def _pipeline_rank(rank: int, world: int, lib_name: str, configs: list[PipelineConfig]) -> list:
    lib = load_library(lib_name)
    return [run_pipeline(lib, cfg, rank, world) for cfg in configs]


def _pipeline_truth(rank: int, world: int, lib_name: str, configs, pp: int) -> list:
    lib = load_library(lib_name)
    out = []
    for cfg in configs:
        _, num_stages = stage_layout(cfg.schedule, 0, pp)
        run = single_pipeline(lib, cfg, num_stages)
        out.append(
            {
                "grads": _scaled_grads(run, cfg.n_microbatches),
                "losses": run["losses"],
                **reference_runs(cfg, num_stages),
            }
        )
    return out


def _compare(report: DistributedReport, where: str, got: dict, want: dict) -> None:
    """One rank's step of one config against the baseline ``want``."""
    for i, grads in got["grads"].items():
        for name, g in grads.items():
            report.bitwise(
                f"{where} stage {i} {name} vs the package without delay",
                g,
                want["grads"][i][name],
            )
        if want["truth"] is not None:
            judge_truth(report, f"{where} stage {i}", grads, want["naive"][i], want["truth"][i])
        left = {n: c for n, c in got["pending"][i].items() if c}
        if left or got["runners_left"][i]:
            report.failures.append(
                f"{where} stage {i}: after step(), entries pending {left}, "
                f"{got['runners_left'][i]} W steps not run"
            )
    if got["losses"]:
        for j, (a, b) in enumerate(zip(got["losses"], want["losses"])):
            report.bitwise(f"{where} loss of micro-batch {j}", a, b)
        if len(got["losses"]) != len(want["losses"]):
            report.failures.append(f"{where}: {len(got['losses'])} losses returned")


def check_pipeline(
    lib_name: str = "splitgrad.impl",
    *,
    world_size: int = 2,
    schedules: tuple[str, ...] = SCHEDULES,
    fused: tuple[bool, ...] = (False, True),
    recipes: tuple[str | None, ...] = (None,),
    dtype: torch.dtype = torch.float32,
    n_microbatches: int | None = None,
    timeout_s: float = 600.0,
) -> DistributedReport:
    """P15 on ``world_size`` gloo ranks for every schedule x accumulation x recipe."""
    n_mb = n_microbatches or 2 * world_size
    configs = [
        PipelineConfig(s, f, r, dtype, n_mb) for s in schedules for f in fused for r in recipes
    ]
    report = DistributedReport(f"P15 {lib_name} on {world_size} ranks")
    results = run_checked(
        report, "pipeline ranks", _pipeline_rank, world_size, lib_name, configs, timeout_s=timeout_s
    )
    truths = run_checked(
        report,
        "single-process baseline",
        _pipeline_truth,
        1,
        lib_name,
        configs,
        world_size,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        for rank, per_rank in enumerate(results):
            _compare(report, f"{cfg.label} rank {rank}", per_rank[k], truth[k])
    return report
