"""Private torch stays fenced: in ``reference/``, ``impl/`` and ``distributed/`` only one module per
package (:data:`FENCES`) imports or names a private part of torch, or reads a private attribute
of torch's objects (:data:`PRIVATE_ATTRIBUTE`); each of those names the torch versions it was
checked on and raises naming the running one when a part is missing. ``bench/`` and ``cli/``
have no fence: they go through the library's."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCES = {
    "reference": "_torch_private.py",
    "impl": "_torch_compat.py",
    "distributed": "_torch_private.py",
    "bench": None,
    "cli": None,
}
FILES = sorted(
    path
    for package, fence in FENCES.items()
    for path in (ROOT / package).rglob("*.py")
    if fence is None or path != ROOT / package / fence
)
#: Private attributes of torch's objects the library reaches (FSDP2's state, parameter groups
#: and parameters; a DTensor's local shard; a tensor's hook dictionaries), read or tested with
#: ``getattr``/``hasattr``/``setattr``.
PRIVATE_ATTRIBUTE = re.compile(
    r"_(fsdp|get_fsdp|unsharded|state_ctx|reduce_scatter|reduce_dtype|orig_dtype|module_fqn"
    r"|local_tensor|post_accumulate_grad_hooks|backward_hooks)"
)
# Calls whose string argument names a module (``importlib.import_module("torch._C")``).
_IMPORTING_CALLS = {"import_module", "__import__", "getLogger"}


def _private(dotted: str) -> bool:
    """Whether a dotted torch name has a private part (``torch._C``, ``torch.utils._pytree``);
    dunders (``torch.__version__``) are public. ``torch.ops.<namespace>.<op>`` names an
    operator, whose name is the operator library's, not a Python attribute of torch."""
    parts = dotted.split(".")
    if parts[:2] == ["torch", "ops"]:
        return False
    return any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts)


def _dotted(node: ast.AST) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``, or ``None`` when it does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def private_uses(source: str) -> list[str]:
    """Every private torch name ``source`` imports or reads, every :data:`PRIVATE_ATTRIBUTE` and
    every ``sys._getframe``, as ``"line N: what"``. Names bound by ``import torch...`` and
    ``from torch... import ...`` are followed (``import torch.distributed as dist; dist._x``
    counts)."""
    tree = ast.parse(source)
    bound = {"torch": "torch"}  # local name -> the torch name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    if _private(alias.name):
                        found.append(f"line {node.lineno}: import {alias.name}")
                    if alias.asname:
                        bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] == "torch":
                for alias in node.names:
                    name = f"{node.module}.{alias.name}"
                    if _private(name):
                        found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                    bound[alias.asname or alias.name] = name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if PRIVATE_ATTRIBUTE.match(node.attr):
                found.append(f"line {node.lineno}: .{node.attr}")
            parts = _dotted(node)
            if parts is None:
                continue
            if parts[:2] == ["sys", "_getframe"]:
                found.append(f"line {node.lineno}: sys._getframe")
            elif parts[0] in bound:
                name = ".".join([bound[parts[0]], *parts[1:]])
                if _private(name):
                    found.append(f"line {node.lineno}: {name}")
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called == "get" and _dotted(func.value) == ["sys", "modules"]:
                called = "sys.modules.get"
            if called in ("getattr", "hasattr", "setattr") and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and PRIVATE_ATTRIBUTE.match(str(name.value)):
                    found.append(f"line {node.lineno}: {called}(..., {name.value!r})")
            if called in _IMPORTING_CALLS | {"sys.modules.get"}:
                for arg in node.args[:1]:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        if arg.value.startswith("torch") and _private(arg.value):
                            found.append(f"line {node.lineno}: {called}({arg.value!r})")
        elif isinstance(node, ast.Subscript) and _dotted(node.value) == ["sys", "modules"]:
            key = node.slice
            if isinstance(key, ast.Constant) and isinstance(key.value, str) and _private(key.value):
                found.append(f"line {node.lineno}: sys.modules[{key.value!r}]")
    return sorted(set(found), key=lambda s: int(s.split()[1].rstrip(":")))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_private_torch_outside_the_fence(path: Path) -> None:
    uses = private_uses(path.read_text())
    package = path.relative_to(ROOT).parts[0]
    fence = f"{package}/{FENCES[package]}" if FENCES[package] else "a fence of the library"
    assert not uses, f"{path.relative_to(ROOT)} uses private torch (move it into {fence}): {uses}"


def test_the_checker_sees_each_kind_of_use() -> None:
    source = (
        "import sys\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "import torch._dynamo\n"
        "from torch.utils._pytree import tree_flatten\n"
        "from torch.distributed.pipelining import stage\n"
        "from torch import _C\n"
        "torch._C._set_grad_enabled(False)\n"
        "dist._functional_collectives\n"
        "stage._PipelineStageBase\n"
        "sys._getframe(1)\n"
        "sys.modules.get('torch.distributed._composable_state')\n"
        "torch.__version__, torch.ops.aten._to_copy, torch.nn.Linear\n"
        "state._fsdp_param_groups, getattr(fp, '_unsharded_param', None)\n"
        "self._parameters, getattr(fp, '_splitgrad_mark', None)\n"
    )
    lines = {int(use.split()[1].rstrip(":")) for use in private_uses(source)}
    assert lines == {4, 5, 7, 8, 9, 10, 11, 12, 14}


def test_each_fence_names_its_versions_and_the_running_one() -> None:
    """Each fence says which torch versions it was checked on, and a missing private part
    raises naming the running torch version."""
    code = (
        "import torch\n"
        "from splitgrad.reference import _torch_private as ref\n"
        "from splitgrad.impl import _torch_compat as impl\n"
        "from splitgrad.distributed import _torch_private as dist\n"
        "for fence in (ref, impl, dist):\n"
        "    assert '2.8' in fence.CHECKED_ON and '2.14' in fence.CHECKED_ON, fence\n"
        "for moved in (\n"
        "    ref._moved('torch._C._x', 'y'),\n"
        "    impl._moved('torch._C._x', 'y'),\n"
        "    dist._moved('torch._C._x', 'y'),\n"
        "):\n"
        "    assert isinstance(moved, RuntimeError)\n"
        "    assert f'torch {torch.__version__}' in str(moved), moved\n"
        "    assert 'torch._C._x' in str(moved), moved\n"
        "del torch._C._current_graph_task_id\n"
        "import importlib\n"
        "importlib.reload(dist)\n"
        "try:\n"
        "    dist.current_backward_pass()\n"
        "except dist.TorchMoved as exc:\n"
        "    assert torch.__version__ in str(exc) and dist.CHECKED_ON in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('no TorchMoved')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def _deep(depth: int, fn):
    """``fn()`` called ``depth`` frames below this one."""
    return _deep(depth - 1, fn) if depth else fn()


def test_the_frame_walks_read_the_whole_stack() -> None:
    """The pipelining frames are found however deep below them the call is, and a call from
    torch's pipelining with no stage to find raises naming the torch version."""
    import types

    import torch
    from splitgrad.distributed import _torch_private as tp
    from torch.distributed.pipelining import PipelineStage

    stage = object.__new__(PipelineStage)  # only its type and attributes matter here
    builder = object()
    object.__setattr__(stage, "dw_builder", builder)
    name = tp.shape_inference_method()
    seen = []

    def inference(self):
        return _deep(40, lambda: seen.append(tp.in_shape_inference()))

    code = inference.__code__.replace(co_name=name)
    renamed = types.FunctionType(code, inference.__globals__, name, None, inference.__closure__)
    renamed(stage)
    inference(stage)
    assert seen == [True, False]

    def backward_one_chunk(self, bwd_chunk_id):
        return _deep(40, lambda: tp.calling_stage(builder))

    assert backward_one_chunk(stage, 3) == (stage, 3)
    assert _deep(40, lambda: tp.calling_stage(builder)) is None  # a runtime of the caller's own
    moved = {"__name__": "torch.distributed.pipelining.stage", "_deep": _deep, "tp": tp}
    exec("def run(builder):\n    return _deep(40, lambda: tp.calling_stage(builder))\n", moved)
    with pytest.raises(
        tp.TorchMoved, match=rf"torch {re.escape(torch.__version__)}: .*checked on torch"
    ):
        moved["run"](builder)
