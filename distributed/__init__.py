"""splitgrad.distributed — split backward across ranks on ``torch.distributed`` (SPEC §8).

The split exists for overlap: a weight-gradient GEMM has no consumer until the optimizer step,
so it can fill a pipeline bubble or hide a collective. This package makes that usable, with
only the public module API of SPEC §2-§4 (reference, impl, or any conforming package):

* :func:`dw_builder` — the W step of ``torch.distributed.pipelining``'s schedules (zero-bubble,
  DualPipeV, interleaved, and GPipe/1F1B unchanged), see :mod:`.pipeline`;
* :class:`GradientReducer` — data-parallel reduction that launches each bucket as soon as its
  gradients are final, from the module hooks for deferred ones, see :mod:`.data_parallel`;
* :class:`ExpertParallelMoE` and :func:`all_to_all` — expert parallelism whose experts'
  ``backward_dw()`` hides the dispatch all-to-all, see :mod:`.expert_parallel`;
* :func:`use_weight_grad_store` — hand deferred entries to DualPipe's ``WeightGradStore`` (or
  any store with ``enabled`` and ``put``), see :mod:`.weight_grad_store`;
* :func:`allreduce_sequence_parallel_grads` — sum the sequence-parallel gradients over the
  tensor-parallel group once per step (``GradientReducer(..., tp_group=...)`` does it itself),
  see :mod:`.tensor_parallel`;
* :func:`run_ranks` — spawn local ranks that fail instead of hanging, see :mod:`.launch`;
* :func:`assert_drained` — raise, naming each module and its count, if any ``backward_dw()`` of
  a step is still owed (``pending_wgrad_count`` of every module), see :mod:`.modules`.

torch's ``DistributedDataParallel`` cannot see gradients written by ``backward_dw()`` or into
``main_grad``: such modules raise inside DDP's forward and point here.
"""

from .data_parallel import GradientReducer, reducer_of
from .expert_parallel import ExpertParallelMoE, all_to_all
from .launch import RankFailure, run_ranks
from .modules import SplitModule, assert_drained, is_split_module, split_modules
from .pipeline import DWBuilder, WStepRunner, dw_builder, in_shape_inference
from .tensor_parallel import (
    SequenceParallelParam,
    allreduce_sequence_parallel_grads,
    sequence_parallel_parameters,
)
from .weight_grad_store import StoreEntry, WeightGradStoreHandle, use_weight_grad_store

__all__ = [
    "dw_builder",
    "DWBuilder",
    "WStepRunner",
    "in_shape_inference",
    "GradientReducer",
    "reducer_of",
    "ExpertParallelMoE",
    "all_to_all",
    "run_ranks",
    "RankFailure",
    "SplitModule",
    "split_modules",
    "is_split_module",
    "assert_drained",
    "use_weight_grad_store",
    "WeightGradStoreHandle",
    "StoreEntry",
    "allreduce_sequence_parallel_grads",
    "sequence_parallel_parameters",
    "SequenceParallelParam",
]
