"""Shared fixtures: the module source under test, hypothesis profiles, CUDA skipping."""

from __future__ import annotations

import importlib

import pytest
import torch
from splitgrad.properties.profiles import load_profile

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
