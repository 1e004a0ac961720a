"""``splitgrad bench`` refuses bad options with exit status 2 and a message naming the value
(argument parsing only); a smoke run (``--quick``, one tiny module) says its figures are not to
be read, and so does a small ``splitgrad moe`` run."""

from __future__ import annotations

import json

import pytest
import torch
from splitgrad import cli
from splitgrad.bench import modules as bench


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        bench.parse_options(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("flag", ["--tokens", "--hidden", "--ffn", "--groups", "--reps"])
@pytest.mark.parametrize("value", ["-5", "0", "x"])
def test_sizes_and_counts_must_be_positive(flag: str, value: str, capsys) -> None:
    err = _refused([flag, value], capsys)
    assert f"argument {flag}: expected a positive integer, got" in err and value in err


def test_threads_and_small_reps_must_be_positive(capsys) -> None:
    assert "argument --threads" in _refused(["--threads", "0"], capsys)
    assert "argument --small-reps" in _refused(["--small-reps", "-1"], capsys)


def test_unknown_dtype_is_named_with_the_valid_ones(capsys) -> None:
    err = _refused(["--dtypes", "float32,float8"], capsys)
    assert (
        "argument --dtypes: unknown dtype 'float8'; expected one of float32, bfloat16, float16"
        in err
    )


def test_unknown_module_is_named_with_the_valid_ones(capsys) -> None:
    err = _refused(["--modules", "Linear,Foo"], capsys)
    assert "argument --modules: unknown module 'Foo'" in err
    assert "Linear, LayerNormLinear, LayerNormMLP, GroupedLinear" in err


def test_empty_lists_are_refused(capsys) -> None:
    assert "argument --modules: no module in ','" in _refused(["--modules", ","], capsys)


def test_fp8_section_needs_aligned_sizes_unless_skipped(capsys) -> None:
    err = _refused(["--tokens", "100"], capsys)
    assert "--tokens 100" in err and "multiples of 128" in err and "--no-fp8" in err
    args = bench.parse_options(["--tokens", "100", "--no-fp8"])
    assert args.shapes.tokens == 100


def test_valid_options_parse_to_what_the_run_uses() -> None:
    args = bench.parse_options(["--dtypes", "bfloat16, float16", "--modules", "GroupedLinear"])
    assert args.dtype_list == [torch.bfloat16, torch.float16]
    assert args.kinds == ["GroupedLinear"]
    assert (args.shapes.tokens, args.shapes.hidden, args.shapes.ffn) == (2048, 1024, 4096)
    quick = bench.parse_options(["--quick", "--groups", "3"])
    assert (quick.shapes.tokens, quick.shapes.groups, quick.reps) == (256, 3, 2)


def test_the_splitgrad_command_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--tokens", "-5"])
    assert exc.value.code == 2
    assert "splitgrad bench: error: argument --tokens" in capsys.readouterr().err


def test_a_quick_run_warns_that_its_figures_are_not_to_be_read_and_prints_no_target(
    tmp_path, capsys
) -> None:
    """A smoke run (``--quick``, or sizes below the defaults) says so first and last, and
    leaves the targets out; the same rows printed as a full run's show them."""
    out = tmp_path / "quick.json"
    argv = ["--quick", "--no-fp8", "--no-small", "--no-compile", "--modules", "Linear"]
    assert bench.main([*argv, "--dtypes", "float32", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("WARNING: smoke run (--quick, --tokens 256 (default 2048)"), lines[0]
    assert "not meant to be read" in lines[0] and lines[-1] == lines[0]
    assert not [ln for ln in lines if "target" in ln and not ln.startswith("WARNING")], lines
    saved = json.loads(out.read_text())
    assert saved["smoke_run"] and saved["targets"] == bench.TARGETS
    shapes = bench.Shapes(**saved["shapes"])
    bench._print_table(saved["rows"], shapes, saved["reps"])
    full = capsys.readouterr().out
    for target in bench.TARGETS.values():
        assert f"(target <= {target:.2f})" in full


def test_only_runs_below_the_default_sizes_are_smoke_runs() -> None:
    assert bench.smoke_run(bench.parse_options([])) == []
    why = bench.smoke_run(bench.parse_options(["--reps", "2", "--no-fp8"]))
    assert why == ["--reps 2 (default 5)"]
    # the small-shape repetitions count only where those sections run
    argv = ["--small-reps", "3", "--no-small", "--no-compile"]
    assert bench.smoke_run(bench.parse_options(argv)) == []


def test_a_small_moe_run_warns_that_its_figures_are_not_to_be_read(capsys) -> None:
    from splitgrad.bench import moe

    assert moe.smoke_run(moe.MoEBenchConfig()) == []
    cfg = moe.MoEBenchConfig(tokens=64, hidden=16, repeats=2)
    assert moe.smoke_run(cfg) == [
        "--tokens 64 (default 2048)",
        "--hidden 16 (default 256)",
        "--repeats 2 (default 10)",
    ]
    times = {"a2a": [1e-4, 1e-4], "dw": [2e-4, 2e-4], "both": [2.5e-4, 2.5e-4]}
    per_rank = [{"times": times, "send_rows": 64, "recv_rows": 64}] * 2
    moe._print_moe(cfg, per_rank, "gloo, cpu", 2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("WARNING: smoke run (--tokens 64") and lines[-1] == lines[0]
    moe._print_moe(moe.MoEBenchConfig(), per_rank, "gloo, cpu", 2)
    assert "WARNING" not in capsys.readouterr().out


def test_a_small_pipeline_run_warns_that_its_figures_are_not_to_be_read(capsys) -> None:
    from splitgrad.bench import pipeline

    assert pipeline.smoke_run(pipeline.PipelineBenchConfig()) == []
    cfg = pipeline.PipelineBenchConfig(schedules=("gpipe",), layers=2, hidden=16, ffn=64, steps=1)
    assert pipeline.smoke_run(cfg) == [
        "--layers 2 (default 8)",
        "--hidden 16 (default 256)",
        "--ffn 64 (default 1024)",
        "--steps 1 (default 3)",
    ]
    row = {"schedule": "gpipe", "step_s": 0.01, "bubble": [0.5, 0.5], "held_mib": None}
    row |= {"act_peak_mib": 0.01, "loss": 1.0, "actions": "FB"}
    rows = [dict(row, variant="splitgrad"), dict(row, variant="torch")]
    pipeline._print_pipeline(cfg, rows, "gloo, cpu", 2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("WARNING: smoke run (--layers 2") and lines[-1] == lines[0]
    pipeline._print_pipeline(pipeline.PipelineBenchConfig(schedules=("gpipe",)), rows, "cpu", 2)
    assert "WARNING" not in capsys.readouterr().out
