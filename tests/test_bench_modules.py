"""Smoke test of ``splitgrad bench --quick`` (a benchmark, not a test of its numbers), and of the
memory counter and the timing it relies on."""

from __future__ import annotations

import json

import pytest
import torch
from splitgrad.bench import modules as bench


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
    assert {r["module"] for r in result["small"]} == {"Linear", "GroupedLinear"}
    assert {r["module"] for r in result["compiled"]} == {"Linear", "GroupedLinear"}
    assert all(r["graph_breaks"] == 0 for r in result["compiled"])
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


def test_interleaved_medians_runs_every_contender_every_round():
    calls = {"a": 0, "b": 0, "c": 0}

    def counter(name):
        def run():
            calls[name] += 1

        return run

    medians = bench._interleaved_medians({k: counter(k) for k in calls}, reps=20)
    assert set(medians) == set(calls)
    assert len(set(calls.values())) == 1 and calls["a"] >= 20


def test_small_shape_row_measures_every_ratio():
    """One small case, few reps: the row carries the three ratios of docs/figures.md's per-call
    table."""
    row = bench.per_call("LayerNormLinear", 16, 32, 32, 1, torch.float32, reps=3)
    assert row["shape"] == "16x32->32"
    for key in ("fwd", "fwd_bwd", "fwd_bwd_dw"):
        assert row[key] > 0
    grouped = bench.per_call("GroupedLinear", 32, 16, 16, 4, torch.bfloat16, reps=3)
    assert grouped["shape"] == "32x16->16 (4 groups)" and grouped["fwd_bwd_dw"] > 0


def test_compiled_row_counts_graph_breaks():
    row = bench.compiled_vs_eager("Linear", 16, 32, 32, 1, torch.float32, reps=3)
    assert row["graph_breaks"] == 0
    for key in ("impl", "delayed", "nn", "vs_nn"):
        assert row[key] > 0
