"""pytest plugin (a ``pytest11`` entry point): ``pytest --pyargs splitgrad.properties
--splitgrad-backend module:mypkg`` collects ``test_conformance.py``, the cells of the session
``splitgrad verify`` runs under the same ids (docs/harness.md). Only options are registered at
start-up: torch and hypothesis are imported when the suite is asked for.
"""

from __future__ import annotations

import functools
import os

__all__ = ["options_of", "session_options", "session_of", "expected_failures", "suite_requested"]

#: ``--splitgrad-NAME`` -> its help; every default is empty but those of :data:`_DEFAULTS`.
_OPTIONS = {
    "backend": "implementation to check: impl, reference, torch-split, transformer_engine, "
    "path:DIR, module:NAME or class:MODULE:ATTR (a Backend subclass) (default: impl)",
    "module": "module kinds, comma-separated (default: all four)",
    "dtype": "dtypes, comma-separated (default: float32,bfloat16)",
    "property": "property ids, comma-separated (default: all)",
    "recipe": "FP8 recipe families: none, delayed, current, mxfp8, block, all (default: high "
    "precision plus a small FP8 slice)",
    "impl-path": "forced fast paths: none, grouped, scaled_mm, recompute, norm_cuda, mxfp8_scaled, "
    "all (default: a small "
    "slice of each where the backend has the knob)",
    "autocast": "torch.autocast dtypes for float32 modules: none, bfloat16, float16, all "
    "(default: a small bfloat16 slice)",
    "examples": "hypothesis examples per cell (default: the profile's; the slices run fewer)",
    "profile": "hypothesis profile: dev, ci, nightly, gpu (default: HYPOTHESIS_PROFILE, or ci "
    "when CI is set, else dev)",
    "seed": "hypothesis seed (default: the profile's; ci is derandomized)",
    "device": "cpu or cuda (default: cpu; cuda for transformer_engine)",
    "threads": "torch intra-op threads per test process (default: 1)",
    "xfails": "file of cells expected to fail, one cell id per line (P4-Linear-bfloat16-none, "
    "as the test ids show it), '#' comments with the reason; strict: a listed cell that passes "
    "fails as XPASS(strict)",
}
_DEFAULTS = {"backend": "impl", "threads": "1"}


def pytest_addoption(parser) -> None:
    group = parser.getgroup("splitgrad", "splitgrad conformance suite (SPEC.md properties)")
    for name, help_text in _OPTIONS.items():
        group.addoption(f"--splitgrad-{name}", default=_DEFAULTS.get(name, ""), help=help_text)


def options_of(config) -> dict[str, str]:
    """The suite's options as strings by name; hypothesis' own ``--hypothesis-profile`` and
    ``--hypothesis-seed`` fill in a profile and seed not given."""
    out = {name: str(config.getoption(f"--splitgrad-{name}") or "") for name in _OPTIONS}
    for key, theirs in (("profile", "hypothesis_profile"), ("seed", "hypothesis_seed")):
        if not out[key]:
            value = config.getoption(theirs, default=None)
            out[key] = "" if value is None else str(value)
    return out


def session_options(config):
    """The suite's :class:`~.front.session.Options` (a bad value is a usage error naming it)."""
    import pytest

    from .front.session import LIST_OPTIONS, OptionError, Options

    opts = options_of(config)

    def number(key: str) -> int | None:
        try:
            return int(opts[key]) if opts[key] else None
        except ValueError:
            value = opts[key]
            raise pytest.UsageError(f"--splitgrad-{key}: not a whole number: {value!r}") from None

    try:
        return Options.chosen(
            {flag: [opts[flag]] if opts[flag] else [] for flag in LIST_OPTIONS},
            backend=opts["backend"],
            examples=number("examples"),
            profile=opts["profile"] or None,
            seed=number("seed"),
            device=opts["device"] or None,
            threads=number("threads") or 1,
        )
    except OptionError as exc:
        raise pytest.UsageError(f"--splitgrad-{exc.option}: {exc}") from None


def session_of(config):
    """The :class:`~.front.session.Session` of this run's options (opened once per process)."""
    return _open_session(session_options(config))


@functools.cache
def _open_session(options):
    import pytest

    from .front.session import OptionError, Session

    try:
        return Session.open(options)
    except OptionError as exc:
        raise pytest.UsageError(f"--splitgrad-backend: {exc}") from None


def suite_requested(config) -> bool:
    """Whether this pytest run asked for the conformance suite (a ``--splitgrad-*`` option, or
    ``splitgrad.properties`` / ``test_conformance.py`` among the arguments)."""
    args = [str(a) for a in config.invocation_params.args] + [str(a) for a in config.args]
    if any(a.startswith("--splitgrad-") for a in args):
        return True
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [str(a).split("::", 1)[0] for a in config.args]
    return any(
        a.startswith("splitgrad.properties")
        or os.path.abspath(a) == here
        or os.path.basename(a) == "test_conformance.py"
        for a in paths
    )


def pytest_configure(config) -> None:
    """Check the suite's options and read ``--splitgrad-xfails`` once, before collection."""
    if suite_requested(config):
        session_options(config)
    path = config.getoption("--splitgrad-xfails", default="")
    if not path:
        return
    import pytest

    from .front.xfails import XfailsFileError, load_xfails

    absolute = os.path.abspath(path)
    try:
        config._splitgrad_xfails = load_xfails(absolute)
    except XfailsFileError as exc:
        raise pytest.UsageError(f"--splitgrad-xfails: {exc}") from None
    # pytest-xdist hands the controller's options to its workers: they read the same file.
    config.option.splitgrad_xfails = absolute


def expected_failures(config) -> dict:
    """The entries of ``--splitgrad-xfails`` by canonical test id (empty without the option)."""
    return getattr(config, "_splitgrad_xfails", {})


def _backend_location(name: str) -> str:
    """Where the backend's code comes from, without importing it (empty when unknown)."""
    import importlib.util

    if name.startswith("path:"):
        return os.path.abspath(name[len("path:") :])
    target = {"impl": "splitgrad.impl", "reference": "splitgrad.reference"}.get(name)
    if name.startswith(("module:", "class:")):
        target = name.split(":", 2)[1]
    try:
        spec = importlib.util.find_spec(target) if target else None
    except (ImportError, ValueError) as exc:
        return f"not importable: {type(exc).__name__}: {exc}"
    if spec is None:
        return "not importable: no such module" if target else ""
    return spec.origin or ", ".join(spec.submodule_search_locations or ())


def pytest_report_header(config) -> list[str]:
    """The backend under test, device, profile, seed and torch's version, when the suite runs."""
    if not suite_requested(config):
        return []
    import torch

    from .cases.profiles import active_profile_name
    from .front.session import Options

    opts = options_of(config)
    backend = opts["backend"]
    where = _backend_location(backend)
    device = Options(backend=backend, device=opts["device"] or None).device_name
    if device == "cuda" and torch.cuda.is_available():
        device += f" ({torch.cuda.get_device_name()})"
    elif device == "cuda":
        device += " (torch.cuda.is_available() is False)"
    profile = opts["profile"] or active_profile_name()
    seed = opts["seed"] or "the profile's"
    lines = [
        f"splitgrad conformance: backend {backend}" + (f" ({where})" if where else ""),
        f"  device {device}, hypothesis profile {profile}, seed {seed}, torch {torch.__version__}"
        f", {opts['threads'] or 1} thread(s) per process",
    ]
    if opts["xfails"]:
        n = len(expected_failures(config))
        lines.append(f"  expected failures: {opts['xfails']} ({n} listed, strict)")
    return lines
