"""Every private module, function, name and attribute of torch that ``splitgrad.distributed``
uses, in one place (:mod:`.fsdp` reaches FSDP2's private objects through the functions below).
Each function names what it reads; when that is missing, or the
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
:func:`is_1d_fsdp_mesh`, :func:`custom_reduce_scatter`; :func:`check_fsdp_available`, all
of them up front. The private attributes of FSDP2's objects (``FSDPState``, ``FSDPParamGroup``,
``FSDPParam``) and of its sharded gradients: :func:`fsdp_param_groups`,
:func:`is_last_backward`, :func:`unsharded_param`, :func:`group_dtypes`,
:func:`group_name`, :func:`add_to_local_shard`, :func:`post_accumulate_grad_hooks`.

``torch.testing._internal.distributed.fake_pg`` (torch's fake process group, for
``splitgrad.bench.tensor_parallel``'s measurements; checked on :data:`FAKE_PG_CHECKED_ON`):
:func:`fake_store`.
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
    "fsdp_moved",
    "is_1d_fsdp_mesh",
    "custom_reduce_scatter",
    "gradient_divide_factors",
    "dim0_padded_size",
    "reduce_scatter_copy_in",
    "fsdp_param_groups",
    "is_last_backward",
    "unsharded_param",
    "group_dtypes",
    "group_name",
    "add_to_local_shard",
    "post_accumulate_grad_hooks",
    "FAKE_PG_CHECKED_ON",
    "fake_store",
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


def custom_reduce_scatter(group) -> object | None:
    """``group._reduce_scatter_comm`` (an ``FSDPParamGroup``'s reduce-scatter) when it is a custom
    one, ``None`` when it is FSDP2's own ``_fsdp_collectives.DefaultReduceScatter``."""
    comm = group._reduce_scatter_comm
    return None if type(comm) is _fsdp_name("_fsdp_collectives", "DefaultReduceScatter") else comm


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


# ---- the private attributes of FSDP2's objects ---------------------------------------------------

_PARAM_ATTRS = (
    "sharded_param",
    "_module_info",
    "sharded_size",
    "contiguous_sharded_stride",
    "reset_sharded_param",
)
_GROUP_ATTRS = ("fsdp_params", "post_backward", "reduce_grads", "mesh_info")


def fsdp_moved(what: str) -> TorchMoved:
    """The error for a part of FSDP2's objects this torch does not have."""
    return TorchMoved(
        f"splitgrad.distributed: torch {torch.__version__}'s fully_shard (FSDP2) has no {what} "
        f"(checked on torch {FSDP_CHECKED_ON}); GradientReducer cannot route delayed gradients "
        "into FSDP2's sharded gradients on this version"
    )


def fsdp_param_groups(module) -> tuple[object, list]:
    """``(state, groups)``: a ``fully_shard`` module's ``FSDPState``
    (``module._get_fsdp_state()``) and its ``FSDPParamGroup``s (``state._fsdp_param_groups``),
    each group and each of its ``FSDPParam``s checked for the attributes :mod:`.fsdp` uses."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        raise fsdp_moved("FSDPState._fsdp_param_groups")
    for group in groups:
        for attr in _GROUP_ATTRS:
            if not hasattr(group, attr):
                raise fsdp_moved(f"FSDPParamGroup.{attr}")
        for fp in group.fsdp_params:
            for attr in _PARAM_ATTRS:
                if not hasattr(fp, attr):
                    raise fsdp_moved(f"FSDPParam.{attr}")
    return state, groups


def is_last_backward(state) -> bool:
    """``state._state_ctx.is_last_backward``: FSDP2's ``set_is_last_backward`` flag."""
    ctx = getattr(state, "_state_ctx", None)
    if ctx is None or not hasattr(ctx, "is_last_backward"):
        raise fsdp_moved("FSDPState._state_ctx.is_last_backward")
    return bool(ctx.is_last_backward)


def unsharded_param(fsdp_param) -> torch.nn.Parameter | None:
    """``fsdp_param._unsharded_param``: the unsharded ``Parameter`` FSDP2 reuses every step
    (``None`` before the first unshard)."""
    return getattr(fsdp_param, "_unsharded_param", None)


def group_dtypes(group) -> tuple[torch.dtype | None, torch.dtype | None]:
    """``(group._reduce_dtype, group._orig_dtype)`` of an ``FSDPParamGroup`` (``None``: no mixed
    precision)."""
    return group._reduce_dtype, group._orig_dtype


def group_name(group) -> str | None:
    """``group._module_fqn``: the name of the module an ``FSDPParamGroup`` belongs to."""
    return getattr(group, "_module_fqn", None)


def add_to_local_shard(dtensor, shard: torch.Tensor) -> None:
    """``dtensor._local_tensor += shard``: accumulate into a sharded gradient in place."""
    dtensor._local_tensor += shard


def post_accumulate_grad_hooks(tensor: torch.Tensor) -> list:
    """The hooks registered with ``tensor.register_post_accumulate_grad_hook``
    (``tensor._post_accumulate_grad_hooks``), in registration order."""
    return list((getattr(tensor, "_post_accumulate_grad_hooks", None) or {}).values())


# ---- torch's fake process group (splitgrad.bench.tensor_parallel's measurements) ------------

#: The torch versions :func:`fake_store` was checked on.
FAKE_PG_CHECKED_ON = "2.13"


def fake_store() -> object:
    """A ``torch.testing._internal.distributed.fake_pg.FakeStore``; importing that module
    registers torch's ``"fake"`` backend, so ``init_process_group("fake", rank=..,
    world_size=.., store=fake_store())`` then makes a group whose collectives return at once
    with the right shapes and move no data. :class:`TorchMoved` when either is gone."""
    consequence = "splitgrad.bench.tensor_parallel cannot measure on a fake process group"
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        what = "torch.testing._internal.distributed.fake_pg.FakeStore"
        raise _moved(what, consequence, FAKE_PG_CHECKED_ON) from None
    if "fake" not in dist.Backend.backend_list:
        raise _moved("a 'fake' c10d backend", consequence, FAKE_PG_CHECKED_ON)
    return FakeStore()
