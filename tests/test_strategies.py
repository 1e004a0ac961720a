"""Meta-tests of the strategies: what they draw is valid, capped, and reaches the edge cases."""

from __future__ import annotations

import dataclasses

from hypothesis import find as _find
from hypothesis import given, settings
from hypothesis import strategies as st
from splitgrad.properties import strategies as S
from splitgrad.properties.checks import PROPERTIES, case_strategy
from splitgrad.properties.data import make_micro_batches, make_state, param_specs


@given(case=S.cases(dtypes=S.DTYPES))
def test_cases_are_valid_and_under_the_work_cap(case: S.Case) -> None:
    c = case.config
    assert c.kind in S.KINDS and c.in_features >= 1 and c.out_features >= 1
    if c.kind in S.NORM_KINDS:
        assert c.in_features >= 3
    for mb in case.micro_batches:
        if c.kind == "GroupedLinear":
            assert mb.m_splits is not None and len(mb.m_splits) == c.num_gemms
            assert min(mb.m_splits) >= 0 and sum(mb.m_splits) == mb.rows
        else:
            assert mb.m_splits is None and mb.rows >= 1
    rows = sum(mb.rows for mb in case.micro_batches)
    # Rows are drawn under the cap; one row is always allowed even when it alone exceeds it.
    assert rows * c.work_per_row() <= max(S.MAX_WORK, c.work_per_row() * len(case.micro_batches))


@given(case=S.cases())
def test_values_follow_the_seed(case: S.Case) -> None:
    a, b = make_micro_batches(case), make_micro_batches(case)
    for x, y in zip(a, b):
        assert x.x.equal(y.x) and x.dy.equal(y.dy)
        assert x.x.dtype == case.config.torch_dtype
    state = make_state(case.config, case.seed)
    assert [s.name for s in param_specs(case.config)] == list(state)


@given(case=st.one_of(*[case_strategy(p, dtypes=S.DTYPES) for p in PROPERTIES]))
def test_case_json_round_trip(case: S.Case) -> None:
    assert S.Case.from_json(case.to_json()) == case


@given(n=st.integers(1, 5), data=st.data())
def test_schedules_are_legal(n: int, data: st.DataObject) -> None:
    ops = data.draw(S.schedules(n))
    pending = 0
    for op in ops:
        assert op in ("fb", "dw", "zero")
        pending += {"fb": 1, "dw": -1, "zero": 0}[op]
        assert pending >= 0
    assert pending == 0 and ops.count("fb") == n


def test_strategies_reach_the_edge_cases() -> None:
    def find(strategy, condition):
        return _find(strategy, condition, settings=settings(max_examples=2000, database=None))

    grouped = S.cases(kinds=("GroupedLinear",))
    assert find(grouped, lambda c: any(0 in mb.m_splits for mb in c.micro_batches))
    assert find(grouped, lambda c: any(mb.rows == 0 for mb in c.micro_batches))
    assert find(
        S.cases(kinds=("Linear",)),
        lambda c: c.config.in_features == 1 and c.config.out_features == 1,
    )
    assert find(S.cases(), lambda c: c.config.in_features == 13)
    assert find(
        S.cases(kinds=("Linear",)), lambda c: any(len(mb.lead_shape) == 2 for mb in c.micro_batches)
    )
    assert find(S.cases(), lambda c: any(mb.is_first_microbatch for mb in c.micro_batches))
    assert find(case_strategy("P6"), lambda c: "zero" in c.schedule and c.schedule.index("dw") > 1)


def test_bad_values_are_rejected_with_their_name() -> None:
    import pytest

    with pytest.raises(ValueError, match="'Conv'"):
        S.ModuleConfig("Conv", 2, 2)
    with pytest.raises(ValueError, match="'int8'"):
        S.ModuleConfig("Linear", 2, 2, dtype="int8")
    with pytest.raises(ValueError, match="not a splitgrad case"):
        S.Case.from_json('{"nope": 1}')
    assert dataclasses.replace(
        S.ModuleConfig("Linear", 2, 2), dtype="bfloat16"
    ).torch_dtype.is_floating_point
