"""P1-P3 (SPEC §7): outputs, input/norm gradients and weight/bias gradients of one forward and
backward per micro-batch within an error budget (:mod:`.budgets`) of the float64 truth and the
naive reference of the same steps (:func:`~.truth.truth_runs`); at a relu kink, of some legal
truth (:mod:`.kink`).
"""

from __future__ import annotations

from ..backends import Backend
from ..cases.case import Case
from ..cases.data import make_main_grads, make_micro_batches
from ..oracle.internals import dgrad_operand_floors, wgrad_operand_floors
from ..oracle.judge import (
    Judging,
    best_of,
    compare_dgrads,
    compare_outputs,
    compare_wgrads,
    kink_candidates,
    kink_note,
)
from ..oracle.kink import kink_choices, kink_deltas, kink_sites
from ..oracle.rounding import rounding_bounds
from ..oracle.truth import TruthRuns, memo, truth_runs
from .results import CheckResult, PropertyViolation, Tracker
from .runner import AccuracyRun, ModuleRun, fb_steps, play

__all__ = ["accuracy", "accuracy_runs", "check_p1", "check_p2", "check_p3"]


def accuracy_runs(backend: Backend, case: Case) -> tuple[AccuracyRun, TruthRuns]:
    """The run under test (one forward and backward per micro-batch) and its truth runs."""
    steps = fb_steps(len(case.micro_batches))
    test = play(ModuleRun(backend, case, delay=case.delay), make_micro_batches(case), steps)
    return test, truth_runs(case, steps)


def accuracy(backend: Backend, case: Case) -> tuple[AccuracyRun, AccuracyRun, AccuracyRun]:
    """(under test, naive reference, float64 truth) for ``case``."""
    test, runs = accuracy_runs(backend, case)
    return test, runs.naive, runs.truth


def _truth_candidates(case: Case, truth: AccuracyRun) -> tuple[list[AccuracyRun], str]:
    """The truths ``case`` may be judged against (``[truth]``, or one per ``relu'`` choice that
    :func:`~.kink.kink_choices` allows at fc1 pre-activations near the kink; it raises
    :class:`~.kink.CaseRejected` when there are too many), and the note a failure gets."""
    sites = kink_sites(case)
    picks = kink_choices(case, sites)
    if len(picks) == 1:
        return [truth], ""
    candidates = kink_candidates(truth, sites, picks, kink_deltas(case, sites))
    return candidates, kink_note(case, sites, len(candidates))


def check_p1(backend: Backend, case: Case) -> CheckResult:
    """P1: every micro-batch's output within :data:`~.budgets.OUTPUT` of the float64 truth."""
    test, runs = accuracy_runs(backend, case)
    judging = Judging(
        case, runs.naive, [runs.truth], runs.truth8, bounds=memo(rounding_bounds, case)
    )
    t = Tracker()
    compare_outputs(t, test, runs.truth, judging)
    return t.result


def check_p2(backend: Backend, case: Case) -> CheckResult:
    """P2: input gradients (:data:`~.budgets.DGRAD`) and norm-parameter gradients
    (:data:`~.budgets.NORM_GRAD`) within budget (of some legal truth at a relu kink; plus the
    per-element :data:`~.budgets.DGRAD_OPERAND_STEPS` allowance behind a smooth activation)."""
    test, runs = accuracy_runs(backend, case)
    return _best_of_truths(case, test, runs, compare_dgrads, dgrad_operand_floors)


def check_p3(backend: Backend, case: Case) -> CheckResult:
    """P3: GEMM weight/bias gradients (``main_grad`` when fused) within
    :data:`~.budgets.WGRAD` (plus, for operands the module computes, the per-element
    :data:`~.budgets.WGRAD_OPERAND_STEPS` allowance) after every ``backward_dw()``; fused weights
    keep ``.grad is None``."""
    test, runs = accuracy_runs(backend, case)
    if set(test.gemm) != set(runs.truth.gemm):
        raise PropertyViolation(f"gradient slots {sorted(test.gemm)} != {sorted(runs.truth.gemm)}")
    fused = case.config.fuse_wgrad_accumulation
    main_grads = make_main_grads(case.config, case.seed) if fused else {}
    prefills = {f"{k}.main_grad": v for k, v in main_grads.items()}
    return _best_of_truths(case, test, runs, compare_wgrads, wgrad_operand_floors, prefills)


def _best_of_truths(case, test, runs, compare, floors_of, prefills=None) -> CheckResult:
    """``compare(t, test, truth, judging)`` against every legal truth (:func:`_truth_candidates`),
    the operand allowances ``floors_of(case)``; the best one counts (:func:`~.judge.best_of`)."""
    candidates, note = _truth_candidates(case, runs.truth)
    judging = Judging(
        case,
        runs.naive,
        candidates,
        runs.truth8,
        floors=floors_of(case),
        prefills=prefills or {},
        bounds=memo(rounding_bounds, case),
        note=note,
    )
    first_wins = case.config.recipe is not None
    return best_of(
        candidates, lambda t, cand: compare(t, test, cand, judging), first_wins=first_wins
    )
