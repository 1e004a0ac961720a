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


#: Edits whose anchor text is meant to match several places (the same bug planted in each copy
#: of the line), by (mutant, file, edit index): how many. Every other edit matches exactly once.
SEVERAL_PLACES = {
    ("bias-in-backward", "linear.py", 1): 2,
    ("wgrad-operands-swapped", "gemm.py", 0): 3,
    ("wgrad-operands-swapped", "gemm.py", 1): 2,
    ("backward-reads-module-weight", "linear.py", 0): 3,
}


def test_mutant_edits_land_where_they_were_written_for() -> None:
    """``str.replace`` plants an edit at every match of its anchor: when impl's text changes, an
    anchor can stop matching the function it was written for and still match a copy of the same
    lines elsewhere (two mutants moved to the tensor-parallel copy of ``linear_wgrad``'s lines
    that way and survived). So the number of matches is pinned: a change means re-reading where
    the edit lands."""
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    for m in mutants.ALL_MUTANTS:
        for i, (rel, old, _) in enumerate(m.edits):
            text = (ROOT / m.package / rel).read_text()
            want = SEVERAL_PLACES.get((m.name, rel, i), 1)
            assert text.count(old) == want, (
                f"{m.name}: edit {i} of {rel} matches {text.count(old)} places, expected {want}: "
                "check where it lands, then update SEVERAL_PLACES or the anchor"
            )
