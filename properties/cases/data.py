"""Tensor values for a :class:`~.case.Case`, all from its seed.

Parameters get values on the scale a trained layer has (weights ~ 1/sqrt(fan_in), non-trivial
biases and norm scales) rather than the constructors' defaults (zero biases, unit gammas), so a
dropped bias or gamma gradient shows up as a large error instead of hiding behind a zero. Each
micro-batch's ``x`` and ``dy`` come in the layout its :class:`MicroBatch` names
(:func:`with_layout`); the gaps of a strided layout hold NaN, so a kernel that reads past a
view's elements fails loudly.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .case import DY_LAYOUTS, GATED, Case, MicroBatch, ModuleConfig

GEMM_WEIGHT, GEMM_BIAS, NORM = "gemm_weight", "gemm_bias", "norm"


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Name (TransformerEngine spelling), shape and role of one parameter."""

    name: str
    shape: tuple[int, ...]
    role: str  # GEMM_WEIGHT, GEMM_BIAS or NORM


def param_specs(config: ModuleConfig) -> list[ParamSpec]:
    """Every parameter a module built from ``config`` has, in a fixed order."""
    specs: list[ParamSpec] = []
    k, m = config.in_features, config.out_features
    if config.has_norm:
        specs.append(ParamSpec("layer_norm_weight", (k,), NORM))
        if config.normalization == "LayerNorm":
            specs.append(ParamSpec("layer_norm_bias", (k,), NORM))
    if config.kind in ("Linear", "LayerNormLinear"):
        specs.append(ParamSpec("weight", (m, k), GEMM_WEIGHT))
        if config.bias:
            specs.append(ParamSpec("bias", (m,), GEMM_BIAS))
    elif config.kind == "LayerNormMLP":
        fc1 = 2 * m if config.activation in GATED else m
        specs.append(ParamSpec("fc1_weight", (fc1, k), GEMM_WEIGHT))
        if config.bias:
            specs.append(ParamSpec("fc1_bias", (fc1,), GEMM_BIAS))
        specs.append(ParamSpec("fc2_weight", (k, m), GEMM_WEIGHT))
        if config.bias:
            specs.append(ParamSpec("fc2_bias", (k,), GEMM_BIAS))
    else:
        specs.extend(ParamSpec(f"weight{i}", (m, k), GEMM_WEIGHT) for i in range(config.num_gemms))
        if config.bias:
            specs.extend(ParamSpec(f"bias{i}", (m,), GEMM_BIAS) for i in range(config.num_gemms))
    return specs


def gemm_weight_names(config: ModuleConfig) -> list[str]:
    """SPEC §2's GEMM weights of ``config`` (those that use ``main_grad`` when fused)."""
    return [s.name for s in param_specs(config) if s.role == GEMM_WEIGHT]


def gemm_bias_names(config: ModuleConfig) -> list[str]:
    """SPEC §2's GEMM biases of ``config``."""
    return [s.name for s in param_specs(config) if s.role == GEMM_BIAS]


def role_of(name: str) -> str:
    """The role (:data:`GEMM_WEIGHT`, :data:`GEMM_BIAS`, :data:`NORM`) SPEC §2's parameter
    name ``name`` has in any module; raises ``ValueError`` for a name SPEC does not use."""
    if name in ("layer_norm_weight", "layer_norm_bias"):
        return NORM
    for role, base in ((GEMM_WEIGHT, "weight"), (GEMM_BIAS, "bias")):
        numbered = name.startswith(base) and name[len(base) :].isdigit()  # GroupedLinear's
        if numbered or name in (base, f"fc1_{base}", f"fc2_{base}"):
            return role
    raise ValueError(f"{name!r} is not a parameter name of SPEC §2")


def generator(seed: int, stream: int = 0) -> torch.Generator:
    """A CPU generator for ``(seed, stream)``: independent streams for weights, each micro-batch,
    and prefills, so adding a micro-batch does not change the weights."""
    return torch.Generator().manual_seed((seed * 1_000_003 + stream) % (2**63 - 1))


def make_state(config: ModuleConfig, seed: int) -> dict[str, torch.Tensor]:
    """Parameter values in the config's dtype on its device, keyed by parameter name."""
    g = generator(seed, 0)
    state = {}
    for spec in param_specs(config):
        v = torch.randn(spec.shape, generator=g, dtype=torch.float64)
        if spec.role == GEMM_WEIGHT:
            v = v / math.sqrt(spec.shape[1])
        elif spec.role == GEMM_BIAS:
            v = v * 0.5
        elif spec.name == "layer_norm_weight":
            v = v * 0.2 + (0.0 if config.zero_centered_gamma else 1.0)
        else:
            v = v * 0.2
        state[spec.name] = v.to(dtype=config.torch_dtype, device=config.device)
    return state


@dataclasses.dataclass
class MicroBatchData:
    """Input ``x`` (leading shape + in_features) and output gradient ``dy`` of one micro-batch."""

    x: torch.Tensor
    dy: torch.Tensor
    spec: MicroBatch

    def fresh_input(self) -> torch.Tensor:
        """A new leaf copy of ``x`` in its layout that requires grad (one per module run)."""
        return with_layout(self.x.detach(), self.spec.x_layout).requires_grad_(True)

    def fresh_dy(self) -> torch.Tensor:
        """A new copy of ``dy`` in the micro-batch's layout (its own storage)."""
        return with_layout(self.dy, self.spec.dy_layout)


def with_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A new tensor with ``t``'s values in ``layout`` (:data:`~.case.DY_LAYOUTS`), on
    storage of its own. The expanded layouts need values constant along the expanded
    dimensions (all of them, or the rows for ``"expanded_rows"``): the first element (row) is
    expanded; raises ``ValueError`` naming an unknown layout."""
    if layout not in DY_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {DY_LAYOUTS}")
    t = t.detach()
    if layout == "contiguous":
        return t.clone(memory_format=torch.contiguous_format)
    if layout == "transposed":
        # Dims 0 and 1 of the leading shape swapped in memory (a 2-D tensor: column-major).
        return t.transpose(0, 1).clone(memory_format=torch.contiguous_format).transpose(0, 1)
    if layout in ("sliced", "narrowed"):
        n = t.shape[-1]
        width = 2 * n if layout == "sliced" else n + 1
        big = torch.full((*t.shape[:-1], width), math.nan, dtype=t.dtype, device=t.device)
        view = big[..., ::2] if layout == "sliced" else big[..., :n]
        view.copy_(t)
        return view
    if layout == "expanded_rows":
        row = t.reshape(-1, t.shape[-1])[:1].clone() if t.numel() else t.new_zeros(1, t.shape[-1])
        return row.reshape((1,) * (t.dim() - 1) + (t.shape[-1],)).expand(t.shape)
    value = t.reshape(-1)[:1].clone() if t.numel() else t.new_zeros(1)
    return value.reshape((1,) * t.dim()).expand(t.shape)


def make_micro_batch(config: ModuleConfig, mb: MicroBatch, seed: int, index: int) -> MicroBatchData:
    """Values of micro-batch ``index``."""
    g = generator(seed, 1 + index)
    dt, dev = config.torch_dtype, config.device
    x = torch.randn((*mb.lead_shape, config.in_features), generator=g, dtype=torch.float64)
    dy = torch.randn((*mb.lead_shape, config.output_features), generator=g, dtype=torch.float64)
    if mb.dy_layout == "expanded":
        dy = torch.ones_like(dy)  # loss.sum()
    elif mb.dy_layout == "expanded_mean":
        dy = torch.full_like(dy, 1.0 / max(1, dy.numel()))  # loss.mean()
    # "expanded_rows" ((y * v).sum()): with_layout repeats the first row.
    if config.recipe is not None:
        # FP8: each micro-batch at its own magnitude (x and dy scaled by 2**-2 .. 2**3), so that
        # delayed scaling meets values beyond the last step's amax (saturation) and below it.
        s = torch.randint(-2, 4, (2,), generator=generator(seed, 5_000 + index))
        x, dy = x * 2.0 ** float(s[0]), dy * 2.0 ** float(s[1])
    x = with_layout(x.to(dtype=dt, device=dev), mb.x_layout)
    # Under torch.autocast the output, hence its gradient, is in the autocast dtype.
    dy = dy.to(dtype=config.compute_dtype, device=dev)
    return MicroBatchData(x, with_layout(dy, mb.dy_layout), mb)


def make_micro_batches(case: Case) -> list[MicroBatchData]:
    """Values of every micro-batch of ``case``."""
    return [
        make_micro_batch(case.config, mb, case.seed, i) for i, mb in enumerate(case.micro_batches)
    ]


def make_main_grads(config: ModuleConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random non-zero fp32 ``main_grad`` prefills for every GEMM weight: accumulation, not
    assignment, is what the checks then see."""
    g = generator(seed, 10_000)
    return {
        s.name: torch.randn(s.shape, generator=g, dtype=torch.float32).to(config.device)
        for s in param_specs(config)
        if s.role == GEMM_WEIGHT
    }


def make_grad_prefill(config: ModuleConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random ``.grad`` prefills for every parameter (checks ``+=`` rather than ``=``)."""
    g = generator(seed, 20_000)
    return {
        s.name: torch.randn(s.shape, generator=g, dtype=torch.float64)
        .to(config.torch_dtype)
        .to(config.device)
        for s in param_specs(config)
    }
