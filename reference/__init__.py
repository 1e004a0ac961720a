"""splitgrad.reference — the executable specification of split backward.

Readable, naive, float64-capable, imports torch only. Each formula is one small function in
:mod:`.functional` with its backward written out by hand; the modules only compose them.
Read in this order: :mod:`.contract` (options, parameters, input checks and error messages,
shared with ``splitgrad.impl``), :mod:`.functional` (formulas and rounding points), :mod:`.base`
(where gradients go, the queue, the failure rules), then :mod:`.linear`,
:mod:`.layernorm_linear`, :mod:`.layernorm_mlp`, :mod:`.grouped_linear`, and :mod:`.fp8`
(recipes). Tensor and sequence parallelism (SPEC §9): :mod:`.parallel` (the options, shapes and
attributes, shared with ``splitgrad.impl``) and :mod:`.collectives` (the reference's own
collectives, written plainly). :mod:`.pending` is the optimizer guard: an optimizer step over a
parameter that a queued entry of either package will still write raises.
"""

from . import fp8
from .base import SplitBackwardModule
from .convert import make_convert_linears as _make_convert_linears
from .fp8 import *  # noqa: F403 (the recipes and fp8_autocast: SPEC §6)
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .upcast import module_config, upcast

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "SplitBackwardModule"]
__all__ += [*fp8.EXPORTED, "module_config", "upcast"]

convert_linears = _make_convert_linears(Linear)
__all__ += ["convert_linears"]
