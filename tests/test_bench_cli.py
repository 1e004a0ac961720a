"""``splitgrad bench`` refuses bad options with exit status 2 and a message naming the value
(argument parsing only: no benchmark runs here)."""

from __future__ import annotations

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
    assert "--dtypes: unknown 'float8'; expected some of float32, bfloat16, float16" in err


def test_unknown_module_is_named_with_the_valid_ones(capsys) -> None:
    err = _refused(["--modules", "Linear,Foo"], capsys)
    assert "--modules: unknown 'Foo'" in err
    assert "Linear, LayerNormLinear, LayerNormMLP, GroupedLinear" in err


def test_empty_lists_are_refused(capsys) -> None:
    assert "--modules: nothing in ','" in _refused(["--modules", ","], capsys)


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
