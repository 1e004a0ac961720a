"""The two-process cell runner of ``splitgrad verify`` (front/workers.py): every cell once,
results in plan order, cells that draw the same cases on one side, P9 in the main process."""

from __future__ import annotations

import os

import pytest
from splitgrad.properties.front import workers
from splitgrad.properties.front.plan import PlannedCell

pytestmark = pytest.mark.skipif(workers.default_jobs() < 2, reason="needs fork and two cores")


def _plan() -> list[PlannedCell]:
    return [
        PlannedCell(pid, kind, dtype, "none", (None,), 10)
        for pid in ("P1", "P2", "P3", "P9")
        for kind in ("Linear", "LayerNormMLP")
        for dtype in ("float32", "bfloat16")
    ]


def _where(cell: PlannedCell) -> tuple[str, int]:
    return cell.test_id, os.getpid()


def test_every_cell_once_in_plan_order_on_two_processes() -> None:
    plan = _plan()
    got = list(workers.run_cells(_where, plan, 2))
    assert [i for i, _ in got] == list(range(len(plan)))
    assert [r[0] for _, r in got] == [c.test_id for c in plan]
    pids = {c.test_id: r[1] for c, (_, r) in zip(plan, got)}
    assert len(set(pids.values())) == 2
    # P9's subprocess lives in this process; a group's cells share one process (and its memo).
    assert all(pids[c.test_id] == os.getpid() for c in plan if c.property_id == "P9")
    for c in plan:
        if c.property_id != "P9":
            twin = PlannedCell("P1", c.kind, c.dtype, "none", (None,), 10)
            assert pids[c.test_id] == pids[twin.test_id]


def test_one_job_runs_here_in_order() -> None:
    plan = _plan()
    got = list(workers.run_cells(_where, plan, 1))
    assert [r for _, r in got] == [(c.test_id, os.getpid()) for c in plan]


def test_stopping_early_stops_the_worker() -> None:
    plan = _plan()
    results = workers.run_cells(_where, plan, 2)
    first = [next(results) for _ in range(3)]
    results.close()
    assert [i for i, _ in first] == [0, 1, 2]


def _fails_elsewhere(cell: PlannedCell):
    if cell.kind == "LayerNormMLP" and os.getpid() != _PARENT:
        raise ValueError("harness bug")
    return cell.test_id


_PARENT = os.getpid()


def test_a_failure_in_the_worker_is_raised_here() -> None:
    with pytest.raises(RuntimeError, match="worker process failed: ValueError"):
        list(workers.run_cells(_fails_elsewhere, _plan(), 2))


def test_cuda_cells_stay_in_one_process() -> None:
    assert workers.default_jobs("cuda") == 1
