"""The two private autograd hooks :class:`~splitgrad.distributed.GradientReducer` needs to tell
backward passes apart from the modules' side (SPEC §8), in one place.

* ``torch._C._current_graph_task_id()``: which backward pass (graph task) is running;
* ``torch.autograd.Variable._execution_engine.queue_callback(fn)``: run ``fn`` when the running
  backward pass ends (what ``DistributedDataParallel`` and FSDP use for the same purpose).

Checked on torch 2.6-2.13. If either moves, :func:`check_available` raises naming the torch
version instead of letting the reducer quietly see no backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["check_available", "current_backward_pass", "at_end_of_backward_pass"]


def check_available() -> None:
    """Raise ``RuntimeError`` naming the torch version if the private hooks are missing."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if not hasattr(torch._C, "_current_graph_task_id") or not hasattr(engine, "queue_callback"):
        raise RuntimeError(
            f"splitgrad.distributed.GradientReducer: torch {torch.__version__} lacks "
            "torch._C._current_graph_task_id or the autograd engine's queue_callback (checked "
            "on torch 2.6-2.13); the reducer cannot tell backward passes apart"
        )


def current_backward_pass() -> int:
    """Id of the running backward pass (-1 outside of one)."""
    return int(torch._C._current_graph_task_id())


def at_end_of_backward_pass(fn: Callable[[], None]) -> None:
    """Run ``fn()`` once the running backward pass has finished (called from a hook in it)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)
