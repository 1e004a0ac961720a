"""The float64 intermediates of a case (the reference's formulas on the case's values, as in
the truth run), and the operand allowances built from them (docs/budgets.md derives them).
"""

from __future__ import annotations

import dataclasses
import itertools

import torch

from .. import budgets as B
from ..cases.case import Case
from ..cases.data import make_micro_batches, make_state

NORM_EPS = 1e-5  # the modules' default norm epsilon (ModuleConfig has no eps)


@dataclasses.dataclass
class MicroBatchInternals:
    """One micro-batch, flattened to rows: ``ln_out``/``stats`` for norm modules; ``h``, ``act``,
    ``d_act = dy @ W2`` and ``d_fc1`` (the gradient at ``h``) for ``LayerNormMLP``."""

    x: torch.Tensor
    dy: torch.Tensor
    ln_out: torch.Tensor | None = None
    stats: tuple[torch.Tensor, ...] = ()
    h: torch.Tensor | None = None
    act: torch.Tensor | None = None
    d_act: torch.Tensor | None = None
    d_fc1: torch.Tensor | None = None


def float64_internals(case: Case) -> tuple[dict[str, torch.Tensor], list[MicroBatchInternals]]:
    """(float64 parameter values, per-micro-batch intermediates) of ``case`` (high precision:
    the intermediates of an FP8 run are not these)."""
    from splitgrad.reference import functional as F

    c = case.config
    state = {k: v.detach().double().cpu() for k, v in make_state(c, case.seed).items()}
    out = []
    for d in make_micro_batches(case):
        m = MicroBatchInternals(
            d.x.detach().double().cpu().reshape(-1, c.in_features),
            d.dy.detach().double().cpu().reshape(-1, c.output_features),
        )
        if c.has_norm:
            gamma, zero_centered = state["layer_norm_weight"], c.zero_centered_gamma
            if c.normalization == "LayerNorm":
                beta = state["layer_norm_bias"]
                m.ln_out, *stats = F.layer_norm_fwd(m.x, gamma, beta, NORM_EPS, zero_centered)
            else:
                m.ln_out, *stats = F.rms_norm_fwd(m.x, gamma, NORM_EPS, zero_centered)
            m.stats = tuple(stats)
        if c.kind == "LayerNormMLP":
            m.h = F.linear_fwd(m.ln_out, state["fc1_weight"], state.get("fc1_bias"))
            m.act = F.activation_fwd(m.h, c.activation)
            m.d_act = F.linear_dgrad(m.dy, state["fc2_weight"])
            m.d_fc1 = F.activation_bwd(m.d_act, m.h, c.activation)
        out.append(m)
    return state, out


def wgrad_operand_floors(case: Case) -> dict[str, torch.Tensor]:
    """Per-element allowance (:data:`~.budgets.WGRAD_OPERAND_STEPS`) for ``main_grad`` of a
    weight whose GEMM operands the module computes, by snapshot key (else empty)."""
    c = case.config
    if not c.has_norm or c.recipe is not None or not c.fuse_wgrad_accumulation:
        return {}
    _, mbs = float64_internals(case)
    steps = B.WGRAD_OPERAND_STEPS * torch.finfo(c.torch_dtype).eps
    # Contributions before the last is_first_microbatch=True are overwritten (SPEC §3).
    flags = [mb.is_first_microbatch for mb in case.micro_batches]
    kept = mbs[max((i for i, f in enumerate(flags) if f), default=0) :]
    # (weight, dy-side operand, x-side operand, how many of the two the module computes)
    if c.kind == "LayerNormLinear":
        gemms = [("weight", lambda m: m.dy, lambda m: m.ln_out, 1)]
    else:
        gemms = [
            ("fc2_weight", lambda m: m.dy, lambda m: m.act, 1),
            ("fc1_weight", lambda m: m.d_fc1, lambda m: m.ln_out, 2),
        ]
    return {
        f"{name}.main_grad": computed
        * steps
        * sum((dy_of(m).abs().t() @ x_of(m).abs() for m in kept), torch.zeros(()))
        for name, dy_of, x_of, computed in gemms
    }


def norm_projection(xhat: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    """Per row, ``P = I - (11^T + xhat xhat^T) / K`` (LayerNorm) or ``I - xhat xhat^T / K``
    (RMSNorm): ``dx = rstd P (gamma * d_ln)`` and ``d xhat = rstd P dx``."""
    k = xhat.shape[-1]
    outer = xhat[:, :, None] * xhat[:, None, :]
    if layer_norm:
        outer = outer + 1.0
    return torch.eye(k, dtype=torch.float64) - outer / k


def _d_fc1_moves(m: MicroBatchInternals, dh: torch.Tensor, activation: str) -> torch.Tensor:
    """How far ``d_fc1`` moves, per element, when each pre-activation moves by up to ``dh``
    (the reference's activation backward at every sign, a gated one's halves independently)."""
    from splitgrad.reference import functional as F

    moved = torch.zeros_like(m.d_fc1)
    half = m.h.shape[-1] // 2 if activation in ("swiglu", "geglu") else m.h.shape[-1]
    for sa, sb in itertools.product((-1.0, 1.0), repeat=2):
        shift = torch.cat([sa * dh[:, :half], sb * dh[:, half:]], dim=-1)
        alt = F.activation_bwd(m.d_act, m.h + shift, activation)
        moved = torch.maximum(moved, (alt - m.d_fc1).abs())
    return moved


def dgrad_operand_floors(case: Case) -> dict[str, torch.Tensor]:
    """Per-element allowance (:data:`~.budgets.DGRAD_OPERAND_STEPS`) for ``LayerNormMLP``'s
    input and norm-parameter gradients under a smooth activation in high precision (else empty)."""
    c = case.config
    if c.kind != "LayerNormMLP" or c.activation == "relu" or c.recipe is not None:
        return {}
    state, mbs = float64_internals(case)
    w1, b1 = state["fc1_weight"], state.get("fc1_bias")
    gamma = state["layer_norm_weight"] + (1.0 if c.zero_centered_gamma else 0.0)
    eps = B.DGRAD_OPERAND_STEPS * torch.finfo(c.torch_dtype).eps
    floors: dict[str, torch.Tensor] = {}
    d_gamma_sq = torch.zeros_like(gamma)
    d_beta_sq = torch.zeros_like(gamma)
    layer_norm = c.normalization == "LayerNorm"
    for i, m in enumerate(mbs):
        # A correct run's saved h may round GEMM + bias once where the reference rounds twice.
        dh = eps * (1.5 * m.h.abs() + (0.5 * b1.abs() if b1 is not None else 0.0))
        moved = _d_fc1_moves(m, dh, c.activation)
        # dx = rstd P diag(gamma) W1^T d_fc1, exactly; the moves add as a root sum of squares.
        rstd = m.stats[-1]
        xhat = (m.x - m.stats[0]) * rstd if layer_norm else m.x * rstd
        proj = norm_projection(xhat, layer_norm)
        jac = (rstd[:, :, None] * proj * gamma[None, None, :]) @ w1.t()  # (N, K, F)
        dx = B.DGRAD_OPERAND_SIGMAS * ((jac * moved[:, None, :]) ** 2).sum(-1).sqrt()
        # d gamma_k = sum_n xhat_nk sum_f W1_fk d_fc1_nf, d beta_k = sum_n sum_f W1_fk d_fc1_nf.
        sq = (moved**2) @ (w1**2)  # (N, K): sum_f (W1_fk u_nf)^2
        d_gamma_sq = d_gamma_sq + (sq * xhat**2).sum(0)
        d_beta_sq = d_beta_sq + sq.sum(0)
        lead = case.micro_batches[i].lead_shape
        floors[f"inp.grad[micro-batch {i}]"] = dx.reshape(*lead, c.in_features)
    floors["layer_norm_weight.grad"] = B.DGRAD_OPERAND_SIGMAS * d_gamma_sq.sqrt()
    if layer_norm:
        floors["layer_norm_bias.grad"] = B.DGRAD_OPERAND_SIGMAS * d_beta_sq.sqrt()
    return floors
