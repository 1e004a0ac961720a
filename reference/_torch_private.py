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
    "has_hooks",
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


def _missing(what: str):
    def raise_moved(*_args, **_kwargs):
        raise _moved(what)

    return raise_moved


#: Whether the running backward executes an autograd node; raises ``RuntimeError`` (from the
#: engine) when asked about a leaf that ``torch.autograd.grad`` captures instead.
will_engine_execute_node = getattr(torch._C, "_will_engine_execute_node", None) or _missing(
    "torch._C._will_engine_execute_node"
)

#: Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``) is running.
functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None) or _missing(
    "torch._C._are_functorch_transforms_active"
)

_HOOK_DICTS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_probe = torch.zeros(())
if not all(hasattr(_probe, name) for name in _HOOK_DICTS):
    _hooks_moved = _moved("Tensor._backward_hooks / Tensor._post_accumulate_grad_hooks")
else:
    _hooks_moved = None
del _probe


def tensor_hook_dict(tensor: torch.Tensor) -> dict | None:
    """The dictionary ``tensor.register_hook`` adds to (``None`` before the first one). Autograd
    holds this very object and reads it each time it calls the hooks."""
    if _hooks_moved is not None:
        raise _hooks_moved
    return tensor._backward_hooks


def post_accumulate_hook_dict(tensor: torch.Tensor) -> dict | None:
    """The dictionary ``tensor.register_post_accumulate_grad_hook`` adds to (or ``None``)."""
    if _hooks_moved is not None:
        raise _hooks_moved
    return tensor._post_accumulate_grad_hooks


if _hooks_moved is None:

    def has_hooks(tensor: torch.Tensor) -> object:
        """Truthy when ``tensor`` has tensor or post-accumulate hooks (cheap: a module asks it
        for every gradient it writes)."""
        return tensor._backward_hooks or tensor._post_accumulate_grad_hooks

else:
    has_hooks = _missing("Tensor._backward_hooks / Tensor._post_accumulate_grad_hooks")
