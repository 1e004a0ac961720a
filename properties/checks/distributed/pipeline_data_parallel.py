"""P16 composed with P15 (SPEC §7) on 4 gloo ranks: 2 pipeline stages x 2 data-parallel
replicas, a :class:`~splitgrad.distributed.GradientReducer` per stage over its replicas, or each
stage module fully_shard-ed over them. Every gradient is bitwise ``(replica0 + replica1) / 2``
of the stages run in one process without delay, and within the data-parallel budget of the
float64 global batch; every reduction is launched before ``finish()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .library import load_library
from .model import clone, gradients
from .pipeline import PipelineConfig, reference_runs, run_pipeline, single_pipeline, stage_layout
from .report import DistributedReport, judge_truth, mean, run_checked

__all__ = ["check_pipeline_data_parallel"]


def _pp_dp_rank(
    rank: int, world: int, lib_name: str, configs: list[PipelineConfig], sharded: bool = False
) -> list:
    """Ranks (0, 1) and (2, 3) are two pipelines; (0, 2) and (1, 3) reduce over replicas
    (``sharded``: each stage module is fully_shard-ed over them)."""
    lib = load_library(lib_name)
    pp = 2
    replica, pp_rank = divmod(rank, pp)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, pp), mesh_dim_names=("dp", "pp"))
        return [
            run_pipeline(
                lib,
                cfg,
                pp_rank,
                pp,
                group=mesh["pp"].get_group(),
                data_seed=replica,
                fsdp_mesh=mesh["dp"],
            )
            for cfg in configs
        ]
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return [
        run_pipeline(
            lib,
            cfg,
            pp_rank,
            pp,
            group=pp_groups[replica],
            reducer_group=dp_groups[pp_rank],
            data_seed=replica,
        )
        for cfg in configs
    ]


def _pp_dp_truth(rank: int, world: int, lib_name: str, configs: list[PipelineConfig]) -> list:
    lib = load_library(lib_name)
    out = []
    for cfg in configs:
        _, num_stages = stage_layout(cfg.schedule, 0, 2)
        reps = [single_pipeline(lib, cfg, num_stages, data_seeds=(r,)) for r in range(2)]
        emulated = []
        for i in range(num_stages):
            g0, g1 = gradients(reps[0]["blocks"][i]), gradients(reps[1]["blocks"][i])
            means = {n: mean([g0[n], g1[n]], 2) for n in g0}
            emulated.append(
                {n: None if g is None else g.div_(cfg.n_microbatches) for n, g in means.items()}
            )
        out.append(
            {
                "grads": [clone(d) for d in emulated],
                "losses": [r["losses"] for r in reps],
                **reference_runs(cfg, num_stages, data_seeds=(0, 1)),
            }
        )
    return out


def _compare_stage(report: DistributedReport, where: str, got: dict, want: dict, i: int) -> None:
    """Stage ``i`` of one rank's step against the one-process runs ``want``."""
    grads = got["grads"][i]
    for name, g in grads.items():
        report.bitwise(
            f"{where} stage {i} {name} vs (replica0 + replica1) / 2 without delay",
            g,
            want["grads"][i][name],
        )
    if want["truth"] is not None:
        judge_truth(
            report,
            f"{where} stage {i} (global batch)",
            grads,
            want["naive"][i],
            want["truth"][i],
        )
    launches = got["launches"][i]
    report.counted()
    if not launches:
        report.failures.append(f"{where} stage {i}: no reduction launched")
    elif max(t for _, t in launches) > got["finish"][i]:
        report.failures.append(f"{where} stage {i}: a reduction launched after finish()")
    left = {n: c for n, c in got["pending"][i].items() if c}
    if left:
        report.failures.append(f"{where} stage {i}: entries pending {left}")


def check_pipeline_data_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    schedules: tuple[str, ...] = ("ScheduleZBVZeroBubble",),
    fused: tuple[bool, ...] = (False, True),
    timeout_s: float = 600.0,
    fully_shard: bool = False,
) -> DistributedReport:
    """P16 with P15 on 4 gloo ranks: 2 pipeline stages x 2 data-parallel replicas
    (``fully_shard``: each stage module fully_shard-ed over its 2 replicas, plain only; the
    ``PipelineStage`` drives FSDP2 and the reducer reduce-scatters the delayed modules)."""
    if fully_shard:
        fused = (False,)
    configs = [PipelineConfig(s, f, None, torch.float32, 4) for s in schedules for f in fused]
    kind = "fully_shard " if fully_shard else ""
    report = DistributedReport(f"P16 x P15 {kind}{lib_name}: 2 stages x 2 replicas")
    results = run_checked(
        report, "ranks", _pp_dp_rank, 4, lib_name, configs, fully_shard, timeout_s=timeout_s
    )
    truths = run_checked(
        report,
        "single-process baseline",
        _pp_dp_truth,
        1,
        lib_name,
        configs,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        for rank, got in enumerate(per_rank[k] for per_rank in results):
            replica = rank // 2
            where = f"{cfg.label} rank {rank} (replica {replica})"
            for error in got["errors"]:
                report.failures.append(f"{where}: finish() raised: {error}")
            for i in got["grads"]:
                _compare_stage(report, where, got, truth[k], i)
            for j, loss in enumerate(got["losses"]):
                report.bitwise(f"{where} loss {j}", loss, truth[k]["losses"][replica][j])
    return report
