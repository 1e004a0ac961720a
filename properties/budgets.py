"""The three tiers of oracle, and the only home of every tolerance in the harness.

1. **Bitwise** (:func:`check_bitwise`): delayed ≡ non-delayed, ``GroupedLinear`` ≡ ``Linear``\\ s
   on the same kernel. ``rtol=0, atol=0``, compared on the bit patterns, with one stated
   exception: in a floating-point tensor ``-0.0`` and ``+0.0`` are the same value (see
   :func:`check_bitwise`); NaN payloads and every non-zero bit pattern count.
2. **Error budget** (:func:`check_error_budget`): an implementation's error against the float64
   truth may be at most ``multiplier`` times the naive low-precision reference's own error, plus
   ``floor_steps`` rounding steps of the compared tensor's dtype at the truth's largest magnitude:

       max|actual - truth| <= multiplier * max|naive - truth|
                              + floor_steps * eps(dtype) * max|truth|

   One budget per kind of tensor (outputs, dgrad, wgrad, norm-parameter gradients), because they
   round at different places (see below).
3. **float64 gradcheck of the reference** (:func:`gradcheck_reference`): the reference's
   hand-written backward against finite differences.

Every failure raises :class:`BudgetViolation` (an ``AssertionError``, so hypothesis shrinks on
it) whose message names the tensor, the worst index, both values and the budget.
"""

from __future__ import annotations

import dataclasses
import math

import torch

__all__ = [
    "BudgetViolation",
    "ErrorBudget",
    "OUTPUT",
    "DGRAD",
    "WGRAD",
    "NORM_GRAD",
    "GROUPED_GEMM",
    "SECOND_ORDER",
    "BUDGETS",
    "GRADCHECK_EPS",
    "GRADCHECK_ATOL",
    "GRADCHECK_RTOL",
    "rounding_step",
    "check_bitwise",
    "check_same_presence",
    "check_error_budget",
    "gradcheck_reference",
    "Fp8Budget",
    "FP8",
    "check_fp8_budget",
    "FP8_MAX",
    "FP8_EPS",
    "FP8_SUBNORMAL_STEP",
    "fp8_step",
    "accumulation_magnitude",
    "WGRAD_OPERAND_STEPS",
    "DGRAD_OPERAND_STEPS",
    "DGRAD_OPERAND_SIGMAS",
    "KINK_ROUNDING_STEPS",
    "KINK_MAX_ENUMERATED",
    "kink_bound",
    "fp8_kink_bound",
    "FP8_KINK_MAX_SITES",
    "FP8_KINK_PAIRS_UP_TO",
    "FP8_KINK_SWITCH_STEPS",
    "FUSED_ACCUMULATION_STEPS",
    "fused_accumulation_tolerance",
    "DATA_PARALLEL_MULTIPLIER",
    "DATA_PARALLEL_FLOOR_STEPS",
    "data_parallel_tolerance",
    "chained",
    "unit_roundoff",
    "sum_gamma",
    "with_rounding_bound",
    "ROUNDING_SIGMAS",
    "ACTIVATION_EVAL_STEPS",
]


class BudgetViolation(AssertionError):
    """A comparison failed. ``ratio`` is worst error / budget (``inf`` for bitwise mismatches,
    missing tensors, or shape/dtype differences)."""

    def __init__(self, tensor: str, message: str, ratio: float = math.inf) -> None:
        super().__init__(message)
        self.tensor = tensor
        self.ratio = ratio


@dataclasses.dataclass(frozen=True)
class ErrorBudget:
    """``max|actual - truth| <= multiplier * max|naive - truth| + floor_steps * eps * max|truth|``.

    ``why`` says where the implementation and the naive reference may round differently — the
    reason this entry is looser than bitwise.
    """

    kind: str
    multiplier: float
    floor_steps: float
    why: str
    fp32_multiplier: float | None = None
    fp32_why: str = ""
    fp32_floor_steps: float | None = None

    def multiplier_for(self, dtype: torch.dtype) -> float:
        """The multiplier for a module computing in ``dtype``."""
        if dtype == torch.float32 and self.fp32_multiplier is not None:
            return self.fp32_multiplier
        return self.multiplier

    def floor_steps_for(self, dtype: torch.dtype) -> float:
        """Rounding steps of the floor for a module computing in ``dtype``."""
        if dtype == torch.float32 and self.fp32_floor_steps is not None:
            return self.fp32_floor_steps
        return self.floor_steps


_FP32_NOISE = (
    "in float32 nothing is rounded to a narrower type, so both errors are pure reduction-order "
    "noise of a few ulps; the naive run's maximum over a tensor of a handful of elements is a "
    "noisy yardstick (measured: impl/naive error ratios up to ~{x} on small float32 cases), and "
    "each of up to four chained float32 ops (norm, fc1, activation, fc2) may round at another "
    "point than the reference, one step each: hence a 4-step floor"
)
_FP32_FLOOR = 4.0

# Outputs: one GEMM (fp32 accumulate, one rounding), then the bias add rounds again in the
# reference; a fused epilogue rounds once, a different norm kernel sums in another order.
OUTPUT = ErrorBudget(
    "output",
    2.0,
    1.0,
    "an implementation may fuse the bias add into the GEMM epilogue (one rounding instead of "
    "the reference's two) or reduce the norm statistics in another order",
    fp32_multiplier=4.0,
    fp32_floor_steps=_FP32_FLOOR,
    fp32_why=_FP32_NOISE.format(x=8),
)
# dgrad: reduces over the output features only (short sums), chained through the norm
# backward for LayerNorm modules; same rounding points as the forward.
DGRAD = ErrorBudget(
    "dgrad",
    2.0,
    1.0,
    "dgrad GEMMs may block the reduction over output features differently, and a fused norm "
    "backward rounds its intermediate sums at other points than the reference's formulas",
    fp32_multiplier=8.0,
    fp32_floor_steps=_FP32_FLOOR,
    fp32_why=_FP32_NOISE.format(x=4) + "; the norm backward is a difference of terms larger "
    "than the result, so that noise is relatively large",
)
# wgrad reduces over every token of the micro-batch, so blocking/ordering differences grow with
# the token count; llm.c and TE's tests likewise allow parameter gradients more slack.
WGRAD = ErrorBudget(
    "wgrad",
    4.0,
    2.0,
    "wgrad and bias gradients reduce over all tokens; a GEMM kernel that splits that reduction "
    "(split-K, or accumulating straight into fp32 main_grad) sums in a different order; and the "
    "saved operands (norm output, activation) are themselves rounded to the module dtype, where "
    "a legal one-step difference in the forward moves dW by about one more step (measured: "
    "1.7 bf16 steps on a LayerNormMLP fc2_weight.grad whose naive error was 0.17 step)",
    fp32_multiplier=8.0,
    fp32_floor_steps=_FP32_FLOOR,
    fp32_why=_FP32_NOISE.format(x=4),
)
# Norm-parameter gradients are token reductions as well (sum over rows of dy * xhat).
NORM_GRAD = ErrorBudget(
    "norm_grad",
    4.0,
    1.0,
    "gamma/beta gradients are reductions over all tokens, done by a fused kernel in partial "
    "sums per block rather than the reference's single torch.sum",
    fp32_multiplier=8.0,
    fp32_floor_steps=_FP32_FLOOR,
    fp32_why=_FP32_NOISE.format(x=5.5),
)
# P12 when GroupedLinear uses a grouped GEMM kernel and the Linears a plain GEMM: the naive side
# is the list of Linears itself.
GROUPED_GEMM = ErrorBudget(
    "grouped_gemm",
    2.0,
    1.0,
    "a grouped GEMM kernel tiles each group's GEMM differently from the single-GEMM kernel a "
    "Linear uses; both round their fp32 accumulation once to the output dtype",
)

# P18: gradients of gradients (create_graph=True, gradgradcheck's pattern). A second-order
# result runs the backward's formulas once more on the first-order results: the dgrad and wgrad
# GEMMs again, and for the norm modules the norm backward's own derivative, a difference of
# terms larger than the result. An implementation that differentiates a torch.nn.functional
# twin (impl) rounds at other points than the reference's hand-written formulas all along that
# chain, twice as many as in a first-order result.
SECOND_ORDER = ErrorBudget(
    "second_order",
    4.0,
    2.0,
    "a second derivative runs the backward's GEMMs and the norm backward's derivative on "
    "first-order results that are themselves rounded: twice the rounding points of a "
    "first-order gradient, each of which an implementation may place elsewhere (a fused "
    "kernel, torch's own norm backward) than the reference's formulas",
    fp32_multiplier=8.0,
    fp32_floor_steps=2 * _FP32_FLOOR,
    fp32_why=_FP32_NOISE.format(x=4) + "; a second derivative chains twice as many of them",
)

BUDGETS = {b.kind: b for b in (OUTPUT, DGRAD, WGRAD, NORM_GRAD, GROUPED_GEMM, SECOND_ORDER)}


def chained(budget: ErrorBudget, uses: int) -> ErrorBudget:
    """``budget`` for a module applied ``uses`` times in a row (P7's chained variant, ``m(m(x))``):
    the floor counts rounding points along the chain of ops (the fp32 floor: one step for each
    of up to four chained ops), and the chain has ``uses`` times as many."""
    if uses == 1:
        return budget
    fp32 = budget.fp32_floor_steps
    return dataclasses.replace(
        budget,
        floor_steps=budget.floor_steps * uses,
        fp32_floor_steps=None if fp32 is None else fp32 * uses,
        why=f"{budget.why}; the module runs {uses} times in a row, so {uses}x the rounding points",
    )


def accumulation_magnitude(truth: torch.Tensor, prefill: torch.Tensor) -> float:
    """The magnitude whose fp32 rounding steps make main_grad's floor: ``max(|truth|, |prefill|,
    |truth - prefill|)``, not ``|truth|`` alone. ``main_grad += dW`` rounds at the size of its
    operands, and where the prefill and the contribution nearly cancel, |truth| is far smaller
    than either (found by splitgrad verify on impl under FP8: a 1x1 Linear's main_grad of 0.028
    one rounding of its ~1.0-sized operands off, where the reference happened to be exact)."""
    t, p = truth.detach().double().cpu(), prefill.detach().double().cpu()
    return float(torch.stack([t.abs().max(), p.abs().max(), (t - p).abs().max()]).max())


# Fused accumulation inside the GEMM (SPEC §3: "no weight-sized temporary"): impl runs
# ``main_grad.addmm_(dy^T, x)``, so G0 enters the kernel's fp32 reduction instead of being added
# to a rounded product afterwards, and the kernel decides where in its K-blocked sum it adds G0.
# Measured: bit-identical to ``G0 + mm`` on an Intel Xeon (MKL), up to 1.2 fp32 steps of
# max(|G0| + |g|) off on an AMD EPYC with the same torch 2.13 wheel (tests/test_contract_split.py,
# 7-token micro-batches). Both orders are one fp32 reduction of the same terms; 4 steps leaves
# room for longer reductions while a contribution added in bf16 (2**-8) or dropped fails at once.
FUSED_ACCUMULATION_STEPS = 4.0


def fused_accumulation_tolerance(start: torch.Tensor, contribution: torch.Tensor) -> float:
    """How far ``main_grad`` after one fused accumulation may be from ``start + contribution``
    (both fp32): :data:`FUSED_ACCUMULATION_STEPS` fp32 steps of
    ``max(|start| + |contribution|)``."""
    size = float((start.detach().double().abs() + contribution.detach().double().abs()).max())
    return FUSED_ACCUMULATION_STEPS * rounding_step(torch.float32, size)


# Fused weight gradients (main_grad) whose GEMM operands the module computes (LayerNormLinear:
# ln_out; LayerNormMLP: ln_out, the activation output, d_fc1) get a per-element allowance on top
# of WGRAD: each such operand is rounded to the module dtype on both sides, and an
# implementation that computes it a step differently (impl's fc1 rounds its fused bias add once
# where the reference rounds twice, so its activation can land on the other neighbour) changes
# dW_ij = sum_n dy_ni a_nj by up to eps(dtype) * sum_n |dy_ni| |a_nj| per computed operand.
# WGRAD's floor covers that in .grad (steps of the module dtype) but not in main_grad, whose
# floor is fp32 steps (found by splitgrad verify: fc2_weight.main_grad of a one-token swiglu MLP
# 1.15x its budget, impl's act one bf16 step from the reference's). Per element, so an element
# with small operands keeps a tight budget, and Linear/GroupedLinear (operands are the inputs:
# bit-identical) get none (a main_grad accumulated in bf16 fails there at once). Cost in
# sensitivity (tests/test_budgets_meta.py): a systematic error in fc2's main_grad contribution
# is still caught from 2% (gelu) and 5-8% (swiglu; 3-5% without the allowance).
WGRAD_OPERAND_STEPS = 1.0
# The same for LayerNormMLP's input and norm gradients under a smooth activation: dgrad runs
# through act'(h) (and act(a) for gated ones) at the saved pre-activation h. A correct run may
# hold h a rounding away from the reference's: impl's fc1 rounds GEMM + bias once, the reference
# rounds the GEMM and then the sum, so |h_impl - h_ref| <= eps * (1.5 |h| + 0.5 |b1|) (half a
# step of the GEMM result, one of h), taken DGRAD_OPERAND_STEPS times. What that moves each
# d_fc1 element by is measured with finite differences of the reference's own activation
# backward (every sign); the moves go through the exact Jacobian of W1 and the norm backward
# (the projection's cancellations included) into dx and the norm gradients. Their signs are
# independent rounding accidents, so they add as a root sum of squares, times
# DGRAD_OPERAND_SIGMAS. Measured on 6-feature MLPs: ~1 bf16 step of max|dx| for gelu, 4-7 for
# swiglu/geglu (whose second half depends on act(a) itself); a systematic error in dx is still
# caught from 2-3% (gelu) and 5% (gated) on (tests/test_budgets_meta.py). Found by splitgrad
# verify: impl's dx 1.09x / 1.11x the dgrad budget on swiglu/geglu MLPs in bf16/fp16, about once
# in 700-2000 examples. ln_out itself is an fp32 result rounded once on both sides and differs
# only when it straddles a rounding boundary within fp32 noise, which nothing here models.
DGRAD_OPERAND_STEPS = 1.0
DGRAD_OPERAND_SIGMAS = 2.0

# ---- FP8 (SPEC §6) ------------------------------------------------------------------------
#
# Yardstick: the naive run is the reference under the same recipe in the same dtype.
#
# Truth, per compared tensor, chosen by where the two sides can quantize different values:
#
# * Every quantized operand on the tensor's way is a module input, a parameter or dy (Linear,
#   GroupedLinear; LayerNormLinear's dgrad and norm gradients; any bias gradient): impl, the
#   naive run and the float64 run *under the same recipe* quantize bit-identical values with
#   bit-identical scales (P13 pins the quantizers; the amax histories only see those inputs), so
#   the truth is that float64 run: the same FP8 operands, then exact GEMMs. What is left between
#   the sides is how each GEMM accumulates and rounds: the reference dequantizes (data *
#   scale_inv, rounded to fp32 per operand) and runs an fp32 GEMM; impl may multiply FP8 values
#   exactly and apply the scales once after an fp32 accumulation in another order (a scaled FP8
#   GEMM). Both are fp32 reductions of the same products, rounded once to the output dtype, so
#   the high-precision budgets above apply unchanged (OUTPUT, DGRAD, WGRAD, NORM_GRAD: bf16
#   output rounding dominates; in fp32 their reduction-order noise budgets are exactly this
#   case), with main_grad's floor taken at the size of the accumulation's operands
#   (accumulation_magnitude: impl folds the scales into its GEMM's alpha and accumulates into
#   main_grad in one addmm, so it rounds where the reference's dequantized products happened to
#   be exact). Against the high-precision truth instead, FP8's own error (2**-4 relative per E4M3
#   operand) would be the yardstick, and a quantizer feeding the wrong copy, or a scale off by a
#   few percent, would hide inside it (meta-tests in tests/test_fp8_budgets_meta.py).
# * Some quantized operand is computed by the module (a norm output, an activation, d_fc1):
#   impl's norm/activation kernels may round it a step differently, and a one-step difference
#   moves the value across an FP8 rounding boundary (one E4M3 step is 16 bf16 steps) with a
#   probability of about 1/16 per element, and also moves the amax, hence the scale, of the
#   whole tensor. Then the FP8 truth is no tighter than the high-precision one, so the truth is
#   the reference *without* FP8 in float64 and the budget is FP8 below: an element-wise gate
#   (as the high-precision budgets, with the naive FP8 error as yardstick) and a whole-tensor
#   gate on the relative norm of the error, ``||a - t|| / ||t|| <= norm_multiplier *
#   ||n - t|| / ||t|| + norm_floor_steps * eps(dtype)``: the element-wise maximum of FP8 noise
#   is dominated by a few elements and is noisy, so it needs a loose multiplier, while the norm
#   averages over every element and catches a small systematic error (a scale off by a few
#   percent) that no single element shows.
#
# relu under FP8 (properties/kink.py): the band of ambiguous pre-activations is an FP8 step of
# fc1's operands wide (fp8_kink_bound), about a quarter of them, so enumerating every relu'
# choice (KINK_MAX_ENUMERATED) would reject nearly every example. The naive FP8 run flips
# relu' within the band too, so its error against the truth already contains flips, and the
# budget below compares with it as it is (the yardstick stays the naive run against the truth
# itself, never against a candidate). That evens out over a tensor of many elements, not over
# two or three: a 2-row MLP whose impl flipped one pre-activation the naive run did not moved
# fc1_bias.grad by 0.88 (1.14x over; nightly on impl). So the candidate truths are the truth,
# then the truth with one band site's relu' switched, then with two (at most
# FP8_KINK_PAIRS_UP_TO sites); the first one within budget is taken. Past FP8_KINK_MAX_SITES
# sites the truth alone is the candidate (statistics carry there; nothing is rejected).
FP8_KINK_MAX_SITES = 64
FP8_KINK_PAIRS_UP_TO = 16
# A switched site's change is computed in float64 from the high-precision intermediates; the
# FP8 run computes it from quantized operands (d_act from an FP8 GEMM, then d_fc1 quantized,
# W1 / ln_out quantized), so where a candidate switches, each compared element's bound gains
# this many FP8 steps (of the coarsest format on the tensor's way) of the switched change.
FP8_KINK_SWITCH_STEPS = 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Budget:
    """Two gates, both must hold (errors against the high-precision float64 truth ``t`` of a
    tensor of ``numel`` elements; ``n`` the naive FP8 reference, ``a`` the implementation)::

        max|a - t|        <= multiplier * max|n - t|
                             + (floor_steps * eps(dtype) + small) * max|t|
        ||a - t|| / ||t|| <= norm_multiplier * ||n - t|| / ||t||
                             + norm_floor_steps * eps(dtype) + small
        small = small_tensor_steps * eps(fp8 format) / sqrt(n)

    ``small``: both gates compare statistics of two FP8 errors over the tensor, and a tensor of a
    few elements has no statistics: there one FP8 rounding-boundary crossing of a computed operand
    (the legal difference, see above) moves an element by up to an FP8 step of its size while the
    naive run's error may be near zero by chance. The allowance shrinks with the square root of
    the number ``n`` of independent quantizations the statistics average over (how their spread
    shrinks): the element count, but no more than the module's smallest GEMM dimension (a
    one-wide ffn or a single token makes every element of a tensor hang on the same one or two
    quantized values: found by splitgrad verify on impl, an 18x1 swiglu MLP 1.08x over with the
    element count). ``eps(fp8 format)`` is E4M3's 2**-3 (E5M2's 2**-2 for gradients under HYBRID).
    """

    kind: str
    multiplier: float
    floor_steps: float
    norm_multiplier: float
    norm_floor_steps: float
    small_tensor_steps: float
    why: str


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
    "partly different places, compounded through LayerNormMLP's two quantized GEMMs. Measured "
    "on 500 drawn examples x P1-P3 each: impl (cf93f07) raw ratios up to 2.4 element-wise and "
    "1.76 on the norm (bf16, current scaling, small tensors), at most 0.66 of this budget; a "
    "surrogate (tests/fp8_doubles.py: norm and activation outputs a step off on 25% / 50% of "
    "the elements, exact-product GEMMs, 800 examples) at most 0.86 / 0.81 of it",
)

# The relu kink (LayerNormMLP, activation="relu"; see properties/kink.py). relu' jumps at 0, so
# where the float64 truth of an fc1 pre-activation h lies within the rounding distance of 0 that a
# correct low-precision run can have, either derivative is legal and flips a gradient by O(1).
# That distance, per element: the norm output is rounded to the dtype (half a step of |ln_out|) and
# an implementation's norm kernel may be a step or two further off; fc1's GEMM accumulates in
# fp32 (at most K * eps32 of sum |ln_out| |W1| in any order) and rounds its result once or twice
# (half a step each, of at most sum |ln_out| |W1| + |b1|). That is 2.5 steps of
# sum_k |ln_out_k| |W1_jk| + |b1_j| plus the accumulation term; KINK_ROUNDING_STEPS takes 4 (bf16,
# fp16), and 16 in float32, where each of the norm's chained fp32 ops may be a step off (impl's
# fp32 LayerNorm output was measured 7 steps off) and the band is still ~1e-6 relative wide.
KINK_ROUNDING_STEPS = {torch.bfloat16: 4.0, torch.float16: 4.0, torch.float32: 16.0}
# At most 2**3 candidate truths are tried; an example with more ambiguous pre-activations is
# rejected (hypothesis does not count it), which happens for about 1 in 12 bf16 relu examples.
KINK_MAX_ENUMERATED = 3


def kink_bound(
    ln_out: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Per fc1 pre-activation (N, F): how far from its float64 truth a correct ``dtype`` run may
    compute it, ``(steps * eps(dtype) + K * eps(fp32)) * (|ln_out| @ |W1|^T + |b1|)`` (float64
    operands; see :data:`KINK_ROUNDING_STEPS`)."""
    k = ln_out.shape[-1]
    scale = KINK_ROUNDING_STEPS[dtype] * torch.finfo(dtype).eps + k * torch.finfo(torch.float32).eps
    size = ln_out.abs() @ w1.abs().t()
    if b1 is not None:
        size = size + b1.abs()
    return scale * size


def fp8_kink_bound(
    recipe: str, ln_outs: list[torch.Tensor], w1: torch.Tensor, bounds: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Per micro-batch, the band of fc1 pre-activations (N, F) whose ``relu'`` an FP8 run under
    ``recipe`` may legally take on either side: the high-precision band ``bounds``
    (:func:`kink_bound`) plus ``ROUNDING_SIGMAS`` root sums of squares of one FP8 step per
    operand element, ``sqrt(step(ln_out)**2 @ (W1**2)^T + ln_out**2 @ step(W1)**2^T)``. A
    correct run's fc1 GEMM sees each operand element up to half a step from its value
    (quantization) and, where the module computes it (``ln_out``), possibly on the neighbouring
    FP8 value (a crossing: half a step more); the signs are independent (the rounding model of
    "the rounding bound" below). The step's subnormal floor is taken at the largest scale the
    recipe can use: twice the amax-based one (block scales round to a power of two), and at
    least 1 for delayed scaling (its initial scale)."""
    from splitgrad.reference import fp8 as R
    from splitgrad.reference.fp8_quant import format_for

    from .strategies import make_recipe

    r = make_recipe(recipe)
    margin = getattr(r, "margin", 0)
    delayed = isinstance(r, R.DelayedScaling)

    def scale_inv(amax: float, role: str) -> float:
        s = 2.0 * amax * 2.0**margin / FP8_MAX[format_for(r, role)]
        return max(s, 1.0) if delayed else s

    nonempty = [x for x in ln_outs if x.numel()]
    amax_ln = max((float(x.abs().max()) for x in nonempty), default=0.0)
    w_step = fp8_step(w1, format_for(r, "weight"), scale_inv(float(w1.abs().max()), "weight"))
    out = []
    for ln, hp in zip(ln_outs, bounds):
        if ln.numel() == 0:
            out.append(hp)
            continue
        ln_step = fp8_step(ln, format_for(r, "input"), scale_inv(amax_ln, "input"))
        rss = (ln_step**2 @ (w1**2).t() + ln**2 @ (w_step**2).t()).sqrt()
        out.append(hp + ROUNDING_SIGMAS * rss)
    return out


# ---- the rounding bound: sound for any summation order -----------------------------------
#
# The error budgets above compare with the naive run's error (one sample) and a floor of a few
# steps at max|truth|. Where a tensor is a difference of much larger terms (a tied chain's input
# gradient made of O(1) products, a LayerNorm row whose mean dwarfs its spread, a row of 4
# features), or where one module feeds itself (P7's m(m(x)): a legal one-step difference in the
# first output is amplified by the second use's norm), that floor is far below what rounding
# can do, and correct runs failed at 500 examples per cell. So every high-precision comparison
# also gets a per-element rounding bound (properties/internals.py: rounding_bounds), propagated
# along the reference's formulas in float64 from the case's own values:
#
# * Reductions, worst case for ANY order (split-K, pairwise, blocked, atomics): Higham's
#   sum_gamma(k, u) = k u / (1 - k u) times the sum of the terms' absolute values, per GEMM
#   output element, per bias/norm-parameter sum, per row mean; carried to later results
#   linearly through |J| (``w``). This is what a GPU kernel's reduction order can change, and it
#   does not depend on the order, so no retuning.
# * Roundings of stored results (the module dtype: GEMM outputs, bias sums, ln_out, the
#   activation, d_act, d_fc1, dx) and of fp32 elementwise operations (half an ulp of the value
#   each): these sit at the same points whatever the kernel, and their signs are independent
#   rounding accidents, so they add as a root sum of squares (``s``, carried through J**2),
#   taken ROUNDING_SIGMAS times (the probabilistic model of Higham & Mary, 2019: lambda sqrt(n) u
#   holds with a probability that grows fast with lambda).
# * LayerNorm's conditioning follows from its formulas: the mean's summation error enters
#   x - mean whole and is multiplied by rstd (bound ~ u (|x| + |mean|) / std), and rstd's error
#   comes from var's through -rstd^3 / 2.
# * relu' is taken on the truth's side (the kink is properties/kink.py's business).
#
# The budget is then, per element,
#
#     |actual - truth| <= multiplier * naive error + max(floor [+ operand allowance], bound)
#
# so it never loosens where the old floor was already the larger. First order: products of
# two errors (~u^2) are dropped.
ROUNDING_SIGMAS = 2.0
# An activation formula (tanh-GELU, SiLU and their derivatives: a handful of fp32 operations on
# terms of about |h|) is taken as this many compute-dtype roundings of |h| + |f(h)|.
ACTIVATION_EVAL_STEPS = 8.0


def unit_roundoff(dtype: torch.dtype) -> float:
    """Round-to-nearest unit roundoff of ``dtype``: half its epsilon."""
    return torch.finfo(dtype).eps / 2


def sum_gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: a sum of ``k`` terms in any order, with unit
    roundoff ``u``, is within ``gamma_k * sum|terms|`` of the exact sum. Raises for ``k u >= 1``
    (no bound exists)."""
    if k * u >= 1.0:
        raise ValueError(f"sum_gamma: no rounding bound for a sum of k={k} terms at u={u}")
    return k * u / (1.0 - k * u)


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
    ``multiplier * naive + max(floor + element_floor, bound)`` (see "the rounding bound";
    ``bound`` from :func:`~.internals.rounding_bounds`, truth's shape)."""
    if bound is None or truth is None or truth.numel() == 0 or bound.shape != truth.shape:
        return element_floor
    t = truth.detach().double().cpu()
    size = float(t.abs().max())
    if floor_magnitude is not None:
        size = max(size, floor_magnitude)
    floor = budget.floor_steps_for(module_dtype or dtype) * rounding_step(dtype, size)
    extra = torch.zeros_like(t) if element_floor is None else element_floor.double().cpu()
    return torch.maximum(extra + floor, bound.double().cpu()) - floor


# Tier 3: finite differences in float64 (torch.autograd.gradcheck's defaults).
GRADCHECK_EPS = 1e-6
GRADCHECK_ATOL = 1e-5
GRADCHECK_RTOL = 1e-3

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
    """Tier 1: identical bits (and dtype, shape, device, presence). Returns 0.0 or raises.

    Signed zeros: in a floating-point tensor ``-0.0`` and ``+0.0`` compare equal, everywhere in
    tier 1. SPEC's formulas give a zero no sign: which one a kernel returns depends on the order
    its exact cancellations happen in (``a + (-a)`` is ``+0.0``, ``-0.0 + -0.0`` is ``-0.0``)
    and on products with a negative operand (``-x * 0``), so two runs of one correct rule on
    kernels that order their sums differently (a grouped GEMM and a plain one, a deferred wgrad
    closure and an inline one) may disagree on it while agreeing on every value. Any other
    difference counts bit for bit, NaN payloads included. Integer views are compared as they
    are: P13 compares FP8 bytes as ``uint8``, where the sign of an FP8 zero still counts."""
    if not check_same_presence(name, actual, expected):
        return 0.0
    assert actual is not None and expected is not None  # narrowed by check_same_presence
    if actual.dtype != expected.dtype:
        raise BudgetViolation(name, f"{name}: dtype {actual.dtype}, expected {expected.dtype}")
    if actual.device != expected.device:
        raise BudgetViolation(name, f"{name}: device {actual.device}, expected {expected.device}")
    a = actual.detach().contiguous()
    e = expected.detach().contiguous()
    ibits = _INT_VIEW[a.element_size()]
    differ = a.view(ibits) != e.view(ibits)
    if a.is_floating_point():
        differ &= ~((a == 0) & (e == 0))  # -0.0 == +0.0 (see the docstring)
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
    """Tier 2: ``actual`` against the float64 ``truth``, relative to ``naive``'s own error.

    ``dtype`` is the dtype whose rounding step sets the floor (default: ``actual``'s — e.g.
    float32 for ``main_grad`` of a bf16 module); ``module_dtype`` the dtype the module computes
    in, which picks the multiplier (default: ``dtype``). ``naive_error`` replaces
    ``max|naive - truth|`` when the caller measured the naive run against its own candidate truth
    (the relu kink); ``note`` is appended to a failure message; ``element_floor`` (truth's
    shape) is added to the budget element by element (:data:`WGRAD_OPERAND_STEPS`);
    ``floor_magnitude`` replaces ``max|truth|`` as the magnitude whose rounding steps make the
    floor when larger (an accumulation rounds at the size of its operands:
    :func:`accumulation_magnitude`). Returns worst error / budget (<= 1) or raises.
    """
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
    floor_steps = budget.floor_steps_for(module_dtype or dtype)
    t = truth.detach().double().cpu()
    a = actual.detach().double().cpu()
    n = naive.detach().double().cpu()
    if t.numel() == 0:
        return 0.0
    err = (a - t).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    naive_err = float((n - t).abs().max()) if naive_error is None else naive_error
    magnitude = float(t.abs().max())
    if floor_magnitude is not None:
        magnitude = max(magnitude, floor_magnitude)
    floor = floor_steps * rounding_step(dtype, magnitude)
    allowed = multiplier * naive_err + floor
    extra = torch.zeros_like(t) if element_floor is None else element_floor.double().cpu()
    ratios = err / (allowed + extra)
    flat = int(ratios.flatten().argmax())
    worst = float(err.flatten()[flat])
    ratio = float(ratios.flatten()[flat])
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


# FP8 formats: largest finite value, and the spacing of the subnormals (the grid's finest step).
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
FP8_EPS = {"E4M3": 2.0**-3, "E5M2": 2.0**-2}
FP8_SUBNORMAL_STEP = {"E4M3": 2.0**-9, "E5M2": 2.0**-16}


def fp8_step(v: torch.Tensor, fmt: str, scale_inv: float) -> torch.Tensor:
    """The largest distance between neighbouring FP8 ``fmt`` values around ``v`` when quantized
    with ``scale_inv`` (values are ``scale_inv * fp8``): ``eps(fmt) * |v|`` for normal numbers,
    the subnormal spacing ``* scale_inv`` below them."""
    return torch.clamp(FP8_EPS[fmt] * v.abs(), min=FP8_SUBNORMAL_STEP[fmt] * scale_inv)


def check_fp8_budget(
    name: str,
    actual: torch.Tensor | None,
    truth: torch.Tensor | None,
    naive: torch.Tensor | None,
    budget: Fp8Budget,
    dtype: torch.dtype | None = None,
    module_dtype: torch.dtype | None = None,
    recipe: str = "",
    fp8_eps: float = 2.0**-3,
    samples: int | None = None,
    bound: torch.Tensor | None = None,
    naive_truth: torch.Tensor | None = None,
) -> float:
    """Both gates of :class:`Fp8Budget`; returns the larger ratio (<= 1) or raises
    :class:`BudgetViolation` naming the gate, the tensor, the worst index and both values.
    ``fp8_eps`` is the epsilon of the coarsest FP8 format on the tensor's way; ``samples`` how
    many independent quantizations its statistics average over (default: its element count;
    see :class:`Fp8Budget`); ``bound``: per element, how far two correct FP8 runs can be apart
    (:func:`~.internals.rounding_bounds` with its FP8 crossings). Since
    ``|a - t| <= |n - t| + |a - n|``, each gate also admits the naive run's error plus that
    bound (``multiplier x naive + bound`` element-wise, ``norm_multiplier x naive + ||bound||``
    on the norm) where that is the larger; it follows the terms a GEMM sums (a wgrad whose
    terms cancel: found by the nightly on impl, a 3x1 swiglu MLP's fc2 ``main_grad`` 2.06x over
    the old gate when one activation of two crossed a boundary). ``naive_truth``: what the
    naive run's errors are measured against, when ``truth`` is a candidate with ``relu'``
    switched at kink sites ("relu under FP8" above; default ``truth``). ``module_dtype`` is
    accepted for symmetry with :func:`check_error_budget`."""
    del module_dtype
    if not check_same_presence(name, actual, truth):
        return 0.0
    if naive is None or naive.shape != truth.shape:
        raise BudgetViolation(
            name, f"{name}: the naive FP8 reference produced no comparable tensor"
        )
    assert actual is not None and truth is not None  # narrowed by check_same_presence
    dtype = dtype or actual.dtype
    t = truth.detach().double().cpu()
    a = actual.detach().double().cpu()
    n = naive.detach().double().cpu()
    if t.numel() == 0:
        return 0.0
    nt = t
    if naive_truth is not None:
        if naive_truth.shape != truth.shape:
            raise BudgetViolation(
                name,
                f"{name}: the naive run's truth has shape {tuple(naive_truth.shape)}, "
                f"expected {tuple(truth.shape)}",
            )
        nt = naive_truth.detach().double().cpu()
    tag = f"[{budget.kind} budget{', ' + recipe if recipe else ''}]"
    eps = torch.finfo(dtype).eps
    err = (a - t).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, math.inf), err)
    naive_err = float((n - nt).abs().max())
    magnitude = float(t.abs().max())
    n_eff = t.numel() if samples is None else max(1, min(samples, t.numel()))
    small = budget.small_tensor_steps * fp8_eps / math.sqrt(n_eff)
    floor = budget.floor_steps * rounding_step(dtype, magnitude) + small * magnitude
    allowed_t = torch.full_like(err, budget.multiplier * naive_err + floor)
    b = None
    if bound is not None:
        b = bound.detach().double().cpu().expand_as(err)
        allowed_t = torch.maximum(allowed_t, budget.multiplier * naive_err + b)
    ratios = err / allowed_t
    flat = int(ratios.flatten().argmax())
    worst = float(err.flatten()[flat])
    allowed = float(allowed_t.flatten()[flat])
    ratio = float(ratios.flatten()[flat])
    if not ratio <= 1.0:
        idx = _fmt_index(flat, t.shape)
        crossing = "" if b is None else f"; FP8 crossing bound there {float(b.flatten()[flat]):.4g}"
        raise BudgetViolation(
            name,
            f"{name}: worst error {worst:.4g} at index {idx}: got {_scalar(a, idx)!r}, "
            f"truth {_scalar(t, idx)!r} (naive FP8 {_scalar(n, idx)!r}); element-wise budget "
            f"{allowed:.4g} = {budget.multiplier} x naive error {naive_err:.4g} + the larger "
            f"of {budget.floor_steps} rounding steps of {dtype} at |truth| {magnitude:.4g} + "
            f"small-tensor {small:.3g} x |truth|{crossing}; ratio {ratio:.3g} {tag}",
            ratio,
        )
    norm_t = float(t.norm())
    if norm_t == 0.0:
        return ratio
    rel = float((a - t).norm()) / norm_t
    norm_nt = float(nt.norm())
    rel_naive = float((n - nt).norm()) / norm_nt if norm_nt else 0.0
    allowed_rel = budget.norm_multiplier * rel_naive + budget.norm_floor_steps * eps + small
    if b is not None:
        allowed_rel = max(
            allowed_rel, budget.norm_multiplier * rel_naive + float(b.norm()) / norm_t
        )
    norm_ratio = rel / allowed_rel
    if not norm_ratio <= 1.0:
        raise BudgetViolation(
            name,
            f"{name}: relative error ||got - truth|| / ||truth|| = {rel:.4g} over the whole "
            f"tensor, naive FP8 {rel_naive:.4g}; whole-tensor budget {allowed_rel:.4g} = "
            f"{budget.norm_multiplier} x naive + {budget.norm_floor_steps} eps of {dtype} + "
            f"small-tensor {small:.3g}; ratio {norm_ratio:.3g} (worst element "
            f"{_worst_text(err, t, a, n)}) {tag}",
            norm_ratio,
        )
    return max(ratio, norm_ratio)


def _worst_text(err: torch.Tensor, t: torch.Tensor, a: torch.Tensor, n: torch.Tensor) -> str:
    """``index: got, truth, naive`` of the largest element of ``err`` (for messages)."""
    idx = _fmt_index(int(err.flatten().argmax()), t.shape)
    return f"{idx}: got {_scalar(a, idx)!r}, truth {_scalar(t, idx)!r}, naive {_scalar(n, idx)!r}"


def gradcheck_reference(config, seed: int = 0, rows: int = 3, backend=None) -> None:
    """Tier 3: the reference's hand-written backward in float64 against finite differences.

    ``torch.autograd.gradcheck`` covers the input gradient. The reference writes parameter
    gradients itself (they never reach autograd), so each parameter element is checked by central
    differences of ``L = sum(y * dy)`` against the ``.grad`` / ``main_grad`` the module wrote.
    Raises :class:`BudgetViolation` naming the parameter and index. Keep shapes tiny.
    ``backend`` defaults to the reference (the meta-tests pass a deliberately wrong one).
    """
    import dataclasses as dc

    from .backends import get_backend
    from .data import make_state
    from .strategies import MicroBatch

    config = dc.replace(config, dtype="float64", autocast=None)
    backend = backend or get_backend("reference")
    splits = None
    if config.kind == "GroupedLinear":
        base, extra = divmod(rows, config.num_gemms)
        splits = tuple(base + (i < extra) for i in range(config.num_gemms))
    mb = MicroBatch((rows,), splits)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(rows, config.in_features, generator=g, dtype=torch.float64)
    dy = torch.randn(rows, config.output_features, generator=g, dtype=torch.float64)
    module = backend.build(config, delay=False)
    backend.load_state(module, make_state(config, seed))
    if config.fuse_wgrad_accumulation:
        for name in backend.gemm_weight_names(module):
            backend.parameters(module)[name].main_grad = torch.zeros_like(
                backend.parameters(module)[name], dtype=torch.float64
            )

    def fwd(x: torch.Tensor) -> torch.Tensor:
        return backend.forward(module, x, mb.m_splits, None)

    x = x0.clone().requires_grad_(True)
    ok = torch.autograd.gradcheck(
        fwd,
        (x,),
        eps=GRADCHECK_EPS,
        atol=GRADCHECK_ATOL,
        rtol=GRADCHECK_RTOL,
        raise_exception=False,
    )
    if not ok:
        raise BudgetViolation(
            "x.grad", f"gradcheck of the input gradient failed for {config.label()}"
        )
    # Parameter gradients: one analytic backward, then finite differences per element.
    params = backend.parameters(module)
    for p in params.values():
        p.grad = None
        if isinstance(getattr(p, "main_grad", None), torch.Tensor):
            p.main_grad.zero_()  # gradcheck's own backward calls accumulated into it
    backend.forward(module, x0.clone().requires_grad_(True), mb.m_splits, None).backward(dy)
    weights = set(backend.gemm_weight_names(module))
    for name, p in params.items():
        analytic = p.main_grad if (config.fuse_wgrad_accumulation and name in weights) else p.grad
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
                idx = _fmt_index(i, p.shape)
                raise BudgetViolation(
                    name,
                    f"{name}: analytic gradient {got!r} at index {idx} vs finite difference "
                    f"{numeric!r} (atol {GRADCHECK_ATOL}, rtol {GRADCHECK_RTOL}) "
                    f"for {config.label()}",
                )


# ---- Data parallel (P16) --------------------------------------------------------------------
#
# A replica sums its micro-batches' contributions, the all-reduce sums the replicas and divides
# by their count: the terms of the single-process global-batch run, grouped differently (one
# partial sum per replica) and with one more rounding (the division, exact for a power of two
# replicas, then the schedule's division by the micro-batch count). The yardstick is that
# global-batch run in the module dtype against the float64 truth of the same values.
DATA_PARALLEL_MULTIPLIER = 2.0
DATA_PARALLEL_FLOOR_STEPS = 4.0


def data_parallel_tolerance(dtype: torch.dtype, naive_error: float, truth_max: float) -> float:
    """Budget of one data-parallel gradient against the float64 global-batch truth:
    ``DATA_PARALLEL_MULTIPLIER * naive_error + DATA_PARALLEL_FLOOR_STEPS`` rounding steps of
    ``dtype`` at ``truth_max`` (``naive_error``: the single-process run's own error)."""
    return DATA_PARALLEL_MULTIPLIER * naive_error + DATA_PARALLEL_FLOOR_STEPS * rounding_step(
        dtype, truth_max
    )
