"""splitgrad.reference — the executable specification of split backward.

Readable, naive, float64-capable, imports torch only. Each formula is one small function in
:mod:`.functional` with its backward written out by hand; the modules only compose them.
Read in this order: :mod:`.functional` (formulas and rounding points), :mod:`.base` (where
gradients go, the queue, the failure rules), then :mod:`.linear`, :mod:`.layernorm_linear`,
:mod:`.layernorm_mlp`, :mod:`.grouped_linear`, and :mod:`.fp8` (recipes).
"""

from .base import SplitBackwardModule
from .fp8 import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    Recipe,
    fp8_autocast,
)
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .upcast import module_config, upcast

__all__ = [
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "GroupedLinear",
    "SplitBackwardModule",
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "fp8_autocast",
    "module_config",
    "upcast",
]
