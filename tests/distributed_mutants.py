"""Packages with SPEC §2's API and one planted bug each that only distributed use shows, for
the meta-tests of the P14-P16 checks (``test_distributed_meta.py``), and a sequence-parallel
gradient sum that forgets the norms, for P19's (``test_properties_p19.py``). Each is importable
by name (``distributed_mutants.hooks_silent``), as the checks import the package under test
inside their spawned ranks."""

from __future__ import annotations

import types

import splitgrad.distributed.expert_parallel as _ep
import splitgrad.impl as _impl
import torch.distributed as dist
from splitgrad.distributed import ExpertParallelMoE, GradientReducer
from splitgrad.distributed.reducer_allreduce import AllReduceBuckets


def _package(name: str, **overrides) -> types.ModuleType:
    pkg = types.ModuleType(f"distributed_mutants.{name}")
    for attr in _impl.__all__:
        setattr(pkg, attr, getattr(_impl, attr))
    for attr, cls in overrides.items():
        setattr(pkg, attr, cls)
    return pkg


def _silent(cls):
    """register_wgrad_accumulation_and_reduce_hooks accepts the hook and never calls it."""

    class Silent(cls):
        def register_wgrad_accumulation_and_reduce_hooks(self, fn):
            return None

    Silent.__name__ = cls.__name__
    return Silent


def _lying(cls):
    """need_backward_dw() says False although the module defers its weight gradients."""

    class Lying(cls):
        def need_backward_dw(self):
            return False

    Lying.__name__ = cls.__name__
    return Lying


def _lifo(cls):
    """backward_dw() runs the newest entry first."""

    class Lifo(cls):
        def backward_dw(self, *args, **kwargs):
            store = self._wgrad_store._entries
            if len(store) > 1:
                store.rotate(1)  # newest to the head
            return super().backward_dw(*args, **kwargs)

    Lifo.__name__ = cls.__name__
    return Lifo


_KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")

hooks_silent = _package("hooks_silent", **{k: _silent(getattr(_impl, k)) for k in _KINDS})
lying_need_backward_dw = _package(
    "lying_need_backward_dw", **{k: _lying(getattr(_impl, k)) for k in _KINDS}
)
lifo = _package("lifo", **{k: _lifo(getattr(_impl, k)) for k in _KINDS})


class LateBackwardDwMoE(ExpertParallelMoE):
    """The expert-parallel layer with its overlap moved: the experts' ``backward_dw()`` runs
    from a hook on the layer's input gradient, after the dispatch all-to-all has been waited on,
    instead of while it is in flight (every gradient still right: only the order shows it)."""

    def __init__(self, experts, group=None, **options) -> None:
        super().__init__(experts, group, overlap_backward_dw=False, **options)

    def forward(self, x, expert_index):
        y = super().forward(x, expert_index)
        if x.requires_grad:
            x.register_hook(self._late_backward_dw)
        return y

    def _late_backward_dw(self, grad):
        self._experts_backward_dw()


class _WaitsFirstAllToAll(_ep._AllToAll):
    """``_AllToAll`` with its backward's wait moved before the overlapped work: the layer's own
    timeline still reads start, backward_dw, wait done."""

    @staticmethod
    def backward(ctx, grad):
        dx, work = _ep._AllToAll.start_reverse(ctx, grad)
        _ep._wait(work, ctx.timeout, "all_to_all (backward)")
        if ctx.during_backward is not None:
            ctx.during_backward()  # nothing left in flight to overlap
        _ep._AllToAll.note(ctx, "wait done")
        return dx, None, None, None, None, None, None


class WaitsFirstMoE(ExpertParallelMoE):
    """The expert-parallel layer whose dispatch all-to-all backward waits on the collective
    before running the experts' ``backward_dw()`` (every gradient right, nothing overlapped)."""

    def forward(self, x, expert_index):
        real = _ep._AllToAll
        _ep._AllToAll = _WaitsFirstAllToAll  # the graph keeps the class it was built with
        try:
            return super().forward(x, expert_index)
        finally:
            _ep._AllToAll = real


class FirstEntryFinalReducer(GradientReducer):
    """The reducer taking a delayed gradient as final after the *first* entry of the step's
    last backward pass instead of its last (a module applied twice queues two in that pass)."""

    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        end_of_pass = self._finality.end_of_pass

        def first_entry_final(owner, task) -> None:
            end_of_pass(owner, task)
            if owner.queue and owner.queue[-1].final:
                owner.queue[-1].entries = 1

        self._finality.end_of_pass = first_entry_final  # the hooks look it up when they fire


class OneOwnerReducer(GradientReducer):
    """The reducer following a weight tied between two delayed modules through one of them
    only (the last that holds it): it launches the reduction when that module's last entry has
    run, whatever the other module still has to write."""

    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        for st in self._params:
            if len(st.owners) > 1:
                kept = st.owners[-1]
                for owner in self._owners:
                    if owner.sm is not kept and st in owner.params:
                        owner.params.remove(st)
                st.owners = (kept,)


class TiedCountKeptReducer(GradientReducer):
    """The reducer whose end-of-step reset forgets the per-step count of a tied weight's
    modules that ran their last entry (``owners_final``), with the finality test relaxed to
    ``>=``: step 1 is right, but from step 2 on the count starts at 2 and the shared weight is
    taken as final after the *first* of its modules' last entries, its reduction launched while
    the other module still writes into it."""

    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        tracker = self._finality
        reset = tracker.reset

        def reset_keeping_tied_counts() -> None:
            kept = [st.owners_final for st in tracker.params]
            reset()
            for st, count in zip(tracker.params, kept):
                st.owners_final = count

        def owner_final(owner) -> None:
            for st in owner.params:
                st.owners_final += 1
                if st.owners_final >= len(st.owners) and not st.ready:
                    tracker._mark_final(st)

        tracker.reset = reset_keeping_tied_counts
        tracker._owner_final = owner_final


class _PreDividingBuckets(AllReduceBuckets):
    """The all-reduce back-end dividing each flat bucket by the world size before its SUM and
    not after it."""

    def launch(self, bucket) -> None:
        real_all_reduce = dist.all_reduce

        def divided_first(tensor, *args, **kwargs):
            tensor.div_(self.world_size)
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = divided_first  # for this launch only
        try:
            super().launch(bucket)
        finally:
            dist.all_reduce = real_all_reduce

    def complete(self, bucket, timeout, errors) -> None:
        world, self.world_size = self.world_size, 1  # divided already
        try:
            super().complete(bucket, timeout, errors)
        finally:
            self.world_size = world


class DividesBeforeAllReduceReducer(GradientReducer):
    """The reducer without fully_shard averaging each bucket by dividing before the all-reduce
    instead of after it: bitwise the same on 2 replicas (halving is exact), rounded otherwise
    on 3."""

    def __init__(self, module, *args, **kwargs) -> None:
        super().__init__(module, *args, **kwargs)
        self._backend = _PreDividingBuckets(self.process_group, self.world_size, self._step)


def sp_sum_forgets_norms(model, tp_group) -> None:
    """``allreduce_sequence_parallel_grads`` with the SP reduction of the norm parameters
    forgotten: every other ``sequence_parallel`` gradient is summed over ``tp_group``, the
    norms' stay each rank's partial sum."""
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False) and "layer_norm" not in name:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=tp_group)
