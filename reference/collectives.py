"""The reference's tensor-parallel collectives (SPEC §9), written plainly: blocking, on the 2-D
row matrices the modules work on, along dim 0 (the rows; under sequence parallelism the
sequence, the outermost dimension of the input).

* :func:`gather_rows` — all-gather: rank ``r``'s rows become rows ``r * n ... (r + 1) * n`` of
  the result (``n`` rows per rank).
* :func:`scatter_rows` — reduce-scatter: the sum over ranks of the whole matrix, of which rank
  ``r`` keeps rows ``r * n / tp ...``.
* :func:`reduce` — all-reduce (sum) of the whole matrix.

Rounding: the sums run in the tensor's dtype (a bf16 sum rounds at each addition, in an order
the backend chooses), and every rank receives the same values. That is the only rounding the
collectives add: a gather moves values unchanged.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import TensorParallel, check_gather_order

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

__all__ = [
    "gather_rows",
    "scatter_rows",
    "reduce",
    "reduce_rows",
    "own_rows",
    "GatherInW",
    "operand",
    "gather_in_w",
]


def gather_rows(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-gather ``t`` (n, ...) over ``tp.group`` along dim 0 -> (n * tp.size, ...)."""
    out = t.new_empty(t.shape[0] * tp.size, *t.shape[1:])
    _all_gather(out, t.contiguous(), group=tp.group)
    return out


def scatter_rows(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Reduce-scatter (sum) ``t`` (n, ...) over ``tp.group`` along dim 0 -> (n / tp.size, ...)."""
    out = t.new_empty(t.shape[0] // tp.size, *t.shape[1:])
    _reduce_scatter(out, t.contiguous(), group=tp.group)
    return out


def reduce(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """All-reduce (sum) ``t`` over ``tp.group``; a new tensor (``t`` is left as it is)."""
    out = t.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=tp.group)
    return out


def own_rows(gathered: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's rows of a :func:`gather_rows` result: a view, no copy."""
    n = gathered.shape[0] // tp.size
    return gathered.narrow(0, tp.rank * n, n)


def reduce_rows(t: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The sum over ranks of partial results ``t``: reduce-scattered along the rows under
    sequence parallelism, all-reduced otherwise (a row layer's output, a column layer's
    dgrad)."""
    return scatter_rows(t, tp) if tp.sequence_parallel else reduce(t, tp)


class GatherInW:
    """A wgrad operand an entry keeps as the rank's shard (``wgrad_gather="backward_dw"``):
    all-gathered along the rows when the wgrad runs, inside ``backward_dw()``."""

    __slots__ = ("shard", "tp")

    def __init__(self, shard: torch.Tensor, tp: TensorParallel) -> None:
        self.shard, self.tp = shard, tp

    def gathered(self, module: torch.nn.Module) -> torch.Tensor:
        check_gather_order(module, self.shard.device, _all_gather)
        return gather_rows(self.shard, self.tp)


def operand(t: torch.Tensor | GatherInW | None, module: torch.nn.Module) -> torch.Tensor | None:
    """A wgrad operand of ``module``'s entry as a tensor: gathered now (after checking that
    every rank gathers for the same entry) if the entry kept only the shard."""
    return t.gathered(module) if isinstance(t, GatherInW) else t


def gather_in_w(shard: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """:meth:`GatherInW.gathered` for a shard held elsewhere (an FP8 copy kept as a shard)."""
    return GatherInW(shard, module._tp).gathered(module)
