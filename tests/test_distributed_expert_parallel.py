"""P14 (SPEC §8): ``splitgrad.distributed.ExpertParallelMoE`` over 2 spawned gloo ranks gives the
single-process gradients — experts bitwise, their ``backward_dw()`` run while the dispatch
all-to-all of the backward is in flight — next to a data-parallel projection reduced by a
``GradientReducer`` that leaves the experts alone (P16)."""

from __future__ import annotations

import importlib

import pytest
import torch
from splitgrad.distributed import ExpertParallelMoE, run_ranks
from splitgrad.properties.checks.distributed import check_expert_parallel

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("lib_name", ["splitgrad.impl", "splitgrad.reference"])
def test_p14_matches_single_process(lib_name):
    report = check_expert_parallel(lib_name)
    report.raise_if_failed()
    assert report.compared > 0


def _bad_inputs(rank: int, world: int) -> list[str]:
    lib = importlib.import_module("splitgrad.impl")
    moe = ExpertParallelMoE(lib.GroupedLinear(2, 4, 4))
    out = []
    for x, idx in (
        (torch.randn(3, 4), torch.tensor([0, 1, 4])),  # expert 4 of 4
        (torch.randn(3, 4), torch.tensor([0, 1])),  # wrong length
    ):
        try:
            moe(x, idx)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    for experts in (lib.Linear(4, 4), lib.GroupedLinear(2, 4, 8)):
        try:
            ExpertParallelMoE(experts)
            out.append("no error")
        except (TypeError, ValueError) as exc:
            out.append(str(exc))
    return out


def test_moe_rejects_bad_input_before_any_collective():
    (errors,) = run_ranks(_bad_inputs, 1, timeout_s=60)
    assert "[0, 2)" in errors[0] and "[0, 4]" in errors[0]
    assert "(3,)" not in errors[1] and "(2,)" in errors[1]
    assert "GroupedLinear" in errors[2]
    assert "in_features=4, out_features=8" in errors[3]
