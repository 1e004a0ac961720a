"""The distributed checks have teeth: each catches a package whose single-process behaviour
looks fine to P15/P16's pipeline and reducer only until ranks are involved."""

from __future__ import annotations

import pytest
from splitgrad.properties.checks import distributed as checks
from splitgrad.properties.checks.distributed.expert_parallel import overlap_failure

pytestmark = pytest.mark.distributed


def test_p16_catches_module_hooks_that_never_fire():
    report = checks.check_data_parallel("distributed_mutants:hooks_silent")
    assert not report.ok
    assert any("never produced" in f for f in report.failures), report.failures[:3]


def test_p15_catches_a_module_that_hides_its_delay():
    report = checks.check_pipeline(
        "distributed_mutants:lying_need_backward_dw",
        schedules=("ScheduleZBVZeroBubble",),
        fused=(False,),
    )
    assert not report.ok
    assert any("entries pending" in f for f in report.failures), report.failures[:3]


def test_p15_catches_lifo_entries_under_fused_first_microbatch():
    """LIFO order is invisible to plain accumulation's sums up to rounding, but with fused
    accumulation the first micro-batch's overwrite lands on the wrong entry."""
    report = checks.check_pipeline(
        "distributed_mutants:lifo",
        schedules=("ScheduleGPipe", "ScheduleZBVZeroBubble"),
        fused=(True,),
    )
    assert not report.ok


def test_p16_catches_a_reducer_final_after_the_first_entry_of_the_last_pass():
    """Each Block applies proj twice: the step's last pass queues two proj entries, and a
    reducer that launches after the first of them reduces a partial gradient (fused) or sees
    the second written after its reduction started; mlp (one entry per pass) stays right."""
    report = checks.check_data_parallel(
        "splitgrad.impl", reducer="distributed_mutants:FirstEntryFinalReducer"
    )
    assert not report.ok
    assert all("proj" in f and "mlp" not in f for f in report.failures), report.failures[:3]
    assert any(
        f.startswith("plain") and "proj.weight, 0.proj.bias: backward_dw() wrote it again" in f
        for f in report.failures
    ), report.failures[:3]
    assert any(
        f.startswith("fused") and "0.proj.weight vs (replica0 + replica1) / 2 without delay" in f
        for f in report.failures
    )
    assert any("1.proj.bias vs the float64 truth: max error" in f for f in report.failures)


def test_p16_catches_a_reducer_that_follows_a_tied_weight_through_one_module():
    """A weight tied between two delayed modules (``out`` shares ``proj``'s) is final only
    after both have run their last entry: a reducer following one of them launches after the
    first module's and sees the other write into the gradient in flight; untied cells stay
    right."""
    report = checks.check_data_parallel(
        "splitgrad.impl", reducer="distributed_mutants:OneOwnerReducer"
    )
    assert not report.ok
    assert all(" tied " in f and "proj.weight" in f for f in report.failures), report.failures[:3]
    assert any(
        "proj.weight: changed while its reduction was in flight" in f for f in report.failures
    )


def test_cli_fails_on_a_planted_bug(capsys):
    from splitgrad.cli.distributed import main

    assert main(["--backend", "distributed_mutants:hooks_silent", "--check", "p16"]) == 1
    out = capsys.readouterr().out
    assert "p16" in out and "FAIL" in out and "never produced" in out


def test_cli_runs_an_outside_package_from_a_directory(tmp_path, capsys):
    """A package known only by its directory (path:DIR), re-exporting the reference under
    another name, passes P14; unknown checks are refused with exit status 2."""
    from splitgrad.cli.distributed import main

    pkg = tmp_path / "other_split_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from splitgrad.reference import *  # noqa: F403\n")
    assert main(["--backend", f"path:{pkg}", "--check", "p14"]) == 0
    assert "p14     pass" in capsys.readouterr().out
    assert main(["--check", "p99"]) == 2


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--world-size", "3"], "--world-size 3 sets p15's pipeline ranks only"),
        (["--check", "p15", "--world-size", "0"], "--world-size must be >= 1, got 0"),
        (["--check", "p15", "--schedule", "ScheduleFoo"], "unknown schedule 'ScheduleFoo'"),
        (["--check", "p15", "--recipe", "fp4"], "unknown recipe 'fp4'"),
        (["--check", "p15", "--reducer", "a:B"], "--reducer a:B applies to p16 only"),
        (
            ["--check", "p16", "--reducer", "distributed_mutants:Nope"],
            "--reducer distributed_mutants:Nope: cannot load it (AttributeError",
        ),
    ],
)
def test_cli_refuses_bad_options_naming_them(argv, needle, capsys):
    from splitgrad.cli.distributed import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_p14_catches_a_dispatch_backward_that_waits_before_backward_dw():
    """The layer's own timeline still claims the overlap; the harness's trace of the
    all-to-all's launch and wait() shows backward_dw() ran after the wait."""
    report = checks.check_expert_parallel("splitgrad.impl", moe="distributed_mutants:WaitsFirstMoE")
    assert not report.ok
    assert len(report.failures) == 2, report.failures  # one per rank, gradients all right
    for f in report.failures:
        assert "did not run while the dispatch all-to-all" in f and "in flight" in f, f
        assert f.index("wait() called") < f.index("experts backward_dw start"), f


_B0, _B1 = ("backward() called", None), ("backward() returned", None)
_DW = [("experts backward_dw start", None), ("experts backward_dw end", None)]


@pytest.mark.parametrize(
    "trace, needle",
    [
        ([_B0, _B1], "ran 0 times"),
        ([("launched", 0), _B0, *_DW, _B1], "issued no all_to_all_single"),
        ([_B0, ("ran synchronously", 0), *_DW, _B1], "ran synchronously"),
        ([_B0, ("launched", 0), *_DW, _B1], "never waited on"),
        ([_B0, ("launched", 0), ("wait() called", 0), *_DW, _B1], "was in flight"),
        ([_B0, ("launched", 0), ("seen completed", 0), *_DW, _B1], "was in flight"),
        ([_B0, ("launched", 0), *_DW, ("launched", 1), ("wait() called", 1), _B1], "in flight"),
        ([_B0, ("launched", 0), *_DW, ("wait() called", 0), _B1], None),
    ],
)
def test_p14_overlap_reading_on_hand_made_traces(trace, needle):
    """A synchronous, never waited, absent or already completed dispatch all-to-all fails,
    naming it (the dispatch being the backward's last all-to-all); backward_dw() between its
    launch and its wait() passes."""
    why = overlap_failure(trace)
    assert why is None if needle is None else needle in why, why
