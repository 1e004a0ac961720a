"""Bad command lines are refused before any work: exit status 2 and a line naming the value, no
traceback, no cell run and no rank spawned; output paths are checked before the run, and no
directory is created for them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from splitgrad import cli
from splitgrad.bench import launch, moe, pipeline, ranks
from splitgrad.bench import modules as bench
from splitgrad.cli import distributed as distributed_cli
from splitgrad.properties.cases.strategies import KINDS
from splitgrad.properties.checks import distributed as distributed_checks
from splitgrad.properties.checks.registry import PROPERTIES
from splitgrad.properties.front import plan, session, verify
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
    options = session.Options(examples=plan.DEFAULT_EXAMPLES, profile="ci")
    header = verify._header(session.Session.open(options))
    fewer = plan.ENUMERATED_DRAWN["P10"]
    assert f"explicit + {plan.DEFAULT_EXAMPLES} drawn, {fewer} for P10, P18)" in header, header
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
        (
            distributed_cli.main,
            ["--check", ""],
            "argument --check: no check in ''; expected one of p14",
        ),
        (
            distributed_cli.main,
            ["--check", "p15", "--recipes", "bogus"],
            "argument --recipe: unknown recipe 'bogus'; expected one of none, delayed",
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
        ("class:splitgrad.impl:NoSuchAttribute", "cannot load it (AttributeError"),
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


# ---- one grammar, one set of names, one way of refusing, across the subcommands --------------

RANK_MAINS = {
    "pipeline": pipeline.pipeline_main,
    "moe": moe.moe_main,
    "distributed": distributed_cli.main,
}
BACKEND_MAINS = {"verify": verify.main, **RANK_MAINS}


def _error_of(sub: str, main, argv: list[str], capsys) -> str:
    """What follows ``splitgrad SUB: error:`` in a refusal, checked to read as argparse's own:
    the usage line first, exit status 2."""
    assert _status(main, argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"usage: splitgrad {sub} "), err
    prefix = f"splitgrad {sub}: error: "
    (line,) = [ln for ln in err.splitlines() if ln.startswith(prefix)]
    return line[len(prefix) :]


_FORMS = "impl, reference, torch-split, transformer_engine, path:DIR, module:NAME[:ATTR], "


@pytest.mark.parametrize(
    "bad, error",
    [
        ("nonesuch", f"unknown backend 'nonesuch'; expected one of {_FORMS}class:MODULE:ATTR"),
        ("Impl", f"unknown backend 'Impl'; expected one of {_FORMS}class:MODULE:ATTR"),
        ("class:onlymodule", "'class:onlymodule' is incomplete; expected class:MODULE:ATTR"),
        ("module:", "'module:' is incomplete; expected module:NAME[:ATTR]"),
        ("path:", "'path:' is incomplete; expected path:DIR"),
    ],
)
def test_every_backend_option_reads_one_grammar_and_refuses_alike(bad, error, capsys, no_work):
    from splitgrad.properties.front.command_line import backend_spec

    for sub, main in BACKEND_MAINS.items():
        assert _error_of(sub, main, ["--backend", bad], capsys) == f"argument --backend: {error}"
    parsers = [
        verify.build_parser(),
        distributed_cli._parser(),
        pipeline._pipeline_parser(),
        moe._moe_parser(),
    ]
    for parser in parsers:
        (action,) = [a for a in parser._actions if "--backend" in a.option_strings]
        assert action.type is backend_spec, parser.prog


def test_the_rank_commands_older_backend_spelling_still_reads():
    from splitgrad.properties.backends import get_backend
    from splitgrad.properties.front.command_line import backend_spec

    spec = backend_spec("splitgrad.properties.cases.case:KINDS")
    assert spec == "module:splitgrad.properties.cases.case:KINDS"
    assert get_backend(spec).lib is KINDS  # an object in a module, as NAME:ATTR loaded it
    assert distributed_checks.load_library(spec) is KINDS
    for kept in ("impl", "module:mypkg", "path:/x", "class:m:A"):
        assert backend_spec(kept) == kept


def test_schedule_names_are_one_set_and_the_old_spellings_still_read(monkeypatch, capsys, no_work):
    from splitgrad.bench.options import SCHEDULES

    assert set(SCHEDULES.values()) == set(distributed_checks.SCHEDULES)
    errors = {
        "pipeline": _error_of(
            "pipeline", pipeline.pipeline_main, ["--schedule", "zbv,nope"], capsys
        ),
        "distributed": _error_of(
            "distributed",
            distributed_cli.main,
            ["--check", "p15", "--schedule", "zbv,nope"],
            capsys,
        ),
    }
    assert set(errors.values()) == {
        f"argument --schedule: unknown schedule 'nope'; expected one of {', '.join(SCHEDULES)}, all"
    }, errors
    # the torch class names and distributed's --schedules / --recipes, read as before
    monkeypatch.setattr(distributed_checks, "preload_library", lambda name: None)
    old = distributed_cli._parser().parse_args(
        ["--check", "p15", "--schedules", "ScheduleGPipe,zbv", "--recipes", "none,delayed"]
    )
    new = distributed_cli._parser().parse_args(
        ["--check", "p15", "--schedule", "gpipe,zbv", "--recipe", "none,delayed"]
    )
    assert distributed_cli._plan(old) == distributed_cli._plan(new)
    assert distributed_cli._plan(new)[1:] == (
        ("ScheduleGPipe", "ScheduleZBVZeroBubble"),
        (None, "delayed"),
    )
    monkeypatch.setattr(pipeline, "preload_library", lambda name: None)
    args = pipeline._pipeline_parser().parse_args(["--schedule", "ScheduleZBVZeroBubble,1f1b"])
    assert pipeline._config(args).schedules == ("zbv", "1f1b")


def test_help_texts_document_one_spelling(capsys):
    texts = {
        "verify": verify.build_parser().format_help(),
        "distributed": distributed_cli._parser().format_help(),
        "pipeline": pipeline._pipeline_parser().format_help(),
        "moe": moe._moe_parser().format_help(),
    }
    for sub, text in texts.items():
        flat = " ".join(text.split())
        assert "NAME:ATTR" not in flat.replace("class:MODULE:ATTR", ""), sub
        assert (
            "--schedules" not in flat and "--recipes" not in flat and "ScheduleGPipe" not in flat
        ), sub
        assert "class:MODULE:ATTR" in flat, sub


class _Accepted(Exception):
    """The command line was accepted: the run would start here."""


def _accept(*args, **kwargs):
    raise _Accepted


def _documented_command_lines() -> list[str]:
    """Every ``splitgrad SUB ...`` line of README.md's and docs/*.md's code blocks, of the CI
    scripts, and of verify's own --help examples."""
    root = Path(__file__).resolve().parent.parent
    lines: list[str] = []
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        shell = None  # inside a fenced block: whether it holds shell commands
        for line in doc.read_text().splitlines():
            if line.startswith("```"):
                shell = (
                    line[3:].strip() in ("", "bash", "sh", "shell", "console")
                    if shell is None
                    else None
                )
            elif shell:
                lines.append(line)
    for script in sorted((root / "ci").glob("*.sh")):
        lines += script.read_text().splitlines()
    lines += verify.EPILOG.splitlines()
    commands = [ln.split("#")[0].strip() for ln in lines]
    # (a command, not printed output: its first word after the subcommand is an option)
    words = [c.split() for c in commands if c.startswith("splitgrad ")]
    return [
        " ".join(w)
        for w in words
        if w[1] in cli.COMMANDS and all(word.startswith("-") for word in w[2:3])
    ]


DOCUMENTED = _documented_command_lines()


def test_the_docs_show_command_lines():
    subs = {shlex.split(line)[1] for line in DOCUMENTED}
    assert {"verify", "distributed", "pipeline", "moe"} <= subs, subs


@pytest.mark.parametrize("line", DOCUMENTED)
def test_every_documented_command_line_is_accepted(line, monkeypatch, capsys, tmp_path):
    """Parsed and checked as the command would, up to where the run starts (no backend is
    loaded and no expected-failures file read: the docs name placeholders)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(verify, "_xfails_file", lambda path: {})
    monkeypatch.setattr(verify, "_backend", _accept)
    monkeypatch.setattr(bench, "run", _accept)
    monkeypatch.setattr(launch, "run", _accept)
    for module in (distributed_checks, pipeline, moe):
        monkeypatch.setattr(module, "preload_library", lambda name: None)
    monkeypatch.setattr(distributed_cli, "_runs", _accept)
    monkeypatch.setattr(pipeline, "run_pipeline_bench", _accept)
    monkeypatch.setattr(moe, "run_moe_bench", _accept)
    argv = shlex.split(line)[1:]
    with pytest.raises(_Accepted):
        status = _status(cli.main, argv)
        pytest.fail(f"{line!r} refused (exit status {status}): {capsys.readouterr().err}")
