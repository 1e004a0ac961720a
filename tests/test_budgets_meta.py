"""Meta-tests of the oracles: every budget passes on the truth and fails on a slightly wrong
result, and its failure message names the tensor, the worst index, both values and the budget."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from splitgrad.properties import budgets as B
from splitgrad.properties.backends import LibraryBackend, get_backend
from splitgrad.properties.checks.accuracy import accuracy as _accuracy
from splitgrad.properties.checks.registry import example_case

LOW = (torch.float32, torch.bfloat16, torch.float16)


def _truth_and_naive(dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(7, 5, generator=g, dtype=torch.float64) * 3
    naive = truth.to(dtype)  # one rounding: the smallest error a dtype-valued result can have
    return truth, naive


@pytest.mark.parametrize("budget", list(B.BUDGETS.values()), ids=list(B.BUDGETS))
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_budget_passes_on_truth(budget: B.ErrorBudget, dtype: torch.dtype) -> None:
    truth, naive = _truth_and_naive(dtype)
    assert (
        B.check_error_budget("t", naive, truth, naive, budget)
        <= 1.0 / budget.multiplier_for(dtype) + 1e-12
    )
    assert B.check_error_budget("t", truth, truth, naive, budget, dtype) == 0.0


@pytest.mark.parametrize("budget", list(B.BUDGETS.values()), ids=list(B.BUDGETS))
@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_budget_fails_just_past_its_limit(budget: B.ErrorBudget, dtype: torch.dtype) -> None:
    truth, naive = _truth_and_naive(dtype)
    naive_err = float((naive.double() - truth).abs().max())
    allowed = budget.multiplier_for(dtype) * naive_err + budget.floor_steps_for(
        dtype
    ) * B.rounding_step(dtype, float(truth.abs().max()))
    wrong = truth.clone()
    wrong[3, 2] += allowed * 1.05  # 5% past the budget, at a known index
    with pytest.raises(B.BudgetViolation) as info:
        B.check_error_budget("fc1_weight.main_grad", wrong, truth, naive, budget, dtype)
    msg = str(info.value)
    assert "fc1_weight.main_grad" in msg and "(3, 2)" in msg and "budget" in msg
    assert repr(float(wrong[3, 2])) in msg and repr(float(truth[3, 2])) in msg
    assert 1.0 < info.value.ratio < 1.1
    # ... and just inside it passes.
    wrong[3, 2] = truth[3, 2] + allowed * 0.95
    assert B.check_error_budget("x", wrong, truth, naive, budget, dtype) <= 1.0


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_floor_is_one_rounding_step_when_naive_is_exact(dtype: torch.dtype) -> None:
    truth = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    naive = truth.to(dtype)  # exactly representable: naive error 0
    step = B.OUTPUT.floor_steps_for(dtype) * torch.finfo(dtype).eps * 4.0
    assert (
        B.check_error_budget(
            "y",
            truth + torch.tensor([0, 0, step * 0.99], dtype=torch.float64),
            truth,
            naive,
            B.OUTPUT,
            dtype,
        )
        <= 1.0
    )
    with pytest.raises(B.BudgetViolation):
        B.check_error_budget(
            "y",
            truth + torch.tensor([0, 0, step * 1.01], dtype=torch.float64),
            truth,
            naive,
            B.OUTPUT,
            dtype,
        )


def test_budget_rejects_nan_missing_and_shape() -> None:
    truth, naive = _truth_and_naive(torch.bfloat16)
    bad = truth.clone()
    bad[0, 0] = math.nan
    with pytest.raises(B.BudgetViolation):
        B.check_error_budget("y", bad, truth, naive, B.OUTPUT, torch.bfloat16)
    with pytest.raises(B.BudgetViolation, match="got None"):
        B.check_error_budget("y", None, truth, naive, B.OUTPUT)
    with pytest.raises(B.BudgetViolation, match="shape"):
        B.check_error_budget("y", truth[:3], truth, naive, B.OUTPUT)


def test_every_relaxed_budget_says_why() -> None:
    for b in B.BUDGETS.values():
        assert b.multiplier >= 1 and b.floor_steps > 0 and len(b.why) > 40
        if b.fp32_multiplier is not None:
            assert len(b.fp32_why) > 40


# ---- tier 1: bitwise ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", (*LOW, torch.float64), ids=str)
def test_bitwise_passes_on_identical_and_fails_on_one_ulp(dtype: torch.dtype) -> None:
    a = torch.randn(4, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert B.check_bitwise("w.grad", a, a.clone()) == 0.0
    b = a.clone()
    b[2, 1] = (
        torch.nextafter(b[2, 1].float(), torch.tensor(math.inf)).to(dtype)
        if dtype != torch.float64
        else torch.nextafter(b[2, 1], torch.tensor(math.inf, dtype=dtype))
    )
    if dtype in (torch.bfloat16, torch.float16):
        b[2, 1] = (a[2, 1].view(torch.int16) + 1).view(dtype)
    with pytest.raises(B.BudgetViolation) as info:
        B.check_bitwise("w.grad", b, a)
    assert (
        "w.grad" in str(info.value)
        and "(2, 1)" in str(info.value)
        and "rtol=0, atol=0" in str(info.value)
    )


@pytest.mark.parametrize("dtype", (*LOW, torch.float64), ids=str)
def test_bitwise_takes_signed_zeros_as_equal_and_nothing_else(dtype: torch.dtype) -> None:
    # The stated policy (check_bitwise's docstring): -0.0 == +0.0, in every float dtype.
    z = torch.tensor([-0.0, 0.0, 1.0], dtype=dtype)
    assert B.check_bitwise("z", z, torch.tensor([0.0, -0.0, 1.0], dtype=dtype)) == 0.0
    # ... but the smallest subnormal next to a zero, or a zero next to a NaN, still differs.
    tiny = torch.tensor([0.0], dtype=dtype).nextafter(torch.tensor([1.0], dtype=dtype))
    with pytest.raises(B.BudgetViolation, match="1 of 1"):
        B.check_bitwise("z", tiny, torch.tensor([-0.0], dtype=dtype))
    with pytest.raises(B.BudgetViolation):
        nan = torch.tensor([math.nan], dtype=dtype)
        B.check_bitwise("z", nan, torch.tensor([0.0], dtype=dtype))
    # Integer views (P13's FP8 bytes) keep the sign of an FP8 zero: 0x80 != 0x00.
    with pytest.raises(B.BudgetViolation):
        B.check_bitwise(
            "q", torch.tensor([128], dtype=torch.uint8), torch.tensor([0], dtype=torch.uint8)
        )


def test_bitwise_keeps_nan_payloads() -> None:
    n = torch.tensor([math.nan, 1.0])
    assert B.check_bitwise("n", n, n.clone()) == 0.0
    with pytest.raises(B.BudgetViolation, match="dtype"):
        B.check_bitwise("d", torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    with pytest.raises(B.BudgetViolation, match="None"):
        B.check_bitwise("m", None, torch.zeros(2))
    assert B.check_bitwise("m", None, None) == 0.0


# ---- tier 2 on real modules ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_module_budgets_pass_on_reference_and_fail_a_few_steps_off(kind: str, dtype: str) -> None:
    """The reference's own gradients are within every budget; moving one element of a real
    wgrad/dgrad/output by a handful of rounding steps past the budget is caught."""
    config = {"in_features": 6, "out_features": 4, "dtype": dtype, "fuse_wgrad_accumulation": True}
    if kind == "GroupedLinear":
        config["num_gemms"] = 2
    case = example_case(kind, **config)
    test, naive, truth = _accuracy(get_backend("reference"), case)
    mdt = getattr(torch, dtype)
    key = next(k for k in truth.gemm if k.endswith(".main_grad"))
    for name, a, n, t, budget, floor_dt in (
        ("output", test.outputs[0], naive.outputs[0], truth.outputs[0], B.OUTPUT, mdt),
        ("inp.grad", test.xgrads[0], naive.xgrads[0], truth.xgrads[0], B.DGRAD, mdt),
        (key, test.gemm[key], naive.gemm[key], truth.gemm[key], B.WGRAD, torch.float32),
    ):
        assert B.check_error_budget(name, a, t, n, budget, floor_dt, mdt) <= 1.0
        naive_err = float((n.double() - t.double()).abs().max())
        floor = budget.floor_steps_for(mdt) * B.rounding_step(floor_dt, float(t.abs().max()))
        allowed = budget.multiplier_for(mdt) * naive_err + floor
        wrong = a.detach().double().clone()
        wrong.view(-1)[0] = t.double().view(-1)[0] + 1.5 * allowed
        with pytest.raises(B.BudgetViolation, match=name.split(".")[0]):
            B.check_error_budget(name, wrong, t, n, budget, floor_dt, mdt)


# ---- tier 3 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        dict(kind="Linear", in_features=3, out_features=2),
        dict(kind="Linear", in_features=3, out_features=2, fuse_wgrad_accumulation=True),
        dict(kind="LayerNormLinear", in_features=4, out_features=2, zero_centered_gamma=True),
        dict(kind="LayerNormLinear", in_features=3, out_features=2, normalization="RMSNorm"),
        dict(kind="LayerNormMLP", in_features=3, out_features=2, activation="swiglu"),
        dict(
            kind="LayerNormMLP",
            in_features=3,
            out_features=2,
            activation="gelu",
            normalization="RMSNorm",
        ),
        dict(kind="GroupedLinear", in_features=2, out_features=2, num_gemms=3),
    ],
    ids=lambda c: "-".join(str(v) for v in c.values()),
)
def test_gradcheck_reference(config: dict) -> None:
    from splitgrad.properties.cases.strategies import ModuleConfig

    B.gradcheck_reference(ModuleConfig(**config))


def test_gradcheck_fails_on_a_one_percent_wrong_backward() -> None:
    """Meta: tier 3 catches a backward that scales every gradient by 1.01."""
    from splitgrad.properties.cases.strategies import ModuleConfig

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.view_as(y)

        @staticmethod
        def backward(ctx, g):
            return g * 1.01

    class Skewed(LibraryBackend):
        def forward(self, module, x, m_splits, first):
            return Scale.apply(super().forward(module, x, m_splits, first))

    skewed = Skewed("reference-skewed", "splitgrad.reference")
    with pytest.raises(B.BudgetViolation):
        B.gradcheck_reference(ModuleConfig("Linear", 3, 2), backend=skewed)
    assert dataclasses.is_dataclass(ModuleConfig("Linear", 3, 2))


# ---- per-element operand allowances (budgets.WGRAD_OPERAND_STEPS / DGRAD_OPERAND_STEPS) ------


def _mlp_case(activation: str, dtype: str = "bfloat16", fused: bool = True, seed: int = 0):
    from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig

    config = ModuleConfig(
        "LayerNormMLP", 6, 4, activation=activation, dtype=dtype, fuse_wgrad_accumulation=fused
    )
    return Case(config, (MicroBatch((3,)), MicroBatch((2,))), seed)


def test_operand_allowances_exist_only_behind_computed_operands() -> None:
    from splitgrad.properties.oracle.internals import dgrad_operand_floors, wgrad_operand_floors

    for kind in ("Linear", "GroupedLinear"):
        assert wgrad_operand_floors(example_case(kind, num_gemms=2)) == {}
    fused = example_case("LayerNormLinear", fuse_wgrad_accumulation=True)
    assert set(wgrad_operand_floors(fused)) == {"weight.main_grad"}
    assert wgrad_operand_floors(example_case("LayerNormLinear")) == {}  # .grad: bf16 floor
    relu = _mlp_case("relu")
    assert dgrad_operand_floors(relu) == {}  # relu' jumps: the kink machinery judges it
    floors = dgrad_operand_floors(_mlp_case("gelu"))
    assert set(floors) == {
        "inp.grad[micro-batch 0]",
        "inp.grad[micro-batch 1]",
        "layer_norm_weight.grad",
        "layer_norm_bias.grad",
    }
    fp8 = dataclasses.replace(
        relu, config=dataclasses.replace(relu.config, recipe="current-hybrid")
    )
    assert wgrad_operand_floors(fp8) == {} and dgrad_operand_floors(fp8) == {}


@pytest.mark.parametrize(("activation", "steps"), [("gelu", 3), ("swiglu", 10), ("geglu", 10)])
def test_operand_allowances_stay_at_the_rounding_scale(activation: str, steps: int) -> None:
    """The allowances are rounding steps of the operands carried to the result: measured
    against the gradient itself they stay a few rounding steps of it (budgets.py has the
    numbers), not a fraction of it."""
    from splitgrad.properties.oracle.internals import dgrad_operand_floors, wgrad_operand_floors

    case = _mlp_case(activation)
    _, _, truth = _accuracy(get_backend("reference"), case)
    eps = torch.finfo(torch.bfloat16).eps
    for key, floor in wgrad_operand_floors(case).items():
        if key in truth.gemm and truth.gemm[key] is not None:
            assert float(floor.max()) < 4 * eps * float(truth.gemm[key].abs().max()), key
    for key, floor in dgrad_operand_floors(case).items():
        t = truth.norm.get(key) if key in truth.norm else truth.xgrads[int(key[-2])]
        assert float(floor.max()) < steps * eps * float(t.abs().max()), key


@pytest.mark.parametrize(
    ("activation", "skew", "dw_skew"), [("gelu", 1.03, 1.03), ("swiglu", 1.05, 1.08)]
)
def test_a_slightly_wrong_mlp_gradient_still_fails(
    activation: str, skew: float, dw_skew: float
) -> None:
    """Meta (soundness): every input/parameter gradient ``skew`` times too large, or fc2's
    main_grad contribution ``dw_skew`` times too large, still fails P2 / P3 of a
    smooth-activation MLP despite the operand allowances (gated ones allow more: their second
    half moves with act(a) itself)."""
    from splitgrad.properties.checks.accuracy import check_p2, check_p3

    class Skewed(LibraryBackend):
        def __init__(self, what: str) -> None:
            super().__init__(f"reference-skewed-{what}", "splitgrad.reference")
            self.what = what

        def forward(self, module, x, m_splits, first):
            y = super().forward(module, x, m_splits, first)
            return _ScaleGrad.apply(y, skew) if self.what == "dx" else y

        def backward_dw(self, module) -> None:
            before = module.fc2_weight.main_grad.clone()
            super().backward_dw(module)
            if self.what == "dw":
                with torch.no_grad():
                    module.fc2_weight.main_grad.sub_(before).mul_(dw_skew).add_(before)

    for seed in range(3):
        case = _mlp_case(activation, seed=seed)
        with pytest.raises(B.BudgetViolation, match="inp.grad|layer_norm"):
            check_p2(Skewed("dx"), case)
        with pytest.raises(B.BudgetViolation, match="fc2_weight.main_grad"):
            check_p3(Skewed("dw"), case)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the incoming gradient scaled by ``factor``: every gradient below it
    (inp.grad, and the parameters') is ``factor`` times too large."""

    @staticmethod
    def forward(ctx, y, factor):
        ctx.factor = factor
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None
