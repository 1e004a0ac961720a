"""Where each parameter's gradient goes (SPEC §3), decided by a Function's own autograd edges,
and what changes when the backward itself is differentiated (SPEC §2). Contract, shared with
``splitgrad.impl``: routing is API, not math.

* The gradient belongs to the tensor the forward was given, never to whatever the module's
  attribute holds when backward runs: :func:`param_targets` reads each parameter input's edge.
  A leaf that the running backward accumulates (:data:`ACCUMULATE`: the module's ``Parameter``
  or a leaf substituted by ``torch.func.functional_call``) is written by the module itself, now
  or at ``backward_dw()``. A leaf that ``torch.autograd.grad`` captures, and a weight that is
  not a leaf (``torch.nn.utils.parametrize``, a weight computed from another tensor), get their
  gradient returned through autograd during backward (:data:`RETURN`): nothing is queued for
  them, with or without delay. Only leaves can be deferred.
* A backward that runs with grad mode on (``create_graph=True``), or under a ``torch.func``
  transform, is differentiated itself or transformed (:func:`differentiated`,
  :func:`route_differentiable`): every plain gradient is
  returned through autograd, which accumulates it with its graph and the leaf's hooks. A
  gradient the module would defer or accumulate into ``main_grad`` would lose its graph there,
  so delay and fused accumulation raise, naming the module and the parameters; so do FP8
  GEMMs, which have no second derivative.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ._torch_private import functorch_active
from .contract import ACCUMULATE, RETURN, node_destination, qualified_name

__all__ = [
    "differentiated",
    "Target",
    "remember_params",
    "param_targets",
    "route_differentiable",
    "qualified_name",
]


def differentiated() -> bool:
    """Whether the running backward is differentiated itself or transformed: grad mode on
    (``create_graph=True``, ``torch.func.grad``) or any ``torch.func`` transform active
    (``vmap``: a gradient written there would be batched)."""
    return torch.is_grad_enabled() or functorch_active()


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the running backward sends one parameter input's gradient.

    ``dest`` is :data:`ACCUMULATE` (the module writes ``leaf``), :data:`RETURN` (returned through
    autograd) or ``None`` (not computed); ``where`` names it for messages (``"Linear.weight"``).
    """

    where: str
    dest: str | None
    leaf: torch.Tensor | None = None

    @property
    def written(self) -> bool:
        """The module writes this gradient itself (now, or at ``backward_dw()``)."""
        return self.dest == ACCUMULATE

    @property
    def returned(self) -> bool:
        """The gradient is returned through autograd (captured, or a non-leaf)."""
        return self.dest == RETURN

    @property
    def needed(self) -> bool:
        return self.dest is not None

    @property
    def name(self) -> str:
        """The module's parameter name (``"weight"``)."""
        return self.where.rsplit(".", 1)[-1]

    @property
    def gemm(self) -> bool:
        """A GEMM parameter (the module writes those; norm parameters go through autograd)."""
        return not self.name.startswith("layer_norm")


def remember_params(ctx, names: Sequence[str], tensors: Sequence[torch.Tensor | None]) -> None:
    """In ``setup_context``: the names of the Function's parameter inputs (those after ``x``)
    and which of them were tensors (``None``, e.g. no bias, has no autograd edge)."""
    ctx.param_names = tuple(names)
    ctx.param_present = tuple(t is not None for t in tensors)


def param_targets(ctx, module: torch.nn.Module) -> list[Target]:
    """The :class:`Target` of each parameter input, from the Function's own autograd edges
    (``ctx.next_functions``: one per tensor input, ``x`` first). Call it inside backward."""
    edges = iter(ctx.next_functions[1:])
    kind = type(module).__name__
    out = []
    for name, present in zip(ctx.param_names, ctx.param_present):
        node = next(edges)[0] if present else None
        dest = node_destination(node)
        leaf = node.variable if dest == ACCUMULATE else None
        out.append(Target(f"{kind}.{name}", dest, leaf))
    return out


def route_differentiable(
    module: torch.nn.Module, targets: Sequence[Target], fp8: bool
) -> list[Target]:
    """``targets`` of a :func:`differentiated` backward (see the module docstring):
    raises ``RuntimeError`` naming the module for what cannot be differentiated, and returns
    the plain gradients the module would write as :data:`RETURN` (autograd accumulates them).
    Norm parameters (``layer_norm_*``) are returned through autograd anyway."""
    kind = qualified_name(module)
    if fp8:
        raise RuntimeError(
            f"{kind} under FP8 cannot be differentiated twice (backward with create_graph=True, "
            "or a torch.func transform): its quantized GEMMs have no derivative"
        )
    written = [t for t in targets if t.written and t.gemm]
    names = ", ".join(t.where for t in written)
    transform = functorch_active()
    if written and module.delay_wgrad_compute:
        how = (
            "under a torch.func transform" if transform else "in a backward with create_graph=True"
        )
        raise RuntimeError(
            f"{kind} with delay_wgrad_compute=True cannot defer the gradients of {names} {how}: "
            "a deferred gradient has no graph. Build the module without delay, or take these "
            "gradients with torch.autograd.grad(..., inputs=[...]) (returned, never deferred)"
        )
    weights = [t.where for t in written if t.name in module.gemm_weight_names()]
    if weights and module.fuse_wgrad_accumulation:
        how = (
            "under a torch.func transform" if transform else "in a backward with create_graph=True"
        )
        raise RuntimeError(
            f"{kind} with fuse_wgrad_accumulation=True cannot accumulate the gradients of "
            f"{', '.join(weights)} into main_grad {how}: main_grad is outside autograd, so the "
            "gradient would lose its graph. Build the module with fuse_wgrad_accumulation=False, "
            "or take these gradients with torch.autograd.grad / torch.func.grad (returned)"
        )
    return [_returned(t) for t in targets]


def _returned(t: Target) -> Target:
    return Target(t.where, RETURN) if t.written else t
