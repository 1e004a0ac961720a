"""FSDP2 (``torch.distributed.fsdp.fully_shard``) internals that
:class:`~splitgrad.distributed.GradientReducer` needs for delayed modules (SPEC §8), in one place.

FSDP2 reduce-scatters a parameter's gradient in its post-backward hook, which runs at the end of
the module group's backward. A delayed split-backward module writes its GEMM gradients later, in
``backward_dw()``, to the *unsharded* parameter its backward saw (``FSDPParam._unsharded_param``,
a ``Parameter`` FSDP2 reuses every step), after FSDP2 has resharded: left alone, every sharded
gradient stays ``None`` and the unsharded one is reduced a step late, if ever. fully_shard has no
public hook for either side, so this module reaches into its private objects (``FSDPState``,
``FSDPParamGroup``, ``FSDPParam``); their private attributes and the functions of FSDP2's
private modules are reached through :mod:`._torch_private`:

* :func:`describe` maps each sharded parameter of a model to its ``FSDPParam`` and group, and
  refuses what the reducer does not handle (HSDP/replicate meshes, CPU offload, a custom
  reduce-scatter); parameters that were DTensors before ``fully_shard`` (tensor parallel on
  another mesh dimension, torchtitan's 2-D layout) are served: see :mod:`.reducer_fsdp`;
* :func:`wrap_post_backward` runs a callback around a group's ``post_backward``, so delayed
  gradients are kept out of FSDP2's own reduce-scatter;
* :class:`ReduceScatter` reduce-scatters unsharded gradients into the sharded ``param.grad``
  DTensors the way ``foreach_reduce`` does (same copy-in layout, same reduce op and divide
  factors, same accumulation into an existing sharded gradient), but asynchronously;
* :func:`accumulate_between_passes` and :func:`take_final_grad` sum a step's micro-batches as
  FSDP2's post-backward sums its own under mixed precision (in ``reduce_dtype``);
* :func:`mark_reduced_from_module_hooks` marks a sharded parameter for the modules' guard, and
  again after FSDP2 resets it (``to_empty`` and every other ``_apply``).

Checked on torch 2.13 and 2.14 (torch 2.8's FSDP2 has no ``DefaultReduceScatter`` and is
refused). When one of these internals is missing, :func:`check_available` and the function
reading it raise :class:`~._torch_private.TorchMoved` naming the torch version, never a silent
fallback.
"""

from __future__ import annotations

import dataclasses
import datetime
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

from . import _torch_private

__all__ = [
    "check_available",
    "is_fully_sharded",
    "any_fully_sharded",
    "describe",
    "FsdpLayout",
    "ReduceScatter",
    "wrap_post_backward",
    "mark_reduced_from_module_hooks",
    "unsharded_grad",
    "take_unsharded_grad",
    "accumulate_between_passes",
    "take_final_grad",
]

CHECKED_ON = _torch_private.FSDP_CHECKED_ON
#: Set on a sharded parameter whose gradient GradientReducer reduces from the module hooks;
#: splitgrad's modules refuse to run delayed under fully_shard without it.
REDUCED_FROM_MODULE_HOOKS = "wgrad_reduce_from_module_hooks"


def _fsdp_module_type() -> type:
    """``FSDPModule``, once FSDP2's private functions this module calls are known to exist."""
    from torch.distributed.fsdp import FSDPModule

    _torch_private.check_fsdp_available()
    return FSDPModule


def check_available() -> None:
    """Raise :class:`TorchMoved` (a ``RuntimeError``) naming the torch version if FSDP2's
    internals moved."""
    _fsdp_module_type()


def is_fully_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its submodules was wrapped with ``fully_shard``."""
    return any_fully_sharded(model.modules())


def any_fully_sharded(modules) -> bool:
    """Whether one of ``modules`` was wrapped with ``fully_shard`` (nothing is imported: without
    ``torch.distributed.fsdp`` loaded, nothing can be)."""
    loaded = sys.modules.get("torch.distributed.fsdp")
    FSDPModule = getattr(loaded, "FSDPModule", None)
    return FSDPModule is not None and any(isinstance(m, FSDPModule) for m in modules)


@dataclasses.dataclass(eq=False)
class FsdpLayout:
    """Which FSDP2 parameter and group hold each sharded parameter of a model."""

    params: dict[int, object]  # id(sharded param) -> FSDPParam
    group_of: dict[int, object]  # id(sharded param) -> FSDPParamGroup
    groups: list  # every FSDPParamGroup, in module order
    states: list  # every FSDPModule, in module order
    process_group: dist.ProcessGroup
    state_of: dict = dataclasses.field(default_factory=dict)  # id(group) -> FSDPState

    def is_last_backward(self, group) -> bool:
        """FSDP2's ``set_is_last_backward`` flag for ``group``'s root."""
        return _torch_private.is_last_backward(self.state_of[id(group)])


def describe(model: torch.nn.Module) -> FsdpLayout:
    """The FSDP2 layout of ``model``; ``ValueError`` for what the reducer does not support."""
    FSDPModule = _fsdp_module_type()
    params, group_of, groups, states, state_of = {}, {}, [], [], {}
    process_group = None
    for name, m in model.named_modules():
        if not isinstance(m, FSDPModule):
            continue
        states.append(m)
        state, groups_of_state = _torch_private.fsdp_param_groups(m)
        for group in groups_of_state:
            where = name or type(m).__name__
            mesh = group.mesh_info
            if not _torch_private.is_1d_fsdp_mesh(mesh):
                raise ValueError(
                    f"GradientReducer supports a 1-D fully_shard mesh only; {where} has "
                    f"{type(mesh).__name__} (HSDP or replicate)"
                )
            comm = _torch_private.custom_reduce_scatter(group)
            if comm is not None:
                raise ValueError(
                    f"{where}: a custom reduce-scatter ({type(comm)}) is not supported by "
                    "GradientReducer"
                )
            pg = mesh.shard_process_group
            if process_group is not None and pg is not process_group:
                raise ValueError("fully_shard modules of this model use different process groups")
            process_group = pg
            groups.append(group)
            state_of[id(group)] = state
            for fp in group.fsdp_params:
                if getattr(fp, "offload_to_cpu", False):
                    raise ValueError(f"{where}: CPU offload is not supported by GradientReducer")
                params[id(fp.sharded_param)] = fp
                group_of[id(fp.sharded_param)] = group
                unsharded = _torch_private.unsharded_param(fp)
                if unsharded is not None:  # built between a forward and its reshard
                    params[id(unsharded)] = fp
                    group_of[id(unsharded)] = group
    if process_group is None:
        raise ValueError("the model is fully_shard-ed but no fully_shard module has parameters")
    return FsdpLayout(params, group_of, groups, states, process_group, state_of)


def mark_reduced_from_module_hooks(fsdp_param) -> None:
    """Set :data:`REDUCED_FROM_MODULE_HOOKS` on ``fsdp_param``'s sharded parameter, and again
    whenever FSDP2 resets it (``FSDPParam.reset_sharded_param``, which FSDP2 calls after every
    ``_apply``: ``to_empty``, ``.to()``, ``.cpu()``, and after ``load_state_dict``). Those swap
    the parameter's contents with ``torch.utils.swap_tensors``, which swaps its ``__dict__`` too:
    a reducer built on the meta device (build, convert, shard, reducer, then ``to_empty``) would
    lose the mark and the modules would refuse to run."""
    sharded = fsdp_param.sharded_param
    setattr(sharded, REDUCED_FROM_MODULE_HOOKS, True)
    if getattr(fsdp_param, "_splitgrad_marks_after_reset", False):
        return
    original = fsdp_param.reset_sharded_param

    def reset_sharded_param(*args, **kwargs):
        out = original(*args, **kwargs)
        setattr(fsdp_param.sharded_param, REDUCED_FROM_MODULE_HOOKS, True)
        return out

    fsdp_param.reset_sharded_param = reset_sharded_param
    fsdp_param._splitgrad_marks_after_reset = True


def unsharded_grad(fsdp_param) -> torch.Tensor | None:
    """The gradient written to the unsharded parameter (``None`` before the first unshard)."""
    unsharded = _torch_private.unsharded_param(fsdp_param)
    return None if unsharded is None else unsharded.grad


def put_back_unsharded_grad(fsdp_param, grad: torch.Tensor) -> None:
    """Give the unsharded parameter back the gradient :func:`take_unsharded_grad` took."""
    _torch_private.unsharded_param(fsdp_param).grad = grad


def take_unsharded_grad(fsdp_param) -> torch.Tensor | None:
    """:func:`unsharded_grad`, taken off the unsharded parameter (FSDP2 then never sees it)."""
    g = unsharded_grad(fsdp_param)
    if g is not None:
        _torch_private.unsharded_param(fsdp_param).grad = None
    return g


def _reduce_dtype(fsdp_param) -> torch.dtype | None:
    if not hasattr(fsdp_param, "reduce_dtype"):
        raise _torch_private.fsdp_moved("FSDPParam.reduce_dtype")
    return fsdp_param.reduce_dtype


def accumulate_between_passes(fsdp_param, accumulated: torch.Tensor | None) -> torch.Tensor | None:
    """FSDP2's post-backward of a pass without gradient sync (``accumulate_unsharded_grad_if_
    needed``, then ``to_accumulated_grad_if_needed``), for a delayed gradient FSDP2 never sees,
    once every entry of that pass has run: with a ``reduce_dtype`` other than the gradient's
    (bf16 parameters, fp32 ``reduce_dtype``), the passes' gradients are summed in
    ``reduce_dtype``, each computed in the parameter dtype, not accumulated on ``.grad`` in it.
    ``accumulated``: the earlier passes' sum, or ``None``; returns the new one (``None``: the
    gradient stays on the unsharded parameter, where the next pass adds to it, as FSDP2
    leaves it without a ``reduce_dtype``)."""
    grad = unsharded_grad(fsdp_param)
    if grad is None:
        return accumulated
    if accumulated is not None:
        accumulated += grad
        _torch_private.unsharded_param(fsdp_param).grad = None
        return accumulated
    reduce_dtype = _reduce_dtype(fsdp_param)
    if reduce_dtype is None or grad.dtype == reduce_dtype:
        return None
    _torch_private.unsharded_param(fsdp_param).grad = None
    return grad.to(reduce_dtype)


def take_final_grad(fsdp_param, accumulated: torch.Tensor | None) -> torch.Tensor | None:
    """The gradient FSDP2's post-backward reduces in the step's last pass: the earlier passes'
    sum in ``reduce_dtype`` plus this pass's gradient (taken off the unsharded parameter), or
    the gradient alone."""
    grad = take_unsharded_grad(fsdp_param)
    if accumulated is None:
        return grad
    if grad is not None:
        accumulated += grad
    return accumulated


def unreduced_grad(fsdp_param) -> bool:
    """Whether a gradient waits on the unsharded side for FSDP2 to reduce it."""
    return (
        unsharded_grad(fsdp_param) is not None
        or getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None
    )


def unshard_during_backward_dw(module: torch.nn.Module, params: list[tuple[str, object]]) -> None:
    """Make ``module.backward_dw()`` run with the unsharded ``Parameter`` objects registered.

    After FSDP2's post-backward reshard the module holds the sharded DTensors; a queued entry
    that looks its parameters up when it runs (splitgrad's reference does; impl keeps the
    ones its backward saw) must write the unsharded gradient FSDP2's layout expects. Only the
    objects are swapped, no data is gathered: a wgrad entry computes ``dy^T x`` from what it
    saved and needs no weight values (SPEC §4)."""
    original = module.backward_dw

    def backward_dw(*args, **kwargs):
        swapped = []
        for name, fp in params:
            unsharded = _torch_private.unsharded_param(fp)
            current = module._parameters.get(name)
            if unsharded is not None and current is not unsharded:
                swapped.append((name, current))
                module._parameters[name] = unsharded
        try:
            return original(*args, **kwargs)
        finally:
            for name, current in swapped:
                module._parameters[name] = current

    backward_dw.__doc__ = original.__doc__
    module.backward_dw = backward_dw


def wrap_post_backward(group, around: Callable[[Callable[[], None]], None]) -> None:
    """Make ``group.post_backward(*args)`` call ``around(run)``, ``run()`` being FSDP2's own.
    FSDP2 calls it from autograd, from its root's end-of-backward callback, and a
    ``PipelineStage`` calls it at its REDUCE_GRAD step: all go through the instance attribute."""
    original = group.post_backward

    def post_backward(*args):
        around(lambda: original(*args))

    group.post_backward = post_backward


class ReduceScatter:
    """One asynchronous reduce-scatter of unsharded gradients into their sharded ``.grad``.

    The copy-in (``foreach_reduce_scatter_copy_in``, with FSDP2's dim-0 padding and Shard(i>0)
    rearrangement), reduce op, pre-/post-divide factors, cast back to the parameter dtype and
    accumulation (``+=`` into an existing sharded gradient, else a new DTensor) are FSDP2's,
    so a gradient comes out bitwise as FSDP2 would have reduced it."""

    def __init__(self, fsdp_params: list, grads: list[torch.Tensor], group) -> None:
        self.fsdp_params = fsdp_params
        pg = group.mesh_info.shard_process_group
        world = pg.size()
        grad_dtypes = {g.dtype for g in grads}
        if len(grad_dtypes) != 1:
            raise RuntimeError(f"one reduce-scatter needs one gradient dtype, got {grad_dtypes}")
        reduce_dtype, self.orig_dtype = _torch_private.group_dtypes(group)
        reduce_dtype = reduce_dtype or grads[0].dtype
        pre, self.post, op, _ = _torch_private.gradient_divide_factors(
            pg,
            reduce_dtype,
            grads[0].device.type,
            group.gradient_divide_factor,
            group.force_sum_reduction_for_comms,
        )
        grads = list(grads)
        for i, (fp, g) in enumerate(zip(fsdp_params, grads)):
            dim = fp.fsdp_placement.dim
            if dim != 0 and world > 1:
                grads[i] = torch.cat(torch.chunk(g, world, dim=dim), dim=0)
        self.padded = [_torch_private.dim0_padded_size(g.size(), world) for g in grads]
        numel = sum(s.numel() for s in self.padded)
        flat_in = torch.empty(numel, dtype=reduce_dtype, device=grads[0].device)
        _torch_private.reduce_scatter_copy_in(grads, flat_in, world)
        if pre is not None and pre != 1:
            flat_in.div_(pre)
        self.world = world
        self.output = torch.empty(numel // world, dtype=reduce_dtype, device=flat_in.device)
        self._input = flat_in  # alive until the collective has completed
        if world > 1:
            # FSDP2's own call (reduce_scatter_tensor before it was renamed)
            reduce_scatter = getattr(dist, "reduce_scatter_single", None)
            if reduce_scatter is None:
                reduce_scatter = dist.reduce_scatter_tensor
            self.work = reduce_scatter(self.output, flat_in, op=op, group=pg, async_op=True)
        else:
            factor = group.gradient_divide_factor
            self.output.copy_(flat_in / factor if factor is not None else flat_in)
            self.work = None

    def complete(self, timeout: datetime.timedelta) -> None:
        """Wait, then write (or add) each parameter's shard into ``sharded_param.grad``."""
        if self.work is not None:
            self.work.wait(timeout)
        self._input = None
        out = self.output
        if self.post is not None and self.post != 1:
            out.div_(self.post)
        if self.orig_dtype is not None and out.dtype != self.orig_dtype:
            out = out.to(self.orig_dtype)
        offset = 0
        for padded, fp in zip(self.padded, self.fsdp_params):
            shard = torch.as_strided(
                out,
                size=fp.sharded_size,
                stride=fp.contiguous_sharded_stride,
                storage_offset=offset,
            )
            sharded = fp.sharded_param
            if sharded.grad is not None:
                _torch_private.add_to_local_shard(sharded.grad, shard)
            else:
                sharded.grad = fp.to_sharded_dtensor(shard)
            for hook in _torch_private.post_accumulate_grad_hooks(sharded):
                hook(sharded)
            offset += padded.numel() // self.world
        self.output = None
