"""``splitgrad verify``: run the property campaign against one backend and print a table.

    splitgrad verify [--backend impl|reference|torch-split|transformer_engine|path:DIR|module:NAME]
                     [--module KIND ...] [--dtype DTYPE ...] [--device cpu|cuda]
                     [--recipe none|delayed|current|mxfp8|block|all ...]
                     [--impl-path none|grouped|scaled_mm|recompute|all ...]
                     [--property P4 ...] [--examples N] [--profile dev|ci|nightly|gpu] [--seed N]
                     [--json PATH] [--junit PATH] [--case JSON]

Each row is property x module x dtype (x FP8 recipe family, x forced fast path): examples run,
worst error/budget ratio, result. A failure prints the shrunk case and one command line that
replays it, and the exit status is 1. Known deviations that a backend declares are printed as
``deviates`` with their description (they do not fail the run; they are never shown as a pass).
A backend lacking part of SPEC's API is reported once, with the properties that need it
(``blocked``); the others still run, and the exit status is 2 — unless a cell also failed: a
failure is the stronger finding, so it takes precedence (exit status 1). Bad options exit with
status 2 and a message.

Every example runs under torch's deterministic mode with uninitialized memory filled with NaN
(:func:`.campaign.deterministic`), so a read of memory nothing wrote fails every run; the printed
``reproduce`` line carries the backend, forced path, device, thread count and the case, and
replays under the same conditions. A failure that hypothesis' own replay did not repeat is a
failure marked ``nondeterministic``.

Without ``--recipe``, ``--impl-path`` and ``--autocast`` the run is the high-precision campaign
plus three small slices (:mod:`.plan`): FP8 (bf16, the recipe drawn from all of them per
example), each fast path that is the default only on a GPU, forced on the CPU, for every module
it applies to, and float32 modules under ``torch.autocast`` to bf16. Each of the three options
chooses the whole run instead (see ``EPILOG``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

from ..cases.case import DTYPES, KINDS, Case
from ..checks.registry import PROPERTIES, case_na_reason
from . import workers, xfails
from .campaign import BLOCKED, DEVIATION, ERROR, FAIL, NA, PASS, CellResult, blocked_by, run_case
from .plan import (
    AUTOCAST_CHOICES,
    DEFAULT_EXAMPLES,
    FP8_SLICE_EXAMPLES,
    PATH_CHOICES,
    PATH_SLICE_EXAMPLES,
    RECIPE_CHOICES,
    plan_cells,
)
from .session import DEFAULT_DTYPES, OptionError, Options, Session

__all__ = [
    "main",
    "build_parser",
    "DEFAULT_EXAMPLES",
    "FP8_SLICE_EXAMPLES",
    "PATH_SLICE_EXAMPLES",
    "RECIPE_CHOICES",
    "format_table",
]

_PROFILES = ("dev", "ci", "nightly", "gpu")

DESCRIPTION = """\
Check a split-backward implementation against SPEC.md: a hypothesis campaign of the properties
P1-P18, against the reference's float64 truth and against the implementation itself, printed as
one table row per property x module x dtype (x FP8 recipe, x forced fast path)."""
EPILOG = """\
exit status: 0 every cell passed (or deviates as the backend declares); 1 a cell failed
(also when the backend lacks part of SPEC's API: a failure takes precedence); 2 bad options, an
unavailable backend, or a backend lacking part of SPEC's API (reported once, with the properties
it blocks; the others still run) and no cell failed.

determinism: every example runs under torch.use_deterministic_algorithms(True, warn_only=True)
with torch.utils.deterministic.fill_uninitialized_memory, so a read of uninitialized memory
fails every run; a failure that does not repeat on replay is reported as nondeterministic. The
reproduce line replays under the same conditions (backend, --impl-path, --device, --threads).

default run ({default_cells} cells): the high-precision campaign, plus small slices under
FP8 (bf16, every recipe), under torch.autocast (float32 modules, bf16) and on each fast path
that is the default only on a GPU, forced on the CPU (grouped GEMM, _scaled_mm FP8 GEMMs,
recomputed MLP activation). The header counts the cells of each kind and the hypothesis
examples each cell draws after its explicit cases (fewer for P10 and P18, whose explicit cases
enumerate their variants).

--recipe, --impl-path and --autocast do not add to the default run; each chooses it whole:
  --recipe F[,F...]   every property under each FP8 family named, and nothing else (name none
                      too to keep the high-precision cells); --recipe none: high precision only
  --impl-path P[,P..] every property on each forced path named, and nothing else; --impl-path
                      none: high precision and the FP8 slice only
  --autocast D[,D..]  every autocast property on float32 modules under torch.autocast to each
                      dtype named, and nothing else; --autocast none: the default run without
                      its autocast slice

examples:
  splitgrad verify                                   # impl, the default run
  splitgrad verify --backend module:mypkg --junit out.xml
  splitgrad verify --impl-path grouped --module GroupedLinear
  splitgrad verify --recipe delayed,mxfp8 --property P1,P4
"""


class _UsageError(Exception):
    """A bad command line: exit status 2, the message and a pointer to --help."""


class _Refused(Exception):
    """The options are fine but cannot run here (the backend, CUDA): exit status 2, the message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # no traceback, exit status 2
        raise _UsageError(message)


def _output_path(text: str) -> Path:
    """argparse type: a file the run writes at its end, checked before it starts (a directory, or
    a parent that does not exist, is refused; none is created)."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} {what}")
    return path


def _default_cells() -> int:
    """How many cells the default run has."""
    return len(plan_cells(list(KINDS), list(DEFAULT_DTYPES), list(PROPERTIES)))


# The options that choose from a list (repeatable or comma-separated): flag, metavar, help.
_LIST_OPTIONS = (
    (
        "--module",
        "KIND",
        f"module kind(s), repeatable or comma-separated (default: all of {', '.join(KINDS)})",
    ),
    ("--dtype", "DTYPE", f"dtype(s) among {', '.join(DTYPES)} (default: float32,bfloat16)"),
    (
        "--recipe",
        "FAMILY",
        f"FP8 recipe famil(ies) among {', '.join(RECIPE_CHOICES)}, "
        "repeatable or comma-separated: run only these (none: high precision) instead of the "
        "default run",
    ),
    (
        "--impl-path",
        "PATH",
        f"force a fast path on the backend's modules: "
        f"{', '.join(PATH_CHOICES)}, repeatable or comma-separated: run only these instead of the "
        "default run (none: the default run without its forced-path and autocast slices)",
    ),
    (
        "--autocast",
        "DTYPE",
        f"run float32 modules under torch.autocast to: "
        f"{', '.join(AUTOCAST_CHOICES)}, repeatable or comma-separated: run only these instead of "
        "the default run (none: the default run without its autocast slice)",
    ),
    ("--property", "PID", f"property id(s) among {', '.join(PROPERTIES)} (default: all)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="splitgrad verify",
        description=DESCRIPTION,
        epilog=EPILOG.format(default_cells=_default_cells()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--backend",
        default="impl",
        help="what to check: impl, reference, torch-split, transformer_engine, path:DIR (a "
        "package directory with SPEC's API), module:NAME (an importable one) or "
        "class:MODULE:ATTR (a splitgrad.properties.backends.Backend subclass) (default: impl)",
    )
    for flag, metavar, help_text in _LIST_OPTIONS:
        p.add_argument(flag, action="append", metavar=metavar, help=help_text)
    p.add_argument(
        "--device", default=None, choices=("cpu", "cuda"), help="default: cpu (cuda for TE)"
    )
    p.add_argument(
        "--examples",
        type=int,
        default=None,
        help=f"hypothesis examples per cell (default {DEFAULT_EXAMPLES}; {FP8_SLICE_EXAMPLES} in "
        f"the FP8 slice, {PATH_SLICE_EXAMPLES} in the forced-path slice; the profile's with "
        "--profile)",
    )
    p.add_argument(
        "--profile", default=None, choices=_PROFILES, help="hypothesis profile (default ci)"
    )
    p.add_argument(
        "--seed", type=int, default=None, help="hypothesis seed (default: the profile's)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: the campaign's tensors are tiny, and more "
        "threads than free cores slow a shared CI machine down several times)",
    )
    p.add_argument("--json", type=_output_path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--junit", type=_output_path, metavar="PATH", help="write the results as JUnit XML"
    )
    p.add_argument("--case", metavar="JSON", help="replay one case (needs exactly one --property)")
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    xfails.add_option(p)
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress (a bar on a terminal, one line per finished cell otherwise)",
    )
    return p


# ---- parse: the command line as session options ----------------------------------------------


def _options(args: argparse.Namespace) -> Options:
    """The session's options from verify's command line (its own defaults: the ``ci`` profile
    unless HYPOTHESIS_PROFILE says otherwise, :data:`~.plan.DEFAULT_EXAMPLES` unless
    ``--profile`` is given); refuses values that name nothing or would be ignored."""
    lists = {"modules": args.module, "dtypes": args.dtype, "properties": args.property}
    lists |= {"recipes": args.recipe, "impl_paths": args.impl_path, "autocasts": args.autocast}
    default_examples = None if args.profile else DEFAULT_EXAMPLES
    try:
        options = Options.chosen(
            lists,
            backend=args.backend,
            examples=args.examples if args.examples is not None else default_examples,
            profile=args.profile or (None if os.environ.get("HYPOTHESIS_PROFILE") else "ci"),
            seed=args.seed,
            device=args.device,
            threads=args.threads,
        )
    except OptionError as exc:
        raise _UsageError(str(exc)) from None
    dtypes, autocasts = options.dtypes, options.autocasts
    if dtypes and set(dtypes) != {"float32"} and set(autocasts) - {"none"}:
        raise _UsageError(
            f"--autocast {','.join(autocasts)} runs float32 modules under torch.autocast, so "
            f"--dtype {','.join(dtypes)} would be ignored; leave --dtype out"
        )
    if args.examples is not None and args.examples < 1:
        raise _UsageError(f"--examples must be at least 1, got {args.examples}")
    if args.threads < 1:
        raise _UsageError(f"--threads must be at least 1, got {args.threads}")
    return options


def _backend(options: Options):
    """The backend to check, refused (exit status 2) when it or the device cannot run here."""
    from ..backends import BackendUnavailable
    from .session import load_backend

    try:
        backend = load_backend(options.backend)
        why = backend.unavailable_reason()
    except OptionError as exc:
        raise _UsageError(str(exc)) from None
    except BackendUnavailable as exc:
        why = str(exc)
    if why:
        raise _Refused(f"backend {options.backend!r} is not available: {why}")
    import torch

    if options.device_name == "cuda" and not torch.cuda.is_available():
        raise _Refused("--device cuda, but torch.cuda.is_available() is False")
    return backend


# ---- session: the planned cells --------------------------------------------------------------


def _open_session(options: Options, backend) -> Session:
    """The session, refusing (usage error) a forced path the backend has no knob for when only
    forced paths were asked, and options that leave no cell to run."""
    session = Session.open(options, backend)
    paths_asked = options.impl_paths
    if paths_asked and session.unforceable and not any(c.path != "default" for c in session.cells):
        reasons = "; ".join(f"{p}: {w}" for p, w in session.unforceable.items())
        raise _UsageError(f"--impl-path on backend {backend.name!r}: {reasons}")
    if not session.cells:
        raise _UsageError(_nothing_to_run(list(options.modules) or list(KINDS), paths_asked))
    return session


def _nothing_to_run(kinds: list[str], impl_paths: list[str]) -> str:
    """Why the options select no cell."""
    from ..checks.paths import IMPL_PATHS

    for name in impl_paths:
        path = IMPL_PATHS.get(name)
        if path is not None and not any(path.applies(k) for k in kinds):
            return (
                f"nothing to run: --impl-path {name} applies to {', '.join(path.kinds)} only, "
                f"not to --module {','.join(kinds)}"
            )
    return "nothing to run: these options select no cell (see --help)"


def _cell_kind(cell) -> str:
    if cell.path != "default":
        return "on forced paths"
    if cell.recipe_label != "none":
        return "under FP8"
    if cell.autocast is not None:
        return "under torch.autocast"
    return "high precision"


def _header(backend, device: str, profile: str, cells) -> str:
    """What the run is: backend, device, profile, and how many hypothesis examples each kind of
    cell draws after its explicit cases (a count only some properties use is named with them:
    P10 and P18 enumerate their variants in explicit cases and draw fewer)."""
    groups: dict[str, dict[str, list[str]]] = {}
    for c in cells:
        n = "the profile's" if c.examples is None else str(c.examples)
        groups.setdefault(_cell_kind(c), {}).setdefault(n, []).append(c.property_id)
    parts = []
    for kind, counts in groups.items():
        usual = max(counts, key=lambda n: len(counts[n]))
        others = "; ".join(
            f"{n} for {', '.join(sorted(set(pids)))}" for n, pids in counts.items() if n != usual
        )
        n_cells = sum(len(pids) for pids in counts.values())
        parts.append(
            f"{n_cells} {kind} at {usual} examples each" + (f" ({others})" if others else "")
        )
    return (
        f"splitgrad verify: backend {backend.name}, device {device}, profile {profile}; "
        f"{len(cells)} cells: " + ", ".join(parts)
    )


def format_table(cells: list[CellResult]) -> str:
    """The property x module x dtype table, with a recipe column when some cell runs FP8 and a
    path column when some cell runs a forced fast path."""
    fp8 = any(c.recipe != "none" for c in cells)
    paths = any(c.path != "default" for c in cells)
    header = ("property", "module", "dtype", *(("recipe",) if fp8 else ()))
    header += ("path",) if paths else ()
    header += ("examples", "worst/budget", "result")
    left = {0, 1, 2, len(header) - 1} | ({3} if fp8 else set()) | ({3 + fp8} if paths else set())
    rows = [header]
    for c in cells:
        rows.append(
            (
                c.property_id,
                c.kind,
                c.dtype if c.autocast is None else f"{c.dtype}+autocast:{c.autocast}",
                *((c.recipe,) if fp8 else ()),
                *((c.path,) if paths else ()),
                str(c.examples) if c.status not in (NA, BLOCKED) else "-",
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


# ---- run: every planned cell, with progress --------------------------------------------------


@dataclasses.dataclass
class _Run:
    """The finished cells of a session and how long they took."""

    session: Session
    cells: list[CellResult]
    elapsed: float

    def with_status(self, *statuses: str) -> list[CellResult]:
        return [c for c in self.cells if c.status in statuses]


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 28
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\r" + " " * (width + 60) + "\r")


def _progress_line(done: int, total: int, cell: CellResult) -> None:
    n = "-" if cell.status in (NA, BLOCKED) else f"{cell.examples} examples"
    sys.stderr.write(
        f"[{done}/{total}] {xfails.result_id(cell)}: {cell.status} ({n}, {cell.seconds:.1f} s)\n"
    )
    sys.stderr.flush()


def _run_cells(session: Session, quiet: bool, fail_fast: bool) -> _Run:
    """Run the session's cells in order (a bar on a terminal, a line per cell otherwise);
    ``fail_fast`` stops at the first cell that fails."""
    bar = not quiet and sys.stderr.isatty()
    plan, cells = session.cells, []
    start = time.perf_counter()
    results = workers.run_cells(session.run, plan, workers.default_jobs(session.device))
    for i, cell in results:
        cells.append(cell)
        if bar:
            _progress_bar(i + 1, len(plan), plan[i].test_id)
        elif not quiet:
            _progress_line(i + 1, len(plan), cell)
        if fail_fast and cell.status in (FAIL, ERROR):
            results.close()
            break
    if bar:
        _progress_bar(len(plan), len(plan), "")
    return _Run(session, cells, time.perf_counter() - start)


# ---- report: the table, what failed or deviates, notes, the summary --------------------------


def _print_header(session: Session) -> None:
    backend = session.backend
    print(_header(backend, session.device, session.profile, session.cells))
    for note in backend.notes:
        print(f"  note: {note}")
    for what, blocked in session.gaps.values():
        print(f"  missing API: {what}" + (f" (blocks {', '.join(blocked)})" if blocked else ""))
    sys.stdout.flush()


def _print_failures(run: _Run) -> None:
    for c in run.with_status(FAIL, ERROR):
        where = f" after {c.first_failure_at} example(s)" if c.first_failure_at else ""
        print(f"\n{c.status} {xfails.result_id(c)}{where}:")
        print("  " + c.message.replace("\n", "\n  "))
        if c.case is not None:
            what = "shrunk case" if c.shrunk and not c.nondeterministic else "failing case"
            print(f"  {what}: {_describe_case(c.case)}")
            print(f"  reproduce: {c.repro}")


def _describe_case(case: Case) -> str:
    mbs = [(m.lead_shape, m.m_splits, m.is_first_microbatch) for m in case.micro_batches]
    return (
        f"{case.config.label()}; micro-batches {mbs}"
        + (f"; schedule {list(case.schedule)}" if case.schedule else "")
        + (f"; variant {case.variant}" if case.variant else "")
        + (f"; frozen {list(case.frozen)}" if case.frozen else "")
        + (f"; asked {list(case.asked)}" if case.asked else "")
    )


def _print_deviations(run: _Run) -> None:
    """The deviations that showed, and the declared ones a property that ran did not show."""
    deviating = run.with_status(DEVIATION)
    if deviating:
        print("\nknown deviations from SPEC.md (declared by the backend, shown, not excused):")
        for c in deviating:
            print(f"  {xfails.result_id(c)}: {c.deviation}")
            print(f"    observed: {c.message.splitlines()[0][:300]}\n    reproduce: {c.repro}")
    ran = {c.property_id for c in run.with_status(PASS, DEVIATION, FAIL)}
    shown = {c.property_id for c in deviating}
    unseen = []
    for dev in run.session.backend.deviations:
        if dev.property_id in ran and dev.property_id not in shown:
            if (dev.property_id, dev.summary) not in unseen:
                unseen.append((dev.property_id, dev.summary))
    for pid, summary in unseen:
        print(f"\nnote: declared deviation not observed in this run: {pid}: {summary}")


_OPTIONAL_PARTS = ("delay", "fused", "first_microbatch", "hooks")


def _print_gaps(run: _Run, failed: bool) -> None:
    """The parts of SPEC's API the backend lacks, once, with what each blocks."""
    gaps, name = run.session.gaps, run.session.backend.name
    if not gaps:
        return
    why_status = "exit status 1: a cell failed" if failed else "exit status 2"
    print(f"\n{name} lacks part of SPEC's API (reported once; {why_status}):")
    blocked = run.with_status(BLOCKED)
    for part, (what, props) in gaps.items():
        cells_of = [c for c in blocked if what in c.message]
        also = f"; {len(cells_of)} cell(s) blocked" if cells_of else ""
        blocks = f"blocks {', '.join(props)}" if props else "blocks no property outright"
        if part.startswith("module:"):
            blocks = f"blocks every {part[len('module:') :]} cell"
        optional = " (the other properties run without it)" if part in _OPTIONAL_PARTS else ""
        print(f"  {what}: {blocks}{also}{optional}")


def _print_notes(run: _Run) -> None:
    """Examples that could not be judged, forced paths the backend lacks, FP8 cells n/a."""
    rejected = [c for c in run.cells if c.rejected]
    if rejected:
        where = ", ".join(f"{xfails.result_id(c)} ({c.rejected})" for c in rejected)
        print(
            f"\nnote: {sum(c.rejected for c in rejected)} drawn example(s) could not be judged and "
            f"were not counted (relu pre-activations within rounding distance of 0; see "
            f"properties/oracle/kink.py): {where}"
        )
    for path, why_not in run.session.unforceable.items():
        print(f"\nnote: forced path {path} not run on {run.session.backend.name}: {why_not}")
    for why_na in sorted({c.message for c in run.with_status(NA) if c.recipe != "none"}):
        print(f"\nnote: FP8 cells n/a: {why_na}")


def _summary(run: _Run, counted_xfails: bool) -> str:
    blocked = run.with_status(BLOCKED)
    return (
        f"\n{len(run.with_status(PASS))} passed, {len(run.with_status(FAIL, ERROR))} failed, "
        f"{len(run.with_status(DEVIATION))} known deviations, {len(run.with_status(NA))} n/a"
        + (f", {len(run.with_status(xfails.XFAIL))} expected failures" if counted_xfails else "")
        + (f", {len(blocked)} blocked" if blocked else "")
        + f" in {run.elapsed:.1f}s"
    )


def _report(run: _Run, xfail_notes: list[str], counted_xfails: bool) -> int:
    """Print the results; returns the exit status (1 a cell failed, 2 API missing, else 0)."""
    print(format_table(run.cells))
    for line in xfail_notes:
        print(f"note: {line}")
    failed = bool(run.with_status(FAIL, ERROR))
    _print_failures(run)
    _print_deviations(run)
    _print_gaps(run, failed)
    _print_notes(run)
    print(_summary(run, counted_xfails))
    return 1 if failed else (2 if run.session.gaps else 0)


# ---- replay: one --case ----------------------------------------------------------------------


def _replay(backend, properties: list[str], text: str, device: str | None) -> int:
    """Run one ``--case`` under the campaign's conditions (:func:`.campaign.run_case`); ``device``
    is ``--device`` when given (it must be the case's)."""
    import torch

    if len(properties) != 1:
        raise _UsageError("--case needs exactly one --property")
    try:
        case = Case.from_json(text)
    except ValueError as exc:
        raise _UsageError(f"--case: {exc}") from None
    pid = properties[0]
    if device is not None and device != case.config.device:
        raise _UsageError(f"--device {device}, but the case runs on {case.config.device}")
    if case.config.device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("the case runs on cuda, but torch.cuda.is_available() is False")
    missing = backend.missing_api()
    gaps = {
        part: why
        for part, why in missing.items()
        if part == f"module:{case.config.kind}"
        or blocked_by(pid, part, case.config.recipe is not None)
    }
    if gaps:
        print(f"{pid} blocked on {backend.name}: missing API: {'; '.join(gaps.values())}")
        return 2
    why = backend.unsupported_reason(pid, case.config) or case_na_reason(pid, backend, case)
    if why:
        print(f"{pid} n/a on {backend.name}: {why}")
        return 0
    from ..oracle.kink import CaseRejected

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


# ---- json and junit --------------------------------------------------------------------------


def _payload(run: _Run, paths) -> dict:
    session = run.session
    return {
        "backend": session.backend.name,
        "device": session.device,
        "profile": session.profile,
        "examples_per_cell": session.options.examples,
        "elapsed_s": round(run.elapsed, 3),
        "notes": list(session.backend.notes),
        "missing_api": {part: {"what": w, "blocks": b} for part, (w, b) in session.gaps.items()},
        "cells": [c.as_dict() for c in run.cells],
        "gemm_paths": paths.summary() if paths is not None else [],
        "fast_paths_missed": _missed_fast_paths(),
    }


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


#: The JUnit class of every cell: the pytest plugin's test module, so that both runners' reports
#: name a cell alike (``test_property[P4-Linear-bfloat16-none]``).
JUNIT_CLASS = "splitgrad.properties.test_conformance"


def _write_junit(path: Path, run: _Run) -> None:
    cells = run.cells
    suite = ET.Element(
        "testsuite",
        name=f"splitgrad verify --backend {run.session.backend.name}",
        tests=str(len(cells)),
        failures=str(sum(c.status == FAIL for c in cells)),
        errors=str(sum(c.status == ERROR for c in cells)),
        skipped=str(sum(c.status in (NA, DEVIATION, BLOCKED) for c in cells)),
        time=f"{run.elapsed:.3f}",
    )
    for c in cells:
        name = f"test_property[{xfails.result_id(c)}]"
        tc = ET.SubElement(suite, "testcase", classname=JUNIT_CLASS, name=name)
        tc.set("time", f"{c.seconds:.3f}")
        _junit_outcome(tc, c)
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _junit_outcome(tc: ET.Element, c: CellResult) -> None:
    if c.status == FAIL:
        first = c.message.splitlines()[0][:500] if c.message else "failed"
        ET.SubElement(tc, "failure", message=first).text = f"{c.message}\n\nreproduce: {c.repro}"
    elif c.status == ERROR:
        ET.SubElement(tc, "error", message=c.message[:500])
    elif c.status == DEVIATION:
        ET.SubElement(tc, "skipped", message=f"KNOWN DEVIATION: {c.deviation}").text = c.message
    elif c.status in (NA, BLOCKED):
        ET.SubElement(tc, "skipped", message=f"{c.status}: {c.message}")
    else:
        out = f"examples={c.examples} worst_ratio={c.ratio_text}"
        ET.SubElement(tc, "system-out").text = out


def _write_outputs(args: argparse.Namespace, run: _Run, paths) -> None:
    if args.json:
        payload = _payload(run, paths)
        args.json.write_text(json.dumps(payload, indent=2, default=_json_default))
    if args.junit:
        _write_junit(args.junit, run)


def _missed_fast_paths() -> list[str]:
    from splitgrad.impl import gemm_paths

    return gemm_paths.missed_fast_paths()


def _print_gemm_paths(paths) -> None:
    """The GEMM paths splitgrad.impl took in this run (``--device cuda``), and any fast path the
    GPU refused where its capability says it runs."""
    print("\nGEMM paths taken (splitgrad.impl; fast / fallback / forced / only):")
    for line in paths.lines() or ["(none recorded: no impl GEMM with a choice ran)"]:
        print(f"  {line}")
    for line in _missed_fast_paths():
        print(f"FAST PATH MISSED: {line}")


# ---- the command -----------------------------------------------------------------------------


def main(argv: Sequence[str]) -> int:
    """Entry point of ``splitgrad verify``; returns the exit status."""
    from splitgrad.impl import gemm_paths

    try:
        with gemm_paths.recording() as paths:
            return _main(list(argv), paths)
    except _UsageError as exc:
        print(f"splitgrad verify: error: {exc}\nTry 'splitgrad verify --help'.", file=sys.stderr)
        return 2
    except _Refused as exc:
        print(f"splitgrad verify: {exc}", file=sys.stderr)
        return 2


def _main(argv: list[str], paths=None) -> int:
    """parse -> session -> plan -> run -> report, json, junit."""
    args = build_parser().parse_args(argv)
    options = _options(args)
    backend = _backend(options)
    if args.case:
        return _replay_case(args, options, backend)
    session = _open_session(options, backend)
    _start_p9_subprocess(session)
    _print_header(session)
    run = _run_cells(session, args.quiet, args.fail_fast)
    xfail_notes = xfails.apply_to_cells(run.cells, args.xfails)
    status = _report(run, xfail_notes, bool(args.xfails))
    if session.device == "cuda" and paths is not None:
        _print_gemm_paths(paths)
    _write_outputs(args, run, paths)
    return status


def _start_p9_subprocess(session: Session) -> None:
    """P9's ``python -O`` subprocess starts now, to run while the first cells do."""
    if any(c.property_id == "P9" for c in session.cells) and not any(
        "P9" in blocked for _, blocked in session.gaps.values()
    ):
        from ..checks.misuse import start_optimized_constructor_results

        start_optimized_constructor_results(session.backend.name)


def _replay_case(args: argparse.Namespace, options: Options, backend) -> int:
    """``--case``: one case on the backend (on one forced path at most)."""
    import torch

    from ..cases.profiles import load_profile
    from ..checks.paths import ForcedPathBackend

    paths = options.impl_paths
    if len(paths) > 1 or "all" in paths:
        raise _UsageError("--case replays on one --impl-path at most")
    if paths and paths[0] != "none":
        backend = ForcedPathBackend(backend, paths[0])
    torch.set_num_threads(options.threads)
    load_profile()
    properties = list(options.properties) or list(PROPERTIES)
    return _replay(backend, properties, args.case, args.device)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
