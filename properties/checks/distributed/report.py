"""What a distributed check returns: every comparison counted as the harness counts a cell's
(:class:`~splitgrad.properties.checks.results.CheckResult`) and every mismatch kept as a line, so
one run names all of them; and the ranks, launches and float64 truth every check judges."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
from splitgrad.distributed import RankFailure, run_ranks

from ...budgets import data_parallel_tolerance
from ..results import CheckResult, Tracker


@dataclasses.dataclass
class DistributedReport:
    """What a distributed check compared (``result``, ``compared``) and ``failures``."""

    name: str
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    tracker: Tracker = dataclasses.field(default_factory=Tracker)
    #: Why the package cannot be checked at all (a check it does not support): n/a, no failure.
    not_supported: str | None = None

    @property
    def result(self) -> CheckResult:
        return self.tracker.result

    @property
    def compared(self) -> int:
        return self.result.comparisons

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        if self.failures:
            shown = "\n  ".join(self.failures[:40])
            more = len(self.failures) - 40
            tail = f"\n  ... and {more} more" if more > 0 else ""
            raise AssertionError(f"{self.name}: {len(self.failures)} failure(s)\n  {shown}{tail}")

    def counted(self, ratio: float | None = None, *, bitwise: bool = False) -> None:
        """One comparison more: bitwise (``ratio`` 0 or inf), against a budget, or (``ratio``
        ``None``) a check of order or counts."""
        budget_ratio = None if bitwise else ratio
        self.tracker.merge(
            CheckResult(ratio=ratio, comparisons=1, bitwise=int(bitwise), budget_ratio=budget_ratio)
        )

    def bitwise(self, what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        failure = None
        if got is None or want is None:
            if got is not want:
                failure = f"{what}: got {_desc(got)}, expected {_desc(want)}"
        elif got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            failure = f"{what}: not bitwise equal ({_diff(got, want)})"
        self.counted(math.inf if failure else 0.0, bitwise=True)
        if failure:
            self.failures.append(failure)

    def within(
        self, what: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float
    ) -> None:
        if got is None or want is None:
            self.counted(0.0 if got is want else math.inf)
            if got is not want:
                self.failures.append(f"{what}: got {_desc(got)}, expected {_desc(want)}")
            return
        err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        self.counted(err / tol if tol > 0 else (0.0 if err == 0 else math.inf))
        if not err <= tol:
            self.failures.append(f"{what}: max error {err:.3g} > budget {tol:.3g}")


def merge_reports(name: str, *reports: DistributedReport) -> DistributedReport:
    """One report of several checks (``splitgrad distributed --check p16`` runs P16 alone and
    under fully_shard)."""
    out = DistributedReport(name)
    for r in reports:
        out.tracker.merge(r.result)
        out.failures += [f"[{r.name}] {f}" for f in r.failures]
        out.notes += r.notes
    return out


def _desc(t: torch.Tensor | None) -> str:
    return "None (no gradient)" if t is None else f"tensor {tuple(t.shape)} {t.dtype}"


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{_desc(got)} vs {_desc(want)}"
    d = (got.double() - want.double()).abs()
    i = int(d.argmax())
    a, b = got.flatten()[i].item(), want.flatten()[i].item()
    return f"max |diff| {float(d.max()):.3g} at flat index {i}: {a!r} vs {b!r}"


def run_checked(
    report: DistributedReport, what: str, fn: Callable, world: int, *args: Any, timeout_s: float
) -> list | None:
    """:func:`~splitgrad.distributed.run_ranks`, a failed or stuck rank (the package raised, or
    a harness step met what it did not expect) turned into a failure of ``report`` with its
    traceback's end; ``None`` then."""
    try:
        return run_ranks(fn, world, *args, timeout_s=timeout_s)
    except RankFailure as exc:
        tails = {r: tb.strip().splitlines()[-1:] for r, tb in exc.tracebacks.items()}
        report.failures.append(f"{what}: {str(exc).splitlines()[0]}: {tails}")
        report.notes.append(str(exc))
        return None


def baseline(report: DistributedReport, fn: Callable, *args: Any, timeout_s: float) -> Any:
    """``fn`` on one rank (:func:`run_checked`): the single-process baseline, in a process of its
    own with the ranks' thread count (CPU kernels may reduce in another order with more)."""
    out = run_checked(report, "single-process baseline", fn, 1, *args, timeout_s=timeout_s)
    return None if out is None else out[0]


def check_buckets(
    report: DistributedReport, where: str, got: dict, collective: str | None = None
) -> None:
    """Each of ``got``'s buckets launched once (by ``collective`` where given), none after
    ``finish()``: one comparison."""
    launches = got["launches"]
    launched = [e["bucket"] for e in launches]
    report.counted()
    if sorted(launched) != list(range(len(got["buckets"]))):
        report.failures.append(
            f"{where}: buckets launched {launched}, expected each of {len(got['buckets'])} once"
        )
    kinds = {e.get("collective") for e in launches}
    if collective and launches and kinds != {collective}:
        report.failures.append(f"{where}: launches were {kinds}, expected {collective}")
    finish = got["finish"]
    late = [e["bucket"] for e in launches if finish is not None and e["time"] > finish]
    if late:
        report.failures.append(f"{where}: buckets {late} launched after finish() was called")


def judge_truth(
    report: DistributedReport,
    where: str,
    got: dict,
    naive: dict,
    truth: dict,
    dtype: torch.dtype | None = None,
) -> None:
    """Every gradient in ``got`` within the data-parallel budget of the float64 ``truth``, scaled
    by the ``naive`` same-dtype run's own error (:func:`~.model.reference_runs`). ``dtype``: the
    compute dtype, for the budget's floor, where it is not the gradients' own (FSDP2 mixed
    precision computes in bf16, returns fp32)."""
    for name, g in got.items():
        want, yard = truth.get(name), naive.get(name)
        if want is None or yard is None or g is None:
            report.within(f"{where} {name} vs the float64 truth", g, want, 0.0)
            continue
        naive_err = float((yard.double() - want.double()).abs().max()) if want.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        tol = data_parallel_tolerance(dtype or g.dtype, naive_err, scale)
        report.within(f"{where} {name} vs the float64 truth", g, want, tol)
