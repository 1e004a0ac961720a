"""Every private part of torch the reference (and the contract impl shares with it) reads, in one
place. Each function names what it reads; when that is missing, calling it raises
:class:`TorchMoved` naming the running torch version and the versions this module was checked
on. Nothing falls back quietly.

Checked on torch 2.8, 2.11, 2.13 and 2.14 (:data:`CHECKED_ON`; FSDP2's state on 2.8, 2.13 and
2.14, whose layouts differ as noted at :func:`fsdp_managed_parameters`).

Autograd (SPEC §3, "only what the backward asks for"; hooks as autograd runs them):

* :func:`will_engine_execute_node`: ``torch._C._will_engine_execute_node``;
* :func:`functorch_active`: ``torch._C._are_functorch_transforms_active``;
* :func:`tensor_hook_dict`, :func:`post_accumulate_hook_dict`, :func:`has_hooks`:
  ``Tensor._backward_hooks`` and ``Tensor._post_accumulate_grad_hooks``, the dictionaries behind
  ``register_hook`` and ``register_post_accumulate_grad_hook``.

Module hooks (:mod:`.convert`):

* :func:`module_hooks_registered`: ``Module._forward_hooks``, ``_forward_pre_hooks``,
  ``_backward_hooks``, ``_backward_pre_hooks``.

Data-parallel wrappers that cannot reduce what a delayed or fused module writes (SPEC §8):

* :func:`active_ddp_module`, :func:`ddp_parameters`:
  ``DistributedDataParallel._active_ddp_module`` and ``DistributedDataParallel._module_parameters``;
* :func:`fsdp_managed_parameters`: FSDP2's ``torch.distributed._composable_state.
  _module_state_mapping``, each ``FSDPState``'s parameter groups and their
  ``FSDPParam._module_info``. Imports nothing: where ``torch.distributed.fsdp`` was never imported
  no module can be sharded.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable

import torch

__all__ = [
    "CHECKED_ON",
    "TorchMoved",
    "will_engine_execute_node",
    "functorch_active",
    "tensor_hook_dict",
    "post_accumulate_hook_dict",
    "has_hooks",
    "module_hooks_registered",
    "active_ddp_module",
    "ddp_parameters",
    "fsdp_managed_parameters",
    "fsdp_in_use",
]

CHECKED_ON = "2.8, 2.11, 2.13, 2.14"


class TorchMoved(RuntimeError):
    """A private torch API splitgrad relies on is missing from this torch version."""


def _moved(what: str, consequence: str) -> TorchMoved:
    return TorchMoved(
        f"torch {torch.__version__} has no {what} (splitgrad was checked on torch {CHECKED_ON}); "
        f"{consequence}"
    )


_ROUTING = "splitgrad's modules cannot route gradients as autograd does on this version"


def _raiser(what: str, consequence: str) -> Callable:
    """A function that raises :class:`TorchMoved` for ``what`` whenever it is called."""

    def raise_moved(*_args, **_kwargs):
        raise _moved(what, consequence)

    return raise_moved


def _bound(owner: object, name: str, what: str, consequence: str) -> Callable:
    """``owner.name``, looked up once (the callers are on every backward's path), or
    :func:`_raiser` of ``what`` where it is missing."""
    found = getattr(owner, name, None)
    return found if found is not None else _raiser(what, consequence)


# ---- autograd -------------------------------------------------------------------------------

#: Whether the running backward executes an autograd node; raises ``RuntimeError`` (from the
#: engine) when asked about a leaf that ``torch.autograd.grad`` captures instead.
will_engine_execute_node = _bound(
    torch._C, "_will_engine_execute_node", "torch._C._will_engine_execute_node", _ROUTING
)

#: Whether a ``torch.func`` transform (``grad``, ``vjp``, ``jacrev``, ``vmap``) is running.
functorch_active = _bound(
    torch._C,
    "_are_functorch_transforms_active",
    "torch._C._are_functorch_transforms_active",
    "splitgrad's modules cannot tell a torch.func transform from an eager call",
)

_TENSOR_HOOKS = "Tensor._backward_hooks / Tensor._post_accumulate_grad_hooks"
_probe = torch.zeros(())
if all(hasattr(_probe, name) for name in ("_backward_hooks", "_post_accumulate_grad_hooks")):
    _hooks_moved = None
else:
    _hooks_moved = _moved(_TENSOR_HOOKS, _ROUTING)
del _probe


def tensor_hook_dict(tensor: torch.Tensor) -> dict | None:
    """``tensor._backward_hooks``: the dictionary ``tensor.register_hook`` adds to (``None``
    before the first one). Autograd holds this very object and reads it each time it calls the
    hooks."""
    if _hooks_moved is not None:
        raise _hooks_moved
    return tensor._backward_hooks


def post_accumulate_hook_dict(tensor: torch.Tensor) -> dict | None:
    """``tensor._post_accumulate_grad_hooks``: the dictionary
    ``tensor.register_post_accumulate_grad_hook`` adds to (or ``None``)."""
    if _hooks_moved is not None:
        raise _hooks_moved
    return tensor._post_accumulate_grad_hooks


if _hooks_moved is None:

    def has_hooks(tensor: torch.Tensor) -> object:
        """Truthy when ``tensor`` has tensor or post-accumulate hooks (cheap: a module asks it
        for every gradient it writes)."""
        return tensor._backward_hooks or tensor._post_accumulate_grad_hooks

else:
    has_hooks = _raiser(_TENSOR_HOOKS, _ROUTING)


# ---- module hooks ---------------------------------------------------------------------------

_MODULE_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def module_hooks_registered(module: torch.nn.Module) -> list[str]:
    """Which of ``module``'s own hook dictionaries hold hooks (``Module._forward_hooks``,
    ``_forward_pre_hooks``, ``_backward_hooks``, ``_backward_pre_hooks``), named without the
    underscore: ``["forward_hooks"]``."""
    found = []
    for name in _MODULE_HOOK_DICTS:
        try:
            hooks = getattr(module, name)
        except AttributeError:
            raise _moved(
                f"torch.nn.Module.{name}",
                "splitgrad cannot tell whether a module to convert has hooks registered",
            ) from None
        if hooks:
            found.append(name.strip("_"))
    return found


# ---- DistributedDataParallel ----------------------------------------------------------------

_DDP_MOVED = "splitgrad cannot tell whether a module runs inside DistributedDataParallel"


def active_ddp_module() -> torch.nn.parallel.DistributedDataParallel | None:
    """``DistributedDataParallel._active_ddp_module``: the DDP whose forward is running (DDP sets
    it around its wrapped module's call), ``None`` outside one."""
    try:
        return torch.nn.parallel.DistributedDataParallel._active_ddp_module
    except AttributeError:
        raise _moved("DistributedDataParallel._active_ddp_module", _DDP_MOVED) from None


def ddp_parameters(ddp: torch.nn.parallel.DistributedDataParallel) -> list[torch.nn.Parameter]:
    """``ddp._module_parameters``: the parameters ``ddp`` reduces (those it was not told to
    ignore)."""
    try:
        return ddp._module_parameters
    except AttributeError:
        raise _moved("DistributedDataParallel._module_parameters", _DDP_MOVED) from None


# ---- FSDP2 (fully_shard) --------------------------------------------------------------------

_FSDP_MOVED = "splitgrad cannot tell whether fully_shard manages a module"
_STATES = "torch.distributed._composable_state"
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"

# module -> (size of FSDP2's state mapping when computed, [(param name, weakref to FSDPParam)])
_FSDP_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fsdp_state_mapping() -> tuple[object, type | tuple]:
    """``(_composable_state._module_state_mapping, FSDPState)``, or ``(None, ())`` where
    ``torch.distributed.fsdp`` was never imported."""
    states = sys.modules.get(_STATES)
    fsdp_state = sys.modules.get(_FSDP_STATE)
    if states is None or fsdp_state is None:
        if "torch.distributed.fsdp" in sys.modules:  # importing it imports both
            raise _moved(_STATES if states is None else _FSDP_STATE, _FSDP_MOVED)
        return None, ()
    mapping = getattr(states, "_module_state_mapping", None)
    if mapping is None:
        raise _moved(f"{_STATES}._module_state_mapping", _FSDP_MOVED)
    state_type = getattr(fsdp_state, "FSDPState", None)
    if state_type is None:
        raise _moved(f"{_FSDP_STATE}.FSDPState", _FSDP_MOVED)
    return mapping, state_type


def fsdp_in_use() -> bool:
    """Whether any module is under ``fully_shard`` (FSDP2's state mapping is not empty): when
    not, :func:`fsdp_managed_parameters` is empty for every module."""
    return bool(_fsdp_state_mapping()[0])


def _param_groups(state: object, fsdp_state: type | tuple) -> tuple | list:
    """The ``FSDPParamGroup``s of one composable state: ``FSDPState._fsdp_param_groups`` (2.13,
    2.14), ``FSDPState._fsdp_param_group`` (2.8, one or ``None``); none for the state of another
    composable API (``replicate``, ``checkpoint``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return groups
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return () if group is None else (group,)
    if isinstance(state, fsdp_state):
        raise _moved("FSDPState._fsdp_param_groups (nor _fsdp_param_group)", _FSDP_MOVED)
    return ()


def fsdp_managed_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(parameter name, sharded parameter)`` of each of ``module``'s own parameters that
    ``fully_shard`` (FSDP2) manages, through any ancestor's state (a weight shared with another
    module counts for both); empty when none is. Reads every state in
    ``_composable_state._module_state_mapping``, its parameter groups' ``fsdp_params`` and their
    ``FSDPParam._module_info`` (``module``, ``param_name``, ``shared_modules``,
    ``shared_param_names``) and ``sharded_param``; cached per module until the mapping grows."""
    mapping, fsdp_state = _fsdp_state_mapping()
    if not mapping:
        return []
    key = len(mapping)
    hit = _FSDP_CACHE.get(module)
    if hit is not None and hit[0] == key:
        found = [(name, ref()) for name, ref in hit[1]]
        if all(fp is not None for _, fp in found):
            return _sharded(found)
    found = []
    for ref in list(mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        for group in _param_groups(state, fsdp_state):
            try:
                fsdp_params = group.fsdp_params
            except AttributeError:
                raise _moved("FSDPParamGroup.fsdp_params", _FSDP_MOVED) from None
            for fp in fsdp_params:
                try:
                    info = fp._module_info
                except AttributeError:
                    raise _moved("FSDPParam._module_info", _FSDP_MOVED) from None
                if info.module is module:
                    found.append((info.param_name, fp))
                for shared, name in zip(info.shared_modules, info.shared_param_names):
                    if shared is module:
                        found.append((name, fp))
    # weak references: an FSDPParam refers back to the module, which must not outlive its model
    _FSDP_CACHE[module] = (key, [(name, weakref.ref(fp)) for name, fp in found])
    return _sharded(found)


def _sharded(found: list) -> list[tuple[str, torch.Tensor]]:
    try:
        return [(name, fp.sharded_param) for name, fp in found]
    except AttributeError:
        raise _moved("FSDPParam.sharded_param", _FSDP_MOVED) from None
