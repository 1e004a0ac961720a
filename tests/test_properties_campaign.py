"""Every property (P1–P13, P17, P18) on every in-process backend, over hypothesis-drawn cases, and
on impl's fast paths that are the default only on a GPU, forced on the CPU.

One test per (backend, property, module kind); dtypes are drawn (float32, bfloat16, float16,
float64; P1–P3 only below float64). FP8: one more test per (backend, property, kind) with the
recipe drawn from all of them per example (few examples outside the ``nightly`` profile; a
backend without FP8 is skipped with the reason). A failure message carries the shrunk case and
the ``splitgrad verify ... --case`` line that replays it. A failure that the backend declares as
a known deviation is an ``xfail`` whose reason is the deviation and the observed message.
Forced paths (:mod:`splitgrad.properties.paths`): one test per (path, property, kind it applies
to), a few examples each outside ``nightly``; a cell where the path never ran is an error.
torch.autocast (SPEC §2): one test per (backend, autocast property, kind), float32 modules with
every forward under a bf16 autocast, a few examples each outside ``nightly``.
"""

from __future__ import annotations

import pytest
import torch
from splitgrad.properties.backends import get_backend
from splitgrad.properties.campaign import DEVIATION, NA, PASS, run_cell
from splitgrad.properties.paths import IMPL_PATHS, ForcedPathBackend
from splitgrad.properties.plan import AUTOCAST_PROPERTIES, PATH_SLICE_PROPERTIES
from splitgrad.properties.profiles import active_profile_name
from splitgrad.properties.registry import PROPERTIES, applicable
from splitgrad.properties.strategies import DTYPES, KINDS, RECIPES

BACKENDS = ("reference", "impl", "torch-split")
FP8_BACKENDS = ("reference", "impl")
# Aligned FP8 shapes are 32-128 wide: a few examples per cell in CI, the profile's in nightly.
FP8_EXAMPLES = None if active_profile_name() == "nightly" else 6
PATH_EXAMPLES = None if active_profile_name() == "nightly" else 8
AUTOCAST_EXAMPLES = None if active_profile_name() == "nightly" else 6
AUTOCAST_BACKENDS = ("reference", "impl")

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


AUTOCAST_CELLS = [
    pytest.param(b, pid, kind, id=f"{b}-autocast-{pid}-{kind}")
    for b in AUTOCAST_BACKENDS
    for pid in AUTOCAST_PROPERTIES
    for kind in KINDS
    if applicable(pid, kind)
]


PATH_CELLS = [
    pytest.param(path.name, pid, kind, id=f"impl-{path.name}-{pid}-{kind}")
    for path in IMPL_PATHS.values()
    for pid in (*PATH_SLICE_PROPERTIES, *(("P13",) if path.recipes else ()))
    for kind in KINDS
    if applicable(pid, kind) and path.applies(kind)
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread per xdist worker (no oversubscription)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _available(name: str):
    backend = get_backend(name)
    why = backend.unavailable_reason()
    if why:
        pytest.skip(why)
    return backend


def _judge(cell, na: str, backend_name: str) -> None:
    """Skip an n/a cell (``na`` says which), xfail a deviation the backend declares; any other
    cell must pass, with examples judged."""
    if cell.status == NA:
        pytest.skip(f"{na}: {cell.message}")
    if cell.status == DEVIATION:
        pytest.xfail(
            f"known deviation of {backend_name}: {cell.deviation} | observed: {cell.message[:300]}"
        )
    assert cell.status == PASS, f"{cell.message}\nreproduce: {cell.repro}"
    assert cell.examples > 0


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), CELLS)
def test_property(backend_name: str, property_id: str, kind: str) -> None:
    backend = _available(backend_name)
    cell = run_cell(backend, property_id, kind, "any", dtypes=DTYPES, profile=active_profile_name())
    _judge(cell, f"{property_id} n/a on {backend_name}", backend_name)


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), FP8_CELLS)
def test_property_fp8(backend_name: str, property_id: str, kind: str) -> None:
    cell = run_cell(
        _available(backend_name),
        property_id,
        kind,
        "any",
        dtypes=("float32", "bfloat16", "float16"),
        examples=FP8_EXAMPLES,
        profile=active_profile_name(),
        recipes=tuple(RECIPES),
        recipe_label="all",
    )
    _judge(cell, f"{property_id} under FP8 n/a on {backend_name}", backend_name)


@pytest.mark.parametrize(("path", "property_id", "kind"), PATH_CELLS)
def test_property_forced_path(path: str, property_id: str, kind: str) -> None:
    forced = IMPL_PATHS[path]
    cell = run_cell(
        ForcedPathBackend(_available("impl"), path),
        property_id,
        kind,
        "any",
        dtypes=forced.dtypes,
        examples=PATH_EXAMPLES,
        profile=active_profile_name(),
        recipes=forced.recipes or (None,),
        recipe_label="all" if forced.recipes else None,
    )
    _judge(cell, f"{property_id} on path {path} n/a", "impl")


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), AUTOCAST_CELLS)
def test_property_autocast(backend_name: str, property_id: str, kind: str) -> None:
    cell = run_cell(
        get_backend(backend_name),
        property_id,
        kind,
        "float32",
        examples=AUTOCAST_EXAMPLES,
        profile=active_profile_name(),
        autocast="bfloat16",
    )
    _judge(cell, f"{property_id} under autocast n/a on {backend_name}", backend_name)
