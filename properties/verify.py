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
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from xml.etree import ElementTree as ET

from . import xfails
from .campaign import (
    BLOCKED,
    DEVIATION,
    ERROR,
    FAIL,
    NA,
    PASS,
    CellResult,
    api_gaps,
    blocked_by,
    run_case,
    run_cell,
)
from .plan import (
    AUTOCAST_CHOICES,
    DEFAULT_EXAMPLES,
    FP8_SLICE_EXAMPLES,
    PATH_CHOICES,
    PATH_SLICE_EXAMPLES,
    RECIPE_CHOICES,
    plan_cells,
)
from .registry import PROPERTIES, case_na_reason
from .strategies import DTYPES, KINDS, LOW_PRECISION_DTYPES, Case

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
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # no traceback, exit status 2
        raise _UsageError(message)


def _split_list(values: Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str]:
    if not values:
        return []
    if not any(item.strip() for v in values for item in v.split(",")):
        raise _UsageError(f"no {what} in {values[-1]!r}; expected one of {', '.join(allowed)}")
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
    return len(plan_cells(list(KINDS), ["float32", "bfloat16"], list(PROPERTIES)))


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
        "comma-separated: run only these (none: high precision) instead of the default run",
    )
    p.add_argument(
        "--impl-path",
        action="append",
        metavar="PATH",
        help=f"force a fast path on the backend's modules: {', '.join(PATH_CHOICES)}, "
        "repeatable or comma-separated: run only these instead of the default run (none: the "
        "default run without its forced-path and autocast slices)",
    )
    p.add_argument(
        "--autocast",
        action="append",
        metavar="DTYPE",
        help=f"run float32 modules under torch.autocast to: {', '.join(AUTOCAST_CHOICES)}, "
        "repeatable or comma-separated: run only these instead of the default run (none: the "
        "default run without its autocast slice)",
    )
    p.add_argument(
        "--property",
        action="append",
        metavar="PID",
        help=f"property id(s) among {', '.join(PROPERTIES)} (default: all)",
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


def _progress_bar(done: int, total: int, label: str) -> None:
    width = 28
    filled = int(width * done / max(total, 1))
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<40}")
    sys.stderr.flush()
    if done == total:
        sys.stderr.write("\r" + " " * (width + 60) + "\r")


def _progress_line(done: int, total: int, cell: CellResult) -> None:
    n = "-" if cell.status in (NA, BLOCKED) else f"{cell.examples} examples"
    sys.stderr.write(f"[{done}/{total}] {cell.label}: {cell.status} ({n}, {cell.seconds:.1f} s)\n")
    sys.stderr.flush()


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


def _write_junit(path: Path, backend: str, cells: list[CellResult], elapsed: float) -> None:
    suite = ET.Element(
        "testsuite",
        name=f"splitgrad verify --backend {backend}",
        tests=str(len(cells)),
        failures=str(sum(c.status == FAIL for c in cells)),
        errors=str(sum(c.status == ERROR for c in cells)),
        skipped=str(sum(c.status in (NA, DEVIATION, BLOCKED) for c in cells)),
        time=f"{elapsed:.3f}",
    )
    for c in cells:
        name = f"{c.kind}[{c.dtype}]" + (f"[{c.recipe}]" if c.recipe != "none" else "")
        name += f"[path={c.path}]" if c.path != "default" else ""
        name += f"[autocast={c.autocast}]" if c.autocast is not None else ""
        tc = ET.SubElement(
            suite,
            "testcase",
            classname=f"splitgrad.verify.{c.property_id}",
            name=name,
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
        elif c.status in (NA, BLOCKED):
            ET.SubElement(tc, "skipped", message=f"{c.status}: {c.message}")
        else:
            ET.SubElement(
                tc, "system-out"
            ).text = f"examples={c.examples} worst_ratio={c.ratio_text}"
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


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
    except (KeyError, TypeError, AttributeError) as exc:  # JSON of another shape
        raise _UsageError(f"--case: not a splitgrad case ({type(exc).__name__}: {exc})") from None
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
    from splitgrad.impl import gemm_paths

    try:
        with gemm_paths.recording() as paths:
            return _main(list(argv), paths)
    except _UsageError as exc:
        print(f"splitgrad verify: error: {exc}\nTry 'splitgrad verify --help'.", file=sys.stderr)
        return 2


def _load_backend(name: str):
    """(backend, why it is unavailable or None)."""
    from .backends import BACKEND_NAMES, BackendUnavailable, get_backend

    if name not in BACKEND_NAMES and not name.startswith(("path:", "module:", "class:")):
        raise _UsageError(
            f"unknown backend {name!r}; expected one of {', '.join(BACKEND_NAMES)}, path:DIR, "
            "module:NAME or class:MODULE:ATTR"
        )
    if name.startswith("path:") and not Path(name[len("path:") :]).exists():
        return None, f"{name[len('path:') :]} does not exist"
    try:
        backend = get_backend(name)
        return backend, backend.unavailable_reason()
    except BackendUnavailable as exc:
        return None, str(exc)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None


def _nothing_to_run(kinds: list[str], impl_paths: list[str]) -> str:
    """Why the options select no cell."""
    from .paths import IMPL_PATHS

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


def _main(argv: list[str], paths=None) -> int:
    args = build_parser().parse_args(argv)
    kinds = _split_list(args.module, KINDS, "module") or list(KINDS)
    dtypes = _split_list(args.dtype, DTYPES, "dtype") or ["float32", "bfloat16"]
    properties = _split_list(args.property, list(PROPERTIES), "property") or list(PROPERTIES)
    families = _split_list(args.recipe, RECIPE_CHOICES, "recipe")
    impl_paths = _split_list(args.impl_path, PATH_CHOICES, "impl path")
    autocasts = _split_list(args.autocast, AUTOCAST_CHOICES, "autocast dtype")
    if args.dtype and set(dtypes) != {"float32"} and set(autocasts) - {"none"}:
        raise _UsageError(
            f"--autocast {','.join(autocasts)} runs float32 modules under torch.autocast, so "
            f"--dtype {','.join(dtypes)} would be ignored; leave --dtype out"
        )
    if args.examples is not None and args.examples < 1:
        raise _UsageError(f"--examples must be at least 1, got {args.examples}")
    if args.threads < 1:
        raise _UsageError(f"--threads must be at least 1, got {args.threads}")
    name = args.backend
    backend, why = _load_backend(name)
    if why:
        print(f"splitgrad verify: backend {name!r} is not available: {why}", file=sys.stderr)
        return 2
    device = args.device or ("cuda" if name == "transformer_engine" else "cpu")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        print(
            "splitgrad verify: --device cuda, but torch.cuda.is_available() is False",
            file=sys.stderr,
        )
        return 2
    torch.set_num_threads(args.threads)
    from .profiles import active_profile_name, load_profile

    load_profile()
    profile = args.profile or (
        "ci" if not os.environ.get("HYPOTHESIS_PROFILE") else active_profile_name()
    )
    examples = (
        args.examples if args.examples is not None else (None if args.profile else DEFAULT_EXAMPLES)
    )
    from .paths import ForcedPathBackend

    forced: dict[str, ForcedPathBackend] = {}
    if args.case:
        if len(impl_paths) > 1 or "all" in impl_paths:
            raise _UsageError("--case replays on one --impl-path at most")
        if impl_paths and impl_paths[0] != "none":
            backend = ForcedPathBackend(backend, impl_paths[0])
        return _replay(backend, properties, args.case, args.device)

    plan = plan_cells(
        kinds,
        dtypes,
        properties,
        families,
        impl_paths or None,
        examples,
        autocasts or None,
    )
    # Forced paths need the implementation's knob: a backend without it has no such path.
    unforceable: dict[str, str] = {}
    for cell in plan:
        if cell.path != "default" and cell.path not in forced:
            forced[cell.path] = ForcedPathBackend(backend, cell.path)
    kept = []
    for cell in plan:
        if cell.path != "default":
            why_not = forced[cell.path].knob_missing(cell.kind)
            if why_not:
                unforceable.setdefault(cell.path, why_not)
                continue
        kept.append(cell)
    if impl_paths and unforceable and not any(c.path != "default" for c in kept):
        reasons = "; ".join(f"{p}: {w}" for p, w in unforceable.items())
        raise _UsageError(f"--impl-path on backend {backend.name!r}: {reasons}")
    plan = kept
    if not plan:
        raise _UsageError(_nothing_to_run(kinds, impl_paths))
    fp8_asked = any(f != "none" for f in families) or any(
        c.recipe_label != "none" for c in plan if c.path != "default"
    )
    gaps = api_gaps(backend, properties, fp8_asked)
    if any(c.property_id == "P9" for c in plan) and not any(
        "P9" in blocked for _, blocked in gaps.values()
    ):
        from .misuse import start_optimized_constructor_results

        start_optimized_constructor_results(backend.name)  # runs while the first cells do
    tty = sys.stderr.isatty()
    print(_header(backend, device, profile, plan))
    for note in backend.notes:
        print(f"  note: {note}")
    for what, blocked in gaps.values():
        print(f"  missing API: {what}" + (f" (blocks {', '.join(blocked)})" if blocked else ""))
    sys.stdout.flush()
    cells: list[CellResult] = []
    start = time.perf_counter()
    for i, pc in enumerate(plan):
        if not args.quiet and tty:
            _progress_bar(i, len(plan), pc.test_id)
        cell_backend = forced[pc.path] if pc.path != "default" else backend
        if pc.property_id in ("P1", "P2", "P3") and pc.dtype not in LOW_PRECISION_DTYPES:
            cell = CellResult(
                pc.property_id,
                pc.kind,
                pc.dtype,
                pc.recipe_label,
                status=NA,
                message="no wider dtype to measure error against",
                path=pc.path,
            )
        else:
            cell = run_cell(
                cell_backend,
                pc.property_id,
                pc.kind,
                pc.dtype,
                device=device,
                examples=pc.examples,
                profile=profile,
                recipes=pc.recipes,
                recipe_label=pc.recipe_label,
                seed=args.seed,
                fp8_asked=fp8_asked,
                autocast=pc.autocast,
            )
        cells.append(cell)
        if not args.quiet and not tty:
            _progress_line(i + 1, len(plan), cell)
        if args.fail_fast and cell.status in (FAIL, ERROR):
            break
    if not args.quiet and tty:
        _progress_bar(len(plan), len(plan), "")
    elapsed = time.perf_counter() - start
    xfail_notes = xfails.apply_to_cells(cells, args.xfails)
    print(format_table(cells))
    for line in xfail_notes:
        print(f"note: {line}")
    failed = [c for c in cells if c.status in (FAIL, ERROR)]
    deviating = [c for c in cells if c.status == DEVIATION]
    blocked = [c for c in cells if c.status == BLOCKED]
    for c in failed:
        mbs = c.case.micro_batches if c.case is not None else ()
        where = f" after {c.first_failure_at} example(s)" if c.first_failure_at else ""
        print(f"\n{c.status} {c.label}{where}:")
        print("  " + c.message.replace("\n", "\n  "))
        if c.case is not None:
            what = "shrunk case" if c.shrunk and not c.nondeterministic else "failing case"
            print(
                f"  {what}: {c.case.config.label()}; micro-batches "
                f"{[(m.lead_shape, m.m_splits, m.is_first_microbatch) for m in mbs]}"
                + (f"; schedule {list(c.case.schedule)}" if c.case.schedule else "")
                + (f"; variant {c.case.variant}" if c.case.variant else "")
                + (f"; frozen {list(c.case.frozen)}" if c.case.frozen else "")
                + (f"; asked {list(c.case.asked)}" if c.case.asked else "")
            )
            print(f"  reproduce: {c.repro}")
    if deviating:
        print("\nknown deviations from SPEC.md (declared by the backend, shown, not excused):")
        for c in deviating:
            print(f"  {c.label}: {c.deviation}\n    observed: {c.message.splitlines()[0][:300]}")
            print(f"    reproduce: {c.repro}")
    ran = {c.property_id for c in cells if c.status in (PASS, DEVIATION, FAIL)}
    unseen = []
    for dev in backend.deviations:
        if dev.property_id in ran and not any(
            c.property_id == dev.property_id and c.status == DEVIATION for c in cells
        ):
            if (dev.property_id, dev.summary) not in unseen:
                unseen.append((dev.property_id, dev.summary))
    for pid, summary in unseen:
        print(f"\nnote: declared deviation not observed in this run: {pid}: {summary}")
    status = 1 if failed else (2 if gaps else 0)
    if gaps:
        why_status = "exit status 1: a cell failed" if failed else "exit status 2"
        print(f"\n{backend.name} lacks part of SPEC's API (reported once; {why_status}):")
        for part, (what, props) in gaps.items():
            cells_of = [c for c in blocked if what in c.message]
            also = f"; {len(cells_of)} cell(s) blocked" if cells_of else ""
            blocks = f"blocks {', '.join(props)}" if props else "blocks no property outright"
            if part.startswith("module:"):
                blocks = f"blocks every {part[len('module:') :]} cell"
            print(
                f"  {what}: "
                + blocks
                + also
                + (" (the other properties run without it)" if part in _OPTIONAL_PARTS else "")
            )
    rejected = [c for c in cells if c.rejected]
    if rejected:
        where = ", ".join(f"{c.label} ({c.rejected})" for c in rejected)
        print(
            f"\nnote: {sum(c.rejected for c in rejected)} drawn example(s) could not be judged and "
            f"were not counted (relu pre-activations within rounding distance of 0; see "
            f"properties/kink.py): {where}"
        )
    for path, why_not in unforceable.items():
        print(f"\nnote: forced path {path} not run on {backend.name}: {why_not}")
    fp8_na = sorted({c.message for c in cells if c.status == NA and c.recipe != "none"})
    for why_na in fp8_na:
        print(f"\nnote: FP8 cells n/a: {why_na}")
    n_pass = sum(c.status == PASS for c in cells)
    print(
        f"\n{n_pass} passed, {len(failed)} failed, {len(deviating)} known deviations, "
        f"{sum(c.status == NA for c in cells)} n/a"
        + (
            f", {sum(c.status == xfails.XFAIL for c in cells)} expected failures"
            if args.xfails
            else ""
        )
        + (f", {len(blocked)} blocked" if blocked else "")
        + f" in {elapsed:.1f}s"
    )
    if device == "cuda" and paths is not None:
        _print_gemm_paths(paths)
    payload = {
        "backend": backend.name,
        "device": device,
        "profile": profile,
        "examples_per_cell": examples,
        "elapsed_s": round(elapsed, 3),
        "notes": list(backend.notes),
        "missing_api": {part: {"what": w, "blocks": b} for part, (w, b) in gaps.items()},
        "cells": [c.as_dict() for c in cells],
        "gemm_paths": paths.summary() if paths is not None else [],
        "fast_paths_missed": _missed_fast_paths(),
    }
    if args.json:
        args.json.write_text(json.dumps(payload, indent=2, default=_json_default))
    if args.junit:
        _write_junit(args.junit, backend.name, cells, elapsed)
    return status


_OPTIONAL_PARTS = ("delay", "fused", "first_microbatch", "hooks")


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


def _json_default(value):
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return str(value)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
