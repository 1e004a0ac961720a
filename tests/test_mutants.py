"""The mutation check as a slow test: every deliberate bug in a copy of impl is caught."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_every_mutant_is_caught_under_the_ci_profile() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ci" / "mutants.py"), "--profile", "ci"],
        capture_output=True,
        text=True,
        timeout=3000,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mutant_edits_still_apply(tmp_path: Path) -> None:
    """Cheap guard: impl changed under a mutant's edit -> update ci/mutants.py."""
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    if not (ROOT / "impl" / "base.py").exists():
        pytest.skip("impl is not written yet")
    import py_compile

    for m in mutants.ALL_MUTANTS:
        why = mutants.apply(m, tmp_path / m.name)
        assert why is None, f"{m.name}: {why}"
        # An edit that applies must also leave valid Python (indentation included).
        for rel in {rel for rel, _, _ in m.edits}:
            py_compile.compile(str(tmp_path / m.name / rel), doraise=True)
