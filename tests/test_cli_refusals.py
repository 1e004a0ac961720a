"""Bad command lines are refused before any work: exit status 2 and a line naming the value, no
traceback, no cell run and no rank spawned; output paths are checked before the run, and no
directory is created for them."""

from __future__ import annotations

import types

import pytest
from splitgrad import cli
from splitgrad.bench import modules as bench
from splitgrad.bench import moe, pipeline, ranks
from splitgrad.cli import distributed as distributed_cli
from splitgrad.properties.cases.strategies import KINDS
from splitgrad.properties.checks import distributed as distributed_checks
from splitgrad.properties.checks.registry import PROPERTIES
from splitgrad.properties.front import session, verify
from splitgrad.properties.front.plan import plan_cells


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a verify cell runs, a rank is spawned or a distributed check starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(session, "run_cell", refuse)
    monkeypatch.setattr(verify, "run_case", refuse)
    monkeypatch.setattr(ranks, "run_ranks", refuse)
    for name in dir(distributed_checks):
        if name.startswith("check_"):
            monkeypatch.setattr(distributed_checks, name, refuse)


def _status(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse
        return exc.code


def refused(main, argv: list[str], capsys) -> str:
    """The error line of a refused command line."""
    assert _status(main, argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and not captured.out
    lines = [ln for ln in captured.err.splitlines() if ln and not ln.startswith(("usage", " "))]
    return lines[0]


BAD_OUTPUTS = [
    ("/tmp", "is a directory"),
    ("/dev/null/x.json", "/dev/null is not a directory"),
    ("{tmp}/missing/dir/out.json", "missing/dir does not exist"),
]


@pytest.mark.parametrize("path, needle", BAD_OUTPUTS)
@pytest.mark.parametrize(
    "main, flag",
    [
        (verify.main, "--json"),
        (verify.main, "--junit"),
        (bench.main, "--json"),
        (pipeline.pipeline_main, "--json"),
        (pipeline.pipeline_main, "--timeline"),
    ],
)
def test_output_paths_are_checked_before_the_run(
    main, flag, path, needle, tmp_path, capsys, no_work
):
    path = path.format(tmp=tmp_path)
    line = refused(main, [flag, path], capsys)
    assert f"argument {flag}" in line and needle in line, line
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--module", "Linear", "--impl-path", "grouped"], "nothing to run: --impl-path grouped"),
        (["--module", ""], "no module in ''; expected one of Linear"),
        (["--property", ","], "no property in ','"),
        (["--case", "{}", "--property", "P1"], "--case: not a splitgrad case"),
        (["--backend", "path:/nonexistent/pkg"], "/nonexistent/pkg does not exist"),
        (["--autocast", "bfloat16", "--dtype", "float16"], "--dtype float16 would be ignored"),
    ],
)
def test_verify_refuses_runs_that_would_check_nothing_or_ignore_an_option(
    argv, needle, capsys, no_work
):
    assert needle in refused(verify.main, argv, capsys)


def test_verify_help_says_what_the_default_run_and_the_choosing_options_do():
    text = verify.build_parser().format_help()
    n = len(plan_cells(list(KINDS), ["float32", "bfloat16"], list(PROPERTIES)))
    assert f"default run ({n} cells)" in text
    assert "minute" not in text
    assert "--recipe, --impl-path and --autocast do not add to the default run" in text


def test_verify_header_names_the_properties_that_draw_fewer_examples():
    cells = plan_cells(list(KINDS), ["float32", "bfloat16"], list(PROPERTIES))
    header = verify._header(types.SimpleNamespace(name="impl"), "cpu", "ci", cells)
    assert "high precision at 36 examples each (10 for P10, P18)" in header, header
    assert "/" not in header.split("cells:", 1)[1]


def test_bench_refuses_a_run_with_every_section_off(capsys):
    argv = ["--no-main", "--no-fp8", "--no-small", "--no-compile"]
    assert "every section is off" in refused(bench.main, argv, capsys)


def test_bench_quick_keeps_sizes_given_explicitly(capsys):
    args = bench.parse_options(["--quick", "--tokens", "7", "--reps", "4", "--no-fp8"])
    assert (args.shapes.tokens, args.shapes.hidden, args.reps, args.small_reps) == (7, 128, 4, 21)
    assert "--tokens 7" in refused(bench.main, ["--quick", "--tokens", "7"], capsys)


@pytest.mark.parametrize(
    "main, argv, needle",
    [
        (pipeline.pipeline_main, ["--microbatches", "0"], "argument --microbatches"),
        (pipeline.pipeline_main, ["--ffn", "0"], "argument --ffn"),
        (pipeline.pipeline_main, ["--timeout", "-1"], "argument --timeout"),
        (moe.moe_main, ["--timeout", "-5"], "argument --timeout"),
        (distributed_cli.main, ["--timeout", "0"], "argument --timeout"),
        (distributed_cli.main, ["--timeout", "-1"], "argument --timeout"),
        (distributed_cli.main, ["--check", ""], "unknown checks ['']; choose from p14"),
        (
            distributed_cli.main,
            ["--check", "p15", "--recipes", "bogus"],
            "unknown recipes ['bogus']; choose from none, delayed",
        ),
    ],
)
def test_rank_commands_refuse_bad_values_before_spawning(main, argv, needle, capsys, no_work):
    assert needle in refused(main, argv, capsys)


@pytest.mark.parametrize("main", [pipeline.pipeline_main, moe.moe_main, distributed_cli.main])
@pytest.mark.parametrize(
    "backend, needle",
    [
        ("module:no_such_package_here", "cannot load it (ModuleNotFoundError"),
        ("path:/nonexistent/pkg", "/nonexistent/pkg does not exist"),
        ("splitgrad.impl:NoSuchAttribute", "cannot load it (AttributeError"),
    ],
)
def test_rank_commands_load_the_backend_before_spawning(main, backend, needle, capsys, no_work):
    argv = ["--backend", backend] + (["--check", "p14"] if main is distributed_cli.main else [])
    line = refused(main, argv, capsys)
    assert f"--backend {backend}" in line and needle in line, line


def test_the_splitgrad_command_passes_the_refusal_on(capsys, no_work):
    assert "is a directory" in refused(cli.main, ["pipeline", "--json", "/tmp"], capsys)


CASE_JSON = '{"config": {"kind": "Linear"}}'  # never parsed: the refusal comes first


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--examples", "3"], "--examples"),
        (["--seed", "0"], "--seed"),  # falsy, still given
        (["--profile", "dev"], "--profile"),
        (["--fail-fast"], "--fail-fast"),
        (["--module", "Linear"], "--module"),
        (["--dtype", "float32"], "--dtype"),
        (["--recipe", "delayed"], "--recipe"),
        (["--autocast", "bfloat16"], "--autocast"),
        (["--xfails", "{empty}"], "--xfails"),  # an empty file is given all the same
    ],
)
def test_verify_case_refuses_the_options_a_replay_would_ignore(
    extra, flag, tmp_path, capsys, no_work
):
    empty = tmp_path / "xfails.txt"
    empty.write_text("")
    extra = [e.format(empty=empty) for e in extra]
    argv = ["--backend", "reference", "--property", "P1", "--case", CASE_JSON, *extra]
    line = refused(verify.main, argv, capsys)
    assert f"--case replays the one case given: {flag} does not apply" in line, line
    assert line.endswith("leave it out"), line


def test_verify_case_names_every_option_it_refuses(capsys, no_work):
    argv = ["--property", "P1", "--case", CASE_JSON, "--dtype", "float32", "--examples", "2"]
    line = refused(verify.main, argv, capsys)
    assert "--dtype, --examples do not apply (the case carries its own module, dtype" in line
    assert "nothing is drawn" in line and line.endswith("leave them out"), line


def test_verify_refuses_json_and_junit_to_one_file(tmp_path, capsys, monkeypatch, no_work):
    out = tmp_path / "out.txt"
    line = refused(verify.main, ["--json", str(out), "--junit", str(out)], capsys)
    assert f"--json and --junit both write {out}" in line, line
    # The same file spelt another way: relative, or through a link.
    monkeypatch.chdir(tmp_path)
    line = refused(verify.main, ["--json", str(out), "--junit", "out.txt"], capsys)
    assert "--json and --junit both write out.txt" in line, line
    (tmp_path / "link.txt").symlink_to(out)
    line = refused(verify.main, ["--json", "link.txt", "--junit", str(out)], capsys)
    assert f"both write {out}" in line, line
    assert not out.exists()
