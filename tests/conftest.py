"""Shared fixtures: the module source under test, hypothesis profiles, CUDA skipping, and
torch's deterministic mode with uninitialized memory filled for the whole suite (a test that
needs it off is marked ``nondeterministic``)."""

from __future__ import annotations

import importlib

import pytest
import torch
from splitgrad.properties.cases.profiles import load_profile
from splitgrad.properties.front.campaign import deterministic

load_profile()

# Contract tests run against every module source listed here with the same test code.
MODULE_SOURCES = ["reference", "impl"]


def load_source(name: str):
    lib = importlib.import_module(f"splitgrad.{name}")
    if not hasattr(lib, "Linear"):
        pytest.skip(f"splitgrad.{name} does not export the modules yet")
    return lib


@pytest.fixture(params=MODULE_SOURCES)
def lib(request):
    """The module namespace under test (``splitgrad.reference`` or ``splitgrad.impl``)."""
    return load_source(request.param)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "nondeterministic: runs with torch's deterministic mode and uninitialized-memory fill off "
        "(the rest of the suite has them on)",
    )


@pytest.fixture(scope="session", autouse=True)
def deterministic_torch():
    """A read of uninitialized memory (``torch.empty`` nobody wrote) fails every run of every
    test, as it does under ``splitgrad verify`` (SPEC §7), instead of passing on a machine whose
    allocator hands back zeros."""
    with deterministic():
        yield


@pytest.fixture(autouse=True)
def _nondeterministic_way_out(request):
    """Tests marked ``nondeterministic`` run with the deterministic mode off."""
    if request.node.get_closest_marker("nondeterministic") is None:
        yield
        return
    with deterministic(False):
        yield
