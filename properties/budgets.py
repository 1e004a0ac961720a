"""Every tolerance of the harness, and the three tiers of oracle that apply them: bitwise
(:func:`check_bitwise`), an error budget against the float64 truth (:func:`check_error_budget`,
:func:`check_fp8_budget`) and float64 gradcheck of the reference (:func:`gradcheck_reference`).
Each constant carries its reason; docs/budgets.md derives each value. Failures raise
:class:`BudgetViolation` naming the tensor, the worst index, both values and the budget.
"""

from __future__ import annotations

import dataclasses
import math

import torch


class BudgetViolation(AssertionError):
    """A comparison failed (an ``AssertionError``, so hypothesis shrinks on it); ``ratio``:
    worst error / budget (``inf`` for a bitwise mismatch, a missing tensor or another shape)."""

    def __init__(self, tensor: str, message: str, ratio: float = math.inf) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ratio = ratio


@dataclasses.dataclass(frozen=True)
class ErrorBudget:
    """``max|actual - truth| <= multiplier * max|naive - truth| + floor_steps * eps * max|truth|``;
    ``why``: where the two sides round differently; ``fp32_*``: the values for float32 modules."""

    kind: str
    multiplier: float
    floor_steps: float
    why: str
    fp32_multiplier: float | None = None
    fp32_why: str = ""
    fp32_floor_steps: float | None = None

    def multiplier_for(self, dtype: torch.dtype) -> float:
        """The multiplier for a module computing in ``dtype``."""
        fp32 = dtype == torch.float32 and self.fp32_multiplier is not None
        return self.fp32_multiplier if fp32 else self.multiplier

    def floor_steps_for(self, dtype: torch.dtype) -> float:
        """Rounding steps of the floor for a module computing in ``dtype``."""
        fp32 = dtype == torch.float32 and self.fp32_floor_steps is not None
        return self.fp32_floor_steps if fp32 else self.floor_steps


# ---- high precision: one budget per kind of tensor ------------------------------------------
_FP32_FLOOR = 4.0


def _fp32(multiplier: float, measured: float, more: str = "", floors: int = 1) -> dict:
    """A budget's float32 fields (``measured``: the largest impl/naive error ratio seen)."""
    why = (
        "in float32 both errors are reduction-order noise of a few ulps, and the naive maximum "
        f"over a few elements is a noisy yardstick (impl/naive ratios up to ~{measured} measured); "
        "each of up to four chained float32 ops may round elsewhere, one step each: a 4-step floor"
    )
    return dict(
        fp32_multiplier=multiplier, fp32_floor_steps=floors * _FP32_FLOOR, fp32_why=why + more
    )


OUTPUT = ErrorBudget(
    "output",
    2.0,
    1.0,
    "an implementation may fuse the bias add into the GEMM epilogue (one rounding instead of "
    "the reference's two) or reduce the norm statistics in another order",
    **_fp32(4.0, 8),
)
DGRAD = ErrorBudget(
    "dgrad",
    2.0,
    1.0,
    "dgrad GEMMs may block the reduction over output features differently, and a fused norm "
    "backward rounds its intermediate sums at other points than the reference's formulas",
    **_fp32(8.0, 4, "; the norm backward, a difference of larger terms, amplifies that noise"),
)
WGRAD = ErrorBudget(
    "wgrad",
    4.0,
    2.0,
    "wgrad and bias gradients reduce over all tokens; a GEMM kernel that splits that reduction "
    "(split-K, or accumulating straight into fp32 main_grad) sums in a different order; and the "
    "saved operands (norm output, activation) are themselves rounded to the module dtype, where "
    "a legal one-step difference in the forward moves dW by about one more step",
    **_fp32(8.0, 4),
)
NORM_GRAD = ErrorBudget(
    "norm_grad",
    4.0,
    1.0,
    "gamma/beta gradients are reductions over all tokens, done by a fused kernel in partial "
    "sums per block rather than the reference's single torch.sum",
    **_fp32(8.0, 5.5),
)
GROUPED_GEMM = ErrorBudget(
    "grouped_gemm",
    2.0,
    1.0,
    "a grouped GEMM kernel tiles each group's GEMM differently from the single-GEMM kernel a "
    "Linear uses; both round their fp32 accumulation once to the output dtype",
)
SECOND_ORDER = ErrorBudget(
    "second_order",
    4.0,
    2.0,
    "a second derivative runs the backward's GEMMs and the norm backward's derivative on "
    "first-order results that are themselves rounded: twice the rounding points of a "
    "first-order gradient, each of which an implementation may place elsewhere (a fused "
    "kernel, torch's own norm backward) than the reference's formulas",
    **_fp32(8.0, 4, "; a second derivative chains twice as many of them", floors=2),
)

BUDGETS = {b.kind: b for b in (OUTPUT, DGRAD, WGRAD, NORM_GRAD, GROUPED_GEMM, SECOND_ORDER)}


def chained(budget: ErrorBudget, uses: int) -> ErrorBudget:
    """``budget`` for a module applied ``uses`` times in a row (P7's ``m(m(x))``): ``uses`` times
    the rounding points, so ``uses`` times the floor."""
    if uses == 1:
        return budget
    fp32 = budget.fp32_floor_steps
    return dataclasses.replace(
        budget,
        floor_steps=budget.floor_steps * uses,
        fp32_floor_steps=None if fp32 is None else fp32 * uses,
        why=f"{budget.why}; the module runs {uses} times in a row, so {uses}x the rounding points",
    )


# ---- per-element allowances on top of a budget -----------------------------------------------
# main_grad of a weight whose GEMM operand the module computes (ln_out, the activation, d_fc1):
# a legal one-step difference in that operand moves dW by eps * sum|dy||a|, per computed operand.
WGRAD_OPERAND_STEPS = 1.0
# LayerNormMLP's dx and norm gradients behind a smooth activation: the saved pre-activation may
# be a rounding away, moving act'(h); the moves add as a root sum of squares, at 2 sigma.
DGRAD_OPERAND_STEPS = 1.0
DGRAD_OPERAND_SIGMAS = 2.0


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double().cpu()


def accumulation_magnitude(truth: torch.Tensor, prefill: torch.Tensor) -> float:
    """``max(|truth|, |prefill|, |truth - prefill|)``: ``main_grad += dW`` rounds at the size of
    its operands, far above ``|truth|`` where the prefill and the contribution nearly cancel."""
    t, p = _f64(truth), _f64(prefill)
    return float(torch.stack([t.abs().max(), p.abs().max(), (t - p).abs().max()]).max())


# main_grad.addmm_ adds the prefill inside the GEMM's fp32 reduction where the kernel chooses
# (measured: up to 1.2 steps off G0 + mm); a contribution added in bf16 or dropped is far more.
FUSED_ACCUMULATION_STEPS = 4.0


def fused_accumulation_tolerance(start: torch.Tensor, contribution: torch.Tensor) -> float:
    """How far ``main_grad`` after one fused accumulation may be from ``start + contribution``:
    :data:`FUSED_ACCUMULATION_STEPS` fp32 steps of ``max(|start| + |contribution|)``."""
    size = float((start.detach().double().abs() + contribution.detach().double().abs()).max())
    return FUSED_ACCUMULATION_STEPS * rounding_step(torch.float32, size)


# ---- the rounding bound (properties/oracle/rounding.py) ---
# Independent roundings add as a root sum of squares, taken at this many standard deviations
# (Higham & Mary's probabilistic model); reductions count their worst case in any order.
ROUNDING_SIGMAS = 2.0
# An activation formula (a handful of fp32 operations on terms of about |h|) is taken as this
# many compute-dtype roundings of |h| + |f(h)|.
ACTIVATION_EVAL_STEPS = 8.0


def _floor(budget, t, dtype, steps_dtype, floor_magnitude) -> tuple[float, float, float]:
    """(floor steps, magnitude, floor), at ``max|t|`` or ``floor_magnitude`` if larger."""
    steps = budget.floor_steps_for(steps_dtype)
    magnitude = float(t.abs().max())
    if floor_magnitude is not None:
        magnitude = max(magnitude, floor_magnitude)
    return steps, magnitude, steps * rounding_step(dtype, magnitude)


def with_rounding_bound(
    budget: ErrorBudget,
    truth: torch.Tensor | None,
    dtype: torch.dtype,
    module_dtype: torch.dtype | None,
    element_floor: torch.Tensor | None,
    bound: torch.Tensor | None,
    floor_magnitude: float | None = None,
) -> torch.Tensor | None:
    """The ``element_floor`` for :func:`check_error_budget` that makes its budget, per element,
    ``multiplier * naive + max(floor + element_floor, bound)`` (``bound``: truth's shape)."""
    if bound is None or truth is None or truth.numel() == 0 or bound.shape != truth.shape:
        return element_floor
    t = _f64(truth)
    floor = _floor(budget, t, dtype, module_dtype or dtype, floor_magnitude)[2]
    extra = torch.zeros_like(t) if element_floor is None else element_floor.double().cpu()
    return torch.maximum(extra + floor, bound.double().cpu()) - floor


# ---- FP8 (SPEC §6) ---------------------------------------------------------------------------
# FP8 formats: largest finite value, epsilon, and the spacing of the subnormals.
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
FP8_EPS = {"E4M3": 2.0**-3, "E5M2": 2.0**-2}
FP8_SUBNORMAL_STEP = {"E4M3": 2.0**-9, "E5M2": 2.0**-16}


def fp8_step(v: torch.Tensor, fmt: str, scale_inv: float) -> torch.Tensor:
    """The largest gap between neighbouring FP8 ``fmt`` values around ``v`` quantized with
    ``scale_inv``: ``eps(fmt) * |v|``, at least the subnormal spacing ``* scale_inv``."""
    return torch.clamp(FP8_EPS[fmt] * v.abs(), min=FP8_SUBNORMAL_STEP[fmt] * scale_inv)


@dataclasses.dataclass(frozen=True)
class Fp8Budget:
    """Two gates, both must hold (docs/budgets.md, FP8): element-wise, ``max|a - t| <=
    multiplier * max|n - t| + (floor_steps * eps(dtype) + small) * max|t|``; whole tensor,
    ``||a - t|| / ||t|| <= norm_multiplier * ||n - t|| / ||t|| + norm_floor_steps * eps + small``;
    ``small = small_tensor_steps * eps(fp8) / sqrt(independent quantizations)``."""

    kind: str
    multiplier: float
    floor_steps: float
    norm_multiplier: float
    norm_floor_steps: float
    small_tensor_steps: float
    why: str


# Where some quantized operand is computed by the module, against the high-precision truth.
FP8 = Fp8Budget(
    "fp8",
    3.0,
    2.0,
    1.5,
    1.0,
    1.0,
    "impl's norm/activation outputs may round a step differently from the reference's before "
    "they are quantized, which moves some elements (and the tensor's amax, hence its scale) "
    "across FP8 rounding boundaries: the two runs then carry FP8 errors of the same size at "
    "partly different places, compounded through LayerNormMLP's two quantized GEMMs",
)
# relu under FP8: candidate truths switch one band site, or two up to PAIRS_UP_TO sites; past
# MAX_SITES the truth alone (statistics carry there).
FP8_KINK_MAX_SITES = 64
FP8_KINK_PAIRS_UP_TO = 16
# A switched site's change passes quantized operands: the bound gains this many FP8 steps of it.
FP8_KINK_SWITCH_STEPS = 1.0

# ---- the relu kink (properties/oracle/kink.py) ---
# How far a correct run's fc1 pre-activation may be off, in steps of sum|ln_out||W1| + |b1|:
# 2.5 steps of rounding plus a norm kernel's own (float32's were measured several steps off).
KINK_ROUNDING_STEPS = {torch.bfloat16: 4.0, torch.float16: 4.0, torch.float32: 16.0}
# At most 2**3 candidate truths; an example with more ambiguous sites is rejected.
KINK_MAX_ENUMERATED = 3

# ---- data parallel (P16) ---------------------------------------------------------------------
# The global batch's terms summed per replica, then averaged; the yardstick is the global batch.
DATA_PARALLEL_MULTIPLIER = 2.0
DATA_PARALLEL_FLOOR_STEPS = 4.0


def data_parallel_tolerance(dtype: torch.dtype, naive_error: float, truth_max: float) -> float:
    """Budget of one data-parallel gradient against the float64 global-batch truth, given the
    single-process run's own error and ``max|truth|``."""
    floor = DATA_PARALLEL_FLOOR_STEPS * rounding_step(dtype, truth_max)
    return DATA_PARALLEL_MULTIPLIER * naive_error + floor


# ---- tensor parallel (P19) -------------------------------------------------------------------
# Below float64 P19 judges with the budgets above, its naive run the reference under the same TP.
TENSOR_PARALLEL_FLOAT64 = ErrorBudget(
    "tensor_parallel_float64",
    0.0,
    2.0**12,
    "a float64 TP run against the float64 single-process truth, which has no naive run to "
    "measure: both sum the same terms in different orders (per-rank partial sums, then the "
    "collective's), at most ~1e-12 of max|truth| for the few hundred terms P19 reduces, through "
    "a norm backward too; a missing reduction or a gather along the wrong dimension is off by "
    "O(max|truth|)",
)


# ---- initial values (P18 module.initial_values) ----------------------------------------------
# A GEMM weight's initial values are judged as a sample of N(0, std²) by statistical tests (its
# mean, its mean square, its largest magnitude); each test raises a false alarm on a correct
# module with at most this probability, for any seed.
INIT_FALSE_ALARM = 1e-9
# The mean-square test (a chi-square statistic under the Wilson-Hilferty normal approximation,
# whose tails are close enough only for a sample this large) runs on samples of this size up.
INIT_MEAN_SQUARE_MIN_SAMPLES = 100

# ---- tier 3: finite differences in float64 (torch.autograd.gradcheck's defaults) -------------
GRADCHECK_EPS = 1e-6
GRADCHECK_ATOL = 1e-5
GRADCHECK_RTOL = 1e-3

# ---- the comparisons -------------------------------------------------------------------------
_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def rounding_step(dtype: torch.dtype, magnitude: float) -> float:
    """One rounding step (ulp) of ``dtype`` at ``magnitude``: at most ``eps * magnitude``; the
    smallest normal number of ``dtype`` when ``magnitude`` is zero."""
    info = torch.finfo(dtype)
    return max(info.eps * magnitude, info.tiny)


def _fmt_index(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    if len(shape) == 0:
        return ()
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_index), shape))


def _scalar(t: torch.Tensor, index: tuple[int, ...]) -> float:
    return float(t[index].item()) if t.numel() else float("nan")


def _worst(ratios: torch.Tensor) -> tuple[int, float]:
    """The flat index of the largest ratio, and that ratio."""
    flat = int(ratios.flatten().argmax())
    return flat, float(ratios.flatten()[flat])


def _abs_err(a: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``|a - t|``, a NaN counted as an infinite error."""
    err = (a - t).abs()
    return torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)


def check_same_presence(
    name: str, actual: torch.Tensor | None, expected: torch.Tensor | None
) -> bool:
    """Raise unless both are ``None`` or both tensors of one shape; return ``True`` when there
    are tensors to compare."""
    if actual is None and expected is None:
        return False
    if actual is None or expected is None:
        got = "None" if actual is None else f"a tensor of shape {tuple(actual.shape)}"
        want = "None" if expected is None else f"a tensor of shape {tuple(expected.shape)}"
        raise BudgetViolation(name, f"{name}: got {got}, expected {want}")
    if actual.shape != expected.shape:
        raise BudgetViolation(
            name, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
        )
    return True


def check_bitwise(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None) -> float:
    """Tier 1: identical bits (and dtype, shape, device, presence), except that ``-0.0 == +0.0``
    in a floating-point tensor (docs/budgets.md). Returns 0.0 or raises."""
    if not check_same_presence(name, actual, expected):
        return 0.0
    assert actual is not None and expected is not None  # narrowed by check_same_presence
    if actual.dtype != expected.dtype:
        raise BudgetViolation(name, f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    if actual.device != expected.device:
        raise BudgetViolation(name, f"{name}: device {actual.device}, expected {expected.device}")
    a, e = actual.detach().contiguous(), expected.detach().contiguous()
    ibits = _INT_VIEW[a.element_size()]
    differ = a.view(ibits) != e.view(ibits)
    if a.is_floating_point():
        differ &= ~((a == 0) & (e == 0))
    if not bool(differ.any()):
        return 0.0
    diff = (a.double() - e.double()).abs()
    # Worst finite difference first; a NaN payload mismatch still gets an index.
    scored = torch.where(differ, torch.nan_to_num(diff, nan=math.inf, posinf=math.inf), -1.0)
    idx = _fmt_index(int(scored.flatten().argmax()), a.shape)
    raise BudgetViolation(
        name,
        f"{name}: not bitwise identical: {int(differ.sum())} of {a.numel()} elements differ; "
        f"worst at index {idx}: got {_scalar(a, idx)!r}, expected {_scalar(e, idx)!r} "
        "(budget: rtol=0, atol=0)",
    )


def check_error_budget(
    name: str,
    actual: torch.Tensor | None,
    truth: torch.Tensor | None,
    naive: torch.Tensor | None,
    budget: ErrorBudget,
    dtype: torch.dtype | None = None,
    module_dtype: torch.dtype | None = None,
    naive_error: float | None = None,
    note: str = "",
    element_floor: torch.Tensor | None = None,
    floor_magnitude: float | None = None,
) -> float:
    """Tier 2: ``actual`` against the float64 ``truth``, relative to ``naive``'s own error;
    ``dtype`` sets the floor's rounding step (default: ``actual``'s), ``module_dtype`` the
    multiplier (default: ``dtype``); ``naive_error`` replaces ``max|naive - truth|``;
    ``element_floor`` (truth's shape) adds to the budget per element; ``floor_magnitude`` as in
    :func:`_floor`; ``note`` ends a failure message. Returns worst error / budget or raises."""
    if not check_same_presence(name, actual, truth):
        return 0.0
    if naive is None:
        raise BudgetViolation(name, f"{name}: the naive reference produced no tensor to compare")
    assert actual is not None and truth is not None  # narrowed by check_same_presence
    if naive.shape != truth.shape:
        raise BudgetViolation(
            name, f"{name}: naive shape {tuple(naive.shape)} != {tuple(truth.shape)}"
        )
    dtype = dtype or actual.dtype
    multiplier = budget.multiplier_for(module_dtype or dtype)
    t, a, n = _f64(truth), _f64(actual), _f64(naive)
    if t.numel() == 0:
        return 0.0
    err = _abs_err(a, t)
    naive_err = float((n - t).abs().max()) if naive_error is None else naive_error
    floor_steps, magnitude, floor = _floor(budget, t, dtype, module_dtype or dtype, floor_magnitude)
    allowed = multiplier * naive_err + floor
    extra = torch.zeros_like(t) if element_floor is None else element_floor.double().cpu()
    flat, ratio = _worst(err / (allowed + extra))
    worst = float(err.flatten()[flat])
    if not ratio <= 1.0:
        idx = _fmt_index(flat, t.shape)
        operand = "" if element_floor is None else f" + operand allowance {float(extra[idx]):.4g}"
        raise BudgetViolation(
            name,
            f"{name}: worst error {worst:.4g} at index {idx}: got {_scalar(a, idx)!r}, "
            f"truth {_scalar(t, idx)!r} (naive {_scalar(n, idx)!r}); budget "
            f"{allowed + float(extra[idx]):.4g} = {multiplier} x naive error {naive_err:.4g} + "
            f"{floor_steps} rounding step of {dtype} at {magnitude:.4g} ({floor:.4g})"
            f"{operand}; ratio {ratio:.3g} [{budget.kind} budget]{note}",
            ratio,
        )
    return ratio


def check_fp8_budget(
    name: str,
    actual: torch.Tensor | None,
    truth: torch.Tensor | None,
    naive: torch.Tensor | None,
    budget: Fp8Budget = FP8,
    dtype: torch.dtype | None = None,
    module_dtype: torch.dtype | None = None,
    recipe: str = "",
    fp8_eps: float = 2.0**-3,
    samples: int | None = None,
    bound: torch.Tensor | None = None,
    naive_truth: torch.Tensor | None = None,
) -> float:
    """Both gates of :class:`Fp8Budget`; returns the larger ratio or raises naming the gate.
    ``fp8_eps``: the coarsest FP8 format's epsilon on the tensor's way; ``samples``: the
    independent quantizations its statistics average over (default: its element count);
    ``bound``: how far two correct FP8 runs can be apart, per element (each gate also admits the
    naive error plus it); ``naive_truth``: what the naive run is measured against (default
    ``truth``). ``module_dtype`` is accepted for symmetry with :func:`check_error_budget`."""
    del module_dtype
    if not check_same_presence(name, actual, truth):
        return 0.0
    if naive is None or naive.shape != truth.shape:
        raise BudgetViolation(
            name, f"{name}: the naive FP8 reference produced no comparable tensor"
        )
    assert actual is not None and truth is not None  # narrowed by check_same_presence
    if truth.numel() == 0:
        return 0.0
    if naive_truth is not None and naive_truth.shape != truth.shape:
        raise BudgetViolation(
            name,
            f"{name}: the naive run's truth has shape {tuple(naive_truth.shape)}, "
            f"expected {tuple(truth.shape)}",
        )
    b, dtype = budget, dtype or actual.dtype
    tag = f"[{b.kind} budget{', ' + recipe if recipe else ''}]"
    t, a, n = _f64(truth), _f64(actual), _f64(naive)
    nt = t if naive_truth is None else _f64(naive_truth)
    n_eff = t.numel() if samples is None else max(1, min(samples, t.numel()))
    small = b.small_tensor_steps * fp8_eps / math.sqrt(n_eff)
    bound = None if bound is None else _f64(bound).expand_as(t)
    # The element-wise gate.
    err = _abs_err(a, t)
    naive_err = float((n - nt).abs().max())
    magnitude = float(t.abs().max())
    floor = b.floor_steps * rounding_step(dtype, magnitude) + small * magnitude
    allowed_t = torch.full_like(err, b.multiplier * naive_err + floor)
    if bound is not None:
        allowed_t = torch.maximum(allowed_t, b.multiplier * naive_err + bound)
    flat, ratio = _worst(err / allowed_t)
    if not ratio <= 1.0:
        idx = _fmt_index(flat, t.shape)
        crossing = ""
        if bound is not None:
            crossing = f"; FP8 crossing bound there {float(bound.flatten()[flat]):.4g}"
        raise BudgetViolation(
            name,
            f"{name}: worst error {float(err.flatten()[flat]):.4g} at index {idx}: got "
            f"{_scalar(a, idx)!r}, truth {_scalar(t, idx)!r} (naive FP8 "
            f"{_scalar(n, idx)!r}); element-wise budget "
            f"{float(allowed_t.flatten()[flat]):.4g} = {b.multiplier} x naive error "
            f"{naive_err:.4g} + the larger of {b.floor_steps} rounding steps of {dtype} at "
            f"|truth| {magnitude:.4g} + small-tensor {small:.3g} x |truth|{crossing}; "
            f"ratio {ratio:.3g} {tag}",
            ratio,
        )
    whole = _fp8_whole_tensor_gate(name, a, t, n, nt, err, b, dtype, small, bound, tag)
    return max(ratio, whole)


def _fp8_whole_tensor_gate(name, a, t, n, nt, err, b, dtype, small, bound, tag) -> float:
    """The whole-tensor gate of :func:`check_fp8_budget`: the relative error over the tensor
    within a multiple of the naive run's, plus a floor; returns the ratio or raises."""
    norm_t = float(t.norm())
    if norm_t == 0.0:
        return 0.0
    rel = float((a - t).norm()) / norm_t
    norm_nt = float(nt.norm())
    rel_naive = float((n - nt).norm()) / norm_nt if norm_nt else 0.0
    eps = torch.finfo(dtype).eps
    allowed = b.norm_multiplier * rel_naive + b.norm_floor_steps * eps + small
    if bound is not None:
        allowed = max(allowed, b.norm_multiplier * rel_naive + float(bound.norm()) / norm_t)
    whole = rel / allowed
    if not whole <= 1.0:
        idx = _fmt_index(int(err.flatten().argmax()), t.shape)
        raise BudgetViolation(
            name,
            f"{name}: relative error ||got - truth|| / ||truth|| = {rel:.4g} over the whole "
            f"tensor, naive FP8 {rel_naive:.4g}; whole-tensor budget {allowed:.4g} = "
            f"{b.norm_multiplier} x naive + {b.norm_floor_steps} eps of {dtype} + "
            f"small-tensor {small:.3g}; ratio {whole:.3g} (worst element {idx}: got "
            f"{_scalar(a, idx)!r}, truth {_scalar(t, idx)!r}, naive {_scalar(n, idx)!r}) "
            f"{tag}",
            whole,
        )
    return whole


def gradcheck_reference(config, seed: int = 0, rows: int = 3, backend=None) -> None:
    """Tier 3: the reference's hand-written backward in float64 against finite differences:
    ``torch.autograd.gradcheck`` for the input gradient, central differences of
    ``L = sum(y * dy)`` per parameter element for the gradients the module writes itself.
    Raises :class:`BudgetViolation`; ``backend`` defaults to the reference. Keep shapes tiny."""
    from .backends import get_backend
    from .cases.data import make_state

    config = dataclasses.replace(config, dtype="float64", autocast=None)
    backend = backend or get_backend("reference")
    splits = None
    if config.kind == "GroupedLinear":
        base, extra = divmod(rows, config.num_gemms)
        splits = tuple(base + (i < extra) for i in range(config.num_gemms))
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, config.in_features, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, config.output_features, generator=g, dtype=torch.float64)
    module = backend.build(config, delay=False)
    backend.load_state(module, make_state(config, seed))
    params = backend.parameters(module)
    weights = set(backend.gemm_weight_names(module)) if config.fuse_wgrad_accumulation else set()

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return backend.forward(module, x, splits, None)

    x = x0.clone().requires_grad_(True)
    tol = {"eps": GRADCHECK_EPS, "atol": GRADCHECK_ATOL, "rtol": GRADCHECK_RTOL}
    for name in weights:
        params[name].main_grad = torch.zeros_like(params[name], dtype=torch.float64)
    if not torch.autograd.gradcheck(fwd, (x,), raise_exception=False, **tol):
        raise BudgetViolation(
            "x.grad", f"gradcheck of the input gradient failed for {config.label()}"
        )
    for name, p in params.items():
        p.grad = None
        if name in weights:
            p.main_grad.zero_()  # gradcheck's own backward calls accumulated into it
    backend.forward(module, x0.clone().requires_grad_(True), splits, None).backward(dy)
    for name, p in params.items():
        analytic = p.main_grad if name in weights else p.grad
        if analytic is None:
            raise BudgetViolation(name, f"{name}: no gradient written by the float64 reference")
        flat = p.data.view(-1)
        for i in range(flat.numel()):
            orig = float(flat[i])
            with torch.no_grad():
                flat[i] = orig + GRADCHECK_EPS
                up = float((fwd(x0) * dy).sum())
                flat[i] = orig - GRADCHECK_EPS
                down = float((fwd(x0) * dy).sum())
                flat[i] = orig
            numeric = (up - down) / (2 * GRADCHECK_EPS)
            got = float(analytic.reshape(-1)[i])
            if abs(got - numeric) > GRADCHECK_ATOL + GRADCHECK_RTOL * abs(numeric):
                raise BudgetViolation(
                    name,
                    f"{name}: analytic gradient {got!r} at index {_fmt_index(i, p.shape)} vs "
                    f"finite difference {numeric!r} (atol {GRADCHECK_ATOL}, rtol "
                    f"{GRADCHECK_RTOL}) for {config.label()}",
                )
