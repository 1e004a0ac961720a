"""Meta-tests of the per-element rounding bound (oracle/rounding.py: ``rounding_bounds``).

The bound claims to hold for *any* summation order of a GEMM's fp32 reduction (split-K, blocked,
reversed: what a GPU kernel may do), so the budgets need no retuning on another device. These
tests compute the same GEMMs in several orders and check every result lies inside the bound, and
that the bound is not so wide that it could not fail: a reduction that drops one term, or a
result one part in a thousand off, lies outside it.
"""

from __future__ import annotations

import pytest
import torch
from splitgrad.properties.cases.data import make_micro_batches, make_state
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig
from splitgrad.properties.oracle.rounding import rounding_bounds

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(3, 5, 7), (64, 48, 17), (200, 33, 40)]  # (in_features K, out_features, rows)


def _case(k: int, n: int, rows: int, dtype: torch.dtype, seed: int) -> Case:
    name = str(dtype).removeprefix("torch.")
    return Case(ModuleConfig("Linear", k, n, dtype=name), (MicroBatch((rows,)),), seed)


def _ordered_mm(a: torch.Tensor, b: torch.Tensor, order: str) -> torch.Tensor:
    """``a @ b`` with an fp32 accumulator over the reduction dimension in ``order``."""
    a, b = a.float(), b.float()
    k = a.shape[1]
    if order == "library":
        return a @ b
    if order == "reversed":
        acc = torch.zeros(a.shape[0], b.shape[1])
        for i in reversed(range(k)):
            acc = acc + a[:, i : i + 1] * b[i : i + 1, :]
        return acc
    if order == "split-k":  # four partial GEMMs, summed last to first
        parts = [a[:, c] @ b[c, :] for c in torch.arange(k).chunk(4)]
        acc = torch.zeros(a.shape[0], b.shape[1])
        for p in reversed(parts):
            acc = acc + p
        return acc
    if order == "pairwise":
        terms = [a[:, i : i + 1] * b[i : i + 1, :] for i in range(k)]
        while len(terms) > 1:
            terms = [
                terms[j] + terms[j + 1] if j + 1 < len(terms) else terms[j]
                for j in range(0, len(terms), 2)
            ]
        return terms[0]
    raise ValueError(order)


ORDERS = ["library", "reversed", "split-k", "pairwise"]


def _linear_pieces(case: Case):
    c = case.config
    state = make_state(c, case.seed)
    (d,) = make_micro_batches(case)
    x = d.x.reshape(-1, c.in_features)
    dy = d.dy.reshape(-1, c.out_features)
    return state["weight"], state["bias"], x, dy


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("order", ORDERS)
def test_every_summation_order_lies_inside_the_bound(dtype, shape, order) -> None:
    case = _case(*shape, dtype, seed=11)
    bounds = rounding_bounds(case)
    w, b, x, dy = _linear_pieces(case)
    w64, b64, x64, dy64 = (t.double() for t in (w, b, x, dy))
    # Forward: one fp32 reduction, the bias added in fp32, one rounding to the module dtype.
    y = (_ordered_mm(x, w.t(), order) + b.float()).to(dtype)
    err = (y.double() - (x64 @ w64.t() + b64)).abs()
    assert bool((err <= bounds["output[micro-batch 0]"]).all()), float(
        (err / bounds["output[micro-batch 0]"]).max()
    )
    # dgrad reduces over out_features, wgrad over the rows.
    dx = _ordered_mm(dy, w, order).to(dtype)
    err = (dx.double() - dy64 @ w64).abs()
    assert bool((err <= bounds["inp.grad[micro-batch 0]"]).all())
    dw = _ordered_mm(dy.t(), x, order).to(dtype)
    err = (dw.double() - dy64.t() @ x64).abs()
    assert bool((err <= bounds["weight.grad"]).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES[1:], ids=str)
def test_the_bound_fails_a_dropped_term_and_a_small_relative_error(dtype, shape) -> None:
    case = _case(*shape, dtype, seed=5)
    bounds = rounding_bounds(case)
    _, _, x, dy = _linear_pieces(case)
    x64, dy64 = x.double(), dy.double()
    truth = dy64.t() @ x64
    # A wgrad that skips the last row (a real mutant class: an off-by-one over the tokens).
    dropped = _ordered_mm(dy[:-1].t(), x[:-1], "library").to(dtype).double()
    assert bool(((dropped - truth).abs() > bounds["weight.grad"]).any())
    # A result off by 2**-7 relative (a bf16 step) on every element is outside the fp32 bound,
    # and a few bf16 steps outside the bf16 one.
    rel = 2.0**-7 if dtype == torch.float32 else 2.0**-4
    off = truth * (1 + rel)
    assert bool(((off - truth).abs() > bounds["weight.grad"]).any())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_bound_scales_with_the_summed_magnitudes_not_the_result(dtype) -> None:
    """Where the terms cancel, the bound follows sum |a_i b_i| (Higham), not |result|: the error
    of a cancelling sum can be far above a step of its own size."""
    case = _case(32, 8, 16, dtype, seed=3)
    bounds = rounding_bounds(case)
    w, _, x, dy = _linear_pieces(case)
    terms = dy.double().abs().t() @ x.double().abs()
    u32 = 2.0**-24
    assert bool((bounds["weight.grad"] >= 16 * u32 * terms).all())
    step = torch.finfo(dtype).eps / 2
    result = (dy.double().t() @ x.double()).abs()
    assert bool((bounds["weight.grad"] <= 4 * (step * result + 32 * 16 * u32 * terms)).all())


# ---- the FP8 crossing bound (properties/oracle/rounding.py: Arith.quant) ---


@pytest.mark.parametrize("recipe", ["current-hybrid", "delayed-max-e4m3", "mxfp8"])
def test_fp8_bound_adds_nothing_where_every_quantized_operand_is_an_input(
    recipe: str, monkeypatch
) -> None:
    # A Linear quantizes x, W and dy only: the same values on every side, so no crossing.
    from splitgrad.properties.oracle import rounding

    case = Case(
        ModuleConfig("Linear", 32, 32, dtype="bfloat16", recipe=recipe), (MicroBatch((32,)),), 3
    )
    got = rounding_bounds(case)
    monkeypatch.setattr(rounding.Arith, "quant", lambda self, a, gemm, role: a)
    want = rounding_bounds(case)
    assert set(got) == set(want) and got
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0)


def test_fp8_bound_grows_where_the_module_computes_an_operand(monkeypatch) -> None:
    # LayerNormLinear quantizes its norm output: weight.grad's bound must widen there.
    from splitgrad.properties.oracle import rounding

    config = ModuleConfig("LayerNormLinear", 32, 32, dtype="bfloat16", recipe="current-hybrid")
    case = Case(config, (MicroBatch((32,)),), 3)
    got = rounding_bounds(case)["weight.grad"]
    monkeypatch.setattr(rounding.Arith, "quant", lambda self, a, gemm, role: a)
    want = rounding_bounds(case)["weight.grad"]
    assert bool((got > 4 * want).all())


def test_fp8_bound_counts_one_step_of_each_computed_operand() -> None:
    from splitgrad.properties import budgets as B
    from splitgrad.properties.oracle.rounding import Arith, Bounded

    ar = Arith(torch.bfloat16, recipe="current-e4m3")
    v = torch.tensor([[0.5, -3.0, 1e-4, 7.0]], dtype=torch.float64)
    exact = ar.quant(Bounded.exact(v), "fc2", "input")
    assert torch.equal(exact.s, torch.zeros_like(v))  # an input: quantized alike everywhere
    computed = ar.quant(Bounded(v, torch.full_like(v, 1e-30)), "fc2", "input")
    step = B.fp8_step(v, "E4M3", 7.0 / 448.0)
    # One step per element at ROUNDING_SIGMAS; the subnormal floor at the tensor's scale.
    torch.testing.assert_close(
        Bounded(v, computed.s - 1e-30).bound(), B.ROUNDING_SIGMAS * step, rtol=1e-12, atol=0
    )
    assert float(step[0, 2]) == 2.0**-9 * 7.0 / 448.0
    assert float(step[0, 1]) == 3.0 / 8.0


def test_fp8_budget_with_a_crossing_bound_still_fails() -> None:
    from splitgrad.properties import budgets as B

    t = torch.linspace(-1.0, 1.0, 64, dtype=torch.float64).reshape(8, 8)
    n = t.clone()  # a naive run with no error: only the bound and the floors remain
    bound = 0.01 * t.abs() + 1e-3
    inside = t + 0.9 * bound * torch.sign(
        torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    )
    assert B.check_fp8_budget("w", inside, t, n, B.FP8, torch.float32, bound=bound) <= 1.0
    outside = t.clone()
    outside[3, 5] += 3.0 * float(bound[3, 5]) + 0.1
    with pytest.raises(B.BudgetViolation, match=r"w: worst error .* index \(3, 5\)"):
        B.check_fp8_budget("w", outside, t, n, B.FP8, torch.float32, bound=bound)
