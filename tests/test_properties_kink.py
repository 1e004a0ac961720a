"""The relu kink (``oracle/kink.py``): the candidate truths are right, a legal relu' choice at
an ambiguous pre-activation passes, and a real relu bug still fails."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from splitgrad.properties import budgets as B
from splitgrad.properties.backends import LibraryBackend, get_backend
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig
from splitgrad.properties.checks.accuracy import check_p2, check_p3
from splitgrad.properties.front.campaign import PASS, run_cell
from splitgrad.properties.oracle.kink import (
    CaseRejected,
    KinkSite,
    kink_choices,
    kink_deltas,
    kink_sites,
    site_at,
)
from splitgrad.reference import functional as F
from test_properties_pinned import P3_FP8_RELU_KINK, RELU_KINK

# One bf16 relu MLP with exactly one fc1 pre-activation within rounding distance of 0
# (h = -0.00154, bound 0.056); the reference computes it as exactly 0.0.
KINK_CASE = RELU_KINK


class ReluGradPatched(LibraryBackend):
    """The reference, except that its backward uses ``relu_grad`` for relu' (a test double for an
    implementation that decides relu' differently)."""

    def __init__(self, relu_grad: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__("reference-relu-patched", "splitgrad.reference")
        self.relu_grad = relu_grad

    def backward(self, module, outputs, grads) -> None:
        saved = F._ELEMENTWISE["relu"]
        F._ELEMENTWISE["relu"] = (F.relu, self.relu_grad)
        try:
            super().backward(module, outputs, grads)
        finally:
            F._ELEMENTWISE["relu"] = saved


def _flip_at(rows_features: list[tuple[int, int]]) -> Callable[[torch.Tensor], torch.Tensor]:
    def grad(a: torch.Tensor) -> torch.Tensor:
        g = (a > 0).to(a.dtype)
        for r, f in rows_features:
            g[r, f] = 1 - g[r, f]
        return g

    return grad


def test_the_kink_case_has_one_site_that_the_reference_rounds_onto_zero() -> None:
    (site,) = kink_sites(KINK_CASE)
    assert (site.micro_batch, site.row, site.feature) == (0, 1, 1)
    assert -0.0016 < site.h < -0.0015 and site.truth_slope == 0
    assert site.bound == pytest.approx(0.0563, rel=1e-2)


def _truth_of(backend, case: Case):
    """The float64 run of ``backend`` on the case's values (rounded to its dtype), as the
    harness's truth is made: an upcast copy of a reference module in the case's dtype."""
    from splitgrad.properties.cases.data import make_micro_batches
    from splitgrad.properties.checks.runner import ModuleRun, fb_steps, play
    from splitgrad.properties.oracle.truth import float64_twin

    low = ModuleRun(get_backend("reference"), case, delay=False, hooks=0)
    run = float64_twin(backend, case, low)
    return play(run, make_micro_batches(case), fb_steps(len(case.micro_batches)), torch.float64)


@pytest.mark.parametrize(
    "config, where",
    [
        ({}, (1, 1)),
        ({}, (3, 2)),
        ({"normalization": "RMSNorm", "fuse_wgrad_accumulation": True}, (2, 0)),
        ({"bias": False, "zero_centered_gamma": False}, (0, 1)),
    ],
    ids=["site", "positive-h", "rmsnorm-fused", "nobias"],
)
def test_deltas_equal_a_float64_reference_with_that_relu_flipped(config: dict, where) -> None:
    """A site's delta is exactly what a float64 reference module whose relu' is flipped at that
    element changes in every compared gradient (brute force through the real module, 1e-12)."""
    case = dataclasses.replace(KINK_CASE, config=dataclasses.replace(KINK_CASE.config, **config))
    site = site_at(case, 0, *where)
    (delta,) = kink_deltas(case, [site])
    truth = _truth_of(get_backend("reference"), case)
    flipped = _truth_of(ReluGradPatched(_flip_at([where])), case)
    sign = 1 - 2 * site.truth_slope  # flipping 0 -> 1 adds the delta, 1 -> 0 subtracts it
    compared = 0
    for (kind, key), d in delta.items():
        if kind == "x":
            base, new = truth.xgrads[key], flipped.xgrads[key]
        else:
            base = {**truth.norm, **truth.gemm}[key]
            new = {**flipped.norm, **flipped.gemm}[key]
        torch.testing.assert_close(new - base, sign * d, rtol=0, atol=1e-12)
        compared += 1
    assert compared >= 3 and float(delta[("x", 0)].abs().max()) > 0.01


def test_a_legal_relu_choice_at_the_site_passes_where_the_truth_alone_fails(monkeypatch) -> None:
    """The reference with relu' = 1 at the ambiguous element (the other legal choice): judged
    against the float64 truth alone it fails P2 and P3 by far; against the candidate truths it
    passes."""
    (site,) = kink_sites(KINK_CASE)
    assert _flip_passes_only_with_candidates(monkeypatch, KINK_CASE, (site.row, site.feature)) > 10


def _flip_passes_only_with_candidates(monkeypatch, case: Case, where: tuple[int, int]) -> float:
    """The reference with relu' flipped at ``where`` passes P2 and P3 against the candidate
    truths; returns its P2 ratio judged against the truth alone (which must fail)."""
    other = ReluGradPatched(_flip_at([where]))
    assert check_p2(other, case).ratio <= 1.0
    assert check_p3(other, case).ratio <= 1.0
    import splitgrad.properties.checks.accuracy as checks

    monkeypatch.setattr(checks, "kink_sites", lambda case: [])
    with pytest.raises(B.BudgetViolation) as info:
        check_p2(other, case)
    return info.value.ratio


@pytest.mark.parametrize("check", [check_p2, check_p3], ids=["P2", "P3"])
def test_a_real_relu_bug_still_fails(check) -> None:
    """Meta (soundness): relu' = [h > -0.65] also flips the element at h = -0.62 (eleven times
    its bound away from 0) and fails although the case has an ambiguous site; so does flipping
    that element together with the legal flip at the site."""
    shifted = ReluGradPatched(lambda a: (a > -0.65).to(a.dtype))
    with pytest.raises(B.BudgetViolation, match="relu kink: 1 fc1 pre-activation"):
        check(shifted, KINK_CASE)
    (site,) = kink_sites(KINK_CASE)
    both = ReluGradPatched(_flip_at([(site.row, site.feature), (1, 0)]))
    with pytest.raises(B.BudgetViolation):
        check(both, KINK_CASE)


def test_a_slightly_wrong_gradient_is_not_hidden_by_the_candidates() -> None:
    """Meta: a 3% error on every fc1 gradient still fails P3 on the kink case."""

    class Skewed(LibraryBackend):
        def backward(self, module, outputs, grads) -> None:
            super().backward(module, outputs, grads)
            with torch.no_grad():
                for name in ("fc1_weight", "fc1_bias"):
                    g = getattr(module, name).grad
                    if g is not None:
                        g.mul_(1.03)

    with pytest.raises(B.BudgetViolation, match="fc1_"):
        check_p3(Skewed("reference-skewed", "splitgrad.reference"), KINK_CASE)


def test_too_many_sites_reject_the_example_and_are_not_counted() -> None:
    many = Case(
        ModuleConfig("LayerNormMLP", 8, 16, activation="relu", dtype="bfloat16"),
        (MicroBatch((12,)),),
        3,
    )
    assert len(kink_sites(many)) > B.KINK_MAX_ENUMERATED
    with pytest.raises(CaseRejected, match="cannot be judged"):
        check_p2(get_backend("reference"), many)
    # High precision has no such sites (FP8 does not reject: see test_fp8_kink_choices_counts).
    fp32 = dataclasses.replace(many, config=dataclasses.replace(many.config, dtype="float32"))
    assert len(kink_sites(fp32)) <= B.KINK_MAX_ENUMERATED


def test_campaign_counts_rejections_apart(monkeypatch) -> None:
    """A rejected example is neither a pass nor a failure: the cell still runs its full number
    of judged examples and reports the rejections separately."""
    import splitgrad.properties.checks.accuracy as checks

    fake = site_at(KINK_CASE, 0, 0, 0)
    real = checks.kink_sites
    monkeypatch.setattr(
        checks, "kink_sites", lambda case: [fake] * 4 if case.seed % 2 else real(case)
    )
    cell = run_cell(get_backend("reference"), "P2", "Linear", "bfloat16", examples=12)
    # The cell's explicit boundary cases come on top of the 12 drawn (registry.explicit_cases).
    assert cell.status == PASS and cell.examples >= 12 and cell.rejected > 0


# ---- the kink under FP8 ---------------------------------------------------------------------

# Found by the nightly on impl: a 2-token RMSNorm relu MLP under delayed scaling whose fc1
# pre-activations (0,0) at 0.31, (1,0) at -0.114 and (1,1) at -0.0071 lie inside the FP8 kink band
# (bounds 0.32, 0.24, 0.46: a quantization step of ln_out and fc1_weight, not a bf16 rounding),
# and (1,3) at -0.55 lies outside it.
FP8_KINK_CASE = P3_FP8_RELU_KINK  # the pinned case (tests/test_properties_pinned.py)


def test_fp8_band_is_a_quantization_step_wide() -> None:
    """Under FP8 the band is a quantization step of fc1's operands wide: three sites, where the
    same case in plain bf16 has one; (1,3) is outside both."""
    sites = {(s.row, s.feature): s for s in kink_sites(FP8_KINK_CASE)}
    assert set(sites) == {(0, 0), (1, 0), (1, 1)}
    s = sites[(1, 1)]
    assert -0.0072 < s.h < -0.007 and s.truth_slope == 0
    assert sites[(0, 0)].truth_slope == 1 and 0.31 < sites[(0, 0)].h < sites[(0, 0)].bound
    hp = dataclasses.replace(
        FP8_KINK_CASE, config=dataclasses.replace(FP8_KINK_CASE.config, recipe=None)
    )
    assert [(t.row, t.feature) for t in kink_sites(hp)] == [(1, 1)]
    assert s.bound > 4 * site_at(hp, 0, 1, 1).bound


def test_fp8_a_switched_band_site_passes_where_the_truth_alone_fails(monkeypatch) -> None:
    """The FP8 reference with relu' = 1 at (1,1) (h = -0.0071, inside the band): passes P2 and
    P3 against the candidates; judged against the truth alone it fails P2 (1.31x)."""
    assert _flip_passes_only_with_candidates(monkeypatch, FP8_KINK_CASE, (1, 1)) > 1.2


def test_fp8_a_flip_outside_the_band_still_fails() -> None:
    """Meta (soundness): relu' flipped at (1,3), h = -0.55, outside the band: P3 fails (1.39x)
    although the case has band sites whose switches the judge tries."""
    wrong = ReluGradPatched(_flip_at([(1, 3)]))
    with pytest.raises(B.BudgetViolation) as info:
        check_p3(wrong, FP8_KINK_CASE)
    assert info.value.ratio > 1.2


def test_fp8_naive_yardstick_is_measured_against_the_unswitched_truth() -> None:
    """A candidate truth with one relu' switched moves one element by O(1); the naive run (which
    made the truth's choice) is not that far from the truth, and its error must not be measured
    against the candidate: that would let any error up to the switch's size pass."""
    g = torch.Generator().manual_seed(1)
    truth = torch.randn(32, 32, generator=g, dtype=torch.float64)
    naive = truth + torch.randn(32, 32, generator=g, dtype=torch.float64) * 0.01
    candidate = truth.clone()
    candidate[2, 3] += 5.0
    legal = candidate + (naive - truth)
    wrong = legal.clone()
    wrong[5, 5] += 1.0  # 25x the naive run's largest error
    args = (B.FP8, torch.bfloat16)
    assert B.check_fp8_budget("g", legal, candidate, naive, *args, naive_truth=truth) <= 1.0
    # Measured against the candidate, the naive error is 5: the wrong element hides under it.
    assert B.check_fp8_budget("g", wrong, candidate, naive, *args) <= 1.0
    with pytest.raises(B.BudgetViolation, match=r"\(5, 5\)"):
        B.check_fp8_budget("g", wrong, candidate, naive, *args, naive_truth=truth)
    with pytest.raises(B.BudgetViolation, match="naive run's truth has shape"):
        B.check_fp8_budget("g", legal, candidate, naive, *args, naive_truth=truth[:2])


def _sites(slopes: list[int]) -> list[KinkSite]:
    return [KinkSite(0, i, 0, 0.01 if v else -0.01, 0.1, 1.0) for i, v in enumerate(slopes)]


def test_fp8_kink_choices_counts() -> None:
    """FP8: the truth's own choice first, then every single switch, then every pair (up to
    FP8_KINK_PAIRS_UP_TO sites), singles only beyond, the truth alone past FP8_KINK_MAX_SITES;
    never a rejection. High precision: every assignment, rejected past KINK_MAX_ENUMERATED."""
    fp8 = FP8_KINK_CASE
    hp = dataclasses.replace(fp8, config=dataclasses.replace(fp8.config, recipe=None))
    assert kink_choices(fp8, []) == [()] and kink_choices(hp, []) == [()]
    slopes = [1, 0, 0, 1]
    got = kink_choices(fp8, _sites(slopes))
    assert got[0] == tuple(slopes) and len(got) == len(set(got)) == 1 + 4 + 6
    assert all(sum(a != b for a, b in zip(c, slopes)) <= 2 for c in got)
    assert len(kink_choices(hp, _sites(slopes[:3]))) == 2**3
    k = B.FP8_KINK_PAIRS_UP_TO
    assert len(kink_choices(fp8, _sites([0] * k))) == 1 + k + k * (k - 1) // 2
    assert len(kink_choices(fp8, _sites([0] * (k + 1)))) == 1 + (k + 1)
    many = [1, 0] * (B.FP8_KINK_MAX_SITES // 2 + 1)
    assert kink_choices(fp8, _sites(many)) == [tuple(many)]
    with pytest.raises(CaseRejected, match="KINK_MAX_ENUMERATED"):
        kink_choices(hp, _sites([0] * (B.KINK_MAX_ENUMERATED + 1)))
