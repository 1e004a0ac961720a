"""The README's first example ("Using it") runs as written: saved as a script and run with
``python`` in a fresh process, from a directory outside the checkout."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def using_it_example() -> str:
    """The first ``python`` code block under the README's "## Using it" heading."""
    text = README.read_text()
    section = text.split("\n## Using it\n", 1)
    if len(section) != 2:
        raise LookupError(f"{README} has no '## Using it' section")
    match = re.search(r"```python\n(.*?)```", section[1].split("\n## ", 1)[0], re.S)
    if match is None:
        raise LookupError(f"{README}: no python code block under '## Using it'")
    return match.group(1)


def test_using_it_runs_as_written(tmp_path: Path) -> None:
    code = using_it_example()
    # The example defines its own inputs and communication stand-in, and checks its own result.
    for name in ("x =", "dy =", "def start_all_to_all", "mlp.backward_dw()", "assert "):
        assert name in code, name
    script = tmp_path / "using_it.py"
    script.write_text(
        code + "\nprint('main_grad filled:', float(mlp.fc2_weight.main_grad.abs().sum()) > 0)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "main_grad filled: True" in proc.stdout
