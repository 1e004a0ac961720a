"""The optimizer guard: a forgotten ``backward_dw()`` is caught at the optimizer step.

Under delay (SPEC §4) a GEMM parameter's gradient arrives in ``backward_dw()``. An optimizer
step taken while an entry that writes the parameter is still queued uses a gradient that lacks
that entry's contribution, and the entry later adds a stale one to the next step's. So every
``torch.optim`` optimizer step (one global step pre-hook,
``torch.optim.optimizer.register_optimizer_step_pre_hook``, installed once when this module is
imported) raises ``RuntimeError`` before the step runs — no parameter and no optimizer state
changes — when one of its parameters will still be written by a queued entry of a module of
either package. The message names each such module (:func:`.contract.qualified_name`, e.g.
``splitgrad.impl.LayerNormMLP``), each parameter by its name in the module (``fc1_weight``) and
how many pending entries write it. Steps over other parameters run unchanged.

This is an index for the guard, not a queue. SPEC §8 allows no module-level state shared between
modules for the queues themselves: every queue stays on its module and stays the truth. The
index only holds, weakly, the modules whose queue is not empty — a module calls :func:`queued`
when its queue goes from empty to one entry and :func:`drained` when it goes back to empty (an
entry whose wgrad fails stays queued, so nothing changes then), O(1) per entry. When a step finds
the index non-empty, the leaves each entry will write are read from the module's own queue
(``module._pending_writes()``: per entry, oldest first, its ``(name, leaf)`` pairs; impl's
``WgradEntry.params``, the reference's entry targets), counting per (parameter, module), so a
tied weight (two entries) and several micro-batches count right. A module that dies with entries
queued leaves the index with them.

Cost: with nothing queued the pre-hook is one truthiness check of an empty dict.

Off switch, for a framework that runs its own W steps around its own step (Megatron-style
``main_grad`` training, or a step deliberately taken with entries queued):
``optimizer_guard(False)`` turns the check off (``optimizer_guard(True)`` back on), and
``with optimizer_guard(False):`` turns it off for a block, restoring the previous setting; the
environment variable ``SPLITGRAD_OPTIMIZER_GUARD=0`` (read once, at import) starts it off.
Only parameters the entries write themselves are guarded: an optimizer over fp32 master copies,
or over FSDP2's sharded parameters, is not checked.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .contract import check_flag, qualified_name

__all__ = [
    "PendingWrite",
    "queued",
    "drained",
    "pending_writes",
    "check_optimizer_step",
    "optimizer_guard",
    "optimizer_guard_enabled",
    "ENV_VAR",
]

#: The environment variable that starts the guard off when set to ``0`` (or false, off, no).
ENV_VAR = "SPLITGRAD_OPTIMIZER_GUARD"

# id(module) -> weak reference to a module whose queue is not empty. A plain dict, so that the
# step pre-hook's fast path is one truthiness check.
_QUEUED: dict[int, weakref.ref] = {}


def _enabled_from_environment() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "off", "no")


_enabled = _enabled_from_environment()


def queued(module: torch.nn.Module) -> None:
    """Called by ``module`` when its queue goes from empty to one entry."""
    key = id(module)
    if key not in _QUEUED:
        _QUEUED[key] = weakref.ref(module, _died)


def drained(module: torch.nn.Module) -> None:
    """Called by ``module`` when its queue becomes empty."""
    _QUEUED.pop(id(module), None)


def _died(ref: weakref.ref) -> None:
    """A module died with entries queued (they died with it): out of the index. A scan, so that
    :func:`queued` creates no closure; this is rare."""
    for key, value in list(_QUEUED.items()):
        if value is ref:
            _forget(key, ref)


def _forget(key: int, ref: weakref.ref) -> None:
    if _QUEUED.get(key) is ref:
        del _QUEUED[key]


@dataclasses.dataclass(frozen=True)
class PendingWrite:
    """``count`` queued entries of ``module`` will still write its parameter ``name``
    (``param``: the leaf the forward used)."""

    module: torch.nn.Module
    name: str
    param: torch.Tensor
    count: int

    def __str__(self) -> str:
        entries = "entry" if self.count == 1 else "entries"
        return f"{self.name} ({self.count} pending {entries})"


def pending_writes(params: Iterable[torch.Tensor]) -> list[PendingWrite]:
    """Which of ``params`` a queued entry of some module will still write, per (module,
    parameter name), with the number of entries."""
    wanted = {id(p): p for p in params}
    found: list[PendingWrite] = []
    for key, ref in list(_QUEUED.items()):
        module = ref()
        entries = module._pending_writes() if module is not None else ()
        if not entries:  # dead, or emptied without telling: out of the index
            _forget(key, ref)
            continue
        counts: dict[tuple[str, int], list] = {}
        for written in entries:
            for name, leaf in written:
                if wanted.get(id(leaf)) is leaf:
                    counts.setdefault((name, id(leaf)), [leaf, 0])[1] += 1
        order = {name: i for i, name in enumerate(module._parameters)}  # registration order
        for (name, _), (leaf, n) in sorted(counts.items(), key=lambda kv: order.get(kv[0][0], -1)):
            found.append(PendingWrite(module, name, leaf, n))
    return found


def check_optimizer_step(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``RuntimeError`` if a queued entry will still write a parameter of ``optimizer``
    (see the module docstring); otherwise do nothing."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    found = pending_writes(params)
    if not found:
        return
    by_module: dict[int, list[PendingWrite]] = {}
    for w in found:
        by_module.setdefault(id(w.module), []).append(w)
    lines = "; ".join(
        f"{qualified_name(ws[0].module)} (pending_wgrad_count="
        f"{ws[0].module.pending_wgrad_count}): {', '.join(str(w) for w in ws)}"
        for ws in by_module.values()
    )
    raise RuntimeError(
        f"{type(optimizer).__name__}.step() refused, nothing was changed: weight-gradient work "
        f"is still queued for parameters it would update: {lines}. Their gradients are not "
        "complete until backward_dw() has run each pending entry; stepping now would miss that "
        "work and leave it to write stale gradients into the next step. Call backward_dw() on "
        "each module until its pending_wgrad_count is 0 before optimizer.step(). A framework that "
        "runs the W step itself can turn this check off: "
        f"splitgrad.reference.pending.optimizer_guard(False), or {ENV_VAR}=0"
    )


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The global optimizer step pre-hook."""
    if _QUEUED and _enabled:
        check_optimizer_step(optimizer)


class optimizer_guard:
    """Turn the optimizer guard on (``True``) or off (``False``) now; used as a context manager,
    restore the previous setting on exit (as ``torch.set_grad_enabled`` does)."""

    def __init__(self, enabled: bool) -> None:
        global _enabled
        enabled = check_flag("enabled", enabled)
        self.previous = _enabled
        _enabled = enabled

    def __enter__(self) -> optimizer_guard:
        return self

    def __exit__(self, *exc: object) -> None:
        global _enabled
        _enabled = self.previous


def optimizer_guard_enabled() -> bool:
    """Whether optimizer steps are checked now."""
    return _enabled


_HOOK = register_optimizer_step_pre_hook(_before_step)
