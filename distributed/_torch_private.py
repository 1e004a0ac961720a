"""Every private module, function and name of torch that ``splitgrad.distributed`` uses, in one
place (:mod:`.fsdp` reads the attributes of FSDP2's private objects, and calls the functions
below for its private modules). Each function names what it reads; when that is missing, or the
call stack does not look as it did, calling it raises :class:`TorchMoved` naming the running
torch version and the versions this module was checked on. Nothing answers quietly.

Checked on torch 2.8, 2.13 and 2.14 (:data:`CHECKED_ON`); FSDP2's on 2.13 and 2.14
(:data:`FSDP_CHECKED_ON`).

Autograd, to tell backward passes apart from the modules' side (GradientReducer):

* :func:`current_backward_pass`: ``torch._C._current_graph_task_id()``;
* :func:`at_end_of_backward_pass`: ``torch.autograd.Variable._execution_engine.queue_callback``
  (what ``DistributedDataParallel`` and FSDP use for the same purpose);
* :func:`check_available`: both of them, checked once up front.

``torch.distributed.pipelining`` (:mod:`.pipeline`), which has no public hook for either:

* :func:`in_shape_inference`, :func:`shape_inference_method`: whether a forward runs inside a
  stage's shape-inference pass, a private method (:data:`SHAPE_INFERENCE_METHODS`) found on the
  call stack;
* :func:`calling_stage`: the stage calling a ``dw_builder`` and its micro-batch id, the
  ``self`` and ``bwd_chunk_id`` of the stage's ``backward_one_chunk`` frame;
* :func:`is_stage`: ``torch.distributed.pipelining.stage._PipelineStageBase``, the base the
  schedules' stages share.

FSDP2's private modules ``torch.distributed.fsdp._fully_shard._fsdp_collectives`` and
``_fsdp_common`` (:mod:`.fsdp`, reducing delayed gradients as FSDP2 does):
:func:`gradient_divide_factors`, :func:`dim0_padded_size`, :func:`reduce_scatter_copy_in`,
:func:`is_1d_fsdp_mesh`, :func:`is_default_reduce_scatter`; :func:`check_fsdp_available`, all
of them up front.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

__all__ = [
    "CHECKED_ON",
    "TorchMoved",
    "check_available",
    "current_backward_pass",
    "at_end_of_backward_pass",
    "SHAPE_INFERENCE_METHODS",
    "shape_inference_method",
    "in_shape_inference",
    "is_stage",
    "calling_stage",
    "FSDP_CHECKED_ON",
    "check_fsdp_available",
    "is_1d_fsdp_mesh",
    "is_default_reduce_scatter",
    "gradient_divide_factors",
    "dim0_padded_size",
    "reduce_scatter_copy_in",
]

CHECKED_ON = "2.8, 2.13, 2.14"


class TorchMoved(RuntimeError):
    """A private torch API splitgrad.distributed relies on is missing from this torch version."""


def _moved(what: str, consequence: str, checked_on: str = CHECKED_ON) -> TorchMoved:
    return TorchMoved(
        f"torch {torch.__version__} has no {what} (splitgrad.distributed was checked on torch "
        f"{checked_on}); {consequence}"
    )


# ---- autograd -------------------------------------------------------------------------------

_PASSES = "splitgrad.distributed.GradientReducer cannot tell backward passes apart"
_GRAPH_TASK_ID = "torch._C._current_graph_task_id"
_QUEUE_CALLBACK = "torch.autograd.Variable._execution_engine.queue_callback"

# Bound once: the reducer asks on every gradient its hooks see.
_graph_task_id = getattr(torch._C, "_current_graph_task_id", None)
_queue_callback = getattr(
    getattr(torch.autograd.Variable, "_execution_engine", None), "queue_callback", None
)


def check_available() -> None:
    """Raise :class:`TorchMoved` if :func:`current_backward_pass` or
    :func:`at_end_of_backward_pass` would."""
    if _graph_task_id is None:
        raise _moved(_GRAPH_TASK_ID, _PASSES)
    if _queue_callback is None:
        raise _moved(_QUEUE_CALLBACK, _PASSES)


def current_backward_pass() -> int:
    """``torch._C._current_graph_task_id()``: id of the running backward pass (-1 outside of
    one)."""
    if _graph_task_id is None:
        raise _moved(_GRAPH_TASK_ID, _PASSES)
    return int(_graph_task_id())


def at_end_of_backward_pass(fn: Callable[[], None]) -> None:
    """``Variable._execution_engine.queue_callback(fn)``: run ``fn()`` once the running backward
    pass has finished (called from a hook in it)."""
    if _queue_callback is None:
        raise _moved(_QUEUE_CALLBACK, _PASSES)
    _queue_callback(fn)


# ---- torch.distributed.pipelining -----------------------------------------------------------

#: What ``torch.distributed.pipelining``'s stages call their shape-inference forward, by torch
#: version: ``_forward_metadata_inference`` (torch 2.12 and newer), ``_shape_inference`` (2.11
#: and older). A private method, so it is recognised by every name it has had, and
#: :func:`shape_inference_method` refuses a torch where it has none of them.
SHAPE_INFERENCE_METHODS = ("_forward_metadata_inference", "_shape_inference")


def shape_inference_method() -> str:
    """The name this torch's ``PipelineStage`` gives its shape-inference forward (one of
    :data:`SHAPE_INFERENCE_METHODS`). Raises :class:`TorchMoved` naming the torch version when
    it has none of them: the pass moved, and :func:`in_shape_inference` could not see it."""
    from torch.distributed.pipelining import PipelineStage

    for name in SHAPE_INFERENCE_METHODS:
        if callable(getattr(PipelineStage, name, None)):
            return name
    raise TorchMoved(
        f"torch {torch.__version__}: torch.distributed.pipelining.PipelineStage has none of "
        f"{SHAPE_INFERENCE_METHODS}, the names its shape-inference forward had up to now "
        f"(checked on torch {CHECKED_ON}); splitgrad cannot tell that pass from a real forward "
        "on this torch. Give the stage static input_args/output_args (no inference runs), and "
        "report the torch version"
    )


def in_shape_inference() -> bool:
    """Whether the forward being run is ``torch.distributed.pipelining``'s shape-inference pass
    (a ``PipelineStage``'s first ``step()`` without static shapes runs the stage once on
    placeholder tensors): whether a frame anywhere on the call stack runs one of
    :data:`SHAPE_INFERENCE_METHODS` on a stage (``self`` checked, so a function of the same
    name elsewhere is not taken for it). The whole stack is read, so ``False`` means no such
    frame; a torch whose stage has none of these methods raises (:func:`shape_inference_method`)
    instead of answering ``False`` during a pass it cannot see."""
    shape_inference_method()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in SHAPE_INFERENCE_METHODS and is_stage(frame.f_locals.get("self")):
            return True
        frame = frame.f_back
    return False


_stage_base: type | None = None


def is_stage(obj: object) -> bool:
    """Whether ``obj`` is a pipelining stage: an instance of
    ``torch.distributed.pipelining.stage._PipelineStageBase``, which ``PipelineStage`` and the
    stages ``pipeline()`` builds share."""
    global _stage_base
    if _stage_base is None:
        from torch.distributed.pipelining import stage

        try:
            _stage_base = stage._PipelineStageBase
        except AttributeError:
            raise _moved(
                "torch.distributed.pipelining.stage._PipelineStageBase",
                "splitgrad.distributed cannot recognise a pipeline stage on the call stack",
            ) from None
    return isinstance(obj, _stage_base)


def calling_stage(builder: object) -> tuple[object, int] | None:
    """``(stage, micro-batch id)`` of the pipelining stage calling ``builder`` as its
    ``dw_builder`` (torch has no public hook that hands a builder its stage): the ``self`` and
    ``bwd_chunk_id`` of the first frame on the call stack whose ``self`` is a stage with
    ``stage.dw_builder is builder`` (the stage's ``backward_one_chunk``). ``None`` when no code
    of ``torch.distributed.pipelining`` is on the stack (a runtime of the caller's own).

    Raises :class:`TorchMoved` when pipelining code is on the stack but no frame holds the
    stage, or that frame has no integer ``bwd_chunk_id``: torch moved the call."""
    frame = sys._getframe(1)
    called_by_pipelining = False
    while frame is not None:
        has_self = "self" in frame.f_code.co_varnames  # f_locals only where it can help
        candidate = frame.f_locals.get("self") if has_self else None
        if is_stage(candidate) and getattr(candidate, "dw_builder", None) is builder:
            chunk = frame.f_locals.get("bwd_chunk_id")
            if isinstance(chunk, int):
                return candidate, chunk
            break
        module = frame.f_globals.get("__name__", "")
        called_by_pipelining |= module.startswith("torch.distributed.pipelining")
        frame = frame.f_back
    if frame is None and not called_by_pipelining:
        return None
    raise TorchMoved(
        f"torch {torch.__version__}: dw_builder was called from torch.distributed.pipelining, "
        "but no calling frame holds the PipelineStage whose dw_builder it is, with the "
        f"micro-batch's bwd_chunk_id (torch moved the call; checked on torch {CHECKED_ON}); call "
        "builder.attach(stage) after building the stage, and report the torch version"
    )


# ---- FSDP2 (fully_shard) --------------------------------------------------------------------

#: The torch versions FSDP2's private parts below were checked on (torch 2.8's FSDP2 has no
#: ``DefaultReduceScatter``: the reducer refuses it).
FSDP_CHECKED_ON = "2.13, 2.14"
_FSDP = "GradientReducer cannot route delayed gradients into FSDP2's sharded gradients"
_FULLY_SHARD = "torch.distributed.fsdp._fully_shard"
#: What :mod:`.fsdp` calls of FSDP2's private modules, by module.
_FSDP_NAMES = {
    "_fsdp_collectives": (
        "_get_gradient_divide_factors",
        "foreach_reduce_scatter_copy_in",
        "DefaultReduceScatter",
    ),
    "_fsdp_common": ("_get_dim0_padded_size", "FSDPMeshInfo", "DDPMeshInfo"),
}


def _fsdp_name(module: str, name: str):
    """``torch.distributed.fsdp._fully_shard.<module>.<name>``, looked up at each call (tests
    stand in for FSDP2's functions on its modules)."""
    try:
        found = importlib.import_module(f"{_FULLY_SHARD}.{module}")
    except ImportError:
        raise _moved(f"{_FULLY_SHARD}.{module}", _FSDP, FSDP_CHECKED_ON) from None
    try:
        return getattr(found, name)
    except AttributeError:
        raise _moved(f"{_FULLY_SHARD}.{module}.{name}", _FSDP, FSDP_CHECKED_ON) from None


def check_fsdp_available() -> None:
    """Raise :class:`TorchMoved` if any function of FSDP2's private modules that
    :mod:`.fsdp` calls is missing."""
    for module, names in _FSDP_NAMES.items():
        for name in names:
            _fsdp_name(module, name)


def is_1d_fsdp_mesh(mesh_info: object) -> bool:
    """Whether an ``FSDPParamGroup.mesh_info`` shards over a 1-D mesh: an ``FSDPMeshInfo`` of
    ``_fsdp_common`` that is no ``DDPMeshInfo`` (HSDP and replicate meshes are)."""
    fsdp_mesh = _fsdp_name("_fsdp_common", "FSDPMeshInfo")
    ddp_mesh = _fsdp_name("_fsdp_common", "DDPMeshInfo")
    return isinstance(mesh_info, fsdp_mesh) and not isinstance(mesh_info, ddp_mesh)


def is_default_reduce_scatter(comm: object) -> bool:
    """Whether ``comm`` (an ``FSDPParamGroup``'s reduce-scatter) is FSDP2's own
    ``_fsdp_collectives.DefaultReduceScatter``, not a custom one."""
    return type(comm) is _fsdp_name("_fsdp_collectives", "DefaultReduceScatter")


def gradient_divide_factors(
    group: dist.ProcessGroup,
    reduce_dtype: torch.dtype,
    device_type: str,
    factor: float | None,
    force_sum_reduction_for_comms: bool,
) -> tuple:
    """``_fsdp_collectives._get_gradient_divide_factors`` for a reduce-scatter over ``group``
    alone (no all-reduce group): ``(pre-divide, post-divide, reduce op, all-reduce op)``."""
    divide_factors = _fsdp_name("_fsdp_collectives", "_get_gradient_divide_factors")
    return divide_factors(
        group, None, reduce_dtype, device_type, factor, force_sum_reduction_for_comms
    )


def dim0_padded_size(size: torch.Size, world: int) -> torch.Size:
    """``_fsdp_common._get_dim0_padded_size``: ``size`` with dim 0 padded to a multiple of
    ``world``."""
    return _fsdp_name("_fsdp_common", "_get_dim0_padded_size")(size, world)


def reduce_scatter_copy_in(grads: list[torch.Tensor], flat_in: torch.Tensor, world: int) -> None:
    """``_fsdp_collectives.foreach_reduce_scatter_copy_in``: ``grads`` copied into the flat
    reduce-scatter input in FSDP2's layout."""
    _fsdp_name("_fsdp_collectives", "foreach_reduce_scatter_copy_in")(grads, flat_in, world)
