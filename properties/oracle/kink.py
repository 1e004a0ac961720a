"""The relu kink: pre-activations too close to 0 for any low-precision run to know relu'.

``relu'(h)`` jumps from 0 to 1 at ``h = 0``. When the float64 truth of an fc1 pre-activation of a
``LayerNormMLP(activation="relu")`` lies within rounding distance of 0, an implementation in
bf16/fp16/fp32 may compute it on either side (or exactly on 0) and so legally use either
derivative there, and that one choice moves ``inp.grad``, the norm-parameter gradients and fc1's
gradients by O(1). No budget built on rounding steps can absorb that, so the checks of P2 and P3
compare against *every* truth the ambiguous elements allow instead:

* :func:`kink_sites` finds the ambiguous elements: ``|h_true| <= bound`` with the rigorous bound
  of :func:`kink_bound` (float64, from :mod:`splitgrad.reference.functional`).
* Gradients are linear in each ``relu'`` value, so :func:`kink_deltas` computes, per site, what
  switching its derivative from 0 to 1 adds to every compared tensor (again with the reference's
  float64 formulas: the dgrad row through the norm backward, one row of fc1's weight gradient, one
  entry of its bias gradient).
* The checks accept the implementation if it is within budget of the truth for *some* choice of
  ``relu'`` on the sites (``2**k`` candidates, ``k <= KINK_MAX_ENUMERATED``); with more sites the
  example is rejected (:class:`CaseRejected`, a hypothesis rejection), so it is neither passed
  nor counted.

Under FP8 (:func:`has_fp8_relu_kink`) the band is an FP8 step of fc1's operands wide
(:func:`fp8_kink_bound`), about a quarter of the pre-activations lie in it, and the naive FP8
run flips ``relu'`` inside it as well, so its error (the FP8 budget's yardstick) already carries
flips of its own; what it cannot carry is a flip the implementation makes where the naive run
did not, in a tensor too small for the flips to even out. So the FP8 candidates are the truth,
then the truth with one site's ``relu'`` switched (each site in turn), then with two (when there
are at most :data:`~.budgets.FP8_KINK_PAIRS_UP_TO` sites); the first that passes is taken; the
naive yardstick stays measured against the truth itself; past
:data:`~.budgets.FP8_KINK_MAX_SITES` sites the example is judged against the truth alone
(nothing is rejected). docs/budgets.md has the derivation of both bands.

Everything else stays strict: away from the sites the candidates are the truth
itself, and one choice must hold for every compared tensor of the property at once.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

import torch
from hypothesis.errors import UnsatisfiedAssumption

from .. import budgets as B
from ..cases.case import Case
from .internals import float64_internals

__all__ = [
    "CaseRejected",
    "KinkSite",
    "has_relu_kink",
    "has_fp8_relu_kink",
    "kink_choices",
    "kink_sites",
    "kink_bound",
    "fp8_kink_bound",
    "site_at",
    "kink_deltas",
    "choices",
]

# A compared tensor: ("x", micro_batch_index) for inp.grad, or ("p", "fc1_weight.grad") etc.
TensorKey = tuple[str, int | str]


class CaseRejected(UnsatisfiedAssumption):
    """This example cannot be judged (hypothesis rejects it: neither a pass nor a failure)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def __str__(self) -> str:
        return self.reason


@dataclasses.dataclass(frozen=True)
class KinkSite:
    """One fc1 pre-activation within rounding distance of the kink: micro-batch, row (of the
    flattened input), fc1 output feature, its float64 truth, the bound, and ``d_act`` there (what
    ``relu' = 1`` passes through)."""

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


def has_relu_kink(case: Case) -> bool:
    """Whether ``case`` runs a relu MLP in high precision (every ``relu'`` choice on its sites is
    a candidate; FP8 runs: :func:`has_fp8_relu_kink`)."""
    c = case.config
    return c.kind == "LayerNormMLP" and c.activation == "relu" and c.recipe is None


def has_fp8_relu_kink(case: Case) -> bool:
    """Whether ``case`` runs a relu MLP under an FP8 recipe (one or two switched ``relu'`` per
    candidate: see the module docstring)."""
    c = case.config
    return c.kind == "LayerNormMLP" and c.activation == "relu" and c.recipe is not None


def kink_bound(
    ln_out: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Per fc1 pre-activation (N, F): how far from its float64 truth a correct ``dtype`` run may
    compute it, ``(steps * eps(dtype) + K * eps(fp32)) * (|ln_out| @ |W1|^T + |b1|)`` (float64
    operands; see :data:`~.budgets.KINK_ROUNDING_STEPS`)."""
    k = ln_out.shape[-1]
    scale = (
        B.KINK_ROUNDING_STEPS[dtype] * torch.finfo(dtype).eps + k * torch.finfo(torch.float32).eps
    )
    size = ln_out.abs() @ w1.abs().t()
    if b1 is not None:
        size = size + b1.abs()
    return scale * size


def fp8_kink_bound(
    recipe: str, ln_outs: list[torch.Tensor], w1: torch.Tensor, bounds: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Per micro-batch, the band of fc1 pre-activations (N, F) whose ``relu'`` an FP8 run under
    ``recipe`` may legally take on either side: the high-precision band ``bounds``
    (:func:`kink_bound`) plus :data:`~.budgets.ROUNDING_SIGMAS` root sums of squares of one FP8
    step per operand element, ``sqrt(step(ln_out)**2 @ (W1**2)^T + ln_out**2 @ step(W1)**2^T)``. A
    correct run's fc1 GEMM sees each operand element up to half a step from its value
    (quantization) and, where the module computes it (``ln_out``), possibly on the neighbouring
    FP8 value (a crossing: half a step more); the signs are independent (the rounding model of
    :mod:`.rounding`). The step's subnormal floor is taken at the largest scale the
    recipe can use: twice the amax-based one (block scales round to a power of two), and at
    least 1 for delayed scaling (its initial scale)."""
    from splitgrad.reference import fp8 as R
    from splitgrad.reference.fp8_quant import format_for

    from ..cases.case import make_recipe

    r = make_recipe(recipe)
    margin = getattr(r, "margin", 0)
    delayed = isinstance(r, R.DelayedScaling)

    def scale_inv(amax: float, role: str) -> float:
        s = 2.0 * amax * 2.0**margin / B.FP8_MAX[format_for(r, role)]
        return max(s, 1.0) if delayed else s

    nonempty = [x for x in ln_outs if x.numel()]
    amax_ln = max((float(x.abs().max()) for x in nonempty), default=0.0)
    w_step = B.fp8_step(w1, format_for(r, "weight"), scale_inv(float(w1.abs().max()), "weight"))
    out = []
    for ln, hp in zip(ln_outs, bounds):
        if ln.numel() == 0:
            out.append(hp)
            continue
        ln_step = B.fp8_step(ln, format_for(r, "input"), scale_inv(amax_ln, "input"))
        rss = (ln_step**2 @ (w1**2).t() + ln**2 @ (w_step**2).t()).sqrt()
        out.append(hp + B.ROUNDING_SIGMAS * rss)
    return out


@dataclasses.dataclass
class _Forward:
    """The float64 pieces of one micro-batch that the sites and deltas need."""

    x: torch.Tensor  # (N, K)
    ln_out: torch.Tensor
    stats: tuple[torch.Tensor, ...]
    h: torch.Tensor  # fc1 pre-activation (N, F)
    d_act: torch.Tensor  # dy @ W2 (N, F)
    bound: torch.Tensor


def _forwards(case: Case) -> tuple[dict[str, torch.Tensor], list[_Forward]]:
    state, mbs = float64_internals(case)
    w1, b1 = state["fc1_weight"], state.get("fc1_bias")
    dtype = case.config.compute_dtype
    bounds = [kink_bound(m.ln_out, w1, b1, dtype) for m in mbs]
    if case.config.recipe is not None:
        bounds = fp8_kink_bound(case.config.recipe, [m.ln_out for m in mbs], w1, bounds)
    return state, [
        _Forward(m.x, m.ln_out, m.stats, m.h, m.d_act, bound) for m, bound in zip(mbs, bounds)
    ]


def kink_sites(case: Case) -> list[KinkSite]:
    """The ambiguous pre-activations of ``case`` (empty unless :func:`has_relu_kink` or
    :func:`has_fp8_relu_kink`)."""
    if not (has_relu_kink(case) or has_fp8_relu_kink(case)):
        return []
    _, fwds = _forwards(case)
    sites = []
    for i, f in enumerate(fwds):
        for r, j in (f.h.abs() <= f.bound).nonzero().tolist():
            sites.append(
                KinkSite(i, r, j, float(f.h[r, j]), float(f.bound[r, j]), float(f.d_act[r, j]))
            )
    return sites


def site_at(case: Case, micro_batch: int, row: int, feature: int) -> KinkSite:
    """The pre-activation at ``(micro_batch, row, feature)`` as a :class:`KinkSite`, ambiguous or
    not (tests flip any element with it)."""
    _, fwds = _forwards(case)
    f = fwds[micro_batch]
    return KinkSite(
        micro_batch,
        row,
        feature,
        float(f.h[row, feature]),
        float(f.bound[row, feature]),
        float(f.d_act[row, feature]),
    )


def kink_deltas(case: Case, sites: list[KinkSite]) -> list[dict[TensorKey, torch.Tensor]]:
    """For each site, what switching its ``relu'`` from 0 to 1 adds to each compared tensor
    (float64; keys as :data:`TensorKey`, parameter keys as in the harness's snapshots)."""
    from splitgrad.reference import functional as F

    c = case.config
    state, fwds = _forwards(case)
    w1 = state["fc1_weight"]
    fused = c.fuse_wgrad_accumulation
    w1_key = "fc1_weight.main_grad" if fused else "fc1_weight.grad"
    flags = [mb.is_first_microbatch for mb in case.micro_batches]
    out = []
    for s in sites:
        f = fwds[s.micro_batch]
        rows = f.x.shape[0]
        # d_fc1 gains d_act at (row, feature): d_ln_out gains d_act * W1[feature] on that row.
        d_ln = torch.zeros(rows, c.in_features, dtype=torch.float64)
        d_ln[s.row] = s.d_act * w1[s.feature]
        if c.normalization == "LayerNorm":
            mean, rstd = f.stats
            dx, dgamma, dbeta = F.layer_norm_bwd(
                d_ln, f.x, state["layer_norm_weight"], mean, rstd, c.zero_centered_gamma
            )
        else:
            (rstd,) = f.stats
            dx, dgamma = F.rms_norm_bwd(
                d_ln, f.x, state["layer_norm_weight"], rstd, c.zero_centered_gamma
            )
            dbeta = None
        lead = case.micro_batches[s.micro_batch].lead_shape
        delta: dict[TensorKey, torch.Tensor] = {
            ("x", s.micro_batch): dx.reshape(*lead, c.in_features),
            ("p", "layer_norm_weight.grad"): dgamma,
        }
        if dbeta is not None:
            delta[("p", "layer_norm_bias.grad")] = dbeta
        # A later micro-batch flagged is_first_microbatch overwrites main_grad (SPEC §3).
        overwritten = fused and any(flags[s.micro_batch + 1 :])
        dw1 = torch.zeros_like(w1)
        if not overwritten:
            dw1[s.feature] = s.d_act * f.ln_out[s.row]
        delta[("p", w1_key)] = dw1
        if c.bias:
            db1 = torch.zeros(w1.shape[0], dtype=torch.float64)
            db1[s.feature] = s.d_act
            delta[("p", "fc1_bias.grad")] = db1
        out.append(delta)
    return out


def choices(sites: list[KinkSite]) -> Iterator[tuple[int, ...]]:
    """Every ``relu'`` assignment of the sites, the truth's own first."""
    own = tuple(s.truth_slope for s in sites)
    yield own
    for c in itertools.product((0, 1), repeat=len(sites)):
        if c != own:
            yield c


def switched(sites: list[KinkSite], most: int) -> Iterator[tuple[int, ...]]:
    """The truth's own ``relu'`` assignment, then every one that switches one site, then (with
    ``most >= 2``) every one that switches two."""
    own = tuple(s.truth_slope for s in sites)
    yield own
    for k in range(1, most + 1):
        for picked in itertools.combinations(range(len(sites)), k):
            yield tuple(1 - v if i in picked else v for i, v in enumerate(own))


def kink_choices(case: Case, sites: list[KinkSite]) -> list[tuple[int, ...]]:
    """The ``relu'`` assignments of ``sites`` that ``case`` is judged against, the truth's own
    first (a single one: judge against the truth alone). High precision: all of them, and
    :class:`CaseRejected` past :data:`~.budgets.KINK_MAX_ENUMERATED` sites. FP8: one or two
    switched sites (:func:`switched`), and the truth alone past
    :data:`~.budgets.FP8_KINK_MAX_SITES` sites (the module docstring says why)."""
    if not sites:
        return [()]
    if case.config.recipe is None:
        if len(sites) > B.KINK_MAX_ENUMERATED:
            raise CaseRejected(
                f"{len(sites)} relu pre-activations lie within rounding distance of 0 (more "
                f"than KINK_MAX_ENUMERATED={B.KINK_MAX_ENUMERATED}): the example cannot be "
                "judged"
            )
        return list(choices(sites))
    if len(sites) > B.FP8_KINK_MAX_SITES:
        return [tuple(s.truth_slope for s in sites)]
    most = 2 if len(sites) <= B.FP8_KINK_PAIRS_UP_TO else 1
    return list(switched(sites, most))
