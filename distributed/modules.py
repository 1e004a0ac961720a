"""What ``splitgrad.distributed`` knows about a model, read from SPEC §2-§4's public API only.

A *split-backward module* is any submodule with ``backward_dw``, ``pending_wgrad_count``,
``need_backward_dw`` and ``register_wgrad_accumulation_and_reduce_hooks`` (splitgrad's reference
and impl, TransformerEngine, or any conforming package). Its *GEMM parameters* are its own
parameters other than the norm's (``layer_norm_weight``, ``layer_norm_bias``): SPEC §2 names
them ``weight``/``bias``, ``weight{i}``/``bias{i}``, ``fc1_*``/``fc2_*``. With
``fuse_wgrad_accumulation=True`` the GEMM *weights* accumulate into ``main_grad``; biases and norm
parameters always use ``.grad`` (SPEC §3).
"""

from __future__ import annotations

import dataclasses
import re

import torch

__all__ = ["SplitModule", "split_modules", "is_split_module", "gradient_tensor", "assert_drained"]

_API = (
    "backward_dw",
    "pending_wgrad_count",
    "need_backward_dw",
    "register_wgrad_accumulation_and_reduce_hooks",
)
_GEMM_WEIGHT = re.compile(r"^(weight\d*|fc1_weight|fc2_weight)$")


def is_split_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` has SPEC §4's split-backward API."""
    return all(hasattr(module, name) for name in _API)


@dataclasses.dataclass(frozen=True)
class SplitModule:
    """One split-backward submodule of a model and its GEMM parameters (trainable ones only)."""

    name: str
    module: torch.nn.Module
    gemm_params: tuple[tuple[str, torch.nn.Parameter], ...]

    @property
    def delayed(self) -> bool:
        """``need_backward_dw()``: its GEMM gradients arrive in ``backward_dw()``."""
        return bool(self.module.need_backward_dw())

    def uses_main_grad(self, local_name: str) -> bool:
        """Whether the parameter ``local_name`` accumulates into ``main_grad`` (fused weights)."""
        fused = bool(getattr(self.module, "fuse_wgrad_accumulation", False))
        return fused and _GEMM_WEIGHT.match(local_name) is not None


def split_modules(root: torch.nn.Module) -> list[SplitModule]:
    """Every split-backward module inside ``root`` (``root`` included), in registration order."""
    found = []
    for name, module in root.named_modules():
        if not is_split_module(module):
            continue
        params = tuple(
            (pname, p)
            for pname, p in module.named_parameters(recurse=False)
            if not pname.startswith("layer_norm") and p.requires_grad
        )
        found.append(SplitModule(name, module, params))
    return found


def assert_drained(model: torch.nn.Module) -> None:
    """Raise ``RuntimeError`` if a module inside ``model`` (``model`` included) still has queued
    weight-gradient entries: every module with an int ``pending_wgrad_count`` above 0 (any
    conforming package), named by its name in ``model`` with its kind and count. Call it where
    every ``backward_dw()`` of a step should have run, e.g. before ``optimizer.step()``."""
    owing = []
    for name, module in model.named_modules():
        count = getattr(module, "pending_wgrad_count", None)
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            owing.append(f"{name or '<model>'} ({type(module).__name__}): {count}")
    if owing:
        raise RuntimeError(
            f"assert_drained({type(model).__name__}): weight-gradient entries are still pending "
            f"(module: pending_wgrad_count): {', '.join(owing)}; run backward_dw() once per "
            "pending entry"
        )


def gradient_tensor(param: torch.nn.Parameter, uses_main_grad: bool) -> torch.Tensor | None:
    """The tensor that holds ``param``'s gradient: ``main_grad`` for fused weights, else
    ``.grad`` (``None`` while nothing was written)."""
    if uses_main_grad:
        mg = getattr(param, "main_grad", None)
        if not isinstance(mg, torch.Tensor):
            raise RuntimeError(
                "fuse_wgrad_accumulation=True but the parameter has no main_grad tensor "
                f"(got {type(mg).__name__})"
            )
        return mg
    return param.grad


def output_tensors(output) -> list[torch.Tensor]:
    """The tensors of a module's output: a tensor, or one nested in tuples, lists and dicts."""
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in output_tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in output_tensors(item)]
    return []
