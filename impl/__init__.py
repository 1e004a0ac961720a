"""splitgrad.impl — the optimized split-backward implementation (same API as the reference).

Same four modules, constructor signatures, parameter names and behaviour as
``splitgrad.reference`` (SPEC.md §2–§5), written for speed and memory:

* :mod:`splitgrad.reference.contract` — the contract the modules are built on, shared with the
  reference: constructor options and their validation, parameters, input checks, §5 errors;
* :mod:`.store` — the per-module FIFO of deferred wgrad entries;
* :mod:`.base` — gradient routing, ``backward_dw(stream=None)``, hooks, the cheap eager
  ``Function.apply`` and gradient destinations;
* :mod:`.compiled` — how a backward runs inside a ``torch.compile``-d graph;
* :mod:`.gemm` — the device dispatch (CUDA fast paths, portable path);
* :mod:`.linear`, :mod:`.layernorm_linear`, :mod:`.layernorm_mlp`, :mod:`.grouped_linear` —
  each module's autograd Functions and fast paths;
* :mod:`.norm`, :mod:`.activation` — fused elementwise kernels;
* :mod:`.fp8` — FP8 quantizers and delayed-scaling state (bit-identical to the reference's);
* :mod:`.fp8_gemm` — FP8 GEMMs (``torch._scaled_mm`` where the device runs it well, an exact
  dequantize-then-GEMM path elsewhere) and what a queued FP8 wgrad entry holds;
* :mod:`.parallel` — tensor and sequence parallelism (SPEC §9): impl's collectives, overlapped
  with the GEMMs as TransformerEngine's are, and what a TP entry holds in each ``wgrad_gather``
  mode (the options are the shared contract, :mod:`splitgrad.reference.parallel`).

The FP8 recipes and ``fp8_autocast`` are re-exported from the reference (part of the contract);
under an enabled ``fp8_autocast`` every module runs its GEMMs in FP8 (SPEC §6).
"""

from splitgrad.reference import fp8 as _recipes
from splitgrad.reference.convert import make_convert_linears as _make_convert_linears
from splitgrad.reference.fp8 import *  # noqa: F403 (the recipes and fp8_autocast, written once)

from .base import SplitBackwardModule
from .grouped_linear import GroupedLinear
from .layernorm_linear import LayerNormLinear
from .layernorm_mlp import LayerNormMLP
from .linear import Linear
from .store import WeightGradStore, WgradEntry

__all__ = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "SplitBackwardModule"]
__all__ += ["WeightGradStore", "WgradEntry", *_recipes.EXPORTED]

convert_linears = _make_convert_linears(Linear)
__all__ += ["convert_linears"]
