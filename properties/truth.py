"""The float64 truth of any sequence of steps on a module: tier 2 for the differential
properties.

P4-P8 and P12 compare an implementation with itself (delayed with non-delayed, grouped with
Linears). A bug on the path both sides share — the wgrad closure that runs in both modes, a
Linear's code that the grouped module reuses — passes those comparisons. So every case they
draw (frozen subsets, tied weights, prefilled ``.grad``/``main_grad`` over several micro-batches,
``is_first_microbatch``, interleavings with zeroing, grouped splits with empty groups) also
has its final gradients judged here against the float64 truth, with the P2/P3 budgets of
:mod:`.budgets`.

A differential check describes what it did to the module as a list of :class:`Step`\\ s (the
same forwards and backwards, in the same order, with the same zeroing), plus how the module
was prepared (prefilled gradients, frozen parameters). :func:`judge_steps` replays those steps
non-delayed on the reference in the case's dtype (the naive baseline) and on its float64 twin
(:func:`splitgrad.reference.upcast`, with the same prefills; under FP8 also the same recipe in
float64) and judges the gradients the check observed: input gradients with
:data:`~.budgets.DGRAD`, norm-parameter gradients with :data:`~.budgets.NORM_GRAD`, GEMM
gradients and ``main_grad`` with :data:`~.budgets.WGRAD`, operand allowances and the relu kink
as in P2/P3. At a relu kink the candidate truths add each ambiguous pre-activation's change only
to the gradients its micro-batch's contribution still reaches at the end (not after a zeroing,
not after a later ``is_first_microbatch`` overwrite of ``main_grad``, not to frozen parameters).

A module chained on itself (``"chain"``, P7) feeds its own output into its second use: the
operand allowances and the kink sites of the micro-batches do not describe that second use, so
there neither applies, and a relu ``LayerNormMLP`` (whose second use may meet the kink) is not
judged (the tier-1 comparison still is). float64 cases have no wider truth and are not judged
either (P1-P3 never draw them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .accuracy import (
    AccuracyRun,
    best_of,
    compare_dgrads,
    compare_wgrads,
    kink_candidates,
    kink_note,
    reference_backend,
    reorders_rows,
    row_reversal,
    worse_naive,
)
from .data import (
    GEMM_WEIGHT,
    MicroBatchData,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    param_specs,
)
from .internals import dgrad_operand_floors, rounding_bounds, wgrad_operand_floors
from .kink import has_relu_kink, kink_choices, kink_deltas, kink_sites
from .results import Tracker
from .runner import ModuleRun
from .strategies import LOW_PRECISION_DTYPES, Case

__all__ = [
    "Step",
    "fb_steps",
    "tied_fb",
    "play",
    "truth_runs",
    "judge_steps",
]


@dataclasses.dataclass(frozen=True)
class Step:
    """One step a differential check took: ``"fb"`` (forward + backward of micro-batch
    ``index`` with its ``is_first_microbatch`` flag), ``"zero"`` (every gradient to ``None``,
    ``main_grad`` to zeros), ``"tied"`` (micro-batches ``index`` and ``index + 1`` through the
    module in one backward, the first with its flag), ``"chain"`` (micro-batch ``index`` through
    the module twice, ``y = m(m(x))``, one backward)."""

    op: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("fb", "zero", "tied", "chain"):
            raise ValueError(f"unknown step {self.op!r}; expected fb, zero, tied or chain")


def fb_steps(n: int) -> tuple[Step, ...]:
    """Forward + backward of micro-batches ``0 .. n-1`` in order."""
    return tuple(Step("fb", i) for i in range(n))


def tied_fb(run: ModuleRun, data: Sequence[MicroBatchData], chain: bool, index: int = 0):
    """One backward through two uses of the same module; returns the leaf inputs."""
    d0 = data[index]
    x0 = d0.fresh_input()
    y0 = run.forward(x0, d0.spec.m_splits, d0.spec.is_first_microbatch)
    if chain:
        y1 = run.forward(y0, d0.spec.m_splits, None)
        run.backward_outputs([y1], [d0.dy])
        return [x0]
    d1 = data[index + 1]
    x1 = d1.fresh_input()
    y1 = run.forward(x1, d1.spec.m_splits, None)
    run.backward_outputs([y0, y1], [d0.dy, d1.dy])
    return [x0, x1]


def _grad(x: torch.Tensor) -> torch.Tensor | None:
    return None if x.grad is None else x.grad.detach().clone()


def play(
    run: ModuleRun,
    data: Sequence[MicroBatchData],
    steps: Sequence[Step],
    dtype: torch.dtype | None = None,
) -> AccuracyRun:
    """Run ``steps`` on ``run`` (its inputs cast to ``dtype`` when given), drain the queue, and
    return what they produced: ``xgrads[i]`` is micro-batch ``i``'s input gradient (its last
    one; ``None`` where it did not run), ``norm`` / ``gemm`` the final gradient snapshots."""
    if dtype is not None:
        data = [dataclasses.replace(d, x=d.x.to(dtype), dy=d.dy.to(dtype)) for d in data]
    xgrads: list[torch.Tensor | None] = [None] * len(data)
    for step in steps:
        if step.op == "fb":
            x, _ = run.fb(data[step.index])
            xgrads[step.index] = _grad(x)
        elif step.op == "zero":
            run.zero_grads()
        else:
            xs = tied_fb(run, data, step.op == "chain", step.index)
            for k, x in enumerate(xs):
                xgrads[step.index + k] = _grad(x)
    norm = run.norm_snapshot()
    run.drain()
    return AccuracyRun([], xgrads, norm, run.gemm_snapshot())


def truth_runs(
    case: Case,
    steps: Sequence[Step],
    *,
    prefill_grads: bool = False,
    frozen: Sequence[str] = (),
) -> tuple[AccuracyRun, AccuracyRun, AccuracyRun | None]:
    """(naive reference, float64 truth, FP8 float64 truth or ``None``) of ``steps`` on ``case``,
    prepared as the check prepared its module (``prefill_grads``, ``frozen``; ``main_grad``
    prefilled when fused)."""
    from splitgrad.reference import upcast

    data = make_micro_batches(case)
    ref = reference_backend()
    naive_run = ModuleRun(
        ref, case, delay=False, hooks=0, prefill_grads=prefill_grads, frozen=frozen
    )

    def float64_run(recipe: str | None) -> AccuracyRun:
        run = ModuleRun(
            ref,
            case,
            delay=False,
            hooks=0,
            module=upcast(naive_run.module),
            config=dataclasses.replace(case.config, dtype="float64", recipe=recipe, autocast=None),
            main_grads=False,
        )
        return play(run, data, steps, torch.float64)

    truth = float64_run(None)
    truth8 = float64_run(case.config.recipe) if case.config.recipe is not None else None
    naive = play(naive_run, data, steps)
    if reorders_rows(case):
        rev_data, perms = row_reversal(data)
        rev_run = ModuleRun(
            ref, case, delay=False, hooks=0, prefill_grads=prefill_grads, frozen=frozen
        )
        yardstick = truth8 if truth8 is not None else truth
        naive = worse_naive(naive, play(rev_run, rev_data, steps), perms, yardstick)
    return naive, truth, truth8


def _reached(case: Case, steps: Sequence[Step], frozen: Sequence[str]) -> dict[str, set[int]]:
    """For each parameter gradient slot (snapshot key), the micro-batches whose contribution is
    still in it after ``steps``. Two uses of a tied module run their wgrad in backward order
    (the second use's first), so a flagged first use overwrites the second's ``main_grad``."""
    fused = case.config.fuse_wgrad_accumulation
    flags = [mb.is_first_microbatch for mb in case.micro_batches]
    keys = {}
    for spec in param_specs(case.config):
        if spec.name in frozen:
            continue
        slot = "main_grad" if fused and spec.role == GEMM_WEIGHT else "grad"
        keys[f"{spec.name}.{slot}"] = slot == "main_grad"
    reached: dict[str, set[int]] = {k: set() for k in keys}

    def contribute(i: int, flag: bool | None) -> None:
        for key, overwrites in keys.items():
            if overwrites and flag:
                reached[key] = {i}
            else:
                reached[key].add(i)

    for step in steps:
        if step.op == "fb":
            contribute(step.index, flags[step.index])
        elif step.op == "zero":
            for key in reached:
                reached[key] = set()
        elif step.op == "tied":
            contribute(step.index + 1, None)
            contribute(step.index, flags[step.index])
    return reached


def _candidates(
    case: Case, steps: Sequence[Step], truth: AccuracyRun, frozen: Sequence[str]
) -> tuple[list[AccuracyRun], str]:
    """The truths the case may be judged against (see the module docstring) and the note a
    failure message gets; raises :class:`~.kink.CaseRejected` past
    :data:`~.budgets.KINK_MAX_ENUMERATED` ambiguous sites in high precision
    (:func:`~.kink.kink_choices`)."""
    sites = kink_sites(case)
    picks = kink_choices(case, sites)
    if len(picks) == 1:
        return [truth], ""
    # Without flags kink_deltas never drops a contribution: _reached decides which count.
    unflagged = dataclasses.replace(
        case,
        micro_batches=tuple(
            dataclasses.replace(mb, is_first_microbatch=None) for mb in case.micro_batches
        ),
    )
    deltas = kink_deltas(unflagged, sites)
    reached = _reached(case, steps, frozen)
    ran = {s.index for s in steps if s.op == "fb"} | {
        s.index + k for s in steps if s.op == "tied" for k in (0, 1)
    }

    def reaches(site, where: str, key) -> bool:
        if site.micro_batch not in ran:
            return False
        return where == "x" or site.micro_batch in reached.get(key, ())

    candidates = kink_candidates(truth, sites, picks, deltas, reaches)
    return candidates, kink_note(case, sites, len(candidates))


def _prefills(case: Case, prefill_grads: bool, frozen: Sequence[str]) -> dict[str, torch.Tensor]:
    """What each gradient slot held before the first step, by snapshot key."""
    out: dict[str, torch.Tensor] = {}
    fused = case.config.fuse_wgrad_accumulation
    if fused:
        for name, value in make_main_grads(case.config, case.seed).items():
            out[f"{name}.main_grad"] = value
    if prefill_grads:
        weights = {s.name for s in param_specs(case.config) if s.role == GEMM_WEIGHT}
        for name, value in make_grad_prefill(case.config, case.seed).items():
            if name not in frozen and not (fused and name in weights):
                out[f"{name}.grad"] = value
    return out


def _only(run: AccuracyRun, keep: Callable[[str], bool]) -> AccuracyRun:
    xgrads = [g if keep(f"inp.grad[micro-batch {i}]") else None for i, g in enumerate(run.xgrads)]
    norm = {k: v for k, v in run.norm.items() if keep(k)}
    gemm = {k: v for k, v in run.gemm.items() if keep(k)}
    return AccuracyRun(list(run.outputs), xgrads, norm, gemm)


def judge_steps(
    t: Tracker,
    case: Case,
    steps: Sequence[Step],
    got: AccuracyRun,
    *,
    prefill_grads: bool = False,
    frozen: Sequence[str] = (),
    parts: tuple[str, ...] = ("dgrad", "wgrad"),
    label: str = "",
    only: Callable[[str], bool] | None = None,
) -> None:
    """Judge what a check observed after ``steps`` (``got``: input gradients by micro-batch,
    final norm and GEMM gradient snapshots) against the float64 truth of the same steps on a
    module prepared the same way. ``parts``: ``"dgrad"`` (input and norm gradients, P2's
    budgets) and/or ``"wgrad"`` (GEMM gradients and ``main_grad``, P3's). ``label`` prefixes the
    tensor names in messages; ``only`` (a predicate on names such as
    ``"inp.grad[micro-batch 1]"`` and ``"fc1_weight.grad"``) limits the comparison to the tensors
    it accepts. Raises :class:`~.budgets.BudgetViolation` /
    :class:`~.results.PropertyViolation`; records the worst ratio in ``t``."""
    if case.config.dtype not in LOW_PRECISION_DTYPES:
        return  # float64 has no wider truth (as P1-P3, which never draw it)
    chain = any(s.op == "chain" for s in steps)
    if chain and has_relu_kink(case):
        return
    naive, truth, truth8 = truth_runs(case, steps, prefill_grads=prefill_grads, frozen=frozen)
    if chain:
        candidates, note = [truth], ""
        dfloors: dict[str, torch.Tensor] = {}
        wfloors: dict[str, torch.Tensor] = {}
    else:
        candidates, note = _candidates(case, steps, truth, frozen)
        dfloors = dgrad_operand_floors(case) if "dgrad" in parts else {}
        wfloors = wgrad_operand_floors(case) if "wgrad" in parts else {}
    if only is not None:
        got, naive, truth = (_only(r, only) for r in (got, naive, truth))
        truth8 = _only(truth8, only) if truth8 is not None else None
        candidates = [_only(c, only) for c in candidates]
    prefills = _prefills(case, prefill_grads, frozen)
    bounds = rounding_bounds(case, steps, prefill_grads, frozen)
    norm_prefills = {k: v for k, v in prefills.items() if k in truth.norm}
    label = label or "against the float64 truth: "

    # Chained on itself, the module quantizes its own output under FP8: no operand is exact.
    exact = False if chain else None

    def compare(tr: Tracker, cand: AccuracyRun) -> None:
        if "dgrad" in parts:
            compare_dgrads(
                tr,
                case,
                got,
                naive,
                cand,
                candidates,
                truth8,
                note,
                dfloors,
                norm_prefills,
                label,
                exact,
                2 if chain else 1,
                bounds,
            )
        if "wgrad" in parts:
            compare_wgrads(
                tr,
                case,
                got,
                naive,
                cand,
                candidates,
                truth8,
                note,
                wfloors,
                prefills,
                label,
                exact,
                2 if chain else 1,
                bounds,
            )

    t.merge(best_of(candidates, compare, first_wins=case.config.recipe is not None))
