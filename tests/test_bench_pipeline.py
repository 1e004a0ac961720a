"""``splitgrad pipeline`` and ``splitgrad moe``: they run every schedule side by side, measure what
they say (W actions release what the input-gradient backward held; nothing left pending), and
refuse bad options naming the value. No timing is asserted: the figures are the benchmark's."""

from __future__ import annotations

import json
import math

import pytest
from splitgrad.bench import actions, moe, pipeline
from splitgrad.bench.moe import MoEBenchConfig, run_moe_bench
from splitgrad.bench.pipeline import PipelineBenchConfig, run_pipeline_bench

pytestmark = pytest.mark.distributed

_TINY = dict(ranks=2, layers=4, hidden=32, ffn=64, rows=8, steps=1)


def test_pipeline_bench_runs_each_schedule_next_to_torchs_split(tmp_path):
    cfg = PipelineBenchConfig(schedules=("1f1b", "zbv", "dualpipev"), **_TINY)
    rows, per_rank, device, world = run_pipeline_bench(cfg, timeout_s=300)
    assert world == 2 and device.startswith("gloo")
    by_key = {(r["schedule"], r["variant"]): r for r in rows}
    assert set(by_key) == {(s, v) for s in cfg.schedules for v in ("splitgrad", "torch")}
    for r in rows:
        assert r["step_s"] > 0 and len(r["bubble"]) == 2
        assert all(0.0 <= b < 1.0 for b in r["bubble"]), r["bubble"]
        assert math.isfinite(r["loss"])
    for v in ("splitgrad", "torch"):
        # a schedule without a W step holds nothing for one; a zero-bubble one does, and its
        # W actions give it back
        assert by_key[("1f1b", v)]["actions"] == "FB" and by_key[("1f1b", v)]["held_mib"] is None
        for s in ("zbv", "dualpipev"):
            assert "I" in by_key[(s, v)]["actions"] and "W" in by_key[(s, v)]["actions"]
            assert by_key[(s, v)]["held_mib"] > 0, (s, v)
    # the timeline: one Chrome trace event per action of the last step, every rank present
    path = tmp_path / "timeline.json"
    pipeline._write_timeline(str(path), cfg, per_rank)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    expected = sum(len(res[k]["steps"][-1]["spans"]) for res in per_rank for k in res)
    assert len(events) == expected and {e["tid"] for e in events} == {0, 1}


def test_held_between_b_and_w_sums_what_pending_w_actions_release():
    def span(kind, mb, t, nbytes):
        return {"kind": kind, "stage": 0, "mb": mb, "t0": t - 0.5, "t1": t, "bytes": nbytes}

    spans = [
        span("F", 0, 1, 300),
        span("I", 0, 2, -40),
        span("F", 1, 3, 300),
        span("I", 1, 4, -40),
        span("W", 0, 5, -100),  # releases 100 held since I0
        span("W", 1, 6, -250),  # releases 250 held since I1
    ]
    assert actions.held_between_b_and_w(spans) == 350.0
    assert actions.held_between_b_and_w([span("F", 0, 1, 10), span("B", 0, 2, -10)]) is None
    assert actions.activation_peak(spans) == 560.0  # after F1: 300 - 40 + 300


@pytest.mark.parametrize(
    "schedule, option, needle",
    [
        ("zbv,nope", [], "'nope'"),
        ("zbv", ["--layers", "6"], "--layers 6"),
        ("1f1b", ["--ranks", "1"], "--ranks must be >= 2 for a pipeline, got 1"),
        ("zbv", ["--microbatches", "2"], "--microbatches 2"),
        ("zbv", ["--dtype", "float16"], "'float16'"),
    ],
)
def test_pipeline_command_refuses_bad_options_naming_them(schedule, option, needle, capsys):
    assert pipeline.pipeline_main(["--schedule", schedule, *option]) == 2
    assert needle in capsys.readouterr().err


def test_an_image_timeline_needs_matplotlib(capsys):
    """A .json timeline needs nothing; an image one needs matplotlib."""
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed here: an image timeline is accepted")
    except ImportError:
        pass
    assert pipeline.pipeline_main(["--schedule", "zbv", "--timeline", "x.png"]) == 2
    assert "matplotlib" in capsys.readouterr().err


def test_moe_bench_times_the_three_modes_on_every_rank(capsys):
    cfg = MoEBenchConfig(ranks=2, tokens=64, hidden=16, local_experts=2, repeats=2)
    per_rank, device, world = run_moe_bench(cfg, timeout_s=300)
    assert world == 2 and len(per_rank) == 2
    for res in per_rank:
        assert set(res["times"]) == {"a2a", "dw", "both"}
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in res["times"].values())
    assert sum(r["send_rows"] for r in per_rank) == 2 * 64  # every token dispatched once
    moe._print_moe(cfg, per_rank, device, world)
    assert "a2a hidden" in capsys.readouterr().out
    assert moe.moe_main(["--tokens", "0"]) == 2
    assert "--tokens must be >= 1, got 0" in capsys.readouterr().err


def test_ranks_must_agree_with_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert pipeline.pipeline_main(["--ranks", "4", "--schedule", "1f1b"]) == 2
    assert "--ranks 4 but torchrun started WORLD_SIZE=2" in capsys.readouterr().err
    assert moe.moe_main(["--ranks", "3"]) == 2
    assert "--ranks 3 but torchrun started WORLD_SIZE=2" in capsys.readouterr().err
