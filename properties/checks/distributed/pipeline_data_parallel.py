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
from .pipeline import PipelineConfig, compare_stage, pipeline_truth, run_pipeline
from .report import DistributedReport, baseline, run_checked


def _pp_dp_rank(
    rank: int, world: int, lib_name: str, configs: list[PipelineConfig], sharded: bool = False
) -> list:
    """Ranks (0, 1) and (2, 3) are two pipelines; (0, 2) and (1, 3) reduce over replicas
    (``sharded``: each stage module is fully_shard-ed over them)."""
    lib = load_library(lib_name)
    replica, pp_rank = divmod(rank, 2)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        groups = {"group": mesh["pp"].get_group(), "fsdp_mesh": mesh["dp"]}
    else:
        pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        groups = {"group": pp_groups[replica], "reducer_group": dp_groups[pp_rank]}
    return [run_pipeline(lib, cfg, pp_rank, 2, data_seed=replica, **groups) for cfg in configs]


def _compare(report: DistributedReport, where: str, got: dict, want: dict, replica: int) -> None:
    """One rank's step against the one-process runs ``want``."""
    for error in got["errors"]:
        report.failures.append(f"{where}: finish() raised: {error}")
    for i, grads in got["grads"].items():
        versus = "(replica0 + replica1) / 2 without delay"
        compare_stage(report, where, grads, want, i, versus, " (global batch)")
        launches = got["launches"][i]
        report.counted()
        if not launches:
            report.failures.append(f"{where} stage {i}: no reduction launched")
        elif max(launches) > got["finish"][i]:
            report.failures.append(f"{where} stage {i}: a reduction launched after finish()")
        left = {n: c for n, c in got["pending"][i].items() if c}
        if left:
            report.failures.append(f"{where} stage {i}: entries pending {left}")
    for j, loss in enumerate(got["losses"]):
        report.bitwise(f"{where} loss {j}", loss, want["losses"][replica][j])


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
    truth = baseline(report, pipeline_truth, lib_name, configs, 2, 2, timeout_s=timeout_s)
    if results is None or truth is None:
        return report
    for k, cfg in enumerate(configs):
        for rank, per_rank in enumerate(results):
            where = f"{cfg.label} rank {rank} (replica {rank // 2})"
            _compare(report, where, per_rank[k], truth[k], rank // 2)
    return report
