"""ci/device.sh, the one prepared run for a borrowed GPU, checked on the CPU: its dry run goes
through every step up to the first CUDA call, its report turns a GPU run's files into one JSON
and docs/gpu-without-gpu.md's table (and fails on what a GPU run can get wrong), and the GPU
commands refuse a machine without CUDA with exit status 2 and one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))
import device_report  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")

GPU_COMMANDS = {
    "verify": [sys.executable, "-m", "splitgrad.cli", "verify", "--device", "cuda"],
    "bench": [sys.executable, "-m", "splitgrad.cli", "bench", "--device", "cuda"],
    "entry_memory": [sys.executable, "-m", "splitgrad.bench.entry_memory", "--device", "cuda"],
}


@no_cuda
@pytest.mark.parametrize("name", list(GPU_COMMANDS))
def test_gpu_commands_without_cuda_exit_2_with_one_line(name):
    """Bad input: a --device cuda run where torch sees no GPU exits 2 and says why in one line,
    nothing else (no traceback, no table)."""
    done = subprocess.run(GPU_COMMANDS[name], capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1, lines
    assert "--device cuda" in lines[0] and "torch.cuda.is_available() is False" in lines[0]


@no_cuda
def test_dry_run_goes_up_to_the_first_cuda_call(tmp_path):
    """``bash ci/device.sh --dry-run``: the environment check, the offline editable install (pip
    --dry-run), pytest collecting the cuda-marked tests and the trace tier, verify / bench / the
    GPU memory table stopping at their CUDA check, the fake-tensor memory table, and the report:
    one JSON (ok), the GPU table, a summary and the logs, within the device tool's 8 files."""
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, TMPDIR=str(tmp_path))
    done = subprocess.run(
        ["bash", str(ROOT / "ci" / "device.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "device.json",
        "gpu-table.md",
        "logs.tar.gz",
        "summary.txt",
    ]
    report = json.loads((out / "device.json").read_text())
    assert report["ok"] and report["dry_run"], report["problems"]
    steps = {s["name"]: s["exit"] for s in report["steps"]}
    assert steps == {
        "env": 0,
        "install": 0,
        "cuda-tests": 0,
        "trace": 0,
        "verify": 2,
        "bench": 2,
        "memory": 2,
        "memory-fake": 0,
    }
    assert report["collected"]["cuda-tests"] >= 20 and report["collected"]["trace"] >= 20
    assert report["packages"]["torch"] == torch.__version__
    rows = report["memory"]["fake_rows"]
    assert len(rows) == 15 and all(r["held_bytes"] == r["entry_bytes"] for r in rows)
    assert "dry run, passed" in (out / "gpu-table.md").read_text()
    with tarfile.open(out / "logs.tar.gz") as logs:
        names = {Path(n).name for n in logs.getnames()}
    assert {"verify.log", "bench.log", "memory-fake.json", "steps.tsv"} <= names
    assert not list(tmp_path.glob("splitgrad-device.*")), "work folder left behind"


def _gpu_run(work: Path, *, missed: bool = False, failing: bool = False, differ: bool = False):
    """The files a GPU run of ci/device.sh leaves, written by hand."""
    steps = ["env", "install", "cuda-tests", "trace", "verify", "bench", "memory", "memory-fake"]
    (work / "steps.tsv").write_text("".join(f"{s}\t0\t10\t60\n" for s in steps))
    (work / "machine.json").write_text(
        json.dumps(
            {
                "torch": "2.11.0+cu130",
                "cuda": "13.0",
                "device_name": "NVIDIA H200",
                "capability": [9, 0],
            }
        )
    )
    (work / "env.log").write_text(json.dumps({"torch": "2.11.0+cu130", "dualpipe": None}) + "\n")
    failure = (
        '<testcase classname="tests.test_impl_fp8" name="test_cuda_fp8[Linear-block]">'
        '<failure message="mat2 must be col_major, got stride (1024, 1)"/></testcase>'
    )
    (work / "cuda-tests.xml").write_text(
        f'<testsuites><testsuite tests="27" failures="{int(failing)}" errors="0" skipped="0">'
        f"{failure if failing else ''}</testsuite></testsuites>"
    )
    (work / "trace.xml").write_text(
        '<testsuite tests="65" failures="0" errors="0" skipped="0"></testsuite>'
    )
    path = {
        "gemm": "forward",
        "call": "torch._scaled_mm TensorWise",
        "path": "fast",
        "reason": "tensor scaling, aligned",
        "shapes": [[2048, 4096, 1024]],
    }
    message = "splitgrad: FP8 forward GEMM E4M3 A (2048, 1024) row-major ... fell back"
    (work / "verify.json").write_text(
        json.dumps(
            {
                "cells": [{"status": "PASS", "label": "P1 Linear bfloat16"}],
                "gemm_paths": [path],
                "fast_paths_missed": [message] if missed else [],
            }
        )
    )
    row = {"module": "Linear", "dtype": "bfloat16", "split": 1.01, "bare": 1.05, "nn": 0.98}
    row |= {"generic_time": 0.9, "generic_peak": 0.8, "fused_peak": 1.0, "gemm_paths": [path]}
    (work / "bench.json").write_text(json.dumps({"rows": [row], "fp8": [], "machine": "H200"}))
    mem = {"module": "Linear", "precision": "bf16", "entry_bytes": 301989888}
    mem["held_bytes"] = mem["entry_bytes"]
    gpu = dict(mem, held_bytes=mem["held_bytes"] + (4096 if differ else 0))
    (work / "memory.json").write_text(json.dumps({"rows": [gpu]}))
    (work / "memory-fake.json").write_text(json.dumps({"rows": [mem]}))


def test_report_of_a_passing_gpu_run(tmp_path):
    """A clean GPU run gives ok, and the GPU table names the machine, the counts, the memory
    check and each GEMM path with its call and reason."""
    _gpu_run(tmp_path)
    report = device_report.collect(tmp_path, dry_run=False)
    assert report["ok"], report["problems"]
    text = device_report.table(report)
    assert "NVIDIA H200 (sm90)" in text and "27 passed, 0 failed" in text
    assert "1 rows equal, byte for byte" in text and "| fast paths missed | none |" in text
    assert "| Linear bfloat16 | forward | fast | `torch._scaled_mm TensorWise` |" in text


@pytest.mark.parametrize(
    "fault,problem",
    [
        ("failing", "mat2 must be col_major"),
        ("missed", "fast path missed: splitgrad: FP8 forward GEMM"),
        ("differ", "memory: Linear bf16 held_bytes"),
    ],
)
def test_report_fails_a_gpu_run_that_went_wrong(tmp_path, fault, problem):
    """A failed test (its message: GEMM, layout), a fast path the GPU refused, or GPU memory
    figures that differ from the fake-tensor ones make the run fail, naming the problem."""
    _gpu_run(tmp_path, **{fault: True})
    report = device_report.collect(tmp_path, dry_run=False)
    assert not report["ok"]
    assert any(problem in p for p in report["problems"]), report["problems"]
    assert "FAILED" in device_report.table(report)


def test_report_fails_a_step_that_ran_out_of_time(tmp_path):
    """A step killed at its limit (timeout's exit 124) or skipped for lack of time (125) fails
    the run, with the end of its log in the JSON."""
    _gpu_run(tmp_path)
    (tmp_path / "steps.tsv").write_text(
        (tmp_path / "steps.tsv").read_text().replace("verify\t0", "verify\t124")
    )
    (tmp_path / "verify.log").write_text("cell 17/244\n")
    report = device_report.collect(tmp_path, dry_run=False)
    assert "step verify: exit 124" in report["problems"]
    (verify,) = [s for s in report["steps"] if s["name"] == "verify"]
    assert verify["log_tail"] == "cell 17/244"


def test_verify_records_the_gemm_paths_it_took(tmp_path):
    """splitgrad verify's JSON carries the GEMM path decisions of its run (on the CPU: the
    portable grouped loop, and why) and the fast paths a GPU missed (none here)."""
    from splitgrad.properties.front import verify

    path = tmp_path / "v.json"
    args = ["--module", "GroupedLinear", "--dtype", "bfloat16", "--property", "P1"]
    args += ["--recipe", "none", "--impl-path", "none", "--autocast", "none"]
    assert verify.main([*args, "--examples", "1", "--quiet", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["fast_paths_missed"] == []
    grouped = [p for p in data["gemm_paths"] if p["gemm"] == "grouped forward+dgrad"]
    assert grouped and all(p["path"] == "portable" for p in grouped), data["gemm_paths"]
    assert "auto on cpu" in grouped[0]["reason"]
