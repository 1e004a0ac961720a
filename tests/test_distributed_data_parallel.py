"""P16 (SPEC §8): ``splitgrad.distributed.GradientReducer`` on spawned gloo ranks — alone and
under a zero-bubble pipeline (2 stages x 2 replicas; next to the expert-parallel layer in
test_distributed_expert_parallel.py) — and what torch's ``DistributedDataParallel`` does with
split-backward modules.

Each rank function is at module level (the spawned processes import it by name) and returns
what the parent asserts on; a failing or stuck rank fails the test with its traceback.
"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from splitgrad.distributed import GradientReducer, RankFailure, run_ranks
from splitgrad.properties.checks.distributed import (
    check_data_parallel,
    check_pipeline_data_parallel,
)

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("lib_name", ["splitgrad.impl", "splitgrad.reference"])
def test_p16_alone(lib_name):
    """2 replicas: fused/plain x no_sync()/num_microbatches x untied/tied, 3 optimizer steps
    on one reducer; 3 replicas: fp32, num_microbatches, 2 steps. In every step bitwise
    (replica0 + replica1) / 2 (on 3, one of the summation orders), within the data-parallel budget
    of the float64 global batch, every launch before finish() and logged under that step, and
    the first block's reductions before the second block's last backward_dw()."""
    dtypes = (torch.float32, torch.bfloat16) if lib_name == "splitgrad.impl" else (torch.float32,)
    report = check_data_parallel(lib_name, dtypes=dtypes)
    report.raise_if_failed()
    assert report.compared > 0


def test_p16_catches_tied_finality_kept_across_steps():
    """A reducer whose end-of-step reset keeps the count of a tied weight's modules that ran
    their last entry (``>=`` in the finality test) is right in step 1 and, from step 2 on,
    launches the shared weight after the first module's last entry: only tied cells fail, only
    in later steps, naming proj.weight."""
    report = check_data_parallel(
        "splitgrad.impl", reducer="distributed_mutants:TiedCountKeptReducer", timeout_s=240
    )
    assert not report.ok
    assert all(" tied " in f for f in report.failures), report.failures[:3]
    assert {f.split(" step ")[1].split()[0].rstrip(":") for f in report.failures} == {"2", "3"}
    assert any(
        "proj.weight: backward_dw() wrote it again after its reduction had started" in f
        for f in report.failures
    ), report.failures[:3]
    assert any(
        "step 2 0.proj.weight vs (replica0 + replica1) / 2 without delay: not bitwise" in f
        for f in report.failures
    )


def test_p16_catches_a_division_before_the_all_reduce_on_3_replicas():
    """Dividing each bucket by the world size before the SUM instead of after: exact on 2
    replicas (every 2-replica cell stays right), rounded on 3, where elements match none of the
    three summation orders of the replicas' mean."""
    report = check_data_parallel(
        "splitgrad.impl", reducer="distributed_mutants:DividesBeforeAllReduceReducer", timeout_s=240
    )
    assert not report.ok
    assert all(" on 3 replicas rank " in f for f in report.failures), report.failures[:3]
    assert any(
        re.search(
            r"0\.mlp\.fc1_weight vs the means of the 3 replicas in each summation order: "
            r"\d+ of 512 elements match none",
            f,
        )
        for f in report.failures
    ), report.failures[:3]


def test_p16_alone_refuses_bad_options():
    with pytest.raises(ValueError, match="steps must be a positive int, got 0"):
        check_data_parallel("splitgrad.impl", steps=0)
    with pytest.raises(ValueError, match=r"world_sizes must be some of \(2, 3\), got \(4,\)"):
        check_data_parallel("splitgrad.impl", world_sizes=(4,))


def test_p16_with_a_zero_bubble_pipeline():
    """4 ranks: 2 pipeline stages x 2 replicas, ScheduleZBVZeroBubble, plain and fused; the
    schedule's gradient scaling finishes each stage's reducer first, then scales .grad and
    main_grad."""
    report = check_pipeline_data_parallel("splitgrad.impl")
    report.raise_if_failed()


# ---- misuse is reported, never silent --------------------------------------------------------


def _model(lib, delay=True, fused=False):
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        lib.Linear(8, 8, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused),
        torch.nn.Linear(8, 8),
    )
    if fused:
        m[0].weight.main_grad = torch.zeros(8, 8)
    return m


_MISUSE = {
    "no_sync_forgotten": "produced it again after its reduction had started",
    "backward_dw_skipped": r"never produced.*0\.weight",
    "changed_in_flight": r"1\.weight: changed while its reduction was in flight",
    "finish_without_step": r"finish\(\) without a step: .*0\.weight.*since it was built",
    "finish_twice": r"finish\(\) without a step: .*since step 1 was finished",
}


def _misuse_rank(rank: int, world: int) -> dict[str, str]:
    lib = importlib.import_module("splitgrad.impl")
    out = {}
    for case in _MISUSE:
        model = _model(lib)
        reducer = GradientReducer(model)
        x = torch.randn(4, 8) * (rank + 1)
        if case == "no_sync_forgotten":
            # two backward passes both treated as a step's last: the second writes the
            # gradients again after their reduction started
            model(x).sum().backward()
            model[0].backward_dw()
            model(x).sum().backward()
            model[0].backward_dw()
        elif case == "backward_dw_skipped":
            model(x).sum().backward()  # the delayed weight's entry never runs
        elif case == "changed_in_flight":
            model(x).sum().backward()
            model[0].backward_dw()
            model[1].weight.grad.mul_(2)  # e.g. gradient clipping before finish()
        elif case == "finish_twice":
            model(x).sum().backward()
            model[0].backward_dw()
            reducer.finish()
        try:
            reducer.finish()
            out[case] = "no error"
        except RuntimeError as exc:
            out[case] = str(exc)
    return out


def test_finish_reports_misuse():
    import re

    for per_rank in run_ranks(_misuse_rank, 2, timeout_s=120, collective_timeout_s=20):
        for case, message in _MISUSE.items():
            assert re.search(message, per_rank[case]), (case, per_rank[case])


_DDP_CASES = [(True, False), (False, True), (True, True), (False, False)]


def _ddp_rank(rank: int, world: int) -> list[dict]:
    lib = importlib.import_module("splitgrad.impl")
    out = []
    for delay, fused in _DDP_CASES:
        model = _model(lib, delay=delay, fused=fused)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        try:
            y = ddp(x)
        except RuntimeError as exc:
            out.append({"error": str(exc)})
            del ddp
            continue
        y.sum().backward()
        g = model[0].weight.grad.clone()
        gathered = [torch.empty_like(g) for _ in range(world)]
        torch.distributed.all_gather(gathered, g)
        del ddp  # before the process group goes
        out.append({"error": None, "grads": gathered})
    return out


def test_ddp_refuses_what_it_cannot_reduce_and_works_otherwise():
    """Delayed or fused: RuntimeError pointing to GradientReducer. Plain and non-delayed: the
    module writes .grad before autograd's AccumulateGrad runs, so DDP's hook reduces it and both
    replicas end with the same weight gradient."""
    for per_rank in run_ranks(_ddp_rank, 2, timeout_s=120, collective_timeout_s=20):
        for (delay, fused), res in zip(_DDP_CASES, per_rank):
            if delay or fused:
                assert res["error"] is not None, (delay, fused)
                assert "GradientReducer" in res["error"] and "weight" in res["error"]
            else:
                assert res["error"] is None, res["error"]
                torch.testing.assert_close(res["grads"][0], res["grads"][1], rtol=0, atol=0)


# ---- the launcher fails instead of hanging -----------------------------------------------


def _one_rank_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 gives up")
    torch.distributed.barrier()  # rank 0 would wait forever without the timeouts


def test_a_failing_rank_fails_the_run_with_its_traceback():
    with pytest.raises(RankFailure, match="rank 1 gives up"):
        run_ranks(_one_rank_fails, 2, timeout_s=60, collective_timeout_s=10)


def _rank_sleeps(rank: int, world: int) -> None:
    import time

    time.sleep(60 if rank == 0 else 0)


def _returns_a_lambda(rank: int, world: int):
    return lambda: rank


def test_an_unpicklable_result_is_reported_not_lost():
    with pytest.raises(RankFailure, match="cannot be pickled back"):
        run_ranks(_returns_a_lambda, 2, timeout_s=60, collective_timeout_s=10)


def test_a_stuck_rank_is_killed_at_the_deadline():
    with pytest.raises(RankFailure, match="timed out"):
        run_ranks(_rank_sleeps, 2, timeout_s=8, collective_timeout_s=5)


# ---- constructor checks (one process, a world of one) -------------------------------------


def _reducer_error(exc_type: type[Exception], model, **kwargs) -> str:
    """The message of the ``exc_type`` that ``GradientReducer(model, **kwargs)`` raises, or
    ``"no error"``."""
    try:
        GradientReducer(model, **kwargs)
    except exc_type as exc:
        return str(exc)
    return "no error"


def _constructor_errors(rank: int, world: int) -> list[str]:
    lib = importlib.import_module("splitgrad.impl")
    model = _model(lib)
    out = []
    for kwargs in ({"num_microbatches": 0}, {"bucket_cap_mb": 0}, {"ignore": ["nope"]}):
        out.append(_reducer_error(ValueError, model, **kwargs))
    GradientReducer(model)
    out.append(_reducer_error(RuntimeError, model))
    frozen = _model(lib)
    for p in frozen.parameters():
        p.requires_grad_(False)
    out.append(_reducer_error(ValueError, frozen))
    split = _model(lib)
    split[1].to("meta")  # parameters on two devices
    out.append(_reducer_error(ValueError, split))
    return out


def test_reducer_constructor_checks():
    (errors,) = run_ranks(_constructor_errors, 1, timeout_s=60)
    assert "num_microbatches must be a positive int, got 0" in errors[0]
    assert "bucket_cap_mb must be positive, got 0" in errors[1]
    assert "['nope']" in errors[2]
    assert "already has a GradientReducer" in errors[3]
    assert "no trainable parameter" in errors[4]
    assert "got 2: cpu (e.g. 0.weight), meta (e.g. 1.weight)" in errors[5], errors[5]
