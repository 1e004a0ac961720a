"""Smoke test of ``splitgrad bench --quick`` (a benchmark, not a test of its numbers), and of the
memory counter it relies on."""

from __future__ import annotations

import json

import pytest
import torch
from splitgrad.properties import bench


def test_peak_memory_counter_counts_allocations_not_views():
    with bench.PeakMemory() as mem:
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        a.view(32, 32).t()  # a view allocates nothing
        a.add_(1)  # in place allocates nothing
        b = torch.empty(2048, dtype=torch.float32)  # 8 KiB: 12 KiB alive at once
        del a, b
        c = torch.empty(256, dtype=torch.float32)
        alive = mem.alive_bytes()
        del c
    assert mem.peak == 12 * 1024
    assert alive == 1024


@pytest.mark.slow
def test_bench_quick_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--quick", "--modules", "Linear,GroupedLinear", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "split" in out and "GroupedLinear" in out
    rows = json.loads(path.read_text())["rows"]
    assert {r["module"] for r in rows} == {"Linear", "GroupedLinear"}
    for r in rows:
        assert r["split"] > 0 and r["nn"] > 0 and r["peak_impl_mb"] >= 0
