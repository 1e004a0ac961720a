"""Buckets, and the all-reduce back-end of :class:`~splitgrad.distributed.GradientReducer`
(SPEC §8, P16).

Parameters are packed into buckets (``bucket_cap_mb``, one dtype each) in the order they are
expected to become final: parameters reduced from autograd's hooks first, then the delayed ones,
each group last-registered first. A bucket is launched as soon as all its parameters are final
*and* every earlier bucket has been launched, so every rank issues the same collectives in the
same order. Launches overlap the rest of the backward and the remaining ``backward_dw()`` work;
``launch_log`` records when each launch happened.

Without ``fully_shard``, :class:`AllReduceBuckets` flattens a bucket and all-reduces it
asynchronously; ``finish()`` waits, averages over the process group and writes the averages back
into ``.grad`` (or ``main_grad``), reporting a gradient that was changed while it was being
reduced. A DTensor parameter (torch's tensor-parallel styles, the data-parallel group being
another dimension of the mesh) is reduced through its local shard, after its gradient is brought
to the parameter's own placements (a ``Partial`` one, a sequence-parallel norm's, is summed over
the tensor-parallel mesh first, as FSDP2 does). Under ``fully_shard`` a bucket is one delayed
module's parameters and :mod:`.reducer_fsdp` reduce-scatters it instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .modules import gradient_tensor
from .reducer_finality import Owner, Step
from .reducer_params import ReducedParam
from .tensor_parallel import is_dtensor

__all__ = ["Bucket", "make_buckets", "AllReduceBuckets"]


@dataclasses.dataclass(eq=False)
class Bucket:
    """Parameters reduced by one collective, and that collective while it is in flight."""

    index: int
    params: list[ReducedParam]
    work: object = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    # what the collective reads and writes for each gradient (a DTensor's local shard)
    local_grads: list[torch.Tensor] = dataclasses.field(default_factory=list)

    def reset(self) -> None:
        self.work, self.flat, self.grads, self.versions, self.local_grads = None, None, [], [], []

    def log_launch(self, step: Step, **extra) -> None:
        """Record in ``step.launch_log`` that this bucket's collective starts now."""
        step.launch_log.append(
            {
                "bucket": self.index,
                "params": [st.name for st in self.params],
                "time": time.perf_counter(),
                "step": step.number,
                **extra,
            }
        )

    def wait(self, complete: Callable, timeout: datetime.timedelta, collective: str) -> None:
        """``complete(timeout)``; a ``RuntimeError`` naming the bucket when it times out."""
        try:
            complete(timeout)
        except RuntimeError as exc:
            names = [st.name for st in self.params]
            raise RuntimeError(
                f"GradientReducer: the {collective} of bucket {self.index} {names} did not "
                f"complete within {timeout} (a rank failed or issued other collectives)"
            ) from exc


def make_buckets(params: list[ReducedParam], cap_mb: float) -> list[Bucket]:
    """``params`` in launch order, cut where the kind changes (fused or not, dtype, device,
    delayed or not; under fully_shard, the module: one reduce-scatter per delayed module) and,
    without fully_shard, where a bucket would pass ``cap_mb``."""
    cap = cap_mb * 2**20
    ordered = [st for st in reversed(params) if not st.delayed] + [
        st for st in reversed(params) if st.delayed
    ]
    buckets: list[Bucket] = []
    current: list[ReducedParam] = []
    size, kind = 0.0, None
    for st in ordered:
        this_kind = (st.main_grad, st.param.dtype, st.param.device, st.delayed)
        if st.fsdp is not None:  # one reduce-scatter per delayed module
            this_kind += (id(st.owner.module),)
        nbytes = st.param.numel() * (4 if st.main_grad else st.param.element_size())
        if current and (this_kind != kind or (st.fsdp is None and size + nbytes > cap)):
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0.0
        current.append(st)
        size += nbytes
        kind = this_kind
    if current:
        buckets.append(Bucket(len(buckets), current))
    for b in buckets:
        for st in b.params:
            st.bucket = b.index
    return buckets


class AllReduceBuckets:
    """Averages each bucket over ``process_group`` with one asynchronous all-reduce."""

    def __init__(self, process_group: dist.ProcessGroup | None, world_size: int, step: Step):
        self.process_group = process_group
        self.world_size = world_size
        self.step = step

    def launch(self, bucket: Bucket) -> None:
        """Flatten ``bucket``'s gradients and start their all-reduce."""
        grads = []
        for st in bucket.params:
            g = gradient_tensor(st.param, st.main_grad)
            if g is None:
                self.step.errors.append(f"{st.name}: final but no gradient was written")
                g = torch.zeros_like(st.param)
                st.param.grad = g
            elif is_dtensor(g) and g.placements != st.param.placements:
                with torch.no_grad():
                    g = g.redistribute(st.param.device_mesh, st.param.placements)
                st.param.grad = g
            grads.append(g)
        bucket.grads = grads
        bucket.local_grads = [g.to_local() if is_dtensor(g) else g for g in grads]
        bucket.versions = [t._version for t in bucket.local_grads]
        bucket.flat = torch.cat([t.detach().reshape(-1) for t in bucket.local_grads])
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        bucket.log_launch(self.step)

    def complete(self, bucket: Bucket, timeout: datetime.timedelta, errors: list[str]) -> None:
        """Wait for ``bucket``'s all-reduce and write the averages back; a gradient that was
        replaced or written in the meantime goes to ``errors``."""
        bucket.wait(bucket.work.wait, timeout, "all-reduce")
        bucket.flat.div_(self.world_size)
        offset = 0
        for st, g, local, version in zip(
            bucket.params, bucket.grads, bucket.local_grads, bucket.versions
        ):
            now = gradient_tensor(st.param, st.main_grad)
            if now is not g or local._version != version:
                errors.append(f"{st.name}: changed while its reduction was in flight")
            n = local.numel()
            local.copy_(bucket.flat[offset : offset + n].view_as(local))
            offset += n

    def on_pass_done(self, owner: Owner) -> None:
        """Nothing to do between a delayed module's passes: its gradient accumulates in place."""

    def sync_off(self) -> contextlib.AbstractContextManager:
        """Nothing else to turn off for :meth:`GradientReducer.no_sync`'s passes."""
        return contextlib.nullcontext()

    def left_unreduced(self) -> list[str]:
        """Nothing is reduced by anyone else."""
        return []

    def reset(self) -> None:
        """No state of its own beyond the buckets'."""
