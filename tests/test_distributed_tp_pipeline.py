"""Tensor parallel x pipeline parallel (SPEC §8, §9): stages made of splitgrad's TP modules
under a ``torch.distributed.pipelining`` zero-bubble schedule with ``dw_builder``, on 4 gloo
ranks as pp 2 x tp 2 (``init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))``).

Each stage is ``LayerNormMLP`` (``set_parallel_mode=True``), a column ``LayerNormLinear`` and a
row ``Linear``; the activations a stage sends are this TP rank's shard of the sequence under SP,
the whole of it without. Per package, schedule and variant (SP with each ``wgrad_gather``, no
SP) the step runs with delayed modules (the W steps run ``backward_dw()``, which in
``"backward_dw"`` mode all-gathers over the TP group in the middle of the schedule's P2P) and
again without delay: losses and every gradient of every rank bitwise equal (rtol=0, atol=0),
nothing left queued, and under SP the two gather modes bitwise equal to each other. After the
step ``allreduce_sequence_parallel_grads`` sums the stage's sequence-parallel gradients over the
TP group: then they are bitwise equal on both TP ranks. One spawn runs the whole matrix.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from splitgrad.distributed import allreduce_sequence_parallel_grads, dw_builder, run_ranks

pytestmark = pytest.mark.distributed

PP, TP = 2, 2
HIDDEN, FFN, TOKENS, MICRO_BATCHES = 16, 32, 8, 4
PACKAGES = ("splitgrad.reference", "splitgrad.impl")
SCHEDULES = ("ScheduleZBVZeroBubble", "ScheduleInterleavedZeroBubble")
#: (sequence_parallel, wgrad_gather)
VARIANTS = ((True, "backward"), (True, "backward_dw"), (False, "backward"))


def _stage_indices(schedule: str, pp_rank: int) -> list[int]:
    """Two stages per pipeline rank: in a V (ZBV) or looped (interleaved)."""
    if schedule == "ScheduleZBVZeroBubble":
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank, pp_rank + PP]


def _stage(lib, index: int, tp_rank: int, tp_group, sp: bool, gather: str, delay: bool):
    torch.manual_seed(100 * index + tp_rank)  # the same shards with and without delay
    kw = dict(
        tp_group=tp_group, sequence_parallel=sp, wgrad_gather=gather, delay_wgrad_compute=delay
    )
    return torch.nn.Sequential(
        lib.LayerNormMLP(HIDDEN, FFN, set_parallel_mode=True, **kw),
        lib.LayerNormLinear(HIDDEN, FFN, parallel_mode="column", **kw),
        lib.Linear(FFN, HIDDEN, parallel_mode="row", **kw),
    )


def _data(tp_rank: int, sp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """This TP rank's micro-batches, stacked along dim 0 (the schedule splits them again):
    under SP its shard of each micro-batch's sequence, without SP the whole of it."""
    gen = torch.Generator().manual_seed(7)
    x, target = (torch.randn(MICRO_BATCHES, TOKENS, HIDDEN, generator=gen) for _ in range(2))
    if sp:
        rows = slice(tp_rank * TOKENS // TP, (tp_rank + 1) * TOKENS // TP)
        x, target = x[:, rows], target[:, rows]
    return x.reshape(-1, HIDDEN).contiguous(), target.reshape(-1, HIDDEN).contiguous()


def _step(lib, schedule_name: str, mesh, sp: bool, gather: str, delay: bool) -> dict:
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    pp_group, tp_group = mesh["pp"].get_group(), mesh["tp"].get_group()
    pp_rank, tp_rank = mesh["pp"].get_local_rank(), mesh["tp"].get_local_rank()
    indices = _stage_indices(schedule_name, pp_rank)
    modules = {i: _stage(lib, i, tp_rank, tp_group, sp, gather, delay) for i in indices}
    w_calls = [0]
    for m in modules.values():
        for layer in m:
            layer.backward_dw = _counted(layer.backward_dw, w_calls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # without delay: "nothing is split"
        builders = {i: dw_builder(m) for i, m in modules.items()}
    stages = [
        PipelineStage(m, i, 2 * PP, torch.device("cpu"), group=pp_group, dw_builder=builders[i])
        for i, m in modules.items()
    ]
    schedule = getattr(schedules, schedule_name)(
        stages, MICRO_BATCHES, loss_fn=torch.nn.functional.mse_loss
    )
    x, target = _data(tp_rank, sp)
    first, last = 0 in indices, 2 * PP - 1 in indices
    losses: list[torch.Tensor] = []
    schedule.step(
        *((x,) if first else ()),
        target=target if last else None,
        losses=losses if last else None,
    )
    # The norms' and row biases' gradients are per-rank partial sums under SP: summed over the
    # TP group once the schedule's W steps have run.
    summed = [
        f"stage {i}.{name}"
        for i, m in modules.items()
        for name in allreduce_sequence_parallel_grads(m, tp_group)
    ]
    return {
        "summed": summed,
        "losses": [loss.detach().clone() for loss in losses],
        "grads": {
            f"stage {i}.{name}": p.grad.clone()
            for i, m in modules.items()
            for name, p in m.named_parameters()
        },
        "w_calls": w_calls[0],
        "pending": sum(layer.pending_wgrad_count for m in modules.values() for layer in m),
        "runners_left": sum(b.pending_runners for b in builders.values()),
    }


def _counted(backward_dw, calls: list):
    def run() -> None:
        calls[0] += 1
        backward_dw()

    return run


def _tp_pp_rank(rank: int, world: int) -> dict:
    import importlib

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (PP, TP), mesh_dim_names=("pp", "tp"))
    out = {}
    for package in PACKAGES:
        lib = importlib.import_module(package)
        for schedule in SCHEDULES:
            for sp, gather in VARIANTS:
                for delay in (True, False):
                    out[package, schedule, sp, gather, delay] = _step(
                        lib, schedule, mesh, sp, gather, delay
                    )
    return out


def _bitwise(failures: list, where: str, got, want) -> None:
    try:
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    except AssertionError as exc:
        failures.append(f"{where}: {str(exc).splitlines()[0]}")


def test_tp_stages_under_zero_bubble_schedules_delayed_equals_not_delayed():
    results = run_ranks(_tp_pp_rank, PP * TP, timeout_s=240)
    failures: list[str] = []
    compared = 0
    for rank, per_rank in enumerate(results):
        for package in PACKAGES:
            for schedule in SCHEDULES:
                for sp, gather in VARIANTS:
                    key = (package, schedule, sp, gather)
                    where = f"rank {rank} {package} {schedule} sp={sp} {gather}"
                    delayed, plain = per_rank[(*key, True)], per_rank[(*key, False)]
                    if delayed["pending"] or delayed["runners_left"]:
                        failures.append(f"{where}: entries or W steps left after step()")
                    # the W steps ran every entry: 3 layers x 2 stages x each micro-batch
                    if delayed["w_calls"] != 3 * 2 * MICRO_BATCHES:
                        failures.append(f"{where}: {delayed['w_calls']} backward_dw() calls")
                    assert delayed["grads"].keys() == plain["grads"].keys()
                    for name, g in delayed["grads"].items():
                        if not g.abs().sum() > 0:  # a bitwise match of zeros shows nothing
                            failures.append(f"{where} {name}: gradient is zero")
                        _bitwise(failures, f"{where} {name}", g, plain["grads"][name])
                        compared += 1
                    assert len(delayed["losses"]) == len(plain["losses"])
                    for j, (a, b) in enumerate(zip(delayed["losses"], plain["losses"])):
                        _bitwise(failures, f"{where} loss {j}", a, b)
                    if sp and gather == "backward_dw":  # the two modes: the same GEMMs
                        te = per_rank[(package, schedule, True, "backward", True)]
                        for name, g in delayed["grads"].items():
                            _bitwise(failures, f"{where} vs backward {name}", g, te["grads"][name])
    # After the sum, every sequence-parallel gradient is bitwise the same on both TP ranks of a
    # stage (ranks TP * p and TP * p + 1 hold pipeline rank p's stages): per stage the norm
    # weight and bias of LayerNormMLP and LayerNormLinear, fc2_bias, the row Linear's bias.
    for p in range(PP):
        a, b = results[TP * p], results[TP * p + 1]
        for key, got in a.items():
            names = got["summed"]
            if names != b[key]["summed"] or len(names) != (12 if key[2] else 0):
                failures.append(f"pp rank {p} {key}: summed {names} / {b[key]['summed']}")
            for name in names:
                theirs = b[key]["grads"][name]
                _bitwise(failures, f"pp rank {p} {key} {name}", got["grads"][name], theirs)
    assert not failures, "\n".join(failures)
    # 4 ranks x packages x schedules x variants x 2 stages x 12 parameters (LayerNormMLP 6,
    # LayerNormLinear 4, Linear 2)
    assert compared == 4 * len(PACKAGES) * len(SCHEDULES) * len(VARIANTS) * 2 * 12
    # the last stage's ranks hold the losses: one per micro-batch
    assert {len(r[(*k, True)]["losses"]) for r in results for k in _keys()} == {0, MICRO_BATCHES}


def _keys():
    return [(p, s, sp, g) for p in PACKAGES for s in SCHEDULES for sp, g in VARIANTS]
