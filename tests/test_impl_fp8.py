"""FP8 in splitgrad.impl (SPEC §6): quantizers bit for bit against the reference (P13), module
results against the reference within a documented budget, delayed ≡ non-delayed bitwise over
steps that move the scales, amax histories, unquantizable shapes, and the scaled-GEMM path
(CUDA, with CPU twins that force it).

Budget for impl vs reference module results (``_assert_fp8_close``). Both sides quantize
bit-identical operands (P13); they differ only where

* the GEMM rounds: the reference dequantizes each operand (``data * scale_inv``, one fp32
  rounding per element), multiplies, rounds to ``params_dtype`` and then adds the bias in
  ``params_dtype``; impl multiplies the exact FP8 values, applies ``scale_inv_a * scale_inv_b``
  once and rounds product + bias once. In fp32 that is ~1e-7 relative; in bf16 the different
  bias rounding moves single elements by one bf16 step (2^-8);
* high-precision layers between GEMMs (LayerNorm kernels, activations) differ in the last bit,
  and such an input can then land on the other side of an FP8 rounding boundary. In fp32 that is
  rare (probability ~2^-20 per element); in bf16 a one-step difference in a tensor's amax under
  current scaling shifts every element's scaled value by 2^-8, and about 1/16 of them change
  their FP8 rounding. Measured: up to ~0.6x the reference's own FP8 error for LayerNormMLP.

So every tensor must satisfy, with ``fp8_err = ref - (same module without FP8)``:

* whole tensor: ``|impl - ref| / |ref| <= max(FLOOR[dtype], |fp8_err| / |ref|)`` (L2 norms):
  impl is no farther from the reference than FP8 itself is from high precision, or within
  ``FLOOR`` (2^-12 in fp32: a few boundary flips; 2^-7 in bf16: two bf16 roundings);
* element-wise: ``max|impl - ref| <= max(FLOOR[dtype] * max|ref|, max|fp8_err|)``: no element
  moves more than FP8's own worst element error;
* bias gradients of the last GEMM (summed from the module's unquantized ``dy`` by the same
  reduction on both sides) are bitwise equal.

A wrong scale, a transposed operand or a stale delayed scale is off by O(1) and fails both.
"""

from __future__ import annotations

import math

import pytest
import splitgrad.impl as impl
import splitgrad.reference as ref
import torch
from cases import build_fp8, check_fp8_delay_bitwise, fp8_size, fp8_step, snapshot
from hypothesis import example, given
from hypothesis import strategies as st
from splitgrad.impl import fp8 as ifp8
from splitgrad.impl import fp8_gemm
from splitgrad.reference import fp8_quant as rfp8

KINDS = ["Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear"]
RECIPES = {
    "delayed-max": ref.DelayedScaling(amax_history_len=4),
    "delayed-recent-e4m3": ref.DelayedScaling(
        amax_history_len=4, amax_compute_algo="most_recent", fp8_format=ref.Format.E4M3, margin=1
    ),
    "current": ref.Float8CurrentScaling(),
    "mxfp8": ref.MXFP8BlockScaling(),
    "block": ref.Float8BlockScaling(),
}
RECIPE_IDS = list(RECIPES)
FLOOR = {torch.float32: 2.0**-12, torch.bfloat16: 2.0**-7}


# ---- P13: quantizers bit for bit ------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _assert_bitwise(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    a, e = _bits(actual.contiguous()), _bits(expected.contiguous())
    if not torch.equal(a, e):
        idx = (a != e).nonzero()[0].tolist()
        raise AssertionError(
            f"{what} differs at {idx}: impl {actual[tuple(idx)].item()!r} "
            f"(bits {a[tuple(idx)].item()}), reference {expected[tuple(idx)].item()!r} "
            f"(bits {e[tuple(idx)].item()})"
        )


def _multiples(recipe, role: str, axis: int) -> tuple[int, int]:
    """(rows, cols) multiples the quantizer needs."""
    if isinstance(recipe, ref.MXFP8BlockScaling):
        return (1, 32) if axis == 1 else (32, 1)
    if isinstance(recipe, ref.Float8BlockScaling):
        if role == "weight":
            return (128, 128)
        return (1, 128) if axis == 1 else (128, 1)
    return (1, 1)


def _compare_quantizers(x, recipe, role, axis, steps=1) -> None:
    """Quantize ``x`` (and, for delayed scaling, ``steps`` rescaled copies with a state update in
    between) on both sides; data, scale_inv, history and scale must be bitwise equal."""
    per_tensor = isinstance(recipe, ref.DelayedScaling)
    n = recipe.amax_history_len if per_tensor else 1
    rstate = rfp8.DelayedScalingState(n, x.device) if per_tensor else None
    istate = ifp8.DelayedScalingState(n, x.device) if per_tensor else None
    for step in range(steps):
        xs = x * (4.0**step) if step else x
        q_ref = rfp8.quantize(xs, recipe, role, axis, state=rstate)
        q_imp = ifp8.quantize(xs, recipe, role, axis, state=istate)
        assert q_imp.fmt == q_ref.fmt
        _assert_bitwise(q_imp.data, q_ref.data, f"data (step {step})")
        _assert_bitwise(q_imp.scale_inv, q_ref.scale_inv, f"scale_inv (step {step})")
        if per_tensor:
            _assert_bitwise(istate.amax_history, rstate.amax_history, f"history (step {step})")
            rstate.update(recipe, rfp8.format_for(recipe, role))
            istate.update(recipe, ifp8.fp8_format(recipe, role))
            _assert_bitwise(istate.scale, rstate.scale, f"scale (step {step})")
            _assert_bitwise(istate.amax_history, rstate.amax_history, f"rolled (step {step})")


@st.composite
def _recipes(draw):
    kind = draw(st.sampled_from(["delayed", "current", "mxfp8", "block"]))
    fmt = draw(st.sampled_from([ref.Format.HYBRID, ref.Format.E4M3]))
    if kind == "delayed":
        return ref.DelayedScaling(
            margin=draw(st.integers(0, 3)),
            fp8_format=fmt,
            amax_history_len=draw(st.integers(1, 4)),
            amax_compute_algo=draw(st.sampled_from(["max", "most_recent"])),
        )
    if kind == "current":
        return ref.Float8CurrentScaling(fp8_format=fmt)
    return ref.MXFP8BlockScaling() if kind == "mxfp8" else ref.Float8BlockScaling()


# Magnitudes: zero, fp32 subnormals, tiny, ordinary, around the FP8 maxima, huge (fp32 inf after
# scaling), so that amax-derived scales overflow, underflow and saturate.
SCALES = [0.0, 1e-42, 1e-39, 1e-20, 1e-3, 1.0, 300.0, 5e4, 1e20, 3e38]
SPECIALS = [math.nan, math.inf, -math.inf, -0.0, 1e38, 448.0 * 1.9]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


@given(
    recipe=_recipes(),
    role=st.sampled_from(ifp8.ROLES),
    axis=st.sampled_from([0, 1]),
    dtype=st.sampled_from(DTYPES),
    row_blocks=st.integers(0, 3),
    col_blocks=st.integers(1, 3),
    scale=st.sampled_from(SCALES),
    specials=st.lists(
        st.tuples(st.sampled_from(SPECIALS), st.floats(0, 1, exclude_max=True)), max_size=3
    ),
    seed=st.integers(0, 2**31 - 1),
)
@example(  # a NaN in a delayed-scaling tensor poisons the history (scale kept)
    recipe=ref.DelayedScaling(amax_history_len=2),
    role="grad_output",
    axis=1,
    dtype=torch.bfloat16,
    row_blocks=1,
    col_blocks=2,
    scale=1.0,
    specials=[(math.nan, 0.3)],
    seed=1,
)
def test_p13_quantizers_bitwise(
    recipe, role, axis, dtype, row_blocks, col_blocks, scale, specials, seed
):
    mr, mc = _multiples(recipe, role, axis)
    # Per-tensor recipes take any shape; draw small odd ones.
    rows = row_blocks * (mr if mr > 1 else 5)
    cols = col_blocks * (mc if mc > 1 else 7)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g, dtype=torch.float64) * scale
    flat = x.view(-1)
    for value, where in specials:
        if flat.numel():
            flat[int(where * flat.numel())] = value
    steps = 3 if isinstance(recipe, ref.DelayedScaling) else 1
    _compare_quantizers(x.to(dtype), recipe, role, axis, steps)


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=RECIPE_IDS)
@pytest.mark.parametrize(
    "case",
    ["zeros", "negative-zeros", "empty", "nan", "inf", "-inf", "saturating", "subnormal-amax"],
)
def test_p13_pinned_edge_cases(recipe, case):
    """Edge cases on every role and axis: both sides agree bit for bit."""
    for role in ifp8.ROLES:
        for axis in (0, 1):
            mr, mc = _multiples(recipe, role, axis)
            rows, cols = max(mr, 4), max(mc, 6)
            x = torch.linspace(-3, 3, rows * cols).reshape(rows, cols)
            if case == "zeros":
                x = torch.zeros(rows, cols)
            elif case == "negative-zeros":
                x = torch.full((rows, cols), -0.0)
            elif case == "empty":
                x = torch.zeros(0, cols) if mr == 1 or role != "weight" else torch.zeros(0, cols)
            elif case in ("nan", "inf", "-inf"):
                x[0, 0] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[case]
            elif case == "saturating":
                # Block max 1.9 * 2^k scales to 486.4 > 448 under MXFP8; a stale delayed scale
                # (step 2 is 4x larger) saturates the per-tensor recipes.
                x[:, 0] = 1.9
            else:
                x = x * 1e-41  # amax a subnormal: 448 / amax overflows to inf
            steps = 3 if isinstance(recipe, ref.DelayedScaling) else 1
            _compare_quantizers(x, recipe, role, axis, steps)


def test_p13_catches_a_one_bit_difference(monkeypatch):
    """Meta: the comparison is not vacuous (an impl rounding toward zero is caught)."""
    original = ifp8._cast_

    def truncating(scaled, fmt):
        return original(scaled * (1 - 2.0**-6), fmt)

    monkeypatch.setattr(ifp8, "_cast_", truncating)
    with pytest.raises(AssertionError, match="data"):
        _compare_quantizers(
            torch.linspace(-3, 3, 64).reshape(2, 32), ref.MXFP8BlockScaling(), "input", 1
        )


def test_quantize_rejects_misaligned_block_shapes():
    with pytest.raises(ValueError, match=r"MXFP8BlockScaling.*dimension 1 \(40\).*32"):
        ifp8.quantize(torch.ones(4, 40), ref.MXFP8BlockScaling(), "input", 1)
    with pytest.raises(ValueError, match="DelayedScalingState"):
        ifp8.quantize(torch.ones(4, 4), ref.DelayedScaling(), "input", 1)


# ---- modules against the reference (builders and steps: cases.build_fp8, cases.fp8_step) ---


def _assert_fp8_close(name, actual, expected, high, dtype):
    """The budget of the module docstring."""
    a, e, h = actual.double(), expected.double(), high.double()
    diff, fp8_err = a - e, e - h
    e_norm = e.norm().item()
    gate = max(FLOOR[dtype], fp8_err.norm().item() / max(e_norm, 1e-300))
    rel = diff.norm().item() / max(e_norm, 1e-300)
    assert rel <= gate, f"{name}: |impl - ref| / |ref| = {rel:.3g} > gate {gate:.3g}"
    elem_budget = max(FLOOR[dtype] * e.abs().max().item(), fp8_err.abs().max().item())
    worst = diff.abs().max().item()
    if worst > elem_budget:
        idx = tuple(int(i) for i in (diff.abs() == worst).nonzero()[0])
        raise AssertionError(
            f"{name}[{idx}]: impl {a[idx].item():.6g} vs reference {e[idx].item():.6g}, "
            f"|diff| {worst:.3g} > element budget {elem_budget:.3g}"
        )


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_modules_match_reference_within_budget(recipe, kind, dtype):
    """Two steps (delayed scaling then quantizes with real scales); outputs, input gradients and
    parameter gradients of impl within the documented budget of the reference's."""
    imp, rf = build_fp8(impl, kind, recipe, dtype=dtype), build_fp8(ref, kind, recipe, dtype=dtype)
    high = build_fp8(ref, kind, recipe, dtype=dtype)
    for step in range(2):
        for m in (imp, rf, high):
            for p in m.parameters():
                p.grad = None
        xi, yi = fp8_step(imp, recipe, step)
        xr, yr = fp8_step(rf, recipe, step)
        xh, yh = fp8_step(high, recipe, step, fp8=False)
    pairs = [("y", yi, yr, yh), ("x.grad", xi.grad, xr.grad, xh.grad)]
    gi, gr, gh = snapshot(imp), snapshot(rf), snapshot(high)
    assert gi.keys() == gr.keys()
    pairs += [(k, gi[k], gr[k], gh[k]) for k in gr]
    for name, a, e, h in pairs:
        if name in ("bias.grad", "fc2_bias.grad") or name.startswith("bias"):
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=name)
        else:
            _assert_fp8_close(name, a, e, h, dtype)


def test_budget_catches_a_wrong_scale(monkeypatch):
    """Meta: an impl whose wgrad forgets one operand's scale_inv fails the budget."""
    original = fp8_gemm.fp8_wgrad_write

    def unscaled(module, param, dy_q, x_q, overwrite):
        x_q = ifp8.Float8Tensor(
            x_q.data, torch.ones_like(x_q.scale_inv), x_q.fmt, x_q.block, x_q.transposed
        )
        original(module, param, dy_q, x_q, overwrite)

    monkeypatch.setattr("splitgrad.impl.base.fp8_wgrad_write", unscaled)
    with pytest.raises(AssertionError, match="weight"):
        test_modules_match_reference_within_budget(RECIPES["current"], "Linear", torch.float32)


# ---- delayed ≡ non-delayed, bitwise, over steps that move the scales -----------------------


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=RECIPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_delayed_equals_non_delayed_over_steps(recipe, kind, fused):
    """Gradients (``.grad``, prefilled ``main_grad``), amax histories and scales are bitwise
    equal delayed vs not over three bf16 steps whose wgrad runs only after the next step's
    forward and backward have moved the scales."""
    check_fp8_delay_bitwise(impl, kind, recipe, fused)


# ---- amax histories against the reference ---------------------------------------------------

# Roles whose quantized tensor is bitwise the same on both sides after the same steps: the
# weights, the module's input (Linear, GroupedLinear) and the module's output gradient. The
# others quantize impl's own norm/activation/GEMM outputs, which differ from the reference's in
# the last bit (different kernels), so their amax — a max over the tensor — differs by at most a
# few steps of params_dtype (bounded below by INTERNAL_ROLE_RTOL).
INTERNAL_ROLES = {
    "LayerNormLinear": {"input"},
    "LayerNormMLP": {"fc1.input", "fc2.input", "fc1.grad_output"},
}
INTERNAL_ROLE_RTOL = {torch.float32: 2.0**-18, torch.bfloat16: 2.0**-6}


@pytest.mark.parametrize(
    "kind, normalization",
    [(k, "LayerNorm") for k in KINDS] + [(k, "RMSNorm") for k in INTERNAL_ROLES],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_amax_histories_match_reference(kind, dtype, normalization):
    """After three delayed-scaling steps every history and scale is bitwise the reference's where
    both quantized bitwise-equal tensors (see INTERNAL_ROLES), else within INTERNAL_ROLE_RTOL."""
    recipe = RECIPES["delayed-max"]
    extra = {"normalization": normalization} if kind in INTERNAL_ROLES else {}
    imp = build_fp8(impl, kind, recipe, dtype=dtype, **extra)
    rf = build_fp8(ref, kind, recipe, dtype=dtype, **extra)
    for step in range(3):
        fp8_step(imp, recipe, step)
        fp8_step(rf, recipe, step)
    assert imp.fp8_states.keys() == rf.fp8_states.keys()
    internal = set(INTERNAL_ROLES.get(kind, ()))
    if normalization == "RMSNorm":
        internal.discard("input")  # impl's RMSNorm is bitwise the reference's formula
        internal.discard("fc1.input")
    for key, rs in rf.fp8_states.items():
        s = imp.fp8_states[key]
        if key in internal:
            rtol = INTERNAL_ROLE_RTOL[dtype]
            torch.testing.assert_close(s.amax_history, rs.amax_history, rtol=rtol, atol=0, msg=key)
            torch.testing.assert_close(s.scale, rs.scale, rtol=rtol, atol=0, msg=key)
        else:
            _assert_bitwise(s.amax_history, rs.amax_history, f"{key}.amax_history")
            _assert_bitwise(s.scale, rs.scale, f"{key}.scale")


# ---- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe, make, rows, pattern",
    [
        (
            ref.MXFP8BlockScaling(),
            lambda: impl.Linear(48, 32),
            32,
            r"MXFP8BlockScaling cannot quantize in_features=48: it must be a multiple of 32",
        ),
        (
            ref.MXFP8BlockScaling(),
            lambda: impl.Linear(32, 40),
            32,
            r"out_features=40: it must be a multiple of 32",
        ),
        (ref.MXFP8BlockScaling(), lambda: impl.Linear(32, 32), 20, r"tokens=20: .* of 32"),
        (
            ref.Float8BlockScaling(),
            lambda: impl.Linear(128, 64),
            128,
            r"Float8BlockScaling cannot quantize out_features=64: it must be a multiple of 128",
        ),
        (ref.MXFP8BlockScaling(), lambda: impl.LayerNormMLP(32, 48), 32, r"fc1.out_features=48"),
        (
            ref.MXFP8BlockScaling(),
            lambda: impl.GroupedLinear(2, 32, 32),
            48,
            r"gemm0.tokens=16: .* of 32",
        ),
    ],
)
def test_unquantizable_shapes_raise_and_change_nothing(recipe, make, rows, pattern):
    module = make()
    k = module.hidden_size if hasattr(module, "hidden_size") else module.in_features
    x = torch.randn(rows, k, requires_grad=True)
    with pytest.raises(ValueError, match=pattern):
        with ref.fp8_autocast(enabled=True, fp8_recipe=recipe):
            module(x, [16, 32]) if hasattr(module, "num_gemms") else module(x)
    assert module.fp8_states == {}
    assert all(p.grad is None for p in module.parameters())


def test_reference_and_impl_reject_the_same_shapes():
    """Same message, word for word, for the same unquantizable module."""
    messages = []
    for lib in (ref, impl):
        module = lib.LayerNormMLP(64, 96)
        with pytest.raises(ValueError) as info:
            with lib.fp8_autocast(enabled=True, fp8_recipe=ref.Float8BlockScaling()):
                module(torch.randn(128, 64))
        messages.append(str(info.value))
    assert messages[0] == messages[1]


# ---- what a queued FP8 entry holds -----------------------------------------------------------


@pytest.mark.parametrize("recipe", list(RECIPES.values()), ids=RECIPE_IDS)
def test_queued_entry_holds_fp8_operands_and_bias_grad_only(recipe):
    """The entry keeps q(dy) and q(x) column-wise (1 byte per value), their scale_inv and the
    (M,) bias gradient: no high-precision activation-sized tensor."""
    module = build_fp8(impl, "Linear", recipe, dtype=torch.bfloat16, delay=True)
    fp8_step(module, recipe, 0)
    (entry,) = list(module._wgrad_store)
    saved = [t for t in entry.saved if t is not None]
    data = [t for t in saved if t.element_size() == 1]
    n = fp8_size(recipe)
    assert len(data) == 2 and sum(t.numel() for t in data) == 2 * (2 * n) * n
    # The rest: scale_inv (at most one per 32 values) and the (M,) bias gradient.
    rest = sum(t.numel() for t in saved if t.element_size() != 1)
    assert rest <= sum(t.numel() for t in data) // 32 + module.out_features


# ---- the scaled-GEMM path: CPU twins (forced) and CUDA --------------------------------------


PER_TENSOR_IDS = ["delayed-max", "delayed-recent-e4m3", "current"]


def test_scaled_mm_probe_on_cpu():
    """torch 2.13's CPU _scaled_mm serves tensor-wise scales; the block kinds are refused, so
    forcing the scaled path falls back for them."""
    cpu = torch.device("cpu")
    assert fp8_gemm.scaled_mm_works(cpu, "tensor")
    assert not fp8_gemm.scaled_mm_works(cpu, "mx")
    assert not fp8_gemm.scaled_mm_works(cpu, "block")


@pytest.mark.parametrize("recipe_id", RECIPE_IDS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormMLP"])
def test_forced_scaled_mm_matches_dequantize_path(recipe_id, kind):
    """CPU twin of the CUDA path: the module forced onto torch's FP8 GEMM (transposed column-wise
    copies, _scaled_mm epilogue) gives the dequantize path's results within fp32 GEMM noise
    (both multiply exact FP8 values and scale once; only the accumulation order differs:
    |diff| <= 2^-16 * max|result| at K <= 64), and exactly them where it falls back."""
    recipe = RECIPES[recipe_id]
    results = []
    for path in ("dequantize", "scaled_mm"):
        module = build_fp8(impl, kind, recipe, fused=True)
        module.fp8_gemm = path
        x, y = fp8_step(module, recipe, 3)
        results.append({"y": y, "x.grad": x.grad, **snapshot(module)})
    ref_path, scaled = results
    fallback = recipe_id in ("mxfp8", "block")
    for key, want in ref_path.items():
        got = scaled[key]
        if want is None:
            assert got is None, key
        elif fallback:
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=key)
        else:
            tol = 2.0**-16 * want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=tol, msg=key)


@pytest.mark.parametrize("recipe_id", PER_TENSOR_IDS)
def test_forced_scaled_mm_keeps_transposed_copies_and_is_split_bitwise(recipe_id):
    """On the scaled path the queued column-wise copies are stored transposed (made once), and
    delayed ≡ non-delayed stays bitwise."""
    recipe = RECIPES[recipe_id]
    plain = build_fp8(impl, "Linear", recipe, dtype=torch.bfloat16)
    delayed = build_fp8(impl, "Linear", recipe, dtype=torch.bfloat16, delay=True)
    for m in (plain, delayed):
        m.fp8_gemm = "scaled_mm"
    for step in range(2):
        fp8_step(plain, recipe, step)
        fp8_step(delayed, recipe, step)
    (first, second) = list(delayed._wgrad_store)
    n = fp8_size(recipe)
    dy_data, x_data = first.saved[0], first.saved[2]
    assert dy_data.shape == (n, 2 * n) and x_data.shape == (n, 2 * n)  # (cols, rows) storage
    delayed.backward_dw()
    delayed.backward_dw()
    for key, value in snapshot(plain).items():
        torch.testing.assert_close(snapshot(delayed)[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.cuda
@pytest.mark.parametrize("recipe_id", RECIPE_IDS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_fp8_matches_reference_and_split_is_bitwise(recipe_id, kind):
    """On CUDA "auto" takes the scaled GEMM where the probe passed; results stay within the
    reference budget and delayed ≡ non-delayed bitwise."""
    recipe = RECIPES[recipe_id]
    dev = "cuda"
    imp = build_fp8(impl, kind, recipe, dtype=torch.bfloat16).to(dev)
    rf = build_fp8(ref, kind, recipe, dtype=torch.bfloat16).to(dev)
    high = build_fp8(ref, kind, recipe, dtype=torch.bfloat16).to(dev)
    delayed = build_fp8(impl, kind, recipe, dtype=torch.bfloat16, delay=True).to(dev)
    n = fp8_size(recipe)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * n, n, generator=g).to(device=dev, dtype=torch.bfloat16)
    out = {}
    for name, m, fp8 in (
        ("impl", imp, True),
        ("ref", rf, True),
        ("high", high, False),
        ("delayed", delayed, True),
    ):
        xx = x.clone().requires_grad_()
        with ref.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
            y = m(xx, [n, 0, n]) if kind == "GroupedLinear" else m(xx)
        y.backward(torch.ones_like(y))
        if name == "delayed":
            m.backward_dw()
        out[name] = {"y": y, "x.grad": xx.grad, **snapshot(m)}
    for key, value in out["impl"].items():
        torch.testing.assert_close(out["delayed"][key], value, rtol=0, atol=0, msg=key)
        if value is not None and "bias" not in key:
            _assert_fp8_close(
                key, value.cpu(), out["ref"][key].cpu(), out["high"][key].cpu(), torch.bfloat16
            )


# ---- frozen parameters, no bias, freeing -----------------------------------------------------


@pytest.mark.parametrize("recipe_id", ["delayed-max", "mxfp8"])
@pytest.mark.parametrize(
    "kind, frozen, bias",
    [
        ("Linear", ["weight"], True),
        ("Linear", [], False),
        ("LayerNormLinear", ["layer_norm_weight", "layer_norm_bias"], False),
        ("LayerNormMLP", ["fc1_weight"], True),
        ("LayerNormMLP", ["fc2_weight", "fc2_bias"], True),
        ("GroupedLinear", ["weight2", "bias0"], True),
    ],
)
def test_frozen_and_biasless_modules_split_bitwise_and_match_reference(
    recipe_id, kind, frozen, bias
):
    """Frozen parameters get no gradient and no kept copy; the rest is bitwise delayed ≡ plain
    and within the reference budget; histories of the bitwise roles equal the reference's."""
    recipe = RECIPES[recipe_id]
    modules = {}
    for name, lib, delay, fp8 in (
        ("plain", impl, False, True),
        ("delayed", impl, True, True),
        ("ref", ref, False, True),
        ("high", ref, False, False),
    ):
        m = build_fp8(lib, kind, recipe, dtype=torch.float32, delay=delay, bias=bias)
        for pname, p in m.named_parameters():
            p.requires_grad_(pname not in frozen)
        modules[name] = (m, fp8)
    outs = {}
    for step in range(2):
        for name, (m, fp8) in modules.items():
            x, y = fp8_step(m, recipe, step, fp8=fp8)
            outs[name] = {"y": y, "x.grad": x.grad}
        modules["delayed"][0].backward_dw()
    for name, (m, _) in modules.items():
        outs[name].update(snapshot(m))
        for pname in frozen:
            assert outs[name][f"{pname}.grad"] is None
    for key, value in outs["plain"].items():
        if value is None:
            continue
        torch.testing.assert_close(outs["delayed"][key], value, rtol=0, atol=0, msg=key)
        _assert_fp8_close(key, value, outs["ref"][key], outs["high"][key], torch.float32)


def test_fp8_entry_tensors_are_freed_after_backward_dw():
    from torch.multiprocessing.reductions import StorageWeakRef

    recipe = RECIPES["mxfp8"]
    module = build_fp8(impl, "LayerNormMLP", recipe, dtype=torch.bfloat16, delay=True)
    fp8_step(module, recipe, 0)
    (entry,) = list(module._wgrad_store)
    # saved = (fc2 dy, scale, act_out, scale, fc1 dy, scale, ln_out, scale, db2, db1); the bias
    # gradients move into .grad, every FP8 operand and scale must die.
    operands = entry.saved[:8]
    assert all(t is not None for t in operands)
    refs = [StorageWeakRef(t.untyped_storage()) for t in operands]
    del entry, operands
    module.backward_dw()
    assert not [r for r in refs if not r.expired()]


@pytest.mark.parametrize(
    "recipe",
    [
        ref.MXFP8BlockScaling(fp8_format=ref.Format.HYBRID),
        ref.Float8BlockScaling(fp8_format=ref.Format.HYBRID),
    ],
    ids=["mxfp8-hybrid", "block-hybrid"],
)
@pytest.mark.parametrize(
    "case", ["negative-zeros", "zeros", "nan", "inf", "saturating", "subnormal-amax"]
)
def test_p13_block_recipes_under_hybrid(recipe, case):
    """Block recipes honour Format.HYBRID (E5M2 gradients) identically on both sides."""
    assert ifp8.fp8_format(recipe, "grad_output") == "E5M2"
    test_p13_pinned_edge_cases(recipe, case)
