"""When a gradient is final: the step bookkeeping of
:class:`~splitgrad.distributed.GradientReducer` (SPEC §8, P16).

A step is several micro-batches; a gradient is final after the step's *last* backward pass that
produces it (``no_sync()`` marks the earlier ones, as DDP's ``no_sync`` does, or
``num_microbatches=n`` counts them: the n-th pass is the last).

* A non-delayed parameter is produced when autograd accumulates into it (its
  ``register_post_accumulate_grad_hook``).
* A delayed GEMM parameter (``skip_backward_post_hook``, SPEC §4) is followed from its module's
  own API only, never from autograd reaching it (a conforming module may hand its Function
  detached copies; TransformerEngine returns no gradient for a delayed weight): a forward hook
  puts a gradient hook on the module's output, so the tracker learns each backward pass that
  reaches the module; ``pending_wgrad_count`` read there and again when that pass ends tells
  how many entries the pass queued (none for input-only backwards such as
  ``torch.autograd.grad(y, x)`` or pipelining's shape inference, P17), and the module hook of
  §4 says when each entry has run (FIFO). The gradient is final once the last entry of the
  step's last producing pass has run; a weight tied between delayed modules, once each of them
  has run its own.

A gradient produced again after it was final (a micro-batch not marked as non-final, or a
``backward_dw()`` after the last one) is recorded as an error for ``finish()`` to raise.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import weakref
from collections.abc import Callable

import torch

from . import _torch_private
from .modules import SplitModule, output_tensors
from .reducer_params import ReducedParam

__all__ = ["Step", "Owner", "FinalityTracker", "call_weakly"]


@dataclasses.dataclass(eq=False)
class Step:
    """The step under way, shared by the reducer and its parts."""

    number: int = 0
    finished: bool = True  # between finish() and the next step's first gradient
    finished_by_schedule: bool = False
    errors: list[str] = dataclasses.field(default_factory=list)  # raised by finish()
    launch_log: list[dict] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class QueuedPass:
    """The entries one backward pass queued on one delayed module, not yet run."""

    entries: int
    final: bool


@dataclasses.dataclass(eq=False)
class Owner:
    """What the tracker follows of one delayed module through a step."""

    sm: SplitModule
    params: list[ReducedParam]
    passes: int = 0  # backward passes of this step that queued entries on it
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    # backward passes under way that reached the module: id -> [pending at the start, entries
    # run by backward_dw() during the pass that the pass itself queued]
    running: dict = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.sm.name or type(self.sm.module).__name__

    def reset(self) -> None:
        self.passes = 0
        self.queue.clear()
        self.running.clear()


class FinalityTracker:
    """Follows every parameter of ``params`` through the step's backward passes and
    ``backward_dw()`` entries; calls ``on_final(st)`` once ``st`` is final, and
    ``on_pass_done(owner)`` once every entry of a non-final pass of ``owner`` has run."""

    def __init__(
        self,
        params: list[ReducedParam],
        num_microbatches: int | None,
        step: Step,
        on_final: Callable[[ReducedParam], None],
        on_pass_done: Callable[[Owner], None],
    ) -> None:
        self.params = params
        self.num_microbatches = num_microbatches
        self.no_sync = False
        self.step = step
        self._on_final = on_final
        self._on_pass_done = on_pass_done
        self._by_id = {id(st.param): st for st in params}
        for st in params:
            if not st.delayed:
                st.param.register_post_accumulate_grad_hook(self.on_accumulate)
        self.owners: list[Owner] = []
        for st in params:
            for sm in st.owners:
                owner = next((o for o in self.owners if o.sm.module is sm.module), None)
                if owner is None:
                    owner = Owner(sm, [])
                    self.owners.append(owner)
                owner.params.append(st)
        for owner in self.owners:
            hook = _ModuleHook(weakref.ref(self), owner)
            owner.sm.module.register_wgrad_accumulation_and_reduce_hooks(hook)
            owner.sm.module.register_forward_hook(hook.after_forward)

    def begin_step_if_needed(self) -> None:
        step = self.step
        if step.finished:
            step.finished = False
            step.finished_by_schedule = False
            step.number += 1
            step.launch_log = []

    def final_pass(self, name: str, passes: int) -> bool:
        """Whether the backward pass that just produced ``name`` (its ``passes``-th of the step)
        is the step's last."""
        if self.num_microbatches is None:
            return not self.no_sync
        if passes > self.num_microbatches:
            self.step.errors.append(
                f"{name}: produced by {passes} backward passes in one step, more than "
                f"num_microbatches={self.num_microbatches}"
            )
        return passes == self.num_microbatches

    def on_accumulate(self, param: torch.Tensor) -> None:
        """autograd accumulated into the non-delayed parameter ``param``."""
        st = self._by_id.get(id(param))
        if st is None or st.delayed:
            return
        self.begin_step_if_needed()
        task = _torch_private.current_backward_pass()
        if task != st.last_task:
            st.last_task = task
            st.passes += 1
        final = self.final_pass(st.name, st.passes)
        if st.ready:
            self.step.errors.append(
                f"{st.name}: a backward pass produced it again after its reduction had started "
                "(mark the non-final micro-batches with no_sync() or set num_microbatches)"
            )
            return
        if final:
            self._mark_final(st)

    def on_output_grad(self, owner: Owner) -> None:
        """A backward pass reached the output of ``owner``'s module; the module's backward for
        it has not run yet."""
        task = _torch_private.current_backward_pass()
        if task in owner.running:
            return  # a second use of the module in the same pass (tied)
        owner.running[task] = [owner.sm.module.pending_wgrad_count, 0]
        _torch_private.at_end_of_backward_pass(
            functools.partial(call_weakly, weakref.ref(self), "end_of_pass", owner, task)
        )

    def end_of_pass(self, owner: Owner, task: int) -> None:
        """The backward pass ``task`` that reached ``owner``'s module has ended: count what it
        queued there."""
        before, ran_inside = owner.running.pop(task)
        queued = owner.sm.module.pending_wgrad_count - before + ran_inside
        if queued <= 0:
            return  # input-only backward: nothing queued, nothing produced (SPEC §3)
        self.begin_step_if_needed()
        owner.passes += 1
        final = self.final_pass(owner.label, owner.passes)
        again = [st.name for st in owner.params if st.ready]
        if again:
            self.step.errors.append(
                f"{', '.join(again)}: a backward pass produced it again after its reduction had "
                "started (it queued entries on its module; mark the non-final micro-batches "
                "with no_sync() or set num_microbatches)"
            )
            return
        if queued > ran_inside:
            owner.queue.append(QueuedPass(queued - ran_inside, final))
        elif final:
            self._owner_final(owner)
        else:
            self._on_pass_done(owner)

    def on_entry_done(self, owner: Owner) -> None:
        """A ``backward_dw()`` of ``owner``'s module wrote its oldest entry's gradients (SPEC
        §4's module hook)."""
        self.begin_step_if_needed()
        again = [st.name for st in owner.params if st.ready]
        if again:
            self.step.errors.append(
                f"{', '.join(again)}: backward_dw() wrote it again after its reduction had started"
            )
            return
        if owner.queue:
            head = owner.queue[0]
            head.entries -= 1
            if head.entries == 0:
                owner.queue.popleft()
                if head.final:
                    self._owner_final(owner)
                else:
                    self._on_pass_done(owner)
            return
        task = _torch_private.current_backward_pass()
        if task in owner.running:
            owner.running[task][1] += 1  # an entry of the pass under way, run inside it
            return
        self.step.errors.append(
            f"{owner.label}: backward_dw() ran an entry that no backward pass of this step "
            f"was seen to queue (parameters {[st.name for st in owner.params]})"
        )

    def _owner_final(self, owner: Owner) -> None:
        if owner.queue:
            self.step.errors.append(
                f"{owner.label}: entries of a later backward pass were queued before the step's "
                "last one had run"
            )
        for st in owner.params:
            st.owners_final += 1
            if st.owners_final == len(st.owners):
                self._mark_final(st)

    def _mark_final(self, st: ReducedParam) -> None:
        st.ready = True
        self._on_final(st)

    def reset(self) -> None:
        """Forget the step (called by ``finish()``)."""
        self.step.errors = []
        for st in self.params:
            st.passes, st.last_task, st.ready, st.owners_final = 0, -1, False, 0
        for owner in self.owners:
            owner.reset()


def call_weakly(target: weakref.ref, method: str, *args) -> None:
    """``target().method(*args)`` unless ``target`` is gone (the method is looked up now)."""
    obj = target()
    if obj is not None:
        getattr(obj, method)(*args)


class _ModuleHook:
    """The hooks the tracker puts on one delayed module (holding the tracker weakly): the module
    hook of SPEC §4, and a forward hook that hooks the output's gradient."""

    def __init__(self, tracker: weakref.ref, owner: Owner) -> None:
        self._tracker = tracker
        self._owner = owner

    def __call__(self) -> None:
        call_weakly(self._tracker, "on_entry_done", self._owner)

    def after_forward(self, module: torch.nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        call_weakly(self._tracker, "on_output_grad", self._owner)
