"""P4-P8 (SPEC §4, §7): the split's semantics, and the cases P4-P7 draw. Each compares an
implementation with itself (tier 1, bitwise); a bug on the path both modes share passes that, so
every case also has its final gradients judged against the float64 truth with the P2/P3 budgets
(:func:`~.truth.judge_steps`, tier 2).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from .. import budgets as B
from ..backends import Backend
from ..cases.data import MicroBatchData, make_micro_batches, param_specs
from ..cases.strategies import (
    Case,
    MicroBatch,
    ModuleConfig,
    cases,
    micro_batches,
    module_configs,
    schedules,
    seeds,
)
from ..oracle.truth import judge_steps
from .results import CheckResult, Tracker
from .runner import AccuracyRun, ModuleRun, Step, clone_of, fb_steps, tied_fb

__all__ = [
    "check_p4",
    "check_p5",
    "check_p6",
    "check_p7",
    "check_p8",
    "InterleavingModel",
    "p4_cases",
    "p5_cases",
    "p6_cases",
    "p7_cases",
    "frozen_subsets",
    "chain_splits",
]


def check_p4(backend: Backend, case: Case) -> CheckResult:
    """P4: the same micro-batches through a delayed and a non-delayed module (random ``.grad``
    and ``main_grad`` prefills, ``case.frozen`` frozen), all ``backward_dw()`` at the end:
    outputs, input grads, every gradient and ``main_grad`` bitwise equal; hooks fire once per
    entry, after the writes; ``grad_added_to_main_grad`` set for every trained weight. Under FP8
    queued entries run after later scale updates; amax histories and scales compare after every
    micro-batch and after draining."""
    t = Tracker()
    data = make_micro_batches(case)
    eager = ModuleRun(backend, case, delay=False, prefill_grads=True, frozen=case.frozen)
    late = ModuleRun(backend, case, delay=True, prefill_grads=True, frozen=case.frozen)
    trains = _trains_gemm(late)
    xgrads = []
    for i, d in enumerate(data):
        xe, ye = eager.fb(d)
        xl, yl = late.fb(d)
        xgrads.append(clone_of(xl.grad))
        t.bitwise(f"output[micro-batch {i}]", yl, ye)
        t.bitwise(f"inp.grad[micro-batch {i}]", xl.grad, xe.grad)
        t.bitwise_all(f"after micro-batch {i}: ", late.fp8_snapshot(), eager.fp8_snapshot())
    what = "pending_wgrad_count after the backwards" + _frozen_note(case)
    t.equal(what, late.pending(), len(data) if trains else 0)
    late.drain()
    norm = late.norm_snapshot()
    t.equal("pending_wgrad_count after draining", late.pending(), 0)
    t.bitwise_all("", late.all_snapshot(), eager.all_snapshot())
    t.bitwise_all("after draining: ", late.fp8_snapshot(), eager.fp8_snapshot())
    late_hooks, eager_hooks = ([c.hook for c in r.hook_calls] for r in (late, eager))
    t.equal("hook calls (delayed vs non-delayed)", late_hooks, eager_hooks)
    if case.config.fuse_wgrad_accumulation:
        t.equal("grad_added_to_main_grad (delayed)", late.added_flags(), eager.added_flags())
        trained = {n: v for n, v in late.added_flags().items() if n not in case.frozen}
        t.expect(all(trained.values()), f"grad_added_to_main_grad not set: {trained}")
    _check_hooks_saw_final(t, late)
    _judge(t, case, fb_steps(len(data)), late, xgrads, norm, prefill_grads=True, frozen=case.frozen)
    return t.result


def _judge(t: Tracker, case: Case, steps, run: ModuleRun, xgrads, norm, **options) -> None:
    """``run``'s final gradients (input gradients ``xgrads``, norm gradients ``norm``, its GEMM
    gradients now) against the float64 truth of ``steps`` (:func:`~.truth.judge_steps`)."""
    judge_steps(t, case, steps, AccuracyRun([], xgrads, norm, run.gemm_snapshot()), **options)


def _trains_gemm(run: ModuleRun) -> bool:
    """Whether some GEMM parameter of ``run`` needs a gradient (else nothing is queued)."""
    return any(run.params[n].requires_grad for n in run.gemm_names)


def _frozen_note(case: Case) -> str:
    return f" (frozen={list(case.frozen)})" if case.frozen else ""


def _check_hooks_saw_final(t: Tracker, run: ModuleRun) -> None:
    """The last hook call must have seen the final gradients (hooks fire after the writes)."""
    if run.hook_calls:
        t.bitwise_all("at the last hook call: ", run.hook_calls[-1].seen, run.gemm_snapshot())


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
    before, flags_before = late.gemm_snapshot(), late.added_flags()
    xs = []
    for i, d in enumerate(data):
        xe, _ = eager.fb(d)
        xl, _ = late.fb(d)
        xs.append((xl, clone_of(xl.grad)))
        t.bitwise(f"inp.grad[micro-batch {i}] right after backward()", xl.grad, xe.grad)
        where = f"after backward() of micro-batch {i}: "
        t.bitwise_all(where, late.norm_snapshot(), eager.norm_snapshot())
        t.bitwise_all(where, late.fp8_snapshot(), eager.fp8_snapshot())
        t.bitwise_all(
            f"untouched until backward_dw(), after backward() {i}: ", late.gemm_snapshot(), before
        )
        t.equal(f"grad_added_to_main_grad after backward() {i}", late.added_flags(), flags_before)
        t.equal(f"hook calls after backward() {i}", len(late.hook_calls), 0)
        t.equal(f"pending_wgrad_count after backward() {i}", late.pending(), i + 1)
    norm_before_dw, fp8_before_dw = late.norm_snapshot(), late.fp8_snapshot()
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
    xgrads = [g for _, g in xs]
    _judge(t, case, fb_steps(len(data)), late, xgrads, late.norm_snapshot(), prefill_grads=prefill)
    return t.result


class InterleavingModel:
    """Drives a delayed module through a schedule (:func:`check_p6`, :mod:`.state_machine`)
    next to two non-delayed twins: ``eager`` runs every step as it comes; ``lagged`` replays
    micro-batch *i* when the delayed module runs its *i*-th ``backward_dw()`` (FIFO), so its GEMM
    gradients and ``main_grad`` must equal the delayed module's after every step, bitwise."""

    def __init__(self, backend: Backend, case: Case) -> None:
        self.case = case
        self.t = Tracker()
        self.late = ModuleRun(backend, case, delay=True)
        self.eager = ModuleRun(backend, case, delay=False)
        self.lagged = ModuleRun(backend, case, delay=False)
        #: (index, data) of the micro-batches whose entries are pending, oldest first.
        self.queue: list[tuple[int, MicroBatchData]] = []
        self.steps: list[str] = []
        # What the truth replays: the micro-batches run so far, and both orders of the steps.
        self.specs: list[MicroBatch] = []
        self.xgrads: list[torch.Tensor | None] = []
        self.eager_steps: list[Step] = []
        self.lagged_steps: list[Step] = []

    def fb(self, data: MicroBatchData) -> None:
        self.steps.append("fb")
        index = len(self.specs)
        self.specs.append(data.spec)
        self.eager_steps.append(Step("fb", index))
        xl, _ = self.late.fb(data)
        xe, _ = self.eager.fb(data)
        self.xgrads.append(clone_of(xl.grad))
        self.queue.append((index, data))
        where = f"step {len(self.steps)} (fb): "
        self.t.bitwise(f"{where}inp.grad", xl.grad, xe.grad)
        self.t.bitwise_all(where, self.late.norm_snapshot(), self.eager.norm_snapshot())
        self.check()

    def dw(self) -> None:
        self.steps.append("dw")
        self.late.dw()
        index, data = self.queue.pop(0)
        self.lagged.fb(data)
        self.lagged_steps.append(Step("fb", index))
        self.check()

    def zero(self) -> None:
        self.steps.append("zero")
        for run in (self.late, self.eager, self.lagged):
            run.zero_grads()
        self.eager_steps.append(Step("zero"))
        self.lagged_steps.append(Step("zero"))
        self.check()

    def check(self) -> None:
        op = self.steps[-1] if self.steps else "start"
        where = f"step {len(self.steps)} ({op}): "
        self.t.equal(f"{where}pending_wgrad_count", self.late.pending(), len(self.queue))
        # FP8: the delayed module's amax histories move exactly as the eager twin's.
        self.t.bitwise_all(where, self.late.fp8_snapshot(), self.eager.fp8_snapshot())
        self.t.bitwise_all(where, self.late.gemm_snapshot(), self.lagged.gemm_snapshot())
        self.t.equal(f"{where}hook calls", len(self.late.hook_calls), 2 * self.steps.count("dw"))
        if op == "dw":
            _check_hooks_saw_final(self.t, self.late)

    def judge_truth(self) -> None:
        """The delayed module's final gradients against the float64 truth (call with nothing
        pending): input and norm gradients after the eager order of the steps, GEMM gradients
        and ``main_grad`` after the lagged order (an entry writes when it runs)."""
        if not self.specs:
            return
        self.t.equal("pending_wgrad_count before judging", self.late.pending(), 0)
        case = dataclasses.replace(self.case, micro_batches=tuple(self.specs))
        got = AccuracyRun(
            [], list(self.xgrads), self.late.norm_snapshot(), self.late.gemm_snapshot()
        )
        judge_steps(self.t, case, self.eager_steps, got, parts=("dgrad",))
        judge_steps(self.t, case, self.lagged_steps, got, parts=("wgrad",))


def check_p6(backend: Backend, case: Case) -> CheckResult:
    """P6: ``case.schedule`` (``fb``/``dw``/``zero``) on a delayed module against the
    non-delayed twins of :class:`InterleavingModel`, checked after every step; the final
    gradients then against the float64 truth."""
    data = make_micro_batches(case)
    model = InterleavingModel(backend, case)
    batches = iter(data)
    run = {"fb": lambda: model.fb(next(batches)), "dw": model.dw, "zero": model.zero}
    for op in case.schedule:
        if op not in run:
            raise ValueError(f"unknown schedule step {op!r} in {case.schedule}")
        run[op]()
    model.judge_truth()
    return model.t.result


def check_p7(backend: Backend, case: Case) -> CheckResult:
    """P7. ``"tied"``/``"tied-chain"``: one backward through two applications of the module
    queues two entries; after both ``backward_dw()`` everything equals the non-delayed run
    bitwise. ``"frozen"``: the parameters in ``case.frozen`` get no gradient (their
    ``main_grad`` stays as prefilled), nothing is queued when no GEMM parameter trains, the rest
    equals the non-delayed run bitwise. Gradients are prefilled."""
    t = Tracker()
    data = make_micro_batches(case)
    if case.variant.startswith("tied"):
        chain = case.variant == "tied-chain"
        eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
        late = ModuleRun(backend, case, delay=True, prefill_grads=True)
        xe = tied_fb(eager, data, chain)
        xl = tied_fb(late, data, chain)
        queued, entries = late.pending(), 2
        for i, (a, b) in enumerate(zip(xl, xe)):
            t.bitwise(f"inp.grad[use {i}]", a.grad, b.grad)
        late.drain()
        norm = late.norm_snapshot()
        # Gradients first: a wrong gradient matters more than a wrong entry count.
        t.same_run("tied, after draining: ", late, eager)
        t.equal("pending_wgrad_count after one backward through two uses", queued, entries)
        t.equal("hook calls", len(late.hook_calls), 2 * entries)
        xgrads = [clone_of(x.grad) for x in xl] + [None] * (len(data) - len(xl))
        steps = (Step("chain" if chain else "tied", 0),)
        _judge(t, case, steps, late, xgrads, norm, prefill_grads=True, label=f"{case.variant}, ")
        return t.result
    if case.variant != "frozen":
        raise ValueError(
            f"P7 variant must be 'tied', 'tied-chain' or 'frozen', got {case.variant!r}"
        )
    eager = ModuleRun(backend, case, delay=False, frozen=case.frozen, prefill_grads=True)
    late = ModuleRun(backend, case, delay=True, frozen=case.frozen, prefill_grads=True)
    trains = _trains_gemm(late)
    before, note = late.all_snapshot(), _frozen_note(case)
    xgrads = []
    for i, d in enumerate(data):
        xe, _ = eager.fb(d)
        xl, _ = late.fb(d)
        xgrads.append(clone_of(xl.grad))
        t.bitwise(f"inp.grad[micro-batch {i}]", xl.grad, xe.grad)
        expected = (i + 1) if trains else 0
        t.equal(f"pending_wgrad_count after backward() {i}{note}", late.pending(), expected)
    late.drain()
    norm = late.norm_snapshot()
    after = late.all_snapshot()
    for name in case.frozen:
        for key in (k for k in after if k.split(".")[0] == name):
            t.bitwise(f"frozen {key}", after[key], before[key])
    t.same_run("frozen case, after draining: ", late, eager)
    label = f"frozen={list(case.frozen)}, "
    steps = fb_steps(len(data))
    _judge(t, case, steps, late, xgrads, norm, prefill_grads=True, frozen=case.frozen, label=label)
    return t.result


def check_p8(backend: Backend, case: Case) -> CheckResult:
    """P8. Fused: a micro-batch whose forward got ``is_first_microbatch=True`` *overwrites*
    ``main_grad`` (delayed entries keep their flag until ``backward_dw()``), others add: as a
    non-delayed twin without flags whose ``main_grad`` is zeroed before each flagged micro-batch,
    exactly (``rtol=0, atol=0``: overwrite and add-to-zero may differ in the sign of an exact
    zero). Biases still accumulate in ``.grad``. Plain mode: the flag changes nothing, bitwise."""
    t = Tracker()
    data = make_micro_batches(case)
    fused = case.config.fuse_wgrad_accumulation
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=False, prefill_grads=True)
    xgrads = []
    for d in data:
        x, _ = run.fb(d)
        xgrads.append(clone_of(x.grad))
        if fused and d.spec.is_first_microbatch:
            for name in twin.weight_names:
                twin.params[name].main_grad.zero_()
        twin.fb(d, first=None)
    run.drain()
    norm = run.norm_snapshot()
    got, want = run.all_snapshot(), twin.all_snapshot()
    t.bitwise_all("is_first_microbatch vs none: ", run.fp8_snapshot(), twin.fp8_snapshot())
    flags = [d.spec.is_first_microbatch for d in data]
    for key in sorted(set(got) | set(want)):
        if not key.endswith(".main_grad"):
            t.bitwise(key, got.get(key), want.get(key))
        elif B.check_same_presence(key, got.get(key), want.get(key)):
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
            t._note(0.0, bitwise=True)
    _judge(t, case, fb_steps(len(data)), run, xgrads, norm, prefill_grads=True)
    return t.result


@st.composite
def frozen_subsets(draw, config: ModuleConfig) -> tuple[str, ...]:
    """A non-empty set of frozen parameters of ``config``: a prefix of a drawn permutation, so
    every parameter is as likely as any other to be frozen alone or with others (booleans per
    parameter would start from the first names)."""
    names = [s.name for s in param_specs(config)]
    order = draw(st.permutations(names))
    chosen = set(order[: draw(st.integers(1, len(names)))])
    return tuple(n for n in names if n in chosen)


@st.composite
def p4_cases(draw, kinds, dtypes, devices, recipes):
    """P4's cases: prefilled gradients over 1-3 micro-batches, and in half of them a frozen
    subset (:func:`frozen_subsets`)."""
    bias = draw(st.sampled_from([True, False]))  # biases first: every role can be frozen
    case = draw(cases(kinds, dtypes, devices, recipes=recipes, bias=bias))
    frozen = draw(frozen_subsets(case.config)) if draw(st.booleans()) else ()
    return dataclasses.replace(case, frozen=frozen, delay=True)


@st.composite
def p5_cases(draw, kinds, dtypes, devices, recipes):
    case = draw(cases(kinds, dtypes, devices, recipes=recipes))
    return dataclasses.replace(case, variant=draw(st.sampled_from(["", "prefill"])), delay=True)


@st.composite
def p6_cases(draw, kinds, dtypes, devices, recipes):
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 4), recipes=recipes))
    return dataclasses.replace(case, schedule=draw(schedules(len(case.micro_batches))), delay=True)


@st.composite
def p7_cases(draw, kinds, dtypes, devices, recipes):
    variant = draw(st.sampled_from(["tied", "tied-chain", "frozen"]))
    # Biases first: every parameter role is then present to be tied or frozen (a plain
    # st.booleans() starts from bias=False and leaves most early examples without one).
    bias = draw(st.sampled_from([True, False]))
    square = variant == "tied-chain"
    config = draw(module_configs(kinds, dtypes, devices, square=square, recipes=recipes, bias=bias))
    count = 2 if variant.startswith("tied") else draw(st.integers(1, 2))
    mbs = chain_splits(draw(micro_batches(config, count)), variant, config.kind)
    frozen = draw(frozen_subsets(config)) if variant == "frozen" else ()
    return Case(config, mbs, draw(seeds()), variant=variant, frozen=frozen, delay=True)


def chain_splits(mbs: tuple[MicroBatch, ...], variant: str, kind: str) -> tuple[MicroBatch, ...]:
    """P7's micro-batches: under ``"tied-chain"`` a ``GroupedLinear``'s second application takes
    the first's output, so the second micro-batch gets the first's shape and ``m_splits``."""
    if variant != "tied-chain" or kind != "GroupedLinear":
        return mbs
    second = dataclasses.replace(mbs[1], lead_shape=mbs[0].lead_shape, m_splits=mbs[0].m_splits)
    return (mbs[0], second)
