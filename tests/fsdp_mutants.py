"""Reducers with one planted bug each on GradientReducer's FSDP2 path (SPEC §8 "Fully sharded
data parallel"), for the meta-tests of ``check_fully_sharded``'s cells (mixed precision,
``Shard(1)`` placements, 3 ranks, 3 micro-batches, post-accumulate-grad hooks;
``tests/test_distributed_fsdp.py``). Each is importable by name (``fsdp_mutants:
NoPostDivideReducer``), as the check builds the reducer inside its spawned ranks."""

from __future__ import annotations

from splitgrad.distributed import GradientReducer


class NoPostDivideReducer(GradientReducer):
    """The reducer's FSDP2 reduce-scatter without its post-divide: the division by the world
    size FSDP2 applies after a SUM reduce-scatter (``set_force_sum_reduction_for_comms(True)``)
    is dropped, so every averaged gradient comes out summed."""

    def _launch(self, bucket) -> None:
        super()._launch(bucket)
        if bucket.work is not None:
            bucket.work.post = None


class NoPreDivideReducer(GradientReducer):
    """The reducer's FSDP2 reduce-scatter without its pre-divide: the part of the world size
    FSDP2 divides by before a SUM reduce-scatter in fp16 (against overflow) is dropped."""

    def _launch(self, bucket) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

        real = coll._get_gradient_divide_factors

        def without_pre(*args, **kwargs):
            _, post, op, all_reduce_op = real(*args, **kwargs)
            return None, post, op, all_reduce_op

        coll._get_gradient_divide_factors = without_pre  # for this launch only
        try:
            super()._launch(bucket)
        finally:
            coll._get_gradient_divide_factors = real


class PassesInParamDtypeReducer(GradientReducer):
    """The reducer under FSDP2 mixed precision leaving a step's micro-batch gradients to
    accumulate on ``.grad`` in the parameter dtype (bf16) where FSDP2 sums its own in the
    ``reduce_dtype`` (fp32): every gradient within rounding of the truth, none bitwise
    FSDP2's."""

    def _between_passes(self, owner) -> None:
        return None


class _PlacedOnDim0:
    """An ``FSDPParam`` seen through a copy-in that takes every parameter as ``Shard(0)``."""

    def __init__(self, fsdp_param) -> None:
        from torch.distributed.tensor import Shard

        self._fsdp_param = fsdp_param
        self.fsdp_placement = Shard(0)

    def __getattr__(self, name):
        return getattr(self._fsdp_param, name)


class Shard0AssumedReducer(GradientReducer):
    """The reducer's FSDP2 reduce-scatter laying every gradient out as if sharded on dim 0: a
    parameter ``shard_placement_fn`` put on ``Shard(1)`` is not rearranged into dim-0 chunks
    before the copy-in, so each rank gets rows where FSDP2 gives it columns (right wherever
    every parameter is ``Shard(0)``)."""

    def _launch(self, bucket) -> None:
        from splitgrad.distributed import fsdp

        real = fsdp.ReduceScatter

        def placed_on_dim0(fsdp_params, grads, group):
            return real([_PlacedOnDim0(fp) for fp in fsdp_params], grads, group)

        fsdp.ReduceScatter = placed_on_dim0  # for this launch only
        try:
            super()._launch(bucket)
        finally:
            fsdp.ReduceScatter = real


class DividesBeforeSumReducer(GradientReducer):
    """The reducer's FSDP2 reduce-scatter under forced sum (``set_force_sum_reduction_for_comms``)
    dividing by the world size *before* the SUM where FSDP2 divides after it: bitwise the same
    on 2 ranks (halving is exact), rounded otherwise on 3."""

    def _launch(self, bucket) -> None:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

        real = coll._get_gradient_divide_factors

        def divide_first(*args, **kwargs):
            pre, post, op, all_reduce_op = real(*args, **kwargs)
            if pre is None and post is not None:
                return post, None, op, all_reduce_op
            return pre, post, op, all_reduce_op

        coll._get_gradient_divide_factors = divide_first  # for this launch only
        try:
            super()._launch(bucket)
        finally:
            coll._get_gradient_divide_factors = real


class HooksNotRunReducer(GradientReducer):
    """The reducer writing the delayed modules' sharded gradients without running their
    post-accumulate-grad hooks (FSDP2 runs a sharded parameter's hooks once it has written its
    reduced shard): an optimizer-in-backward hook never sees those gradients."""

    def finish(self) -> None:
        from splitgrad.distributed import _torch_private

        real = _torch_private.post_accumulate_grad_hooks
        _torch_private.post_accumulate_grad_hooks = lambda tensor: []
        try:
            super().finish()
        finally:
            _torch_private.post_accumulate_grad_hooks = real


class LaterPassesLeftOnGradReducer(GradientReducer):
    """The reducer under a ``reduce_dtype`` other than the gradients' moving a module's
    gradient into the ``reduce_dtype`` sum after the step's first non-final pass only: the
    later passes accumulate on the unsharded ``.grad`` in the parameter dtype (right with 2
    micro-batches, off FSDP2's bits from 3 on)."""

    def _between_passes(self, owner) -> None:
        if any(st.accumulated is not None for st in owner.params):
            return
        super()._between_passes(owner)
