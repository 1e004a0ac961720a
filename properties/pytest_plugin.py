"""pytest plugin: run splitgrad's conformance suite against any implementation, in its own CI.

Installed with splitgrad (a ``pytest11`` entry point), so in a project with SPEC §2's API:

    pytest --pyargs splitgrad.properties --splitgrad-backend module:mypkg -n auto \\
        --junitxml=conformance.xml

collects ``splitgrad/properties/test_conformance.py``: one test per property x module x dtype x
FP8 recipe family (x forced fast path), with the ids and cells of ``splitgrad verify`` (the same
plan, :mod:`.plan`), e.g. ``test_property[P4-Linear-bfloat16-none]``. A deviation the backend
declares (:attr:`~.backends.Backend.deviations`) makes its cells strict expected failures with
its sentence as the reason (a declared deviation that no longer shows fails as XPASS). Parts of
SPEC's API the backend lacks fail one test, ``test_api_complete``, naming them and the
properties they block; the blocked cells are skipped, the others run. Nothing is shared between
tests but read-only options, so ``pytest-xdist`` can spread them.

Only options are registered here (no import of torch or hypothesis at pytest start-up): the
plugin costs nothing in a test run that does not collect the suite.
"""

from __future__ import annotations

__all__ = ["pytest_addoption", "options_of"]

_OPTIONS = (
    (
        "--splitgrad-backend",
        "impl",
        "implementation to check: impl, reference, torch-split, transformer_engine, path:DIR, "
        "module:NAME or class:MODULE:ATTR (a Backend subclass) (default: impl)",
    ),
    ("--splitgrad-module", "", "module kinds, comma-separated (default: all four)"),
    ("--splitgrad-dtype", "", "dtypes, comma-separated (default: float32,bfloat16)"),
    ("--splitgrad-property", "", "property ids, comma-separated (default: all)"),
    (
        "--splitgrad-recipe",
        "",
        "FP8 recipe families: none, delayed, current, mxfp8, block, all (default: high "
        "precision plus a small FP8 slice)",
    ),
    (
        "--splitgrad-impl-path",
        "",
        "forced fast paths: none, grouped, scaled_mm, recompute, all (default: a small slice of "
        "each where the backend has the knob)",
    ),
    (
        "--splitgrad-examples",
        "",
        "hypothesis examples per cell (default: the profile's; the slices run fewer)",
    ),
    (
        "--splitgrad-profile",
        "",
        "hypothesis profile: dev, ci, nightly, gpu (default: HYPOTHESIS_PROFILE, or ci when "
        "CI is set, else dev)",
    ),
    ("--splitgrad-seed", "", "hypothesis seed (default: the profile's; ci is derandomized)"),
    ("--splitgrad-device", "", "cpu or cuda (default: cpu; cuda for transformer_engine)"),
    ("--splitgrad-threads", "1", "torch intra-op threads per test process (default: 1)"),
)


def pytest_addoption(parser) -> None:
    group = parser.getgroup("splitgrad", "splitgrad conformance suite (SPEC.md properties)")
    for flag, default, help_text in _OPTIONS:
        group.addoption(flag, default=default, help=help_text)


def options_of(config) -> dict[str, str]:
    """The suite's options as strings, keyed without the ``--splitgrad-`` prefix. Hypothesis'
    own ``--hypothesis-profile`` / ``--hypothesis-seed`` fill in a profile / seed not given."""
    out = {}
    for flag, _, _ in _OPTIONS:
        key = flag[len("--splitgrad-") :]
        out[key] = str(config.getoption(flag) or "")
    for key, theirs in (("profile", "hypothesis_profile"), ("seed", "hypothesis_seed")):
        if not out[key]:
            value = config.getoption(theirs, default=None)
            out[key] = "" if value is None else str(value)
    return out
