"""The harness pointed at packages that are not splitgrad's: ``module:NAME``, ``path:DIR``,
``class:MODULE:ATTR``, a package lacking part of SPEC's API, plain re-exports of impl, and the
pytest plugin run the way an outside project's CI runs it (``pytest --pyargs
splitgrad.properties ...``, with xdist and JUnit, its header, an expected-failures file);
TransformerEngine's FP8 recipes mapped by name."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from xml.etree import ElementTree as ET

import pytest
from outside_packages import write_packages
from outside_reexport import write_reexports
from splitgrad.properties.backends import (
    RecipeMappingError,
    get_backend,
    to_transformer_engine_recipe,
)
from splitgrad.properties.cases.strategies import ModuleConfig, make_recipe
from splitgrad.properties.checks.registry import PROPERTIES
from splitgrad.properties.front import xfails
from splitgrad.properties.front.campaign import FAIL, NA, PASS, CellResult, api_gaps
from splitgrad.properties.front.verify import main
from splitgrad.properties.pytest_plugin import suite_requested


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    root = write_reexports(write_packages(tmp_path_factory.mktemp("outside")))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))


def _verify(argv: list[str], capsys) -> tuple[int, str]:
    status = main(argv)
    return status, capsys.readouterr().out


def test_renamed_reference_passes_without_private_helpers(outside: Path, capsys) -> None:
    """Every property on a package that refuses splitgrad's private gemm_*_names() to the
    harness: roles come from SPEC's parameter names."""
    backend = get_backend("module:renamed_ref")
    assert backend.missing_api() == {}  # no quantizer module of its own: P13 n/a, not a gap
    m = backend.build(ModuleConfig("LayerNormMLP", 4, 3), delay=True)
    # Called from a frame of splitgrad.properties, the helper is refused (or absent) ...
    harness_frame = {"__name__": "splitgrad.properties.somewhere", "m": m}
    with pytest.raises(AttributeError):
        eval("m.gemm_weight_names()", harness_frame)
    # ... and the harness still knows the roles, from SPEC's parameter names.
    assert backend.gemm_weight_names(m) == ["fc1_weight", "fc2_weight"]
    argv = ["--backend", "module:renamed_ref", "--module", "LayerNormMLP,GroupedLinear"]
    argv += ["--dtype", "float32"]
    status, out = _verify([*argv, "--examples", "2", "--recipe", "none"], capsys)
    assert status == 0, out
    assert "FAIL" not in out and "missing API" not in out
    assert " 0 failed" in out


def test_path_backend_is_the_same_package(outside: Path, capsys) -> None:
    argv = ["--backend", f"path:{outside / 'renamed_ref'}", "--module", "Linear"]
    status, out = _verify([*argv, "--property", "P4,P7", "--examples", "3"], capsys)
    assert status == 0, out


def test_missing_api_is_reported_once_with_exit_2(outside: Path, capsys, tmp_path: Path) -> None:
    """No delay option, no backward_dw, no queue, no LayerNorm modules: one report naming what
    is missing and what it blocks; the properties that need none of it still run and pass."""
    js = tmp_path / "gaps.json"
    argv = ["--backend", "module:no_split_api", "--examples", "3", "--dtype", "float32"]
    status, out = _verify([*argv, "--recipe", "none", "--json", str(js)], capsys)
    assert status == 2, out
    assert "FAIL" not in out and "Traceback" not in out
    assert out.count("takes no delay_wgrad_compute") == 2  # header line and summary
    assert "does not export LayerNormLinear" in out and "does not export LayerNormMLP" in out
    data = json.loads(js.read_text())
    blocks = data["missing_api"]["delay"]["blocks"]
    assert {"P4", "P5", "P6", "P7", "P9", "P10", "P13"} <= set(blocks)
    assert "P1" not in blocks and "P3" not in blocks and "P17" not in blocks
    status_of = {(c["property_id"], c["kind"]): c["status"] for c in data["cells"]}
    for pid in ("P1", "P2", "P3", "P11", "P12", "P17"):
        for kind in ("Linear", "GroupedLinear"):
            if (pid, kind) in status_of:
                assert status_of[(pid, kind)] == "pass", (pid, kind, status_of[(pid, kind)])
    assert status_of[("P4", "Linear")] == "blocked"
    assert status_of[("P1", "LayerNormMLP")] == "blocked"
    assert not any(s == "FAIL" for s in status_of.values())


def _verify_p13_na_once(capsys, name: str, *options: str) -> str:
    """``verify`` of P1 and P13 on the Linear of package ``name``, which has no FP8 quantizer of
    its own: exit 0, no API missing, P13 n/a with its reason said once. Returns the output."""
    argv = ["--backend", f"module:{name}", "--module", "Linear", "--examples", "2", *options]
    status, out = _verify([*argv, "--property", "P1,P13"], capsys)
    assert status == 0, out
    assert "missing API" not in out
    assert out.count(f"{name} exposes no FP8 quantizer of its own") == 1, out
    return out


def test_no_quantizer_module_is_p13_na_said_once_not_missing_api(outside: Path, capsys) -> None:
    """fp8_autocast without a quantizer module of the package's own: complete; P13 n/a, said
    once; the other FP8 cells run."""
    out = _verify_p13_na_once(capsys, "renamed_ref", "--recipe", "delayed")
    assert "FAIL" not in out
    assert "P1        Linear" in out and "2 n/a" in out


def test_plain_reexports_of_impl_lack_nothing(outside: Path) -> None:
    for name in ("impl_star", "impl_names"):
        backend = get_backend(f"module:{name}")
        assert backend.missing_api() == {}, name
        assert api_gaps(backend, list(PROPERTIES), True) == {}, name
        config = ModuleConfig("Linear", 32, 32, dtype="bfloat16", recipe="delayed-max-hybrid")
        assert backend.unsupported_reason("P1", config) is None
        why = backend.unsupported_reason("P13", config)
        assert why is not None and f"{name} exposes no FP8 quantizer of its own" in why
    lacking = get_backend("module:impl_no_fp8").missing_api()
    assert lacking == {"fp8": "impl_no_fp8 does not export fp8_autocast"}


def test_verify_passes_a_plain_reexport_p13_na_said_once(outside: Path, capsys) -> None:
    """The default slices (FP8, and impl's forced scaled_mm path, which a re-export keeps):
    nothing missing, exit 0, P13 n/a with its reason once."""
    out = _verify_p13_na_once(capsys, "impl_star", "--dtype", "bfloat16")
    assert "lacks part" not in out
    assert "path=scaled_mm: pass" in out or "scaled_mm         " in out


def test_planted_bug_in_an_outside_package_fails(outside: Path, capsys) -> None:
    argv = ["--backend", "module:biased_bias", "--module", "Linear", "--dtype", "float32"]
    argv += ["--property", "P1,P3,P5"]
    status, out = _verify([*argv, "--examples", "20", "--recipe", "none"], capsys)
    assert status == 1, out
    assert "bias.grad" in out and "reproduce: splitgrad verify --backend module:biased_bias" in out


#: The suite on float32 Linear cells only, high precision, 20 examples each.
FLOAT32_LINEAR = {"module": "Linear", "dtype": "float32", "recipe": "none", "examples": 20}


def _pytest(outside: Path, *args: str, cwd: Path, **suite: object) -> subprocess.CompletedProcess:
    """``pytest --pyargs splitgrad.properties`` with ``args``, and each keyword of ``suite`` as
    its ``--splitgrad-KEY VALUE`` option (``impl_path`` for ``--splitgrad-impl-path``)."""
    options = [a for k, v in suite.items() for a in (f"--splitgrad-{k.replace('_', '-')}", str(v))]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(outside), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("PYTEST_XDIST_WORKER", None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "splitgrad.properties",
            "-p",
            "no:cacheprovider",
            *options,
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=cwd,
        env=env,
    )


def _junit(path: Path) -> dict[str, str]:
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            node = tc.find(tag)
            if node is not None:
                status = (
                    tag
                    if tag != "skipped"
                    else ("xfailed" if "xfail" in (node.get("type") or "") else "skipped")
                )
        out[tc.get("name")] = status
    return out


def test_pytest_plugin_on_an_outside_package_with_xdist_and_junit(
    outside: Path, tmp_path: Path
) -> None:
    xml = tmp_path / "conformance.xml"
    proc = _pytest(
        outside,
        "-n",
        "2",
        f"--junitxml={xml}",
        cwd=tmp_path,
        backend="module:renamed_ref",
        module="Linear,GroupedLinear",
        property="P1,P4,P12,P17",
        examples=3,
        profile="ci",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = _junit(xml)
    # One test id per property x module x dtype x recipe, as splitgrad verify's cells.
    for tid in (
        "P1-Linear-float32-none",
        "P4-GroupedLinear-bfloat16-none",
        "P12-GroupedLinear-float32-none",
        "P17-Linear-bfloat16-all",
    ):
        assert results.get(f"test_property[{tid}]") == "passed", (tid, sorted(results))
    assert results["test_api_complete"] == "passed"
    assert "test_property[P12-Linear-float32-none]" not in results  # P12 is GroupedLinear only


def test_pytest_plugin_reports_missing_api_once_and_a_planted_bug(
    outside: Path, tmp_path: Path
) -> None:
    """A package lacking the split API and carrying a bug: one failing test_api_complete, the
    blocked cells skipped, the bug failing its cell, the rest passing."""
    xml = tmp_path / "gaps.xml"
    proc = _pytest(
        outside,
        f"--junitxml={xml}",
        "-rN",  # no short summary: it repeats the message in full where COLUMNS is wide
        cwd=tmp_path,
        backend="module:gappy_buggy",
        property="P1,P3,P4",
        **FLOAT32_LINEAR,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    results = _junit(xml)
    assert results == {
        "test_api_complete": "failure",
        "test_property[P1-Linear-float32-none]": "passed",
        "test_property[P3-Linear-float32-none]": "failure",
        "test_property[P4-Linear-float32-none]": "skipped",
    }, results
    assert proc.stdout.count("takes no delay_wgrad_compute") == 1
    assert "bias.grad" in proc.stdout and "reproduce: splitgrad verify" in proc.stdout


def test_pytest_plugin_declared_deviations_are_strict_xfails(outside: Path, tmp_path: Path) -> None:
    """A deviation that shows is an xfail with its sentence; one that does not show fails as
    XPASS(strict)."""
    proc = _pytest(
        outside,
        "-rxX",
        cwd=tmp_path,
        backend="class:declares:Backend",
        property="P1,P3",
        **FLOAT32_LINEAR,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "XFAIL" in proc.stdout and "bias gradient 2 % too large" in proc.stdout
    assert "XPASS(strict)" in proc.stdout and "made up: outputs off by a bias" in proc.stdout
    assert "1 failed" in proc.stdout and "1 xfailed" in proc.stdout


def test_pytest_plugin_passes_a_plain_reexport_and_names_it_in_the_header(
    outside: Path, tmp_path: Path
) -> None:
    """Same cells as the verify run above: test_api_complete passes, P13 skipped n/a with its
    reason said once; the header names the backend, device, profile, seed and torch."""
    import torch

    xml = tmp_path / "reexport.xml"
    proc = _pytest(
        outside,
        f"--junitxml={xml}",
        "-rs",
        cwd=tmp_path,
        backend="module:impl_star",
        module="Linear",
        property="P1,P13",
        dtype="bfloat16",
        examples=2,
        profile="ci",
        seed=7,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = _junit(xml)
    assert results["test_api_complete"] == "passed"
    assert results["test_property[P1-Linear-bfloat16-all-path=scaled_mm]"] == "passed"
    assert results["test_property[P13-Linear-bfloat16-all]"] == "skipped"
    assert proc.stdout.count("impl_star exposes no FP8 quantizer of its own") == 1, proc.stdout
    head = proc.stdout.split("collected", 1)[0]
    assert f"splitgrad conformance: backend module:impl_star ({outside / 'impl_star'}" in head
    assert f"device cpu, hypothesis profile ci, seed 7, torch {torch.__version__}" in head


def test_missing_fp8_fails_test_api_complete_as_verify_exits_2(
    outside: Path, tmp_path: Path, capsys
) -> None:
    """impl's modules without fp8_autocast: impl's forced FP8 path plans cells under FP8, so
    both routes report the gap (it used to be a silent skip and a passing test_api_complete)."""
    argv = ["--backend", "module:impl_no_fp8", "--module", "Linear", "--property", "P13"]
    status, out = _verify([*argv, "--dtype", "bfloat16", "--examples", "2"], capsys)
    assert status == 2, out
    assert "missing API: impl_no_fp8 does not export fp8_autocast (blocks P13)" in out
    xml = tmp_path / "no_fp8.xml"
    proc = _pytest(
        outside,
        f"--junitxml={xml}",
        "-rN",
        cwd=tmp_path,
        backend="module:impl_no_fp8",
        module="Linear",
        property="P13",
        dtype="bfloat16",
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = _junit(xml)
    assert results.pop("test_api_complete") == "failure"
    assert results and set(results.values()) == {"skipped"}, results
    assert proc.stdout.count("impl_no_fp8 does not export fp8_autocast -> blocks P13") == 1


def test_header_only_when_the_suite_is_asked_for() -> None:
    def config(*args: str) -> SimpleNamespace:
        plain = [a for a in args if not a.startswith("-")]
        return SimpleNamespace(invocation_params=SimpleNamespace(args=args), args=plain)

    assert not suite_requested(config("tests/test_budgets_meta.py", "-q"))
    assert suite_requested(config("--pyargs", "splitgrad.properties", "-n", "2"))
    assert suite_requested(config("tests", "--splitgrad-backend=module:mypkg"))
    assert suite_requested(config("site-packages/splitgrad/properties/test_conformance.py"))


# ---- the expected-failures file ---------------------------------------------------------------


XFAILS = """\
# made up, so that it shows as XPASS(strict)
test_conformance.py::test_property[P1-Linear-float32-none]

P3-Linear-float32-none # the planted 2 % bias gradient
test_api_complete      # no split API in this package yet
# a cell this run does not select: ignored
test_property[P4-GroupedLinear-bfloat16-none-path=grouped]
"""


def test_xfails_file_spellings_and_reasons() -> None:
    entries = xfails.parse_xfails(XFAILS, "xf.txt")
    assert {k: (e.reason, e.line) for k, e in entries.items()} == {
        "P1-Linear-float32-none": ("made up, so that it shows as XPASS(strict)", 2),
        "P3-Linear-float32-none": ("the planted 2 % bias gradient", 4),
        "test_api_complete": ("no split API in this package yet", 5),
        "P4-GroupedLinear-bfloat16-none-path=grouped": (
            "a cell this run does not select: ignored",
            7,
        ),
    }
    assert entries["P3-Linear-float32-none"].describe() == (
        "expected failure (xf.txt:4): the planted 2 % bias gradient"
    )
    for canonical in (
        "P1-Linear-bfloat16-all-path=scaled_mm",
        "P6-LayerNormMLP-bfloat16-mxfp8",
        "P1-GroupedLinear-float32-none-path=grouped-autocast=bfloat16",
    ):
        assert xfails.canonical_id(canonical) == canonical
        assert xfails.canonical_id(f"x.py::test_property[{canonical}]") == canonical


@pytest.mark.parametrize(
    ("line", "names"),
    [
        ("P4-Linaer-bfloat16-none", ["xf.txt:3", "'P4-Linaer-bfloat16-none'", "kind 'Linaer'"]),
        ("P44-Linear-float32-none", ["xf.txt:3", "property 'P44'"]),
        ("P4-Linear-float8-none", ["dtype 'float8'", "float32"]),
        ("P12-Linear-float32-none", ["P12 does not apply to Linear"]),
        ("P1-Linear-float32-none-path=fast", ["forced path 'fast'", "scaled_mm"]),
        ("P1-Linear-float32", ["is not a cell"]),
        # One grammar: the id as both runners print it, not a table row's words.
        ("P4 Linear float32", ["xf.txt:3", "is not a cell id", "PROPERTY-KIND-DTYPE-RECIPE"]),
        ("P4-Linear-float32-none-autocast=bfloat16-path=scaled_mm", ["is not a cell id"]),
        ("P3-Linear-float32-none", ["xf.txt:3", "listed already at line 1"]),
    ],
)
def test_xfails_file_names_a_line_that_names_no_cell(line: str, names: list[str]) -> None:
    with pytest.raises(xfails.XfailsFileError) as exc:
        xfails.parse_xfails(f"P3-Linear-float32-none  # bug\n\n{line}\n", "xf.txt")
    for name in names:
        assert name in str(exc.value), (name, str(exc.value))


def test_xfails_judge_verify_cells_strictly() -> None:
    entries = xfails.parse_xfails(
        "P3-Linear-float32-none  # known\nP1-Linear-bfloat16-all-path=scaled_mm\n"
        "P4-Linear-float32-none\n",
        "xf.txt",
    )
    failed = CellResult("P3", "Linear", "float32", status=FAIL, message="bias.grad off")
    fixed = CellResult("P1", "Linear", "bfloat16", "all", status=PASS, path="scaled_mm")
    na = CellResult("P4", "Linear", "float32", status=NA, message="no delay")
    other = CellResult("P5", "Linear", "float32", status=FAIL, message="real bug")
    notes = xfails.apply_to_cells([failed, fixed, na, other], entries)
    assert failed.status == xfails.XFAIL and "expected failure (xf.txt:1): known" in failed.message
    assert "bias.grad off" in failed.message
    assert fixed.status == FAIL and fixed.message.startswith("XPASS(strict)")
    assert "xf.txt:2" in fixed.message
    assert (na.status, other.status) == (NA, FAIL)
    assert notes == [
        "XFAIL P3-Linear-float32-none: expected failure (xf.txt:1): known",
        "XPASS(strict) P1-Linear-bfloat16-all-path=scaled_mm: xf.txt:2",
    ]


def test_xfails_option_for_verify_checks_the_file_while_parsing(tmp_path: Path, capsys) -> None:
    from splitgrad.properties.front.verify import build_parser

    good, bad = tmp_path / "good.txt", tmp_path / "bad.txt"
    good.write_text("P3-Linear-float32-none  # known\n")
    bad.write_text("P3-Linear-float32-none\nP3-Linear-float33-none\n")
    parser = build_parser()  # verify's own parser carries the option
    assert parser.parse_args([]).xfails == {}
    assert list(parser.parse_args(["--xfails", str(good)]).xfails) == ["P3-Linear-float32-none"]
    with pytest.raises(Exception) as exc:  # verify's parser raises its usage error (exit 2)
        parser.parse_args(["--xfails", str(bad)])
    text = str(exc.value) + capsys.readouterr().err
    assert f"{bad}:2: 'P3-Linear-float33-none': unknown dtype 'float33'" in text


def test_pytest_plugin_xfails_file_is_strict(outside: Path, tmp_path: Path) -> None:
    """Listed cells that fail are XFAIL (test_api_complete included), a listed cell that
    passes fails as XPASS(strict) with its reason, a listed cell outside the run is ignored."""
    listed = tmp_path / "splitgrad-xfails.txt"
    listed.write_text(XFAILS)
    xml = tmp_path / "xfails.xml"
    proc = _pytest(
        outside,
        f"--junitxml={xml}",
        "-rxX",
        cwd=tmp_path,
        backend="module:gappy_buggy",
        property="P1,P3",
        **FLOAT32_LINEAR,
        xfails=listed.name,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert _junit(xml) == {
        "test_api_complete": "xfailed",
        "test_property[P1-Linear-float32-none]": "failure",
        "test_property[P3-Linear-float32-none]": "xfailed",
    }
    assert "XPASS(strict)" in proc.stdout and "made up, so that it shows" in proc.stdout
    assert "the planted 2 % bias gradient" in proc.stdout
    assert f"expected failures: {listed} (4 listed, strict)" in proc.stdout


def test_pytest_plugin_refuses_an_xfails_file_naming_no_cell(outside: Path, tmp_path: Path):
    listed = tmp_path / "xf.txt"
    listed.write_text("P3-Linear-float32-none\nP4-Linaer-bfloat16-none  # typo\n")
    proc = _pytest(outside, "--splitgrad-xfails", str(listed), cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr + proc.stdout
    assert f"--splitgrad-xfails: {listed}:2: 'P4-Linaer-bfloat16-none': unknown kind" in err
    assert "Traceback" not in err


# ---- TransformerEngine's recipe classes, mapped by name ----------------------------------------


class _TEFormat(enum.Enum):
    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"


@dataclasses.dataclass
class _TEDelayed:
    margin: int = 0
    fp8_format: _TEFormat = _TEFormat.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True


@dataclasses.dataclass
class _TECurrent:
    fp8_format: _TEFormat = _TEFormat.HYBRID


@dataclasses.dataclass
class _TEMX:
    margin: int = 0
    fp8_format: _TEFormat = _TEFormat.E4M3


@dataclasses.dataclass
class _TEBlock:
    fp8_format: _TEFormat = _TEFormat.E4M3
    x_block_scaling_dim: int = 1


def _fake_te(**override) -> SimpleNamespace:
    """A stand-in for ``transformer_engine.common.recipe``: TE's class and field names."""
    names = {
        "__name__": "transformer_engine.common.recipe",
        "Format": _TEFormat,
        "DelayedScaling": _TEDelayed,
        "Float8CurrentScaling": _TECurrent,
        "MXFP8BlockScaling": _TEMX,
        "Float8BlockScaling": _TEBlock,
    }
    names.update(override)
    return SimpleNamespace(**{k: v for k, v in names.items() if v is not None})


def test_transformer_engine_recipes_mapped_by_name() -> None:
    from splitgrad.reference import fp8

    te = _fake_te()
    delayed = fp8.DelayedScaling(
        margin=2, fp8_format=fp8.Format.E4M3, amax_history_len=16, amax_compute_algo="most_recent"
    )
    assert to_transformer_engine_recipe(delayed, te) == _TEDelayed(
        2, _TEFormat.E4M3, 16, "most_recent"
    )
    assert to_transformer_engine_recipe(fp8.Float8CurrentScaling(), te) == _TECurrent(
        _TEFormat.HYBRID
    )
    assert to_transformer_engine_recipe(fp8.MXFP8BlockScaling(), te) == _TEMX(0, _TEFormat.E4M3)
    assert to_transformer_engine_recipe(fp8.Float8BlockScaling(), te) == _TEBlock(_TEFormat.E4M3)
    # Every recipe the harness draws maps.
    from splitgrad.properties.cases.strategies import RECIPES

    for name in RECIPES:
        mapped = to_transformer_engine_recipe(make_recipe(name), te)
        assert type(mapped).__name__.startswith("_TE"), name


def test_transformer_engine_recipe_without_a_counterpart_fails_naming_it() -> None:
    from splitgrad.reference import fp8

    @dataclasses.dataclass
    class OldDelayed:  # a TE whose DelayedScaling has no amax_compute_algo
        margin: int = 0
        fp8_format: _TEFormat = _TEFormat.HYBRID
        amax_history_len: int = 1024

    with pytest.raises(RecipeMappingError, match=r"DelayedScaling\.amax_compute_algo \(= 'max'\)"):
        to_transformer_engine_recipe(fp8.DelayedScaling(), _fake_te(DelayedScaling=OldDelayed))
    with pytest.raises(RecipeMappingError, match="has no MXFP8BlockScaling"):
        to_transformer_engine_recipe(fp8.MXFP8BlockScaling(), _fake_te(MXFP8BlockScaling=None))

    class NoHybrid(enum.Enum):
        E4M3 = "e4m3"

    with pytest.raises(RecipeMappingError, match=r"fp8_format = <Format.HYBRID.*no Format.HYBRID"):
        to_transformer_engine_recipe(fp8.Float8CurrentScaling(), _fake_te(Format=NoHybrid))


@pytest.mark.parametrize(
    ("suite", "needle"),
    [
        ({"impl_path": "fast"}, "--splitgrad-impl-path: unknown impl path 'fast'"),
        ({"examples": "many"}, "--splitgrad-examples: not a whole number: 'many'"),
    ],
)
def test_pytest_plugin_refuses_an_option_naming_nothing(
    outside: Path, tmp_path: Path, suite, needle
):
    """The plugin reads its options into the same session options as verify, with verify's
    rule for what a list may name; a bad one stops the run naming the option."""
    proc = _pytest(outside, cwd=tmp_path, **suite)
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr + proc.stdout
    assert needle in err and "Traceback" not in err
