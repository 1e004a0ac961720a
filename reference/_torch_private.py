"""The private parts of torch that the reference's gradient routing reads, in one place.

* ``torch._C._will_engine_execute_node``: whether the running backward executes an autograd node
  (SPEC §3, "only what the backward asks for").
* ``Tensor._backward_hooks`` / ``Tensor._post_accumulate_grad_hooks``: the dictionaries behind
  ``register_hook`` and ``register_post_accumulate_grad_hook``. A module that writes a leaf's
  gradient itself runs that leaf's hooks as autograd would (:mod:`.accumulate`).
* ``torch._C._are_functorch_transforms_active``: whether a ``torch.func`` transform is running.

Checked on torch 2.8, 2.11, 2.13 and 2.14. When one of them is missing, the call raises
``RuntimeError`` naming the torch version; nothing falls back quietly.
"""

from __future__ import annotations

import torch

__all__ = [
    "CHECKED_ON",
    "TorchMoved",
    "will_engine_execute_node",
    "tensor_hook_dict",
    "post_accumulate_hook_dict",
    "functorch_active",
]

CHECKED_ON = "2.8, 2.11, 2.13, 2.14"


class TorchMoved(RuntimeError):
    """A private torch API splitgrad relies on is missing from this torch version."""


def _moved(what: str) -> TorchMoved:
    return TorchMoved(
        f"torch {torch.__version__} has no {what} (splitgrad was checked on torch {CHECKED_ON}); "
        "splitgrad's modules cannot route gradients as autograd does on this version"
    )


_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)
_FUNCTORCH_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)


def will_engine_execute_node(node: torch.autograd.graph.Node) -> bool:
    """Whether the running backward executes ``node``; raises ``RuntimeError`` (from the engine)
    when asked about a leaf that ``torch.autograd.grad`` captures instead."""
    if _WILL_EXECUTE is None:
        raise _moved("torch._C._will_engine_execute_node")
    return _WILL_EXECUTE(node)


def _hook_dict(tensor: torch.Tensor, attribute: str) -> dict | None:
    try:
        return getattr(tensor, attribute)
    except AttributeError:
        raise _moved(f"Tensor.{attribute}") from None


def tensor_hook_dict(tensor: torch.Tensor) -> dict | None:
    """The dictionary ``tensor.register_hook`` adds to (``None`` before the first one). Autograd
    holds this very object and reads it each time it calls the hooks."""
    return _hook_dict(tensor, "_backward_hooks")


def post_accumulate_hook_dict(tensor: torch.Tensor) -> dict | None:
    """The dictionary ``tensor.register_post_accumulate_grad_hook`` adds to (or ``None``)."""
    return _hook_dict(tensor, "_post_accumulate_grad_hooks")


def functorch_active() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``) is running."""
    if _FUNCTORCH_ACTIVE is None:
        raise _moved("torch._C._are_functorch_transforms_active")
    return _FUNCTORCH_ACTIVE()
