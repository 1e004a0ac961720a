"""P19 (SPEC §7, §9): tensor and sequence parallel modules on spawned gloo ranks. The reference
and impl pass the ``ci`` matrix on 2 and 4 ranks; each planted TP bug is caught, by the
property it breaks, on the narrowed matrix that takes its branch (``tests/test_mutants.py``'s
slow test runs the whole ``ci`` matrix on each through ``ci/mutants.py``); a package that has
no TP is "not supported", never a pass or a failure; the matrix enumerates what it promises."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from splitgrad.properties import budgets as B
from splitgrad.properties.checks.distributed import check_tensor_parallel, tp_support
from splitgrad.properties.checks.distributed.tensor_parallel import (
    TP_KINDS,
    TPCase,
    gather_modes,
    shard_param,
    tp_cases,
)

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parent.parent


def _mutants():
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    return mutants


@pytest.mark.parametrize("lib_name", ["splitgrad.reference", "splitgrad.impl"])
def test_p19_passes_on_2_and_4_ranks(lib_name):
    report = check_tensor_parallel(lib_name)
    report.raise_if_failed()
    assert report.not_supported is None
    assert report.compared > 10_000


#: Each planted bug (ci/mutants.py TP_MUTANTS): the module kind whose branch it is on, and what
#: P19 says about it (the property that catches it).
_CATCHES = {
    # (2) the input gradient against the float64 truth
    "tp-dgrad-unscattered": ("Linear-column", "inp.grad[micro-batch 0]: worst error"),
    # (3) the §9 attributes
    "tp-sp-bias-unmarked": (
        "Linear-row",
        "bias: attributes tensor_model_parallel=False, partition_dim=None, "
        "sequence_parallel=False; §9 gives False, None, True",
    ),
    # (2) the output against the float64 truth
    "tp-gather-wrong-dim": ("Linear-column", "output[micro-batch 0]: worst error"),
    # (4) a collective inside backward_dw() in the default mode
    "tp-default-gathers-in-w": (
        "LayerNormMLP",
        "wgrad_gather=backward: collectives inside backward_dw() in the default mode",
    ),
    # (1) delayed against non-delayed, bitwise
    "tp-entry-buffer-reused": ("Linear-column", "weight delayed vs not: not bitwise equal"),
}


def test_every_tp_mutant_has_a_catching_test():
    assert sorted(m.name for m in _mutants().TP_MUTANTS) == sorted(_CATCHES)


@pytest.mark.parametrize("name", sorted(_CATCHES))
def test_p19_catches_a_planted_tp_bug(name, tmp_path):
    mutants = _mutants()
    (mutant,) = [m for m in mutants.TP_MUTANTS if m.name == name]
    dest = tmp_path / name.replace("-", "_")
    assert mutants.apply(mutant, dest) is None
    kind, needle = _CATCHES[name]
    report = check_tensor_parallel(
        f"path:{dest}",
        world_sizes=(2,),
        kinds=(kind,),
        dtypes=("float32",),
        recipes=(None,),
        sp=(True,),
    )
    assert not report.ok
    assert any(needle in f for f in report.failures), report.failures[:5]


def test_p19_catches_the_default_mode_holding_only_the_shard(tmp_path):
    """(5): an entry of the default mode that keeps the shard (and gathers in W) holds less
    than the gathered operand, and no more than the 'backward_dw' mode's."""
    mutants = _mutants()
    (mutant,) = [m for m in mutants.TP_MUTANTS if m.name == "tp-default-gathers-in-w"]
    dest = tmp_path / "lazy"
    assert mutants.apply(mutant, dest) is None
    report = check_tensor_parallel(
        f"path:{dest}",
        world_sizes=(2,),
        kinds=("Linear-row",),
        dtypes=("float32",),
        recipes=(None,),
        sp=(True,),
    )
    assert any("less than the gathered operand(s) it must hold" in f for f in report.failures)
    assert any("the entry keeping only the shard" in f for f in report.failures)


def test_p19_catches_a_forgotten_sequence_parallel_norm_sum():
    """(3) and (2): the norms' partial sums left unreduced differ across ranks and from the
    truth (the naive run is reduced by splitgrad's own sum); nothing else fails."""
    report = check_tensor_parallel(
        "splitgrad.reference",
        world_sizes=(2,),
        kinds=("LayerNormLinear-column",),
        dtypes=("float32",),
        recipes=(None,),
        sp=(True,),
        sp_reduce="distributed_mutants:sp_sum_forgets_norms",
    )
    assert not report.ok
    assert any(
        "layer_norm_weight rank 1 vs rank 0 after the SP reduction: not bitwise" in f
        for f in report.failures
    )
    assert any("layer_norm_weight.grad: worst error" in f for f in report.failures)
    assert all("layer_norm_" in f for f in report.failures), report.failures[:5]


def test_a_package_without_tp_is_not_supported():
    """torch-split (no package of modules) and a package whose modules take no TP options are
    reported "not supported", with nothing compared and nothing failed."""
    for name in ("torch-split", "outside_distributed:correct"):
        report = check_tensor_parallel(name)
        assert report.not_supported and report.ok and report.compared == 0, name
    assert "no package of modules" in tp_support("torch-split")
    assert "takes no tp_group" in tp_support("outside_distributed:correct")
    assert tp_support("splitgrad.impl") is None


def test_cli_p19_not_supported_and_refusals(capsys):
    from splitgrad.cli.distributed import main

    assert main(["--check", "p19", "--backend", "torch-split"]) == 0
    out = capsys.readouterr().out
    assert "p19     n/a" in out and "not supported" in out
    # a package that cannot be loaded is still an error, not "not supported"
    assert main(["--check", "p19", "--backend", "module:no_such_package_p19"]) == 2
    assert "cannot load it" in capsys.readouterr().err
    assert main(["--check", "p19", "--world-size", "3"]) == 2
    assert "p19: 2 and 4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--check", "p19", "--profile", "weekly"])


def test_verify_points_p19_at_splitgrad_distributed(capsys):
    from splitgrad.properties.front.verify import main

    assert main(["--property", "P19"]) == 2
    assert "P19 runs on spawned ranks: splitgrad distributed --check p19" in capsys.readouterr().err


# ---- the matrix and the budget ----------------------------------------------------------------
def test_ci_matrix_enumerates_every_module_sp_fused_bias_dtype_and_recipe():
    for world in (2, 4):
        cases = tp_cases(world)
        hp = {(c.kind, c.sp, c.fused, c.bias, c.dtype) for c in cases if c.recipe is None}
        assert len(hp) == len(TP_KINDS) * 2 * 2 * 2 * 3
        fp8 = {(c.kind, c.sp, c.recipe) for c in cases if c.recipe is not None}
        recipes = {"delayed", "current", "mxfp8"} | ({"block"} if world == 2 else set())
        assert fp8 == {(k, s, r) for k in TP_KINDS for s in (False, True) for r in recipes}
        # LayerNormMLP gated and not, norms LayerNorm and RMSNorm
        mlp = {c.activation for c in cases if c.kind == "LayerNormMLP"}
        norms = {c.normalization for c in cases if c.kind != "Linear-column"}
        assert mlp == {"gelu", "swiglu"} and norms == {"LayerNorm", "RMSNorm"}
    nightly = tp_cases(4, "nightly")
    assert {c.recipe for c in nightly} >= {"block"} and {c.seed for c in nightly} == {0, 1}
    with pytest.raises(ValueError, match="unknown profile 'weekly'"):
        tp_cases(2, "weekly")


@pytest.mark.parametrize("world", [2, 4])
def test_sizes_shard_evenly_and_align_with_the_recipe_blocks(world):
    """Every per-rank GEMM dimension a multiple of the recipe's block, every SP shard of the
    tokens whole; the high-precision matrix's second micro-batch is one row per rank."""
    for c in tp_cases(world, "nightly"):
        k, n, tokens = c.sizes()
        block = {"mxfp8": 32, "block": 128}.get(c.recipe, 1)
        per_rank = [k, n // world, *(t // world if c.sp else t for t in tokens)]
        assert n % world == 0 and k % world == 0 and all(t % world == 0 for t in tokens)
        assert all(d % block == 0 for d in per_rank), (c.label, per_rank)
        if c.recipe in (None, "delayed", "current"):
            assert tokens[-1] == world


def test_gated_fc1_shards_gate_and_up_rows():
    """§9: a rank's gated fc1 rows are [gate rows r; up rows r]."""
    case = TPCase("LayerNormMLP", True, False, True, "float32", None, 2, activation="swiglu")
    full = torch.arange(8.0).repeat_interleave(3).reshape(8, 3)  # rows 0..3 gate, 4..7 up
    assert shard_param(case, "fc1_weight", full, 1, 2)[:, 0].tolist() == [2.0, 3.0, 6.0, 7.0]
    assert shard_param(case, "fc1_bias", full[:, 0], 0, 2).tolist() == [0.0, 1.0, 4.0, 5.0]


def test_both_gather_modes_under_sp_only():
    import splitgrad.reference as ref

    sp = TPCase("Linear-row", True, False, True, "float32", None, 2)
    assert gather_modes(ref, sp) == ("backward", "backward_dw")
    no_sp = TPCase("Linear-row", False, False, True, "float32", None, 2)
    assert gather_modes(ref, no_sp) == ("backward",)


def test_float64_budget_passes_at_its_floor_and_fails_past_it():
    """A budget that can never fail is a defect (tests/test_budgets_meta.py)."""
    truth = torch.linspace(-2.0, 3.0, 64, dtype=torch.float64)
    step = B.TENSOR_PARALLEL_FLOAT64.floor_steps * B.rounding_step(torch.float64, 3.0)
    ok = truth.clone()
    ok[5] += 0.99 * step
    assert B.check_error_budget("t", ok, truth, truth, B.TENSOR_PARALLEL_FLOAT64) <= 1.0
    bad = truth.clone()
    bad[5] += 1.05 * step
    with pytest.raises(B.BudgetViolation, match="tensor_parallel_float64 budget"):
        B.check_error_budget("t", bad, truth, truth, B.TENSOR_PARALLEL_FLOAT64)
    assert step < 1e-11  # far below a missing 1/tp share of a partial sum


@pytest.mark.slow
def test_p19_nightly_matrix_passes_on_impl():
    report = check_tensor_parallel("splitgrad.impl", profile="nightly", timeout_s=3000)
    report.raise_if_failed()
