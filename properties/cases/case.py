"""What one example of the campaign is, as data: a :class:`Case` (module configuration,
micro-batches, seed, schedule, variant) and the finite dimensions it is drawn from (kinds, dtypes,
FP8 recipes, layouts). No hypothesis here: backends, results and the distributed checks (which
run in spawned ranks) import these without paying for hypothesis; :mod:`.strategies` draws them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import torch

from .variants import Variant, parse_variant

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
DTYPES = ("float32", "bfloat16", "float16", "float64")
# Dtypes with a wider dtype to measure error against (float64 has no truth above it).
LOW_PRECISION_DTYPES = ("float32", "bfloat16", "float16")
# torch.autocast dtypes the harness runs float32 modules under (SPEC §2): the GEMMs in it.
AUTOCAST_DTYPES = ("bfloat16", "float16")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")
NORM_KINDS = ("LayerNormLinear", "LayerNormMLP")

# FP8 recipes by name (JSON-friendly, so a shrunk case replays). Delayed scaling keeps a short
# history (4 steps) so that a few micro-batches already roll it over and "max" differs from
# "most_recent".
_HISTORY = 4
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "delayed-max-hybrid": ("DelayedScaling", {"amax_compute_algo": "max"}),
    "delayed-max-e4m3": ("DelayedScaling", {"amax_compute_algo": "max", "fp8_format": "E4M3"}),
    "delayed-recent-hybrid": ("DelayedScaling", {"amax_compute_algo": "most_recent"}),
    "delayed-recent-e4m3": (
        "DelayedScaling",
        {"amax_compute_algo": "most_recent", "fp8_format": "E4M3"},
    ),
    "current-hybrid": ("Float8CurrentScaling", {}),
    "current-e4m3": ("Float8CurrentScaling", {"fp8_format": "E4M3"}),
    "mxfp8": ("MXFP8BlockScaling", {}),
    "mxfp8-hybrid": ("MXFP8BlockScaling", {"fp8_format": "HYBRID"}),
    "block": ("Float8BlockScaling", {}),
    "block-hybrid": ("Float8BlockScaling", {"fp8_format": "HYBRID"}),
}
# What ``splitgrad verify --recipe`` and the tests select by.
RECIPE_FAMILIES: dict[str, tuple[str, ...]] = {
    family: tuple(n for n in RECIPES if n.startswith(family))
    for family in ("delayed", "current", "mxfp8", "block")
}
_ALIGNMENT = {"MXFP8BlockScaling": 32, "Float8BlockScaling": 128}

# Memory layouts of a micro-batch's input and output gradient, as real models and losses give them:
# "transposed": t.transpose(0, 1) of a contiguous tensor (column-major for 2-D);
# "sliced": big[..., ::2]; "narrowed": big[..., :n] of rows one element wider (unaligned rows);
# "expanded": ones(()).expand (loss.sum()); "expanded_mean": the same at 1/numel (loss.mean());
# "expanded_rows": one row expanded over the rows (stride 0 along rows: (y * v).sum()).
X_LAYOUTS = ("contiguous", "transposed", "sliced", "narrowed")
EXPANDED_LAYOUTS = ("expanded", "expanded_mean", "expanded_rows")
DY_LAYOUTS = (*X_LAYOUTS, *EXPANDED_LAYOUTS)


def make_recipe(name: str) -> Any:
    """The recipe object called ``name`` (classes from ``splitgrad.reference.fp8``, which impl
    re-exports); raises ``ValueError`` naming unknown recipes."""
    from splitgrad.reference import fp8

    try:
        cls, kw = RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown FP8 recipe {name!r}; expected one of {list(RECIPES)}") from None
    kw = dict(kw)
    if "fp8_format" in kw:
        kw["fp8_format"] = fp8.Format[kw["fp8_format"]]
    if cls == "DelayedScaling":
        kw["amax_history_len"] = _HISTORY
    return getattr(fp8, cls)(**kw)


def recipe_alignment(name: str | None) -> int:
    """The multiple every feature size and token count needs under recipe ``name`` (1: any)."""
    if name is None:
        return 1
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 recipe {name!r}; expected one of {list(RECIPES)}")
    return _ALIGNMENT.get(RECIPES[name][0], 1)


def _max_work() -> int:
    raw = os.environ.get("SPLITGRAD_MAX_WORK", "24576")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"SPLITGRAD_MAX_WORK must be an int, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"SPLITGRAD_MAX_WORK must be positive, got {value}")
    return value


MAX_WORK = _max_work()


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; raises ``ValueError`` naming unknown dtypes."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {DTYPES}")
    return getattr(torch, name)


@dataclasses.dataclass(frozen=True)
class ModuleConfig:
    """How to build one module: the constructor's structure, without any tensor values.

    ``out_features`` is ``ffn_hidden_size`` for ``LayerNormMLP`` (whose output has
    ``in_features`` columns); ``num_gemms`` only matters for ``GroupedLinear``.
    """

    kind: str
    in_features: int
    out_features: int
    num_gemms: int = 1
    bias: bool = True
    fuse_wgrad_accumulation: bool = False
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    zero_centered_gamma: bool = False
    dtype: str = "float32"
    device: str = "cpu"
    recipe: str | None = None
    autocast: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown module kind {self.kind!r}; expected one of {KINDS}")
        torch_dtype(self.dtype)
        recipe_alignment(self.recipe)  # validates the name
        if self.autocast is not None:
            if self.autocast not in AUTOCAST_DTYPES:
                raise ValueError(
                    f"unknown autocast dtype {self.autocast!r}; expected one of {AUTOCAST_DTYPES}"
                )
            if self.dtype != "float32":
                raise ValueError(
                    f"autocast={self.autocast!r} runs float32 parameters (as torch.autocast "
                    f"is used), got dtype={self.dtype!r}"
                )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the GEMMs compute in: the autocast dtype under ``torch.autocast``, else
        the parameters' (what the rounding budgets are sized by)."""
        return torch_dtype(self.autocast) if self.autocast is not None else self.torch_dtype

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def output_features(self) -> int:
        """Columns of the module's output."""
        return self.in_features if self.kind == "LayerNormMLP" else self.out_features

    @property
    def has_norm(self) -> bool:
        return self.kind in NORM_KINDS

    def gemm_shapes(self) -> list[tuple[int, int]]:
        """(out, in) of every GEMM weight, in parameter order."""
        if self.kind == "LayerNormMLP":
            fc1 = 2 * self.out_features if self.activation in GATED else self.out_features
            return [(fc1, self.in_features), (self.in_features, self.out_features)]
        if self.kind == "GroupedLinear":
            return [(self.out_features, self.in_features)] * self.num_gemms
        return [(self.out_features, self.in_features)]

    def work_per_row(self) -> int:
        """Multiply-adds per input row over forward, dgrad and wgrad of every GEMM."""
        if self.kind == "GroupedLinear":
            return 3 * self.in_features * self.out_features
        return 3 * sum(o * i for o, i in self.gemm_shapes())

    def label(self) -> str:
        """Short human description, used in tables and test ids."""
        parts = [self.kind, f"{self.in_features}x{self.out_features}", self.dtype]
        if self.kind == "GroupedLinear":
            parts.insert(1, f"n={self.num_gemms}")
        if self.has_norm:
            parts.append(self.normalization + ("+zcg" if self.zero_centered_gamma else ""))
        if self.kind == "LayerNormMLP":
            parts.append(self.activation)
        if self.fuse_wgrad_accumulation:
            parts.append("fused")
        if not self.bias:
            parts.append("nobias")
        if self.recipe is not None:
            parts.append(f"fp8:{self.recipe}")
        if self.autocast is not None:
            parts.append(f"autocast:{self.autocast}")
        return " ".join(parts)

    @property
    def alignment(self) -> int:
        """Multiple every size and token count needs under the recipe (1 without FP8)."""
        return recipe_alignment(self.recipe)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: leading shape of the input (rows = product) and, for ``GroupedLinear``,
    its ``m_splits``; ``is_first_microbatch`` as passed to the forward."""

    lead_shape: tuple[int, ...]
    m_splits: tuple[int, ...] | None = None
    is_first_microbatch: bool | None = None
    x_layout: str = "contiguous"
    dy_layout: str = "contiguous"

    def __post_init__(self) -> None:
        if self.x_layout not in X_LAYOUTS:
            raise ValueError(f"unknown input layout {self.x_layout!r}; expected one of {X_LAYOUTS}")
        if self.dy_layout not in DY_LAYOUTS:
            raise ValueError(
                f"unknown output-gradient layout {self.dy_layout!r}; expected one of {DY_LAYOUTS}"
            )

    @property
    def rows(self) -> int:
        return math.prod(self.lead_shape)


@dataclasses.dataclass(frozen=True)
class Case:
    """One example of one property: a module, its micro-batches, a seed for every value, and the
    property-specific structure (``schedule`` for P6; ``variant`` for P5, P7, P10, P13, P17,
    P18, typed for P10 and P17 (:mod:`.variants`; a string form given is parsed); ``frozen``
    for P4 and P7; ``asked``, the tensors a partial backward asks for, for P17: ``"inp"`` and
    parameter names; for P18 the parameters its substitution targets)."""

    config: ModuleConfig
    micro_batches: tuple[MicroBatch, ...]
    seed: int = 0
    schedule: tuple[str, ...] = ()
    variant: Variant = ""
    frozen: tuple[str, ...] = ()
    delay: bool = True
    asked: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "variant", parse_variant(self.variant))

    def as_dict(self) -> dict[str, Any]:
        """The case as plain data, the variant in its string form."""
        return {**dataclasses.asdict(self), "variant": str(self.variant)}

    def to_json(self) -> str:
        """One-line JSON that :meth:`from_json` turns back into this case."""
        return json.dumps(self.as_dict(), separators=(",", ":"), sort_keys=True)

    @staticmethod
    def from_json(text: str | dict[str, Any]) -> Case:
        """Parse :meth:`to_json` output; raises ``ValueError`` naming what is wrong."""
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
            config = ModuleConfig(**raw.pop("config"))
            mbs = tuple(
                MicroBatch(
                    lead_shape=tuple(mb["lead_shape"]),
                    m_splits=None if mb.get("m_splits") is None else tuple(mb["m_splits"]),
                    is_first_microbatch=mb.get("is_first_microbatch"),
                    x_layout=mb.get("x_layout", "contiguous"),
                    dy_layout=mb.get("dy_layout", "contiguous"),
                )
                for mb in raw.pop("micro_batches")
            )
            return Case(
                config=config,
                micro_batches=mbs,
                seed=int(raw.pop("seed", 0)),
                schedule=tuple(raw.pop("schedule", ())),
                variant=str(raw.pop("variant", "")),
                frozen=tuple(raw.pop("frozen", ())),
                delay=bool(raw.pop("delay", True)),
                asked=tuple(raw.pop("asked", ())),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ValueError(f"not a splitgrad case: {text!r} ({exc})") from None
