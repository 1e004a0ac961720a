"""Every property P1–P12 on every in-process backend, over hypothesis-drawn cases.

One test per (backend, property, module kind); dtypes are drawn (float32, bfloat16, float16,
float64; P1–P3 only below float64). A failure message carries the shrunk case and the
``splitgrad verify ... --case`` line that replays it. A failure that the backend declares as a
known deviation is an ``xfail`` whose reason is the deviation and the observed message.
"""

from __future__ import annotations

import pytest
from splitgrad.properties.backends import get_backend
from splitgrad.properties.campaign import DEVIATION, NA, PASS, run_cell
from splitgrad.properties.checks import PROPERTIES, applicable
from splitgrad.properties.profiles import active_profile_name
from splitgrad.properties.strategies import DTYPES, KINDS

BACKENDS = ("reference", "impl", "torch-split")

CELLS = [
    pytest.param(b, pid, kind, id=f"{b}-{pid}-{kind}")
    for b in BACKENDS
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
