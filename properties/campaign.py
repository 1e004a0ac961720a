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

from .backends import Backend
from .registry import MODULE_PROTOCOL, case_strategy, explicit_cases, run_check
from .results import CheckResult
from .strategies import Case

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
    from .registry import SPECS

    out = {}
    for part, why in backend.missing_api().items():
        if part in ("fp8", "fp8_quantizer") and not fp8:
            continue
        blocked = [pid for pid in properties if pid in SPECS and blocked_by(pid, part, fp8)]
        out[part] = (why, blocked)
    return out


def blocked_by(property_id: str, part: str, fp8: bool = False) -> bool:
    """Whether missing API ``part`` blocks ``property_id`` (its cells cannot run at all)."""
    from .registry import SPECS

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
    from .paths import ForcedPathBackend, forced_path_error
    from .registry import SPECS, applicable
    from .strategies import ModuleConfig

    fp8 = tuple(r for r in recipes if r is not None)
    label = recipe_label or (",".join(fp8) if fp8 else "none")
    cell = CellResult(property_id, kind, dtype, label, autocast=autocast)
    size_multiple = 1
    if isinstance(backend, ForcedPathBackend):
        path = backend.path
        cell.path = path.name
        size_multiple = path.size_multiple
        if path.recipes is not None:
            recipes = tuple(r for r in recipes if r in path.recipes) or (None,)
            fp8 = tuple(r for r in recipes if r is not None)
        dtypes = tuple(d for d in (dtypes or (dtype,)) if d in path.dtypes) or (dtype,)
    missing = backend.missing_api()
    spec = SPECS.get(property_id)
    blocked = [
        part
        for part in missing
        if part == f"module:{kind}"
        or (spec is not None and blocked_by(property_id, part, bool(fp8)))
    ]
    if blocked:
        only_fp8 = all(p in ("fp8", "fp8_quantizer") for p in blocked)
        cell.status = NA if only_fp8 and not fp8_asked else BLOCKED
        cell.message = "; ".join(missing[p] for p in blocked)
        return cell
    probe = ModuleConfig(
        kind=kind,
        in_features=2,
        out_features=2,
        dtype=(dtypes or (dtype,))[0]
        if dtype not in ("float32", "bfloat16", "float16", "float64")
        else dtype,
        device=device,
        recipe=fp8[0] if fp8 else None,
        autocast=autocast,
    )
    why = None if applicable(property_id, kind) else f"{property_id} does not apply to {kind}"
    if property_id == "P13" and not fp8:
        why = why or "P13 checks FP8 quantizers: it needs an FP8 recipe (--recipe)"
    why = why or backend.unsupported_reason(property_id, probe)
    if why:
        cell.status, cell.message = NA, why
        return cell
    without = frozenset(p for p in missing if spec is not None and p in spec.uses)
    if backend.module_protocol_reason() is not None:
        without |= {MODULE_PROTOCOL}  # said once in the backend's notes, not a gap in its API
    strategy = case_strategy(
        property_id,
        (kind,),
        dtypes or (dtype,),
        (device,),
        fused=None if backend.supports_fused else False,
        recipes=recipes,
        without=without,
        size_multiple=size_multiple,
        autocast=autocast,
    )
    calls_before = getattr(backend, "operator_calls", 0)
    seen: dict[str, Any] = {"case": None, "failed": None}
    start = time.perf_counter()

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

    # SPEC §7: the boundary and enumerated cases run first (in order), whatever the count.
    args = (property_id, (kind,), dtypes or (dtype,), (device,))
    fused = None if backend.supports_fused else False
    kw = {
        "recipes": recipes,
        "without": without,
        "size_multiple": size_multiple,
        "autocast": autocast,
    }
    enumerated = explicit_cases(*args, fused=fused, **kw)
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
        case = seen["case"]
        if case is not None and not _fails_again(backend, property_id, case):
            # hypothesis replays only generated failures: an explicit example's is confirmed here
            _nondeterministic(cell, backend, property_id, (case, exc), exc)
            cell.seconds = time.perf_counter() - start
            return cell
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
    if cell.status == PASS:
        unexercised = forced_path_error(backend, calls_before, cell.examples)
        if unexercised:
            cell.status, cell.message = ERROR, unexercised
    cell.seconds = time.perf_counter() - start
    return cell


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
