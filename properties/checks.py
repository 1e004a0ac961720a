"""Property checks P1–P12 of SPEC.md §7, as functions of ``(backend, case)``.

Each ``check_pN`` runs one example and returns a :class:`CheckResult` (the worst error/budget
ratio it saw, ``None`` when it compares no numbers), or raises :class:`PropertyViolation` /
:class:`~.budgets.BudgetViolation` (both ``AssertionError``\\ s, so hypothesis shrinks on them).
pytest (``tests/test_properties_*.py``) and ``splitgrad verify`` call the same functions with
cases from :func:`case_strategy`.

Truth and baseline for P1–P3 come from the reference: the naive run is
``splitgrad.reference`` in the case's dtype, the truth is its float64 twin from
:func:`splitgrad.reference.upcast` (same code, same weights, same ``main_grad`` prefill).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st
from torch.multiprocessing.reductions import StorageWeakRef

from . import budgets as B
from .backends import Backend, get_backend
from .data import (
    GEMM_WEIGHT,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    make_state,
    param_specs,
)
from .internals import dgrad_operand_floors, wgrad_operand_floors
from .kink import CaseRejected, choices, kink_deltas, kink_sites
from .runner import ModuleRun, Snapshot
from .strategies import (
    KINDS,
    LOW_PRECISION_DTYPES,
    RECIPES,
    Case,
    MicroBatch,
    ModuleConfig,
    cases,
    make_recipe,
    micro_batches,
    module_configs,
    schedules,
    seeds,
)

__all__ = [
    "PROPERTIES",
    "PropertyViolation",
    "CheckResult",
    "Tracker",
    "case_strategy",
    "run_check",
    "check_p1",
    "check_p2",
    "check_p3",
    "check_p4",
    "check_p5",
    "check_p6",
    "check_p7",
    "check_p8",
    "check_p9",
    "check_p10",
    "check_p11",
    "check_p12",
    "check_p13",
    "MISUSES",
]

PROPERTIES = {
    "P1": "forward output within budget of the reference",
    "P2": "input and norm gradients within budget",
    "P3": "weight/bias gradients (or main_grad) within budget after backward_dw()",
    "P4": "delayed == non-delayed, bitwise (random .grad and main_grad prefill)",
    "P5": "between backward() and backward_dw(): input grads final, GEMM grads untouched, no hooks",
    "P6": "any legal interleaving of forward/backward/backward_dw/zero == non-delayed run",
    "P7": "tied weights (module used twice) and frozen weights",
    "P8": "is_first_microbatch overwrites main_grad under fused accumulation only",
    "P9": "ub_bulk_wgrad + delay raises ValueError, also under python -O",
    "P10": "bad input and misuse raise the errors of SPEC §4/§5 and change nothing",
    "P11": "after backward_dw() the entry's tensors are freed",
    "P12": "GroupedLinear == a list of Linears on torch.split(x, m_splits)",
    "P13": "FP8 quantizers == the reference's bit for bit; amax histories delayed == not",
}


class PropertyViolation(AssertionError):
    """A property does not hold; the message says which invariant, on which tensor."""


@dataclasses.dataclass
class CheckResult:
    """``ratio``: worst error/budget over the example (0.0 when every comparison was bitwise
    and exact; ``None`` when nothing numeric was compared); ``comparisons``: tensors compared."""

    ratio: float | None = None
    comparisons: int = 0


class Tracker:
    """Collects the worst ratio of one example while running its comparisons."""

    def __init__(self) -> None:
        self.result = CheckResult()

    def _note(self, ratio: float) -> None:
        self.result.comparisons += 1
        self.result.ratio = ratio if self.result.ratio is None else max(self.result.ratio, ratio)

    def bitwise(
        self, name: str, actual: torch.Tensor | None, expected: torch.Tensor | None
    ) -> None:
        self._note(B.check_bitwise(name, actual, expected))

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
    ) -> None:
        self._note(
            B.check_fp8_budget(
                name, actual, truth, naive, budget, dtype, module_dtype, recipe, fp8_eps, samples
            )
        )

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            raise PropertyViolation(message)

    def equal(self, name: str, actual: Any, expected: Any) -> None:
        if actual != expected:
            raise PropertyViolation(f"{name}: got {actual!r}, expected {expected!r}")


def _reference() -> Backend:
    return get_backend("reference")


# =============================================================================================
# P1–P3: error budgets against the float64 truth
# =============================================================================================


@dataclasses.dataclass
class _AccuracyRun:
    outputs: list[torch.Tensor]
    xgrads: list[torch.Tensor | None]
    norm: Snapshot
    gemm: Snapshot


def _accuracy_run(
    run: ModuleRun, case: Case, data, dtype: torch.dtype | None = None
) -> _AccuracyRun:
    outputs, xgrads = [], []
    for d in data:
        if dtype is not None:
            d = dataclasses.replace(d, x=d.x.to(dtype), dy=d.dy.to(dtype))
        x, y = run.fb(d)
        outputs.append(y)
        xgrads.append(None if x.grad is None else x.grad.detach().clone())
    norm = run.norm_snapshot()
    run.drain()
    return _AccuracyRun(outputs, xgrads, norm, run.gemm_snapshot())


def _accuracy(backend: Backend, case: Case) -> tuple[_AccuracyRun, _AccuracyRun, _AccuracyRun]:
    """(under test, naive reference, float64 truth) for ``case``."""
    test, naive, truth, _ = _accuracy_runs(backend, case)
    return test, naive, truth


def _accuracy_runs(
    backend: Backend, case: Case
) -> tuple[_AccuracyRun, _AccuracyRun, _AccuracyRun, _AccuracyRun | None]:
    """(under test, naive reference, float64 truth, FP8 truth) for ``case``.

    The naive run is the reference in the case's dtype (under the case's recipe); the truth is
    its float64 twin *without* FP8; the FP8 truth (``None`` without a recipe) is the float64
    twin under the same recipe: the same quantizations followed by exact GEMMs."""
    from splitgrad.reference import upcast

    data = make_micro_batches(case)
    test = _accuracy_run(ModuleRun(backend, case, delay=case.delay), case, data)
    naive_run = ModuleRun(_reference(), case, delay=False, hooks=0)

    def float64_run(recipe: str | None) -> _AccuracyRun:
        run = ModuleRun(
            _reference(),
            case,
            delay=False,
            hooks=0,
            module=upcast(naive_run.module),
            config=dataclasses.replace(case.config, dtype="float64", recipe=recipe),
            main_grads=False,
        )
        return _accuracy_run(run, case, data, torch.float64)

    truth = float64_run(None)
    truth_fp8 = float64_run(case.config.recipe) if case.config.recipe is not None else None
    naive = _accuracy_run(naive_run, case, data)
    return test, naive, truth, truth_fp8


def _fp8_exact_operands(config: ModuleConfig, name: str) -> bool:
    """Whether every FP8-quantized operand on the way to tensor ``name`` is a module input,
    parameter or output gradient (none is computed by the module: no norm or activation output),
    so that impl, the naive reference and the FP8 truth quantize bit-identical values."""
    if config.kind in ("Linear", "GroupedLinear"):
        return True
    if config.kind == "LayerNormLinear":
        # dgrad q(dy) q(W) feeds the norm backward; the bias gradient is summed from dy.
        return name.startswith(("inp.grad", "layer_norm_", "bias."))
    return name.startswith("fc2_bias.")


def _judge(
    t: Tracker,
    case: Case,
    name: str,
    actual: torch.Tensor | None,
    naive: torch.Tensor | None,
    truth: torch.Tensor | None,
    truth_fp8: torch.Tensor | None,
    budget: B.ErrorBudget,
    dtype: torch.dtype | None = None,
    module_dtype: torch.dtype | None = None,
    naive_error: float | None = None,
    note: str = "",
    element_floor: torch.Tensor | None = None,
    prefill: torch.Tensor | None = None,
) -> None:
    """One P1–P3 comparison. High precision: ``budget`` against the float64 truth. FP8:
    ``budget`` against the FP8 truth when every quantized operand is an input (the quantized
    values are then the same on all sides and only the GEMMs' rounding differs), otherwise the
    two-gate :data:`~.budgets.FP8` budget against the high-precision truth (see budgets.py).
    ``prefill``: ``main_grad``'s value before the run (its floor is then taken at
    :func:`~.budgets.accumulation_magnitude`)."""
    exact = case.config.recipe is None or _fp8_exact_operands(case.config, name)
    reference = truth if case.config.recipe is None else truth_fp8
    magnitude = None
    if exact and prefill is not None and reference is not None:
        magnitude = B.accumulation_magnitude(reference, prefill)
    if case.config.recipe is None:
        t.budget(
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
            magnitude,
        )
    elif exact:
        t.budget(
            name,
            actual,
            truth_fp8,
            naive,
            budget,
            dtype,
            module_dtype,
            note=f" (FP8 {case.config.recipe}: against the same recipe in float64)",
            floor_magnitude=magnitude,
        )
    else:
        # Outputs only meet E4M3; gradients meet E5M2 under HYBRID.
        coarse = case.config.recipe.endswith("hybrid") and not name.startswith("output")
        t.fp8_budget(
            name,
            actual,
            truth,
            naive,
            B.FP8,
            dtype,
            module_dtype,
            case.config.recipe,
            2.0**-2 if coarse else 2.0**-3,
            _smallest_gemm_dimension(case),
        )


def _smallest_gemm_dimension(case: Case) -> int:
    """The fewest values any FP8 GEMM of ``case`` reduces over or spans: feature sizes, fc1's
    width, and every non-empty token count (group by group)."""
    c = case.config
    dims = [d for shape in c.gemm_shapes() for d in shape]
    for mb in case.micro_batches:
        dims.extend(n for n in (mb.m_splits or (mb.rows,)) if n > 0)
    return min(dims)


def _floor_dtype(run_key: str, config: ModuleConfig) -> torch.dtype:
    return torch.float32 if run_key.endswith(".main_grad") else config.torch_dtype


def check_p1(backend: Backend, case: Case) -> CheckResult:
    """P1: every micro-batch's output within :data:`~.budgets.OUTPUT` of the float64 truth."""
    t = Tracker()
    test, naive, truth, truth8 = _accuracy_runs(backend, case)
    for i, (a, n, r) in enumerate(zip(test.outputs, naive.outputs, truth.outputs)):
        r8 = truth8.outputs[i] if truth8 is not None else None
        _judge(t, case, f"output[micro-batch {i}]", a, n, r, r8, B.OUTPUT)
    return t.result


def _truth_candidates(case: Case, truth: _AccuracyRun) -> tuple[list[_AccuracyRun], str]:
    """The truths ``case`` may legally be judged against: ``[truth]``, or, for a relu MLP with
    fc1 pre-activations within rounding distance of the kink, one truth per ``relu'`` choice on
    them (see :mod:`.kink`); raises :class:`~.kink.CaseRejected` when there are too many to try.
    Also returns the note a failure message gets."""
    sites = kink_sites(case)
    if not sites:
        return [truth], ""
    if len(sites) > B.KINK_MAX_ENUMERATED:
        raise CaseRejected(
            f"{len(sites)} relu pre-activations lie within rounding distance of 0 (more than "
            f"KINK_MAX_ENUMERATED={B.KINK_MAX_ENUMERATED}): the example cannot be judged"
        )
    deltas = kink_deltas(case, sites)
    candidates = []
    for choice in choices(sites):
        cand = _AccuracyRun(
            list(truth.outputs), list(truth.xgrads), dict(truth.norm), dict(truth.gemm)
        )
        for site, slope, delta in zip(sites, choice, deltas):
            w = slope - site.truth_slope
            if not w:
                continue
            for (where, key), d in delta.items():
                if where == "x":
                    cand.xgrads[key] = cand.xgrads[key] + w * d
                else:
                    snap = cand.norm if key in cand.norm else cand.gemm
                    if snap.get(key) is not None:
                        snap[key] = snap[key] + w * d
        candidates.append(cand)
    where = ", ".join(
        f"micro-batch {s.micro_batch} row {s.row} feature {s.feature}: h={s.h:.3g} "
        f"(bound {s.bound:.3g})"
        for s in sites
    )
    note = (
        f" (relu kink: {len(sites)} fc1 pre-activation(s) within rounding distance of 0 [{where}]; "
        f"judged against the best of {len(candidates)} truths, one per relu' choice there)"
    )
    return candidates, note


def _naive_error(naive: torch.Tensor | None, truths: list[torch.Tensor | None]) -> float | None:
    """The naive run's error against the candidate truth it matches best (``None``: only one
    truth, let the budget measure it)."""
    if naive is None or len(truths) < 2 or any(t is None for t in truths):
        return None
    n = naive.detach().double().cpu()
    return min(float((n - t.detach().double().cpu()).abs().max()) for t in truths)


def _best_of(
    candidates: list[_AccuracyRun], compare: Callable[[Tracker, _AccuracyRun], None]
) -> CheckResult:
    """Run ``compare`` against each candidate truth: the result of the best one that passes, or
    the violation of the one that came closest."""
    if len(candidates) == 1:
        t = Tracker()
        compare(t, candidates[0])
        return t.result
    best: CheckResult | None = None
    failures: list[AssertionError] = []
    for cand in candidates:
        t = Tracker()
        try:
            compare(t, cand)
        except AssertionError as exc:
            failures.append(exc)
            continue
        if best is None or (t.result.ratio or 0.0) < (best.ratio or 0.0):
            best = t.result
    if best is not None:
        return best
    raise min(failures, key=lambda e: getattr(e, "ratio", float("inf")))


def check_p2(backend: Backend, case: Case) -> CheckResult:
    """P2: input gradients (:data:`~.budgets.DGRAD`) and norm-parameter gradients
    (:data:`~.budgets.NORM_GRAD`) within budget (of some legal truth at a relu kink; plus the
    per-element :data:`~.budgets.DGRAD_OPERAND_STEPS` allowance behind a smooth activation)."""
    test, naive, truth, truth8 = _accuracy_runs(backend, case)
    candidates, note = _truth_candidates(case, truth)
    floors = dgrad_operand_floors(case)

    def compare(t: Tracker, cand: _AccuracyRun) -> None:
        for i, (a, n, r) in enumerate(zip(test.xgrads, naive.xgrads, cand.xgrads)):
            ne = _naive_error(n, [c.xgrads[i] for c in candidates])
            r8 = truth8.xgrads[i] if truth8 is not None else None
            name = f"inp.grad[micro-batch {i}]"
            _judge(
                t,
                case,
                name,
                a,
                n,
                r,
                r8,
                B.DGRAD,
                naive_error=ne,
                note=note,
                element_floor=floors.get(name),
            )
        for key in sorted(cand.norm):
            n = naive.norm.get(key)
            ne = _naive_error(n, [c.norm[key] for c in candidates])
            r8 = truth8.norm.get(key) if truth8 is not None else None
            _judge(
                t,
                case,
                key,
                test.norm.get(key),
                n,
                cand.norm[key],
                r8,
                B.NORM_GRAD,
                naive_error=ne,
                note=note,
                element_floor=floors.get(key),
            )

    return _best_of(candidates, compare)


def check_p3(backend: Backend, case: Case) -> CheckResult:
    """P3: GEMM weight/bias gradients (``main_grad`` when fused) within
    :data:`~.budgets.WGRAD` (plus, for operands the module computes, the per-element
    :data:`~.budgets.WGRAD_OPERAND_STEPS` allowance) after every ``backward_dw()``; fused weights
    keep ``.grad is None``."""
    test, naive, truth, truth8 = _accuracy_runs(backend, case)
    if set(test.gemm) != set(truth.gemm):
        raise PropertyViolation(f"gradient slots {sorted(test.gemm)} != {sorted(truth.gemm)}")
    candidates, note = _truth_candidates(case, truth)
    floors = wgrad_operand_floors(case)
    fused = case.config.fuse_wgrad_accumulation
    prefills = make_main_grads(case.config, case.seed) if fused else {}

    def compare(t: Tracker, cand: _AccuracyRun) -> None:
        for key in sorted(cand.gemm):
            a = test.gemm[key]
            if key.endswith(".grad") and cand.gemm[key] is None:
                t.expect(
                    a is None, f"{key}: expected None (fused weights keep .grad None), got a tensor"
                )
                continue
            n = naive.gemm.get(key)
            _judge(
                t,
                case,
                key,
                a,
                n,
                cand.gemm[key],
                truth8.gemm.get(key) if truth8 is not None else None,
                B.WGRAD,
                _floor_dtype(key, case.config),
                case.config.torch_dtype,
                naive_error=_naive_error(n, [c.gemm[key] for c in candidates]),
                note=note,
                element_floor=floors.get(key),
                prefill=prefills.get(key.split(".")[0]) if key.endswith(".main_grad") else None,
            )

    return _best_of(candidates, compare)


# =============================================================================================
# P4: delayed == non-delayed
# =============================================================================================


def check_p4(backend: Backend, case: Case) -> CheckResult:
    """P4: the same micro-batches through a delayed and a non-delayed module (random ``.grad``
    and ``main_grad`` prefills), all ``backward_dw()`` at the end: outputs, input grads, every
    parameter gradient and ``main_grad`` bitwise equal; hooks fire once per entry, after the
    gradients are written; ``grad_added_to_main_grad`` set in both. Under FP8 the queued entries
    run after later scale updates, and the amax histories and scales are compared after every
    micro-batch and after draining."""
    t = Tracker()
    data = make_micro_batches(case)
    eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
    late = ModuleRun(backend, case, delay=True, prefill_grads=True)
    for i, d in enumerate(data):
        xe, ye = eager.fb(d)
        xl, yl = late.fb(d)
        t.bitwise(f"output[micro-batch {i}]", yl, ye)
        t.bitwise(f"inp.grad[micro-batch {i}]", xl.grad, xe.grad)
        t.bitwise_all(f"after micro-batch {i}: ", late.fp8_snapshot(), eager.fp8_snapshot())
    t.equal("pending_wgrad_count after the backwards", late.pending(), len(data))
    late.drain()
    t.equal("pending_wgrad_count after draining", late.pending(), 0)
    t.bitwise_all("", late.all_snapshot(), eager.all_snapshot())
    t.bitwise_all("after draining: ", late.fp8_snapshot(), eager.fp8_snapshot())
    t.equal(
        "hook calls (delayed vs non-delayed)",
        [c.hook for c in late.hook_calls],
        [c.hook for c in eager.hook_calls],
    )
    if case.config.fuse_wgrad_accumulation:
        t.equal("grad_added_to_main_grad (delayed)", late.added_flags(), eager.added_flags())
        t.expect(
            all(late.added_flags().values()),
            f"grad_added_to_main_grad not set: {late.added_flags()}",
        )
    _check_hooks_saw_final(t, late)
    return t.result


def _check_hooks_saw_final(t: Tracker, run: ModuleRun) -> None:
    """The last hook call must have seen the final gradients (hooks fire after the writes)."""
    if run.hook_calls:
        t.bitwise_all("at the last hook call: ", run.hook_calls[-1].seen, run.gemm_snapshot())


# =============================================================================================
# P5: between backward() and backward_dw()
# =============================================================================================


def check_p5(backend: Backend, case: Case) -> CheckResult:
    """P5: after each ``backward()`` of a delayed module, input and norm gradients already equal
    the non-delayed run's (bitwise), GEMM gradients and ``main_grad`` are exactly as before
    (``None`` or the prefill), no hook has fired and one entry per backward is pending. Each
    ``backward_dw()`` then leaves input/norm gradients alone and fires every hook once, in
    registration order, after that entry's gradients are written."""
    t = Tracker()
    data = make_micro_batches(case)
    prefill = case.variant == "prefill"
    eager = ModuleRun(backend, case, delay=False, prefill_grads=prefill)
    late = ModuleRun(backend, case, delay=True, prefill_grads=prefill)
    before = late.gemm_snapshot()
    flags_before = late.added_flags()
    xs = []
    for i, d in enumerate(data):
        xe, _ = eager.fb(d)
        xl, _ = late.fb(d)
        xs.append((xl, xl.grad.detach().clone() if xl.grad is not None else None))
        t.bitwise(f"inp.grad[micro-batch {i}] right after backward()", xl.grad, xe.grad)
        t.bitwise_all(
            f"after backward() of micro-batch {i}: ", late.norm_snapshot(), eager.norm_snapshot()
        )
        t.bitwise_all(
            f"after backward() of micro-batch {i}: ", late.fp8_snapshot(), eager.fp8_snapshot()
        )
        t.bitwise_all(
            f"untouched until backward_dw(), after backward() {i}: ", late.gemm_snapshot(), before
        )
        t.equal(f"grad_added_to_main_grad after backward() {i}", late.added_flags(), flags_before)
        t.equal(f"hook calls after backward() {i}", len(late.hook_calls), 0)
        t.equal(f"pending_wgrad_count after backward() {i}", late.pending(), i + 1)
    norm_before_dw = late.norm_snapshot()
    fp8_before_dw = late.fp8_snapshot()
    for j in range(len(data)):
        late.dw()
        t.bitwise_all(f"untouched by backward_dw() {j}: ", late.fp8_snapshot(), fp8_before_dw)
        t.equal(f"pending_wgrad_count after backward_dw() {j}", late.pending(), len(data) - j - 1)
        calls = late.hook_calls[2 * j :]
        t.equal(f"hooks fired by backward_dw() {j}", [c.hook for c in calls], [0, 1])
        now = late.gemm_snapshot()
        for c in calls:
            t.bitwise_all(f"seen by hook {c.hook} at backward_dw() {j}: ", c.seen, now)
    for i, (x, g) in enumerate(xs):
        t.bitwise(f"inp.grad[micro-batch {i}] after backward_dw()", x.grad, g)
    t.bitwise_all("norm grads across backward_dw(): ", late.norm_snapshot(), norm_before_dw)
    t.bitwise_all("after draining: ", late.all_snapshot(), eager.all_snapshot())
    return t.result


# =============================================================================================
# P6: interleavings
# =============================================================================================


class InterleavingModel:
    """Drives a delayed module through a schedule next to two non-delayed twins.

    ``eager`` runs every step as it comes (so input/norm gradients compare right after each
    backward). ``lagged`` replays micro-batch *i*'s forward+backward at the moment the delayed
    module runs its *i*-th ``backward_dw()`` (FIFO), so after **every** step the delayed module's
    GEMM gradients and ``main_grad`` must equal the lagged twin's, bitwise. Zeroing hits all three.
    Used by :func:`check_p6` and by the stateful machine in :mod:`.state_machine`.
    """

    def __init__(self, backend: Backend, case: Case) -> None:
        self.case = case
        self.t = Tracker()
        self.late = ModuleRun(backend, case, delay=True)
        self.eager = ModuleRun(backend, case, delay=False)
        self.lagged = ModuleRun(backend, case, delay=False)
        self.queue: list[Any] = []  # micro-batch data of the pending entries, oldest first
        self.steps: list[str] = []
        self.dws = 0

    def fb(self, data) -> None:
        self.steps.append("fb")
        xl, _ = self.late.fb(data)
        xe, _ = self.eager.fb(data)
        self.queue.append(data)
        n = len(self.steps)
        self.t.bitwise(f"step {n} (fb): inp.grad", xl.grad, xe.grad)
        self.t.bitwise_all(
            f"step {n} (fb): ", self.late.norm_snapshot(), self.eager.norm_snapshot()
        )
        self.check()

    def dw(self) -> None:
        self.steps.append("dw")
        self.late.dw()
        self.lagged.fb(self.queue.pop(0))
        self.dws += 1
        self.check()

    def zero(self) -> None:
        self.steps.append("zero")
        for run in (self.late, self.eager, self.lagged):
            run.zero_grads()
        self.check()

    def check(self) -> None:
        n, op = len(self.steps), self.steps[-1] if self.steps else "start"
        self.t.equal(f"step {n} ({op}): pending_wgrad_count", self.late.pending(), len(self.queue))
        # FP8: the delayed module's amax histories move exactly as the eager twin's.
        self.t.bitwise_all(
            f"step {n} ({op}): ", self.late.fp8_snapshot(), self.eager.fp8_snapshot()
        )
        self.t.bitwise_all(
            f"step {n} ({op}): ", self.late.gemm_snapshot(), self.lagged.gemm_snapshot()
        )
        self.t.equal(f"step {n} ({op}): hook calls", len(self.late.hook_calls), 2 * self.dws)
        _check_hooks_saw_final(self.t, self.late) if op == "dw" else None


def check_p6(backend: Backend, case: Case) -> CheckResult:
    """P6: ``case.schedule`` (``fb``/``dw``/``zero``) on a delayed module against the
    non-delayed twins of :class:`InterleavingModel`, checked after every step."""
    data = make_micro_batches(case)
    model = InterleavingModel(backend, case)
    nxt = 0
    for op in case.schedule:
        if op == "fb":
            model.fb(data[nxt])
            nxt += 1
        elif op == "dw":
            model.dw()
        elif op == "zero":
            model.zero()
        else:
            raise ValueError(f"unknown schedule step {op!r} in {case.schedule}")
    return model.t.result


# =============================================================================================
# P7: tied and frozen weights
# =============================================================================================


def _tied_fb(run: ModuleRun, data, chain: bool) -> tuple[list[torch.Tensor], int]:
    """One backward through two uses of the same module; returns the leaf inputs."""
    d0, d1 = data[0], data[1]
    x0 = d0.fresh_input()
    y0 = run.forward(x0, d0.spec.m_splits, d0.spec.is_first_microbatch)
    if chain:
        y1 = run.forward(y0, d0.spec.m_splits, None)
        run.backward_outputs([y1], [d0.dy])
        return [x0], 2
    x1 = d1.fresh_input()
    y1 = run.forward(x1, d1.spec.m_splits, None)
    run.backward_outputs([y0, y1], [d0.dy, d1.dy])
    return [x0, x1], 2


def check_p7(backend: Backend, case: Case) -> CheckResult:
    """P7. ``variant="tied"``/``"tied-chain"``: one backward through two applications of the
    module queues two entries; after both ``backward_dw()`` everything equals the non-delayed
    run bitwise (prefilled ``.grad``/``main_grad``). ``variant="frozen"``: parameters in
    ``case.frozen`` have ``requires_grad=False``: they get no gradient (and their ``main_grad``
    stays as prefilled), nothing is queued when no GEMM parameter trains, the rest equals the
    non-delayed run bitwise."""
    t = Tracker()
    data = make_micro_batches(case)
    if case.variant.startswith("tied"):
        chain = case.variant == "tied-chain"
        eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
        late = ModuleRun(backend, case, delay=True, prefill_grads=True)
        xe, _ = _tied_fb(eager, data, chain)
        xl, entries = _tied_fb(late, data, chain)
        queued = late.pending()
        for i, (a, b) in enumerate(zip(xl, xe)):
            t.bitwise(f"inp.grad[use {i}]", a.grad, b.grad)
        late.drain()
        # Gradients first: a wrong gradient matters more than a wrong entry count.
        t.bitwise_all("tied, after draining: ", late.all_snapshot(), eager.all_snapshot())
        t.bitwise_all("tied, after draining: ", late.fp8_snapshot(), eager.fp8_snapshot())
        t.equal("pending_wgrad_count after one backward through two uses", queued, entries)
        t.equal("hook calls", len(late.hook_calls), 2 * entries)
        return t.result
    if case.variant != "frozen":
        raise ValueError(
            f"P7 variant must be 'tied', 'tied-chain' or 'frozen', got {case.variant!r}"
        )
    eager = ModuleRun(backend, case, delay=False, frozen=case.frozen)
    late = ModuleRun(backend, case, delay=True, frozen=case.frozen)
    trains = any(late.params[n].requires_grad for n in late.gemm_names)
    before = late.all_snapshot()
    for i, d in enumerate(data):
        xe, _ = eager.fb(d)
        xl, _ = late.fb(d)
        t.bitwise(f"inp.grad[micro-batch {i}]", xl.grad, xe.grad)
        t.equal(
            f"pending_wgrad_count after backward() {i} (frozen={list(case.frozen)})",
            late.pending(),
            (i + 1) if trains else 0,
        )
    late.drain()
    after = late.all_snapshot()
    for name in case.frozen:
        for key in (k for k in after if k.split(".")[0] == name):
            t.bitwise(f"frozen {key}", after[key], before[key])
    t.bitwise_all("frozen case, after draining: ", after, eager.all_snapshot())
    t.bitwise_all("frozen case, after draining: ", late.fp8_snapshot(), eager.fp8_snapshot())
    return t.result


# =============================================================================================
# P8: is_first_microbatch
# =============================================================================================


def check_p8(backend: Backend, case: Case) -> CheckResult:
    """P8. Fused: a micro-batch whose forward got ``is_first_microbatch=True`` *overwrites*
    ``main_grad`` (delayed entries keep their own flag until ``backward_dw()``), others add; the
    expected run is a non-delayed twin without flags whose ``main_grad`` is zeroed right before
    each flagged micro-batch. Values compare exactly (``rtol=0, atol=0``; overwrite and
    add-to-zero may differ only in the sign of an exact zero). Biases still accumulate in
    ``.grad``. Plain mode: the flag changes nothing, bitwise."""
    t = Tracker()
    data = make_micro_batches(case)
    fused = case.config.fuse_wgrad_accumulation
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=False, prefill_grads=True)
    for d in data:
        run.fb(d)
        if fused and d.spec.is_first_microbatch:
            for name in twin.weight_names:
                twin.params[name].main_grad.zero_()
        twin.fb(d, first=None)
    run.drain()
    got, want = run.all_snapshot(), twin.all_snapshot()
    t.bitwise_all("is_first_microbatch vs none: ", run.fp8_snapshot(), twin.fp8_snapshot())
    flags = [d.spec.is_first_microbatch for d in data]
    for key in sorted(set(got) | set(want)):
        if key.endswith(".main_grad"):
            if B.check_same_presence(key, got.get(key), want.get(key)):
                a, e = got[key], want[key]
                bad = a != e
                if bool(bad.any()):
                    idx = tuple(int(i) for i in bad.nonzero()[0])
                    raise B.BudgetViolation(
                        key,
                        f"{key}: {int(bad.sum())} elements differ from the overwrite expectation "
                        f"(is_first_microbatch flags {flags}); "
                        f"worst at {idx}: got {float(a[idx])!r}, expected {float(e[idx])!r} "
                        "(budget: rtol=0, atol=0)",
                    )
                t.result.comparisons += 1
                t.result.ratio = max(t.result.ratio or 0.0, 0.0)
        else:
            t.bitwise(key, got.get(key), want.get(key))
    return t.result


# =============================================================================================
# P9: ub_bulk_wgrad
# =============================================================================================

UB_MESSAGE = "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
_OPTIMIZED_CACHE: dict[str, dict[str, str]] = {}

_OPTIMIZED_SCRIPT = """
import json, sys
from splitgrad.properties.backends import get_backend
backend = get_backend(sys.argv[1])
out = {}
for kind in sys.argv[2:]:
    try:
        backend.constructor(kind)(*([2, 4, 3] if kind == "GroupedLinear" else [4, 3]),
                                  ub_bulk_wgrad=True, delay_wgrad_compute=True)
        out[kind] = "no error"
    except ValueError as exc:
        out[kind] = "ValueError: " + str(exc)
    except Exception as exc:
        out[kind] = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"optimize": sys.flags.optimize, "results": out}))
"""


def optimized_constructor_results(backend_name: str, kinds: tuple[str, ...]) -> dict[str, str]:
    """What the constructors raise for ``ub_bulk_wgrad=True, delay_wgrad_compute=True`` in a
    ``python -O`` subprocess (cached per backend: a subprocess costs seconds)."""
    if backend_name not in _OPTIMIZED_CACHE:
        proc = subprocess.run(
            [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT, backend_name, *kinds],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PYTHONOPTIMIZE": "1"},
        )
        if proc.returncode != 0:
            raise PropertyViolation(
                f"python -O subprocess for backend {backend_name!r} failed:\n{proc.stderr[-2000:]}"
            )
        payload = json.loads(proc.stdout.strip().splitlines()[-1])
        if payload["optimize"] < 1:
            raise PropertyViolation("the subprocess did not run with python -O")
        _OPTIMIZED_CACHE[backend_name] = payload["results"]
    return _OPTIMIZED_CACHE[backend_name]


def check_p9(backend: Backend, case: Case) -> CheckResult:
    """P9: ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises ``ValueError``
    containing the SPEC message, in this process and under ``python -O``; without delay
    ``ub_bulk_wgrad=True`` changes no result (bitwise)."""
    t = Tracker()
    kind = case.config.kind
    ctor = backend.constructor(kind)
    args = (2, 4, 3) if kind == "GroupedLinear" else (4, 3)
    try:
        ctor(*args, ub_bulk_wgrad=True, delay_wgrad_compute=True)
    except ValueError as exc:
        t.expect(
            UB_MESSAGE in str(exc), f"{kind}: ValueError message {str(exc)!r} lacks {UB_MESSAGE!r}"
        )
    else:
        raise PropertyViolation(
            f"{kind}(ub_bulk_wgrad=True, delay_wgrad_compute=True) did not raise ValueError"
        )
    result = optimized_constructor_results(
        backend.name, tuple(k for k in KINDS if k != "GroupedLinear")
    )
    t.expect(
        result.get(kind, "").startswith("ValueError") and UB_MESSAGE in result[kind],
        f"under python -O, {kind}(ub_bulk_wgrad=True, delay_wgrad_compute=True) gave "
        f"{result.get(kind)!r}",
    )
    data = make_micro_batches(case)
    plain = ModuleRun(backend, case, delay=False, prefill_grads=True)
    bulk = ModuleRun(backend, case, delay=False, prefill_grads=True, ub_bulk_wgrad=True)
    for i, d in enumerate(data):
        xp, yp = plain.fb(d)
        xb, yb = bulk.fb(d)
        t.bitwise(f"ub_bulk_wgrad output[{i}]", yb, yp)
        t.bitwise(f"ub_bulk_wgrad inp.grad[{i}]", xb.grad, xp.grad)
    t.bitwise_all("ub_bulk_wgrad: ", bulk.all_snapshot(), plain.all_snapshot())
    t.bitwise_all("ub_bulk_wgrad: ", bulk.fp8_snapshot(), plain.fp8_snapshot())
    return t.result


# =============================================================================================
# P10: bad input and misuse
# =============================================================================================


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _expect_raises(
    t: Tracker, what: str, fn: Callable[[], Any], types: tuple[type, ...], *needles: str
) -> BaseException:
    try:
        fn()
    except types as exc:
        msg = str(exc)
        for needle in needles:
            t.expect(
                needle.lower() in msg.lower(),
                f"{what}: {type(exc).__name__} message {msg!r} does not name {needle!r}",
            )
        return exc
    except Exception as exc:
        raise PropertyViolation(
            f"{what}: raised {type(exc).__name__}({exc}) instead of "
            f"{'/'.join(x.__name__ for x in types)}"
        ) from exc
    raise PropertyViolation(
        f"{what}: no error raised (expected {'/'.join(x.__name__ for x in types)})"
    )


def _state_snapshot(run: ModuleRun) -> dict[str, Any]:
    snap: dict[str, Any] = dict(run.all_snapshot())
    snap.update(run.fp8_snapshot())
    for name, p in run.params.items():
        snap[f"{name} (value)"] = p.detach().clone()
    return snap


def _unchanged(t: Tracker, what: str, run: ModuleRun, before: dict[str, Any], pending: int) -> None:
    t.bitwise_all(f"{what} changed ", _state_snapshot(run), before)
    t.equal(f"{what}: pending_wgrad_count", run.pending(), pending)


def misuses(config: ModuleConfig, delay: bool) -> list[str]:
    """The P10 misuse variants that apply to ``config`` built with or without delay."""
    out = ["bad_last_dim", "bad_dtype", "bad_device", "dw_empty", "dw_no_delay", "bad_ctor"]
    if delay:
        out.append("hook_raises")
    if config.kind == "GroupedLinear":
        out += ["m_splits_len", "m_splits_negative", "m_splits_sum"]
    if config.fuse_wgrad_accumulation:
        out += ["main_grad_missing", "main_grad_shape", "main_grad_dtype", "main_grad_device"]
        if delay:
            out.append("wgrad_fails")
    if config.alignment > 1:
        out += ["fp8_tokens", "fp8_features"]
    return out


MISUSES = (
    "bad_last_dim",
    "bad_dtype",
    "bad_device",
    "dw_empty",
    "dw_no_delay",
    "bad_ctor",
    "hook_raises",
    "m_splits_len",
    "m_splits_negative",
    "m_splits_sum",
    "main_grad_missing",
    "main_grad_shape",
    "main_grad_dtype",
    "main_grad_device",
    "wgrad_fails",
    "fp8_tokens",
    "fp8_features",
)

# How a message may name the dimension a block recipe cannot quantize.
_TOKEN_WORDS = ("tokens", "rows")
_FEATURE_WORDS = ("in_features", "out_features", "hidden_size", "ffn_hidden_size")


def _expect_fp8_shape_error(
    t: Tracker, what: str, fn: Callable[[], Any], config: ModuleConfig, size: int, words
) -> None:
    """``fn`` raises ``ValueError`` naming the recipe, the dimension, its size and the multiple
    it needs (SPEC §5 / reference/base.py)."""
    recipe = type(make_recipe(config.recipe)).__name__
    exc = _expect_raises(t, what, fn, (ValueError,), recipe, str(size), str(config.alignment))
    t.expect(
        any(w in str(exc) for w in words),
        f"{what}: ValueError message {str(exc)!r} names none of the dimensions {words}",
    )


class _HookError(Exception):
    pass


def check_p10(backend: Backend, case: Case) -> CheckResult:
    """P10: the misuse named by ``case.variant`` raises the SPEC error, with a message naming
    the offending value, and leaves parameters, gradients, ``main_grad`` and the queue exactly
    as they were (bitwise); a valid micro-batch afterwards still matches a fresh module."""
    t = Tracker()
    config, misuse = case.config, case.variant.split(":")[0]
    target = case.variant.split(":")[1] if ":" in case.variant else None
    data = make_micro_batches(case)
    d = data[0]
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    before, pending = _state_snapshot(run), run.pending()
    dt = config.torch_dtype
    splits = d.spec.m_splits
    inp = d.fresh_input()

    def call(x, ms=splits):
        return run.forward(x, ms, None)

    if misuse == "bad_last_dim":
        bad = torch.zeros(*d.spec.lead_shape, config.in_features + 1, dtype=dt, requires_grad=True)
        _expect_raises(
            t,
            "wrong last dimension",
            lambda: call(bad),
            (ValueError,),
            str(config.in_features),
            str(config.in_features + 1),
        )
    elif misuse == "bad_dtype":
        other = torch.float64 if dt != torch.float64 else torch.float32
        _expect_raises(
            t,
            "wrong input dtype",
            lambda: call(inp.detach().to(other)),
            (TypeError, ValueError),
            _dtype_name(dt),
            _dtype_name(other),
        )
    elif misuse == "bad_device":
        _expect_raises(
            t,
            "wrong input device",
            lambda: call(inp.detach().to("meta")),
            (ValueError, TypeError),
            "meta",
            config.device,
        )
    elif misuse in ("m_splits_len", "m_splits_negative", "m_splits_sum"):
        s = list(splits or [])
        if misuse == "m_splits_len":
            ms = s + [0]
        elif misuse == "m_splits_negative":
            ms = [-1] + s[1:-1] + [s[-1] + 1 + s[0]] if len(s) > 1 else [-1]
        else:
            ms = s[:-1] + [s[-1] + 1]
        _expect_raises(
            t,
            f"m_splits={ms}",
            lambda: call(inp, ms),
            (ValueError,),
            str(ms[-1]) if misuse != "m_splits_negative" else "-1",
        )
    elif misuse == "fp8_tokens":
        # One more half-block of rows (in the first group for GroupedLinear).
        extra = config.alignment // 2
        if config.kind == "GroupedLinear":
            ms = [splits[0] + extra, *splits[1:]]
            bad = torch.zeros(sum(ms), config.in_features, dtype=dt, requires_grad=True)
            size = ms[0]
        else:
            bad = torch.zeros(d.spec.rows + extra, config.in_features, dtype=dt)
            bad.requires_grad_(True)
            ms, size = None, d.spec.rows + extra
        _expect_fp8_shape_error(
            t,
            f"{size} tokens under {config.recipe}",
            lambda: call(bad, ms),
            config,
            size,
            _TOKEN_WORDS,
        )
    elif misuse == "fp8_features":
        # A module whose in_features is half a block off; its forward must refuse, untouched.
        size = config.in_features + config.alignment // 2
        odd = ModuleRun(
            backend, case, delay=run.delay, config=dataclasses.replace(config, in_features=size)
        )
        x = torch.zeros(*d.spec.lead_shape, size, dtype=dt, requires_grad=True)
        odd_before = _state_snapshot(odd)
        _expect_fp8_shape_error(
            t,
            f"in_features={size} under {config.recipe}",
            lambda: odd.forward(x, splits, None),
            config,
            size,
            _FEATURE_WORDS,
        )
        _unchanged(t, "the module that refused", odd, odd_before, 0)
    elif misuse == "dw_empty":
        if run.delay:
            _expect_raises(
                t, "backward_dw() with nothing pending", run.dw, (RuntimeError,), "pending"
            )
            run.fb(d)
            run.dw()
            before, pending = _state_snapshot(run), run.pending()
            _expect_raises(
                t, "backward_dw() after the queue drained", run.dw, (RuntimeError,), "pending"
            )
        else:
            run.dw()  # must be a no-op on a module built without delay
    elif misuse == "dw_no_delay":
        run = ModuleRun(backend, case, delay=False, prefill_grads=True)
        run.fb(d)
        before, pending, calls = _state_snapshot(run), run.pending(), len(run.hook_calls)
        run.dw()
        t.equal("hook calls of backward_dw() without delay", len(run.hook_calls), calls)
    elif misuse == "bad_ctor":
        ctor = backend.constructor(config.kind)
        bad_calls: list[tuple[str, Callable[[], Any]]] = [
            ("in_features=0", lambda: ctor(*_ctor_args(config, in_features=0)))
        ]
        bad_calls.append(("negative out size", lambda: ctor(*_ctor_args(config, out_features=-3))))
        if config.kind == "GroupedLinear":
            bad_calls.append(("num_gemms=0", lambda: ctor(0, 4, 3)))
        if config.has_norm:
            bad_calls.append(
                ("normalization='BatchNorm'", lambda: ctor(4, 3, normalization="BatchNorm"))
            )
        if config.kind == "LayerNormMLP":
            bad_calls.append(("activation='tanh'", lambda: ctor(4, 3, activation="tanh")))
        for what, fn in bad_calls:
            _expect_raises(t, f"{config.kind}({what})", fn, (ValueError,))
    elif misuse == "hook_raises":
        t.expect(run.delay, "P10 hook_raises needs a delayed case")
        eager = ModuleRun(backend, case, delay=False, prefill_grads=True)

        def bad_hook() -> None:
            raise _HookError("hook failed on purpose")

        backend.register_hook(run.module, bad_hook)
        run.fb(d)
        eager.fb(d)
        _expect_raises(t, "backward_dw() with a raising hook", run.dw, (_HookError,))
        t.equal("pending_wgrad_count after a hook raised (entry consumed)", run.pending(), 0)
        t.bitwise_all("written before the hook raised: ", run.all_snapshot(), eager.all_snapshot())
        return t.result
    elif misuse.startswith("main_grad") or misuse == "wgrad_fails":
        name = target or run.weight_names[0]
        p = run.params[name]
        good = p.main_grad
        broken = {
            "main_grad_missing": None,
            "main_grad_shape": torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
            "main_grad_dtype": torch.zeros(p.shape, dtype=torch.bfloat16),
            "main_grad_device": torch.zeros(p.shape, dtype=torch.float32, device="meta"),
            "wgrad_fails": torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
        }[misuse]
        if misuse == "wgrad_fails":
            t.expect(run.delay, "P10 wgrad_fails needs a delayed case")
            eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
            run.fb(d)
            eager.fb(d)
            before, pending = _state_snapshot(run), run.pending()
            _set_main_grad(p, broken)
            _expect_raises(
                t, f"backward_dw() with a broken {name}.main_grad", run.dw, (RuntimeError,), name
            )
            _set_main_grad(p, good)
            _unchanged(t, "failed backward_dw()", run, before, pending)
            run.dw()
            t.bitwise_all("retried entry: ", run.all_snapshot(), eager.all_snapshot())
            return t.result
        _set_main_grad(p, broken)
        y = call(inp)
        # The forward itself succeeded: under delayed scaling it moved the input and weight
        # histories; the failing backward must move nothing more (not even grad_output's).
        before.update(run.fp8_snapshot())
        _expect_raises(
            t,
            f"backward with {misuse} on {name}",
            lambda: run.backward_outputs([y], [d.dy]),
            (RuntimeError,),
            name,
        )
        _set_main_grad(p, good)
    else:
        raise ValueError(f"unknown P10 misuse {case.variant!r}; expected one of {MISUSES}")
    _unchanged(t, f"after {misuse}", run, before, pending)
    t.expect(inp.grad is None, f"after {misuse}: the input got a gradient")
    # The module must still work normally, and match a module that never saw the misuse.
    fresh = ModuleRun(backend, case, delay=run.delay, prefill_grads=True)
    if misuse in ("dw_empty",) and run.delay:
        fresh.fb(d)
        fresh.dw()
    if misuse == "dw_no_delay":
        fresh.fb(d)
    if misuse.startswith("main_grad"):
        fresh.forward(d.fresh_input(), splits, None)  # the same forwards moved its histories
    run.fb(d)
    fresh.fb(d)
    run.drain()
    fresh.drain()
    t.bitwise_all(
        f"after {misuse}, a valid micro-batch: ", run.all_snapshot(), fresh.all_snapshot()
    )
    return t.result


def _set_main_grad(p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    if value is None:
        if hasattr(p, "main_grad"):
            del p.main_grad
    else:
        p.main_grad = value


def _ctor_args(config: ModuleConfig, **override: int) -> list[int]:
    k = override.get("in_features", config.in_features)
    m = override.get("out_features", config.out_features)
    return [config.num_gemms, k, m] if config.kind == "GroupedLinear" else [k, m]


# =============================================================================================
# P11: freed after backward_dw()
# =============================================================================================


def check_p11(backend: Backend, case: Case) -> CheckResult:
    """P11: after the ``backward_dw()`` of micro-batch *i* (or its non-delayed backward), the
    storages of its input, its output gradient and every activation autograd saved for it
    (tensors with the micro-batch's row count, not sharing a parameter's storage) are freed:
    their :class:`StorageWeakRef`\\ s have expired, without a ``gc.collect()``."""
    t = Tracker()
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=case.delay, hooks=0)
    param_ptrs = {p.untyped_storage().data_ptr() for p in run.params.values()}
    refs: list[list[tuple[str, StorageWeakRef]]] = []
    for i, d in enumerate(data):
        tracked: list[tuple[str, StorageWeakRef]] = []
        rows = d.spec.rows

        def pack(tensor: torch.Tensor, rows: int = rows, tracked=tracked) -> torch.Tensor:
            s = tensor.untyped_storage()
            if (
                s.nbytes() > 0
                and s.data_ptr() not in param_ptrs
                and tensor.dim() >= 1
                and tensor.shape[0] == rows
                and tensor.device.type != "meta"
            ):
                tracked.append((f"saved activation {tuple(tensor.shape)}", StorageWeakRef(s)))
            return tensor

        x = d.x.detach().clone().requires_grad_(True)
        dy = d.dy.detach().clone()
        if x.numel():
            tracked.append(("input", StorageWeakRef(x.untyped_storage())))
        if dy.numel():
            tracked.append(("output gradient", StorageWeakRef(dy.untyped_storage())))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t_: t_):
            y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
        backend.backward(run.module, [y], [dy])
        del x, y, dy
        refs.append(tracked)
        if not run.delay:
            _expect_freed(t, f"micro-batch {i} after its non-delayed backward", tracked)
    if run.delay:
        for i in range(len(data)):
            run.dw()
            _expect_freed(t, f"micro-batch {i} after its backward_dw()", refs[i])
    return t.result


def _expect_freed(t: Tracker, what: str, tracked: list[tuple[str, StorageWeakRef]]) -> None:
    alive = [name for name, ref in tracked if not ref.expired()]
    t.result.comparisons += 1
    t.expect(not alive, f"{what}: still alive: {', '.join(alive)}")


# =============================================================================================
# P12: GroupedLinear == Linears
# =============================================================================================


def check_p12(backend: Backend, case: Case) -> CheckResult:
    """P12: ``GroupedLinear(n)`` against ``n`` ``Linear``\\ s with the same weights on
    ``torch.split(x, m_splits)`` (empty groups included), delayed or not: outputs, input grads,
    weight/bias gradients and ``main_grad`` bitwise when :meth:`Backend.p12_bitwise`, else within
    :data:`~.budgets.GROUPED_GEMM` of the float64 truth relative to the Linears' error."""
    t = Tracker()
    config = case.config
    if config.kind != "GroupedLinear":
        raise ValueError(f"P12 needs a GroupedLinear case, got {config.kind}")
    n = config.num_gemms
    data = make_micro_batches(case)
    grouped = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    lin_config = dataclasses.replace(config, kind="Linear", num_gemms=1)
    state, mg, pre = (
        make_state(config, case.seed),
        make_main_grads(config, case.seed),
        make_grad_prefill(config, case.seed),
    )
    linears = []
    for i in range(n):
        s = {"weight": state[f"weight{i}"]}
        if config.bias:
            s["bias"] = state[f"bias{i}"]
        lin = ModuleRun(
            backend,
            case,
            delay=case.delay,
            config=lin_config,
            state=s,
            main_grads={"weight": mg[f"weight{i}"]},
        )
        for name, p in lin.params.items():
            if not lin.uses_main_grad(name):
                p.grad = pre[f"{name}{i}"].clone()
        linears.append(lin)
    bitwise = backend.p12_bitwise(config)
    for k, d in enumerate(data):
        splits = list(d.spec.m_splits or ())
        xg, yg = grouped.fb(d)
        # The Linears see the very views torch.split gives (same addresses as the grouped
        # module's row blocks): some CPU GEMM kernels sum in another order for an operand at
        # another alignment, which is a different kernel, not a different rule.
        x_all = d.x.detach().clone().requires_grad_(True)
        x_parts = x_all.split(splits)
        dy_parts = d.dy.split(splits)
        ys = []
        for lin, xi, dyi in zip(linears, x_parts, dy_parts):
            yi = lin.forward(xi, None, d.spec.is_first_microbatch)
            lin.backend.backward(lin.module, [yi], [dyi])
            ys.append(yi.detach())
        y_lin = torch.cat(ys) if ys else yg
        dx_lin = x_all.grad if x_all.grad is not None else torch.zeros_like(x_all)
        if bitwise:
            t.bitwise(f"output[micro-batch {k}] grouped vs linears", yg, y_lin)
            t.bitwise(f"inp.grad[micro-batch {k}] grouped vs linears", xg.grad, dx_lin)
    grouped.drain()
    for lin in linears:
        lin.drain()
    got = grouped.gemm_snapshot()
    for i, lin in enumerate(linears):
        for key, value in lin.gemm_snapshot().items():
            name, slot = key.split(".", 1)
            gkey = f"{name}{i}.{slot}"
            if bitwise:
                t.bitwise(f"{gkey} grouped vs linear {i}", got.get(gkey), value)
            else:
                t.expect(gkey in got, f"{gkey} missing from the grouped module's gradients")
    # FP8: group i quantizes with its own scales and history, exactly as Linear i does.
    got_fp8 = grouped.fp8_snapshot()
    for i, lin in enumerate(linears):
        for key, value in lin.fp8_snapshot().items():
            gkey = key.replace("fp8_states[", f"fp8_states[gemm{i}.", 1)
            t.bitwise(f"{gkey} grouped vs linear {i}", got_fp8.get(gkey), value)
    if not bitwise:
        # Within budget: the float64 truth is the reference GroupedLinear in float64.
        _p12_budget(t, backend, case, got, linears)
    return t.result


def _p12_budget(
    t: Tracker, backend: Backend, case: Case, got: Snapshot, linears: list[ModuleRun]
) -> None:
    _, _, truth, truth8 = _accuracy_runs(_reference(), case)
    # Under FP8 every quantized operand is an input: the truth is the same recipe in float64.
    truth = truth8 if truth8 is not None else truth
    for i, lin in enumerate(linears):
        for key, value in lin.gemm_snapshot().items():
            name, slot = key.split(".", 1)
            gkey = f"{name}{i}.{slot}"
            dt = torch.float32 if slot == "main_grad" else case.config.torch_dtype
            t.budget(
                gkey,
                got.get(gkey),
                truth.gemm.get(gkey),
                value,
                B.GROUPED_GEMM,
                dt,
                case.config.torch_dtype,
            )


# =============================================================================================
# P13: FP8 quantizers and amax histories (properties/p13.py)
# =============================================================================================

# Value patterns P13's quantizer operands are drawn with (see properties/p13.py).
P13_VALUES = ("randn", "specials", "outliers")


def check_p13(backend: Backend, case: Case) -> CheckResult:
    """P13: :func:`splitgrad.properties.p13.check_p13`."""
    from .p13 import check_p13 as run

    return run(backend, case)


# =============================================================================================
# Strategies per property, and the single entry point
# =============================================================================================

CHECKS: dict[str, Callable[[Backend, Case], CheckResult]] = {
    "P1": check_p1,
    "P2": check_p2,
    "P3": check_p3,
    "P4": check_p4,
    "P5": check_p5,
    "P6": check_p6,
    "P7": check_p7,
    "P8": check_p8,
    "P9": check_p9,
    "P10": check_p10,
    "P11": check_p11,
    "P12": check_p12,
    "P13": lambda backend, case: check_p13(backend, case),
}


@st.composite
def _p6_cases(draw, kinds, dtypes, devices, recipes):
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 4), recipes=recipes))
    return dataclasses.replace(case, schedule=draw(schedules(len(case.micro_batches))), delay=True)


@st.composite
def _p7_cases(draw, kinds, dtypes, devices, recipes):
    variant = draw(st.sampled_from(["tied", "tied-chain", "frozen"]))
    config = draw(
        module_configs(kinds, dtypes, devices, square=variant == "tied-chain", recipes=recipes)
    )
    count = 2 if variant.startswith("tied") else draw(st.integers(1, 2))
    mbs = draw(micro_batches(config, count))
    if variant == "tied-chain" and config.kind == "GroupedLinear":
        mbs = (
            mbs[0],
            dataclasses.replace(mbs[1], lead_shape=mbs[0].lead_shape, m_splits=mbs[0].m_splits),
        )
    frozen: tuple[str, ...] = ()
    if variant == "frozen":
        names = [s.name for s in param_specs(config)]
        frozen = tuple(n for n in names if draw(st.booleans()))
    return Case(config, mbs, draw(seeds()), variant=variant, frozen=frozen, delay=True)


@st.composite
def _p10_cases(draw, kinds, dtypes, devices, recipes):
    case = draw(
        cases(kinds, dtypes, devices, n_micro_batches=(1, 1), first_flags=False, recipes=recipes)
    )
    variant = draw(st.sampled_from(misuses(case.config, case.delay)))
    if variant.startswith("main_grad") or variant == "wgrad_fails":
        weights = [s.name for s in param_specs(case.config) if s.role == GEMM_WEIGHT]
        variant = f"{variant}:{draw(st.sampled_from(weights))}"
    return dataclasses.replace(case, variant=variant)


@st.composite
def _p5_cases(draw, kinds, dtypes, devices, recipes):
    case = draw(cases(kinds, dtypes, devices, recipes=recipes))
    return dataclasses.replace(case, variant=draw(st.sampled_from(["", "prefill"])), delay=True)


@st.composite
def _p13_cases(draw, kinds, dtypes, devices, recipes):
    fp8 = tuple(r for r in recipes if r is not None) or tuple(RECIPES)
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(2, 3), recipes=fp8))
    return dataclasses.replace(case, variant=draw(st.sampled_from(P13_VALUES)))


def case_strategy(
    property_id: str,
    kinds: tuple[str, ...] = KINDS,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    devices: tuple[str, ...] = ("cpu",),
    fused: bool | None = None,
    recipes: tuple[str | None, ...] = (None,),
) -> st.SearchStrategy[Case]:
    """The cases ``property_id`` is checked on. P1–P3 only draw dtypes below float64 (there is no
    wider truth); P12 only ``GroupedLinear``; P8 draws fused and plain; P13 only FP8 recipes
    (all of them when ``recipes`` has none). ``fused=False`` keeps ``fuse_wgrad_accumulation``
    off (backends without ``main_grad``); ``recipes`` are FP8 recipe names (``None``: high
    precision)."""
    strategy = _case_strategy(
        property_id, tuple(kinds), tuple(dtypes), tuple(devices), tuple(recipes)
    )
    if fused is None:
        return strategy
    return strategy.map(lambda c: _with_fused(c, fused))


def _with_fused(case: Case, fused: bool) -> Case:
    if case.config.fuse_wgrad_accumulation == fused:
        return case
    variant = case.variant
    if variant.startswith(("main_grad", "wgrad_fails")):
        variant = "bad_last_dim"
    return dataclasses.replace(
        case,
        config=dataclasses.replace(case.config, fuse_wgrad_accumulation=fused),
        variant=variant,
    )


def _case_strategy(property_id, kinds, dtypes, devices, recipes) -> st.SearchStrategy[Case]:
    if property_id in ("P1", "P2", "P3"):
        dtypes = tuple(d for d in dtypes if d in LOW_PRECISION_DTYPES) or ("float32",)
        return cases(kinds, dtypes, devices, recipes=recipes)
    if property_id == "P5":
        return _p5_cases(kinds, dtypes, devices, recipes)
    if property_id == "P6":
        return _p6_cases(kinds, dtypes, devices, recipes)
    if property_id == "P7":
        return _p7_cases(kinds, dtypes, devices, recipes)
    if property_id == "P9":
        kinds = tuple(k for k in kinds if k != "GroupedLinear") or ("Linear",)
        return cases(kinds, dtypes, devices, n_micro_batches=(1, 2), recipes=recipes)
    if property_id == "P10":
        return _p10_cases(kinds, dtypes, devices, recipes)
    if property_id == "P12":
        return cases(("GroupedLinear",), dtypes, devices, recipes=recipes)
    if property_id == "P13":
        return _p13_cases(kinds, dtypes, devices, recipes)
    if property_id in CHECKS:
        return cases(kinds, dtypes, devices, recipes=recipes)
    raise ValueError(f"unknown property {property_id!r}; expected one of {', '.join(CHECKS)}")


def applicable(property_id: str, kind: str) -> bool:
    """Whether ``property_id`` has anything to check for module ``kind``."""
    if property_id == "P12":
        return kind == "GroupedLinear"
    if property_id == "P9":
        return kind != "GroupedLinear"
    return True


def run_check(property_id: str, backend: Backend, case: Case) -> CheckResult:
    """Run one example of ``property_id``."""
    try:
        fn = CHECKS[property_id]
    except KeyError:
        raise ValueError(
            f"unknown property {property_id!r}; expected one of {', '.join(CHECKS)}"
        ) from None
    return fn(backend, case)


def example_case(kind: str = "Linear", **config: Any) -> Case:
    """A small fixed case (tests and docs): 2 micro-batches of 3 rows, seed 0."""
    cfg = ModuleConfig(
        kind=kind,
        in_features=config.pop("in_features", 5),
        out_features=config.pop("out_features", 3),
        **config,
    )
    if kind == "GroupedLinear":
        mbs = tuple(
            MicroBatch((3,), tuple([3] + [0] * (cfg.num_gemms - 1)) if cfg.num_gemms > 1 else (3,))
            for _ in range(2)
        )
    else:
        mbs = (MicroBatch((3,)), MicroBatch((1, 3)))
    return Case(cfg, mbs, 0)
