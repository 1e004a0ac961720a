"""Every property (P1–P13, P17, P18) on every in-process backend, over hypothesis-drawn cases, and
on impl's fast paths that are the default only on a GPU, forced on the CPU.

One test per (backend, property, module kind); dtypes are drawn (float32, bfloat16, float16,
float64; P1–P3 only below float64). FP8: one more test per (backend, property, kind) with the
recipe drawn from all of them per example (few examples outside the ``nightly`` profile; a
backend without FP8 is skipped with the reason). A failure message carries the shrunk case and
the ``splitgrad verify ... --case`` line that replays it. A failure that the backend declares as
a known deviation is an ``xfail`` whose reason is the deviation and the observed message.
Forced paths (``checks/paths.py``): one test per (path, property, kind it applies
to), a few examples each outside ``nightly``; a cell where the path never ran is an error.
torch.autocast (SPEC §2): one test per (backend, autocast property, kind), float32 modules with
every forward under a bf16 autocast, a few examples each outside ``nightly``.
"""

from __future__ import annotations

import pytest
import torch
from cases import available_backend
from splitgrad.properties.backends import get_backend
from splitgrad.properties.cases.profiles import active_profile_name
from splitgrad.properties.cases.strategies import DTYPES, KINDS, RECIPES
from splitgrad.properties.checks.paths import IMPL_PATHS, ForcedPathBackend
from splitgrad.properties.checks.registry import PROPERTIES, applicable
from splitgrad.properties.front.campaign import DEVIATION, NA, PASS, run_cell
from splitgrad.properties.front.plan import AUTOCAST_PROPERTIES, PATH_SLICE_PROPERTIES

BACKENDS = ("reference", "impl", "torch-split")
FP8_BACKENDS = ("reference", "impl")
# Aligned FP8 shapes are 32-128 wide: a few examples per cell in CI, the profile's in nightly.
FP8_EXAMPLES = None if active_profile_name() == "nightly" else 6
PATH_EXAMPLES = None if active_profile_name() == "nightly" else 8
AUTOCAST_EXAMPLES = None if active_profile_name() == "nightly" else 6
AUTOCAST_BACKENDS = ("reference", "impl")


def _cells(backends, properties, tag: str) -> list:
    """One test per (backend, property, module kind it applies to), named
    ``{backend}-{tag}{property}-{kind}``."""
    return [
        pytest.param(b, pid, kind, id=f"{b}-{tag}{pid}-{kind}")
        for b in backends
        for pid in properties
        for kind in KINDS
        if applicable(pid, kind)
    ]


CELLS = _cells(BACKENDS, [pid for pid in PROPERTIES if pid != "P13"], "")
FP8_CELLS = _cells(FP8_BACKENDS, PROPERTIES, "fp8-")
AUTOCAST_CELLS = _cells(AUTOCAST_BACKENDS, AUTOCAST_PROPERTIES, "autocast-")


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


def _check_cell(backend, backend_name, property_id, kind, dtype, na: str, **options) -> None:
    """Run one cell under the active profile and judge it: skip an n/a cell (``na`` says
    which), xfail a deviation the backend declares; any other cell must pass, with examples
    judged."""
    cell = run_cell(backend, property_id, kind, dtype, profile=active_profile_name(), **options)
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
    backend = available_backend(backend_name)
    na = f"{property_id} n/a on {backend_name}"
    _check_cell(backend, backend_name, property_id, kind, "any", na, dtypes=DTYPES)


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), FP8_CELLS)
def test_property_fp8(backend_name: str, property_id: str, kind: str) -> None:
    backend = available_backend(backend_name)
    na = f"{property_id} under FP8 n/a on {backend_name}"
    fp8 = dict(examples=FP8_EXAMPLES, recipes=tuple(RECIPES), recipe_label="all")
    dtypes = ("float32", "bfloat16", "float16")
    _check_cell(backend, backend_name, property_id, kind, "any", na, dtypes=dtypes, **fp8)


@pytest.mark.parametrize(("path", "property_id", "kind"), PATH_CELLS)
def test_property_forced_path(path: str, property_id: str, kind: str) -> None:
    forced = IMPL_PATHS[path]
    backend = ForcedPathBackend(available_backend("impl"), path)
    na = f"{property_id} on path {path} n/a"
    recipes = dict(
        recipes=forced.recipes or (None,), recipe_label="all" if forced.recipes else None
    )
    options = dict(dtypes=forced.dtypes, examples=PATH_EXAMPLES, **recipes)
    _check_cell(backend, "impl", property_id, kind, "any", na, **options)


@pytest.mark.parametrize(("backend_name", "property_id", "kind"), AUTOCAST_CELLS)
def test_property_autocast(backend_name: str, property_id: str, kind: str) -> None:
    backend = get_backend(backend_name)
    na = f"{property_id} under autocast n/a on {backend_name}"
    options = dict(examples=AUTOCAST_EXAMPLES, autocast="bfloat16")
    _check_cell(backend, backend_name, property_id, kind, "float32", na, **options)
