"""Run a property over hypothesis-drawn cases and summarise it as one table cell: examples, the
worst error/budget ratio and, on failure, the shrunk case, the message and a replay command.
pytest and ``splitgrad verify`` both use it, so a red CI row and a red ``verify`` row agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import time
from collections.abc import Iterator
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import FlakyFailure, HypothesisException, UnsatisfiedAssumption

from ..backends import Backend
from ..cases.case import Case, ModuleConfig
from ..checks.paths import ForcedPathBackend, forced_path_error
from ..checks.registry import (
    MODULE_PROTOCOL,
    SPECS,
    applicable,
    case_strategy,
    explicit_cases,
    run_check,
)
from ..checks.results import CheckResult
from .plan import cell_id

PASS, FAIL, DEVIATION, NA, ERROR = "pass", "FAIL", "deviates", "n/a", "ERROR"
#: The backend lacks part of SPEC's API that the property needs (reported once, not a FAIL).
BLOCKED = "blocked"
#: What the worst/budget column says for properties that compare no numbers against a budget.
CHECKED = {"P9": "raises (+ -O)", "P10": "raises, unchanged", "P11": "freed"}
#: How a failure that hypothesis' replay did not repeat begins its message.
NONDETERMINISTIC = (
    "nondeterministic: failed once, passed on replay — the implementation (or the machine) gives "
    "different results for the same input"
)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Run the block with torch's deterministic mode on (``enabled``) or off, then restore it.
    On, uninitialized memory is filled with NaN, so a read of it fails every run; ``warn_only``:
    an op may lack a deterministic kernel, and no budget relies on a fixed summation order."""
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    else:
        torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.utils.deterministic.fill_uninitialized_memory = before[2]


@dataclasses.dataclass
class CellResult:
    """The outcome of one cell's campaign."""

    property_id: str
    kind: str
    dtype: str
    recipe: str = "none"
    status: str = PASS
    examples: int = 0
    worst_ratio: float | None = None
    seconds: float = 0.0
    first_failure_at: int | None = None
    rejected: int = 0
    message: str = ""
    case: Case | None = None
    repro: str = ""
    deviation: str = ""
    path: str = "default"
    budget_ratio: float | None = None
    bitwise: int = 0
    nondeterministic: bool = False
    #: ``case`` is hypothesis' shrunk one (not an enumerated example, which it runs as given).
    shrunk: bool = True
    autocast: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["case"] = None if self.case is None else dataclasses.asdict(self.case)
        if self.worst_ratio is not None and math.isinf(self.worst_ratio):
            d["worst_ratio"] = "inf"
        return d

    @property
    def test_id(self) -> str:
        """:func:`.plan.cell_id` of the cell."""
        return cell_id(
            self.property_id, self.kind, self.dtype, self.recipe, self.path, self.autocast
        )

    @property
    def ratio_text(self) -> str:
        """The worst/budget column: the worst ratio (``bitwise;`` first when the property also
        compared bitwise), ``0 (bitwise)``, or what P9-P11 checked."""
        if self.status in (NA, BLOCKED):
            return "-"
        if self.worst_ratio is not None and math.isinf(self.worst_ratio):
            return "inf"
        if self.status == PASS and self.property_id in CHECKED:
            return CHECKED[self.property_id]
        if self.budget_ratio is not None:
            text = f"{self.budget_ratio:.3g}"
            return f"bitwise; {text}" if self.bitwise else text
        if self.worst_ratio is None:
            return "-"
        if self.worst_ratio == 0.0:
            return "0 (bitwise)"
        return f"{self.worst_ratio:.3g}"

    @property
    def label(self) -> str:
        """``P4 Linear bfloat16`` plus the recipe family and forced path when there are."""
        parts = [self.property_id, self.kind, self.dtype]
        parts += [self.recipe] if self.recipe != "none" else []
        parts += [f"path={self.path}"] if self.path != "default" else []
        parts += [f"autocast={self.autocast}"] if self.autocast is not None else []
        return " ".join(parts)


def repro_command(backend: Backend, property_id: str, case: Case) -> str:
    """The shell command that replays ``case`` under the campaign's conditions, down to this
    process's thread count (a reduction may split differently on more threads)."""
    args = [*backend.cli_args(), "--device", case.config.device]
    args += ["--threads", str(torch.get_num_threads()), "--property", property_id]
    return shlex.join(["splitgrad", "verify", *args, "--case", case.to_json()])


def api_gaps(backend: Backend, properties, fp8: bool) -> dict[str, tuple[str, list[str]]]:
    """part -> (what is missing, the ``properties`` it blocks) for the API ``backend`` lacks; FP8
    parts only when ``fp8`` (a recipe was asked for)."""
    return {
        part: (why, [pid for pid in properties if pid in SPECS and blocked_by(pid, part, fp8)])
        for part, why in backend.missing_api().items()
        if fp8 or part not in ("fp8", "fp8_quantizer")
    }


def blocked_by(property_id: str, part: str, fp8: bool = False) -> bool:
    """Whether missing API ``part`` blocks ``property_id`` (its cells cannot run at all)."""
    if part.startswith("module:"):
        return False  # blocks that module's cells, not the property
    if part == "fp8":
        return fp8 or SPECS[property_id].fp8_only
    return part in SPECS[property_id].needs


def blocking_gaps(backend: Backend, property_id: str, kind: str, fp8: bool) -> dict[str, str]:
    """part -> what is missing, for the API ``backend`` lacks that blocks a ``kind`` cell."""
    return {
        part: why
        for part, why in backend.missing_api().items()
        if part == f"module:{kind}" or (property_id in SPECS and blocked_by(property_id, part, fp8))
    }


def _profile_settings(profile: str, examples: int | None, seeded: bool = False) -> settings:
    parent = settings.get_profile(profile)
    return settings(
        parent,
        # An explicit seed must choose the examples (a derandomized profile would ignore it).
        derandomize=False if seeded else parent.derandomize,
        max_examples=examples if examples is not None else parent.max_examples,
        database=None,
        deadline=None,
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=[p for p in Phase if p != Phase.explain],
    )


def run_case(backend: Backend, property_id: str, case: Case) -> CheckResult:
    """One example outside hypothesis (``--case``, pinned tests), as :func:`run_cell` runs one."""
    with deterministic():
        return run_check(property_id, backend, case)


def run_cell(
    backend: Backend,
    property_id: str,
    kind: str,
    dtype: str,
    *,
    device: str = "cpu",
    examples: int | None = None,
    profile: str = "ci",
    dtypes: tuple[str, ...] | None = None,
    recipes: tuple[str | None, ...] = (None,),
    recipe_label: str | None = None,
    seed: int | None = None,
    fp8_asked: bool = True,
    autocast: str | None = None,
) -> CellResult:
    """Check ``property_id`` for module ``kind`` in ``dtype`` (or any of ``dtypes``) over drawn
    cases, the FP8 recipe drawn from ``recipes`` (``None``: high precision). Missing API makes
    the cell ``blocked`` (FP8 parts ``n/a`` unless ``fp8_asked``)."""
    fp8 = tuple(r for r in recipes if r is not None)
    label = recipe_label or (",".join(fp8) if fp8 else "none")
    cell = CellResult(property_id, kind, dtype, label, autocast=autocast)
    drawn = _drawn(backend, cell, device, dtypes or (dtype,), recipes, fp8_asked)
    if drawn is None:
        return cell
    args, kw = drawn
    calls_before = getattr(backend, "operator_calls", 0)
    seen: dict[str, Any] = {"case": None, "failed": None}
    start = time.perf_counter()
    campaign = _campaign(
        backend, property_id, cell, seen, case_strategy(*args, **kw), profile, examples, seed
    )
    enumerated = explicit_cases(*args, **kw)
    # SPEC §7: the boundary and enumerated cases run first (in order), whatever the count.
    for explicit in reversed(enumerated):
        campaign = example(case=explicit)(campaign)
    if seed is not None:
        campaign = hypothesis_seed(seed)(campaign)
    try:
        with deterministic():
            campaign()
    except FlakyFailure as exc:
        _nondeterministic(cell, backend, property_id, seen["failed"], exc)
    except HypothesisException as exc:
        cell.status, cell.message = ERROR, f"hypothesis could not run the campaign: {exc}"
    except Exception as exc:  # any failure of the implementation under test is a result
        # hypothesis replays the minimal failing example last: the last case seen is the shrunk one
        _failed(cell, backend, property_id, seen["case"], exc, enumerated)
    if cell.status == PASS:
        unexercised = forced_path_error(backend, calls_before, cell.examples)
        if unexercised:
            cell.status, cell.message = ERROR, unexercised
    cell.seconds = time.perf_counter() - start
    return cell


def explicit_count(
    backend: Backend,
    property_id: str,
    kind: str,
    dtype: str,
    *,
    device: str = "cpu",
    recipes: tuple[str | None, ...] = (None,),
    fp8_asked: bool = True,
    autocast: str | None = None,
) -> int | None:
    """How many explicit cases :func:`run_cell` runs before drawing, for the same arguments
    (``None``: the cell runs none, being n/a or blocked); nothing is run."""
    cell = CellResult(property_id, kind, dtype, "none", autocast=autocast)
    drawn = _drawn(backend, cell, device, (dtype,), recipes, fp8_asked)
    return None if drawn is None else len(explicit_cases(*drawn[0], **drawn[1]))


def _drawn(backend: Backend, cell: CellResult, device, dtypes, recipes, fp8_asked: bool):
    """The arguments of :func:`.registry.case_strategy` and :func:`.registry.explicit_cases` for
    ``cell`` (a forced path's own recipes, dtypes and size multiple), or ``None`` when the cell
    cannot run, filled in: ``blocked`` by missing API, or ``n/a``."""
    size_multiple = 1
    if isinstance(backend, ForcedPathBackend):
        path = backend.path
        cell.path, size_multiple = path.name, path.size_multiple
        if path.recipes is not None:
            recipes = tuple(r for r in recipes if r in path.recipes) or (None,)
        dtypes = tuple(d for d in dtypes if d in path.dtypes) or (cell.dtype,)
    pid, kind = cell.property_id, cell.kind
    fp8 = tuple(r for r in recipes if r is not None)
    blocked = blocking_gaps(backend, pid, kind, bool(fp8))
    if blocked:
        only_fp8 = all(p in ("fp8", "fp8_quantizer") for p in blocked)
        cell.status = NA if only_fp8 and not fp8_asked else BLOCKED
        cell.message = "; ".join(blocked.values())
        return None
    low = cell.dtype in ("float32", "bfloat16", "float16", "float64")
    probe = ModuleConfig(
        kind=kind,
        in_features=2,
        out_features=2,
        dtype=cell.dtype if low else dtypes[0],
        device=device,
        recipe=fp8[0] if fp8 else None,
        autocast=cell.autocast,
    )
    why = None if applicable(pid, kind) else f"{pid} does not apply to {kind}"
    if pid == "P13" and not fp8:
        why = why or "P13 checks FP8 quantizers: it needs an FP8 recipe (--recipe)"
    why = why or backend.unsupported_reason(pid, probe)
    if why:
        cell.status, cell.message = NA, why
        return None
    spec = SPECS.get(pid)
    without = {p for p in backend.missing_api() if spec is not None and p in spec.uses}
    if backend.module_protocol_reason() is not None:
        without.add(MODULE_PROTOCOL)  # said once in the backend's notes, not a gap
    kw = {
        "fused": None if backend.supports_fused else False,
        "recipes": recipes,
        "without": frozenset(without),
        "size_multiple": size_multiple,
        "autocast": cell.autocast,
    }
    return (pid, (kind,), dtypes, (device,)), kw


def _campaign(backend, property_id: str, cell, seen, strategy, profile, examples, seed):
    """The hypothesis test of one cell, counting examples and keeping the worst ratios in
    ``cell``; ``seen`` keeps the last case and the first failure. A derandomized profile seeds its
    examples from the source text of ``campaign`` below, decorators included: leave it as is."""

    @_profile_settings(profile, examples, seeded=seed is not None)
    @given(case=strategy)
    def campaign(case: Case) -> None:
        seen["case"] = case
        try:
            result = run_check(property_id, backend, case)
        except UnsatisfiedAssumption:
            cell.rejected += 1  # cannot be judged (e.g. the relu kink): not counted
            raise
        except Exception as exc:
            cell.examples += 1
            if cell.first_failure_at is None:
                cell.first_failure_at = cell.examples
                seen["failed"] = (case, exc)
            raise
        cell.examples += 1
        if result.ratio is not None:
            cell.worst_ratio = (
                result.ratio if cell.worst_ratio is None else max(cell.worst_ratio, result.ratio)
            )
        if result.budget_ratio is not None:
            b = cell.budget_ratio
            cell.budget_ratio = result.budget_ratio if b is None else max(b, result.budget_ratio)
        cell.bitwise += result.bitwise

    return campaign


def _failed(cell: CellResult, backend: Backend, pid: str, case, exc, enumerated) -> None:
    """Fill ``cell`` for a failure on ``case`` (replayed here first, as ``--case`` would): FAIL,
    a known deviation, or a nondeterministic FAIL."""
    if case is not None:
        try:
            run_case(backend, pid, case)
        except Exception:  # the same or another failure: the verdict stands
            pass
        else:
            _nondeterministic(cell, backend, pid, (case, exc), exc)
            return
    cell.case = case
    cell.shrunk = case not in enumerated  # hypothesis shrinks generated examples only
    cell.message = _describe(exc)
    ratio = getattr(exc, "ratio", math.inf)
    cell.worst_ratio = ratio if cell.worst_ratio is None else max(cell.worst_ratio, ratio)
    cell.repro = repro_command(backend, pid, case) if case is not None else ""
    dev = backend.deviation_for(pid, case, cell.message) if case is not None else None
    cell.status = FAIL if dev is None else DEVIATION
    if dev is not None:
        cell.deviation = dev.summary + (f" ({dev.reference})" if dev.reference else "")


def _describe(exc: BaseException) -> str:
    """A failure as the table's message: an assertion's own text, otherwise ``Type: text``."""
    return str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"


def _nondeterministic(cell: CellResult, backend: Backend, pid: str, failed, flaky) -> None:
    """Fill ``cell`` for a failure hypothesis could not repeat: a ``FAIL`` with the first failing
    case, its replay line and its first message."""
    if failed is None:  # no example of ours failed: hypothesis' own replay misbehaved
        cell.status, cell.message = ERROR, f"hypothesis could not run the campaign: {flaky}"
        return
    case, first = failed
    cell.status, cell.case, cell.nondeterministic = FAIL, case, True
    cell.repro = repro_command(backend, pid, case)
    cell.worst_ratio = getattr(first, "ratio", math.inf)
    cell.message = (
        f"{NONDETERMINISTIC}; run the reproduce line several times (or this cell with a few "
        f"--seed values) to investigate.\nfirst failure: {_describe(first)}"
    )
