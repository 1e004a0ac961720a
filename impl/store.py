"""The per-module FIFO of deferred weight-gradient work (SPEC §4).

One :class:`WgradEntry` is one backward of one module: a closure that computes *and writes* the
GEMM-parameter gradients, plus the tensors it reads. The closure captures no tensor itself; it
receives ``entry.saved`` as arguments, so dropping ``saved`` is all it takes to free the
operands, and tests can see exactly what an entry keeps alive.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from ._torch_compat import set_grad_enabled

__all__ = ["WgradEntry", "WeightGradStore"]


class WgradEntry:
    """One unit of weight-gradient work.

    ``closure(*saved)`` validates ``main_grad`` first (raising before anything is written), then
    runs the wgrad GEMMs and writes their results by SPEC §3. ``params`` are the ``(name, leaf)``
    pairs it writes (read for CUDA stream bookkeeping and by the optimizer guard,
    :mod:`splitgrad.reference.pending`).
    """

    __slots__ = ("closure", "saved", "params")

    def __init__(
        self,
        closure: Callable[..., None],
        saved: tuple[torch.Tensor, ...],
        params: tuple[tuple[str, torch.Tensor], ...],
    ) -> None:
        self.closure = closure
        self.saved = saved
        self.params = params

    def run(self) -> None:
        """Compute and write this entry's gradients (with grad mode off, as ``torch.no_grad``
        does; set directly, which costs a tenth of the context manager)."""
        enabled = torch.is_grad_enabled()
        set_grad_enabled(False)
        try:
            self.closure(*self.saved)
        finally:
            set_grad_enabled(enabled)

    def release(self) -> None:
        """Drop every tensor the entry holds; its storage is freed unless referenced elsewhere."""
        self.saved = ()
        self.closure = _released


def _released(*_: torch.Tensor) -> None:
    raise RuntimeError("this weight-gradient entry has already run and was released")


class WeightGradStore(collections.deque):
    """FIFO of :class:`WgradEntry`, one per module (no global state: SPEC §8). A ``deque``
    itself, so that ``len`` and iteration, asked on every backward and ``backward_dw()``, are
    C calls."""

    def push(self, entry: WgradEntry) -> None:
        """Queue ``entry`` behind every pending one."""
        self.append(entry)

    def head(self) -> WgradEntry:
        """The oldest entry, left in place (so a failing wgrad keeps it queued)."""
        return self[0]

    def pop_and_release(self) -> None:
        """Remove the oldest entry and drop its tensors."""
        self.popleft().release()
