"""splitgrad's conformance suite as pytest tests (:mod:`splitgrad.properties.pytest_plugin`): the
cells, ids and API gaps of ``splitgrad verify``'s session; ``--splitgrad-xfails`` are strict."""

from __future__ import annotations

import pytest
from splitgrad.properties.pytest_plugin import expected_failures, session_of


class DeviationObserved(AssertionError):
    """A cell failed the way its backend declares it deviates from SPEC.md."""


def pytest_generate_tests(metafunc) -> None:
    if "splitgrad_cell" not in metafunc.fixturenames:
        return
    session = session_of(metafunc.config)
    listed = expected_failures(metafunc.config)
    params = []
    for cell in session.cells:
        declared = [
            d.summary + (f" ({d.reference})" if d.reference else "")
            for d in session.backend.deviations
            if d.expected_in(cell.property_id, cell.kind, cell.dtype)
        ]
        reasons = ["declared deviation: " + " | ".join(declared)] if declared else []
        entry = listed.get(cell.test_id)
        reasons += [entry.describe()] if entry is not None else []
        # A listed cell fails in any way; a declared deviation only the way it declares.
        raises = DeviationObserved if entry is None else None
        xfail = pytest.mark.xfail(strict=True, raises=raises, reason="; ".join(reasons))
        params.append(pytest.param(cell, id=cell.test_id, marks=[xfail] if reasons else []))
    metafunc.parametrize("splitgrad_cell", params)


def test_api_complete(request) -> None:
    """The backend has every part of SPEC's API the chosen properties use."""
    from splitgrad.properties.front.xfails import API_COMPLETE

    session = session_of(request.config)
    entry = expected_failures(request.config).get(API_COMPLETE)
    if entry is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=entry.describe()))
    if session.gaps:
        lines = [
            what + (f" -> blocks {', '.join(blocked)}" if blocked else "")
            for what, blocked in session.gaps.values()
        ]
        pytest.fail(
            f"{session.backend.name} lacks part of SPEC's API (the cells that need it are "
            "skipped):\n  " + "\n  ".join(lines),
            pytrace=False,
        )


def test_property(splitgrad_cell, request) -> None:
    """One cell: a hypothesis campaign of one property on one module kind and dtype."""
    from splitgrad.properties.front.campaign import BLOCKED, DEVIATION, NA, PASS

    session = session_of(request.config)
    cell = session.run(splitgrad_cell)
    if cell.status == NA:
        pytest.skip(f"n/a: {cell.message}")
    if cell.status == BLOCKED:
        pytest.skip(f"blocked (see test_api_complete): {cell.message}")
    if cell.status == DEVIATION:
        text = f"{cell.deviation} | observed: {cell.message[:500]}\nreproduce: {cell.repro}"
        if request.node.get_closest_marker("xfail") is not None:
            raise DeviationObserved(text)
        pytest.xfail(f"known deviation of {session.backend.name}: {text}")
    if cell.status != PASS:
        where = f"after {cell.first_failure_at} example(s)" if cell.first_failure_at else ""
        pytest.fail(
            f"{cell.status} {splitgrad_cell.test_id} {where}\n{cell.message}\n"
            f"reproduce: {cell.repro}",
            pytrace=False,
        )
    assert cell.examples > 0, f"{splitgrad_cell.test_id}: no example was judged"
