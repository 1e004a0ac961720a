"""``splitgrad verify``: run the property campaign against one backend and print a table.

    splitgrad verify [--backend impl|reference|torch-split|transformer_engine]
                     [--module KIND ...] [--dtype DTYPE ...] [--device cpu|cuda]
                     [--recipe none|delayed|current|mxfp8|block|all ...]
                     [--property P4 ...] [--examples N] [--profile dev|ci|nightly|gpu]
                     [--json PATH] [--junit PATH] [--case JSON]

Each row is property x module x dtype (x FP8 recipe family when FP8 is on): examples run, worst
error/budget ratio, result. A failure prints the shrunk case and one command line that replays
it, and the exit status is 1. Known deviations that a backend declares are printed as
``deviates`` with their description (they do not fail the run; they are never shown as a pass).
Bad options exit with status 2 and a message.

Without ``--recipe`` the run is the high-precision campaign plus a small FP8 slice (bf16, the
recipe drawn from all of them per example, :data:`FP8_SLICE_EXAMPLES` examples per cell);
``--recipe none`` leaves FP8 out, ``--recipe delayed,mxfp8`` runs full cells per family
(``all``: every family).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

from .campaign import DEVIATION, ERROR, FAIL, NA, PASS, CellResult, run_case, run_cell
from .registry import PROPERTIES, applicable
from .strategies import DTYPES, KINDS, LOW_PRECISION_DTYPES, RECIPE_FAMILIES, RECIPES, Case

__all__ = ["main", "build_parser", "DEFAULT_EXAMPLES", "FP8_SLICE_EXAMPLES", "RECIPE_CHOICES"]

# About two minutes for the default campaign on 2 CPU cores (see README).
DEFAULT_EXAMPLES = 60
_PROFILES = ("dev", "ci", "nightly", "gpu")
RECIPE_CHOICES = ("none", *RECIPE_FAMILIES, "all")
# The FP8 slice of the default run: few examples, bf16, every recipe drawn in one cell, the
# properties FP8 changes most (accuracy, delayed == non-delayed, bad shapes, grouped, quantizers).
FP8_SLICE_EXAMPLES = 10
FP8_SLICE_PROPERTIES = ("P1", "P2", "P3", "P4", "P6", "P10", "P12", "P13")
FP8_SLICE_DTYPES = ("bfloat16",)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # no traceback, exit status 2
        raise _UsageError(message)


def _split_list(values: Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str]:
    if not values:
        return []
    out: list[str] = []
    for v in values:
        for item in v.split(","):
            item = item.strip()
            if not item:
                continue
            if what == "property":
                item = item.upper()
            if item not in allowed:
                raise _UsageError(f"unknown {what} {item!r}; expected one of {', '.join(allowed)}")
            if item not in out:
                out.append(item)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="splitgrad verify", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--backend",
        default="impl",
        help="impl (default), reference, torch-split, transformer_engine, or path:DIR",
    )
    p.add_argument(
        "--module",
        action="append",
        metavar="KIND",
        help=f"module kind(s), repeatable or comma-separated (default: all of {', '.join(KINDS)})",
    )
    p.add_argument(
        "--dtype",
        action="append",
        help=f"dtype(s) among {', '.join(DTYPES)} (default: float32,bfloat16)",
    )
    p.add_argument(
        "--device", default=None, choices=("cpu", "cuda"), help="default: cpu (cuda for TE)"
    )
    p.add_argument(
        "--recipe",
        action="append",
        metavar="FAMILY",
        help=f"FP8 recipe famil(ies) among {', '.join(RECIPE_CHOICES)}, repeatable or "
        "comma-separated (default: high precision plus a small FP8 slice; none: no FP8)",
    )
    p.add_argument(
        "--property", action="append", metavar="PID", help="property id(s) P1..P13 (default: all)"
    )
    p.add_argument(
        "--examples",
        type=int,
        default=None,
        help=f"hypothesis examples per cell (default {DEFAULT_EXAMPLES}; "
        "the profile's with --profile)",
    )
    p.add_argument(
        "--profile", default=None, choices=_PROFILES, help="hypothesis profile (default ci)"
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument("--junit", type=Path, metavar="PATH", help="write the results as JUnit XML")
    p.add_argument("--case", metavar="JSON", help="replay one case (needs exactly one --property)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _progress(done: int, total: int, label: str, enabled: bool) -> None:
    if not enabled:
        return
    width = 28
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\r" + " " * (width + 60) + "\r")


def format_table(cells: list[CellResult]) -> str:
    """The property x module x dtype table, with a recipe column when some cell runs FP8."""
    fp8 = any(c.recipe != "none" for c in cells)
    header = ("property", "module", "dtype", *(("recipe",) if fp8 else ()))
    header += ("examples", "worst/budget", "result")
    left = {0, 1, 2, len(header) - 1} | ({3} if fp8 else set())
    rows = [header]
    for c in cells:
        rows.append(
            (
                c.property_id,
                c.kind,
                c.dtype,
                *((c.recipe,) if fp8 else ()),
                str(c.examples) if c.status != NA else "-",
                c.ratio_text,
                c.status,
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, r in enumerate(rows):
        lines.append(
            "  ".join(
                v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _write_junit(path: Path, backend: str, cells: list[CellResult], elapsed: float) -> None:
    suite = ET.Element(
        "testsuite",
        name=f"splitgrad verify --backend {backend}",
        tests=str(len(cells)),
        failures=str(sum(c.status == FAIL for c in cells)),
        errors=str(sum(c.status == ERROR for c in cells)),
        skipped=str(sum(c.status in (NA, DEVIATION) for c in cells)),
        time=f"{elapsed:.3f}",
    )
    for c in cells:
        tc = ET.SubElement(
            suite,
            "testcase",
            classname=f"splitgrad.verify.{c.property_id}",
            name=f"{c.kind}[{c.dtype}]" + (f"[{c.recipe}]" if c.recipe != "none" else ""),
            time=f"{c.seconds:.3f}",
        )
        if c.status == FAIL:
            f = ET.SubElement(
                tc, "failure", message=c.message.splitlines()[0][:500] if c.message else "failed"
            )
            f.text = f"{c.message}\n\nreproduce: {c.repro}"
        elif c.status == ERROR:
            ET.SubElement(tc, "error", message=c.message[:500])
        elif c.status == DEVIATION:
            ET.SubElement(tc, "skipped", message=f"KNOWN DEVIATION: {c.deviation}").text = c.message
        elif c.status == NA:
            ET.SubElement(tc, "skipped", message=c.message)
        else:
            ET.SubElement(
                tc, "system-out"
            ).text = f"examples={c.examples} worst_ratio={c.ratio_text}"
    root = ET.Element("testsuites")
    root.append(suite)
    path.parent.mkdir(parents=True, exist_ok=True)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _replay(backend, properties: list[str], text: str) -> int:
    if len(properties) != 1:
        raise _UsageError("--case needs exactly one --property")
    try:
        case = Case.from_json(text)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    pid = properties[0]
    why = backend.unsupported_reason(pid, case.config)
    if why:
        print(f"{pid} n/a on {backend.name}: {why}")
        return 0
    from .kink import CaseRejected

    try:
        result = run_case(backend, pid, case)
    except CaseRejected as exc:
        print(f"{pid} rejected on {backend.name}: {case.config.label()}: {exc}")
        return 0
    except Exception as exc:
        dev = backend.deviation_for(pid, case, str(exc))
        print(
            f"{pid} {'DEVIATES (known: ' + dev.summary + ')' if dev else 'FAIL'} "
            f"on {backend.name}: {case.config.label()}"
        )
        print(f"  {type(exc).__name__}: {exc}")
        return 0 if dev else 1
    print(f"{pid} pass on {backend.name}: {case.config.label()} (worst/budget {result.ratio})")
    return 0


def main(argv: Sequence[str]) -> int:
    """Entry point of ``splitgrad verify``; returns the exit status."""
    try:
        return _main(list(argv))
    except _UsageError as exc:
        print(f"splitgrad verify: error: {exc}\nTry 'splitgrad verify --help'.", file=sys.stderr)
        return 2


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    from .backends import BACKEND_NAMES, BackendUnavailable, get_backend
    from .profiles import active_profile_name

    name = args.backend
    if name not in BACKEND_NAMES and not name.startswith("path:"):
        raise _UsageError(f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}")
    try:
        backend = get_backend(name)
        why = backend.unavailable_reason()
    except BackendUnavailable as exc:
        why = str(exc)
    if why:
        print(f"splitgrad verify: backend {name!r} is not available: {why}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if name == "transformer_engine" else "cpu")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print(
                "splitgrad verify: --device cuda, but torch.cuda.is_available() is False",
                file=sys.stderr,
            )
            return 2
    kinds = _split_list(args.module, KINDS, "module") or list(KINDS)
    dtypes = _split_list(args.dtype, DTYPES, "dtype") or ["float32", "bfloat16"]
    properties = _split_list(args.property, list(PROPERTIES), "property") or list(PROPERTIES)
    families = _split_list(args.recipe, RECIPE_CHOICES, "recipe")
    if "all" in families:
        families = [f for f in families if f != "all"] + [
            f for f in RECIPE_FAMILIES if f not in families
        ]
    if args.examples is not None and args.examples < 1:
        raise _UsageError(f"--examples must be at least 1, got {args.examples}")
    from .profiles import load_profile

    load_profile()
    profile = args.profile or (
        "ci" if not os.environ.get("HYPOTHESIS_PROFILE") else active_profile_name()
    )
    examples = (
        args.examples if args.examples is not None else (None if args.profile else DEFAULT_EXAMPLES)
    )
    if args.case:
        return _replay(backend, properties, args.case)

    # (property, kind, dtype, recipe label, recipes drawn, examples per cell)
    plan: list[tuple[str, str, str, str, tuple, int | None]] = []
    slices: list[tuple[str, tuple, tuple[str, ...], tuple[str, ...], int | None]] = []
    if not families or "none" in families:
        slices.append(("none", (None,), tuple(properties), tuple(dtypes), examples))
    for family in families:
        if family != "none":
            slices.append(
                (family, RECIPE_FAMILIES[family], tuple(properties), tuple(dtypes), examples)
            )
    if not families:
        # The default run's small FP8 slice (explicit --property/--dtype narrow it further).
        slice_props = tuple(p for p in properties if p in FP8_SLICE_PROPERTIES)
        slice_dtypes = tuple(d for d in dtypes if d in FP8_SLICE_DTYPES) or FP8_SLICE_DTYPES
        n = min(examples, FP8_SLICE_EXAMPLES) if examples is not None else None
        slices.append(("all", tuple(RECIPES), slice_props, slice_dtypes, n))
    for label, recipes, props, cell_dtypes, n in slices:
        for pid in props:
            if pid == "P13" and label == "none" and len(properties) > 1:
                continue  # P13 needs FP8: only listed when asked for alone
            for kind in kinds:
                if not applicable(pid, kind):
                    continue
                for dtype in cell_dtypes:
                    plan.append((pid, kind, dtype, label, recipes, n))
    show = not args.quiet and sys.stderr.isatty()
    fp8_cells = sum(1 for p in plan if p[3] != "none")
    print(
        f"splitgrad verify: backend {backend.name}, device {device}, profile {profile}, "
        f"{examples or 'profile default'} examples per cell, {len(plan)} cells"
        + (f" ({fp8_cells} under FP8)" if fp8_cells else "")
    )
    for note in backend.notes:
        print(f"  note: {note}")
    cells: list[CellResult] = []
    start = time.perf_counter()
    for i, (pid, kind, dtype, label, recipes, n) in enumerate(plan):
        _progress(i, len(plan), f"{pid} {kind} {dtype} {label}", show)
        if pid in ("P1", "P2", "P3") and dtype not in LOW_PRECISION_DTYPES:
            cell = CellResult(
                pid,
                kind,
                dtype,
                label,
                status=NA,
                message="no wider dtype to measure error against",
            )
        else:
            cell = run_cell(
                backend,
                pid,
                kind,
                dtype,
                device=device,
                examples=n,
                profile=profile,
                recipes=recipes,
                recipe_label=label,
            )
        cells.append(cell)
        if args.fail_fast and cell.status in (FAIL, ERROR):
            break
    _progress(len(plan), len(plan), "", show)
    elapsed = time.perf_counter() - start
    print(format_table(cells))
    failed = [c for c in cells if c.status in (FAIL, ERROR)]
    deviating = [c for c in cells if c.status == DEVIATION]
    for c in failed:
        mbs = c.case.micro_batches if c.case is not None else ()
        print(
            f"\n{c.status} {c.property_id} {c.kind} {c.dtype}"
            + (f" {c.recipe}" if c.recipe != "none" else "")
            + f" after {c.first_failure_at} example(s):"
        )
        print("  " + c.message.replace("\n", "\n  "))
        if c.case is not None:
            print(
                f"  shrunk case: {c.case.config.label()}; micro-batches "
                f"{[(m.lead_shape, m.m_splits, m.is_first_microbatch) for m in mbs]}"
                + (f"; schedule {list(c.case.schedule)}" if c.case.schedule else "")
                + (f"; variant {c.case.variant}" if c.case.variant else "")
                + (f"; frozen {list(c.case.frozen)}" if c.case.frozen else "")
            )
            print(f"  reproduce: {c.repro}")
    if deviating:
        print("\nknown deviations from SPEC.md (declared by the backend, shown, not excused):")
        for c in deviating:
            print(
                f"  {c.property_id} {c.kind} {c.dtype}"
                + (f" {c.recipe}" if c.recipe != "none" else "")
                + f": {c.deviation}\n"
                f"    observed: {c.message.splitlines()[0][:300]}"
            )
            print(f"    reproduce: {c.repro}")
    ran = {c.property_id for c in cells if c.status in (PASS, DEVIATION, FAIL)}
    for dev in backend.deviations:
        if dev.property_id in ran and not any(
            c.property_id == dev.property_id and c.status == DEVIATION for c in cells
        ):
            print(
                "\nnote: declared deviation not observed in this run: "
                f"{dev.property_id}: {dev.summary}"
            )
    rejected = sum(c.rejected for c in cells)
    if rejected:
        print(
            f"\nnote: {rejected} drawn example(s) could not be judged and were not counted "
            "(relu pre-activations within rounding distance of 0; see properties/kink.py)"
        )
    fp8_na = sorted({c.message for c in cells if c.status == NA and c.recipe != "none"})
    for why in fp8_na:
        print(f"\nnote: FP8 cells n/a: {why}")
    n_pass = sum(c.status == PASS for c in cells)
    print(
        f"\n{n_pass} passed, {len(failed)} failed, {len(deviating)} known deviations, "
        f"{sum(c.status == NA for c in cells)} n/a in {elapsed:.1f}s"
    )
    payload = {
        "backend": backend.name,
        "device": device,
        "profile": profile,
        "examples_per_cell": examples,
        "elapsed_s": round(elapsed, 3),
        "notes": list(backend.notes),
        "cells": [c.as_dict() for c in cells],
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    if args.junit:
        _write_junit(args.junit, backend.name, cells, elapsed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
