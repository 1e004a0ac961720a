"""Which parameters a :class:`~splitgrad.distributed.GradientReducer` reduces (SPEC §8, P16).

* **What is reduced.** Every trainable parameter of the model not in ``ignore``: its ``.grad``,
  or ``main_grad`` for the GEMM weights of a module built with
  ``fuse_wgrad_accumulation=True``; the average over the process group.
* **Who reports it.** A non-delayed parameter is produced when autograd accumulates into it; a
  delayed GEMM parameter (``skip_backward_post_hook``, SPEC §4) by the modules that hold it
  (one, or every module a weight is tied between, all of them delayed), see
  :mod:`.reducer_finality`.
* **Under fully_shard.** Only the delayed modules' GEMM parameters are the reducer's (their
  sharded parameters, with their ``FSDPParam``); FSDP2 reduces every other one itself (what is
  refused there: :mod:`.reducer_fsdp`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import torch

from .modules import SplitModule, split_modules

__all__ = ["ReducedParam", "collect_params"]


@dataclasses.dataclass(eq=False)
class ReducedParam:
    """One parameter the reducer reduces, and where it stands in the current step."""

    name: str
    param: torch.nn.Parameter
    main_grad: bool
    owner: SplitModule | None  # set for delayed GEMM parameters (reduced from module hooks)
    local: str = ""  # its name inside the owner
    fsdp: object = None  # its FSDPParam under fully_shard
    bucket: int = -1
    passes: int = 0  # producing backward passes seen this step (non-delayed parameters)
    last_task: int = -1
    ready: bool = False
    # every delayed module holding it (a weight tied between two of them has two); it is
    # final once each has run the last entry of its step's last pass
    owners: tuple = ()
    owners_final: int = 0
    # under fully_shard with a reduce_dtype other than the gradient's: the step's earlier
    # passes' gradients, summed in reduce_dtype as FSDP2 sums its own
    accumulated: torch.Tensor | None = None

    @property
    def delayed(self) -> bool:
        return self.owner is not None


def collect_params(
    module: torch.nn.Module, ignore: Iterable[str | torch.nn.Parameter], layout
) -> tuple[list[ReducedParam], list[tuple[str, object]]]:
    """The parameters of ``module`` the reducer reduces, in registration order, and under
    fully_shard (``layout``: :func:`.fsdp.describe`'s) the ``(name, FSDPParam)`` of those FSDP2
    reduces itself. ``ValueError`` for a model or an ``ignore`` the reducer cannot serve."""
    ignored = {id(p) for p in ignore if isinstance(p, torch.Tensor)}
    ignored_names = {p for p in ignore if isinstance(p, str)}
    names = dict(module.named_parameters())
    unknown = sorted(ignored_names - set(names))
    if unknown:
        raise ValueError(f"ignore names parameters {unknown} that module does not have")

    owner: dict[int, tuple[SplitModule, str]] = {}
    holders: dict[int, list[SplitModule]] = collections.defaultdict(list)
    for sm in split_modules(module):
        for local, p in sm.gemm_params:
            owner[id(p)] = (sm, local)
            holders[id(p)].append(sm)
    params: list[ReducedParam] = []
    fsdp_own: list[tuple[str, object]] = []
    unmanaged: list[str] = []
    for name, p in names.items():
        if not p.requires_grad or id(p) in ignored or name in ignored_names:
            continue
        sm, local = owner.get(id(p), (None, None))
        deferred = bool(getattr(p, "skip_backward_post_hook", False))
        if deferred and (sm is None or not sm.delayed):
            raise ValueError(
                f"{name} has skip_backward_post_hook=True but no delayed split-backward "
                "module owns it: no module hook would report its gradient"
            )
        main_grad = sm is not None and sm.uses_main_grad(local)
        fp = None
        if layout is not None:
            fp = layout.params.get(id(p))
            if fp is None:
                unmanaged.append(name)
                continue
            # fully_shard's new sharded Parameters do not carry skip_backward_post_hook
            deferred = sm is not None and sm.delayed
            if main_grad:
                raise ValueError(
                    f"{name}: fuse_wgrad_accumulation=True under fully_shard is not supported "
                    "(FSDP2 owns the gradient storage and never reads main_grad)"
                )
            if not deferred:
                fsdp_own.append((name, fp))
                continue
            p = fp.sharded_param
        held_by = tuple(holders[id(names[name])]) if deferred else ()
        _check_tied(name, held_by, layout is not None)
        params.append(
            ReducedParam(
                name, p, main_grad, sm if deferred else None, local or "", fp, owners=held_by
            )
        )
    _check_served(params, unmanaged, layout is not None)
    return params, fsdp_own


def _check_tied(name: str, held_by: tuple[SplitModule, ...], fully_sharded: bool) -> None:
    """A weight tied between delayed modules is followed through each of them; not one tied to
    a non-delayed module (autograd would write it in backward) nor one under fully_shard."""
    if len(held_by) > 1 and (fully_sharded or any(not h.delayed for h in held_by)):
        raise ValueError(
            f"{name} is shared by {len(held_by)} split-backward modules, "
            + (
                "which GradientReducer does not follow under fully_shard"
                if fully_sharded
                else "some of them without delay_wgrad_compute: tie it between "
                "modules that all defer it, or none"
            )
        )


def _check_served(params: list[ReducedParam], unmanaged: list[str], fully_sharded: bool) -> None:
    """Refuse parameters FSDP2 does not manage, nothing to reduce, or several devices."""
    if unmanaged:
        raise ValueError(
            f"under fully_shard every trainable parameter must be managed by FSDP2, but "
            f"{unmanaged} are not: apply fully_shard to the root module too"
        )
    if not params:
        if fully_sharded:
            raise ValueError(
                "nothing for GradientReducer to reduce: the fully_shard-ed module has no "
                "delayed split-backward module, and FSDP2 reduces every other gradient itself"
            )
        raise ValueError("module has no trainable parameter to reduce")
    by_device: dict[str, str] = {}
    for st in params:
        by_device.setdefault(str(st.param.device), st.name)
    if len(by_device) > 1:
        raise ValueError(
            "GradientReducer needs the module's trainable parameters on one device (its "
            f"buckets are flat tensors), got {len(by_device)}: "
            + ", ".join(f"{dev} (e.g. {name})" for dev, name in by_device.items())
        )
