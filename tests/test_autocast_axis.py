"""The harness's torch.autocast axis (SPEC §2): planned cells, their ids, the cases they draw,
the budgets they are judged by, and that a backend which ignores autocast fails them."""

from __future__ import annotations

import contextlib

import pytest
import torch
from splitgrad.properties.backends import get_backend
from splitgrad.properties.cases.data import make_micro_batches
from splitgrad.properties.cases.strategies import KINDS, Case, MicroBatch, ModuleConfig
from splitgrad.properties.checks.registry import PROPERTIES, explicit_cases, run_check
from splitgrad.properties.checks.results import PropertyViolation
from splitgrad.properties.front.campaign import FAIL, PASS, run_cell
from splitgrad.properties.front.plan import AUTOCAST_PROPERTIES, plan_cells
from splitgrad.properties.front.xfails import canonical_id
from splitgrad.properties.oracle.rounding import rounding_bounds


def test_the_default_plan_has_an_autocast_slice(monkeypatch) -> None:
    import splitgrad.properties.front.plan as plan

    monkeypatch.setattr(plan, "AUTOCAST_IN_DEFAULT_RUN", False)
    assert all(c.autocast is None for c in plan_cells(KINDS, ["float32"], list(PROPERTIES)))
    monkeypatch.undo()
    assert plan.AUTOCAST_IN_DEFAULT_RUN  # both packages follow torch.autocast
    cells = plan_cells(KINDS, ["float32", "bfloat16"], list(PROPERTIES))
    auto = [c for c in cells if c.autocast is not None]
    assert {c.property_id for c in auto} == set(AUTOCAST_PROPERTIES)
    assert {c.kind for c in auto} == set(KINDS)
    assert {(c.dtype, c.autocast, c.recipes) for c in auto} == {("float32", "bfloat16", (None,))}
    assert "P4-Linear-float32-none-autocast=bfloat16" in {c.test_id for c in auto}
    assert len({c.test_id for c in cells}) == len(cells)  # ids stay unique


def test_autocast_choices_replace_the_slice() -> None:
    none = plan_cells(KINDS, ["float32"], list(PROPERTIES), autocasts=["none"])
    assert all(c.autocast is None for c in none)
    only = plan_cells(KINDS, ["float32"], ["P1", "P9"], examples=7, autocasts=["all"])
    assert {(c.property_id, c.autocast) for c in only} == {
        ("P1", "bfloat16"),
        ("P1", "float16"),
    }
    assert all(c.examples == 7 for c in only)
    # A campaign asked for FP8 recipes or forced paths runs those, no autocast slice.
    assert all(c.autocast is None for c in plan_cells(KINDS, ["float32"], ["P1"], ["delayed"]))
    assert all(c.autocast is None for c in plan_cells(KINDS, ["float32"], ["P1"], [], ["grouped"]))


def test_xfails_name_autocast_cells_in_both_spellings() -> None:
    want = "P4-Linear-float32-none-autocast=bfloat16"
    assert canonical_id(f"test_property[{want}]") == want
    assert canonical_id(want) == want
    from splitgrad.properties.front.xfails import XfailsFileError

    with pytest.raises(XfailsFileError, match="autocast dtype 'int8'"):
        canonical_id("P4-Linear-float32-none-autocast=int8")


def test_config_refuses_what_autocast_cannot_mean() -> None:
    with pytest.raises(ValueError, match="unknown autocast dtype 'float64'"):
        ModuleConfig("Linear", 2, 2, autocast="float64")
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        ModuleConfig("Linear", 2, 2, dtype="bfloat16", autocast="bfloat16")
    c = ModuleConfig("Linear", 2, 2, autocast="bfloat16")
    assert c.compute_dtype == torch.bfloat16 and c.torch_dtype == torch.float32
    assert "autocast:bfloat16" in c.label()
    assert Case.from_json(Case(c, (MicroBatch((3,)),)).to_json()).config == c


def test_autocast_cases_run_float32_modules_with_output_gradients_in_the_autocast_dtype() -> None:
    cases = explicit_cases("P1", ("LayerNormMLP",), ("bfloat16",), autocast="bfloat16")
    assert cases
    for case in cases:
        assert case.config.dtype == "float32" and case.config.autocast == "bfloat16"
        for d in make_micro_batches(case):
            assert d.x.dtype == torch.float32 and d.dy.dtype == torch.bfloat16


def test_the_rounding_bound_counts_the_operand_casts() -> None:
    """Under autocast the float32 input and weights are rounded to bf16 before the GEMM: the
    output's bound is at least a bf16 rounding of each product's operands, far above the
    float32 module's bound."""
    mb = (MicroBatch((8,)),)
    plain = rounding_bounds(Case(ModuleConfig("Linear", 32, 8), mb, 1))
    auto = rounding_bounds(Case(ModuleConfig("Linear", 32, 8, autocast="bfloat16"), mb, 1))
    bf16 = rounding_bounds(Case(ModuleConfig("Linear", 32, 8, dtype="bfloat16"), mb, 1))
    key = "output[micro-batch 0]"
    assert bool((auto[key] > 100 * plain[key]).all())
    assert bool((auto[key] > bf16[key]).all())  # the bf16 module's weights are exact


class _IgnoresAutocast:
    """The reference, but its forward runs with autocast turned off (float32 GEMMs)."""

    def __init__(self) -> None:
        self._inner = get_backend("reference")

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, module, x, m_splits, is_first_microbatch):
        off = torch.autocast("cpu", enabled=False) if torch.is_autocast_enabled("cpu") else None
        with off or contextlib.nullcontext():
            return self._inner.forward(module, x, m_splits, is_first_microbatch)


def _autocast_case() -> Case:
    return Case(ModuleConfig("Linear", 16, 8, autocast="bfloat16"), (MicroBatch((4,)),), 2)


def test_a_backend_that_ignores_autocast_fails_p1() -> None:
    case = _autocast_case()
    assert run_check("P1", get_backend("reference"), case).ratio <= 1.0
    with pytest.raises(PropertyViolation, match="dtype torch.float32, but the reference gives"):
        run_check("P1", _IgnoresAutocast(), case)


@pytest.mark.parametrize("backend", ["reference", "impl"])
def test_autocast_cells_pass_on_both_packages(backend: str) -> None:
    cell = run_cell(
        get_backend(backend), "P4", "LayerNormMLP", "float32", examples=3, autocast="bfloat16"
    )
    assert cell.status == PASS, cell.message
    assert cell.autocast == "bfloat16" and cell.label.endswith("autocast=bfloat16")


def test_an_autocast_failure_reproduces_from_its_line() -> None:
    cell = run_cell(_IgnoresAutocast(), "P1", "Linear", "float32", examples=2, autocast="bfloat16")
    assert cell.status == FAIL
    assert '"autocast":"bfloat16"' in cell.repro
