"""Tensor and sequence parallelism of splitgrad.impl (SPEC §9): impl's own collectives, the
forward every TP module shares, and what a queued entry does under TP.

The options, their validation and the per-rank shapes are the shared contract
(:mod:`splitgrad.reference.parallel`); a module communicates iff ``module._tp`` is a
:class:`~splitgrad.reference.parallel.TensorParallel` (``group``, ``size``, ``rank``,
``sequence_parallel``, ``wgrad_gather``). With ``_tp is None`` the modules never reach this file:
their forward pays one attribute check.

Every collective acts on the 2-D row matrix (inputs are flattened to rows with dim 0, the
sequence, outermost), along dim 0, in rank order: :func:`gather_rows`,
:func:`reduce_scatter_rows`, :func:`all_reduce_`. The forward's collectives (a column layer's
input gather under SP, a row layer's output reduction) block; the backward's overlap the GEMMs
as TransformerEngine's do (each module's Function says where). Every collective of a backward
is waited for before it returns, so a queued entry never holds a collective in flight.

Where a delayed entry gets its full-sequence wgrad operand under SP (the input of a column GEMM,
``dy`` of a row GEMM):

* ``wgrad_gather="backward"`` (TransformerEngine's): gathered in ``backward()``; the entry holds
  the gathered tensor (under FP8: its quantized column-wise copy) and ``backward_dw()`` issues
  no collective.
* ``wgrad_gather="backward_dw"``: the entry holds the rank's shard and its closure all-gathers
  it (blocking); under FP8 the shard is kept in high precision with the scale it was quantized
  with (per-tensor recipes), and the gathered tensor is quantized again inside the closure,
  which gives the very bytes the forward (or backward) quantized (:class:`GatherLater`).

Without delay the same closure runs inside ``backward()``, so delayed and non-delayed execute
the same instructions in both modes and their gradients are bitwise identical.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from splitgrad.reference.contract import qualified_name
from splitgrad.reference.parallel import (
    TensorParallel,
    check_gather_order,
    check_sequence_split,
)
from splitgrad.reference.routing import differentiated

from .base import autocast_off, functorch_active
from .fp8 import Float8Tensor, quantize
from .fp8_gemm import _kind, fp8_wgrad_write, wants_transposed_storage

__all__ = [
    "gather_rows",
    "gather_shard",
    "reduce_scatter_rows",
    "all_reduce_",
    "wait",
    "reduce_partial_rows",
    "tp_forward",
    "refuse_differentiated",
    "GatherLater",
    "TPWgradPart",
    "scale_for_requantize",
    "submit_tp_fp8_wgrad",
    "fp8_value_of",
]


# ---- the collectives ------------------------------------------------------------------------


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: object, async_op: bool):
    # torch 2.13 renamed all_gather_into_tensor (now a deprecated alias) to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: object, async_op: bool):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


def gather_rows(
    x: torch.Tensor, tp: TensorParallel, async_op: bool = False
) -> tuple[torch.Tensor, object]:
    """``(the rows of every rank's x, stacked in rank order; the work handle or None)``. With
    ``async_op`` the result is valid only after :func:`wait` on the handle."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
    work = _all_gather(out, x, tp.group, async_op)
    return out, (work if async_op else None)


def reduce_scatter_rows(
    x: torch.Tensor, tp: TensorParallel, async_op: bool = False
) -> tuple[torch.Tensor, object]:
    """``(this rank's block of rows of the sum over ranks of x; the work handle or None)``;
    x's row count must be a multiple of ``tp.size`` (checked by the forward, SPEC §9)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    work = _reduce_scatter(out, x, tp.group, async_op)
    return out, (work if async_op else None)


def _blocking_all_gather(out: torch.Tensor, inp: torch.Tensor, group: object) -> None:
    _all_gather(out, inp, group, False)


def gather_shard(module: torch.nn.Module, shard: torch.Tensor) -> torch.Tensor:
    """The full-sequence wgrad operand from the rank's ``shard``, gathered inside a closure
    (``wgrad_gather="backward_dw"``), after checking with the contract's 16-byte tag gather
    (:func:`~splitgrad.reference.parallel.check_gather_order`) that every rank of the group
    gathers for the same module and entry: ``RuntimeError`` on every rank otherwise, before
    anything is written (the entry stays queued)."""
    check_gather_order(module, shard.device, _blocking_all_gather)
    return gather_rows(shard, module._tp)[0]


def all_reduce_(x: torch.Tensor, tp: TensorParallel, async_op: bool = False) -> object:
    """Sum ``x`` (contiguous, owned by the caller) over the group in place; the work handle when
    ``async_op``, else None."""
    work = dist.all_reduce(x, group=tp.group, async_op=async_op)
    return work if async_op else None


def wait(work: object) -> None:
    """Wait for an asynchronous collective (None: nothing in flight)."""
    if work is not None:
        work.wait()


def reduce_partial_rows(
    partial: torch.Tensor | None, tp: TensorParallel
) -> tuple[torch.Tensor | None, object]:
    """Start reducing a per-rank partial sum of full-sequence rows (a column layer's dgrad):
    reduce-scattered along rows under SP, all-reduced in place otherwise. ``(result, work)``:
    the result is valid after :func:`wait` on ``work``."""
    if partial is None:
        return None, None
    if tp.sequence_parallel:
        return reduce_scatter_rows(partial, tp, async_op=True)
    partial = partial.contiguous()
    return partial, all_reduce_(partial, tp, async_op=True)


# ---- the forward -----------------------------------------------------------------------------


def _refusal(module: torch.nn.Module, what: str) -> RuntimeError:
    return RuntimeError(
        f"{qualified_name(module)} with tensor parallelism (tp_size={module.tp_size}) cannot "
        f"{what}: tensor parallel modules do not support torch.func transforms (grad, vjp, "
        "jacrev, vmap) or double backward (create_graph=True) yet, their collectives run "
        "outside autograd"
    )


def refuse_differentiated(module: torch.nn.Module) -> None:
    """Called first in a TP Function's backward: ``RuntimeError`` naming the module when the
    backward is differentiated itself (``create_graph=True``) or transformed."""
    if differentiated():
        raise _refusal(module, "be differentiated twice (create_graph=True)")


def tp_forward(module, inp, x, recipe, is_first_microbatch, params, functions) -> torch.Tensor:
    """The forward of a module that communicates (``module._tp`` set), after ``_check_input``
    gave ``x`` (``inp`` as rows) and ``recipe``: the checks of SPEC §9 before any collective,
    then the module's TP Function (``functions``: its ``(apply, fp8_apply)``, the second under
    an FP8 recipe) on ``(x, *params, module, overwrite, [recipe,] autocast)``, and the output
    shaped like ``inp``, its dim 0 gathered (column + SP) or scattered (row + SP). Under
    ``torch.compile`` the Functions run eagerly (a graph break, :func:`.compiled.eager_apply`):
    their collectives and entries are Python-side effects a traced graph cannot hold."""
    tp = module._tp
    if functorch_active():
        raise _refusal(module, "run under a torch.func transform")
    row = module.parallel_mode == "row"
    # A column GEMM (LayerNormMLP's fc1 included) gathers its input under SP; a row Linear
    # scatters its output, whose dim 0 must split evenly.
    if tp.sequence_parallel:
        check_sequence_split(module, inp, scatters=row)
    overwrite = bool(is_first_microbatch) and module.fuse_wgrad_accumulation
    module._check_weights_used(recipe, type(module)._parameter_names, params)
    autocast = module.autocast_dtype()
    apply, fp8_apply = functions
    with autocast_off(x.device.type):
        if recipe is None:
            y = apply(x, *params, module, overwrite, autocast)
        else:
            gathers = tp.sequence_parallel and not row
            module._check_fp8_shapes(recipe, x.shape[0] * (tp.size if gathers else 1))
            y = fp8_apply(x, *params, module, overwrite, recipe, autocast)
    if x is inp or inp.dim() == 2:
        return y
    lead = inp.shape[:-1]
    if tp.sequence_parallel and module.parallel_mode is not None:
        lead = (lead[0] // tp.size if row else lead[0] * tp.size, *lead[1:])
    return y.reshape(*lead, y.shape[-1])


# ---- FP8 entries -------------------------------------------------------------------------------


@dataclasses.dataclass
class GatherLater:
    """An FP8 wgrad operand the entry keeps as this rank's high-precision ``shard`` (rows) and
    all-gathers inside its closure (``wgrad_gather="backward_dw"``), then quantizes as the
    column-wise copy of tensor ``role``: with ``scale``, the DelayedScaling scale the full
    tensor was quantized with (None for the other recipes, whose scales the gathered data
    decides again), so the closure's bytes are the ones the forward or backward made."""

    shard: torch.Tensor
    role: str
    scale: torch.Tensor | None


class _FixedScale:
    """A delayed-scaling state that quantizes with a scale already used and records nothing
    (the amax was recorded when the tensor was first quantized)."""

    def __init__(self, scale: torch.Tensor) -> None:
        self.scale = scale

    def record(self, amax: torch.Tensor) -> None:
        pass


def scale_for_requantize(states: dict, role: str) -> torch.Tensor | None:
    """A copy of the scale DelayedScaling quantizes ``role`` with now (``states``: the GEMM's
    delayed-scaling states, empty under the other recipes: None), for a :class:`GatherLater`.
    Call it before the state's update moves the scale."""
    state = states.get(role)
    return None if state is None else state.scale.clone()


def _column_copy(module, recipe, role: str, t: torch.Tensor, scale) -> Float8Tensor:
    """The column-wise FP8 copy :class:`~.fp8_gemm.FP8GemmOperands` keeps of ``t`` for wgrad."""
    if scale is not None:
        q = quantize(t, recipe, role, 0, state=_FixedScale(scale))
    else:
        q = quantize(t, recipe, role, 0)
    return q.with_layout(wants_transposed_storage(module.fp8_gemm, t.device, _kind(q)))


@dataclasses.dataclass
class TPWgradPart:
    """One FP8 GEMM's share of a TP wgrad entry: ``weight`` gets ``q(dy)^T q(x)`` (None: frozen),
    ``bias`` gets ``db`` (reduced in backward). ``dy`` / ``x``: a quantized column-wise copy, or
    a :class:`GatherLater` shard."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    dy: Float8Tensor | GatherLater | None
    x: Float8Tensor | GatherLater | None
    db: torch.Tensor | None


def submit_tp_fp8_wgrad(
    module,
    recipe,
    parts: Sequence[TPWgradPart],
    named_weights: Sequence[tuple[str, torch.Tensor]],
    overwrite: bool,
    written: tuple,
) -> None:
    """Queue (or run) one entry writing every part's weight and bias gradient, in order
    (:meth:`~.base.SplitBackwardModule._submit_fp8_wgrad` under TP).

    ``entry.saved`` holds, per part, two slots for dy then two for x — a quantized operand's
    ``(data, scale_inv)``, a :class:`GatherLater`'s ``(shard, scale or None)``, ``(None,
    None)`` for a frozen weight — then each part's bias gradient (or None)."""
    tensors: list = []
    layouts: list = []
    for part in parts:
        for op in (part.dy, part.x) if part.weight is not None else (None, None):
            if op is None:
                tensors += [None, None]
                layouts.append(None)
            elif isinstance(op, GatherLater):
                tensors += [op.shard, op.scale]
                layouts.append(("gather", op.role))
            else:
                tensors += [op.data, op.scale_inv]
                layouts.append(("q", op.fmt, op.block, op.transposed))
    dbs = [part.db if part.bias is not None else None for part in parts]
    targets = [(part.weight, part.bias) for part in parts]
    n = len(tensors)

    def wgrad_closure(*saved):
        module._check_main_grads(named_weights)
        ops = []
        for i, layout in enumerate(layouts):
            a, b = saved[2 * i], saved[2 * i + 1]
            if layout is None:
                ops.append(None)
            elif layout[0] == "gather":
                full = gather_shard(module, a)
                ops.append(_column_copy(module, recipe, layout[1], full, b))
                del full
            else:
                ops.append(Float8Tensor(a, b, *layout[1:]))
        for i, (weight, bias) in enumerate(targets):
            if weight is not None:
                fp8_wgrad_write(module, weight, ops[2 * i], ops[2 * i + 1], overwrite)
            if bias is not None:
                module._write_bias_value(bias, saved[n + i])

    module._submit_wgrad(wgrad_closure, (*tensors, *dbs), written)


def fp8_value_of(module, recipe, op: Float8Tensor | GatherLater) -> Float8Tensor:
    """``op`` as a quantized operand now (gathering a :class:`GatherLater`): for
    ``torch.autograd.grad`` asking for a weight's gradient, returned in backward."""
    if isinstance(op, GatherLater):
        full, _ = gather_rows(op.shard, module._tp)
        return _column_copy(module, recipe, op.role, full, op.scale)
    return op
