"""splitgrad.impl — the optimized split-backward implementation (same API as the reference).

Same four modules, constructor signatures, parameter names and behaviour as
``splitgrad.reference`` (SPEC.md §2–§5), written for speed and memory:

* :mod:`.store` — the per-module FIFO of deferred wgrad entries;
* :mod:`.base` — validation, gradient routing, ``backward_dw(stream=None)``, hooks;
* :mod:`.gemm` — the device dispatch (CUDA fast paths, portable path);
* :mod:`.linear`, :mod:`.layernorm_linear`, :mod:`.layernorm_mlp`, :mod:`.grouped_linear`;
* :mod:`.norm`, :mod:`.activation` — fused elementwise kernels.

The FP8 recipes and ``fp8_autocast`` are re-exported from the reference (the one shared piece);
FP8 numerics are not implemented yet and a forward under an enabled ``fp8_autocast`` raises
``NotImplementedError``.
"""

from splitgrad.reference.fp8 import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
    fp8_autocast,
)

from .base import SplitBackwardModule
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .store import WeightGradStore, WgradEntry

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "SplitBackwardModule",
    "WeightGradStore",
    "WgradEntry",
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "fp8_autocast",
]
