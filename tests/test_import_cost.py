"""What importing splitgrad costs beyond torch: no Dynamo (``torch._dynamo``, about as long to
import as torch itself) until a graph is traced, checked in fresh interpreters (the test
session has long since imported it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHECK = """
import sys
import {module}
loaded = sorted(m for m in ("torch._dynamo", "torch._inductor") if m in sys.modules)
print(",".join(loaded) or "none")
"""


def _loaded_after(module: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _CHECK.format(module=module)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


@pytest.mark.parametrize(
    "module",
    ["splitgrad.impl", "splitgrad.reference", "splitgrad.cli"],
)
def test_import_does_not_load_dynamo(module: str) -> None:
    assert _loaded_after(module) == "none"


def test_impl_imports_nothing_beyond_torch_but_its_own_modules() -> None:
    """After ``import torch``, ``import splitgrad.impl`` loads splitgrad's modules and nothing
    else, so it costs what they cost (about 0.07 s with bytecode cached, against about 2.7 s for
    torch, on the development machine)."""
    code = """
import sys, torch
before = set(sys.modules)
import splitgrad.impl
print(",".join(sorted(m for m in set(sys.modules) - before if not m.startswith("splitgrad"))))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""


def test_eager_modules_fp8_included_do_not_load_dynamo() -> None:
    """Building, running (FP8 too: its forward is eager-only under torch.compile) and
    backward_dw() stay off Dynamo."""
    code = """
import sys, torch
import splitgrad.impl as impl
m = impl.Linear(32, 32, delay_wgrad_compute=True)
x = torch.randn(32, 32, requires_grad=True)
m(x).sum().backward()
with impl.fp8_autocast(enabled=True, fp8_recipe=impl.DelayedScaling()):
    y = m(x)
y.sum().backward()
m.backward_dw()
print("torch._dynamo" in sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
