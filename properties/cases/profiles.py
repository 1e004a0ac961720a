"""Hypothesis profiles: ``dev``, ``ci``, ``nightly``, ``gpu``.

Chosen by ``HYPOTHESIS_PROFILE``; ``ci`` when the ``CI`` variable is set, ``dev`` otherwise.
``ci`` is derandomized so a red run reproduces; every profile has ``deadline=None`` because one
example runs several GEMMs and the first call of a kernel can be slow.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

settings.register_profile("dev", max_examples=20, **_COMMON)
settings.register_profile("ci", max_examples=30, derandomize=True, print_blob=True, **_COMMON)
settings.register_profile("nightly", max_examples=500, **_COMMON)
settings.register_profile("gpu", max_examples=100, derandomize=True, print_blob=True, **_COMMON)


def active_profile_name() -> str:
    """The profile this process should use."""
    return os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def load_profile() -> str:
    """Load and return the active profile."""
    settings.load_profile(name := active_profile_name())
    return name
