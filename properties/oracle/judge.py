"""One comparison against the float64 truth, and the loops that make them for a whole run.

A :class:`Comparison` says what is compared (a tensor of the run under test, the naive
reference's, the truth's) and which allowances apply to it; :func:`judge` picks the regime
from the case and applies the budget of :mod:`.budgets`:

* high precision: the tensor's :class:`~.budgets.ErrorBudget` against the float64 truth, with
  the rounding bound as a per-element floor;
* FP8, same operands: every quantized operand on the tensor's way is an input, a parameter or
  ``dy``, so all sides quantize the same values; the same budget, against the same recipe run
  in float64;
* FP8, computed operands: some quantized operand is computed by the module (a norm output, an
  activation), so two correct runs may quantize it differently; the two-gate
  :data:`~.budgets.FP8` budget against the high-precision truth.

:class:`Judging` holds what every tensor of one example is judged with (the naive run, the
candidate truths, the allowances) and makes the comparisons of P2 (:func:`compare_dgrads`) and
P3 (:func:`compare_wgrads`); :func:`best_of` runs them against each candidate truth at a relu
kink (:mod:`.kink`).
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

__all__ = [
    "HIGH_PRECISION",
    "FP8_SAME_OPERANDS",
    "FP8_COMPUTED_OPERANDS",
    "Comparison",
    "judge",
    "Judging",
    "compare_outputs",
    "compare_dgrads",
    "compare_wgrads",
    "best_of",
    "naive_error",
    "kink_candidates",
    "kink_note",
    "tensor_of",
]

HIGH_PRECISION = "high precision"
FP8_SAME_OPERANDS = "FP8, same operands"
FP8_COMPUTED_OPERANDS = "FP8, computed operands"


@dataclasses.dataclass(frozen=True)
class Comparison:
    """One tensor of ``case`` judged against the float64 truth.

    ``name`` is the tensor's (``"fc1_weight.main_grad"``), ``label`` prefixes it in messages.
    ``truth`` is the high-precision truth (a candidate at a relu kink), ``truth_fp8`` the same
    recipe in float64, ``naive_truth`` what the naive run's error is measured against when
    ``truth`` is a candidate (the truth itself: the yardstick never moves with the candidate).
    ``floor_dtype`` sets the floor's rounding step (default: ``actual``'s dtype), and
    ``module_dtype`` the multiplier (default: ``floor_dtype``). Allowances: ``naive_error``
    (the naive run against its best candidate), ``element_floor`` (operand allowances),
    ``bound`` (the rounding bound, :mod:`.rounding`), ``prefill`` (what the slot held before
    the run: the floor is then taken at :func:`~.budgets.accumulation_magnitude`), ``switched``
    (the candidate's summed ``relu'`` switches on this tensor, under FP8). ``fp8_exact=False``
    says some quantized operand is computed by the module although ``name`` alone would not
    tell (a module chained on itself quantizes its own output)."""

    case: Case
    name: str
    actual: torch.Tensor | None
    naive: torch.Tensor | None
    truth: torch.Tensor | None
    budget: B.ErrorBudget
    truth_fp8: torch.Tensor | None = None
    naive_truth: torch.Tensor | None = None
    floor_dtype: torch.dtype | None = None
    module_dtype: torch.dtype | None = None
    naive_error: float | None = None
    element_floor: torch.Tensor | None = None
    bound: torch.Tensor | None = None
    prefill: torch.Tensor | None = None
    switched: torch.Tensor | None = None
    fp8_exact: bool | None = None
    label: str = ""
    note: str = ""

    @property
    def regime(self) -> str:
        """:data:`HIGH_PRECISION`, :data:`FP8_SAME_OPERANDS` or :data:`FP8_COMPUTED_OPERANDS`."""
        config = self.case.config
        if config.recipe is None:
            return HIGH_PRECISION
        exact = _fp8_exact_operands(config, self.name) if self.fp8_exact is None else self.fp8_exact
        return FP8_SAME_OPERANDS if exact else FP8_COMPUTED_OPERANDS

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """(floor dtype, module dtype). Under ``torch.autocast`` every GEMM rounds its operands
        to the autocast dtype, whatever dtype the tensor comes back in."""
        if self.case.config.autocast is not None:
            return self.case.config.compute_dtype, self.case.config.compute_dtype
        return self.floor_dtype, self.module_dtype

    def floor_magnitude(self, reference: torch.Tensor | None) -> float | None:
        """Where the slot was prefilled: the size its accumulation rounds at."""
        if self.prefill is None or reference is None:
            return None
        return B.accumulation_magnitude(reference, self.prefill)


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


def judge(t: Tracker, c: Comparison) -> None:
    """Judge one tensor (see the module docstring for the regimes); records the ratio in ``t``
    or raises :class:`~.budgets.BudgetViolation` / :class:`~.results.PropertyViolation`."""
    if isinstance(c.actual, torch.Tensor) and isinstance(c.naive, torch.Tensor):
        # SPEC §2: outputs in the compute dtype (the autocast dtype under torch.autocast),
        # input gradients in the input's dtype, parameter gradients in the parameter's.
        autocast = c.case.config.autocast
        t.expect(
            c.actual.dtype == c.naive.dtype,
            f"{c.label}{c.name}: dtype {c.actual.dtype}, but the reference gives {c.naive.dtype}"
            + (f" (under torch.autocast to {autocast})" if autocast else ""),
        )
    _REGIMES[c.regime](t, c)


def _judge_high_precision(t: Tracker, c: Comparison) -> None:
    dtype, module_dtype = c.dtypes()
    magnitude = c.floor_magnitude(c.truth)
    floor = c.element_floor
    if c.actual is not None:
        floor = B.with_rounding_bound(
            c.budget, c.truth, dtype or c.actual.dtype, module_dtype, floor, c.bound, magnitude
        )
    t.budget(
        c.label + c.name,
        c.actual,
        c.truth,
        c.naive,
        c.budget,
        dtype,
        module_dtype,
        c.naive_error,
        c.note,
        floor,
        magnitude,
    )


def _judge_fp8_same_operands(t: Tracker, c: Comparison) -> None:
    dtype, module_dtype = c.dtypes()
    t.budget(
        c.label + c.name,
        c.actual,
        c.truth_fp8,
        c.naive,
        c.budget,
        dtype,
        module_dtype,
        note=f" (FP8 {c.case.config.recipe}: against the same recipe in float64)",
        floor_magnitude=c.floor_magnitude(c.truth_fp8),
    )


def _judge_fp8_computed_operands(t: Tracker, c: Comparison) -> None:
    dtype, module_dtype = c.dtypes()
    recipe = c.case.config.recipe
    # Outputs only meet E4M3; gradients meet E5M2 under HYBRID.
    coarse = recipe.endswith("hybrid") and not c.name.startswith("output")
    fp8_eps = 2.0**-2 if coarse else 2.0**-3
    bound = c.bound
    if c.switched is not None:
        extra = B.FP8_KINK_SWITCH_STEPS * fp8_eps * c.switched
        bound = extra if bound is None else bound + extra
    t.fp8_budget(
        c.label + c.name,
        c.actual,
        c.truth,
        c.naive,
        B.FP8,
        dtype,
        module_dtype,
        recipe,
        fp8_eps,
        _smallest_gemm_dimension(c.case),
        bound,
        c.naive_truth,
    )


_REGIMES = {
    HIGH_PRECISION: _judge_high_precision,
    FP8_SAME_OPERANDS: _judge_fp8_same_operands,
    FP8_COMPUTED_OPERANDS: _judge_fp8_computed_operands,
}


def _smallest_gemm_dimension(case: Case) -> int:
    """The fewest values any FP8 GEMM of ``case`` reduces over or spans: feature sizes, fc1's
    width, and every non-empty token count (group by group)."""
    c = case.config
    dims = [d for shape in c.gemm_shapes() for d in shape]
    for mb in case.micro_batches:
        dims.extend(n for n in (mb.m_splits or (mb.rows,)) if n > 0)
    return min(dims)


# ---- judging a whole run ---------------------------------------------------------------------


def tensor_of(run: AccuracyRun | None, name: str) -> torch.Tensor | None:
    """The tensor ``name`` of ``run`` (``"output[micro-batch 0]"``, ``"inp.grad[micro-batch
    1]"`` or a snapshot key); ``None`` where the run has none."""
    if run is None:
        return None
    for prefix, tensors in (("output", run.outputs), ("inp.grad", run.xgrads)):
        if name.startswith(prefix + "[micro-batch "):
            i = int(name[len(prefix) + 13 : -1])
            return tensors[i] if i < len(tensors) else None
    return run.norm[name] if name in run.norm else run.gemm.get(name)


@dataclasses.dataclass
class Judging:
    """What every tensor of one example is judged with: the naive run, the candidate truths
    (``candidates[0]`` is the truth itself), the FP8 truth, and the allowances by tensor name
    (``floors``: operand allowances, ``prefills``: slot values before the run, ``bounds``:
    rounding bounds). ``note`` ends a failure message, ``label`` begins each tensor name;
    ``uses``: the module ran that many times in a row (:func:`~.budgets.chained`);
    ``fp8_exact`` as in :class:`Comparison`."""

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

    def comparison(
        self,
        name: str,
        actual: torch.Tensor | None,
        cand: AccuracyRun,
        budget: B.ErrorBudget,
        floor_dtype: torch.dtype | None = None,
        module_dtype: torch.dtype | None = None,
    ) -> Comparison:
        """``actual`` (tensor ``name`` of the run under test) against candidate truth ``cand``."""
        naive = tensor_of(self.naive, name)
        return Comparison(
            case=self.case,
            name=name,
            actual=actual,
            naive=naive,
            truth=tensor_of(cand, name),
            budget=B.chained(budget, self.uses),
            truth_fp8=tensor_of(self.truth8, name),
            naive_truth=tensor_of(self.candidates[0], name),
            floor_dtype=floor_dtype,
            module_dtype=module_dtype,
            naive_error=naive_error(naive, [tensor_of(c, name) for c in self.candidates]),
            element_floor=self.floors.get(name),
            bound=self.bounds.get(name),
            prefill=self.prefills.get(name),
            switched=cand.switched.get(name),
            fp8_exact=self.fp8_exact,
            label=self.label,
            note=self.note,
        )


def compare_outputs(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P1's comparisons: every micro-batch's output (:data:`~.budgets.OUTPUT`)."""
    for i in range(min(len(got.outputs), len(j.naive.outputs), len(cand.outputs))):
        name = f"output[micro-batch {i}]"
        judge(t, j.comparison(name, got.outputs[i], cand, B.OUTPUT))


def compare_dgrads(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P2's comparisons of ``got`` against one candidate truth: every input gradient
    (:data:`~.budgets.DGRAD`) and norm-parameter gradient (:data:`~.budgets.NORM_GRAD`)."""
    for i in range(min(len(got.xgrads), len(j.naive.xgrads), len(cand.xgrads))):
        name = f"inp.grad[micro-batch {i}]"
        judge(t, j.comparison(name, got.xgrads[i], cand, B.DGRAD))
    for key in sorted(cand.norm):
        judge(t, j.comparison(key, got.norm.get(key), cand, B.NORM_GRAD))


def compare_wgrads(t: Tracker, got: AccuracyRun, cand: AccuracyRun, j: Judging) -> None:
    """P3's comparisons against one candidate truth: every GEMM weight/bias gradient and
    ``main_grad`` (:data:`~.budgets.WGRAD`); a slot the truth leaves ``None`` (a fused weight's
    ``.grad``, a frozen parameter) must be ``None``."""
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
        judge(t, j.comparison(key, a, cand, B.WGRAD, floor_dtype, config.torch_dtype))


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
