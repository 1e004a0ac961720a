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
