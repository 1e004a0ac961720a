"""What one example of a property returns (:class:`CheckResult`; or it raises
:class:`PropertyViolation` / :class:`~.budgets.BudgetViolation`, both ``AssertionError``\\ s, so
hypothesis shrinks on them), and the :class:`Tracker` that collects it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .. import budgets as B
from .runner import ModuleRun, Snapshot

__all__ = ["PropertyViolation", "CheckResult", "Tracker"]


class PropertyViolation(AssertionError):
    """A property does not hold; the message says which invariant, on which tensor."""


@dataclasses.dataclass
class CheckResult:
    """``ratio``: worst error/budget over the example (0.0 when every comparison was bitwise
    and exact; ``None`` when nothing numeric was compared); ``comparisons``: tensors compared,
    ``bitwise`` of them bitwise; ``budget_ratio``: the worst ratio of the error-budget ones."""

    ratio: float | None = None
    comparisons: int = 0
    bitwise: int = 0
    budget_ratio: float | None = None


def _worst(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)


class Tracker:
    """Collects the worst ratio of one example while running its comparisons."""

    def __init__(self) -> None:
        self.result = CheckResult()

    def _note(self, ratio: float, bitwise: bool = False) -> None:
        r = self.result
        r.comparisons += 1
        r.ratio = _worst(r.ratio, ratio)
        if bitwise:
            r.bitwise += 1
        else:
            r.budget_ratio = _worst(r.budget_ratio, ratio)

    def merge(self, result: CheckResult) -> None:
        """Fold in the result of comparisons made by another tracker (the best of several
        candidate truths, :func:`~.judge.best_of`)."""
        r = self.result
        r.comparisons += result.comparisons
        r.bitwise += result.bitwise
        r.ratio = _worst(r.ratio, result.ratio)
        r.budget_ratio = _worst(r.budget_ratio, result.budget_ratio)

    def bitwise(
        self, name: str, actual: torch.Tensor | None, expected: torch.Tensor | None
    ) -> None:
        self._note(B.check_bitwise(name, actual, expected), bitwise=True)

    def bitwise_all(self, prefix: str, actual: Snapshot, expected: Snapshot) -> None:
        for k in sorted(set(actual) | set(expected)):
            self.bitwise(f"{prefix}{k}", actual.get(k), expected.get(k))

    def same_run(self, prefix: str, actual: ModuleRun, expected: ModuleRun) -> None:
        """Every gradient of ``actual``, then its FP8 state, bitwise equal to ``expected``'s."""
        self.bitwise_all(prefix, actual.all_snapshot(), expected.all_snapshot())
        self.bitwise_all(prefix, actual.fp8_snapshot(), expected.fp8_snapshot())

    def budget(self, name: str, *args: Any, **kwargs: Any) -> None:
        """:func:`~.budgets.check_error_budget` on tensor ``name``; its ratio is noted."""
        self._note(B.check_error_budget(name, *args, **kwargs))

    def fp8_budget(self, name: str, *args: Any, **kwargs: Any) -> None:
        """:func:`~.budgets.check_fp8_budget` on tensor ``name``; its ratio is noted."""
        self._note(B.check_fp8_budget(name, *args, **kwargs))

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise PropertyViolation(message)

    def equal(self, name: str, actual: Any, expected: Any) -> None:
        if actual != expected:
            raise PropertyViolation(f"{name}: got {actual!r}, expected {expected!r}")
