"""The harness pointed at packages that are not splitgrad's: ``module:NAME``, ``path:DIR``,
``class:MODULE:ATTR``, a package lacking part of SPEC's API, and the pytest plugin run the way
an outside project's CI runs it (``pytest --pyargs splitgrad.properties ...``, with xdist and
JUnit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

import pytest
from outside_packages import write_packages
from splitgrad.properties.backends import get_backend
from splitgrad.properties.strategies import ModuleConfig
from splitgrad.properties.verify import main


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    root = write_packages(tmp_path_factory.mktemp("outside"))
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
    assert backend.missing_api() == {"fp8_quantizer": backend.missing_api()["fp8_quantizer"]}
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


def test_fp8_gap_only_when_a_recipe_is_asked(outside: Path, capsys) -> None:
    argv = ["--backend", "module:renamed_ref", "--module", "Linear", "--examples", "2"]
    status, out = _verify([*argv, "--property", "P1,P13", "--recipe", "delayed"], capsys)
    assert status == 2, out
    assert "missing API: renamed_ref has no FP8 quantizer" in out and "blocks P13" in out
    assert "P1        Linear" in out and "FAIL" not in out


def test_planted_bug_in_an_outside_package_fails(outside: Path, capsys) -> None:
    argv = ["--backend", "module:biased_bias", "--module", "Linear", "--dtype", "float32"]
    argv += ["--property", "P1,P3,P5"]
    status, out = _verify([*argv, "--examples", "20", "--recipe", "none"], capsys)
    assert status == 1, out
    assert "bias.grad" in out and "reproduce: splitgrad verify --backend module:biased_bias" in out


def _pytest(outside: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
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
        "--splitgrad-backend",
        "module:renamed_ref",
        "--splitgrad-module",
        "Linear,GroupedLinear",
        "--splitgrad-property",
        "P1,P4,P12,P17",
        "--splitgrad-examples",
        "3",
        "--splitgrad-profile",
        "ci",
        "-n",
        "2",
        f"--junitxml={xml}",
        cwd=tmp_path,
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
        "--splitgrad-backend",
        "module:gappy_buggy",
        "--splitgrad-module",
        "Linear",
        "--splitgrad-property",
        "P1,P3,P4",
        "--splitgrad-dtype",
        "float32",
        "--splitgrad-recipe",
        "none",
        "--splitgrad-examples",
        "20",
        f"--junitxml={xml}",
        "-rN",  # no short summary: it repeats the message in full where COLUMNS is wide
        cwd=tmp_path,
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
        "--splitgrad-backend",
        "class:declares:Backend",
        "--splitgrad-module",
        "Linear",
        "--splitgrad-property",
        "P1,P3",
        "--splitgrad-dtype",
        "float32",
        "--splitgrad-recipe",
        "none",
        "--splitgrad-examples",
        "20",
        "-rxX",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "XFAIL" in proc.stdout and "bias gradient 2 % too large" in proc.stdout
    assert "XPASS(strict)" in proc.stdout and "made up: outputs off by a bias" in proc.stdout
    assert "1 failed" in proc.stdout and "1 xfailed" in proc.stdout
