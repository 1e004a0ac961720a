"""The distributed checks have teeth: each catches a package whose single-process behaviour
looks fine to P15/P16's pipeline and reducer only until ranks are involved."""

from __future__ import annotations

import pytest
from splitgrad.distributed import conformance

pytestmark = pytest.mark.distributed


def test_p16_catches_module_hooks_that_never_fire():
    report = conformance.check_data_parallel("distributed_mutants:hooks_silent")
    assert not report.ok
    assert any("never produced" in f for f in report.failures), report.failures[:3]


def test_p15_catches_a_module_that_hides_its_delay():
    report = conformance.check_pipeline(
        "distributed_mutants:lying_need_backward_dw",
        schedules=("ScheduleZBVZeroBubble",),
        fused=(False,),
    )
    assert not report.ok
    assert any("entries pending" in f for f in report.failures), report.failures[:3]


def test_p15_catches_lifo_entries_under_fused_first_microbatch():
    """LIFO order is invisible to plain accumulation's sums up to rounding, but with fused
    accumulation the first micro-batch's overwrite lands on the wrong entry."""
    report = conformance.check_pipeline(
        "distributed_mutants:lifo",
        schedules=("ScheduleGPipe", "ScheduleZBVZeroBubble"),
        fused=(True,),
    )
    assert not report.ok


def test_cli_fails_on_a_planted_bug(capsys):
    from splitgrad.distributed.cli import main

    assert main(["--backend", "distributed_mutants:hooks_silent", "--check", "p16"]) == 1
    out = capsys.readouterr().out
    assert "p16" in out and "FAIL" in out and "never produced" in out


def test_cli_runs_an_outside_package_from_a_directory(tmp_path, capsys):
    """A package known only by its directory (path:DIR), re-exporting the reference under
    another name, passes P14; unknown checks are refused with exit status 2."""
    from splitgrad.distributed.cli import main

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
        (["--check", "p15", "--schedules", "ScheduleFoo"], "unknown schedules ['ScheduleFoo']"),
        (["--check", "p15", "--recipes", "fp4"], "unknown recipes ['fp4']"),
    ],
)
def test_cli_refuses_bad_options_naming_them(argv, needle, capsys):
    from splitgrad.distributed.cli import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err
