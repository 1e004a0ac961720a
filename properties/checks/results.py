"""What one example of a property returns, and the helper that collects it.

Each ``check_pN`` (one file per property group: :mod:`.accuracy` P1-P3, :mod:`.split` P4-P8,
:mod:`.misuse` P9-P10, :mod:`.memory` P11, :mod:`.grouped` P12, :mod:`.fp8` P13,
:mod:`.input_only` P17, :mod:`.fidelity` P18; :mod:`.registry` lists them) runs one example and
returns a :class:`CheckResult`, or raises :class:`PropertyViolation` /
:class:`~.budgets.BudgetViolation` (both ``AssertionError``\\ s, so hypothesis shrinks on them).
A :class:`Tracker` collects the worst error/budget ratio of the comparisons an example makes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import budgets as B
from .runner import Snapshot

__all__ = ["PropertyViolation", "CheckResult", "Tracker"]


class PropertyViolation(AssertionError):
    """A property does not hold; the message says which invariant, on which tensor."""


@dataclasses.dataclass
class CheckResult:
    """``ratio``: worst error/budget over the example (0.0 when every comparison was bitwise
    and exact; ``None`` when nothing numeric was compared); ``comparisons``: tensors compared."""

    ratio: float | None = None
    comparisons: int = 0
    #: Bitwise comparisons among them, and the worst ratio of the error-budget ones alone.
    bitwise: int = 0
    budget_ratio: float | None = None


class Tracker:
    """Collects the worst ratio of one example while running its comparisons."""

    def __init__(self) -> None:
        self.result = CheckResult()

    def _note(self, ratio: float, bitwise: bool = False) -> None:
        r = self.result
        r.comparisons += 1
        r.ratio = ratio if r.ratio is None else max(r.ratio, ratio)
        if bitwise:
            r.bitwise += 1
        else:
            r.budget_ratio = ratio if r.budget_ratio is None else max(r.budget_ratio, ratio)

    def merge(self, result: CheckResult) -> None:
        """Fold in the result of comparisons made by another tracker (the best of several
        candidate truths, :func:`~.accuracy.best_of`)."""
        r = self.result
        r.comparisons += result.comparisons
        r.bitwise += result.bitwise
        if result.ratio is not None:
            r.ratio = result.ratio if r.ratio is None else max(r.ratio, result.ratio)
        if result.budget_ratio is not None:
            b = r.budget_ratio
            r.budget_ratio = result.budget_ratio if b is None else max(b, result.budget_ratio)

    def bitwise(
        self, name: str, actual: torch.Tensor | None, expected: torch.Tensor | None
    ) -> None:
        self._note(B.check_bitwise(name, actual, expected), bitwise=True)

    def bitwise_all(self, prefix: str, actual: Snapshot, expected: Snapshot) -> None:
        keys = sorted(set(actual) | set(expected))
        for k in keys:
            self.bitwise(f"{prefix}{k}", actual.get(k), expected.get(k))

    def budget(
        self,
        name,
        actual,
        truth,
        naive,
        budget: B.ErrorBudget,
        dtype=None,
        module_dtype=None,
        naive_error: float | None = None,
        note: str = "",
        element_floor: torch.Tensor | None = None,
        floor_magnitude: float | None = None,
    ) -> None:
        self._note(
            B.check_error_budget(
                name,
                actual,
                truth,
                naive,
                budget,
                dtype,
                module_dtype,
                naive_error,
                note,
                element_floor,
                floor_magnitude,
            )
        )

    def fp8_budget(
        self,
        name,
        actual,
        truth,
        naive,
        budget: B.Fp8Budget,
        dtype=None,
        module_dtype=None,
        recipe="",
        fp8_eps: float = 2.0**-3,
        samples: int | None = None,
        bound=None,
        naive_truth=None,
    ) -> None:
        self._note(
            B.check_fp8_budget(
                name,
                actual,
                truth,
                naive,
                budget,
                dtype,
                module_dtype,
                recipe,
                fp8_eps,
                samples,
                bound,
                naive_truth,
            )
        )

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise PropertyViolation(message)

    def equal(self, name: str, actual: Any, expected: Any) -> None:
        if actual != expected:
            raise PropertyViolation(f"{name}: got {actual!r}, expected {expected!r}")
