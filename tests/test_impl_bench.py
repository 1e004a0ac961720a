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
    args = ["--quick", "--modules", "Linear,GroupedLinear", "--json", str(path)]
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "split" in out and "GroupedLinear" in out
    result = json.loads(path.read_text())
    assert [r["recipe"] for r in result["fp8"]] == ["bf16", *bench.fp8_recipes()]
    rows = result["rows"]
    assert {r["module"] for r in rows} == {"Linear", "GroupedLinear"}
    for r in rows:
        assert r["split"] > 0 and r["nn"] > 0 and r["peak_impl_mb"] >= 0


def test_fp8_section_reports_every_recipe_and_halves_entry_memory():
    rows = bench.run_fp8(bench.Shapes(128, 128, 256, 1), reps=1)
    assert [r["recipe"] for r in rows] == ["bf16", *bench.fp8_recipes()]
    for r in rows:
        assert r["wgrad_ms"] > 0 and r["wgrad_fused_ms"] > 0
    # An FP8 entry holds 1-byte copies of dy and x (plus scales and db); bf16 holds 2 bytes.
    for r in rows[1:]:
        assert 0.5 <= r["entry_vs_bf16"] < 0.6, r
