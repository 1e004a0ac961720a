"""Run a property over hypothesis-drawn cases and summarise it as one table cell.

A *cell* is (property, module kind, dtype, FP8 recipe family, forced fast path).
:func:`run_cell` drives ``hypothesis`` with the chosen profile, counts examples (rejected ones
apart), keeps the worst error/budget ratio, and on failure keeps the shrunk case (hypothesis
replays the minimal failing example last, so the last case seen is the shrunk one), the
message, and a command line that replays it. pytest and ``splitgrad verify`` both use it, so a
red CI row and a red ``verify`` row say the same thing.

Every example, in a campaign and in a replay (:func:`run_case`), runs under :func:`deterministic`:
torch's deterministic mode with uninitialized memory filled (NaN, or the largest integer), so a
read of memory nothing wrote fails every run on every machine instead of passing where the
allocator happened to hand back zeros. A failure that does not repeat on hypothesis' replay is a
``FAIL`` that says it is nondeterministic, with the case that failed and its first message.
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
from ..cases.case import Case
from ..checks.registry import MODULE_PROTOCOL, case_strategy, explicit_cases, run_check
from ..checks.results import CheckResult

__all__ = [
    "CellResult",
    "run_cell",
    "run_case",
    "repro_command",
    "PASS",
    "FAIL",
    "DEVIATION",
    "NA",
    "ERROR",
    "BLOCKED",
    "api_gaps",
    "deterministic",
    "NONDETERMINISTIC",
]

PASS, FAIL, DEVIATION, NA, ERROR = "pass", "FAIL", "deviates", "n/a", "ERROR"
#: The backend lacks part of SPEC's API that the property needs (reported once, not a FAIL).
BLOCKED = "blocked"

#: What the worst/budget column says for properties that compare no numbers against a budget.
CHECKED = {
    "P9": "raises (+ -O)",
    "P10": "raises, unchanged",
    "P11": "freed",
}


#: How a failure that hypothesis' replay did not repeat begins its message.
NONDETERMINISTIC = (
    "nondeterministic: failed once, passed on replay — the implementation (or the machine) gives "
    "different results for the same input"
)


@contextlib.contextmanager
def deterministic(enabled: bool = True) -> Iterator[None]:
    """Run the block with torch's deterministic mode on (``enabled``) or off, restoring the
    caller's mode, ``warn_only`` and ``fill_uninitialized_memory`` afterwards.

    On: ``torch.use_deterministic_algorithms(True, warn_only=True)`` with
    ``torch.utils.deterministic.fill_uninitialized_memory = True``, so ``torch.empty`` and the
    outputs ops allocate come filled with NaN (floats) or the largest integer: a read of
    uninitialized memory fails every run. ``warn_only``: an op without a deterministic kernel
    (``put_`` on the CPU, ``index_add_`` on CUDA) warns instead of raising, because a correct
    implementation may use one and the budgets do not rely on a fixed summation order.
    ``CUBLAS_WORKSPACE_CONFIG`` is set (when unset) so cuBLAS is deterministic, not warned about.
    """
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
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
    """The outcome of one (property, kind, dtype) campaign."""

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
    #: The failure did not repeat when hypothesis replayed its case (see :data:`NONDETERMINISTIC`).
    nondeterministic: bool = False
    #: ``case`` is hypothesis' shrunk one (not an enumerated example, which it runs as given).
    shrunk: bool = True
    #: The ``torch.autocast`` dtype every forward of the cell ran under (``None``: none).
    autocast: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["case"] = None if self.case is None else dataclasses.asdict(self.case)
        if self.worst_ratio is not None and math.isinf(self.worst_ratio):
            d["worst_ratio"] = "inf"
        return d

    @property
    def ratio_text(self) -> str:
        """The worst/budget column: the worst error/budget ratio of the comparisons against a
        budget (prefixed ``bitwise;`` when the property also compared bitwise), ``0 (bitwise)``
        when every comparison was bitwise, or what was checked for properties that compare no
        numbers (P9-P11)."""
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
        if self.recipe != "none":
            parts.append(self.recipe)
        if self.path != "default":
            parts.append(f"path={self.path}")
        if self.autocast is not None:
            parts.append(f"autocast={self.autocast}")
        return " ".join(parts)


def repro_command(backend: Backend, property_id: str, case: Case) -> str:
    """One shell command that replays ``case`` for ``property_id`` on ``backend`` under the
    campaign's conditions: the backend and forced path (``backend.cli_args()``), the device, the
    intra-op thread count of this process (a reduction may split differently on more threads),
    and the case itself (dtype, recipe, shapes, flags and seed travel in its JSON). The replay
    runs under :func:`deterministic` like the campaign; no profile setting reaches one example."""
    return " ".join(
        [
            "splitgrad",
            "verify",
            *(shlex.quote(a) for a in backend.cli_args()),
            "--device",
            case.config.device,
            "--threads",
            str(torch.get_num_threads()),
            "--property",
            property_id,
            "--case",
            shlex.quote(case.to_json()),
        ]
    )


def api_gaps(backend: Backend, properties, fp8: bool) -> dict[str, tuple[str, list[str]]]:
    """The parts of SPEC's API ``backend`` lacks that matter to ``properties``: part ->
    (what is missing, the properties it blocks). FP8 parts count only when ``fp8`` (a recipe
    was asked for)."""
    from ..checks.registry import SPECS

    out = {}
    for part, why in backend.missing_api().items():
        if part in ("fp8", "fp8_quantizer") and not fp8:
            continue
        blocked = [pid for pid in properties if pid in SPECS and blocked_by(pid, part, fp8)]
        out[part] = (why, blocked)
    return out


def blocked_by(property_id: str, part: str, fp8: bool = False) -> bool:
    """Whether missing API ``part`` blocks ``property_id`` (its cells cannot run at all)."""
    from ..checks.registry import SPECS

    spec = SPECS[property_id]
    if part.startswith("module:"):
        return False  # blocks that module's cells, not the property
    if part == "fp8":
        return fp8 or spec.fp8_only
    return part in spec.needs


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
    """One example, outside hypothesis (``--case`` replays and pinned tests), under the same
    conditions as an example of :func:`run_cell` (:func:`deterministic`)."""
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
    """Check ``property_id`` for module ``kind`` in ``dtype`` (or any of ``dtypes``) on
    ``backend`` over hypothesis-drawn cases, with the FP8 recipe drawn from ``recipes``
    (``None``: high precision; ``recipe_label`` names the family in the table). ``seed`` fixes
    hypothesis' seed (``None``: the profile's). A backend lacking part of the API the property
    needs gives a ``blocked`` cell (``n/a`` for FP8 parts when ``fp8_asked`` is false: the
    default run's FP8 slice on a backend without FP8); a forced fast path (:mod:`.paths`) that
    never ran gives an ``ERROR``."""
    from ..checks.paths import forced_path_error

    fp8 = tuple(r for r in recipes if r is not None)
    label = recipe_label or (",".join(fp8) if fp8 else "none")
    cell = CellResult(property_id, kind, dtype, label, autocast=autocast)
    plan = _CellPlan(property_id, kind, dtype, device, dtypes or (dtype,), recipes, autocast)
    plan.restrict_to_path(backend, cell)
    if plan.skipped(backend, cell, fp8_asked):
        return cell
    strategy = plan.strategy(backend)
    calls_before = getattr(backend, "operator_calls", 0)
    seen: dict[str, Any] = {"case": None, "failed": None}
    start = time.perf_counter()
    campaign = _campaign(backend, property_id, cell, seen, strategy, profile, examples, seed)
    enumerated = plan.enumerated(backend)
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
        _failed(cell, backend, property_id, seen["case"], exc, enumerated)
    if cell.status == PASS:
        unexercised = forced_path_error(backend, calls_before, cell.examples)
        if unexercised:
            cell.status, cell.message = ERROR, unexercised
    cell.seconds = time.perf_counter() - start
    return cell


@dataclasses.dataclass
class _CellPlan:
    """What one cell draws: its strategy's arguments, narrowed to a forced path's dtypes and
    recipes (:meth:`restrict_to_path`)."""

    property_id: str
    kind: str
    dtype: str
    device: str
    dtypes: tuple[str, ...]
    recipes: tuple[str | None, ...]
    autocast: str | None
    size_multiple: int = 1
    without: frozenset[str] = frozenset()

    @property
    def fp8(self) -> tuple[str, ...]:
        return tuple(r for r in self.recipes if r is not None)

    def restrict_to_path(self, backend: Backend, cell: CellResult) -> None:
        """A forced path runs only its own recipes and dtypes, at its size multiple."""
        from ..checks.paths import ForcedPathBackend

        if not isinstance(backend, ForcedPathBackend):
            return
        path = backend.path
        cell.path = path.name
        self.size_multiple = path.size_multiple
        if path.recipes is not None:
            self.recipes = tuple(r for r in self.recipes if r in path.recipes) or (None,)
        self.dtypes = tuple(d for d in self.dtypes if d in path.dtypes) or (self.dtype,)

    def skipped(self, backend: Backend, cell: CellResult, fp8_asked: bool) -> bool:
        """Fill ``cell`` and return True when it cannot run: ``blocked`` by missing API, or
        ``n/a`` (the property does not apply, or the backend says it does not support it)."""
        from ..cases.case import ModuleConfig
        from ..checks.registry import SPECS, applicable

        pid, kind = self.property_id, self.kind
        missing = backend.missing_api()
        spec = SPECS.get(pid)
        blocked = [
            part
            for part in missing
            if part == f"module:{kind}"
            or (spec is not None and blocked_by(pid, part, bool(self.fp8)))
        ]
        if blocked:
            only_fp8 = all(p in ("fp8", "fp8_quantizer") for p in blocked)
            cell.status = NA if only_fp8 and not fp8_asked else BLOCKED
            cell.message = "; ".join(missing[p] for p in blocked)
            return True
        low = self.dtype in ("float32", "bfloat16", "float16", "float64")
        probe = ModuleConfig(
            kind=kind,
            in_features=2,
            out_features=2,
            dtype=self.dtype if low else self.dtypes[0],
            device=self.device,
            recipe=self.fp8[0] if self.fp8 else None,
            autocast=self.autocast,
        )
        why = None if applicable(pid, kind) else f"{pid} does not apply to {kind}"
        if pid == "P13" and not self.fp8:
            why = why or "P13 checks FP8 quantizers: it needs an FP8 recipe (--recipe)"
        why = why or backend.unsupported_reason(pid, probe)
        if why:
            cell.status, cell.message = NA, why
            return True
        self.without = frozenset(p for p in missing if spec is not None and p in spec.uses)
        if backend.module_protocol_reason() is not None:
            self.without |= {MODULE_PROTOCOL}  # said once in the backend's notes, not a gap
        return False

    def _args(self, backend: Backend) -> tuple[tuple, dict]:
        args = (self.property_id, (self.kind,), self.dtypes, (self.device,))
        kw = {
            "fused": None if backend.supports_fused else False,
            "recipes": self.recipes,
            "without": self.without,
            "size_multiple": self.size_multiple,
            "autocast": self.autocast,
        }
        return args, kw

    def strategy(self, backend: Backend):
        args, kw = self._args(backend)
        return case_strategy(*args, **kw)

    def enumerated(self, backend: Backend) -> list[Case]:
        args, kw = self._args(backend)
        return explicit_cases(*args, **kw)


def _campaign(
    backend: Backend,
    property_id: str,
    cell: CellResult,
    seen: dict,
    strategy,
    profile: str,
    examples: int | None,
    seed: int | None,
):
    """The hypothesis test of one cell: runs the check on each case, counting examples
    (rejected ones apart) and keeping the worst ratios in ``cell``; ``seen`` keeps the last case
    and the first failure.

    A derandomized profile seeds its examples from the source text of ``campaign`` below, its
    decorators included (comments aside): changing it changes every cell's drawn cases."""

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


def _failed(
    cell: CellResult,
    backend: Backend,
    property_id: str,
    case: Case | None,
    exc: Exception,
    enumerated: list[Case],
) -> None:
    """Fill ``cell`` for a failure on ``case`` (hypothesis' shrunk one, or an enumerated case,
    which it does not replay: confirmed here first): FAIL, a known deviation, or a
    nondeterministic FAIL."""
    if case is not None and not _fails_again(backend, property_id, case):
        _nondeterministic(cell, backend, property_id, (case, exc), exc)
        return
    cell.case = case
    cell.shrunk = case not in enumerated  # hypothesis shrinks generated examples only
    cell.message = _describe(exc)
    ratio = getattr(exc, "ratio", math.inf)
    cell.worst_ratio = ratio if cell.worst_ratio is None else max(cell.worst_ratio, ratio)
    cell.repro = repro_command(backend, property_id, case) if case is not None else ""
    dev = backend.deviation_for(property_id, case, cell.message) if case is not None else None
    if dev is not None:
        cell.status = DEVIATION
        cell.deviation = dev.summary + (f" ({dev.reference})" if dev.reference else "")
    else:
        cell.status = FAIL


def _describe(exc: BaseException) -> str:
    """A failure as the table's message: an assertion's own text, otherwise ``Type: text``."""
    return str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"


def _fails_again(backend: Backend, property_id: str, case: Case) -> bool:
    """Whether ``case`` fails once more, replayed as ``--case`` would (:func:`run_case`)."""
    try:
        run_case(backend, property_id, case)
    except Exception:  # the same or another failure: the verdict stands
        return True
    return False


def _nondeterministic(
    cell: CellResult,
    backend: Backend,
    property_id: str,
    failed: tuple[Case, BaseException] | None,
    flaky: BaseException,
) -> None:
    """Fill ``cell`` for a failure hypothesis could not repeat: a ``FAIL`` (the same input gave
    two verdicts), with the first failing case, its replay line and its first message."""
    if failed is None:  # no example of ours failed: hypothesis' own replay misbehaved
        cell.status, cell.message = ERROR, f"hypothesis could not run the campaign: {flaky}"
        return
    case, first = failed
    cell.status, cell.case, cell.nondeterministic = FAIL, case, True
    cell.repro = repro_command(backend, property_id, case)
    cell.worst_ratio = getattr(first, "ratio", math.inf)
    cell.message = (
        f"{NONDETERMINISTIC}; run the reproduce line several times (or this cell with a few "
        f"--seed values) to investigate.\nfirst failure: {_describe(first)}"
    )
