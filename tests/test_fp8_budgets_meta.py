"""Meta-tests of the FP8 oracles: the budgets pass the truth and what a correct implementation may
do differently (tests/fp8_doubles.py ``LegalFP8``), and fail a slightly wrong one (``WrongFP8``:
a scale 3% off, saturation missing, the column-wise copy quantized along the wrong axis, wgrad
fed the row-wise copy); P13 fails a quantizer that differs from the reference in one bit."""

from __future__ import annotations

import math
import types

import pytest
import torch
from fp8_doubles import WRONG, LegalFP8, WrongFP8
from splitgrad.properties import budgets as B
from splitgrad.properties.backends import LibraryBackend, get_backend
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig, recipe_alignment
from splitgrad.properties.checks.registry import run_check
from splitgrad.properties.checks.results import PropertyViolation


def _case(kind: str, recipe: str, dtype: str = "bfloat16", seed: int = 0, **kw) -> Case:
    """A realistic aligned case: 32 (or 128) features, three micro-batches of one block of
    tokens (two groups for GroupedLinear)."""
    n = max(32, recipe_alignment(recipe))
    rows = n if recipe_alignment(recipe) > 1 else 32
    cfg = ModuleConfig(kind, n, n, num_gemms=2, dtype=dtype, recipe=recipe, **kw)
    splits = (rows, rows) if kind == "GroupedLinear" else None
    mbs = tuple(MicroBatch((2 * rows if splits else rows,), splits) for _ in range(3))
    return Case(cfg, mbs, seed)


# ---- the gates themselves ---------------------------------------------------------------


def test_fp8_budget_passes_on_truth_and_fails_just_past_each_gate() -> None:
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(32, 32, generator=g, dtype=torch.float64)
    noise = torch.randn(32, 32, generator=g, dtype=torch.float64) * 0.03
    naive = truth + noise
    assert B.check_fp8_budget("y", truth, truth, naive, B.FP8, torch.bfloat16) == 0.0
    assert B.check_fp8_budget("y", naive, truth, naive, B.FP8, torch.bfloat16) < 1.0
    # The error grown 10% past the whole-tensor budget, spread evenly: that gate catches it.
    b, eps = B.FP8, torch.finfo(torch.bfloat16).eps
    rel_naive = float(noise.norm() / truth.norm())
    allowed = (
        b.norm_multiplier * rel_naive + b.norm_floor_steps * eps + b.small_tensor_steps * 2**-3 / 32
    )
    with pytest.raises(B.BudgetViolation, match="whole-tensor budget") as info:
        B.check_fp8_budget(
            "y", truth + noise * 1.1 * allowed / rel_naive, truth, naive, B.FP8, torch.bfloat16
        )
    assert 1.05 < info.value.ratio < 1.15
    # One element far off: the element-wise gate names it.
    wrong = naive.clone()
    wrong[3, 4] = truth[3, 4] + 10 * float(noise.abs().max())
    with pytest.raises(B.BudgetViolation, match=r"\(3, 4\).*element-wise budget"):
        B.check_fp8_budget("fc1_weight.grad", wrong, truth, naive, B.FP8, torch.bfloat16)
    bad = naive.clone()
    bad[0, 0] = math.nan
    with pytest.raises(B.BudgetViolation):
        B.check_fp8_budget("y", bad, truth, naive, B.FP8, torch.bfloat16)


def test_small_tensor_allowance_shrinks_with_size() -> None:
    """One element can be a full FP8 step off (a boundary crossing) when the naive run happens
    to be exact; a 32x32 tensor gets 1/32 of that allowance."""
    one = torch.tensor([1.0], dtype=torch.float64)
    assert B.check_fp8_budget("y", one * 1.1, one, one, B.FP8, torch.bfloat16) <= 1.0
    big = torch.ones(32, 32, dtype=torch.float64)
    with pytest.raises(B.BudgetViolation):
        B.check_fp8_budget("y", big * 1.1, big, big, B.FP8, torch.bfloat16)
    assert len(B.FP8.why) > 40


# ---- on modules: legal differences pass --------------------------------------------------


@pytest.mark.parametrize(
    "kind, recipe",
    [
        ("Linear", "delayed-max-hybrid"),
        ("LayerNormLinear", "current-hybrid"),
        ("LayerNormMLP", "mxfp8"),
        ("LayerNormMLP", "delayed-recent-e4m3"),
        ("GroupedLinear", "block"),
    ],
)
@pytest.mark.parametrize("pid", ["P1", "P2", "P3"])
def test_legal_fp8_differences_pass(kind: str, recipe: str, pid: str) -> None:
    """Norm/activation outputs a step off on a quarter of the elements and exact-product GEMMs
    (what a correct implementation may do) stay within budget; so does the reference itself."""
    case = _case(kind, recipe, activation="gelu")
    assert run_check(pid, LegalFP8(), case).ratio <= 1.0
    assert run_check(pid, get_backend("reference"), case).ratio <= 1.0


# ---- on modules: wrong results fail ------------------------------------------------------

# Per bug, cases where one of P1-P3 must catch it. Quantizer bugs that keep the FP8 error at
# its usual size (the wrong axis, the row-wise copy in wgrad) are caught where every quantized
# operand is an input (Linear, GroupedLinear, LayerNormLinear's dgrad: judged against the same
# recipe in float64); behind a computed operand (LayerNormLinear's wgrad of ln_out) they hide in
# FP8 noise of the same size, and P13 (the quantizers bit for bit) is what catches them.
WRONG_CASES = {
    "scale": [
        ("Linear", "current-hybrid"),
        ("LayerNormLinear", "mxfp8"),
        ("GroupedLinear", "block"),
    ],
    "saturation": [("Linear", "delayed-max-hybrid"), ("LayerNormMLP", "delayed-recent-hybrid")],
    "axis": [("Linear", "mxfp8"), ("GroupedLinear", "mxfp8")],
    "wgrad-rowwise": [("Linear", "block"), ("GroupedLinear", "mxfp8")],
}


def test_every_wrong_variant_has_cases() -> None:
    assert set(WRONG_CASES) == set(WRONG)


@pytest.mark.parametrize(
    "bug, kind, recipe",
    [(bug, kind, recipe) for bug, cases in WRONG_CASES.items() for kind, recipe in cases],
)
def test_wrong_fp8_fails_an_accuracy_property(bug: str, kind: str, recipe: str) -> None:
    case = _case(kind, recipe, activation="gelu", fuse_wgrad_accumulation=True)
    caught = []
    for pid in ("P1", "P2", "P3"):
        try:
            run_check(pid, WrongFP8(bug), case)
        except (B.BudgetViolation, PropertyViolation) as exc:
            caught.append(f"{pid}: {str(exc)[:120]}")
    assert caught, f"{bug} on {case.config.label()} passed P1-P3"


# ---- P13: one bit off in a quantizer -----------------------------------------------------


class _QuantizerBackend(LibraryBackend):
    """The reference, with ``fp8_quantizer()`` returning ``quantize`` wrapped by ``change``."""

    def __init__(self, change) -> None:
        super().__init__("reference-quantizer-changed", "splitgrad.reference")
        self.change = change

    def fp8_quantizer(self):
        from splitgrad.reference import fp8_quant

        def quantize(x, recipe, role, axis, state=None):
            return self.change(fp8_quant.quantize(x, recipe, role, axis, state=state), x, axis)

        return types.SimpleNamespace(
            quantize=quantize, DelayedScalingState=fp8_quant.DelayedScalingState
        )


def _scale_one_ulp_up(q, x, axis):
    q.scale_inv = torch.nextafter(q.scale_inv, torch.full_like(q.scale_inv, math.inf))
    return q


def _last_byte_flipped(q, x, axis):
    data = q.data.contiguous().view(torch.uint8).clone()
    if data.numel():
        data.view(-1)[-1] ^= 1
    q.data = data.view(q.data.dtype)
    return q


@pytest.mark.parametrize(
    "change, recipes",
    [
        (_scale_one_ulp_up, ["delayed-max-hybrid", "current-e4m3", "block"]),
        (_last_byte_flipped, ["delayed-recent-hybrid", "current-hybrid", "mxfp8", "block"]),
    ],
    ids=["scale_inv-one-ulp", "one-fp8-bit"],
)
def test_p13_catches_a_one_bit_difference(change, recipes: list[str]) -> None:
    backend = _QuantizerBackend(change)
    for recipe in recipes:
        case = _case("Linear", recipe)
        with pytest.raises(B.BudgetViolation, match="not bitwise identical"):
            run_check("P13", backend, case)


def test_p13_catches_a_quantizer_that_ignores_the_axis() -> None:
    from splitgrad.reference import fp8_quant

    def quantize(x, recipe, role, axis, state=None):
        return fp8_quant.quantize(x, recipe, role, 1, state=state)

    class Backend(LibraryBackend):
        def fp8_quantizer(self):
            return types.SimpleNamespace(
                quantize=quantize, DelayedScalingState=fp8_quant.DelayedScalingState
            )

    for recipe in ("mxfp8", "block"):
        with pytest.raises(B.BudgetViolation, match="axis=0"):
            run_check("P13", Backend("ref-axis", "splitgrad.reference"), _case("Linear", recipe))


def test_p13_passes_on_the_reference_for_every_recipe_and_value_pattern() -> None:
    from splitgrad.properties.cases.strategies import RECIPES
    from splitgrad.properties.checks.fp8 import P13_VALUES

    ref = get_backend("reference")
    for recipe in RECIPES:
        for variant in P13_VALUES:
            case = _case("LayerNormMLP", recipe, activation="swiglu")
            case = Case(case.config, case.micro_batches[:2], 3, variant=variant)
            assert run_check("P13", ref, case).ratio == 0.0
