"""``splitgrad verify``: run the property campaign against one backend and print a table, one
row per cell of a :class:`.session.Session` (its help, :data:`DESCRIPTION` and :data:`EPILOG`,
says what the default run is and what each exit status means); ``--case`` replays one case.
Ctrl-C ends a run with the summary of the cells done (exit status :data:`INTERRUPTED`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

import torch
from hypothesis import settings
from splitgrad.impl import gemm_paths

from ..backends import BackendUnavailable
from ..cases.case import DTYPES, KINDS, LOW_PRECISION_DTYPES, Case
from ..cases.profiles import load_profile
from ..checks import misuse
from ..checks.misuse import start_optimized_constructor_results
from ..checks.paths import IMPL_PATHS, ForcedPathBackend
from ..checks.registry import PROPERTIES, case_na_reason
from ..oracle.kink import CaseRejected
from . import plan, workers, xfails
from .campaign import (
    BLOCKED,
    DEVIATION,
    ERROR,
    FAIL,
    NA,
    PASS,
    CellResult,
    blocking_gaps,
    explicit_count,
    repro_command,
    run_case,
)
from .command_line import BACKEND_HELP, USAGE_ERROR, backend_spec, run_error, usage_error
from .session import DEFAULT_DTYPES, LIST_OPTIONS, OptionError, Options, Session, load_backend

DESCRIPTION = """\
Check a split-backward implementation against SPEC.md: a hypothesis campaign of the properties
P1-P18, against the reference's float64 truth and against the implementation itself, printed as
one table row per property x module x dtype (x FP8 recipe, x forced fast path)."""
EPILOG = """\
exit status: 0 every cell passed (or deviates as the backend declares); 1 a cell failed
(also when the backend lacks part of SPEC's API: a failure takes precedence); 2 bad options, an
unavailable backend, or a backend lacking part of SPEC's API (reported once, with the properties
it blocks; the others still run) and no cell failed; 5 nothing was checked: every cell was n/a
(--dtype float64 --recipe delayed --property P1, say), and a line says why; 130 interrupted
(Ctrl-C): the table and summary of the cells done are printed.

determinism: every example runs under torch.use_deterministic_algorithms(True, warn_only=True)
with torch.utils.deterministic.fill_uninitialized_memory, so a read of uninitialized memory
fails every run; a failure that does not repeat on replay is reported as nondeterministic. The
reproduce line replays under the same conditions (backend, --impl-path, --device, --threads).

default run ({default_cells} cells): the high-precision campaign, plus small slices under
FP8 (bf16, every recipe), under torch.autocast (float32 modules, bf16) and on each fast path
that is the default only on a GPU, forced on the CPU (grouped GEMM, _scaled_mm FP8 GEMMs,
recomputed MLP activation). The header counts the cells of each kind and the examples a
passing cell runs, as the table's examples column counts them: its explicit cases plus the
drawn ones (fewer drawn for P10 and P18, whose explicit cases enumerate their variants).

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


#: Exit status of a run in which no cell checked anything (pytest's "no tests ran" is 5 too).
NOTHING_CHECKED = 5
#: Exit status after Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # no traceback, exit status 2
        raise _UsageError(message)


def _output_path(text: str) -> Path:
    """argparse type: a file the run writes at its end, checked before it starts."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    parent = path.absolute().parent
    if not parent.is_dir():
        what = "does not exist" if not parent.exists() else "is not a directory"
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} {what}")
    return path


def _xfails_file(path: str) -> dict[str, xfails.ExpectedFailure]:
    """argparse type: the entries of an expected-failures file, checked before anything runs."""
    try:
        return xfails.load_xfails(path)
    except xfails.XfailsFileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# --xfails left out (an empty file given is another, equal dict: --case refuses that one).
_NO_XFAILS: dict[str, xfails.ExpectedFailure] = {}

# The options that choose from a list, repeatable or comma-separated: (flag, metavar) -> help.
_LIST_HELP = {
    ("module", "KIND"): "module kind(s), repeatable or comma-separated (default: all of "
    f"{', '.join(KINDS)})",
    ("dtype", "DTYPE"): f"dtype(s) among {', '.join(DTYPES)} (default: float32,bfloat16)",
    ("recipe", "FAMILY"): f"FP8 recipe famil(ies) among {', '.join(plan.RECIPE_CHOICES)}, "
    "repeatable or comma-separated: run only these (none: high precision) instead of the "
    "default run",
    ("impl-path", "PATH"): "force a fast path on the backend's modules: "
    f"{', '.join(plan.PATH_CHOICES)}, repeatable or comma-separated: run only these instead of "
    "the default run (none: the default run without its forced-path and autocast slices)",
    ("autocast", "DTYPE"): "run float32 modules under torch.autocast to: "
    f"{', '.join(plan.AUTOCAST_CHOICES)}, repeatable or comma-separated: run only these instead "
    "of the default run (none: the default run without its autocast slice)",
    ("property", "PID"): f"property id(s) among {', '.join(PROPERTIES)} (default: all)",
}


def build_parser() -> argparse.ArgumentParser:
    """verify's command line (its help counts the default run's cells)."""
    default_cells = len(plan.plan_cells(list(KINDS), list(DEFAULT_DTYPES), list(PROPERTIES)))
    p = _Parser(
        prog="splitgrad verify",
        description=DESCRIPTION,
        epilog=EPILOG.format(default_cells=default_cells),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--backend", type=backend_spec, default="impl", help=BACKEND_HELP)
    for (flag, metavar), help_text in _LIST_HELP.items():
        p.add_argument(f"--{flag}", action="append", metavar=metavar, help=help_text)
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: cpu (cuda for TE)")
    p.add_argument(
        "--examples",
        type=int,
        help=f"hypothesis examples drawn per cell after its explicit cases (default "
        f"{plan.DEFAULT_EXAMPLES}; "
        f"{plan.FP8_SLICE_EXAMPLES} in the FP8 slice, {plan.PATH_SLICE_EXAMPLES} in the "
        "forced-path slice; the profile's with --profile)",
    )
    profiles = ("dev", "ci", "nightly", "gpu")
    p.add_argument("--profile", choices=profiles, help="hypothesis profile (default ci)")
    p.add_argument("--seed", type=int, help="hypothesis seed (default: the profile's)")
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
    p.add_argument(
        "--case",
        metavar="JSON",
        help="replay one case (needs exactly one --property; --json and --junit write its "
        "result; the options that choose or draw cases are refused)",
    )
    p.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    p.add_argument(
        "--xfails",
        metavar="FILE",
        type=_xfails_file,
        default=_NO_XFAILS,
        help="cells expected to fail, one id per line (such as P4-Linear-bfloat16-none, as "
        "this command and pytest print it), '#' comments giving the reason; strict: a listed "
        "cell that passes fails as XPASS(strict)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="no progress (a bar on a terminal, one line per finished cell otherwise)",
    )
    return p


_CASE_CARRIES = "the case carries its own module, dtype, FP8 recipe and autocast"
_NOTHING_DRAWN = "nothing is drawn: the case runs as given"
# The options a --case replay has no use for, and why: the case is one given example.
_NOT_FOR_CASE = {
    "module": _CASE_CARRIES,
    "dtype": _CASE_CARRIES,
    "recipe": _CASE_CARRIES,
    "autocast": _CASE_CARRIES,
    "examples": _NOTHING_DRAWN,
    "profile": _NOTHING_DRAWN,
    "seed": _NOTHING_DRAWN,
    "fail-fast": "there is one case to run",
    "xfails": "expected failures name campaign cells",
}


def _check_outputs_and_case(args: argparse.Namespace) -> None:
    """Refuse what the run would otherwise ignore or lose: an option a ``--case`` replay has no
    use for, and ``--json`` and ``--junit`` writing one file (the latter would overwrite it)."""
    if args.json and args.junit:
        same = args.json.resolve() == args.junit.resolve()
        if same or (args.json.exists() and args.junit.exists() and args.json.samefile(args.junit)):
            raise _UsageError(f"--json and --junit both write {args.junit}; give each its own file")
    if args.case is None:
        return
    values = {flag: getattr(args, flag.replace("-", "_")) for flag in _NOT_FOR_CASE}
    left_out = (None, False, _NO_XFAILS)
    given = [flag for flag, value in values.items() if not any(value is v for v in left_out)]
    if given:
        flags = ", ".join(f"--{flag}" for flag in given)
        why = "; ".join(dict.fromkeys(_NOT_FOR_CASE[flag] for flag in given))
        verb, them = ("does", "it") if len(given) == 1 else ("do", "them")
        raise _UsageError(
            f"--case replays the one case given: {flags} {verb} not apply ({why}); leave {them} out"
        )


def _options(args: argparse.Namespace) -> Options:
    """The session's options (profile ``ci`` unless HYPOTHESIS_PROFILE is set, and
    :data:`~.plan.DEFAULT_EXAMPLES` unless ``--profile`` is given), or a usage error."""
    lists = {flag: getattr(args, flag.replace("-", "_")) for flag in LIST_OPTIONS}
    default_examples = None if args.profile else plan.DEFAULT_EXAMPLES
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
        flag = f"argument --{exc.option}: " if exc.option else ""
        raise _UsageError(f"{flag}{exc}") from None
    dtypes, autocasts = options.dtypes, options.autocasts
    if dtypes and set(dtypes) != {"float32"} and set(autocasts) - {"none"}:
        raise _UsageError(
            f"--autocast {','.join(autocasts)} runs float32 modules under torch.autocast, so "
            f"--dtype {','.join(dtypes)} would be ignored; leave --dtype out"
        )
    for flag, value in (("examples", args.examples), ("threads", args.threads)):
        if value is not None and value < 1:
            raise _UsageError(f"--{flag} must be at least 1, got {value}")
    return options


def _backend(options: Options):
    """The backend to check, refused (exit status 2) when it or the device cannot run here."""
    try:
        backend = load_backend(options.backend)
        why = backend.unavailable_reason()
    except OptionError as exc:
        raise _UsageError(str(exc)) from None
    except BackendUnavailable as exc:
        why = str(exc)
    if why:
        raise _Refused(f"--backend {options.backend}: not available: {why}")
    if options.device_name == "cuda" and not torch.cuda.is_available():
        raise _Refused("--device cuda, but torch.cuda.is_available() is False")
    return backend


def _open_session(options: Options, backend) -> Session:
    """The session, refusing options that leave no cell to run (say, only unforceable paths)."""
    session = Session.open(options, backend)
    asked = options.impl_paths
    if asked and session.unforceable and not any(c.path != "default" for c in session.cells):
        reasons = "; ".join(f"{p}: {w}" for p, w in session.unforceable.items())
        raise _UsageError(f"--impl-path on backend {backend.name!r}: {reasons}")
    if session.cells:
        return session
    kinds = list(options.modules) or list(KINDS)
    for name in asked:
        path = IMPL_PATHS.get(name)
        if path is not None and not any(path.applies(k) for k in kinds):
            raise _UsageError(
                f"nothing to run: --impl-path {name} applies to {', '.join(path.kinds)} only, "
                f"not to --module {','.join(kinds)}"
            )
    raise _UsageError("nothing to run: these options select no cell (see --help)")


def _cell_kind(cell) -> str:
    if cell.path != "default":
        return "on forced paths"
    if cell.recipe_label != "none":
        return "under FP8"
    return "high precision" if cell.autocast is None else "under torch.autocast"


def _planned_examples(session: Session, cell: plan.PlannedCell) -> tuple[int, int] | None:
    """(explicit, drawn): the examples ``cell`` runs when it passes, counted as its table row
    counts them (the explicit cases :func:`.campaign.run_cell` runs first, then the drawn ones);
    ``None`` for a cell that runs none (n/a or blocked). Nothing is run."""
    if cell.property_id in ("P1", "P2", "P3") and cell.dtype not in LOW_PRECISION_DTYPES:
        return None  # Session.run: no wider dtype to measure error against
    explicit = explicit_count(
        session.forced[cell.path] if cell.path != "default" else session.backend,
        cell.property_id,
        cell.kind,
        cell.dtype,
        device=session.device,
        recipes=cell.recipes,
        fp8_asked=session.fp8_asked,
        autocast=cell.autocast,
    )
    if explicit is None:
        return None
    drawn = cell.examples
    return explicit, settings.get_profile(session.profile).max_examples if drawn is None else drawn


def _span(values) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"


def _header(session: Session) -> str:
    """What the run is: backend, device, profile, and for each kind of cell the examples a
    passing cell runs, as the table's examples column counts them (explicit cases, then drawn;
    naming the properties that draw fewer)."""
    groups: dict[str, list[tuple[plan.PlannedCell, tuple[int, int] | None]]] = {}
    for c in session.cells:
        groups.setdefault(_cell_kind(c), []).append((c, _planned_examples(session, c)))
    parts = []
    for kind, planned in groups.items():
        runs = [(c.property_id, n) for c, n in planned if n is not None]
        text = f"{len(planned)} {kind}"
        if runs:
            by_drawn: dict[int, list[str]] = {}
            for pid, (_, drawn) in runs:
                by_drawn.setdefault(drawn, []).append(pid)
            usual = max(by_drawn, key=lambda d: len(by_drawn[d]))
            fewer = "".join(
                f", {d} for {', '.join(sorted(set(pids)))}"
                for d, pids in by_drawn.items()
                if d != usual
            )
            totals = _span([e + d for _, (e, d) in runs])
            explicit = _span([e for _, (e, _) in runs])
            text += f" at {totals} examples each ({explicit} explicit + {usual} drawn{fewer})"
        n_none = len(planned) - len(runs)
        parts.append(text + (f", {n_none} of them n/a" if n_none else ""))
    return (
        f"splitgrad verify: backend {session.backend.name}, device {session.device}, profile "
        f"{session.profile}; {len(session.cells)} cells: " + "; ".join(parts)
    )


def format_table(cells: list[CellResult]) -> str:
    """The property x module x dtype table (a recipe and a path column when some cell has one)."""
    fp8 = any(c.recipe != "none" for c in cells)
    paths = any(c.path != "default" for c in cells)
    optional = (("recipe",) if fp8 else ()) + (("path",) if paths else ())
    header = ("property", "module", "dtype", *optional, "examples", "worst/budget", "result")
    left = {0, 1, 2, len(header) - 1, *range(3, 3 + len(optional))}
    rows = [header]
    for c in cells:
        dtype = c.dtype if c.autocast is None else f"{c.dtype}+autocast:{c.autocast}"
        optional = ((c.recipe,) if fp8 else ()) + ((c.path,) if paths else ())
        examples = str(c.examples) if c.status not in (NA, BLOCKED) else "-"
        rows.append((c.property_id, c.kind, dtype, *optional, examples, c.ratio_text, c.status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    rows.insert(1, tuple("-" * w for w in widths))
    justify = [str.ljust if i in left else str.rjust for i in range(len(header))]
    return "\n".join(
        "  ".join(j(v, w) for j, v, w in zip(justify, r, widths)).rstrip() for r in rows
    )


@dataclasses.dataclass
class _Run:
    """The finished cells of a session and how long they took; ``interrupted``: Ctrl-C stopped
    the run with only these of its cells done."""

    session: Session
    cells: list[CellResult]
    elapsed: float
    interrupted: bool = False

    def with_status(self, *statuses: str) -> list[CellResult]:
        return [c for c in self.cells if c.status in statuses]


def _run_cells(session: Session, quiet: bool, fail_fast: bool) -> _Run:
    """Run the session's cells (a bar on a terminal, a line per cell otherwise). Ctrl-C stops
    the run (and the worker process) and keeps every cell finished so far."""
    bar = not quiet and sys.stderr.isatty()
    planned, cells = session.cells, {}
    start = time.perf_counter()
    results = workers.run_cells(session.run, planned, workers.default_jobs(session.device))
    interrupted = False
    try:
        for i, cell in results:
            cells[i] = cell
            if bar:
                _progress_bar(i + 1, len(planned), planned[i].test_id)
            elif not quiet:
                n = "-" if cell.status in (NA, BLOCKED) else f"{cell.examples} examples"
                line = f"{cell.test_id}: {cell.status} ({n}, {cell.seconds:.1f} s)"
                sys.stderr.write(f"[{i + 1}/{len(planned)}] {line}\n")
                sys.stderr.flush()
            if fail_fast and cell.status in (FAIL, ERROR):
                break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        results.close()
    if interrupted:
        cells.update(results.unreported)  # the worker's cells finished ahead of plan order
    if bar:
        _progress_bar(len(planned), len(planned), "")
    elapsed = time.perf_counter() - start
    return _Run(session, [cells[i] for i in sorted(cells)], elapsed, interrupted)


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 28
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\r" + " " * (width + 60) + "\r")


def _print_deviations(run: _Run) -> None:
    """The deviations that showed, and the declared ones a property that ran did not show."""
    deviating = run.with_status(DEVIATION)
    if deviating:
        print("\nknown deviations from SPEC.md (declared by the backend, shown, not excused):")
        for c in deviating:
            print(f"  {c.test_id}: {c.deviation}")
            print(f"    observed: {c.message.splitlines()[0][:300]}\n    reproduce: {c.repro}")
    ran = {c.property_id for c in run.with_status(PASS, DEVIATION, FAIL)}
    unseen = ran - {c.property_id for c in deviating}
    declared = run.session.backend.deviations
    for pid, summary in dict.fromkeys((d.property_id, d.summary) for d in declared):
        if pid in unseen:
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


def _report(run: _Run, xfail_notes: list[str], counted_xfails: bool) -> int:
    """Print the results; returns the exit status."""
    print(format_table(run.cells))
    for line in xfail_notes:
        print(f"note: {line}")
    failed = run.with_status(FAIL, ERROR)
    for c in failed:
        where = f" after {c.first_failure_at} example(s)" if c.first_failure_at else ""
        print(f"\n{c.status} {c.test_id}{where}:")
        print("  " + c.message.replace("\n", "\n  "))
        if c.case is not None:
            what = "shrunk case" if c.shrunk and not c.nondeterministic else "failing case"
            case = c.case
            mbs = [(m.lead_shape, m.m_splits, m.is_first_microbatch) for m in case.micro_batches]
            print(
                f"  {what}: {case.config.label()}; micro-batches {mbs}"
                + (f"; schedule {list(case.schedule)}" if case.schedule else "")
                + (f"; variant {case.variant}" if case.variant else "")
                + (f"; frozen {list(case.frozen)}" if case.frozen else "")
                + (f"; asked {list(case.asked)}" if case.asked else "")
            )
            print(f"  reproduce: {c.repro}")
    _print_deviations(run)
    _print_gaps(run, bool(failed))
    # Examples that could not be judged, forced paths the backend lacks, FP8 cells n/a.
    rejected = [c for c in run.cells if c.rejected]
    if rejected:
        where = ", ".join(f"{c.test_id} ({c.rejected})" for c in rejected)
        print(
            f"\nnote: {sum(c.rejected for c in rejected)} drawn example(s) could not be judged and "
            f"were not counted (relu pre-activations within rounding distance of 0; see "
            f"properties/oracle/kink.py): {where}"
        )
    for path, why_not in run.session.unforceable.items():
        print(f"\nnote: forced path {path} not run on {run.session.backend.name}: {why_not}")
    for why_na in sorted({c.message for c in run.with_status(NA) if c.recipe != "none"}):
        print(f"\nnote: FP8 cells n/a: {why_na}")
    blocked = run.with_status(BLOCKED)
    stopped = ""
    if run.interrupted:
        stopped = f"interrupted after {len(run.cells)} of {len(run.session.cells)} cells: "
    print(
        f"\n{stopped}{len(run.with_status(PASS))} passed, {len(failed)} failed, "
        f"{len(run.with_status(DEVIATION))} known deviations, {len(run.with_status(NA))} n/a"
        + (f", {len(run.with_status(xfails.XFAIL))} expected failures" if counted_xfails else "")
        + (f", {len(blocked)} blocked" if blocked else "")
        + f" in {run.elapsed:.1f}s"
    )
    if run.interrupted:
        return INTERRUPTED
    unchecked = _nothing_checked(run)
    if unchecked:
        print(unchecked)
    return 1 if failed else (2 if run.session.gaps else (NOTHING_CHECKED if unchecked else 0))


def _nothing_checked(run: _Run) -> str:
    """The line saying that no cell checked anything, and why each was left out, or ``""``."""
    if run.with_status(PASS, FAIL, ERROR, DEVIATION, xfails.XFAIL):
        return ""
    reasons: dict[str, list[str]] = {}
    for c in run.cells:
        why = f"{c.status}: {c.message}" if c.status == BLOCKED else c.message
        reasons.setdefault(why or c.status, []).append(c.property_id)
    why = "; ".join(f"{', '.join(dict.fromkeys(pids))}: {r}" for r, pids in reasons.items())
    statuses = " or ".join(dict.fromkeys(c.status for c in run.cells))
    cells = "the only cell is" if len(run.cells) == 1 else f"all {len(run.cells)} cells are"
    return f"nothing was checked: {cells} {statuses} ({why})"


def _replay(args: argparse.Namespace, options: Options, backend) -> int:
    """``--case``: one case on the backend (on one forced path at most), as the campaign runs it."""
    paths = options.impl_paths
    if len(paths) > 1 or "all" in paths:
        raise _UsageError("--case replays on one --impl-path at most")
    if paths and paths[0] != "none":
        backend = ForcedPathBackend(backend, paths[0])
    torch.set_num_threads(options.threads)
    load_profile()
    if len(options.properties) != 1:
        raise _UsageError("--case needs exactly one --property")
    try:
        case = Case.from_json(args.case)
    except ValueError as exc:
        raise _UsageError(f"--case: {exc}") from None
    pid, config, name = options.properties[0], case.config, backend.name
    if args.device is not None and args.device != config.device:
        raise _UsageError(f"--device {args.device}, but the case runs on {config.device}")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise _UsageError("the case runs on cuda, but torch.cuda.is_available() is False")
    cell = CellResult(
        pid,
        config.kind,
        config.dtype,
        config.recipe or "none",
        path=paths[0] if paths and paths[0] != "none" else "default",
        case=case,
        shrunk=False,
        autocast=config.autocast,
    )
    start = time.perf_counter()
    status = _replay_verdict(cell, backend, case)
    cell.seconds = time.perf_counter() - start
    if args.json:
        payload = {
            "backend": name,
            "device": config.device,
            "replay": True,
            "elapsed_s": round(cell.seconds, 3),
            "cells": [cell.as_dict()],
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    if args.junit:
        _write_junit(args.junit, name, [cell], cell.seconds)
    return status


def _replay_verdict(cell: CellResult, backend, case: Case) -> int:
    """Run ``case`` for ``cell``'s property, print the verdict, fill ``cell`` with it and return
    the exit status (a case that does not apply, or cannot be judged, is no failure)."""
    pid, config, name = cell.property_id, case.config, backend.name
    gaps = blocking_gaps(backend, pid, config.kind, config.recipe is not None)
    if gaps:
        cell.status, cell.message = BLOCKED, f"missing API: {'; '.join(gaps.values())}"
        print(f"{pid} blocked on {name}: {cell.message}")
        return 2
    why = backend.unsupported_reason(pid, config) or case_na_reason(pid, backend, case)
    if why:
        cell.status, cell.message = NA, why
        print(f"{pid} n/a on {name}: {why}")
        return 0
    try:
        result = run_case(backend, pid, case)
    except CaseRejected as exc:
        cell.status, cell.rejected, cell.message = NA, 1, f"could not be judged: {exc}"
        print(f"{pid} rejected on {name}: {config.label()}: {exc}")
        return 0
    except Exception as exc:
        cell.examples, cell.first_failure_at = 1, 1
        cell.message, cell.repro = f"{type(exc).__name__}: {exc}", repro_command(backend, pid, case)
        dev = backend.deviation_for(pid, case, str(exc))
        cell.status = DEVIATION if dev else FAIL
        cell.deviation = dev.summary if dev else ""
        verdict = f"DEVIATES (known: {dev.summary})" if dev else "FAIL"
        print(f"{pid} {verdict} on {name}: {config.label()}\n  {cell.message}")
        return 0 if dev else 1
    cell.examples, cell.worst_ratio = 1, result.ratio
    cell.budget_ratio, cell.bitwise = result.budget_ratio, result.bitwise
    print(f"{pid} pass on {name}: {config.label()} (worst/budget {result.ratio})")
    return 0


#: The JUnit class of every cell: the pytest plugin's module, so both runners name cells alike.
JUNIT_CLASS = "splitgrad.properties.test_conformance"


def _write_junit(
    path: Path,
    backend_name: str,
    cells: list[CellResult],
    elapsed: float,
    interrupted: bool = False,
) -> None:
    """``cells`` as one JUnit test suite (an ``interrupted`` property when Ctrl-C stopped it)."""

    def count(*statuses: str) -> str:
        return str(sum(c.status in statuses for c in cells))

    root = ET.Element("testsuites")
    suite = ET.SubElement(
        root,
        "testsuite",
        name=f"splitgrad verify --backend {backend_name}",
        tests=str(len(cells)),
        failures=count(FAIL),
        errors=count(ERROR),
        skipped=count(NA, DEVIATION, BLOCKED),
        time=f"{elapsed:.3f}",
    )
    if interrupted:
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="interrupted", value="true")
    for c in cells:
        name, time_s = f"test_property[{c.test_id}]", f"{c.seconds:.3f}"
        tc = ET.SubElement(suite, "testcase", classname=JUNIT_CLASS, name=name, time=time_s)
        if c.status == FAIL:
            first = c.message.splitlines()[0][:500] if c.message else "failed"
            text = f"{c.message}\n\nreproduce: {c.repro}"
            ET.SubElement(tc, "failure", message=first).text = text
        elif c.status == ERROR:
            ET.SubElement(tc, "error", message=c.message[:500])
        elif c.status == DEVIATION:
            message = f"KNOWN DEVIATION: {c.deviation}"
            ET.SubElement(tc, "skipped", message=message).text = c.message
        elif c.status in (NA, BLOCKED):
            ET.SubElement(tc, "skipped", message=f"{c.status}: {c.message}")
        else:
            out = f"examples={c.examples} worst_ratio={c.ratio_text}"
            ET.SubElement(tc, "system-out").text = out
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def main(argv: Sequence[str]) -> int:
    """Entry point of ``splitgrad verify``; returns the exit status."""
    try:
        with gemm_paths.recording() as paths:
            return _main(list(argv), paths)
    except _UsageError as exc:
        return usage_error(build_parser(), str(exc))
    except _Refused as exc:
        return run_error("splitgrad verify", str(exc), USAGE_ERROR)
    except KeyboardInterrupt:  # outside the cells (those end with their summary): nothing to say
        print("\nsplitgrad verify: interrupted", file=sys.stderr)
        return INTERRUPTED


def _main(argv: list[str], paths: gemm_paths.PathLog) -> int:
    """parse -> session -> plan -> run -> report, json, junit."""
    args = build_parser().parse_args(argv)
    _check_outputs_and_case(args)
    options = _options(args)
    backend = _backend(options)
    if args.case is not None:
        return _replay(args, options, backend)
    session = _open_session(options, backend)
    optimized = None
    if any(c.property_id == "P9" for c in session.cells) and not any(
        "P9" in blocked for _, blocked in session.gaps.values()
    ):
        # P9's ``python -O`` subprocess runs while the first cells do.
        start_optimized_constructor_results(session.backend.name)
        # misuse keeps it until a P9 cell reads it, and has no public handle on it.
        optimized = misuse._OPTIMIZED_RUNNING.get(session.backend.name)
    try:
        return _campaign(args, session, paths)
    finally:
        if optimized is not None and optimized.poll() is None:
            # No P9 cell read it (the run stopped at a failure, or on Ctrl-C): it must not
            # outlive the run, nor be handed, killed, to a later run in this process.
            misuse._OPTIMIZED_RUNNING.pop(session.backend.name, None)
            optimized.kill()
            optimized.communicate()


def _campaign(args: argparse.Namespace, session: Session, paths: gemm_paths.PathLog) -> int:
    """Run and report the session's cells; write the JSON and JUnit files."""
    print(_header(session))
    for note in session.backend.notes:
        print(f"  note: {note}")
    for what, blocked in session.gaps.values():
        print(f"  missing API: {what}" + (f" (blocks {', '.join(blocked)})" if blocked else ""))
    sys.stdout.flush()
    run = _run_cells(session, args.quiet, args.fail_fast)
    xfail_notes = xfails.apply_to_cells(run.cells, args.xfails)
    status = _report(run, xfail_notes, bool(args.xfails))
    if session.device == "cuda":
        print("\nGEMM paths taken (splitgrad.impl; fast / fallback / forced / only):")
        for line in paths.lines() or ["(none recorded: no impl GEMM with a choice ran)"]:
            print(f"  {line}")
        for line in gemm_paths.missed_fast_paths():
            print(f"FAST PATH MISSED: {line}")
    if args.json:
        payload = {
            "backend": session.backend.name,
            "device": session.device,
            "profile": session.profile,
            "examples_per_cell": session.options.examples,
            "elapsed_s": round(run.elapsed, 3),
            "interrupted": run.interrupted,
            "cells_planned": len(session.cells),
            "notes": list(session.backend.notes),
            "missing_api": {p: {"what": w, "blocks": b} for p, (w, b) in session.gaps.items()},
            "cells": [c.as_dict() for c in run.cells],
            "gemm_paths": paths.summary(),
            "fast_paths_missed": gemm_paths.missed_fast_paths(),
        }
        args.json.write_text(json.dumps(payload, indent=2, default=str))
    if args.junit:
        _write_junit(args.junit, session.backend.name, run.cells, run.elapsed, run.interrupted)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
