"""FP8 recipes and ``fp8_autocast`` (SPEC §6).

The recipe dataclasses and the facts of the formats they quantize to (dtypes, largest values,
block sizes) are defined here once; ``splitgrad.impl`` re-exports the recipes. The numerics
live in :mod:`.fp8_quant` (casts, quantizers, amax histories: every rounding point) and
:mod:`.fp8_gemm` (which quantized copy feeds which GEMM). ``fp8_autocast(enabled=False)`` is a
no-op context. An implementation without FP8 support calls :func:`fp8_enabled_for_forward` so
that it raises ``NotImplementedError`` rather than silently running in high precision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
from collections.abc import Iterator

import torch

#: What ``splitgrad.reference`` and ``splitgrad.impl`` export from here (SPEC §6).
EXPORTED = (
    "Format",
    "Recipe",
    "DelayedScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "Float8BlockScaling",
    "fp8_autocast",
)

# The package namespaces star-import this list: the format facts below stay out of it.
__all__ = [*EXPORTED, "fp8_active_recipe", "fp8_enabled_for_forward"]

# ---- the formats and block sizes every implementation quantizes to ---------------------------

#: The torch dtype that holds each FP8 format's values.
FP8_DTYPES = {"E4M3": torch.float8_e4m3fn, "E5M2": torch.float8_e5m2}
#: Each format's largest finite value.
FP8_MAX = {"E4M3": 448.0, "E5M2": 57344.0}
#: The exponent of each format's largest finite value (MXFP8's power-of-two scales align to it).
FP8_EMAX = {"E4M3": 8, "E5M2": 15}
#: ``MXFP8BlockScaling``: values per E8M0 scale, along a GEMM's reduction dimension.
MX_BLOCK = 32
#: ``Float8BlockScaling``: the tile side (1x128 activations and gradients, 128x128 weights).
TILE = 128


class Format(enum.Enum):
    """FP8 formats: ``E4M3`` everywhere, or ``HYBRID`` = E4M3 for activations and weights and
    E5M2 for gradients."""

    E4M3 = "E4M3"
    HYBRID = "HYBRID"


class Recipe:
    """Base class of the FP8 recipes."""


_AMAX_ALGOS = ("max", "most_recent")


@dataclasses.dataclass(frozen=True)
class DelayedScaling(Recipe):
    """Per-tensor scales from an amax history of ``amax_history_len`` steps kept in the module;
    ``amax_compute_algo`` picks the history's max or its most recent entry."""

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"

    def __post_init__(self) -> None:
        if self.amax_compute_algo not in _AMAX_ALGOS:
            raise ValueError(
                f"amax_compute_algo must be one of {_AMAX_ALGOS}, got {self.amax_compute_algo!r}"
            )
        if isinstance(self.amax_history_len, bool) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len!r}")
        if not isinstance(self.fp8_format, Format):
            raise ValueError(f"fp8_format must be a Format, got {self.fp8_format!r}")


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor scale from the current amax of the tensor being quantized."""

    fp8_format: Format = Format.HYBRID


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """E4M3 with one E8M0 (power-of-two) scale per 32 consecutive values along the GEMM's
    reduction dimension."""

    fp8_format: Format = Format.E4M3


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """fp32 scales per 1x128 tile (activations, gradients) and per 128x128 block (weights)."""

    fp8_format: Format = Format.E4M3


class _State(threading.local):
    #: The active recipe of this thread: a class default, so that reading it in a thread that
    #: never entered ``fp8_autocast`` is an attribute lookup, not a caught AttributeError.
    recipe: Recipe | None = None


_state = _State()


def fp8_active_recipe() -> Recipe | None:
    """The recipe of the innermost ``fp8_autocast`` of this thread, or ``None`` when FP8 is off."""
    return _state.recipe


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, fp8_recipe: Recipe | None = None) -> Iterator[None]:
    """Turn FP8 on (or, with ``enabled=False``, off) for the forwards inside the block; backward
    uses what the forward captured. ``fp8_recipe`` defaults to ``DelayedScaling()``."""
    if fp8_recipe is not None and not isinstance(fp8_recipe, Recipe):
        raise TypeError(f"fp8_recipe must be a splitgrad recipe, got {type(fp8_recipe).__name__}")
    previous = fp8_active_recipe()
    _state.recipe = (fp8_recipe or DelayedScaling()) if enabled else None
    try:
        yield
    finally:
        _state.recipe = previous


def fp8_enabled_for_forward() -> None:
    """Raise ``NotImplementedError`` if a forward runs under an enabled ``fp8_autocast``."""
    recipe = fp8_active_recipe()
    if recipe is not None:
        raise NotImplementedError(
            f"FP8 ({type(recipe).__name__}) is not implemented yet in splitgrad; refusing to run "
            "the forward in high precision instead. Run outside fp8_autocast(enabled=True)."
        )
