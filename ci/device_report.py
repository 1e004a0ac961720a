"""``ci/device.sh``'s report: one JSON from the run's files, and docs/gpu-without-gpu.md's GPU
table from it.

    python ci/device_report.py collect WORKDIR device.json [--dry-run]   # exit 1 if not ok
    python ci/device_report.py table device.json                         # Markdown
    python ci/device_report.py summary device.json                       # a few lines

``collect`` reads what the steps left in WORKDIR (steps.tsv, machine.json, env.log, the JUnit
XML of the pytest steps, verify.json, bench.json, memory.json, memory-fake.json) and decides
``ok``: every step exited 0 (in a dry run: pytest collected, verify, bench and the GPU memory
table stopped at their CUDA check with exit status 2, the fake memory table ran), no test or
cell failed, no fast path was missed, and the GPU's memory figures equal the fake-tensor ones
byte for byte.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SCHEMA = 1
#: Steps that, in a dry run on a machine without CUDA, end at their CUDA check (exit 2).
STOP_AT_CUDA = ("verify", "bench", "memory")


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _steps(work: Path) -> list[dict]:
    out = []
    for line in (
        (work / "steps.tsv").read_text().splitlines() if (work / "steps.tsv").exists() else []
    ):
        name, rc, seconds, limit = line.split("\t")
        out.append({"name": name, "exit": int(rc), "seconds": int(seconds), "limit": int(limit)})
    return out


def _junit(path: Path) -> dict | None:
    """Counts and the failures of a JUnit XML file (None when absent)."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failures = []
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
        for case in suite.iter("testcase"):
            for bad in [*case.iter("failure"), *case.iter("error")]:
                first = (bad.get("message") or "").splitlines()[:1]
                failures.append(f"{case.get('classname')}::{case.get('name')}: {''.join(first)}")
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    counts["failed"] = failures
    return counts


def _collected(log: Path) -> int | None:
    """Tests a ``--collect-only -q`` run listed (dry run)."""
    for line in reversed(_tail(log, 5).splitlines()):
        words = line.split()
        if "collected" in words or "tests" in line and "collected" in line:
            try:
                return int(words[0].split("/")[0])
            except (ValueError, IndexError):
                return None
    return None


def _verify(data) -> dict | None:
    if not data:
        return None
    statuses: dict[str, int] = {}
    failed = []
    for cell in data.get("cells", []):
        statuses[cell["status"]] = statuses.get(cell["status"], 0) + 1
        if cell["status"] in ("FAIL", "ERROR"):
            failed.append(
                f"{cell.get('label', cell.get('property_id'))}: {cell.get('message', '')[:300]}"
            )
    return {
        "cells": len(data.get("cells", [])),
        "statuses": statuses,
        "failed": failed,
        "gemm_paths": data.get("gemm_paths", []),
        "fast_paths_missed": data.get("fast_paths_missed", []),
    }


def _bench(data) -> dict | None:
    if not data:
        return None
    keep = ("module", "dtype", "split", "bare", "nn", "generic_time", "generic_peak", "fused_peak")
    rows = [
        {k: r.get(k) for k in keep} | {"gemm_paths": r.get("gemm_paths", [])}
        for r in data.get("rows", [])
    ]
    fp8 = [
        {k: r.get(k) for k in ("recipe", "wgrad_ms", "wgrad_fused_ms", "entry_mb", "gemm_paths")}
        for r in data.get("fp8", [])
    ]
    return {
        "machine": data.get("machine"),
        "shapes": data.get("shapes"),
        "rows": rows,
        "fp8": fp8,
        "fast_paths_missed": data.get("fast_paths_missed", []),
    }


def _memory(device, fake) -> dict | None:
    if not device and not fake:
        return None
    out = {"device_rows": (device or {}).get("rows", []), "fake_rows": (fake or {}).get("rows", [])}
    fake_by = {(r["module"], r["precision"]): r for r in out["fake_rows"]}
    mismatches = []
    for r in out["device_rows"]:
        f = fake_by.get((r["module"], r["precision"]))
        for key in ("entry_bytes", "held_bytes"):
            if f is None or f[key] != r[key]:
                mismatches.append(
                    f"{r['module']} {r['precision']} {key}: GPU {r[key]}, fake {f and f[key]}"
                )
    out["mismatches"] = mismatches
    out["exact"] = bool(out["device_rows"]) and not mismatches
    return out


def collect(work: Path, dry_run: bool) -> dict:
    steps = _steps(work)
    by_name = {s["name"]: s for s in steps}
    env_lines = _tail(work / "env.log", 40).splitlines()
    packages = _read_json_line(env_lines[-1]) if env_lines else None
    report = {
        "schema": SCHEMA,
        "dry_run": dry_run,
        "machine": _read_json(work / "machine.json"),
        "packages": packages,
        "steps": steps,
        "cuda_tests": _junit(work / "cuda-tests.xml"),
        "trace_tests": _junit(work / "trace.xml"),
        "verify": _verify(_read_json(work / "verify.json")),
        "bench": _bench(_read_json(work / "bench.json")),
        "memory": _memory(_read_json(work / "memory.json"), _read_json(work / "memory-fake.json")),
    }
    if dry_run:
        report["collected"] = {
            "cuda-tests": _collected(work / "cuda-tests.log"),
            "trace": _collected(work / "trace.log"),
        }
    missed = []
    for part in (report["verify"], report["bench"]):
        missed += (part or {}).get("fast_paths_missed", [])
    report["fast_paths_missed"] = sorted(set(missed))
    problems = []
    for s in steps:
        log = work / f"{s['name']}.log"
        if dry_run and s["name"] in STOP_AT_CUDA:
            # Exit status 2 is also a usage error: the one line must name the CUDA check.
            lines = _tail(log).splitlines()
            stopped = s["exit"] == 2 and len(lines) == 1 and "is_available() is False" in lines[0]
            if not stopped:
                problems.append(f"step {s['name']}: did not stop at its CUDA check alone")
                s["log_tail"] = _tail(log)
        elif s["exit"] != 0:
            problems.append(f"step {s['name']}: exit {s['exit']}")
            s["log_tail"] = _tail(log)
    for name in (
        "env",
        "install",
        "cuda-tests",
        "trace",
        "verify",
        "bench",
        "memory",
        "memory-fake",
    ):
        if name not in by_name:
            problems.append(f"step {name}: did not run")
    for key in ("cuda_tests", "trace_tests"):
        problems += [f"{key}: {f}" for f in (report[key] or {}).get("failed", [])]
    problems += [f"verify: {f}" for f in (report["verify"] or {}).get("failed", [])]
    problems += [f"fast path missed: {m}" for m in report["fast_paths_missed"]]
    memory = report["memory"] or {}
    problems += [f"memory: {m}" for m in memory.get("mismatches", [])]
    if dry_run:
        for name, n in report["collected"].items():
            if not n:
                problems.append(f"dry run: {name} collected no test")
        if not memory.get("fake_rows"):
            problems.append("dry run: the fake-tensor memory table has no rows")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def _read_json_line(line: str):
    try:
        return json.loads(line)
    except ValueError:
        return None


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def table(report: dict) -> str:
    """The GPU tables of docs/gpu-without-gpu.md (Markdown)."""
    m = report.get("machine") or {}
    where = m.get("device_name") or "no GPU (dry run)"
    cap = m.get("capability")
    lines = [
        "| check | result |",
        "|---|---|",
        f"| machine | {where}{f' (sm{cap[0]}{cap[1]})' if cap else ''}, torch {m.get('torch')}, "
        f"CUDA {m.get('cuda')} |",
    ]

    def tests(key: str, label: str) -> None:
        t = report.get(key)
        if t:
            lines.append(
                f"| {label} | {t['passed']} passed, {len(t['failed'])} failed, "
                f"{t['skipped']} skipped |"
            )
        elif report.get("dry_run"):
            n = (report.get("collected") or {}).get(
                "cuda-tests" if key == "cuda_tests" else "trace"
            )
            lines.append(f"| {label} | not run (dry run; {n} collected) |")

    tests("cuda_tests", "cuda-marked tests")
    tests("trace_tests", "cuda_trace tier on this torch")
    v = report.get("verify")
    if v:
        counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(v["statuses"].items()))
        lines.append(f"| splitgrad verify --device cuda | {v['cells']} cells: {counts} |")
    b = report.get("bench")
    if b:
        for r in b["rows"]:
            lines.append(
                f"| bench {r['module']} {r['dtype']} | split {r['split']:.2f}, "
                f"bare {r['bare']:.2f}, nn {r['nn']:.2f}, generic peak {r['generic_peak']:.2f} |"
            )
    mem = report.get("memory") or {}
    if mem.get("device_rows"):
        verdict = "equal, byte for byte" if mem["exact"] else f"{len(mem['mismatches'])} differ"
        rows = len(mem["device_rows"])
        lines.append(f"| queued-entry memory, GPU vs fake tensors | {rows} rows {verdict} |")
    missed = report.get("fast_paths_missed") or []
    if not report.get("dry_run"):
        lines.append(f"| fast paths missed | {len(missed) or 'none'} |")
    status = (
        "passed" if report.get("ok") else f"FAILED ({len(report.get('problems', []))} problems)"
    )
    lines.append(f"| run | {'dry run, ' if report.get('dry_run') else ''}{status} |")
    paths = []
    for r in (b or {}).get("rows", []):
        for p in r["gemm_paths"]:
            paths.append((f"{r['module']} {r['dtype']}", p))
    for r in (b or {}).get("fp8", []):
        for p in r["gemm_paths"]:
            paths.append((f"Linear fp8:{r['recipe']}", p))
    if paths:
        lines += ["", "| module | GEMM | path | call | why |", "|---|---|---|---|---|"]
        for who, p in paths:
            lines.append(f"| {who} | {p['gemm']} | {p['path']} | `{p['call']}` | {p['reason']} |")
    return "\n".join(lines)


def summary(report: dict) -> str:
    mode = "dry run " if report["dry_run"] else ""
    lines = [f"ci/device.sh: {mode}{'OK' if report['ok'] else 'FAILED'}"]
    lines += [f"  {s['name']}: exit {s['exit']} after {s['seconds']} s" for s in report["steps"]]
    lines += [f"  problem: {p}" for p in report["problems"]]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "collect":
        report = collect(Path(argv[1]), "--dry-run" in argv[3:])
        Path(argv[2]).write_text(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    if len(argv) == 2 and argv[0] in ("table", "summary"):
        report = json.loads(Path(argv[1]).read_text())
        print(table(report) if argv[0] == "table" else summary(report))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
