"""The tensor-parallel option of :class:`~splitgrad.distributed.GradientReducer` (SPEC §9):
``GradientReducer(model, ..., tp_group=group)`` sums the sequence-parallel gradients over the
tensor-parallel group, so no separate
:func:`~splitgrad.distributed.allreduce_sequence_parallel_grads` call is needed.

Which: the parameters the reducer reduces (``ignore`` leaves a parameter out of both) that
:func:`.tensor_parallel.sequence_parallel_parameters` names, FSDP2's own included under
``fully_shard``. When: in ``finish()``, once every data-parallel reduction of the step has
completed (FSDP2's own reduce-scatters are done when the backward returns), as Megatron sums
them after its data-parallel reduction: the average over the data-parallel group of per-rank
partial sums, then the sum over the tensor-parallel group, one all-reduce per dtype and device
(:func:`.tensor_parallel.sum_coalesced`). Every data-parallel replica sums the same averages,
so the gradients come out bitwise equal on every rank of both groups. Under ``fully_shard`` the
sum runs on each rank's local shard: a parameter replicated over the tensor-parallel group is
sharded the same way on each of its ranks.

A gradient missing on a rank (``finish()`` reports it) takes part as zeros and is not written,
so every rank still issues the same collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .modules import gradient_tensor
from .reducer_params import ReducedParam
from .tensor_parallel import check_tp_group, local_part, sequence_parallel_parameters, sum_coalesced

__all__ = ["SequenceParallelSum"]


class SequenceParallelSum:
    """The sequence-parallel gradients of a reducer's parameters and their sum over
    ``tp_group`` (nothing without a group)."""

    def __init__(
        self,
        module: torch.nn.Module,
        tp_group: dist.ProcessGroup | None,
        params: list[ReducedParam],
        fsdp_own: list[tuple[str, object]],
    ) -> None:
        self.group = tp_group
        # (name, parameter holding the gradient, whether in main_grad)
        self.params: list[tuple[str, torch.Tensor, bool]] = []
        if tp_group is None:
            return
        size = check_tp_group(tp_group)
        sp = {p.name for p in sequence_parallel_parameters(module)}
        reduced = [(st.name, st.param, st.main_grad) for st in params]
        reduced += [(name, fp.sharded_param, False) for name, fp in fsdp_own]
        # registration order, as named_parameters() gives them on every rank
        order = {name: i for i, (name, _) in enumerate(module.named_parameters())}
        self.params = sorted(
            (r for r in reduced if r[0] in sp), key=lambda r: order.get(r[0], len(order))
        )
        if size == 1:
            self.params = []

    @property
    def names(self) -> list[str]:
        return [name for name, _, _ in self.params]

    def run(self) -> None:
        """Sum the gradients over the group (each rank's local shard under fully_shard)."""
        if not self.params:
            return
        tensors = []
        for _, param, main_grad in self.params:
            g = gradient_tensor(param, main_grad)
            tensors.append(torch.zeros_like(local_part(param)) if g is None else local_part(g))
        sum_coalesced(tensors, self.group)
