"""Tensor and sequence parallelism, the distributed side (SPEC §9): summing the
sequence-parallel gradients over the tensor-parallel group.

Under sequence parallelism a rank runs the norms, and adds a row-parallel layer's bias, on its
own slice of the sequence, so the gradient of such a replicated parameter is a per-rank partial
sum. Such parameters carry ``sequence_parallel=True`` (Megatron's attribute, set by the modules
of every package, SPEC §9); :func:`allreduce_sequence_parallel_grads` sums them over the group
once per step, after the last ``backward_dw()``, in one all-reduce per dtype and device
(Megatron's ``_allreduce_layernorm_grads``, which runs after the data-parallel reduction).
:class:`~splitgrad.distributed.GradientReducer` calls it itself when built with ``tp_group``.

``fully_shard`` (FSDP2) replaces a model's ``Parameter`` objects, which drops the attribute;
:func:`sequence_parallel_parameters` then reads the same rule from the options every module of
SPEC §9 exposes (``sequence_parallel``, ``parallel_mode``, ``set_parallel_mode``): under SP the
norm parameters, a row-parallel ``bias`` and ``LayerNormMLP``'s ``fc2_bias``.

torch's DTensor styles (``parallelize_module`` with ``SequenceParallel``) need none of this:
the norm gradients are ``Partial`` DTensors, and FSDP2 (or the reducer, without it) reduces
them over the tensor-parallel mesh before it reduces them over the data-parallel one.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.distributed as dist

from .modules import gradient_tensor, split_modules

__all__ = [
    "SequenceParallelParam",
    "sequence_parallel_parameters",
    "allreduce_sequence_parallel_grads",
    "check_tp_group",
    "is_dtensor",
    "local_part",
    "sum_coalesced",
]


@dataclasses.dataclass(frozen=True)
class SequenceParallelParam:
    """One parameter whose gradient is a partial sum per tensor-parallel rank."""

    name: str
    param: torch.nn.Parameter
    main_grad: bool  # its gradient is in ``main_grad`` (never for SPEC §9's biases and norms)


def _sp_names_of(module: torch.nn.Module) -> set[str]:
    """SPEC §9's sequence-parallel parameters of ``module``, from its public options."""
    if not getattr(module, "sequence_parallel", False) or getattr(module, "tp_size", 1) < 2:
        return set()
    names = {"layer_norm_weight", "layer_norm_bias"}
    if getattr(module, "parallel_mode", None) == "row":
        names.add("bias")
    if getattr(module, "set_parallel_mode", False):
        names.add("fc2_bias")
    return names


def sequence_parallel_parameters(model: torch.nn.Module) -> list[SequenceParallelParam]:
    """The trainable parameters of ``model`` whose gradient is a per-rank partial sum under
    sequence parallelism: those carrying ``sequence_parallel=True``, and those SPEC §9's rule
    names on a module whose options say so (the attribute is gone once ``fully_shard`` has
    replaced the parameter), in ``named_parameters()`` order."""
    by_rule: set[int] = set()
    main_grads: dict[int, bool] = {}
    for sm in split_modules(model):
        names = _sp_names_of(sm.module)
        for local, p in sm.module.named_parameters(recurse=False):
            main_grads[id(p)] = sm.uses_main_grad(local)
            if local in names:
                by_rule.add(id(p))
    found = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if getattr(p, "sequence_parallel", False) or id(p) in by_rule:
            found.append(SequenceParallelParam(name, p, main_grads.get(id(p), False)))
    return found


def check_tp_group(tp_group: object) -> int:
    """The size of ``tp_group``; ``ValueError`` naming it when it is not a process group of
    this rank."""
    if tp_group is None or not isinstance(tp_group, dist.ProcessGroup):
        raise ValueError(f"tp_group must be a torch.distributed ProcessGroup, got {tp_group!r}")
    if not dist.is_initialized():
        raise RuntimeError("tp_group given but torch.distributed is not initialized")
    if dist.get_rank(tp_group) < 0:
        raise ValueError(f"tp_group={tp_group!r} does not contain this rank ({dist.get_rank()})")
    return dist.get_world_size(tp_group)


def _check_drained(model: torch.nn.Module) -> None:
    pending = [
        f"{sm.name or type(sm.module).__name__} ({sm.module.pending_wgrad_count})"
        for sm in split_modules(model)
        if sm.module.pending_wgrad_count
    ]
    if pending:
        raise RuntimeError(
            "allreduce_sequence_parallel_grads: weight-gradient entries are still queued on "
            f"modules {', '.join(pending)}: the gradients are not final; run backward_dw() for "
            "each first (call this once per step, after the last backward_dw())"
        )


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (imports nothing: none
    exists unless that module was loaded)."""
    loaded = sys.modules.get("torch.distributed.tensor")
    return loaded is not None and isinstance(tensor, loaded.DTensor)


def local_part(grad: torch.Tensor) -> torch.Tensor:
    """The tensor a collective reads and writes for ``grad``: its local shard when it is a
    DTensor (``fully_shard``'s sharded gradients), else ``grad`` itself."""
    return grad.to_local() if is_dtensor(grad) else grad


def allreduce_sequence_parallel_grads(
    model: torch.nn.Module, tp_group: dist.ProcessGroup
) -> list[str]:
    """Sum over ``tp_group`` the gradients of every trainable parameter of ``model`` that
    carries ``sequence_parallel=True`` (:func:`sequence_parallel_parameters`): ``.grad``, or
    ``main_grad`` where the module accumulates into it; under ``fully_shard`` the local shard
    of the sharded gradient. One all-reduce per dtype and device (flattened, reduced, copied
    back), so afterwards those gradients are bitwise equal on every rank of the group. Call it
    once per step after the last ``backward_dw()``. Returns the names it summed.

    Raises ``RuntimeError`` naming the module when a delayed module inside ``model`` still has
    queued entries (the gradients are not final), and naming the parameter when one that
    requires a gradient has none; ``ValueError`` for a ``tp_group`` that is not a process
    group of this rank. Nothing is reduced when it raises."""
    size = check_tp_group(tp_group)
    _check_drained(model)
    params = sequence_parallel_parameters(model)
    grads = []
    for sp in params:
        g = gradient_tensor(sp.param, sp.main_grad)
        if g is None:
            raise RuntimeError(
                f"allreduce_sequence_parallel_grads: {sp.name} (sequence_parallel=True) has no "
                "gradient: no backward reached it, or it was cleared before the reduction"
            )
        grads.append(local_part(g))
    if size > 1:
        sum_coalesced(grads, tp_group)
    return [sp.name for sp in params]


def sum_coalesced(tensors: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """All-reduce (sum) ``tensors`` in place over ``group``: one collective per dtype and
    device, in the order of their first tensor, so every rank of the group issues the same
    collectives when it passes tensors of the same sizes and dtypes."""
    kinds: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for t in same:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n
