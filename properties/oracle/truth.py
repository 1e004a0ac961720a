"""The float64 truth and the naive yardstick of any sequence of steps on a module, built once.

:func:`truth_runs` replays a check's :class:`~.runner.Step`\\ s non-delayed on the reference:
in the case's dtype (the naive run, the budgets' yardstick), on its float64 twin
(:func:`splitgrad.reference.upcast`, the same weights and prefills: the truth) and, under FP8,
on the float64 twin under the same recipe (the same quantizations followed by exact GEMMs).
P1-P3 judge one forward and backward per micro-batch against it (:mod:`.accuracy`); the
differential properties judge what they observed after their own steps (:func:`judge_steps`).

Tier 2 for the differential properties. P4-P8 and P12 compare an implementation with itself
(delayed with non-delayed, grouped with Linears), so a bug on the path both sides share (the
wgrad closure that runs in both modes) passes those comparisons. So every case they draw
(frozen subsets, tied weights, prefilled ``.grad``/``main_grad``, ``is_first_microbatch``,
interleavings with zeroing, grouped splits with empty groups) also has its final gradients
judged here with the P2/P3 budgets. At a relu kink the candidate truths add each ambiguous
pre-activation's change only to the gradients its micro-batch's contribution still reaches at
the end (not after a zeroing, not after a later ``is_first_microbatch`` overwrite of
``main_grad``, not to frozen parameters). A module chained on itself (``"chain"``, P7) feeds
its own output into its second use: the operand allowances and kink sites of the micro-batches
do not describe that use, so neither applies there, and a relu ``LayerNormMLP`` is not judged
(its tier-1 comparison still is). float64 cases have no wider truth and are not judged.

The reference is deterministic and the truth a function of the case and the steps alone, so
the runs are kept for the few cases a campaign judges again (P1-P3 draw the same cases).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch

from ..backends import Backend, get_backend
from ..cases.case import LOW_PRECISION_DTYPES, Case
from ..cases.data import (
    GEMM_WEIGHT,
    MicroBatchData,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    param_specs,
)
from ..checks.results import Tracker
from ..checks.runner import AccuracyRun, ModuleRun, Step, play
from .internals import dgrad_operand_floors, wgrad_operand_floors
from .judge import Judging, best_of, compare_dgrads, compare_wgrads, kink_candidates, kink_note
from .kink import has_relu_kink, kink_choices, kink_deltas, kink_sites
from .rounding import rounding_bounds

__all__ = [
    "reference_backend",
    "TruthRuns",
    "truth_runs",
    "memo",
    "row_reversal",
    "reorders_rows",
    "worse_naive",
    "judge_steps",
]


T = TypeVar("T")


@functools.cache
def reference_backend() -> Backend:
    """``splitgrad.reference``: the naive baseline and (upcast) the truth (one instance, so its
    API probe runs once)."""
    return get_backend("reference")


@dataclasses.dataclass(frozen=True)
class TruthRuns:
    """``naive``: the reference in the case's dtype (the worse of rows in order and reversed,
    see :func:`worse_naive`); ``truth``: its float64 twin without FP8; ``truth8``: the float64
    twin under the case's recipe (``None`` without one)."""

    naive: AccuracyRun
    truth: AccuracyRun
    truth8: AccuracyRun | None


# What the memo may hold, in tensor bytes (a default verify's truths and bounds take ~180 MB).
MEMO_BYTES = 256 * 2**20
_MEMO: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
_memo_bytes = 0


def memo(fn: Callable[..., T], *args: Hashable) -> T:
    """``fn(*args)`` for a function of its arguments alone (a truth run, a rounding bound),
    kept for the next call with the same function and arguments (the least recently used
    go past :data:`MEMO_BYTES`): P1-P3 draw the same cases, forced-path cells the default
    cells' ones, and a campaign judges some cases twice. The key holds the function object
    itself, so a test that replaces it is never answered from the memo; and torch's thread
    count and deterministic mode, which the float64 reductions may depend on. The caller must
    not modify what it gets (it is shared)."""
    global _memo_bytes
    key = (fn, args, torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    if key in _MEMO:
        _MEMO.move_to_end(key)
        return _MEMO[key][0]  # type: ignore[return-value]
    value = fn(*args)
    size = _nbytes(value)
    _MEMO[key] = (value, size)
    _memo_bytes += size
    while _memo_bytes > MEMO_BYTES and len(_MEMO) > 1:
        _memo_bytes -= _MEMO.popitem(last=False)[1][1]
    return value


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(_nbytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def truth_runs(
    case: Case, steps: Sequence[Step], *, prefill_grads: bool = False, frozen: Sequence[str] = ()
) -> TruthRuns:
    """The truth and the naive yardstick of ``steps`` on ``case``, prepared as the check prepared
    its module (``prefill_grads``, ``frozen``; ``main_grad`` prefilled when fused). The runs
    are shared (:func:`memo`): callers must not modify them."""
    return memo(_truth_runs, case, tuple(steps), prefill_grads, tuple(frozen))


def _truth_runs(
    case: Case, steps: Sequence[Step], prefill_grads: bool, frozen: tuple[str, ...]
) -> TruthRuns:
    from splitgrad.reference import upcast

    data = make_micro_batches(case)
    ref = reference_backend()

    def naive_run() -> ModuleRun:
        return ModuleRun(
            ref, case, delay=False, hooks=0, prefill_grads=prefill_grads, frozen=frozen
        )

    naive_module = naive_run()

    def float64_run(recipe: str | None) -> AccuracyRun:
        config = dataclasses.replace(case.config, dtype="float64", recipe=recipe, autocast=None)
        run = ModuleRun(
            ref,
            case,
            delay=False,
            hooks=0,
            module=upcast(naive_module.module),
            config=config,
            main_grads=False,
        )
        return play(run, data, steps, torch.float64)

    truth = float64_run(None)
    truth8 = float64_run(case.config.recipe) if case.config.recipe is not None else None
    naive = play(naive_module, data, steps)
    if reorders_rows(case):
        rev_data, perms = row_reversal(data)
        yardstick = truth8 if truth8 is not None else truth
        naive = worse_naive(naive, play(naive_run(), rev_data, steps), perms, yardstick)
    return TruthRuns(naive, truth, truth8)


# ---- the naive yardstick, independent of the order rows are summed in ------------------------


def row_reversal(data: Sequence[MicroBatchData]) -> tuple[list[MicroBatchData], list[torch.Tensor]]:
    """Each micro-batch with its rows in reverse order within each group (``m_splits``), and the
    row permutation of each (its own inverse). Row-wise work (the norms, activations, each
    output row) is unchanged; every reduction over rows (weight, bias and norm-parameter
    gradients) adds the same terms in another order."""
    out, perms = [], []
    for d in data:
        rows = d.x.reshape(-1, d.x.shape[-1]).shape[0]
        splits = d.spec.m_splits or (rows,)
        parts, start = [], 0
        for n in splits:
            parts.append(torch.arange(start + n - 1, start - 1, -1))
            start += n
        perm = torch.cat(parts) if parts else torch.arange(0)
        perm = perm.to(d.x.device)
        x = d.x.reshape(-1, d.x.shape[-1])[perm].reshape(d.x.shape)
        dy = d.dy.reshape(-1, d.dy.shape[-1])[perm].reshape(d.dy.shape)
        out.append(dataclasses.replace(d, x=x, dy=dy))
        perms.append(perm)
    return out, perms


def _unpermute(t: torch.Tensor | None, perm: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    return t.reshape(-1, t.shape[-1])[perm.to(t.device)].reshape(t.shape)


def reorders_rows(case: Case) -> bool:
    """Whether a second naive run with reversed rows says something: some group has two rows
    or more, and no block-scaled FP8 recipe (MXFP8 and block scales run along the rows, so
    reversing them would change what is quantized; per-tensor delayed and current scaling
    quantize each row the same way in any order)."""
    recipe = case.config.recipe
    if recipe is not None and not recipe.startswith(("delayed", "current")):
        return False
    for mb in case.micro_batches:
        rows = 1
        for n in mb.lead_shape:
            rows *= n
        if max(mb.m_splits or (rows,), default=0) >= 2:
            return True
    return False


def worse_naive(
    naive: AccuracyRun, reversed_run: AccuracyRun, perms: Sequence[torch.Tensor], truth: AccuracyRun
) -> AccuracyRun:
    """Per tensor, whichever of two naive runs (rows in order, rows reversed) is further from
    ``truth``: a yardstick for the rounding a reduction over rows may legally show. One run's
    error over a reduction is a single sample of that noise, and can be far below it when its
    row errors happen to cancel (docs/budgets.md)."""

    def err(a: torch.Tensor | None, t: torch.Tensor | None) -> float:
        if a is None or t is None or a.shape != t.shape:
            return -1.0
        if a.numel() == 0:
            return 0.0
        return float((a.detach().double().cpu() - t.detach().double().cpu()).abs().max())

    def pick(a, b, t):
        return b if err(b, t) > err(a, t) else a

    def per_batch(mine: list, theirs: list, truths: list) -> list:
        return [
            pick(a, _unpermute(b, perms[i]), truths[i] if i < len(truths) else None)
            for i, (a, b) in enumerate(zip(mine, theirs))
        ]

    outputs = per_batch(naive.outputs, reversed_run.outputs, truth.outputs)
    xgrads = per_batch(naive.xgrads, reversed_run.xgrads, truth.xgrads)
    norm = {k: pick(v, reversed_run.norm.get(k), truth.norm.get(k)) for k, v in naive.norm.items()}
    gemm = {k: pick(v, reversed_run.gemm.get(k), truth.gemm.get(k)) for k, v in naive.gemm.items()}
    return AccuracyRun(outputs, xgrads, norm, gemm)


# ---- tier 2 for the differential properties --------------------------------------------------


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


def _only(run: AccuracyRun | None, keep: Callable[[str], bool] | None) -> AccuracyRun | None:
    if run is None or keep is None:
        return run
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
    runs = truth_runs(case, steps, prefill_grads=prefill_grads, frozen=frozen)
    candidates, note = ([runs.truth], "") if chain else _candidates(case, steps, runs.truth, frozen)
    floors: dict[str, torch.Tensor] = {}
    if not chain:
        floors.update(dgrad_operand_floors(case) if "dgrad" in parts else {})
        floors.update(wgrad_operand_floors(case) if "wgrad" in parts else {})
    judging = Judging(
        case,
        _only(runs.naive, only),
        [_only(c, only) for c in candidates],
        _only(runs.truth8, only),
        floors=floors,
        prefills=_prefills(case, prefill_grads, frozen),
        bounds=memo(rounding_bounds, case, tuple(steps), prefill_grads, tuple(frozen)),
        note=note,
        label=label or "against the float64 truth: ",
        # Chained on itself, the module quantizes its own output under FP8: no operand is exact.
        fp8_exact=False if chain else None,
        uses=2 if chain else 1,
    )
    got = _only(got, only)

    def compare(tr: Tracker, cand: AccuracyRun) -> None:
        if "dgrad" in parts:
            compare_dgrads(tr, got, cand, judging)
        if "wgrad" in parts:
            compare_wgrads(tr, got, cand, judging)

    t.merge(best_of(judging.candidates, compare, first_wins=case.config.recipe is not None))
