"""P1-P3 (SPEC §7): outputs, input/norm gradients and weight/bias gradients within an error
budget of the float64 truth.

Truth and baseline come from the reference: the naive run is ``splitgrad.reference`` in the
case's dtype, the truth is its float64 twin from :func:`splitgrad.reference.upcast` (same code,
same weights, same ``main_grad`` prefill). Under FP8 a second truth runs the same recipe in
float64. Budgets are :mod:`.budgets`'s; :func:`judge` is the one comparison every property that
measures against the truth uses (:mod:`.truth` applies it to the differential properties' cases).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch

from . import budgets as B
from .backends import Backend, get_backend
from .data import MicroBatchData, make_main_grads, make_micro_batches
from .internals import dgrad_operand_floors, rounding_bounds, wgrad_operand_floors
from .kink import KinkSite, kink_choices, kink_deltas, kink_sites
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun, Snapshot
from .strategies import Case, ModuleConfig

__all__ = [
    "AccuracyRun",
    "accuracy_runs",
    "judge",
    "reference_backend",
    "check_p1",
    "check_p2",
    "check_p3",
]


@functools.cache
def reference_backend() -> Backend:
    """``splitgrad.reference``: the naive baseline and (upcast) the truth (one instance, so its
    API probe runs once)."""
    return get_backend("reference")


# =============================================================================================
# P1–P3: error budgets against the float64 truth
# =============================================================================================


@dataclasses.dataclass
class AccuracyRun:
    """What one run produced (or, for a candidate truth, what it should have): every output and
    input gradient by micro-batch, the norm-parameter and GEMM gradient snapshots. ``switched``
    (candidate truths under FP8 only): per tensor name, the summed magnitude of the ``relu'``
    switches the candidate made (:func:`kink_candidates`)."""

    outputs: list[torch.Tensor]
    xgrads: list[torch.Tensor | None]
    norm: Snapshot
    gemm: Snapshot
    switched: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def accuracy_run(run: ModuleRun, case: Case, data, dtype: torch.dtype | None = None) -> AccuracyRun:
    outputs, xgrads = [], []
    for d in data:
        if dtype is not None:
            d = dataclasses.replace(d, x=d.x.to(dtype), dy=d.dy.to(dtype))
        x, y = run.fb(d)
        outputs.append(y)
        xgrads.append(None if x.grad is None else x.grad.detach().clone())
    norm = run.norm_snapshot()
    run.drain()
    return AccuracyRun(outputs, xgrads, norm, run.gemm_snapshot())


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
    row errors happen to cancel (measured: a LayerNormLinear ``layer_norm_weight.grad`` over 22
    rows of 3 features, naive error 2.3e-8 while each row's contribution carries 1-3e-7)."""

    def err(a: torch.Tensor | None, t: torch.Tensor | None) -> float:
        if a is None or t is None or a.shape != t.shape:
            return -1.0
        if a.numel() == 0:
            return 0.0
        return float((a.detach().double().cpu() - t.detach().double().cpu()).abs().max())

    def pick(a, b, t):
        return b if err(b, t) > err(a, t) else a

    outputs = [
        pick(a, _unpermute(b, perms[i]), truth.outputs[i] if i < len(truth.outputs) else None)
        for i, (a, b) in enumerate(zip(naive.outputs, reversed_run.outputs))
    ]
    xgrads = [
        pick(a, _unpermute(b, perms[i]), truth.xgrads[i] if i < len(truth.xgrads) else None)
        for i, (a, b) in enumerate(zip(naive.xgrads, reversed_run.xgrads))
    ]
    norm = {k: pick(v, reversed_run.norm.get(k), truth.norm.get(k)) for k, v in naive.norm.items()}
    gemm = {k: pick(v, reversed_run.gemm.get(k), truth.gemm.get(k)) for k, v in naive.gemm.items()}
    return AccuracyRun(outputs, xgrads, norm, gemm)


def accuracy(backend: Backend, case: Case) -> tuple[AccuracyRun, AccuracyRun, AccuracyRun]:
    """(under test, naive reference, float64 truth) for ``case``."""
    test, naive, truth, _ = accuracy_runs(backend, case)
    return test, naive, truth


def accuracy_runs(
    backend: Backend, case: Case
) -> tuple[AccuracyRun, AccuracyRun, AccuracyRun, AccuracyRun | None]:
    """(under test, naive reference, float64 truth, FP8 truth) for ``case``.

    The naive run is the reference in the case's dtype (under the case's recipe); the truth is
    its float64 twin *without* FP8; the FP8 truth (``None`` without a recipe) is the float64
    twin under the same recipe: the same quantizations followed by exact GEMMs."""
    from splitgrad.reference import upcast

    data = make_micro_batches(case)
    test = accuracy_run(ModuleRun(backend, case, delay=case.delay), case, data)
    naive_run = ModuleRun(reference_backend(), case, delay=False, hooks=0)

    def float64_run(recipe: str | None) -> AccuracyRun:
        run = ModuleRun(
            reference_backend(),
            case,
            delay=False,
            hooks=0,
            module=upcast(naive_run.module),
            config=dataclasses.replace(case.config, dtype="float64", recipe=recipe, autocast=None),
            main_grads=False,
        )
        return accuracy_run(run, case, data, torch.float64)

    truth = float64_run(None)
    truth_fp8 = float64_run(case.config.recipe) if case.config.recipe is not None else None
    naive = accuracy_run(naive_run, case, data)
    if reorders_rows(case):
        rev_data, perms = row_reversal(data)
        rev_run = ModuleRun(reference_backend(), case, delay=False, hooks=0)
        yardstick = truth_fp8 if truth_fp8 is not None else truth
        naive = worse_naive(naive, accuracy_run(rev_run, case, rev_data), perms, yardstick)
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


def judge(
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
    label: str = "",
    fp8_exact: bool | None = None,
    bound: torch.Tensor | None = None,
    naive_truth: torch.Tensor | None = None,
    switched: torch.Tensor | None = None,
) -> None:
    """One P1–P3 comparison. High precision: ``budget`` against the float64 truth. FP8:
    ``budget`` against the FP8 truth when every quantized operand is an input (the quantized
    values are then the same on all sides and only the GEMMs' rounding differs), otherwise the
    two-gate :data:`~.budgets.FP8` budget against the high-precision truth (see budgets.py).
    ``prefill``: the slot's value before the run (``main_grad``, or a prefilled ``.grad``; its
    floor is then taken at :func:`~.budgets.accumulation_magnitude`); ``label`` prefixes ``name``
    in messages; ``fp8_exact=False`` says some quantized operand is computed by the module even
    though ``name`` alone would not tell (a module chained on itself quantizes its own output);
    ``bound``: the tensor's order-independent rounding bound (:func:`~.internals.rounding_bounds`;
    see :func:`~.budgets.with_rounding_bound`, and under FP8 :func:`~.budgets.check_fp8_budget`);
    ``naive_truth``: what the naive FP8 run's error is measured against when ``truth`` is a
    candidate with switched ``relu'`` (the truth itself: the yardstick never moves with the
    candidate); ``switched``: the summed magnitude of the candidate's ``relu'`` switches on
    this tensor (its FP8 run computes each through quantized operands: the bound gains
    :data:`~.budgets.FP8_KINK_SWITCH_STEPS` FP8 steps of it).
    """
    if isinstance(actual, torch.Tensor) and isinstance(naive, torch.Tensor):
        # SPEC §2: outputs in the compute dtype (the autocast dtype under torch.autocast),
        # input gradients in the input's dtype, parameter gradients in the parameter's.
        t.expect(
            actual.dtype == naive.dtype,
            f"{label}{name}: dtype {actual.dtype}, but the reference gives {naive.dtype}"
            + (
                f" (under torch.autocast to {case.config.autocast})" if case.config.autocast else ""
            ),
        )
    if case.config.autocast is not None:
        # Under torch.autocast every GEMM rounds its operands to the autocast dtype, whatever
        # dtype the compared tensor comes back in (parameter gradients in float32).
        dtype = module_dtype = case.config.compute_dtype
    exact = case.config.recipe is None or (
        _fp8_exact_operands(case.config, name) if fp8_exact is None else fp8_exact
    )
    reference = truth if case.config.recipe is None else truth_fp8
    magnitude = None
    if exact and prefill is not None and reference is not None:
        magnitude = B.accumulation_magnitude(reference, prefill)
    if case.config.recipe is None:
        if actual is not None:
            element_floor = B.with_rounding_bound(
                budget, truth, dtype or actual.dtype, module_dtype, element_floor, bound, magnitude
            )
        t.budget(
            label + name,
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
            label + name,
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
        fp8_eps = 2.0**-2 if coarse else 2.0**-3
        if switched is not None:
            extra = B.FP8_KINK_SWITCH_STEPS * fp8_eps * switched
            bound = extra if bound is None else bound + extra
        t.fp8_budget(
            label + name,
            actual,
            truth,
            naive,
            B.FP8,
            dtype,
            module_dtype,
            case.config.recipe,
            fp8_eps,
            _smallest_gemm_dimension(case),
            bound,
            naive_truth,
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
    test, naive, truth, truth8 = accuracy_runs(backend, case)
    bounds = rounding_bounds(case)
    for i, (a, n, r) in enumerate(zip(test.outputs, naive.outputs, truth.outputs)):
        r8 = truth8.outputs[i] if truth8 is not None else None
        name = f"output[micro-batch {i}]"
        judge(t, case, name, a, n, r, r8, B.OUTPUT, bound=bounds.get(name))
    return t.result


def _truth_candidates(case: Case, truth: AccuracyRun) -> tuple[list[AccuracyRun], str]:
    """The truths ``case`` may legally be judged against: ``[truth]``, or, for a relu MLP with
    fc1 pre-activations within rounding distance of the kink, one truth per ``relu'`` choice
    :func:`~.kink.kink_choices` allows there (all of them in high precision, where it raises
    :class:`~.kink.CaseRejected` when there are too many to try; one or two switched under FP8;
    see :mod:`.kink`). Also returns the note a failure message gets."""
    sites = kink_sites(case)
    picks = kink_choices(case, sites)
    if len(picks) == 1:
        return [truth], ""
    deltas = kink_deltas(case, sites)
    candidates = kink_candidates(truth, sites, picks, deltas)
    return candidates, kink_note(case, sites, len(candidates))


def kink_candidates(
    truth: AccuracyRun,
    sites: Sequence[KinkSite],
    picks: Sequence[tuple[int, ...]],
    deltas: Sequence[dict],
    reaches: Callable[[KinkSite, str, int | str], bool] | None = None,
) -> list[AccuracyRun]:
    """One candidate truth per ``relu'`` assignment in ``picks``: ``truth`` plus each switched
    site's change (``deltas``, :func:`~.kink.kink_deltas`) on every compared tensor it
    ``reaches`` (``(site, "x" | "p", micro-batch or snapshot key)``; default: all). Each records
    what it switched, by tensor name, in ``switched``."""
    candidates = []
    for choice in picks:
        cand = AccuracyRun(
            list(truth.outputs), list(truth.xgrads), dict(truth.norm), dict(truth.gemm)
        )
        for site, slope, delta in zip(sites, choice, deltas):
            w = slope - site.truth_slope
            if not w:
                continue
            for (where, key), d in delta.items():
                if reaches is not None and not reaches(site, where, key):
                    continue
                if where == "x":
                    if cand.xgrads[key] is None:
                        continue
                    cand.xgrads[key] = cand.xgrads[key] + w * d
                    name = f"inp.grad[micro-batch {key}]"
                else:
                    snap = cand.norm if key in cand.norm else cand.gemm
                    if snap.get(key) is None:
                        continue
                    snap[key] = snap[key] + w * d
                    name = key
                cand.switched[name] = cand.switched.get(name, 0.0) + d.abs()
        candidates.append(cand)
    return candidates


def kink_note(case: Case, sites: Sequence[KinkSite], candidates: int) -> str:
    """What a failure message says about the kink sites it was judged at."""
    shown = sites[:8]
    where = ", ".join(
        f"micro-batch {s.micro_batch} row {s.row} feature {s.feature}: h={s.h:.3g} "
        f"(bound {s.bound:.3g})"
        for s in shown
    ) + (f", and {len(sites) - len(shown)} more" if len(sites) > len(shown) else "")
    how = (
        "the truth, then one or two of them switched (FP8)"
        if case.config.recipe is not None
        else "one per relu' choice there"
    )
    return (
        f" (relu kink: {len(sites)} fc1 pre-activation(s) within rounding distance of 0 [{where}]; "
        f"judged against the best of {candidates} truths, {how})"
    )


def naive_error(naive: torch.Tensor | None, truths: list[torch.Tensor | None]) -> float | None:
    """The naive run's error against the candidate truth it matches best (``None``: only one
    truth, let the budget measure it)."""
    if naive is None or len(truths) < 2 or any(t is None for t in truths):
        return None
    n = naive.detach().double().cpu()
    return min(float((n - t.detach().double().cpu()).abs().max()) for t in truths)


def best_of(
    candidates: list[AccuracyRun],
    compare: Callable[[Tracker, AccuracyRun], None],
    first_wins: bool = False,
) -> CheckResult:
    """Run ``compare`` against each candidate truth: the result of the best one that passes (the
    first one that passes with ``first_wins``: FP8's candidates are tried in order, the truth
    first), or the violation of the one that came closest."""
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
        if first_wins:
            return t.result
        if best is None or (t.result.ratio or 0.0) < (best.ratio or 0.0):
            best = t.result
    if best is not None:
        return best
    raise min(failures, key=lambda e: getattr(e, "ratio", float("inf")))


def compare_dgrads(
    t: Tracker,
    case: Case,
    test: AccuracyRun,
    naive: AccuracyRun,
    cand: AccuracyRun,
    candidates: list[AccuracyRun],
    truth8: AccuracyRun | None,
    note: str,
    floors: dict[str, torch.Tensor],
    prefills: dict[str, torch.Tensor] | None = None,
    label: str = "",
    fp8_exact: bool | None = None,
    uses: int = 1,
    bounds: dict[str, torch.Tensor] | None = None,
) -> None:
    """P2's comparisons of ``test`` against one candidate truth: every input gradient
    (:data:`~.budgets.DGRAD`) and norm-parameter gradient (:data:`~.budgets.NORM_GRAD`).
    ``prefills``: ``.grad`` values the norm parameters held before the run, by snapshot key;
    ``label`` prefixes every tensor name in messages (the differential property's step);
    ``uses``: the module ran that many times in a row (:func:`~.budgets.chained`); ``bounds``:
    rounding bounds by tensor name (:func:`~.internals.rounding_bounds`)."""
    prefills = prefills or {}
    bounds = bounds or {}
    for i, (a, n, r) in enumerate(zip(test.xgrads, naive.xgrads, cand.xgrads)):
        ne = naive_error(n, [c.xgrads[i] for c in candidates])
        r8 = truth8.xgrads[i] if truth8 is not None else None
        name = f"inp.grad[micro-batch {i}]"
        judge(
            t,
            case,
            name,
            a,
            n,
            r,
            r8,
            B.chained(B.DGRAD, uses),
            naive_error=ne,
            note=note,
            element_floor=floors.get(name),
            label=label,
            fp8_exact=fp8_exact,
            bound=bounds.get(name),
            naive_truth=candidates[0].xgrads[i],
            switched=cand.switched.get(name),
        )
    for key in sorted(cand.norm):
        n = naive.norm.get(key)
        ne = naive_error(n, [c.norm[key] for c in candidates])
        r8 = truth8.norm.get(key) if truth8 is not None else None
        judge(
            t,
            case,
            key,
            test.norm.get(key),
            n,
            cand.norm[key],
            r8,
            B.chained(B.NORM_GRAD, uses),
            naive_error=ne,
            note=note,
            element_floor=floors.get(key),
            prefill=prefills.get(key),
            label=label,
            fp8_exact=fp8_exact,
            bound=bounds.get(key),
            naive_truth=candidates[0].norm.get(key),
            switched=cand.switched.get(key),
        )


def compare_wgrads(
    t: Tracker,
    case: Case,
    test: AccuracyRun,
    naive: AccuracyRun,
    cand: AccuracyRun,
    candidates: list[AccuracyRun],
    truth8: AccuracyRun | None,
    note: str,
    floors: dict[str, torch.Tensor],
    prefills: dict[str, torch.Tensor],
    label: str = "",
    fp8_exact: bool | None = None,
    uses: int = 1,
    bounds: dict[str, torch.Tensor] | None = None,
) -> None:
    """P3's comparisons against one candidate truth: every GEMM weight/bias gradient and
    ``main_grad`` (:data:`~.budgets.WGRAD`); a slot the truth leaves ``None`` (a fused weight's
    ``.grad``, a frozen parameter) must be ``None``. ``prefills``: what a slot held before the
    run, by snapshot key (its floor is then taken at :func:`~.budgets.accumulation_magnitude`);
    ``bounds`` as in :func:`compare_dgrads`."""
    bounds = bounds or {}
    for key in sorted(cand.gemm):
        a = test.gemm.get(key)
        if cand.gemm[key] is None:
            t.expect(
                a is None,
                f"{label}{key}: expected None (a fused weight's .grad or a frozen parameter), "
                "got a tensor",
            )
            continue
        n = naive.gemm.get(key)
        judge(
            t,
            case,
            key,
            a,
            n,
            cand.gemm[key],
            truth8.gemm.get(key) if truth8 is not None else None,
            B.chained(B.WGRAD, uses),
            _floor_dtype(key, case.config),
            case.config.torch_dtype,
            naive_error=naive_error(n, [c.gemm[key] for c in candidates]),
            note=note,
            element_floor=floors.get(key),
            prefill=prefills.get(key),
            label=label,
            fp8_exact=fp8_exact,
            bound=bounds.get(key),
            naive_truth=candidates[0].gemm.get(key),
            switched=cand.switched.get(key),
        )


def check_p2(backend: Backend, case: Case) -> CheckResult:
    """P2: input gradients (:data:`~.budgets.DGRAD`) and norm-parameter gradients
    (:data:`~.budgets.NORM_GRAD`) within budget (of some legal truth at a relu kink; plus the
    per-element :data:`~.budgets.DGRAD_OPERAND_STEPS` allowance behind a smooth activation)."""
    test, naive, truth, truth8 = accuracy_runs(backend, case)
    candidates, note = _truth_candidates(case, truth)
    floors = dgrad_operand_floors(case)
    bounds = rounding_bounds(case)

    def compare(t: Tracker, cand: AccuracyRun) -> None:
        compare_dgrads(t, case, test, naive, cand, candidates, truth8, note, floors, bounds=bounds)

    return best_of(candidates, compare, first_wins=case.config.recipe is not None)


def check_p3(backend: Backend, case: Case) -> CheckResult:
    """P3: GEMM weight/bias gradients (``main_grad`` when fused) within
    :data:`~.budgets.WGRAD` (plus, for operands the module computes, the per-element
    :data:`~.budgets.WGRAD_OPERAND_STEPS` allowance) after every ``backward_dw()``; fused weights
    keep ``.grad is None``."""
    test, naive, truth, truth8 = accuracy_runs(backend, case)
    if set(test.gemm) != set(truth.gemm):
        raise PropertyViolation(f"gradient slots {sorted(test.gemm)} != {sorted(truth.gemm)}")
    candidates, note = _truth_candidates(case, truth)
    floors = wgrad_operand_floors(case)
    fused = case.config.fuse_wgrad_accumulation
    prefills = (
        {f"{k}.main_grad": v for k, v in make_main_grads(case.config, case.seed).items()}
        if fused
        else {}
    )

    bounds = rounding_bounds(case)

    def compare(t: Tracker, cand: AccuracyRun) -> None:
        compare_wgrads(
            t, case, test, naive, cand, candidates, truth8, note, floors, prefills, bounds=bounds
        )

    return best_of(candidates, compare, first_wins=case.config.recipe is not None)
