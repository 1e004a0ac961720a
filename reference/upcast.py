"""The upcast switch: the same reference code, run in float64, is the truth for error budgets."""

from __future__ import annotations

import inspect

import torch

__all__ = ["module_config", "upcast"]


def module_config(module: torch.nn.Module) -> tuple[tuple, dict]:
    """``(args, kwargs)`` that rebuild ``module`` (any splitgrad-style module, reference or impl):
    positional sizes and every keyword option its constructor takes, read from its attributes."""
    sig = inspect.signature(type(module).__init__)
    args, kwargs = [], {}
    for name, p in list(sig.parameters.items())[1:]:
        if name == "device":
            value = next(module.parameters()).device
        else:
            value = getattr(module, "use_bias" if name == "bias" else name)
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    return tuple(args), kwargs


def upcast(module: torch.nn.Module, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A reference twin of ``module`` in ``dtype`` (float64 by default): same configuration, same
    parameter values, ``main_grad`` and ``.grad`` copied and cast. ``module`` may be a reference
    or an impl module (only its public configuration attributes and state dict are read)."""
    from . import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear

    cls = {c.__name__: c for c in (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear)}[
        type(module).__name__
    ]
    args, kwargs = module_config(module)
    kwargs["params_dtype"] = dtype
    twin = cls(*args, **kwargs)
    with torch.no_grad():
        own = dict(module.named_parameters())
        for name, p in twin.named_parameters():
            src = own[name]
            p.copy_(src.to(dtype))
            p.requires_grad_(src.requires_grad)
            if src.grad is not None:
                p.grad = src.grad.to(dtype)
            if isinstance(getattr(src, "main_grad", None), torch.Tensor):
                p.main_grad = src.main_grad.to(
                    torch.float64 if dtype == torch.float64 else torch.float32
                )
            if hasattr(src, "grad_added_to_main_grad"):
                p.grad_added_to_main_grad = src.grad_added_to_main_grad
    return twin
