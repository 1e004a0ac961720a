"""The relu kink: fc1 pre-activations of a relu ``LayerNormMLP`` within rounding distance of 0
(:func:`kink_sites`), where a correct run may take either ``relu'``. :func:`kink_deltas` gives
what switching a site adds to every compared tensor, and the checks accept a result within
budget of the truth for some choice (:func:`kink_choices`); docs/budgets.md derives the bands.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from hypothesis.errors import UnsatisfiedAssumption

from .. import budgets as B
from ..cases.case import Case, make_recipe
from .internals import MicroBatchInternals, float64_internals

# A compared tensor: ("x", micro_batch_index) for inp.grad, or ("p", "fc1_weight.grad") etc.
TensorKey = tuple[str, int | str]


class CaseRejected(UnsatisfiedAssumption):
    """This example cannot be judged (hypothesis rejects it: neither a pass nor a failure)."""


@dataclasses.dataclass(frozen=True)
class KinkSite:
    """One fc1 pre-activation within rounding distance of the kink (row of the flattened input),
    its float64 truth, the bound, and ``d_act`` (what ``relu' = 1`` passes)."""

    micro_batch: int
    row: int
    feature: int
    h: float
    bound: float
    d_act: float

    @property
    def truth_slope(self) -> int:
        """relu' of the float64 truth (0 at exactly 0, as the reference)."""
        return 1 if self.h > 0 else 0


def _relu_mlp(case: Case) -> bool:
    return case.config.kind == "LayerNormMLP" and case.config.activation == "relu"


def has_relu_kink(case: Case) -> bool:
    """Whether ``case`` runs a relu MLP in high precision (every ``relu'`` choice a candidate)."""
    return _relu_mlp(case) and case.config.recipe is None


def kink_bound(
    ln_out: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Per fc1 pre-activation (N, F): how far from its float64 truth a correct ``dtype`` run may
    compute it, ``(steps * eps(dtype) + K * eps(fp32)) * (|ln_out| @ |W1|^T + |b1|)``."""
    k, eps32 = ln_out.shape[-1], torch.finfo(torch.float32).eps
    scale = B.KINK_ROUNDING_STEPS[dtype] * torch.finfo(dtype).eps + k * eps32
    size = ln_out.abs() @ w1.abs().t()
    if b1 is not None:
        size = size + b1.abs()
    return scale * size


def fp8_kink_bound(
    recipe: str, ln_outs: list[torch.Tensor], w1: torch.Tensor, bounds: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Per micro-batch, the band of fc1 pre-activations (N, F) whose ``relu'`` an FP8 run under
    ``recipe`` may take on either side: the high-precision ``bounds`` plus
    :data:`~.budgets.ROUNDING_SIGMAS` root sums of squares of one FP8 step per operand element,
    at the largest scale the recipe can use (docs/budgets.md)."""
    from splitgrad.reference import fp8 as R
    from splitgrad.reference.fp8_quant import format_for

    r = make_recipe(recipe)
    margin = getattr(r, "margin", 0)
    delayed = isinstance(r, R.DelayedScaling)

    def scale_inv(amax: float, role: str) -> float:
        s = 2.0 * amax * 2.0**margin / B.FP8_MAX[format_for(r, role)]
        return max(s, 1.0) if delayed else s

    amax_ln = max((float(x.abs().max()) for x in ln_outs if x.numel()), default=0.0)
    w_step = B.fp8_step(w1, format_for(r, "weight"), scale_inv(float(w1.abs().max()), "weight"))
    out = []
    for ln, hp in zip(ln_outs, bounds):
        if ln.numel():
            ln_step = B.fp8_step(ln, format_for(r, "input"), scale_inv(amax_ln, "input"))
            rss = (ln_step**2 @ (w1**2).t() + ln**2 @ (w_step**2).t()).sqrt()
            hp = hp + B.ROUNDING_SIGMAS * rss
        out.append(hp)
    return out


def _forwards(case: Case) -> tuple[dict, list[MicroBatchInternals], list[torch.Tensor]]:
    """float64 parameters, and each micro-batch's intermediates and band of ambiguous ``h``."""
    state, mbs = float64_internals(case)
    w1, b1 = state["fc1_weight"], state.get("fc1_bias")
    bounds = [kink_bound(m.ln_out, w1, b1, case.config.compute_dtype) for m in mbs]
    if case.config.recipe is not None:
        bounds = fp8_kink_bound(case.config.recipe, [m.ln_out for m in mbs], w1, bounds)
    return state, mbs, bounds


def _site(i: int, row: int, feature: int, m: MicroBatchInternals, bound: torch.Tensor) -> KinkSite:
    at = (row, feature)
    return KinkSite(i, row, feature, float(m.h[at]), float(bound[at]), float(m.d_act[at]))


def kink_sites(case: Case) -> list[KinkSite]:
    """The ambiguous pre-activations of a relu ``LayerNormMLP`` ``case`` (else none)."""
    if not _relu_mlp(case):
        return []
    _, mbs, bounds = _forwards(case)
    return [
        _site(i, r, j, m, bound)
        for i, (m, bound) in enumerate(zip(mbs, bounds))
        for r, j in (m.h.abs() <= bound).nonzero().tolist()
    ]


def site_at(case: Case, micro_batch: int, row: int, feature: int) -> KinkSite:
    """The pre-activation at ``(micro_batch, row, feature)`` as a :class:`KinkSite`, ambiguous or
    not (tests flip any element with it)."""
    _, mbs, bounds = _forwards(case)
    return _site(micro_batch, row, feature, mbs[micro_batch], bounds[micro_batch])


def kink_deltas(case: Case, sites: list[KinkSite]) -> list[dict[TensorKey, torch.Tensor]]:
    """For each site, what switching its ``relu'`` from 0 to 1 adds to each compared tensor
    (float64; keys as :data:`TensorKey`, parameter keys as in the harness's snapshots)."""
    from splitgrad.reference import functional as F

    c = case.config
    state, fwds, _ = _forwards(case)
    w1, gamma = state["fc1_weight"], state["layer_norm_weight"]
    fused, zero_centered = c.fuse_wgrad_accumulation, c.zero_centered_gamma
    w1_key = "fc1_weight.main_grad" if fused else "fc1_weight.grad"
    flags = [mb.is_first_microbatch for mb in case.micro_batches]
    out = []
    for s in sites:
        f = fwds[s.micro_batch]
        # d_fc1 gains d_act at (row, feature): d_ln_out gains d_act * W1[feature] on that row.
        d_ln = torch.zeros_like(f.x)
        d_ln[s.row] = s.d_act * w1[s.feature]
        if c.normalization == "LayerNorm":
            dx, dgamma, dbeta = F.layer_norm_bwd(d_ln, f.x, gamma, *f.stats, zero_centered)
        else:
            (dx, dgamma), dbeta = F.rms_norm_bwd(d_ln, f.x, gamma, *f.stats, zero_centered), None
        lead = case.micro_batches[s.micro_batch].lead_shape
        delta: dict[TensorKey, torch.Tensor] = {
            ("x", s.micro_batch): dx.reshape(*lead, c.in_features),
            ("p", "layer_norm_weight.grad"): dgamma,
        }
        if dbeta is not None:
            delta[("p", "layer_norm_bias.grad")] = dbeta
        dw1 = torch.zeros_like(w1)
        # A later micro-batch flagged is_first_microbatch overwrites main_grad (SPEC §3).
        if not (fused and any(flags[s.micro_batch + 1 :])):
            dw1[s.feature] = s.d_act * f.ln_out[s.row]
        delta[("p", w1_key)] = dw1
        if c.bias:
            db1 = torch.zeros(w1.shape[0], dtype=torch.float64)
            db1[s.feature] = s.d_act
            delta[("p", "fc1_bias.grad")] = db1
        out.append(delta)
    return out


def kink_choices(case: Case, sites: list[KinkSite]) -> list[tuple[int, ...]]:
    """The ``relu'`` assignments of ``sites`` that ``case`` is judged against, the truth's own
    first: all of them in high precision (:class:`CaseRejected` past
    :data:`~.budgets.KINK_MAX_ENUMERATED` sites); under FP8 one or two switched sites, and the
    truth alone past :data:`~.budgets.FP8_KINK_MAX_SITES` sites."""
    own = tuple(s.truth_slope for s in sites)
    if case.config.recipe is None:
        if len(sites) > B.KINK_MAX_ENUMERATED:
            raise CaseRejected(
                f"{len(sites)} relu pre-activations lie within rounding distance of 0 (more "
                f"than KINK_MAX_ENUMERATED={B.KINK_MAX_ENUMERATED}): the example cannot be "
                "judged"
            )
        return [own] + [c for c in itertools.product((0, 1), repeat=len(sites)) if c != own]
    if len(sites) > B.FP8_KINK_MAX_SITES:
        return [own]
    most = 2 if len(sites) <= B.FP8_KINK_PAIRS_UP_TO else 1
    picks = [p for k in range(1, most + 1) for p in itertools.combinations(range(len(sites)), k)]
    return [own] + [tuple(1 - v if i in p else v for i, v in enumerate(own)) for p in picks]
