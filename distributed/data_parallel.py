"""Data parallel: reduce every gradient once per step, as soon as it is final (SPEC §8, P16).

torch's ``DistributedDataParallel`` reduces a parameter from a hook on autograd's
``AccumulateGrad``, which fires during ``backward()``. A delayed GEMM parameter gets its gradient
later, in ``backward_dw()``, and a fused one accumulates into ``main_grad``, which DDP never
reads: under DDP both would stay unreduced (the modules refuse to run inside DDP's forward for
that reason). :class:`GradientReducer` takes DDP's place, composed of:

* **what is reduced** (:mod:`.reducer_params`): every trainable parameter's ``.grad``, or
  ``main_grad`` for fused GEMM weights, averaged over the process group;
* **when a gradient is final** (:mod:`.reducer_finality`): after the step's last backward pass
  that produces it (``no_sync()`` or ``num_microbatches`` tell which that is), followed from
  autograd's hooks for non-delayed parameters and from the modules' own API (forwards,
  ``pending_wgrad_count``, the module hook of SPEC §4) for delayed ones;
* **how** (:mod:`.reducer_allreduce`): buckets launched in one fixed order as soon as all their
  gradients are final, each an asynchronous all-reduce; under ``fully_shard`` (FSDP2) one
  reduce-scatter per delayed module into FSDP2's sharded gradients instead
  (:mod:`.reducer_fsdp`), every other parameter left to FSDP2.

:meth:`GradientReducer.finish` waits for every reduction (with a timeout), writes the averages
back, sums the sequence-parallel gradients over the tensor-parallel group when given one
(:mod:`.reducer_tp`), and raises ``RuntimeError`` if a gradient was never produced, was
produced again after its reduction had started (a micro-batch not marked as non-final, or a
``backward_dw()`` after the last one), or was changed while it was being reduced. Call it
before the optimizer step; it is a no-op when the step is already finished (a pipeline stage's
gradient scaling finishes it, see :mod:`.pipeline`).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import time
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from . import _torch_private, fsdp
from .reducer_allreduce import AllReduceBuckets, Bucket, make_buckets
from .reducer_finality import FinalityTracker, Owner, Step, call_weakly
from .reducer_fsdp import FsdpReduceScatter
from .reducer_params import ReducedParam, collect_params
from .reducer_tp import SequenceParallelSum

__all__ = ["GradientReducer", "reducer_of"]

_REDUCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reducer_of(module: torch.nn.Module) -> GradientReducer | None:
    """The :class:`GradientReducer` built on ``module`` itself, if any."""
    return _REDUCERS.get(module)


class GradientReducer:
    """Average-reduce every trainable parameter's gradient of ``module`` across
    ``process_group`` once per step, each bucket launched as soon as its gradients are final.

    Args:
        module: the model replica (plain ``torch.nn`` modules and split-backward modules alike).
        process_group: the data-parallel group (default: the world).
        num_microbatches: backward passes per step; ``None`` (default): every backward pass
            outside :meth:`no_sync` is a step's last.
        bucket_cap_mb: bucket size, as DDP's.
        ignore: parameters (or their names in ``module``) that this reducer leaves alone, e.g.
            the experts of an expert-parallel layer.
        timeout: how long :meth:`finish` waits for one bucket before raising.
        tp_group: the tensor-parallel group (SPEC §9): :meth:`finish` also sums over it, after
            the data-parallel reduction, the gradients of the parameters it reduces that are
            partial sums per rank under sequence parallelism (``sequence_parallel=True``), as
            :func:`~splitgrad.distributed.allreduce_sequence_parallel_grads` does; ``None``
            (default): no such sum.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        num_microbatches: int | None = None,
        bucket_cap_mb: float = 25.0,
        ignore: Iterable[str | torch.nn.Parameter] = (),
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
        tp_group: dist.ProcessGroup | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GradientReducer needs torch.distributed to be initialized")
        _torch_private.check_available()
        if num_microbatches is not None and (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if module in _REDUCERS:
            raise RuntimeError(
                "this module already has a GradientReducer (hooks cannot be removed): reuse it"
            )
        layout = fsdp.describe(module) if fsdp.is_fully_sharded(module) else None
        if layout is not None:
            if process_group is not None and process_group is not layout.process_group:
                raise ValueError(
                    "process_group differs from the group fully_shard shards over: under FSDP2 "
                    "the reducer reduce-scatters over FSDP2's own group (pass None)"
                )
            process_group = layout.process_group
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.num_microbatches = num_microbatches
        self.timeout = timeout
        self._params, fsdp_own = collect_params(module, ignore, layout)
        self._tp_sum = SequenceParallelSum(module, tp_group, self._params, fsdp_own)
        self._buckets = make_buckets(self._params, bucket_cap_mb)
        self._next_bucket = 0
        self._step = Step()
        #: ``time.perf_counter()`` when :meth:`finish` was last called.
        self.finish_time: float | None = None
        self._finality = FinalityTracker(
            self._params, num_microbatches, self._step, self._launch_ready, self._between_passes
        )
        self._owners: list[Owner] = self._finality.owners
        if layout is None:
            self._backend = AllReduceBuckets(process_group, self.world_size, self._step)
            module.register_forward_pre_hook(
                functools.partial(_call_weakly_hook, weakref.ref(self), "_check_not_sharded_later")
            )
        else:
            self._backend = FsdpReduceScatter(layout, self._params, fsdp_own, self._finality)
            self._backend.attach(self._owners)
        _REDUCERS[module] = self

    @property
    def sequence_parallel_names(self) -> list[str]:
        """The parameters whose gradients :meth:`finish` sums over ``tp_group`` (empty without
        one)."""
        return self._tp_sum.names

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[st.name for st in b.params] for b in self._buckets]

    @property
    def launch_log(self) -> list[dict]:
        """One record per bucket launch of the current step (a new list when the next step
        starts): ``{"bucket", "params", "time", "step"}``, ``time`` from
        ``time.perf_counter()``; under fully_shard also ``"collective": "reduce_scatter"``."""
        return self._step.launch_log

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context are not a step's last (as DDP's ``no_sync``);
        under fully_shard, FSDP2's own gradient sync is off for them too."""
        if self.num_microbatches is not None:
            raise RuntimeError(
                f"no_sync() with num_microbatches={self.num_microbatches}: use one or the other"
            )
        previous, self._finality.no_sync = self._finality.no_sync, True
        try:
            with self._backend.sync_off():
                yield
        finally:
            self._finality.no_sync = previous

    # ---- wiring: the tracker's events to the back-end ----------------------------------------

    def _launch_ready(self, st: ReducedParam) -> None:
        """``st`` is final: launch, in their fixed order, every bucket now wholly final."""
        while self._next_bucket < len(self._buckets) and all(
            q.ready for q in self._buckets[self._next_bucket].params
        ):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        self._backend.launch(bucket)

    def _between_passes(self, owner: Owner) -> None:
        """Every entry of a non-final backward pass of ``owner``'s module has run."""
        self._backend.on_pass_done(owner)

    def _check_not_sharded_later(self) -> None:
        # The root and the delayed modules only (cheap, every forward): a plain parameter under
        # a fully_shard applied later keeps its stale hook, and finish() reports it never
        # produced.
        if fsdp.any_fully_sharded([self.module] + [o.sm.module for o in self._owners]):
            raise RuntimeError(
                "fully_shard was applied after GradientReducer was built on this module: the "
                "reducer holds the replaced, unsharded parameters and would reduce nothing. "
                "Build GradientReducer(model) after fully_shard(...)"
            )

    # ---- the end of a step -------------------------------------------------------------------

    @property
    def step_finished(self) -> bool:
        """``True`` between :meth:`finish` and the next gradient of the next step."""
        return self._step.finished

    def finish(self) -> None:
        """Wait for every reduction of this step and write the averages back; raise
        ``RuntimeError`` naming every gradient that was never produced, produced twice, or
        changed while being reduced. Called when no gradient was produced since the reducer was
        built or last finished, it raises too (a step's backward ran on another model, or
        ``finish()`` was called twice), except once after a pipeline schedule's gradient scaling
        finished the step itself (see :func:`~splitgrad.distributed.dw_builder`)."""
        self.finish_time = time.perf_counter()
        if self._step.finished:
            if self._step.finished_by_schedule:
                self._step.finished_by_schedule = False
                return
            self._raise_without_step()
        errors = list(self._step.errors)
        missing = [st.name for st in self._params if not st.ready]
        try:
            with torch.no_grad():
                for bucket in self._buckets[: self._next_bucket]:
                    self._backend.complete(bucket, self.timeout, errors)
                self._tp_sum.run()
        finally:
            self._reset()
        errors += self._backend.left_unreduced()
        if missing:
            errors.append(
                f"never produced in this step, so never reduced: {missing} (a parameter no "
                "backward reached, a delayed module whose queue was not drained with "
                "backward_dw(), or a step with fewer backward passes than num_microbatches)"
            )
        if errors:
            raise RuntimeError("GradientReducer.finish(): " + "; ".join(errors))

    def finish_for_schedule(self) -> None:
        """:meth:`finish`, called by a pipeline stage's gradient scaling; one more ``finish()``
        by the training loop in the same step is then a no-op."""
        self.finish()
        self._step.finished_by_schedule = True

    def _raise_without_step(self) -> None:
        number = self._step.number
        since = "it was built" if number == 0 else f"step {number} was finished"
        names = [st.name for st in self._params]
        shown = ", ".join(names[:4])
        if len(names) > 4:
            shown += f", ... ({len(names)} in all)"
        raise RuntimeError(
            f"GradientReducer.finish() without a step: none of its parameters ({shown}) got "
            f"a gradient since {since}; run the step's backward passes (and backward_dw()) "
            "on this reducer's module first"
        )

    def _reset(self) -> None:
        self._step.finished = True
        self._next_bucket = 0
        self._finality.reset()
        self._backend.reset()
        for bucket in self._buckets:
            bucket.reset()


def _call_weakly_hook(reducer: weakref.ref, method: str, module, args) -> None:
    call_weakly(reducer, method)
