"""Every property P1–P13 on every in-process backend, over hypothesis-drawn cases.

One test per (backend, property, module kind); dtypes are drawn (float32, bfloat16, float16,
float64; P1–P3 only below float64). FP8: one more test per (backend, property, kind) with the
recipe drawn from all of them per example (few examples outside the ``nightly`` profile; a
backend without FP8 is skipped with the reason). A failure message carries the shrunk case and
the ``splitgrad verify ... --case`` line that replays it. A failure that the backend declares as
a known deviation is an ``xfail`` whose reason is the deviation and the observed message.
"""

from __future__ import annotations

import pytest
from splitgrad.properties.backends import get_backend
from splitgrad.properties.campaign import DEVIATION, NA, PASS, run_cell
from splitgrad.properties.profiles import active_profile_name
from splitgrad.properties.registry import PROPERTIES, applicable
from splitgrad.properties.strategies import DTYPES, KINDS, RECIPES

BACKENDS = ("reference", "impl", "torch-split")
FP8_BACKENDS = ("reference", "impl")
# Aligned FP8 shapes are 32-128 wide: a few examples per cell in CI, the profile's in nightly.
FP8_EXAMPLES = None if active_profile_name() == "nightly" else 6

CELLS = [
    pytest.param(b, pid, kind, id=f"{b}-{pid}-{kind}")
    for b in BACKENDS
    for pid in PROPERTIES
    for kind in KINDS
    if applicable(pid, kind) and pid != "P13"
]
FP8_CELLS = [
    pytest.param(b, pid, kind, id=f"{b}-fp8-{pid}-{kind}")
    for b in FP8_BACKENDS
    for pid in PROPERTIES
    for kind in KINDS
    if applicable(pid, kind)
]


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), CELLS)
def test_property(backend_name: str, property_id: str, kind: str) -> None:
    backend = get_backend(backend_name)
    why = backend.unavailable_reason()
    if why:
        pytest.skip(why)
    cell = run_cell(backend, property_id, kind, "any", dtypes=DTYPES, profile=active_profile_name())
    if cell.status == NA:
        pytest.skip(f"{property_id} n/a on {backend_name}: {cell.message}")
    if cell.status == DEVIATION:
        pytest.xfail(
            f"known deviation of {backend_name}: {cell.deviation} | observed: {cell.message[:300]}"
        )
    assert cell.status == PASS, f"{cell.message}\nreproduce: {cell.repro}"
    assert cell.examples > 0


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), FP8_CELLS)
def test_property_fp8(backend_name: str, property_id: str, kind: str) -> None:
    backend = get_backend(backend_name)
    why = backend.unavailable_reason()
    if why:
        pytest.skip(why)
    cell = run_cell(
        backend,
        property_id,
        kind,
        "any",
        dtypes=("float32", "bfloat16", "float16"),
        examples=FP8_EXAMPLES,
        profile=active_profile_name(),
        recipes=tuple(RECIPES),
        recipe_label="all",
    )
    if cell.status == NA:
        pytest.skip(f"{property_id} under FP8 n/a on {backend_name}: {cell.message}")
    if cell.status == DEVIATION:
        pytest.xfail(
            f"known deviation of {backend_name}: {cell.deviation} | observed: {cell.message[:300]}"
        )
    assert cell.status == PASS, f"{cell.message}\nreproduce: {cell.repro}"
    assert cell.examples > 0
