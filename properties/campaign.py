"""Run a property over hypothesis-drawn cases and summarise it as one table cell.

A *cell* is (property, module kind, dtype, FP8 recipe family). :func:`run_cell` drives
``hypothesis`` with the chosen profile, counts examples (rejected ones apart), keeps the worst
error/budget ratio, and on failure keeps the shrunk case (hypothesis replays the minimal failing
example last, so the last case seen is the shrunk one), the message, and a command line that
replays it. pytest and ``splitgrad verify`` both use it, so a red CI row and a red ``verify`` row
say the same thing.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
import time
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.errors import HypothesisException, UnsatisfiedAssumption

from .backends import Backend
from .checks import CheckResult, case_strategy, run_check
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
]

PASS, FAIL, DEVIATION, NA, ERROR = "pass", "FAIL", "deviates", "n/a", "ERROR"


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

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["case"] = None if self.case is None else dataclasses.asdict(self.case)
        if self.worst_ratio is not None and math.isinf(self.worst_ratio):
            d["worst_ratio"] = "inf"
        return d

    @property
    def ratio_text(self) -> str:
        if self.worst_ratio is None:
            return "-"
        if math.isinf(self.worst_ratio):
            return "inf"
        if self.worst_ratio == 0.0:
            return "0 (bitwise)"
        return f"{self.worst_ratio:.3g}"


def repro_command(backend: Backend, property_id: str, case: Case) -> str:
    """One shell command that replays ``case`` for ``property_id`` on ``backend``."""
    return " ".join(
        [
            "splitgrad",
            "verify",
            "--backend",
            shlex.quote(backend.name),
            "--property",
            property_id,
            "--case",
            shlex.quote(case.to_json()),
        ]
    )


def _profile_settings(profile: str, examples: int | None) -> settings:
    parent = settings.get_profile(profile)
    return settings(
        parent,
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
    """One example, outside hypothesis (``--case`` replays and pinned tests)."""
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
) -> CellResult:
    """Check ``property_id`` for module ``kind`` in ``dtype`` (or any of ``dtypes``) on
    ``backend`` over hypothesis-drawn cases, with the FP8 recipe drawn from ``recipes``
    (``None``: high precision; ``recipe_label`` names the family in the table)."""
    from .checks import applicable
    from .strategies import ModuleConfig

    fp8 = tuple(r for r in recipes if r is not None)
    label = recipe_label or (",".join(fp8) if fp8 else "none")
    cell = CellResult(property_id, kind, dtype, label)
    probe = ModuleConfig(
        kind=kind,
        in_features=2,
        out_features=2,
        dtype=dtype if dtype in ("float32", "bfloat16", "float16", "float64") else "float32",
        device=device,
        recipe=fp8[0] if fp8 else None,
    )
    why = None if applicable(property_id, kind) else f"{property_id} does not apply to {kind}"
    if property_id == "P13" and not fp8:
        why = why or "P13 checks FP8 quantizers: it needs an FP8 recipe (--recipe)"
    why = why or backend.unsupported_reason(property_id, probe)
    if why:
        cell.status, cell.message = NA, why
        return cell
    strategy = case_strategy(
        property_id,
        (kind,),
        dtypes or (dtype,),
        (device,),
        fused=None if backend.supports_fused else False,
        recipes=recipes,
    )
    seen: dict[str, Any] = {"case": None}
    start = time.perf_counter()

    @_profile_settings(profile, examples)
    @given(case=strategy)
    def campaign(case: Case) -> None:
        seen["case"] = case
        try:
            result = run_check(property_id, backend, case)
        except UnsatisfiedAssumption:
            cell.rejected += 1  # cannot be judged (e.g. the relu kink): not counted
            raise
        except Exception:
            cell.examples += 1
            if cell.first_failure_at is None:
                cell.first_failure_at = cell.examples
            raise
        cell.examples += 1
        if result.ratio is not None:
            cell.worst_ratio = (
                result.ratio if cell.worst_ratio is None else max(cell.worst_ratio, result.ratio)
            )

    try:
        campaign()
    except HypothesisException as exc:
        cell.status, cell.message = ERROR, f"hypothesis could not run the campaign: {exc}"
    except Exception as exc:  # any failure of the implementation under test is a result
        case = seen["case"]
        cell.case = case
        cell.message = (
            f"{type(exc).__name__}: {exc}" if not isinstance(exc, AssertionError) else str(exc)
        )
        ratio = getattr(exc, "ratio", math.inf)
        cell.worst_ratio = ratio if cell.worst_ratio is None else max(cell.worst_ratio, ratio)
        cell.repro = repro_command(backend, property_id, case) if case is not None else ""
        dev = backend.deviation_for(property_id, case, cell.message) if case is not None else None
        if dev is not None:
            cell.status = DEVIATION
            cell.deviation = dev.summary + (f" ({dev.reference})" if dev.reference else "")
        else:
            cell.status = FAIL
    cell.seconds = time.perf_counter() - start
    return cell
