"""Refuse a delayed or fused module under torch's ``fully_shard`` (FSDP2) that nothing reduces
(SPEC §8), as :func:`.contract.check_not_under_ddp` does for DDP.

FSDP2 reduce-scatters a parameter's gradient in its post-backward hook. A delayed module writes
its GEMM gradients later, in ``backward_dw()``, to the unsharded parameter FSDP2 has already
resharded away: every sharded gradient would stay ``None`` (and the unsharded one be reduced a
step late). ``splitgrad.distributed.GradientReducer`` built on the fully_shard-ed model reduces
them from the module hooks and marks their sharded parameters
(``wgrad_reduce_from_module_hooks = True``); an unmarked one makes the module raise. Under fused
accumulation the gradient goes to ``main_grad``, which FSDP2 never reads: refused always.

Which parameters FSDP2 manages is FSDP2's private state, read by
:func:`._torch_private.fsdp_managed_parameters` (which imports nothing: when
``torch.distributed.fsdp`` was never imported no module can be sharded).
"""

from __future__ import annotations

from ._torch_private import fsdp_managed_parameters

__all__ = ["check_not_under_fsdp", "REDUCED_FROM_MODULE_HOOKS"]

#: The attribute GradientReducer sets on the sharded parameters it reduces.
REDUCED_FROM_MODULE_HOOKS = "wgrad_reduce_from_module_hooks"


def check_not_under_fsdp(module) -> None:
    """Raise ``RuntimeError`` when ``module`` (delayed or fused) has GEMM parameters managed by
    ``fully_shard`` that no ``GradientReducer`` reduces."""
    if not (module.delay_wgrad_compute or module.fuse_wgrad_accumulation):
        return
    managed = [
        (name, sharded)
        for name, sharded in fsdp_managed_parameters(module)
        if not name.startswith("layer_norm") and sharded.requires_grad
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
        name for name, sharded in managed if not getattr(sharded, REDUCED_FROM_MODULE_HOOKS, False)
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
