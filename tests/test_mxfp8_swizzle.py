"""The MXFP8 scale layout impl hands the block-scaled CUDA GEMM, checked by value on the CPU.

``F.scaled_mm`` with ``BlockWise1x32`` scales and ``SWIZZLE_32_4_4`` reads each E8M0 scale at a
position cuBLAS documents ("1D Block Scaling Factors Layout",
https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout): 128x4 blocks of scales,
row-major block order, each block stored as 32 lines of 4x4 (row ``r`` of the block in line
``r % 32``, columns ``4 * (r // 32) + c``). Shapes and torch's meta checks accept the scales in
any order, so the fake-CUDA trace cannot see a misplaced scale; here every scale's position is
compared, bit for bit, with an index-by-index loop over that documented formula
(:func:`splitgrad.properties.checks.paths.mx_scale_offset`, the harness's reading of the
documentation, written without impl), for shapes that need padding and for empty ones, and each
GEMM orientation's operands are decoded from what reaches ``F.scaled_mm`` and compared with the
values the portable path multiplies. ``splitgrad verify --impl-path mxfp8_scaled`` runs the same
layout through the modules (a CPU stand-in of the GEMM reads the scales by the formula); the two
swizzle mutants of ``ci/mutants.py`` are planted here and must be caught.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from splitgrad.impl import fp8_gemm
from splitgrad.impl.fp8 import quantize
from splitgrad.properties.checks import paths
from splitgrad.reference.fp8 import MXFP8BlockScaling

ROOT = Path(__file__).resolve().parent.parent
E8M0 = torch.float8_e8m0fnu
# Shapes (outer rows, scales per row): exact tiles, padding in one or both directions, one tile
# plus one, several tiles each way, and empty ones (an expert with no tokens).
PINNED = [(1, 1), (31, 3), (32, 4), (33, 5), (127, 3), (128, 4), (129, 5), (256, 8), (300, 7)]
EMPTY = [(0, 0), (0, 3), (5, 0), (0, 4), (128, 0)]


def _scales(rows: int, cols: int, seed: int) -> torch.Tensor:
    """(rows, cols) powers of two as fp32 (what ``_mx_blocked`` takes): all distinct where
    E8M0's 254 finite values allow it, so any two swapped positions differ."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols
    if n <= 200:
        exponents = torch.randperm(200, generator=g)[:n] - 100
    else:
        exponents = torch.randint(-100, 100, (n,), generator=g)
    return torch.exp2(exponents.double()).float().reshape(rows, cols)


def _documented_swizzle(scale: torch.Tensor) -> torch.Tensor:
    """The flat E8M0 buffer the documented layout gives ``scale``: one index at a time, the
    padding (positions no scale maps to) holding 1.0 as impl documents for its padding."""
    rows, cols = scale.shape
    out = torch.ones(paths.mx_scales_size(rows, cols), dtype=torch.float32)
    for r in range(rows):
        for c in range(cols):
            out[paths.mx_scale_offset(r, c, cols)] = scale[r, c]
    return out.to(E8M0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _layout_mismatch(swizzle, shapes, seed: int = 0) -> str | None:
    """The first shape at which ``swizzle`` disagrees with the documented layout, or None."""
    for rows, cols in shapes:
        scale = _scales(rows, cols, seed)
        got, want = swizzle(scale), _documented_swizzle(scale)
        if got.dtype != E8M0 or got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
            return f"({rows}, {cols}): {got.dtype} {tuple(got.shape)}"
    return None


def test_offsets_follow_the_documented_formula_on_worked_examples():
    """Worked from the documentation's description, by hand: a row's 4 scales sit side by side
    in its 16-byte line; rows 32 apart share a line, 4 bytes apart; the next block along K
    starts 512 bytes on; the next 128 rows start after all the blocks of the first 128."""
    assert [paths.mx_scale_offset(0, c, 4) for c in range(4)] == [0, 1, 2, 3]
    assert paths.mx_scale_offset(1, 0, 4) == 16
    assert paths.mx_scale_offset(32, 0, 4) == 4
    assert paths.mx_scale_offset(97, 2, 4) == 16 * 1 + 4 * 3 + 2
    assert paths.mx_scale_offset(0, 4, 8) == 512
    assert paths.mx_scale_offset(128, 0, 8) == 2 * 512  # two blocks along K per 128 rows
    assert paths.mx_scale_offset(128, 0, 5) == 2 * 512  # 5 scales pad to two blocks
    assert paths.mx_scales_size(129, 5) == 256 * 8
    # A bijection onto the unpadded positions of a full tile.
    offsets = {paths.mx_scale_offset(r, c, 4) for r in range(128) for c in range(4)}
    assert offsets == set(range(512))


@pytest.mark.parametrize("shape", PINNED + EMPTY, ids=str)
def test_mx_blocked_is_the_documented_layout(shape):
    """impl's swizzle equals the index-by-index layout, bit for bit, padding included."""
    assert _layout_mismatch(fp8_gemm._mx_blocked, [shape]) is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 400), cols=st.integers(0, 12), seed=st.integers(0, 2**16))
@example(rows=129, cols=1, seed=0)
@example(rows=1, cols=9, seed=0)
def test_mx_blocked_is_the_documented_layout_drawn(rows, cols, seed):
    assert _layout_mismatch(fp8_gemm._mx_blocked, [(rows, cols)], seed) is None


def test_unswizzle_inverts_the_documented_layout():
    """The stand-in's decoder (what ``verify --impl-path mxfp8_scaled`` runs) reads back every
    scale the loop placed, and refuses a buffer of the wrong size or dtype, naming it."""
    for rows, cols in PINNED + EMPTY:
        scale = _scales(rows, cols, 1)
        back = paths.mx_unswizzle(_documented_swizzle(scale), rows, cols)
        torch.testing.assert_close(back, scale, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="need 512 swizzled bytes, got 4"):
        paths.mx_unswizzle(torch.ones(4).to(E8M0), 2, 2)
    with pytest.raises(RuntimeError, match="float32"):
        paths.mx_unswizzle(torch.ones(512), 2, 2)


# ---- what reaches F.scaled_mm in each GEMM orientation ----------------------------------------


def _operands(m: int, n: int, k: int, seed: int):
    """q(x), q(W), q(dy) of a (m tokens, k in, n out) layer under MXFP8, values spread over
    many binades so neighbouring 32-blocks get different scales; per GEMM: (a, a_t, b, b_t)."""
    g = torch.Generator().manual_seed(seed)

    def spread(*shape):
        return torch.randn(*shape, generator=g) * torch.exp2(
            torch.randint(-6, 7, shape, generator=g)
        )

    recipe = MXFP8BlockScaling()
    x, w, dy = spread(m, k), spread(n, k), spread(m, n)
    return {
        "forward": (quantize(x, recipe, "input", 1), False, quantize(w, recipe, "weight", 1), True),
        "dgrad": (
            quantize(dy, recipe, "grad_output", 1),
            False,
            quantize(w, recipe, "weight", 0),
            False,
        ),
        "wgrad": (
            quantize(dy, recipe, "grad_output", 0),
            True,
            quantize(x, recipe, "input", 0),
            False,
        ),
    }


class _Recorder:
    """Stands in for ``F.scaled_mm``: keeps its arguments, returns zeros of the output shape."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, mat_a, mat_b, scale_a, recipe_a, scale_b, recipe_b, **kw):
        self.calls.append(dict(a=mat_a, b=mat_b, sa=scale_a, sb=scale_b, **kw))
        dtype = kw.get("output_dtype", torch.bfloat16)
        return torch.zeros(mat_a.shape[0], mat_b.shape[1], dtype=dtype)


@pytest.mark.parametrize(
    "m,n,k", [(32, 32, 32), (96, 160, 64), (160, 64, 288), (256, 128, 128), (288, 320, 416)]
)
def test_each_gemm_gets_its_scales_in_the_documented_layout(monkeypatch, m, n, k):
    """For forward, dgrad and wgrad (column-wise copies stored transposed, as the scaled path
    stores them): A and B decoded from the FP8 data and the swizzled scales handed to
    F.scaled_mm, by the documented layout, are exactly the operands the portable path
    multiplies (power-of-two scales: no rounding anywhere)."""
    F = torch.nn.functional
    recorder = _Recorder()
    monkeypatch.setattr(F, "scaled_mm", recorder)
    for role, (a, a_t, b, b_t) in _operands(m, n, k, m + n + k).items():
        a, b = a.with_layout(a_t), b.with_layout(not b_t)
        fp8_gemm._scaled_mm(a, a_t, b, b_t, torch.float32, None)
        call = recorder.calls.pop()
        assert call["swizzle_a"] == call["swizzle_b"] == F.SwizzleType.SWIZZLE_32_4_4, role
        A, B = call["a"], call["b"]
        (rows, depth), cols = A.shape, B.shape[1]
        sa = paths.mx_unswizzle(call["sa"], rows, depth // 32).repeat_interleave(32, dim=1)
        sb = paths.mx_unswizzle(call["sb"], cols, depth // 32).repeat_interleave(32, dim=1)
        got_a = A.float() * sa
        got_b = (B.t().float() * sb).t()
        want_a, _ = fp8_gemm._operand(a, a_t, torch.float32)
        want_b, _ = fp8_gemm._operand(b, b_t, torch.float32)
        torch.testing.assert_close(got_a, want_a, rtol=0, atol=0, msg=f"{role} A")
        torch.testing.assert_close(got_b, want_b, rtol=0, atol=0, msg=f"{role} B")


def test_stand_in_gemm_matches_the_portable_path():
    """The CPU stand-in verify runs (fp32 products and sums of the decoded operands) agrees with
    impl's dequantize path within fp32 summation order, in every orientation: it is a GEMM of
    the right operands, not only a layout decoder."""
    calls = []
    with paths.mx_scaled_mm_stand_in(lambda: calls.append(1)):
        for role, (a, a_t, b, b_t) in _operands(96, 160, 288, 3).items():
            a, b = a.with_layout(a_t), b.with_layout(not b_t)
            got = fp8_gemm._scaled_mm(a, a_t, b, b_t, torch.float32, None)
            want = fp8_gemm._dequantized_mm(a, a_t, b, b_t, torch.float32, None)
            A, _ = fp8_gemm._operand(a, a_t, torch.float32)
            B, _ = fp8_gemm._operand(b, b_t, torch.float32)
            # fp32 sums of the same products in another order: |A| @ |B| * K * 2^-24 bounds it.
            bound = (A.abs() @ B.abs()) * (A.shape[1] * 2.0**-24)
            assert bool(((got - want).abs() <= bound).all()), role
    assert len(calls) == 3
    assert torch.nn.functional.scaled_mm.__module__ == "torch.nn.functional"


# ---- the planted swizzle mutants -----------------------------------------------------------


def _cuda_branch_mutants():
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    return {m.name: m for m in mutants.CUDA_BRANCH_MUTANTS}


def _planted(mutant) -> object:
    """impl's ``_mx_blocked`` with ``mutant``'s edits applied to its source."""
    source = inspect.getsource(fp8_gemm._mx_blocked)
    for rel, old, new in mutant.edits:
        assert rel == "fp8_gemm.py" and old in source, f"{mutant.name}: edit does not apply"
        source = source.replace(old, new)
    namespace = dict(vars(fp8_gemm))
    exec(compile(source, "planted", "exec"), namespace)
    return namespace["_mx_blocked"]


@pytest.mark.parametrize("name", ["mx-swizzle-inner-transposed", "mx-swizzle-32-4-swapped"])
def test_planted_swizzle_mutants_are_caught(name):
    """ci/mutants.py's swizzle mutants, planted into _mx_blocked, fail the layout check (and
    only a layout that differs can: impl's own passes the same shapes above)."""
    planted = _planted(_cuda_branch_mutants()[name])
    assert _layout_mismatch(planted, PINNED) is not None


@pytest.mark.parametrize("name", ["mx-swizzle-inner-transposed", "mx-swizzle-32-4-swapped"])
def test_a_probe_that_rejects_a_planted_layout_is_not_the_path_running(name, monkeypatch):
    """Under the stand-in verify's ``mxfp8_scaled`` cells use, impl's probe GEMMs on a planted
    wrong layout: the probe says no, and none of its calls counts as the forced path running
    (they did once: the cells then passed on the dequantize path and the mutants survived)."""
    monkeypatch.setattr(fp8_gemm, "_mx_blocked", _planted(_cuda_branch_mutants()[name]))
    calls = []
    with paths.mx_scaled_mm_stand_in(lambda: calls.append(1)):
        assert not fp8_gemm.scaled_mm_works(torch.device("cpu"), "mx")
        assert calls == []
    assert not fp8_gemm.scaled_mm_works.cache_info().currsize  # no verdict outlives it
