"""DualPipe and other weight-gradient stores: the W step through a global store (SPEC §8).

DeepSeek's DualPipe (``dualpipe.WeightGradStore``) and the zero-bubble Megatron forks schedule
W steps through a store: an object with a boolean ``enabled`` and ``put(fn)``. The schedule sets
``enabled`` around a backward chunk, groups what was put (``flush()``) and later runs a group
(``pop()``); a layer written for it checks ``enabled`` in its backward and either puts its wgrad
closure or runs it. :func:`use_weight_grad_store` gives every delayed split-backward module of a
model that behaviour, from SPEC §2-§4's public API only:

* **Which backward pass queued what.** A forward hook puts a gradient hook on the module's
  output, so the connection learns each backward pass that reaches the module (before the
  module's own backward runs) and reads ``pending_wgrad_count`` there; when that pass ends
  (autograd's end-of-pass callback, still inside the schedule's ``backward()`` call, so while
  ``enabled`` is as the schedule set it) ``pending_wgrad_count`` again says how many entries the
  pass queued (none for an input-only backward, SPEC §3).
* **Handed over or run.** If ``store.enabled`` is true then, each new entry is handed to the
  store with ``store.put(fn)``, one callable per entry; otherwise each is run at once with
  ``backward_dw()``. Entries of one pass are handed (or run) in the order the pass reached the
  modules, one per forward call of a module, so a weight tied between modules adds its
  contributions in the order the non-delayed backward would.
* **FIFO.** A callable runs ``backward_dw()``, which runs the module's *oldest* entry; that is
  the callable's own entry as long as the store runs a module's callables in ``put()`` order,
  as DualPipe does. Each callable checks it: one called before an earlier callable of the same
  module has run (a store that reorders, or one cleared with callables still in it) raises
  ``RuntimeError`` naming both entries and runs nothing; so does one called twice, or one whose
  module has fewer entries pending than callables outstanding (something else ran
  ``backward_dw()``). A callable whose ``backward_dw()`` raises keeps its entry and may be
  called again. A backward pass with ``enabled`` false on a module that still owes the store
  entries raises ``RuntimeError`` from that ``backward()``, since running the new entry would run
  an older one.

``remove()`` on the returned handle disconnects: later backward passes queue entries as the
modules do unconnected (call ``backward_dw()`` yourself); callables already in the store stay
valid.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import warnings
import weakref

import torch

from . import _torch_private
from .modules import SplitModule, output_tensors, split_modules

__all__ = ["use_weight_grad_store", "WeightGradStoreHandle", "StoreEntry"]

# Every connected delayed module -> its handle: a module is connected to one store at a time.
_CONNECTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class _Connected:
    """One delayed module of a connection and the callables it owes the store."""

    sm: SplitModule
    owed: collections.deque = dataclasses.field(default_factory=collections.deque)
    handed: int = 0  # entries handed to the store so far (numbers the callables)

    @property
    def label(self) -> str:
        kind = type(self.sm.module).__name__
        return f"{self.sm.name} ({kind})" if self.sm.name else kind


@dataclasses.dataclass(eq=False)
class _Pass:
    """What one backward pass under way has reached: pending counts when it first reached each
    module, and the forward calls it reached, in order."""

    before: dict = dataclasses.field(default_factory=dict)  # _Connected -> pending at first reach
    calls: list = dataclasses.field(default_factory=list)  # _Connected per forward call reached
    seen: set = dataclasses.field(default_factory=set)  # ids of those forward calls' tokens


class StoreEntry:
    """The callable handed to the store for one queued entry of one module: calling it runs that
    entry with ``backward_dw()`` (see the module docstring for the FIFO checks)."""

    def __init__(self, conn: _Connected, index: int) -> None:
        self._conn = conn
        #: This entry's number among those of its module handed to the store (from 0).
        self.index = index
        self.done = False

    @property
    def label(self) -> str:
        return f"entry #{self.index} of {self._conn.label}"

    def __repr__(self) -> str:
        return f"<StoreEntry {self.label}{' (done)' if self.done else ''}>"

    def __call__(self) -> None:
        conn = self._conn
        if self.done:
            raise RuntimeError(f"use_weight_grad_store: the store ran {self.label} twice")
        head = conn.owed[0] if conn.owed else None
        if head is not self:
            raise RuntimeError(
                f"use_weight_grad_store: the store ran {self.label} before {head.label}, which "
                "was handed to it earlier and has not run (a store that reorders callables, or "
                "one cleared with callables still in it): backward_dw() runs a module's oldest "
                "entry, so they must run in put() order; nothing was run"
            )
        pending = conn.sm.module.pending_wgrad_count
        if pending < len(conn.owed):
            raise RuntimeError(
                f"use_weight_grad_store: {conn.label} has {pending} entries pending but owes the "
                f"store {len(conn.owed)}: something else ran backward_dw() on it; nothing was run"
            )
        conn.sm.module.backward_dw()  # raises -> the entry stays queued and this callable at head
        conn.owed.popleft()
        self.done = True


class WeightGradStoreHandle:
    """What :func:`use_weight_grad_store` returns; :meth:`remove` disconnects."""

    def __init__(self, model: torch.nn.Module, store: object, delayed: list[SplitModule]) -> None:
        self.model_type = type(model).__name__
        self.store = store
        self._conns = [_Connected(sm) for sm in delayed]
        self._passes: dict[int, _Pass] = {}
        self._hooks = []
        self.removed = False
        #: Entries handed to the store, and entries run at once (``enabled`` false), so far.
        self.handed = 0
        self.ran_at_once = 0
        for conn in self._conns:
            self._hooks.append(
                conn.sm.module.register_forward_hook(functools.partial(self._after_forward, conn))
            )
            _CONNECTED[conn.sm.module] = self

    @property
    def modules(self) -> list[str]:
        """The connected delayed modules, by name inside the model."""
        return [conn.label for conn in self._conns]

    @property
    def outstanding(self) -> dict[str, int]:
        """Callables handed to the store and not run yet, by module."""
        return {conn.label: len(conn.owed) for conn in self._conns if conn.owed}

    def remove(self) -> None:
        """Disconnect: later backward passes leave their entries queued on the modules.
        Callables already handed to the store stay valid."""
        if self.removed:
            return
        self.removed = True
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for conn in self._conns:
            if _CONNECTED.get(conn.sm.module) is self:
                del _CONNECTED[conn.sm.module]

    # ---- hooks -----------------------------------------------------------------------------

    def _after_forward(self, conn: _Connected, module: torch.nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        token = object()  # this forward call: its outputs' hooks count one reach between them
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._on_output_grad, conn, token))

    def _on_output_grad(self, conn: _Connected, token: object, grad: torch.Tensor) -> None:
        """A backward pass reached an output of ``conn``'s module; its backward for that
        forward call has not run yet."""
        if self.removed:
            return
        task = _torch_private.current_backward_pass()
        record = self._passes.get(task)
        if record is None:
            record = self._passes[task] = _Pass()
            _torch_private.at_end_of_backward_pass(functools.partial(self._end_of_pass, task))
        if conn not in record.before:
            record.before[conn] = conn.sm.module.pending_wgrad_count
        if id(token) not in record.seen:
            record.seen.add(id(token))
            record.calls.append(conn)

    def _end_of_pass(self, task: int) -> None:
        """The backward pass ``task`` has ended: hand its entries to the store, or run them."""
        record = self._passes.pop(task)
        if self.removed:
            return
        new: dict[_Connected, int] = {}
        for conn, before in record.before.items():
            now = conn.sm.module.pending_wgrad_count
            if before != len(conn.owed) or now < before:
                raise RuntimeError(
                    f"use_weight_grad_store: {conn.label} had {before} entries pending when this "
                    f"backward reached it and {now} at its end, but owes the store "
                    f"{len(conn.owed)}: entries were queued by a backward this connection did not "
                    "see (a forward before use_weight_grad_store) or run by another backward_dw() "
                    "caller; they cannot be matched to store callables"
                )
            if now > before:
                new[conn] = now - before
        if not new:
            return  # an input-only backward queues nothing (SPEC §3)
        order = _order(record.calls, new)
        if bool(self.store.enabled):
            for conn in order:
                entry = StoreEntry(conn, conn.handed)
                conn.handed += 1
                conn.owed.append(entry)
                self.handed += 1
                self.store.put(entry)
            return
        owing = {conn.label: len(conn.owed) for conn in new if conn.owed}
        if owing:
            raise RuntimeError(
                f"use_weight_grad_store: a backward pass with {_name(self.store)}.enabled false "
                f"on modules that still owe the store callables ({owing}): "
                "running its entries at once would run those older entries first (FIFO); run the "
                "store's callables before a backward pass outside enabled"
            )
        for conn in order:
            conn.sm.module.backward_dw()
            self.ran_at_once += 1


def _order(calls: list[_Connected], new: dict[_Connected, int]) -> list[_Connected]:
    """One item per new entry, in the order the pass reached the modules' forward calls. A module
    with as many new entries as forward calls reached takes one per call; otherwise (some calls
    queued nothing) all its entries go where the pass first reached it."""
    reached = collections.Counter(calls)
    order: list[_Connected] = []
    placed: set = set()
    for conn in calls:
        if conn not in new:
            continue
        if new[conn] == reached[conn]:
            order.append(conn)
        elif conn not in placed:
            order.extend([conn] * new[conn])
        placed.add(conn)
    return order


def use_weight_grad_store(model: torch.nn.Module, store: object) -> WeightGradStoreHandle:
    """Connect every delayed split-backward module inside ``model`` (``model`` included) to
    ``store`` (``dualpipe.WeightGradStore`` or any object with a boolean ``enabled`` and
    ``put(fn)``): after a backward pass has queued a module's entry, the entry is handed to the
    store as a callable when ``store.enabled`` is true, and run at once otherwise. Returns a
    handle whose ``remove()`` disconnects. See the module docstring for the order rules.

    Raises ``TypeError`` for a ``model`` that is not a module or a ``store`` without ``enabled``
    or a callable ``put``, and ``RuntimeError`` for a module already connected (the same model
    twice) or one with entries already queued; warns when ``model`` has no delayed module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"use_weight_grad_store: model must be a torch.nn.Module, got {model!r}")
    missing = [name for name in ("enabled", "put") if not hasattr(store, name)]
    if not missing and not callable(store.put):
        missing = ["a callable put"]
    if missing:
        raise TypeError(
            f"use_weight_grad_store: store {store!r} lacks {' and '.join(missing)}: a "
            "weight-gradient store has a boolean `enabled` and `put(fn)` "
            "(as dualpipe.WeightGradStore)"
        )
    try:
        _torch_private.check_available()
    except RuntimeError as exc:
        raise RuntimeError(f"use_weight_grad_store needs the same autograd hooks: {exc}") from exc
    delayed = [sm for sm in split_modules(model) if sm.delayed]
    for sm in delayed:
        label = _Connected(sm).label
        if sm.module in _CONNECTED:
            raise RuntimeError(
                f"use_weight_grad_store({type(model).__name__}): {label} is already connected "
                "to a store (the same model attached twice?); remove() the earlier handle first"
            )
        pending = sm.module.pending_wgrad_count
        if pending:
            raise RuntimeError(
                f"use_weight_grad_store({type(model).__name__}): {label} has {pending} entries "
                "queued already, which no store callable would own; run backward_dw() for them "
                "first"
            )
    if not delayed:
        warnings.warn(
            f"use_weight_grad_store({type(model).__name__}): the model has no split-backward "
            "module with delay_wgrad_compute=True; nothing is handed to the store and every "
            "gradient is computed in the backward",
            UserWarning,
            stacklevel=2,
        )
    return WeightGradStoreHandle(model, store, delayed)


def _name(store: object) -> str:
    """``WeightGradStore`` for a store that is a class (DualPipe's), else its type's name."""
    return store.__name__ if isinstance(store, type) else type(store).__name__
