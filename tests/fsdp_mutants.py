"""Reducers with one planted bug each on GradientReducer's FSDP2 path (SPEC §8 "Fully sharded
data parallel"), for the meta-tests of ``check_fully_sharded``'s mixed-precision cells
(``tests/test_distributed_fsdp.py``). Each is importable by name (``fsdp_mutants:
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
