"""P14-P16 judge an outside package on its merits (SPEC §7, §8): ``outside_distributed.correct``
is written apart from splitgrad.impl (its Function takes detached copies of the delayed
parameters, so autograd never reaches them, as TransformerEngine returns no gradient for a
delayed weight) and passes every distributed check; the same package with one planted bug in
its weight-gradient writes fails them, and an expert-parallel layer whose experts'
``backward_dw()`` runs after the dispatch all-to-all's wait fails P14.

The planted bugs are invisible to a check that compares the package only with itself: the
baseline runs the package without delay (bitwise) and everything is also judged against
``splitgrad.reference``'s float64 truth."""

from __future__ import annotations

import pytest
from splitgrad.properties.checks import distributed as checks

pytestmark = pytest.mark.distributed

CORRECT = "outside_distributed:correct"
OVERWRITES = "outside_distributed:overwrites_grad"
DROPS_BIAS = "outside_distributed:drops_bias"
IGNORES_FIRST = "outside_distributed:ignores_first_microbatch"


def test_p14_passes_the_outside_package():
    report = checks.check_expert_parallel(CORRECT)
    report.raise_if_failed()
    assert report.compared > 0


def test_p14_fails_backward_dw_moved_after_the_all_to_all_wait():
    report = checks.check_expert_parallel(
        "splitgrad.impl", moe="distributed_mutants:LateBackwardDwMoE"
    )
    assert not report.ok
    assert all("in flight" in f for f in report.failures), report.failures
    assert "experts backward_dw start" in report.failures[0]


def test_p16_passes_the_outside_package_no_sync_and_num_microbatches():
    """The reducer learns the delayed gradients' passes from the modules' forwards,
    ``pending_wgrad_count`` and hooks: no_sync() and num_microbatches both reduce them."""
    report = checks.check_data_parallel(CORRECT)
    report.raise_if_failed()
    assert report.compared > 0


def test_p15_and_p16_pp_pass_the_outside_package():
    report = checks.check_pipeline(
        CORRECT, schedules=("Schedule1F1B", "ScheduleZBVZeroBubble"), fused=(False, True)
    )
    report.raise_if_failed()
    report = checks.check_pipeline_data_parallel(CORRECT)
    report.raise_if_failed()


def test_p15_fails_backward_dw_that_overwrites_grad():
    report = checks.check_pipeline(OVERWRITES, schedules=("ScheduleZBVZeroBubble",), fused=(False,))
    assert not report.ok
    assert any("without delay: not bitwise" in f for f in report.failures), report.failures[:3]
    assert any("vs the float64 truth: max error" in f for f in report.failures)


def test_p15_fails_a_dropped_delayed_bias():
    report = checks.check_pipeline(DROPS_BIAS, schedules=("ScheduleZBVZeroBubble",), fused=(False,))
    assert not report.ok
    assert any("mlp.fc1_bias" in f and "None (no gradient)" in f for f in report.failures)


def test_p16_fails_both_planted_bugs_naming_the_parameter():
    report = checks.check_data_parallel(OVERWRITES)
    assert not report.ok
    assert any("0.mlp.fc1_weight vs (replica0" in f for f in report.failures)
    report = checks.check_data_parallel(DROPS_BIAS)
    assert not report.ok, "a dropped bias must fail, not crash the harness"
    assert any(
        "finish() raised" in f and "bias: final but no gradient was written" in f
        for f in report.failures
    ), report.failures[:3]


def test_p16_fails_a_package_that_ignores_is_first_microbatch():
    """Fused, main_grad starts random and the first micro-batch passes
    is_first_microbatch=True: a package that adds instead of overwriting keeps the prefill, in
    every fused GEMM weight and in no plain cell."""
    report = checks.check_data_parallel(IGNORES_FIRST)
    assert not report.ok
    assert all(f.startswith("fused") for f in report.failures), report.failures[:3]
    for name in ("0.mlp.fc1_weight", "0.mlp.fc2_weight", "1.proj.weight"):
        assert any(
            f"{name} vs (replica0 + replica1) / 2 without delay: not bitwise" in f
            for f in report.failures
        ), name
        assert any(f"{name} vs the float64 truth: max error" in f for f in report.failures)


def test_p16_pp_fails_a_dropped_delayed_bias():
    report = checks.check_pipeline_data_parallel(DROPS_BIAS, fused=(False,))
    assert not report.ok
    assert any("bias" in f for f in report.failures)


def test_cli_passes_the_outside_package_and_fails_a_planted_bug(capsys):
    from splitgrad.cli.distributed import main

    assert main(["--backend", CORRECT, "--check", "p16"]) == 0
    assert "p16     pass" in capsys.readouterr().out
    assert main(["--backend", DROPS_BIAS, "--check", "p16"]) == 1
    out = capsys.readouterr().out
    assert "p16     FAIL" in out and "ERROR" not in out
