"""The torch minimums stated across the tree agree: the eager minimum of ``pyproject.toml``'s
dependency is the one the CI scripts accept before installing a torch of their own, and the one
README.md, docs/torch-matrix.md and ci/torch_matrix.sh state; the ``torch.compile`` minimum of
``_torch_compat.MINIMUM`` is the one the docs state."""

from __future__ import annotations

import re
from pathlib import Path

from splitgrad.impl import _torch_compat

ROOT = Path(__file__).resolve().parent.parent


def _eager_minimum() -> str:
    # (tomllib is 3.11+; the project supports 3.10)
    deps = re.search(r"^dependencies = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M)
    assert deps, "pyproject.toml has no dependencies line"
    (spec,) = [d for d in re.findall(r'"([^"]+)"', deps.group(1)) if re.match(r"torch\b", d)]
    found = re.fullmatch(r"torch\s*>=\s*(\d+\.\d+)", spec)
    assert found, f"pyproject.toml's torch requirement {spec!r} is no plain minimum"
    return found.group(1)


def test_ci_scripts_accept_the_torch_pyproject_requires() -> None:
    minimum = _eager_minimum()
    as_tuple = "({}, {})".format(*minimum.split("."))
    scripts = sorted((ROOT / "ci").glob("*.sh"))
    checked = 0
    for script in scripts:
        text = script.read_text()
        for check in re.findall(r"torch\.__version__[^']*?<\s*(\(\d+,\s*\d+\))", text):
            assert check == as_tuple, f"{script.name} accepts torch from {check}, not {minimum}"
            checked += 1
        for said in re.findall(r"usable torch \(>= (\d+\.\d+)", text):
            assert said == minimum, f"{script.name} says torch >= {said}, not {minimum}"
    assert checked >= 2, "ci/cpu.sh and ci/nightly.sh no longer check the installed torch"


def test_docs_state_the_same_minimums() -> None:
    eager, compiled = _eager_minimum(), _torch_compat.MINIMUM["torch.compile support"]
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"Any torch ≥ {eager} works for the modules and the harness" in readme
    assert f"(`torch.compile` needs {compiled}," in readme
    matrix = (ROOT / "docs" / "torch-matrix.md").read_text()
    assert f"`pyproject.toml` states `torch>={eager}`" in matrix
    assert f"| ≥ {eager} | the eager modules and the harness |" in matrix
    assert f"| ≥ {compiled} | `torch.compile` support" in matrix
    script = (ROOT / "ci" / "torch_matrix.sh").read_text()
    assert re.search(rf"eager minimum\s+{re.escape(eager)}\s", script)
    assert re.search(rf"torch\.compile minimum\s+{re.escape(compiled)}\s", script)
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f"Eager modules: torch >= {eager}" in pyproject
    assert f"torch.compile support needs {compiled}" in pyproject
