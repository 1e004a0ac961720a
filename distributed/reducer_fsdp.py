"""The FSDP2 back-end of :class:`~splitgrad.distributed.GradientReducer` (SPEC §8, "Fully sharded
data parallel").

Built on a model wrapped with ``fully_shard`` (build it *after* ``fully_shard``; built before,
the model's first forward raises), the reducer leaves every non-delayed parameter to FSDP2's own
reduce-scatter and takes over the delayed modules' GEMM parameters (FSDP2's internals it needs
are fenced in :mod:`.fsdp`): their gradients, written by ``backward_dw()`` to FSDP2's unsharded
parameters, are kept out of FSDP2's post-backward, and once a module's last entry of the step has
run they are reduce-scattered asynchronously (one collective per module, in the fixed bucket
order, averaged as FSDP2 averages) into the sharded ``param.grad`` DTensors, which ``finish()``
writes (or adds to). Under a ``MixedPrecisionPolicy`` whose ``reduce_dtype`` differs from the
gradients' dtype, a step's micro-batches are summed in ``reduce_dtype`` once each pass's entries
have run, as FSDP2 sums its own between passes. ``backward_dw()`` runs with the unsharded
``Parameter`` objects registered, as the backward saw them (FSDP2 has resharded by then; no data
is gathered: a wgrad entry needs no weight values). The reducer may be built on a model still on
meta: its parameters are marked again after ``to_empty()`` (see
:func:`.fsdp.mark_reduced_from_module_hooks`).

``no_sync()`` also turns FSDP2's gradient sync off (its ``set_requires_gradient_sync``) for its
passes; with ``num_microbatches`` the caller sets it. Either way a disagreement is reported by
``finish()``: FSDP2 syncing in a pass the reducer counts as non-final, or not syncing in the last
one, unless told the reduction is deferred (``set_is_last_backward(False)``, as
``PipelineStage`` does before calling FSDP2's post-backward at its REDUCE_GRAD step); and a
gradient FSDP2 left unreduced on an unsharded parameter.

Parameters that were DTensors before ``fully_shard`` (torch's tensor-parallel styles on the
other dimension of a 2-D mesh, torchtitan's layout) are reduced as FSDP2 reduces them: the
gradient ``backward_dw()`` wrote (a DTensor on the tensor-parallel mesh) is brought to the
parameter's own placements (a ``Partial`` one is summed over the tensor-parallel mesh), and its
local shard is reduce-scattered over the data-parallel group.

Refused (``ValueError``): fused accumulation, HSDP and replicate meshes, CPU offload,
parameters no ``fully_shard`` manages, and a model with no delayed module (FSDP2 alone
suffices). ``bucket_cap_mb`` does not apply.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import weakref
from collections.abc import Iterator

import torch

from . import _torch_private, fsdp
from .reducer_allreduce import Bucket
from .reducer_finality import FinalityTracker, Owner
from .reducer_params import ReducedParam
from .tensor_parallel import is_dtensor

__all__ = ["FsdpReduceScatter"]


class FsdpReduceScatter:
    """Reduce-scatters each delayed module's gradients into FSDP2's sharded gradients, and
    checks FSDP2's own reduction of the other parameters against the tracker's passes."""

    def __init__(
        self,
        layout: fsdp.FsdpLayout,
        params: list[ReducedParam],
        fsdp_own: list[tuple[str, object]],
        tracker: FinalityTracker,
    ) -> None:
        self.layout = layout
        self.params = params
        self.tracker = tracker
        # FSDP2 reduces these itself (non-delayed parameters under fully_shard)
        self.fsdp_own = fsdp_own
        # FSDP2 post-backward passes per group this step: id(group) -> [last task, count]
        self.passes: dict[int, list[int]] = {}

    def attach(self, owners: list[Owner]) -> None:
        """Route the delayed gradients past FSDP2 (see :mod:`.fsdp`): mark their sharded
        parameters for the modules' guard, keep them out of FSDP2's post-backward, and let
        ``backward_dw()`` see the unsharded parameters it writes."""
        layout = self.layout
        delayed_by_group: dict[int, list] = {id(g): [] for g in layout.groups}
        self.own_by_group: dict[int, list] = {id(g): [] for g in layout.groups}
        for _, fp in self.fsdp_own:
            self.own_by_group[id(layout.group_of[id(fp.sharded_param)])].append(fp)
        for st in self.params:
            fsdp.mark_reduced_from_module_hooks(st.fsdp)
            delayed_by_group[id(layout.group_of[id(st.param)])].append(st.fsdp)
        for group in layout.groups:
            fsdp.wrap_post_backward(
                group,
                functools.partial(
                    _call_weakly_around, weakref.ref(self), group, delayed_by_group[id(group)]
                ),
            )
        for owner in owners:
            fsdp.unshard_during_backward_dw(
                owner.sm.module, [(st.local, st.fsdp) for st in owner.params]
            )

    def around_post_backward(self, group, delayed: list, run) -> None:
        """FSDP2's post-backward of ``group``: its sync flag checked against this pass, the
        delayed gradients hidden from it."""
        task = _torch_private.current_backward_pass()
        if task >= 0:
            self._check_sync(group, task)
        hidden = [(fp, fsdp.take_unsharded_grad(fp)) for fp in delayed]
        try:
            run()
        finally:
            for fp, g in hidden:
                if g is not None:
                    fsdp.put_back_unsharded_grad(fp, g)

    def _check_sync(self, group, task: int) -> None:
        """FSDP2 must reduce a group's own gradients in the step's last backward pass and in no
        other: its ``set_requires_gradient_sync`` agrees with ``no_sync()`` or
        ``num_microbatches``. A final pass whose reduction FSDP2 was told to defer
        (``set_is_last_backward(False)``, as ``PipelineStage`` does before calling
        ``post_backward`` itself) is accepted; ``finish()`` checks nothing was left."""
        own = self.own_by_group.get(id(group), ())
        if not any(fsdp.unreduced_grad(fp) for fp in own):
            return  # nothing for FSDP2 to reduce (all delayed, or an input-only backward)
        self.tracker.begin_step_if_needed()
        label = _torch_private.group_name(group) or "a fully_shard group"
        seen = self.passes.setdefault(id(group), [-1, 0])
        if seen[0] != task:
            seen[0] = task
            seen[1] += 1
        final = self.tracker.final_pass(label, seen[1])
        sync = bool(group.reduce_grads)
        deferred = not self.layout.is_last_backward(group)
        errors = self.tracker.step.errors
        if final and not sync and not deferred:
            errors.append(
                f"{label}: FSDP2's gradient sync is off (set_requires_gradient_sync(False)) in "
                "the backward pass the reducer counts as the step's last, so FSDP2 never reduces "
                "its own gradients"
            )
        elif sync and not final:
            errors.append(
                f"{label}: FSDP2 reduce-scattered its gradients in backward pass {seen[1]}, which "
                "the reducer was told is not the step's last (run the non-final micro-batches "
                "inside reducer.no_sync(), which turns FSDP2's gradient sync off for them)"
            )

    def launch(self, bucket: Bucket) -> None:
        """Start the reduce-scatter of ``bucket``'s gradients (one delayed module's)."""
        step = self.tracker.step
        fps, grads = [], []
        for st in bucket.params:
            g = fsdp.take_final_grad(st.fsdp, st.accumulated)
            st.accumulated = None
            if g is None:
                step.errors.append(f"{st.name}: final but no gradient was written")
                continue
            fps.append(st.fsdp)
            grads.append(_local_grad(st.fsdp, g))
        group = self.layout.group_of[id(bucket.params[0].param)]
        bucket.work = fsdp.ReduceScatter(fps, grads, group) if fps else None
        bucket.log_launch(step, collective="reduce_scatter")

    def complete(self, bucket: Bucket, timeout: datetime.timedelta, errors: list[str]) -> None:
        """Wait for ``bucket``'s reduce-scatter and write its shards into ``param.grad``."""
        if bucket.work is None:
            return
        bucket.wait(bucket.work.complete, timeout, "reduce-scatter")

    def on_pass_done(self, owner: Owner) -> None:
        """Every entry of a non-final backward pass of ``owner``'s module has run: what FSDP2
        does to its own gradients after such a pass."""
        for st in owner.params:
            st.accumulated = fsdp.accumulate_between_passes(st.fsdp, st.accumulated)

    @contextlib.contextmanager
    def sync_off(self) -> Iterator[None]:
        """FSDP2's own gradient sync off (its ``set_requires_gradient_sync``) for ``no_sync()``'s
        passes."""
        groups = self.layout.groups
        flags = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
        for g in groups:
            g.reduce_grads = g.all_reduce_grads = False
        try:
            yield
        finally:
            for g, reduce_grads, all_reduce_grads in flags:
                g.reduce_grads, g.all_reduce_grads = reduce_grads, all_reduce_grads

    def left_unreduced(self) -> list[str]:
        """What ``finish()`` reports of FSDP2's own reduction: gradients it left unreduced."""
        left = [name for name, fp in self.fsdp_own if fsdp.unreduced_grad(fp)]
        if not left:
            return []
        return [
            f"FSDP2 left the gradients of {left} unreduced on the unsharded parameters: "
            "its gradient sync was off in the step's last backward pass (use the reducer's "
            "no_sync() for the non-final micro-batches, which sets FSDP2's "
            "set_requires_gradient_sync for them, or set it True for the last one)"
        ]

    def reset(self) -> None:
        """Forget the step (called by ``finish()``)."""
        for st in self.params:
            st.accumulated = None
        self.passes.clear()


def _local_grad(fsdp_param, grad: torch.Tensor) -> torch.Tensor:
    """What FSDP2's post-backward reduce-scatters for ``grad``: itself, or for a tensor-parallel
    (DTensor) parameter its local shard, once in the unsharded parameter's placements."""
    if not is_dtensor(grad):
        return grad
    placements = _torch_private.unsharded_param(fsdp_param).placements
    if grad.placements != placements:
        with torch.no_grad():
            grad = grad.redistribute(placements=placements)
    return grad.to_local()


def _call_weakly_around(backend: weakref.ref, group, delayed: list, run) -> None:
    target = backend()
    if target is None:
        run()
    else:
        target.around_post_backward(group, delayed, run)
