"""P15 (SPEC §7): stages of split-backward modules under ``torch.distributed.pipelining``
schedules with :func:`~splitgrad.distributed.dw_builder`.

Loss and every gradient are bitwise equal to running the same stages on the same micro-batches
in one process *without delay*, divided by the micro-batch count as the schedule does: each
parameter's micro-batch contributions are added in micro-batch order (W steps run FIFO) by the
same kernels on the same shapes (P4), and the stage boundaries only copy tensors. Without FP8,
every gradient is also judged against ``splitgrad.reference``'s float64 truth.
"""

from __future__ import annotations

import dataclasses

import torch
from splitgrad.distributed import GradientReducer, dw_builder, split_modules

from .library import load_library
from .model import (
    autocast,
    blocks,
    data,
    finish_error,
    gradient_copies,
    gradients,
    loss_of,
    make_recipe,
    reference_runs,
    replica_mean,
    sizes,
    without_delay,
)
from .report import DistributedReport, baseline, judge_truth, run_checked

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


def _stage_reducers(stages: dict, cfg: PipelineConfig, reducer_group, fsdp_mesh) -> dict:
    """A reducer per stage module: over ``reducer_group``, or over FSDP2's group once the
    module is fully_shard-ed over ``fsdp_mesh``; none without either."""
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard
    reducers = {}
    for i, b in stages.items():
        if fsdp_mesh is not None:
            fully_shard(b, mesh=fsdp_mesh)
            reducers[i] = GradientReducer(b, num_microbatches=cfg.n_microbatches)
        elif reducer_group is not None:
            reducers[i] = GradientReducer(b, reducer_group, num_microbatches=cfg.n_microbatches)
    return reducers


def _schedule(cfg: PipelineConfig, stages: dict, builders: dict, num_stages: int, group):
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    pipeline_stages = [
        PipelineStage(b, i, num_stages, torch.device("cpu"), group=group, dw_builder=builders[i])
        for i, b in stages.items()
    ]
    schedule_cls = getattr(schedules, cfg.schedule)
    only = pipeline_stages[0] if len(pipeline_stages) == 1 else pipeline_stages
    return schedule_cls(only, cfg.n_microbatches, loss_fn=loss_of)


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
    """One ``schedule.step`` on this rank: its stages' gradients, losses, what was left pending
    and the reducers' launches. ``fsdp_mesh``: each stage module is fully_shard-ed over it (its
    reducer reduce-scatters over FSDP2's group; the gradients returned are all-gathered)."""
    indices, num_stages = stage_layout(cfg.schedule, rank, pp)
    model = blocks(
        lib,
        indices,
        cfg.recipe,
        fused=cfg.fused,
        dtype=cfg.dtype,
        microbatches_per_step=cfg.n_microbatches,
        prefill_seed=rank + 1,
    )
    stages = dict(zip(indices, model))
    reducers = _stage_reducers(stages, cfg, reducer_group, fsdp_mesh)
    builders = {i: dw_builder(b) for i, b in stages.items()}
    schedule = _schedule(cfg, stages, builders, num_stages, group)
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
    # finish() is a no-op where the schedule's gradient scaling finished it already
    errors = [(i, finish_error(r)) for i, r in reducers.items()]
    grads = {i: gradient_copies(b, full=fsdp_mesh is not None) for i, b in stages.items()}
    return {
        "errors": [f"stage {i}: {e}" for i, e in errors if e is not None],
        "losses": [loss.detach().clone() for loss in losses],
        "grads": grads,
        "pending": {
            i: {sm.name: sm.module.pending_wgrad_count for sm in split_modules(b)}
            for i, b in stages.items()
        },
        "runners_left": {i: builders[i].pending_runners for i in stages},
        "launches": {i: [e["time"] for e in r.launch_log] for i, r in reducers.items()},
        "finish": {i: r.finish_time for i, r in reducers.items()},
    }


def _pipeline_rank(rank: int, world: int, lib_name: str, configs: list[PipelineConfig]) -> list:
    lib = load_library(lib_name)
    return [run_pipeline(lib, cfg, rank, world) for cfg in configs]


def pipeline_truth(
    rank: int, world: int, lib_name: str, configs: list[PipelineConfig], pp: int, replicas: int
) -> list:
    """Per config, the stages of ``pp`` ranks without delay in one process on each replica's
    micro-batches (data seed = replica): each stage's replica mean, the losses by replica, and
    (without FP8, whose truth is the same-recipe one P3 and P13 judge) the reference runs."""
    lib = load_library(lib_name)
    out = []
    for cfg in configs:
        _, num_stages = stage_layout(cfg.schedule, 0, pp)
        n_mb, seeds = cfg.n_microbatches, tuple(range(replicas))
        options = dict(dtype=cfg.dtype, value_dtype=cfg.dtype, fused=cfg.fused)
        runs = [
            without_delay(lib, num_stages, (r,), n_mb, recipe=cfg.recipe, **options) for r in seeds
        ]
        grads = [replica_mean([gradients(m[i]) for m, _ in runs], n_mb) for i in range(num_stages)]
        naive = truth = None
        if cfg.recipe is None:
            references = reference_runs(num_stages, seeds, n_mb, **options)
            naive, truth = ([gradient_copies(b) for b in run] for run in references)
        losses = [run_losses for _, run_losses in runs]
        out.append({"grads": grads, "losses": losses, "naive": naive, "truth": truth})
    return out


def compare_stage(
    report: DistributedReport, where: str, grads: dict, want: dict, i: int, versus: str, batch=""
) -> None:
    """Stage ``i``'s gradients bitwise against ``want``'s (the one-process run ``versus`` names)
    and, without FP8, within the budget of the float64 truth (of the ``batch``)."""
    for name, g in grads.items():
        report.bitwise(f"{where} stage {i} {name} vs {versus}", g, want["grads"][i][name])
    if want["truth"] is not None:
        naive, truth = want["naive"][i], want["truth"][i]
        judge_truth(report, f"{where} stage {i}{batch}", grads, naive, truth)


def _compare(report: DistributedReport, where: str, got: dict, want: dict) -> None:
    """One rank's step of one config against the baseline ``want``."""
    for i, grads in got["grads"].items():
        compare_stage(report, where, grads, want, i, "the package without delay")
        left = {n: c for n, c in got["pending"][i].items() if c}
        if left or got["runners_left"][i]:
            report.failures.append(
                f"{where} stage {i}: after step(), entries pending {left}, "
                f"{got['runners_left'][i]} W steps not run"
            )
    if got["losses"]:
        for j, (a, b) in enumerate(zip(got["losses"], want["losses"][0])):
            report.bitwise(f"{where} loss of micro-batch {j}", a, b)
        if len(got["losses"]) != len(want["losses"][0]):
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
    truth = baseline(report, pipeline_truth, lib_name, configs, world_size, 1, timeout_s=timeout_s)
    if results is None or truth is None:
        return report
    for k, cfg in enumerate(configs):
        for rank, per_rank in enumerate(results):
            _compare(report, f"{cfg.label} rank {rank}", per_rank[k], truth[k])
    return report
