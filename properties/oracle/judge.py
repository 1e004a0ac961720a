"""One comparison against the float64 truth (:func:`judge`, in the tensor's regime: high
precision, FP8 with exact operands or FP8 with computed ones, docs/budgets.md), and the loops
that make them for a whole run against each candidate truth (:func:`best_of`, :mod:`.kink`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from .. import budgets as B
from ..cases.case import Case, ModuleConfig
from ..checks.results import CheckResult, Tracker
from ..checks.runner import AccuracyRun
from .kink import KinkSite


@dataclasses.dataclass
class Judging:
    """What every tensor of one example is judged with: the naive run, the candidate truths
    (``candidates[0]`` the truth), the FP8 truth, the allowances by tensor name, ``uses`` (the
    module's runs in a row); ``fp8_exact=False``: a quantized operand is computed, whatever the
    tensor's name says (a module chained on itself)."""

    case: Case
    naive: AccuracyRun
    candidates: list[AccuracyRun]
    truth8: AccuracyRun | None = None
    floors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    prefills: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    bounds: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    note: str = ""
    label: str = ""
    uses: int = 1
    fp8_exact: bool | None = None


def _fp8_exact_operands(config: ModuleConfig, name: str) -> bool:
    """Whether every FP8-quantized operand on the way to tensor ``name`` is an input, parameter
    or output gradient (quantized alike by every side)."""
    if config.kind in ("Linear", "GroupedLinear"):
        return True
    if config.kind == "LayerNormLinear":
        # dgrad q(dy) q(W) feeds the norm backward; the bias gradient is summed from dy.
        return name.startswith(("inp.grad", "layer_norm_", "bias."))
    return name.startswith("fc2_bias.")


def _accumulated(reference: torch.Tensor | None, prefill: torch.Tensor | None) -> float | None:
    """Where the slot was prefilled: the size its accumulation rounds at."""
    if prefill is None or reference is None:
        return None
    return B.accumulation_magnitude(reference, prefill)


def judge(
    t: Tracker,
    j: Judging,
    name: str,
    actual: torch.Tensor | None,
    cand: AccuracyRun,
    budget: B.ErrorBudget,
    floor_dtype: torch.dtype | None = None,
    module_dtype: torch.dtype | None = None,
) -> None:
    """Judge tensor ``name`` against candidate truth ``cand`` in its regime (``floor_dtype``: the
    floor's rounding step, default ``actual``'s; ``module_dtype``: the multiplier's)."""
    config = j.case.config
    naive, truth, label = tensor_of(j.naive, name), tensor_of(cand, name), j.label + name
    if isinstance(actual, torch.Tensor) and isinstance(naive, torch.Tensor):
        # SPEC §2: outputs in the compute dtype (the autocast dtype under torch.autocast),
        # input gradients in the input's dtype, parameter gradients in the parameter's.
        under = f" (under torch.autocast to {config.autocast})" if config.autocast else ""
        t.expect(
            actual.dtype == naive.dtype,
            f"{label}: dtype {actual.dtype}, but the reference gives {naive.dtype}{under}",
        )
    if config.autocast is not None:  # every GEMM rounds its operands to the autocast dtype
        floor_dtype = module_dtype = config.compute_dtype
    dtypes = (floor_dtype, module_dtype)
    budget, prefill = B.chained(budget, j.uses), j.prefills.get(name)
    if config.recipe is None:
        magnitude = _accumulated(truth, prefill)
        floor = j.floors.get(name)
        if actual is not None:
            step_dtype, bound = floor_dtype or actual.dtype, j.bounds.get(name)
            floor = B.with_rounding_bound(
                budget, truth, step_dtype, module_dtype, floor, bound, magnitude
            )
        naive_err = naive_error(naive, [tensor_of(c, name) for c in j.candidates])
        t.budget(label, actual, truth, naive, budget, *dtypes, naive_err, j.note, floor, magnitude)
    elif _fp8_exact_operands(config, name) if j.fp8_exact is None else j.fp8_exact:
        truth8 = tensor_of(j.truth8, name)
        note = f" (FP8 {config.recipe}: against the same recipe in float64)"
        magnitude = _accumulated(truth8, prefill)
        t.budget(
            label, actual, truth8, naive, budget, *dtypes, note=note, floor_magnitude=magnitude
        )
    else:
        recipe = config.recipe
        # Outputs only meet E4M3; gradients meet E5M2 under HYBRID.
        coarse = recipe.endswith("hybrid") and not name.startswith("output")
        fp8_eps = 2.0**-2 if coarse else 2.0**-3
        bound, switched = j.bounds.get(name), cand.switched.get(name)
        if switched is not None:
            extra = B.FP8_KINK_SWITCH_STEPS * fp8_eps * switched
            bound = extra if bound is None else bound + extra
        # The fewest values any FP8 GEMM reduces over or spans (every non-empty group's rows).
        dims = [d for shape in config.gemm_shapes() for d in shape]
        for mb in j.case.micro_batches:
            dims.extend(n for n in (mb.m_splits or (mb.rows,)) if n > 0)
        truth0 = tensor_of(j.candidates[0], name)  # the naive error is measured against it
        t.fp8_budget(
            label, actual, truth, naive, B.FP8, *dtypes, recipe, fp8_eps, min(dims), bound, truth0
        )


# ---- judging a whole run ---------------------------------------------------------------------
def tensor_of(run: AccuracyRun | None, name: str) -> torch.Tensor | None:
    """The tensor ``name`` (``"output[micro-batch 0]"``, ``"inp.grad[micro-batch 1]"`` or a
    snapshot key) of ``run``, or ``None``."""
    if run is None:
        return None
    for prefix, tensors in (("output", run.outputs), ("inp.grad", run.xgrads)):
        if name.startswith(prefix + "[micro-batch "):
            i = int(name[len(prefix) + 13 : -1])
            return tensors[i] if i < len(tensors) else None
    return run.norm[name] if name in run.norm else run.gemm.get(name)


def compare_outputs(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P1's comparisons: every micro-batch's output (:data:`~.budgets.OUTPUT`)."""
    for i in range(min(len(got.outputs), len(j.naive.outputs), len(cand.outputs))):
        judge(t, j, f"output[micro-batch {i}]", got.outputs[i], cand, B.OUTPUT)


def compare_dgrads(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P2's comparisons of ``got`` against one candidate truth: every input gradient
    (:data:`~.budgets.DGRAD`) and norm-parameter gradient (:data:`~.budgets.NORM_GRAD`)."""
    for i in range(min(len(got.xgrads), len(j.naive.xgrads), len(cand.xgrads))):
        judge(t, j, f"inp.grad[micro-batch {i}]", got.xgrads[i], cand, B.DGRAD)
    for key in sorted(cand.norm):
        judge(t, j, key, got.norm.get(key), cand, B.NORM_GRAD)


def compare_wgrads(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P3's comparisons: every GEMM gradient and ``main_grad`` (:data:`~.budgets.WGRAD`); a slot
    the truth leaves ``None`` (a fused weight's ``.grad``, a frozen one) must be ``None``."""
    config = j.case.config
    for key in sorted(cand.gemm):
        a = got.gemm.get(key)
        if cand.gemm[key] is None:
            t.expect(
                a is None,
                f"{j.label}{key}: expected None (a fused weight's .grad or a frozen parameter), "
                "got a tensor",
            )
            continue
        floor_dtype = torch.float32 if key.endswith(".main_grad") else config.torch_dtype
        judge(t, j, key, a, cand, B.WGRAD, floor_dtype, config.torch_dtype)


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


def kink_candidates(
    truth: AccuracyRun,
    sites: Sequence[KinkSite],
    picks: Sequence[tuple[int, ...]],
    deltas: Sequence[dict],
    reaches: Callable[[KinkSite, str, int | str], bool] | None = None,
) -> list[AccuracyRun]:
    """One candidate truth per ``relu'`` assignment in ``picks``: ``truth`` plus each switched
    site's change (``deltas``) on every tensor it ``reaches`` (``(site, "x" | "p", micro-batch or
    snapshot key)``; default: all), what it switched recorded by tensor name."""
    candidates = []
    for choice in picks:
        cand = AccuracyRun(
            list(truth.outputs), list(truth.xgrads), dict(truth.norm), dict(truth.gemm)
        )
        for site, slope, delta in zip(sites, choice, deltas):
            w = slope - site.truth_slope
            if w:
                _switch(cand, site, w, delta, reaches)
        candidates.append(cand)
    return candidates


def _switch(cand: AccuracyRun, site: KinkSite, w: int, delta: dict, reaches) -> None:
    """Add ``w`` times site's change to every tensor of ``cand`` it reaches."""
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
