"""P16 under torch's ``fully_shard`` (FSDP2, SPEC §8) on spawned gloo ranks: GradientReducer's
reduce-scatters of delayed modules, the modules' refusal to run delayed under fully_shard without
it, the order refusal, and FSDP2's ``set_requires_gradient_sync`` agreeing with the reducer.

Each rank function is at module level (the spawned processes import it by name); every run has
a timeout on each collective and on the whole run, so a failing rank fails the test.
"""

from __future__ import annotations

import contextlib
import importlib
import re

import pytest
import torch
from splitgrad.distributed import GradientReducer, _torch_private, run_ranks
from splitgrad.properties.checks.distributed import (
    DistributedReport,
    check_fully_sharded,
    check_pipeline_data_parallel,
)
from splitgrad.properties.checks.distributed.fsdp import check_fsdp_launches

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("lib_name", ["splitgrad.impl", "splitgrad.reference"])
def test_p16_fully_sharded(lib_name):
    """One spawn on 2 ranks, one on 3; 3 micro-batches. On 2 ranks no_sync() and
    num_microbatches (every backward_dw() after the last backward; under no_sync() also each
    right after its own), in fp32 and each FSDP2 mixed precision of FSDP_PRECISIONS (bf16 and
    fp16 reduce_dtype, bf16 parameters reduced in fp32 or fp16, fp32 parameters reduced in bf16,
    forced sum reduction), plus Shard(1) weights (shard_placement_fn): every gradient bitwise
    FSDP2 without delay, within the data-parallel budget of the float64 global batch, in fp32
    compute also bitwise (replica0 + replica1) / 2. On 3 ranks (fp32, forced sum, fp16) each
    element one of the three summation orders of the replicas' mean, for the reducer and for
    FSDP2 alone. Every sharded parameter's post-accumulate-grad hook fires once, with the
    final shard; one reduce-scatter per delayed module, the first before the last
    backward_dw()."""
    report = check_fully_sharded(lib_name, timeout_s=240)
    report.raise_if_failed()
    # 26 cells x 2 ranks + 4 cells x 3 ranks, 18 gradients each, 4+ comparisons per gradient
    assert report.compared > 5000
    assert "reduce_scatter" in report.notes[-1] and "3 ranks" in report.notes[-1]


_MODES = ("no_sync", "count", "no_sync each")
_PLANTED = [
    # (reducer, check options, the cells that must fail, what the first failure says)
    (
        "NoPostDivideReducer",
        {"precisions": ("fp32", "fp32 sum")},
        {f"fully_shard fp32 sum {m}" for m in _MODES},
        r"fp32 sum no_sync rank 0 0\.mlp\.fc1_weight vs FSDP2 without delay: not bitwise",
    ),
    (
        "NoPreDivideReducer",
        {"precisions": ("fp32", "fp16")},
        {f"fully_shard fp16 {m}" for m in _MODES},
        r"fp16 no_sync rank 0 0\.mlp\.fc1_weight vs FSDP2 without delay: not bitwise",
    ),
    (
        "PassesInParamDtypeReducer",
        {"precisions": ("bf16", "bf16/fp32")},
        {f"fully_shard bf16/fp32 {m}" for m in _MODES},
        r"bf16/fp32 no_sync rank 0 0\.mlp\.fc1_weight vs FSDP2 without delay: not bitwise",
    ),
    (
        # 3 micro-batches: the second non-final pass is the one left in the parameter dtype
        "LaterPassesLeftOnGradReducer",
        {"precisions": ("bf16", "bf16/fp32", "fp32/bf16")},
        {f"fully_shard {p} {m}" for p in ("bf16/fp32", "fp32/bf16") for m in _MODES},
        r"bf16/fp32 no_sync rank 0 0\.mlp\.fc1_weight vs FSDP2 without delay: not bitwise",
    ),
    (
        "Shard0AssumedReducer",
        {"precisions": ("fp32",), "placements": ("Shard(0)", "Shard(1)")},
        {"fully_shard fp32 count Shard(1)"},
        r"fp32 count Shard\(1\) rank 0 0\.mlp\.fc1_weight vs FSDP2 without delay: not bitwise",
    ),
    (
        # halving is exact: the 2-rank forced-sum cells cannot tell, the 3-rank ones do
        "DividesBeforeSumReducer",
        {"precisions": ("fp32", "fp32 sum"), "world_sizes": (2, 3)},
        {f"fully_shard fp32 sum {m} on 3 ranks" for m in ("count", "no_sync each")},
        r"fp32 sum count on 3 ranks rank 0 0\.mlp\.fc1_weight vs the means of the 3 replicas "
        r"in each summation order: \d+ of 512 elements match none",
    ),
    (
        "HooksNotRunReducer",
        {"precisions": ("fp32",)},
        {f"fully_shard fp32 {m}" for m in _MODES},
        r"fp32 no_sync rank 0 0\.mlp\.fc1_weight: post-accumulate-grad hook called 0 times in "
        r"the step, 1 under FSDP2 without delay",
    ),
]


@pytest.mark.parametrize("reducer, options, failing, first", _PLANTED, ids=[p[0] for p in _PLANTED])
def test_fully_sharded_cells_catch_a_planted_bug(reducer, options, failing, first):
    """A reducer that drops FSDP2's post-divide (forced sum) or its pre-divide (fp16), sums a
    step's micro-batches in bf16 where FSDP2 sums in its fp32 reduce_dtype, leaves the passes
    after the first non-final one in the parameter dtype, lays out Shard(1) gradients as
    Shard(0), divides before the forced sum, or never runs the sharded parameters'
    post-accumulate-grad hooks: exactly the cells that take that branch fail, in every
    micro-batch mode and on every rank, naming the gradient; the cells next to them that do
    not take it stay right (2 ranks, Shard(0) unless the options say otherwise)."""
    options = {"world_sizes": (2,), "placements": ("Shard(0)",), **options}
    report = check_fully_sharded(
        "splitgrad.impl", reducer=f"fsdp_mutants:{reducer}", timeout_s=240, **options
    )
    assert not report.ok
    cells = {f.split(" rank ")[0] for f in report.failures}
    assert cells == failing
    ranks = {int(f.split(" rank ")[1].split()[0]) for f in report.failures}
    assert ranks == set(range(3 if "on 3 ranks" in first else 2))
    assert re.search(first, report.failures[0]), report.failures[0]
    with pytest.raises(AssertionError, match=r"P16 fully_shard splitgrad\.impl on 2"):
        report.raise_if_failed()


def test_check_fully_sharded_refuses_bad_options():
    for kwargs, message in (
        ({"precisions": ("fp32", "fp8")}, r"unknown precisions \['fp8'\]; expected some of"),
        ({"placements": ("Shard(2)",)}, r"unknown placements \['Shard\(2\)'\]"),
        ({"world_sizes": (1,)}, r"world_sizes must be ints >= 2, got \(1,\)"),
        ({"n_microbatches": 0}, r"n_microbatches must be a positive int, got 0"),
    ):
        with pytest.raises(ValueError, match=message):
            check_fully_sharded("splitgrad.impl", **kwargs)


def test_launch_check_flags_a_late_reduce_scatter():
    """The launch check fails a run whose first reduce-scatter came after the last
    backward_dw() began, one that all-reduced, and one that launched a bucket twice."""
    good = {
        "launches": [
            {"bucket": 0, "time": 1.0, "collective": "reduce_scatter"},
            {"bucket": 1, "time": 3.0, "collective": "reduce_scatter"},
        ],
        "buckets": [["a"], ["b"]],
        "finish": 4.0,
        "dw_starts": [0.5, 2.0],
    }
    report = DistributedReport("meta")
    check_fsdp_launches(report, "good", good)
    assert report.ok, report.failures
    late = dict(good, dw_starts=[0.5, 0.9])
    twice = dict(good, launches=[good["launches"][0], good["launches"][0]])
    allreduce = dict(good, launches=[dict(e, collective="all_reduce") for e in good["launches"]])
    for case, pattern in (
        (late, "before the last backward_dw"),
        (twice, r"launched \[0, 0\]"),
        (allreduce, "expected reduce_scatter"),
    ):
        report = DistributedReport("meta")
        check_fsdp_launches(report, "bad", case)
        assert any(re.search(pattern, f) for f in report.failures), report.failures


# ---- misuse is refused, never silent ---------------------------------------------------------


def _sharded(lib, *, delay=True, fused=False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        lib.Linear(8, 8, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused),
        torch.nn.Linear(8, 8),
    )
    fully_shard(model[0])
    fully_shard(model)
    return model


def _sync_flags(model) -> list[bool]:
    from torch.distributed.fsdp import FSDPModule

    return [
        g.reduce_grads
        for m in model.modules()
        if isinstance(m, FSDPModule)
        for g in _torch_private.fsdp_param_groups(m)[1]
    ]


def _error(fn) -> str:
    try:
        fn()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _misuse_rank(rank: int, world: int) -> dict[str, object]:
    from torch.distributed.fsdp import fully_shard

    lib = importlib.import_module("splitgrad.impl")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    out: dict[str, object] = {}

    model = _sharded(lib)
    out["plain_fsdp2_delayed"] = _error(lambda: model(x))
    model = _sharded(lib, delay=False, fused=True)
    out["plain_fsdp2_fused"] = _error(lambda: model(x))
    out["reducer_fused"] = _error(lambda: GradientReducer(_sharded(lib, delay=False, fused=True)))
    out["reducer_nothing_delayed"] = _error(lambda: GradientReducer(_sharded(lib, delay=False)))

    torch.manual_seed(0)
    first = torch.nn.Sequential(lib.Linear(8, 8, delay_wgrad_compute=True), torch.nn.Linear(8, 8))
    GradientReducer(first)
    fully_shard(first[0])
    fully_shard(first)
    out["reducer_before_fully_shard"] = _error(lambda: first(x))

    # no_sync() turns FSDP2's gradient sync off for its passes and back on after
    model = _sharded(lib)
    reducer = GradientReducer(model)
    with reducer.no_sync():
        out["flags_inside_no_sync"] = _sync_flags(model)
        model(x).sum().backward()
    out["flags_after_no_sync"] = _sync_flags(model)
    model(x).sum().backward()
    model[0].backward_dw()
    model[0].backward_dw()
    out["no_sync_ok"] = _error(reducer.finish)

    def step(reducer, model, syncs, contexts=None):
        for i, sync in enumerate(syncs):
            model.set_requires_gradient_sync(sync)
            ctx = contexts[i] if contexts else contextlib.nullcontext()
            with ctx:
                model(x).sum().backward()
        model.set_requires_gradient_sync(True)
        while model[0].pending_wgrad_count:
            model[0].backward_dw()
        return _error(reducer.finish)

    model = _sharded(lib)
    reducer = GradientReducer(model, num_microbatches=2)
    out["count_agrees"] = step(reducer, model, [False, True])
    model = _sharded(lib)
    reducer = GradientReducer(model, num_microbatches=2)
    out["count_fsdp_syncs_early"] = step(reducer, model, [True, True])
    model = _sharded(lib)
    reducer = GradientReducer(model)
    out["last_pass_fsdp_sync_off"] = step(
        reducer, model, [False], contexts=[contextlib.nullcontext()]
    )

    model = _sharded(lib)
    reducer = GradientReducer(model)
    model(x).sum().backward()  # the delayed entry never runs
    out["backward_dw_skipped"] = _error(reducer.finish)
    model[0].backward_dw()  # leave nothing queued behind
    return out


_MISUSE = {
    "plain_fsdp2_delayed": r"RuntimeError: (FSDP)?Linear with delay_wgrad_compute=True runs under "
    r"torch\.distributed\.fsdp\.fully_shard .*weight, bias.*GradientReducer\(model\) after",
    "plain_fsdp2_fused": r"RuntimeError: .*fuse_wgrad_accumulation=True runs under .*fully_shard",
    "reducer_fused": r"ValueError: 0\.weight: fuse_wgrad_accumulation=True under fully_shard",
    "reducer_nothing_delayed": r"ValueError: nothing for GradientReducer to reduce",
    "reducer_before_fully_shard": r"RuntimeError: fully_shard was applied after GradientReducer",
    "no_sync_ok": r"^no error$",
    "count_agrees": r"^no error$",
    "count_fsdp_syncs_early": r"FSDP2 reduce-scattered its gradients in backward pass 1, which "
    r"the reducer was told is not the step's last",
    "last_pass_fsdp_sync_off": r"gradient sync is off .* step's last.*FSDP2 left the gradients "
    r"of \['1\.weight', '1\.bias'\] unreduced",
    "backward_dw_skipped": r"never produced in this step.*0\.weight",
}


def test_misuse_under_fully_shard_raises():
    """Plain FSDP2 with a delayed (or fused) module raises in the forward; the reducer refuses
    fused modules, a model with nothing delayed, and fully_shard applied after it; FSDP2's
    set_requires_gradient_sync follows reducer.no_sync(), and finish() names a disagreement
    either way and a gradient never produced."""
    for per_rank in run_ranks(_misuse_rank, 2, timeout_s=120, collective_timeout_s=20):
        wrong = {
            case: per_rank[case]
            for case, pattern in _MISUSE.items()
            if not re.search(pattern, per_rank[case], re.S)
        }
        assert not wrong, wrong
        assert per_rank["flags_inside_no_sync"] == [False, False]
        assert per_rank["flags_after_no_sync"] == [True, True]


def test_p16_fully_sharded_under_a_zero_bubble_pipeline():
    """4 ranks: 2 pipeline stages (ScheduleZBVZeroBubble with dw_builder) x 2 replicas, each
    stage module fully_shard-ed over its replicas. The PipelineStage turns FSDP2's sync and
    reshard off during B/W and calls its post-backward at REDUCE_GRAD; the reducer reduce-scatters
    each delayed module after its last W step, and the stage's gradient scaling finishes it
    before dividing. Losses and gradients bitwise (replica0 + replica1) / 2 without delay."""
    report = check_pipeline_data_parallel("splitgrad.impl", fully_shard=True, timeout_s=240)
    report.raise_if_failed()
    assert report.compared > 100
