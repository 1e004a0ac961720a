"""splitgrad's conformance suite as pytest tests (collected by ``pytest --pyargs
splitgrad.properties``; options from :mod:`splitgrad.properties.pytest_plugin`).

The cells, their ids and the gaps in the backend's API come from the same
:class:`~splitgrad.properties.front.session.Session` that ``splitgrad verify`` runs.
``test_api_complete`` fails once when the backend lacks part of SPEC's API (where ``splitgrad
verify`` exits 2); ``test_property`` runs one cell of the campaign per test id. Cells listed in
``--splitgrad-xfails`` are strict expected failures.
"""

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
        marks = []
        declared = [
            d
            for d in session.backend.deviations
            if d.expected_in(cell.property_id, cell.kind, cell.dtype)
        ]
        reasons = []
        if declared:
            summaries = (d.summary + (f" ({d.reference})" if d.reference else "") for d in declared)
            reasons.append("declared deviation: " + " | ".join(summaries))
        entry = listed.get(cell.test_id)
        if entry is not None:
            reasons.append(entry.describe())
        if reasons:
            # A listed cell fails in any way; a declared deviation only the way it declares.
            raises = DeviationObserved if entry is None else None
            marks.append(pytest.mark.xfail(strict=True, raises=raises, reason="; ".join(reasons)))
        params.append(pytest.param(cell, id=cell.test_id, marks=marks))
    metafunc.parametrize("splitgrad_cell", params)


def test_api_complete(request) -> None:
    """The backend has every part of SPEC's API the chosen properties use."""
    from splitgrad.properties.front.xfails import API_COMPLETE

    session = session_of(request.config)
    entry = expected_failures(request.config).get(API_COMPLETE)
    if entry is not None:
        request.applymarker(pytest.mark.xfail(strict=True, reason=entry.describe()))
    gaps = session.gaps
    if gaps:
        lines = [
            f"{what}" + (f" -> blocks {', '.join(blocked)}" if blocked else "")
            for what, blocked in gaps.values()
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
