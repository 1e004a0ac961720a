"""The float64 truth and the naive yardstick of any sequence of steps on a module, built once.

:func:`truth_runs` replays a check's :class:`~.runner.Step`\\ s non-delayed on the reference: in
the case's dtype (the naive run), on its float64 twin (the truth) and, under FP8, on the float64
twin under the same recipe. :func:`judge_steps` judges what the differential properties observed
after their own steps with the P2/P3 budgets (docs/oracle.md). A module chained on itself
(``"chain"``) gets neither operand allowances nor kink sites, and a relu ``LayerNormMLP`` is not
judged there: its second use's operands are its own output, which they do not describe.
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

T = TypeVar("T")


@functools.cache
def reference_backend() -> Backend:
    """``splitgrad.reference``, one instance (its API probe runs once)."""
    return get_backend("reference")


def float64_twin(backend: Backend, case: Case, low: ModuleRun, **config: object) -> ModuleRun:
    """A non-delayed run of ``backend`` on a float64 copy of ``low``'s module (weights and
    prefills), ``config`` replacing fields of the case's."""
    from splitgrad.reference import upcast

    module = upcast(low.module)
    config = dataclasses.replace(case.config, dtype="float64", **config)
    return ModuleRun(
        backend, case, delay=False, hooks=0, module=module, config=config, main_grads=False
    )


@dataclasses.dataclass(frozen=True)
class TruthRuns:
    """``naive``: the reference in the case's dtype (:func:`worse_naive` of two row orders);
    ``truth``: its float64 twin; ``truth8``: the twin under the case's recipe (or ``None``)."""

    naive: AccuracyRun
    truth: AccuracyRun
    truth8: AccuracyRun | None


# What the memo may hold, in tensor bytes (a default verify's truths and bounds take ~180 MB).
MEMO_BYTES = 256 * 2**20
_MEMO: collections.OrderedDict[tuple, tuple[object, int]] = collections.OrderedDict()
_memo_bytes = 0


def memo(fn: Callable[..., T], *args: Hashable) -> T:
    """``fn(*args)`` for a function of its arguments alone, kept up to :data:`MEMO_BYTES`; keyed
    also by torch's thread count and deterministic mode (float64 reductions may depend on them).
    Callers must not modify what they get."""
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
    if dataclasses.is_dataclass(value):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        value = list(value.values())
    return sum(map(_nbytes, value)) if isinstance(value, (list, tuple)) else 0


def truth_runs(
    case: Case, steps: Sequence[Step], *, prefill_grads: bool = False, frozen: Sequence[str] = ()
) -> TruthRuns:
    """The truth and the naive yardstick of ``steps`` on ``case``, the module prepared as the
    check prepared its own (``prefill_grads``, ``frozen``); memoized."""
    return memo(_truth_runs, case, tuple(steps), prefill_grads, tuple(frozen))


def _truth_runs(
    case: Case, steps: Sequence[Step], prefill_grads: bool, frozen: tuple[str, ...]
) -> TruthRuns:
    data, ref = make_micro_batches(case), reference_backend()
    prepared = {"delay": False, "hooks": 0, "prefill_grads": prefill_grads, "frozen": frozen}
    naive_module = ModuleRun(ref, case, **prepared)

    def float64_run(recipe: str | None) -> AccuracyRun:
        run = float64_twin(ref, case, naive_module, recipe=recipe, autocast=None)
        return play(run, data, steps, torch.float64)

    truth = float64_run(None)
    truth8 = float64_run(case.config.recipe) if case.config.recipe is not None else None
    naive = play(naive_module, data, steps)
    if reorders_rows(case):
        rev_data, perms = row_reversal(data)
        yardstick = truth8 if truth8 is not None else truth
        reversed_run = play(ModuleRun(ref, case, **prepared), rev_data, steps)
        naive = worse_naive(naive, reversed_run, perms, yardstick)
    return TruthRuns(naive, truth, truth8)


# ---- the naive yardstick, independent of the order rows are summed in ------------------------
def _permute_rows(t: torch.Tensor | None, perm: torch.Tensor) -> torch.Tensor | None:
    if t is None:
        return None
    return t.reshape(-1, t.shape[-1])[perm.to(t.device)].reshape(t.shape)


def row_reversal(data: Sequence[MicroBatchData]) -> tuple[list[MicroBatchData], list[torch.Tensor]]:
    """Each micro-batch with its rows reversed within each group (``m_splits``), and each row
    permutation (its own inverse): every reduction over rows adds its terms in another order."""
    out, perms = [], []
    for d in data:
        starts, start = [], 0
        for n in d.spec.m_splits or (d.x.reshape(-1, d.x.shape[-1]).shape[0],):
            starts.append(torch.arange(start + n - 1, start - 1, -1))
            start += n
        perm = (torch.cat(starts) if starts else torch.arange(0)).to(d.x.device)
        out.append(dataclasses.replace(d, x=_permute_rows(d.x, perm), dy=_permute_rows(d.dy, perm)))
        perms.append(perm)
    return out, perms


def reorders_rows(case: Case) -> bool:
    """Whether a second naive run with reversed rows says something: some group has two rows or
    more, and no block-scaled FP8 recipe (its scales run along the rows)."""
    recipe = case.config.recipe
    if recipe is not None and not recipe.startswith(("delayed", "current")):
        return False
    return any(max(mb.m_splits or (mb.rows,), default=0) >= 2 for mb in case.micro_batches)


def worse_naive(
    naive: AccuracyRun, reversed_run: AccuracyRun, perms: Sequence[torch.Tensor], truth: AccuracyRun
) -> AccuracyRun:
    """Per tensor, whichever of two naive runs (rows in order, rows reversed) is further from
    ``truth`` (docs/budgets.md: the naive yardstick, taken twice)."""

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
            pick(a, _permute_rows(b, perms[i]), truths[i] if i < len(truths) else None)
            for i, (a, b) in enumerate(zip(mine, theirs))
        ]

    outputs = per_batch(naive.outputs, reversed_run.outputs, truth.outputs)
    xgrads = per_batch(naive.xgrads, reversed_run.xgrads, truth.xgrads)
    norm = {k: pick(v, reversed_run.norm.get(k), truth.norm.get(k)) for k, v in naive.norm.items()}
    gemm = {k: pick(v, reversed_run.gemm.get(k), truth.gemm.get(k)) for k, v in naive.gemm.items()}
    return AccuracyRun(outputs, xgrads, norm, gemm)


# ---- tier 2 for the differential properties --------------------------------------------------
def _reached(case: Case, steps: Sequence[Step], frozen: Sequence[str]) -> dict[str, set[int]]:
    """For each gradient slot (snapshot key), the micro-batches whose contribution is still in it
    after ``steps``. A tied module's second use runs its wgrad first, so a flagged first use
    overwrites the second's ``main_grad``."""
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
    """The truths the case may be judged against (a site's change only on the gradients its
    micro-batch still reaches) and the note a failure message gets."""
    sites = kink_sites(case)
    picks = kink_choices(case, sites)
    if len(picks) == 1:
        return [truth], ""
    # Without flags kink_deltas never drops a contribution: _reached decides which count.
    mbs = tuple(dataclasses.replace(mb, is_first_microbatch=None) for mb in case.micro_batches)
    deltas = kink_deltas(dataclasses.replace(case, micro_batches=mbs), sites)
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
    fused = case.config.fuse_wgrad_accumulation
    mains = make_main_grads(case.config, case.seed) if fused else {}
    out = {f"{name}.main_grad": value for name, value in mains.items()}
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
    """Judge what a check observed after ``steps`` (``got``) against the float64 truth of the same
    steps with P2's (``"dgrad"``) and/or P3's (``"wgrad"``) budgets; ``label`` prefixes tensor
    names in messages; ``only``, a predicate on names, limits the comparison."""
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
