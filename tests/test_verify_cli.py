"""``splitgrad verify``: options, messages, table, JSON/JUnit output, failure and replay."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from splitgrad.properties.verify import main


def test_unknown_option_is_a_message_not_a_traceback(capsys) -> None:
    assert main(["--frobnicate"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --frobnicate" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--backend", "nonesuch"], "unknown backend 'nonesuch'"),
        (["--module", "Conv2d"], "unknown module 'Conv2d'"),
        (["--dtype", "int8"], "unknown dtype 'int8'"),
        (["--property", "P99"], "unknown property 'P99'"),
        (["--examples", "0"], "--examples must be at least 1"),
        (["--recipe", "fp4"], "unknown recipe 'fp4'"),
        (["--backend", "reference", "--case", "{}"], "--case needs exactly one --property"),
        (["--backend", "reference", "--property", "P4", "--case", "nope"], "not a splitgrad case"),
    ],
)
def test_bad_values_exit_2_with_a_message(capsys, argv: list[str], needle: str) -> None:
    assert main(argv) == 2
    assert needle in capsys.readouterr().err


def test_unavailable_backend_is_explained(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present; transformer_engine may be available")
    assert main(["--backend", "transformer_engine"]) == 2
    err = capsys.readouterr().err
    assert "backend 'transformer_engine' is not available" in err and "Traceback" not in err
    assert main(["--device", "cuda", "--backend", "reference"]) == 2


def test_campaign_prints_table_and_writes_json_and_junit(tmp_path: Path, capsys) -> None:
    js, xml = tmp_path / "out.json", tmp_path / "out.xml"
    argv = [
        "--backend",
        "reference",
        "--module",
        "Linear,GroupedLinear",
        "--dtype",
        "bfloat16",
        "--property",
        "P1,P4",
        "--property",
        "P12",
        "--examples",
        "3",
        "--recipe",
        "none",
        "--json",
        str(js),
        "--junit",
        str(xml),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "property" in out and "worst/budget" in out and "0 (bitwise)" in out
    assert "recipe" not in out.split("\n\n")[0]  # no FP8 cell: no recipe column
    assert "5 passed, 0 failed" in out
    data = json.loads(js.read_text())
    assert {(c["property_id"], c["kind"]) for c in data["cells"]} == {
        ("P1", "Linear"),
        ("P1", "GroupedLinear"),
        ("P4", "Linear"),
        ("P4", "GroupedLinear"),
        ("P12", "GroupedLinear"),
    }
    assert all(c["status"] == "pass" and c["examples"] == 3 for c in data["cells"])
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite.get("tests") == "5" and suite.get("failures") == "0"


BROKEN = textwrap.dedent(
    '''
    """The reference with one bug: Linear's output is off by 1e-2 (P1 must catch it)."""
    from splitgrad.reference import *  # noqa: F403
    from splitgrad.reference import Linear as _Linear

    class Linear(_Linear):
        def forward(self, inp, is_first_microbatch=None):
            return super().forward(inp, is_first_microbatch) + 1e-2
    '''
)


def test_failure_prints_shrunk_case_and_a_working_repro(tmp_path: Path, capsys) -> None:
    pkg = tmp_path / "broken_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN)
    argv = [
        "--backend",
        f"path:{pkg}",
        "--module",
        "Linear",
        "--dtype",
        "float32",
        "--property",
        "P1",
        "--examples",
        "5",
    ]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "shrunk case: Linear 1x1 float32" in out
    repro = next(
        line.split("reproduce: ", 1)[1] for line in out.splitlines() if "reproduce: " in line
    )
    args = shlex.split(repro)
    assert args[:2] == ["splitgrad", "verify"]
    assert main(args[2:]) == 1
    assert "P1 FAIL" in capsys.readouterr().out
    # The console script is installed and behaves the same.
    proc = subprocess.run(
        [sys.executable, "-m", "splitgrad.properties.cli", "verify", *args[2:]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "output[micro-batch 0]" in proc.stdout


def test_replay_of_a_passing_case(capsys) -> None:
    from splitgrad.properties.registry import example_case

    case = example_case("GroupedLinear", num_gemms=3)
    assert main(["--backend", "reference", "--property", "P12", "--case", case.to_json()]) == 0
    assert "P12 pass" in capsys.readouterr().out


def test_recipe_option_adds_fp8_cells_with_a_recipe_column(tmp_path: Path, capsys) -> None:
    js = tmp_path / "fp8.json"
    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "bfloat16"]
    argv += ["--property", "P1,P13", "--examples", "2", "--recipe", "delayed,mxfp8"]
    assert main([*argv, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("property"))
    assert header.split()[:4] == ["property", "module", "dtype", "recipe"]
    cells = json.loads(js.read_text())["cells"]
    assert {(c["property_id"], c["recipe"]) for c in cells} == {
        ("P1", "delayed"),
        ("P1", "mxfp8"),
        ("P13", "delayed"),
        ("P13", "mxfp8"),
    }
    assert all(c["status"] == "pass" for c in cells)


def test_default_run_has_a_small_fp8_slice(capsys) -> None:
    from splitgrad.properties.verify import FP8_SLICE_EXAMPLES

    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "float32,bfloat16"]
    assert main([*argv, "--property", "P4", "--examples", "40"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = [r for r in rows if r[:1] == ["P4"]]
    assert [r[2:4] for r in table] == [
        ["float32", "none"],
        ["bfloat16", "none"],
        ["bfloat16", "all"],
    ]
    assert table[-1][4] == str(FP8_SLICE_EXAMPLES)


def test_fp8_case_replays(capsys) -> None:
    import dataclasses

    from splitgrad.properties.registry import example_case

    case = example_case("GroupedLinear", num_gemms=2, in_features=32, out_features=32)
    config = dataclasses.replace(case.config, recipe="delayed-max-e4m3")
    case = dataclasses.replace(case, config=config)
    assert main(["--backend", "reference", "--property", "P12", "--case", case.to_json()]) == 0
    assert "P12 pass" in capsys.readouterr().out and "fp8:delayed-max-e4m3" in case.config.label()
