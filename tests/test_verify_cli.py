"""``splitgrad verify``: options, messages, table, JSON/JUnit output, failure and replay,
a run that checks nothing, Ctrl-C."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from splitgrad.properties.front.verify import main


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
    assert "--backend transformer_engine: not available" in err and "Traceback" not in err
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
    assert "property" in out and "worst/budget" in out
    # P4 and P12 compare bitwise and judge the final gradients against the float64 truth.
    p4 = [line for line in out.splitlines() if line.startswith("P4 ")]
    assert p4 and all("bitwise; " in line for line in p4)
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
    # 3 drawn examples per cell, plus the enumerated boundary ones that always run.
    assert all(c["status"] == "pass" and c["examples"] >= 3 for c in data["cells"])
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite.get("tests") == "5" and suite.get("failures") == "0"
    # The cells' names are the pytest plugin's test ids: one id grammar for both runners.
    names = {(tc.get("classname"), tc.get("name")) for tc in suite.iter("testcase")}
    assert (
        "splitgrad.properties.test_conformance",
        "test_property[P4-Linear-bfloat16-none]",
    ) in names


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
    # Every example fails, so the first enumerated boundary example does, reported as given.
    assert "FAIL P1-Linear-float32-none after 1 example(s)" in out
    assert "failing case: Linear " in out and "shrunk case" not in out
    repro = next(
        line.split("reproduce: ", 1)[1] for line in out.splitlines() if "reproduce: " in line
    )
    args = shlex.split(repro)
    assert args[:2] == ["splitgrad", "verify"]
    xml = tmp_path / "replay.xml"
    assert main([*args[2:], "--junit", str(xml)]) == 1
    assert "P1 FAIL" in capsys.readouterr().out
    (case,) = ET.parse(xml).getroot().iter("testcase")
    assert case.get("name") == "test_property[P1-Linear-float32-none]"
    failure = case.find("failure")
    assert failure is not None and "output[micro-batch 0]" in failure.text
    # The console script is installed and behaves the same.
    proc = subprocess.run(
        [sys.executable, "-m", "splitgrad.cli", "verify", *args[2:]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and "output[micro-batch 0]" in proc.stdout


def test_replay_of_a_passing_case_writes_json_and_junit(tmp_path: Path, capsys) -> None:
    from splitgrad.properties.checks.registry import example_case

    case = example_case("GroupedLinear", num_gemms=3)
    js, xml = tmp_path / "case.json", tmp_path / "case.xml"
    argv = ["--backend", "reference", "--property", "P12", "--case", case.to_json()]
    assert main([*argv, "--json", str(js), "--junit", str(xml)]) == 0
    assert "P12 pass" in capsys.readouterr().out
    data = json.loads(js.read_text())
    assert data["backend"] == "reference" and data["replay"] is True
    (cell,) = data["cells"]
    assert (cell["property_id"], cell["kind"], cell["status"]) == ("P12", "GroupedLinear", "pass")
    assert cell["examples"] == 1 and cell["case"]["config"]["num_gemms"] == 3
    suite = ET.parse(xml).getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "0"
    (tc,) = suite.iter("testcase")
    assert tc.get("name") == "test_property[P12-GroupedLinear-float32-none]"


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
    from splitgrad.properties.front.plan import FP8_SLICE_EXAMPLES

    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "float32,bfloat16"]
    assert main([*argv, "--property", "P4", "--examples", "40"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    table = [r for r in rows if r[:1] == ["P4"]]
    assert [r[2:4] for r in table] == [
        ["float32", "none"],
        ["bfloat16", "none"],
        ["bfloat16", "all"],
        ["float32+autocast:bfloat16", "none"],
    ]
    # The column counts the enumerated examples too, on top of the slice's drawn ones.
    assert int(table[2][4]) >= FP8_SLICE_EXAMPLES > 0


def test_fp8_case_replays(capsys) -> None:
    import dataclasses

    from splitgrad.properties.checks.registry import example_case

    case = example_case("GroupedLinear", num_gemms=2, in_features=32, out_features=32)
    config = dataclasses.replace(case.config, recipe="delayed-max-e4m3")
    case = dataclasses.replace(case, config=config)
    assert main(["--backend", "reference", "--property", "P12", "--case", case.to_json()]) == 0
    assert "P12 pass" in capsys.readouterr().out and "fp8:delayed-max-e4m3" in case.config.label()


def test_header_says_what_each_kind_of_cell_runs(capsys) -> None:
    argv = ["--backend", "reference", "--module", "Linear", "--property", "P4", "--examples", "12"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[0]
    assert re.search(r"2 high precision at \d+ examples each \(\d+ explicit \+ 12 drawn\)", header)
    assert re.search(r"1 under FP8 at \d+ examples each \(\d+ explicit \+ 5 drawn\)", header)
    assert re.search(
        r"1 under torch.autocast at \d+ examples each \(\d+ explicit \+ 5 drawn\)", header
    )


def test_impl_header_counts_forced_path_cells(capsys) -> None:
    argv = ["--module", "GroupedLinear", "--property", "P1", "--examples", "3", "--recipe", "none"]
    assert main([*argv, "--impl-path", "grouped"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"2 on forced paths at \d+ examples each \(\d+ explicit \+ 3 drawn\)", out)
    rows = [line.split() for line in out.splitlines() if line.startswith("P1 ")]
    assert [r[3] for r in rows] == ["grouped", "grouped"]  # the path column


def test_impl_path_on_a_backend_without_the_knob_is_a_usage_error(capsys) -> None:
    argv = ["--backend", "reference", "--module", "GroupedLinear", "--impl-path", "grouped"]
    assert main(argv) == 2
    assert "has no grouped_gemm attribute" in capsys.readouterr().err


def test_one_line_per_finished_cell_off_a_terminal(capsys) -> None:
    argv = ["--backend", "reference", "--module", "Linear", "--property", "P1,P11"]
    assert main([*argv, "--examples", "2", "--recipe", "none", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err.splitlines()  # captured: not a terminal
    assert err == [line for line in err if line.startswith("[")] and len(err) == 2, err
    # Each cell's explicit boundary cases run on top of the 2 drawn examples.
    assert err[0].startswith("[1/2] P1-Linear-float32-none: pass (") and " examples, " in err[0]
    assert err[1].startswith("[2/2] P11-Linear-float32-none: pass (") and " examples, " in err[1]
    assert main([*argv, "--examples", "2", "--recipe", "none", "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_p9_p10_p11_say_what_they_checked(capsys) -> None:
    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "float32"]
    assert main([*argv, "--property", "P9,P10,P11", "--examples", "2", "--recipe", "none"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("P")}
    assert "raises (+ -O)" in rows["P9"] and "0 (bitwise)" not in rows["P9"]
    assert "raises, unchanged" in rows["P10"]
    assert "freed" in rows["P11"]


def test_unjudged_examples_name_their_cell(capsys, monkeypatch) -> None:
    import splitgrad.properties.checks.accuracy as accuracy
    from splitgrad.properties.oracle.kink import site_at

    fake = site_at(example_case_for_kink(), 0, 0, 0)
    real = accuracy.kink_sites
    monkeypatch.setattr(
        accuracy, "kink_sites", lambda case: [fake] * 4 if case.seed % 2 else real(case)
    )
    argv = ["--backend", "reference", "--module", "Linear", "--dtype", "bfloat16"]
    assert main([*argv, "--property", "P2", "--examples", "6", "--recipe", "none"]) == 0
    out = capsys.readouterr().out
    note = next(line for line in out.splitlines() if "could not be judged" in line)
    assert note.rstrip().endswith(")") and "P2-Linear-bfloat16-none (" in note


def example_case_for_kink():
    from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig

    return Case(
        ModuleConfig("LayerNormMLP", 8, 16, activation="relu", dtype="bfloat16"),
        (MicroBatch((12,)),),
        3,
    )


def test_help_texts_are_plain_and_complete(capsys) -> None:
    from splitgrad import cli
    from splitgrad.bench import modules as bench
    from splitgrad.properties.front.verify import build_parser

    def run(fn, *args: str) -> str:
        try:
            status = fn(list(args))
        except SystemExit as exc:  # argparse's --help
            status = exc.code
        assert status == 0
        return capsys.readouterr().out

    verify_help = build_parser().format_help()
    bench_help = run(bench.main, "--help")
    top = run(cli.main, "--help")
    for text in (verify_help, bench_help, top):
        assert "``" not in text and ":func:" not in text and ":mod:" not in text
    assert "exit status" in verify_help and "--impl-path" in verify_help
    for option, default in (("--tokens", "2048"), ("--hidden", "1024"), ("--ffn", "4096")):
        line = next(ln for ln in bench_help.splitlines() if ln.strip().startswith(option))
        rest = bench_help.split(line, 1)[1].split("\n  --", 1)[0]
        assert f"(default: {default})" in " ".join((line + rest).split()), (option, line)
    assert "Split backward" in top and "--version" in top
    from importlib.metadata import version

    assert run(cli.main, "--version").strip() == f"splitgrad {version('splitgrad')}"


NO_HOOKS = textwrap.dedent(
    '''
    """The reference without register_wgrad_accumulation_and_reduce_hooks on Linear."""
    from splitgrad.reference import *  # noqa: F403
    from splitgrad.reference import Linear as _Linear

    class Linear(_Linear):
        register_wgrad_accumulation_and_reduce_hooks = None
    '''
)


def test_missing_api_exits_2_and_a_failure_alongside_exits_1(tmp_path: Path, capsys) -> None:
    argv = ["--module", "Linear", "--dtype", "float32", "--examples", "2", "--recipe", "none"]
    argv += ["--property", "P1,P4"]
    pkg = tmp_path / "no_hooks_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(NO_HOOKS)
    assert main(["--backend", f"path:{pkg}", *argv]) == 2
    out = capsys.readouterr().out
    assert "missing API: " in out and "(reported once; exit status 2)" in out
    assert [ln.split()[-1] for ln in out.splitlines() if ln.startswith("P4 ")] == ["blocked"]
    # The same gap with a real failure: the failure takes precedence, and the text says so.
    broken = tmp_path / "no_hooks_broken_lib"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        BROKEN + "    register_wgrad_accumulation_and_reduce_hooks = None\n"
    )
    assert main(["--backend", f"path:{broken}", *argv]) == 1
    out = capsys.readouterr().out
    assert "(reported once; exit status 1: a cell failed)" in out and "\nFAIL P1-Linear-" in out
    assert "a failure takes precedence" in build_parser_help()


def build_parser_help() -> str:
    from splitgrad.properties.front.verify import build_parser

    return " ".join(build_parser().format_help().split())


def test_reexport_of_impl_is_complete_and_p13_is_na_once(tmp_path: Path, capsys) -> None:
    pkg = tmp_path / "reexport_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from splitgrad.impl import *  # noqa: F403\n")
    argv = ["--backend", f"path:{pkg}", "--module", "Linear", "--property", "P1,P13"]
    assert main([*argv, "--examples", "2", "--impl-path", "none"]) == 0
    out = capsys.readouterr().out
    assert "missing API" not in out and "lacks part of SPEC's API" not in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("P13 ")]
    assert rows and all(r[-1] == "n/a" for r in rows)
    notes = [ln for ln in out.splitlines() if "no FP8 quantizer" in ln]
    assert len(notes) == 1 and notes[0].startswith("note: FP8 cells n/a: "), out
    case_argv = ["--backend", f"path:{pkg}", "--property", "P13", "--case"]
    from splitgrad.properties.checks.registry import example_case

    case = example_case("Linear", dtype="bfloat16", recipe="delayed-max-e4m3")
    assert main([*case_argv, case.to_json()]) == 0
    assert "P13 n/a" in capsys.readouterr().out


def test_xfails_file_turns_a_listed_failure_into_xfail_and_a_listed_pass_into_a_failure(
    tmp_path: Path, capsys
) -> None:
    pkg = tmp_path / "broken_lib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(BROKEN)
    listed = tmp_path / "xfails.txt"
    listed.write_text("# planted: the output is wrong\nP1-Linear-float32-none\n")
    base = ["--backend", f"path:{pkg}", "--module", "Linear", "--dtype", "float32", "--recipe"]
    base += ["none", "--impl-path", "none"]
    argv = [*base, "--property", "P1", "--examples", "3", "--xfails", str(listed)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1 expected failures" in out and "planted: the output is wrong" in out
    # Strict: the same file on a cell that passes (P9 does not run the wrong forward) fails.
    listed.write_text("P9-Linear-float32-none  # not a real expectation\n")
    argv = [*base, "--property", "P9", "--examples", "1", "--xfails", str(listed)]
    assert main(argv) == 1
    assert "XPASS(strict)" in capsys.readouterr().out
    listed.write_text("P99-Linear-float32-none\n")
    assert main([*base, "--xfails", str(listed)]) == 2
    assert "xfails.txt:1" in capsys.readouterr().err


def test_a_run_that_checks_nothing_exits_5_and_says_why(tmp_path: Path, capsys) -> None:
    js = tmp_path / "out.json"
    argv = ["--backend", "reference", "--dtype", "float64", "--recipe", "delayed"]
    assert main([*argv, "--property", "P1", "--module", "Linear", "--json", str(js)]) == 5
    out = capsys.readouterr().out.rstrip().splitlines()
    assert "0 passed, 0 failed, 0 known deviations, 1 n/a" in out[-2]
    assert out[-1] == (
        "nothing was checked: the only cell is n/a (P1: no wider dtype to measure error against)"
    )
    assert [c["status"] for c in json.loads(js.read_text())["cells"]] == ["n/a"]
    assert main([*argv, "--property", "P1,P2,P3"]) == 5
    last = capsys.readouterr().out.rstrip().splitlines()[-1]
    assert last.startswith("nothing was checked: all 12 cells are n/a (P1, P2, P3: no wider")
    assert "5 nothing was checked" in build_parser_help()


def _lines(stream, into: list[str], first: queue.Queue | None = None) -> None:
    for line in stream:
        into.append(line)
        if first is not None:
            first.put(line)


def _live_in_group(pgid: int) -> list[int]:
    """The processes of group ``pgid`` that still run (a zombie has ended)."""
    live = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry.name))
    return live


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")
def test_ctrl_c_prints_the_summary_of_the_cells_done_and_ends_the_worker(tmp_path: Path) -> None:
    """SIGINT to the process group (as a terminal's Ctrl-C), the worker running: exit 130, the
    cells done in a table and the summary marked as interrupted, no traceback, no process left."""
    js = tmp_path / "out.json"
    argv = ["--backend", "reference", "--module", "Linear,LayerNormMLP", "--recipe", "none"]
    argv += ["--dtype", "float32,bfloat16", "--property", "P4,P6,P9", "--examples", "50"]
    cmd = [sys.executable, "-m", "splitgrad.cli", "verify", *argv, "--json", str(js)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    out: list[str] = []
    err: list[str] = []
    first: queue.Queue = queue.Queue()
    readers = [
        threading.Thread(target=_lines, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=_lines, args=(proc.stderr, err, first), daemon=True),
    ]
    for reader in readers:
        reader.start()
    try:
        line = first.get(timeout=600)  # a loaded 2-core machine: minutes at worst
        assert line.startswith("[1/12] P4-Linear-float32-none: pass"), line + "".join(err)
        assert len(_live_in_group(proc.pid)) >= 2  # the worker runs too
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, "".join(out + err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for reader in readers:
        reader.join(timeout=30)
    text, errors = "".join(out), "".join(err)
    assert "Traceback" not in errors and "Traceback" not in text, errors
    rows = [ln.split() for ln in out if ln.startswith("P")]
    assert rows[0][:3] == ["P4", "Linear", "float32"] and all(r[-1] == "pass" for r in rows)
    summary = re.search(r"^interrupted after (\d+) of 12 cells: (\d+) passed, 0 failed", text, re.M)
    assert summary and int(summary[1]) == int(summary[2]) == len(rows) < 12, text
    data = json.loads(js.read_text())
    assert data["interrupted"] is True and data["cells_planned"] == 12
    assert len(data["cells"]) == len(rows)
    deadline = time.monotonic() + 30
    while _live_in_group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _live_in_group(proc.pid), "a worker process outlived splitgrad verify"


# ---- the documented figures agree with the tool (planned only: no cell runs) ---------------

ROOT = Path(__file__).resolve().parent.parent


def _planned_session(argv: list[str]):
    """The session ``splitgrad verify ARGV`` would run, as its header counts it."""
    from splitgrad.properties.front import verify

    args = verify.build_parser().parse_args(argv)
    options = verify._options(args)
    return verify._open_session(options, verify._backend(options))


def _verify_rows(path: Path) -> list[tuple[str, int]]:
    """(run, cells) of each row of the verify table in ``path`` (the table whose second
    column is ``cells``)."""
    rows, in_table = [], False
    for line in path.read_text().splitlines():
        cols = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cols) > 1 and cols[1] == "cells":
            in_table = True
        elif in_table and line.startswith("|") and cols[1].isdigit():
            rows.append((cols[0], int(cols[1])))
        elif in_table and not line.startswith("|"):
            break
    return rows


def _argv_of(run: str) -> list[str]:
    """The verify options a table row names: its backticked ``--options``, and the reference
    when the row names it."""
    argv = [
        a for span in re.findall(r"`([^`]*)`", run) if span.startswith("--") for a in span.split()
    ]
    return (["--backend", "reference"] if "reference" in run else []) + argv


@pytest.mark.parametrize("doc", ["README.md", "docs/figures.md"])
def test_documented_cell_counts_are_what_verify_plans(doc: str) -> None:
    """Each verify run README.md and docs/figures.md give a cell count for plans that many
    cells (its header's count), as the command would, without running one."""
    rows = _verify_rows(ROOT / doc)
    assert len(rows) >= 2, f"{doc}: no verify table found"
    for run, documented in rows:
        planned = len(_planned_session(_argv_of(run)).cells)
        assert documented == planned, (
            f"{doc}: {run!r} says {documented} cells, verify plans {planned}"
        )


def test_figures_split_the_default_run_as_verify_does() -> None:
    from splitgrad.properties.front import verify

    kinds: dict[str, int] = {}
    for cell in _planned_session([]).cells:
        kinds[verify._cell_kind(cell)] = kinds.get(verify._cell_kind(cell), 0) + 1
    text = " ".join((ROOT / "docs" / "figures.md").read_text().split())
    said = re.search(
        r"default run's cells: (\d+) high-precision cells .*?, (\d+) under a bf16 "
        r"`torch.autocast` slice, (\d+) FP8 cells .*? and (\d+) on the GPU-default fast paths",
        text,
    )
    assert said, "docs/figures.md no longer splits the default run's cells"
    documented = dict(
        zip(
            ("high precision", "under torch.autocast", "under FP8", "on forced paths"),
            map(int, said.groups()),
        )
    )
    assert documented == kinds


def test_nightly_runs_the_default_cells_drawing_the_profiles_count_as_the_docs_say() -> None:
    """``--profile nightly`` adds no cell: the default run's cells, each drawing the profile's
    examples (the slices too), which docs/harness.md and docs/figures.md state."""
    from hypothesis import settings
    from splitgrad.properties.front import plan

    default, nightly = _planned_session([]), _planned_session(["--profile", "nightly"])
    assert [c.test_id for c in nightly.cells] == [c.test_id for c in default.cells]
    assert {c.examples for c in nightly.cells} == {None}  # the profile's count, every cell
    drawn = settings.get_profile("nightly").max_examples
    harness = " ".join((ROOT / "docs" / "harness.md").read_text().split())
    slices = (plan.FP8_SLICE_EXAMPLES, plan.PATH_SLICE_EXAMPLES, plan.AUTOCAST_SLICE_EXAMPLES)
    claim = (
        f"`--profile nightly` (`ci/nightly.sh`) runs the default run's cells, each drawing {drawn} "
        f"examples after its explicit cases (the FP8, forced-path and autocast slices too, instead "
        f"of {slices[0]}, {slices[1]} and {slices[2]})"
    )
    assert claim in harness
    figures = (ROOT / "docs" / "figures.md").read_text()
    assert f"`--profile nightly` (the default run's cells, {drawn} drawn in each)" in figures


def _cell_kind(cell: dict) -> str:
    if cell["path"] != "default":
        return "on forced paths"
    if cell["recipe"] != "none":
        return "under FP8"
    return "high precision" if cell.get("autocast") is None else "under torch.autocast"


def test_header_counts_examples_as_the_rows_do(tmp_path: Path, capsys) -> None:
    """The header's examples per kind of cell are the rows' examples column: explicit cases plus
    drawn ones, per passing cell (a run with P10, whose explicit cases are many, and slices)."""
    out = tmp_path / "run.json"
    argv = ["--backend", "reference", "--module", "Linear", "--property", "P4,P10"]
    assert main([*argv, "--examples", "3", "--json", str(out)]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    claims = {
        kind: (int(lo), int(hi or lo))
        for kind, lo, hi in re.findall(
            r"\d+ ([a-zA-Z0-9. ]+?) at (\d+)(?:-(\d+))? examples each", header
        )
    }
    cells = json.loads(out.read_text())["cells"]
    assert {_cell_kind(c) for c in cells} == set(claims), header
    for kind, (lo, hi) in claims.items():
        ran = [c["examples"] for c in cells if _cell_kind(c) == kind and c["status"] == "pass"]
        assert ran and (min(ran), max(ran)) == (lo, hi), (kind, ran, header)
