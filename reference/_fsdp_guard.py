"""Refuse a delayed or fused module under torch's ``fully_shard`` (FSDP2) that nothing reduces
(SPEC §8), as :func:`.contract.check_not_under_ddp` does for DDP.

FSDP2 reduce-scatters a parameter's gradient in its post-backward hook. A delayed module writes
its GEMM gradients later, in ``backward_dw()``, to the unsharded parameter FSDP2 has already
resharded away: every sharded gradient would stay ``None`` (and the unsharded one be reduced a
step late). ``splitgrad.distributed.GradientReducer`` built on the fully_shard-ed model reduces
them from the module hooks and marks their sharded parameters
(``wgrad_reduce_from_module_hooks = True``); an unmarked one makes the module raise. Under fused
accumulation the gradient goes to ``main_grad``, which FSDP2 never reads: refused always.

This reads FSDP2's private state (``torch.distributed._composable_state._module_state_mapping``,
each state's ``_fsdp_param_groups`` and their ``FSDPParam._module_info``; checked on torch 2.13)
and imports nothing: when ``torch.distributed`` was never imported no module can be sharded.
"""

from __future__ import annotations

import sys
import weakref

import torch

__all__ = ["check_not_under_fsdp", "REDUCED_FROM_MODULE_HOOKS"]

#: The attribute GradientReducer sets on the sharded parameters it reduces.
REDUCED_FROM_MODULE_HOOKS = "wgrad_reduce_from_module_hooks"

# module -> (size of FSDP2's state mapping when computed, [(param name, weakref to FSDPParam)])
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _managed(module: torch.nn.Module, mapping) -> list:
    key = len(mapping)
    hit = _CACHE.get(module)
    if hit is not None and hit[0] == key:
        found = [(name, ref()) for name, ref in hit[1]]
        if all(fp is not None for _, fp in found):
            return found
    found = []
    for ref in list(mapping.values()):
        state = ref() if isinstance(ref, weakref.ref) else ref
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for fp in getattr(group, "fsdp_params", ()):
                info = getattr(fp, "_module_info", None)
                if info is None:
                    raise RuntimeError(
                        f"torch {torch.__version__}: FSDPParam has no _module_info (checked on "
                        "torch 2.13); splitgrad cannot tell whether fully_shard manages a module"
                    )
                if info.module is module:
                    found.append((info.param_name, fp))
                for shared, name in zip(info.shared_modules, info.shared_param_names):
                    if shared is module:
                        found.append((name, fp))
    # weak references: an FSDPParam refers back to the module, which must not outlive its model
    _CACHE[module] = (key, [(name, weakref.ref(fp)) for name, fp in found])
    return found


def check_not_under_fsdp(module) -> None:
    """Raise ``RuntimeError`` when ``module`` (delayed or fused) has GEMM parameters managed by
    ``fully_shard`` that no ``GradientReducer`` reduces."""
    if not (module.delay_wgrad_compute or module.fuse_wgrad_accumulation):
        return
    states = sys.modules.get("torch.distributed._composable_state")
    mapping = getattr(states, "_module_state_mapping", None)
    if not mapping:
        return
    managed = [
        (name, fp)
        for name, fp in _managed(module, mapping)
        if not name.startswith("layer_norm") and fp.sharded_param.requires_grad
    ]
    if not managed:
        return
    names = ", ".join(name for name, _ in managed)
    kind = type(module).__name__
    if module.fuse_wgrad_accumulation:
        raise RuntimeError(
            f"{kind} with fuse_wgrad_accumulation=True runs under torch.distributed.fsdp."
            f"fully_shard (FSDP2), which owns the gradients of {names}: it never reads "
            "main_grad, so they would silently go unreduced. Build the module with "
            "fuse_wgrad_accumulation=False under fully_shard"
        )
    unclaimed = [
        name
        for name, fp in managed
        if not getattr(fp.sharded_param, REDUCED_FROM_MODULE_HOOKS, False)
    ]
    if unclaimed:
        raise RuntimeError(
            f"{kind} with delay_wgrad_compute=True runs under torch.distributed.fsdp.fully_shard "
            f"(FSDP2), which cannot reduce {', '.join(unclaimed)}: backward_dw() writes them after "
            "FSDP2's post-backward reduce-scatter and reshard, so every sharded gradient would "
            "silently stay None. Build splitgrad.distributed.GradientReducer(model) after "
            "fully_shard(...) (not before: a reducer built first reduces the replaced, unsharded "
            "parameters) and call its finish() before the optimizer step"
        )
