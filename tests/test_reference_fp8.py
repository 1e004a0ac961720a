"""FP8 in the reference (SPEC §6): the casts against an independent numpy implementation, the
quantizers on hand-computed examples, delayed-scaling histories, and split backward under every
recipe."""

from __future__ import annotations

import numpy as np
import pytest
import splitgrad.reference as ref
import torch
from cases import build_fp8, check_fp8_delay_bitwise, fp8_step
from splitgrad.reference.fp8_quant import (
    DelayedScalingState,
    cast_to_fp8,
    fp8_max,
    quantize,
)

# ---- the casts, checked bit for bit against numpy ---------------------------------------------

LAYOUT = {"E4M3": (4, 3, 7), "E5M2": (5, 2, 15)}  # exponent bits, mantissa bits, bias


def _decode_all(fmt: str) -> np.ndarray:
    """Every finite, non-negative value of ``fmt`` from its bit fields (float64, ascending)."""
    e_bits, m_bits, bias = LAYOUT[fmt]
    values = []
    for code in range(1 << (e_bits + m_bits)):
        e, m = code >> m_bits, code & ((1 << m_bits) - 1)
        if e == 0:
            values.append(m * 2.0 ** (1 - bias - m_bits))
        else:
            values.append((1 + m / 2**m_bits) * 2.0 ** (e - bias))
    finite = np.array(values)
    return finite[finite <= fp8_max(fmt)]


def _numpy_cast(x32: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating round-to-nearest-even to ``fmt``, from the float32 bit pattern: returns float64
    values (NaN for NaN)."""
    e_bits, m_bits, bias = LAYOUT[fmt]
    bits = x32.view(np.uint32).astype(np.int64)
    sign = np.where(bits >> 31, -1.0, 1.0)
    exp32 = ((bits >> 23) & 0xFF) - 127
    mag = np.abs(x32.astype(np.float64))
    # quantum = spacing of fp8 values in x's binade; subnormals share the smallest binade's
    emin = 1 - bias
    quantum = np.exp2(np.maximum(exp32, emin) - m_bits)
    rounded = np.rint(mag / quantum) * quantum  # np.rint rounds half to even
    out = sign * np.minimum(rounded, fp8_max(fmt))
    out = np.where(np.isinf(x32), sign * fp8_max(fmt), out)
    return np.where(np.isnan(x32), np.nan, out)


def _probe_values(fmt: str) -> np.ndarray:
    """Every representable value, the midpoints between neighbours, one float32 ulp either side
    of each, values past the largest finite one, infinities, NaN, and both signs of all."""
    grid = _decode_all(fmt)
    mids = (grid[1:] + grid[:-1]) / 2
    beyond = fp8_max(fmt) * np.array([1.03, 1.0625, 1.07, 2.0, 1e6])
    base = np.concatenate([grid, mids, beyond]).astype(np.float32)
    up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(0))
    tiny = np.array([1e-30, 1e-12, np.inf, np.nan], dtype=np.float32)
    probes = np.concatenate([base, up, down, tiny])
    return np.concatenate([probes, -probes])


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_cast_matches_numpy_bit_level(fmt):
    probes = _probe_values(fmt)
    got = cast_to_fp8(torch.from_numpy(probes), fmt).to(torch.float64).numpy()
    expected = _numpy_cast(probes, fmt)
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan], expected[~nan]), probes[~nan][got[~nan] != expected[~nan]][:8]
    # signed zeros: -tiny rounds to -0, +tiny to +0
    assert np.array_equal(np.signbit(got[~nan]), np.signbit(expected[~nan]))


@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_every_representable_value_round_trips(fmt):
    grid = _decode_all(fmt)
    values = torch.from_numpy(np.concatenate([grid, -grid]).astype(np.float32))
    torch.testing.assert_close(cast_to_fp8(values, fmt).float(), values, rtol=0, atol=0)


def test_numpy_cast_is_not_trivial():
    """Meta-check of the oracle: ties go to even and saturation happens."""
    x = np.array([17.0, 19.0, 500.0, -1e9, 0.0009765625], dtype=np.float32)
    # E4M3 around 16 has spacing 2: 17 -> 16 (even mantissa), 19 -> 20; 2^-10 -> 0 (tie to even)
    np.testing.assert_array_equal(_numpy_cast(x, "E4M3"), [16.0, 20.0, 448.0, -448.0, 0.0])


# ---- the quantizers on hand-computed examples -----------------------------------------------


def test_current_scaling_per_tensor():
    x = torch.tensor([[1.0, -2.0, 0.5, 0.0]])
    q = quantize(x, ref.Float8CurrentScaling(), "input", axis=1)
    assert q.fmt == "E4M3"
    torch.testing.assert_close(q.scale_inv, torch.tensor(2.0 / 448.0), rtol=0, atol=0)
    torch.testing.assert_close(
        q.data.float(), torch.tensor([[224.0, -448.0, 112.0, 0.0]]), rtol=0, atol=0
    )
    g = quantize(x, ref.Float8CurrentScaling(), "grad_output", axis=1)
    assert g.fmt == "E5M2"
    torch.testing.assert_close(g.scale_inv, torch.tensor(2.0 / 57344.0), rtol=0, atol=0)
    zero = quantize(torch.zeros(2, 3), ref.Float8CurrentScaling(), "input", axis=1)
    torch.testing.assert_close(zero.scale_inv, torch.tensor(1.0), rtol=0, atol=0)


def test_e4m3_format_everywhere():
    x = torch.ones(1, 4)
    q = quantize(x, ref.Float8CurrentScaling(fp8_format=ref.Format.E4M3), "grad_output", axis=1)
    assert q.fmt == "E4M3" and q.data.dtype == torch.float8_e4m3fn


def test_mxfp8_power_of_two_scale_per_32_values():
    x = torch.zeros(2, 64)
    x[0, :32] = 1.0  # amax 1 -> scale_inv 2^(0 - 8)
    x[0, 32:] = 448.0  # amax 448 = 1.75 * 2^8 -> scale_inv 2^0
    x[1, :32] = 3.0  # amax 3 -> 2^(1 - 8); 3 / 2^-7 = 384
    q = quantize(x, ref.MXFP8BlockScaling(), "input", axis=1)
    expected = torch.tensor([[2.0**-8, 1.0], [2.0**-7, 1.0]])
    torch.testing.assert_close(q.scale_inv, expected, rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(), x, rtol=0, atol=0)
    col = quantize(x.t().contiguous(), ref.MXFP8BlockScaling(), "input", axis=0)
    torch.testing.assert_close(col.scale_inv, expected.t(), rtol=0, atol=0)


def test_mxfp8_block_max_can_saturate():
    """amax = 1.9 * 2^k lands at 1.9 * 256 = 486.4 > 448 after scaling, so it saturates."""
    x = torch.full((1, 32), 0.5)
    x[0, 0] = 1.9
    q = quantize(x, ref.MXFP8BlockScaling(), "input", axis=1)
    assert q.data[0, 0].float().item() == 448.0
    assert q.dequantize()[0, 0].item() == 448.0 / 256.0


def test_float8_block_scaling_tiles_and_blocks():
    x = torch.ones(128, 256)
    x[:, 128:] *= 4.0
    x[5, 0] = 2.0
    tiles = quantize(x, ref.Float8BlockScaling(), "input", axis=1)
    assert tiles.scale_inv.shape == (128, 2)
    assert tiles.scale_inv[5, 0].item() == pytest.approx(2.0 / 448.0)
    assert tiles.scale_inv[0, 0].item() == pytest.approx(1.0 / 448.0)
    blocks = quantize(x, ref.Float8BlockScaling(), "weight", axis=1)
    assert blocks.scale_inv.shape == (1, 2)
    assert blocks.scale_inv[0, 0].item() == pytest.approx(2.0 / 448.0)
    assert blocks.scale_inv[0, 1].item() == pytest.approx(4.0 / 448.0)


def test_delayed_scaling_history_and_scale():
    recipe = ref.DelayedScaling(amax_history_len=3, amax_compute_algo="max", margin=1)
    state = DelayedScalingState(3, torch.device("cpu"))
    q = quantize(torch.tensor([[2.0, -1.0]]), recipe, "input", axis=1, state=state)
    torch.testing.assert_close(q.scale_inv, torch.tensor(1.0), rtol=0, atol=0)  # first step: 1
    assert state.amax_history.tolist() == [2.0, 0.0, 0.0]
    state.update(recipe, "E4M3")
    assert state.amax_history.tolist() == [0.0, 2.0, 0.0]
    assert state.scale.item() == 448.0 / 2.0 / 2.0
    quantize(torch.tensor([[0.5]]), recipe, "input", axis=1, state=state)
    state.update(recipe, "E4M3")  # max over history: still 2
    assert state.scale.item() == 112.0
    recent = ref.DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    quantize(torch.tensor([[0.5]]), recent, "input", axis=1, state=state)
    state.update(recent, "E4M3")
    assert state.scale.item() == 448.0 / 0.5


# ---- modules under FP8 ----------------------------------------------------------------------

RECIPES = [
    ref.DelayedScaling(amax_history_len=4),
    ref.DelayedScaling(
        amax_history_len=4, amax_compute_algo="most_recent", fp8_format=ref.Format.E4M3
    ),
    ref.Float8CurrentScaling(),
    ref.MXFP8BlockScaling(),
    ref.Float8BlockScaling(),
]
RECIPE_IDS = ["delayed-max", "delayed-recent-e4m3", "current", "mxfp8", "block"]


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_fp8_delayed_equals_non_delayed_over_steps(recipe, kind, fused):
    """Gradients, amax histories and scales are bitwise equal delayed vs not, over three steps
    whose wgrad runs only after the next step's forward and backward moved the scales."""
    check_fp8_delay_bitwise(ref, kind, recipe, fused)


@pytest.mark.parametrize("recipe", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_fp8_is_close_to_high_precision_but_not_equal(recipe, kind):
    """FP8 really quantizes (the result differs from high precision) and stays near it: the
    whole-tensor relative error of each gradient is below 0.25 (E4M3 keeps 3 mantissa bits, a
    relative step of 1/16; errors of chained GEMMs add up, an 8x margin covers them)."""
    hp, lp = (build_fp8(ref, kind, recipe) for _ in range(2))
    # two steps so delayed scaling has real scales
    for _ in range(2):
        for p in lp.parameters():
            p.grad = None
        x_lp, y_lp = fp8_step(lp, recipe, 7)
    x_hp, y_hp = fp8_step(hp, recipe, 7, fp8=False)
    pairs = [("y", y_lp, y_hp), ("x.grad", x_lp.grad, x_hp.grad)]
    pairs += [
        (name, p.grad, q.grad) for (name, p), q in zip(lp.named_parameters(), hp.parameters())
    ]
    for name, a, b in pairs:
        rel = ((a - b).norm() / b.norm()).item()
        if name in ("bias", "fc2_bias"):  # summed from the unquantized dy: exact
            assert rel == 0, (name, rel)
        else:
            assert 0 < rel < 0.25, (name, rel)


@pytest.mark.parametrize(
    "recipe, make, pattern",
    [
        (
            ref.MXFP8BlockScaling(),
            lambda: ref.Linear(48, 32),
            r"MXFP8BlockScaling.*in_features=48.*32",
        ),
        (ref.MXFP8BlockScaling(), lambda: ref.Linear(32, 40), r"out_features=40.*multiple of 32"),
        (ref.Float8BlockScaling(), lambda: ref.Linear(128, 64), r"Float8BlockScaling.*64.*128"),
    ],
)
def test_fp8_unquantizable_shape_raises(recipe, make, pattern):
    module = make()
    x = torch.randn(32, module.in_features, requires_grad=True)
    with pytest.raises(ValueError, match=pattern):
        with ref.fp8_autocast(enabled=True, fp8_recipe=recipe):
            module(x)
    assert module.fp8_states == {} and module.weight.grad is None


def test_fp8_token_count_must_align_per_group():
    module = ref.GroupedLinear(2, 32, 32)
    x = torch.randn(48, 32)
    with pytest.raises(ValueError, match=r"gemm0.tokens=16.*32"):
        with ref.fp8_autocast(enabled=True, fp8_recipe=ref.MXFP8BlockScaling()):
            module(x, [16, 32])


@pytest.mark.parametrize(
    "recipe, role",
    [
        (ref.Float8CurrentScaling(), "input"),
        (ref.Float8CurrentScaling(), "grad_output"),
        (ref.Float8BlockScaling(), "input"),
        (ref.Float8BlockScaling(), "weight"),
    ],
)
def test_tiny_amax_keeps_zeros_zero(recipe, role):
    """448 / 1e-38 overflows fp32; the scale is capped at FLT_MAX so 0 stays 0, not 0*inf=NaN."""
    x = torch.zeros(128, 128)
    x[0, 0] = 1e-38
    q = quantize(x, recipe, role, axis=1)
    assert torch.isfinite(q.data.float()).all()
    assert q.data.float().count_nonzero() == 1
    assert torch.isfinite(q.scale_inv).all() and (q.scale_inv > 0).all()


def test_delayed_scaling_tiny_amax_scale_is_finite():
    recipe = ref.DelayedScaling(amax_history_len=2)
    state = DelayedScalingState(2, torch.device("cpu"))
    quantize(torch.tensor([[1e-38, 0.0]]), recipe, "input", axis=1, state=state)
    state.update(recipe, "E4M3")
    assert state.scale.item() == torch.finfo(torch.float32).max
    q = quantize(torch.tensor([[1e-38, 0.0]]), recipe, "input", axis=1, state=state)
    assert q.data.float()[0, 1].item() == 0.0
    assert 0 < q.data.float()[0, 0].item() < 448


def test_mxfp8_block_with_inf_or_nan_is_nan():
    """OCP MX: a block holding inf or NaN gets E8M0's NaN scale; other blocks are untouched."""
    x = torch.ones(1, 96)
    x[0, 3] = float("inf")
    x[0, 40] = float("nan")
    q = quantize(x, ref.MXFP8BlockScaling(), "input", axis=1)
    assert torch.isnan(q.scale_inv[0, :2]).all()
    assert torch.isnan(q.dequantize()[0, :64]).all()
    torch.testing.assert_close(q.dequantize()[0, 64:], x[0, 64:], rtol=0, atol=0)


def test_block_recipes_honour_hybrid():
    """Gradients are E5M2 under Format.HYBRID for the block recipes too; MXFP8's E8M0 exponent
    then sits 15 binades below the block amax (E5M2's largest exponent)."""
    x = torch.full((1, 128), 1.0)
    mx = quantize(x, ref.MXFP8BlockScaling(fp8_format=ref.Format.HYBRID), "grad_output", axis=1)
    assert mx.fmt == "E5M2" and mx.data.dtype == torch.float8_e5m2
    torch.testing.assert_close(mx.scale_inv, torch.full((1, 4), 2.0**-15), rtol=0, atol=0)
    blk = quantize(x, ref.Float8BlockScaling(fp8_format=ref.Format.HYBRID), "grad_output", axis=1)
    assert blk.fmt == "E5M2"
    torch.testing.assert_close(blk.scale_inv, torch.full((1, 1), 1 / 57344), rtol=0, atol=0)
    fwd = quantize(x, ref.MXFP8BlockScaling(fp8_format=ref.Format.HYBRID), "input", axis=1)
    assert fwd.fmt == "E4M3"
