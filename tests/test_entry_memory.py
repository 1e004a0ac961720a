"""The memory one queued wgrad entry holds at real scale (hidden 8192, ffn 28672, 4096 tokens,
64 experts), computed exactly on fake tensors by ``splitgrad.bench.entry_memory``: what is alive
between B and W is the entry and nothing else, each entry is its floor plus exactly what impl
adds, torch's generic split holds more, and the table in docs/figures.md is this table."""

from __future__ import annotations

from pathlib import Path

import pytest
from splitgrad.bench import entry_memory as em

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures.md"
S = em.SCALE


@pytest.fixture(scope="module")
def table():
    return em.rows()


def _db_bytes(kind: str, precision: str) -> int:
    """The bias gradients an FP8 entry keeps (bf16, summed from dy during backward); a bf16
    entry keeps dy itself and sums it at W."""
    if precision == "bf16":
        return 0
    if kind == "Linear":
        return 2 * S.ffn
    if kind == "LayerNormMLP":
        return 2 * (S.ffn + S.hidden)
    groups = sum(1 for n in em.splits(kind, precision, S) if n)
    return 2 * S.ffn * groups + 2 * S.ffn * (S.experts - groups)


def test_held_between_b_and_w_is_the_entry(table):
    """After B, with the caller's references dropped, exactly the entry's bytes stay alive:
    no temporary, copy or reference cycle outlives the backward."""
    assert len(table) == len(em.KINDS) * len(em.PRECISIONS)
    for r in table:
        assert r["pending"] == 1, r
        assert r["held_bytes"] == r["entry_bytes"], r


def test_entries_are_their_floor_plus_what_impl_adds(table):
    """bf16: the operands and nothing else. FP8: the FP8 copies and scales, plus the bias
    gradients; MXFP8 also stores its E8M0 scales as fp32 (3 more bytes per 32 values)."""
    for r in table:
        kind, precision = r["module"], r["precision"]
        extra = _db_bytes(kind, precision)
        if precision == "mxfp8":
            values = sum(
                rows * (k + n)
                for rows, k, n in em._gemm_operands(kind, S, em.splits(kind, precision, S))
            )
            extra += 3 * (values // 32)
        assert r["entry_bytes"] == r["floor_bytes"] + extra, r


def test_floor_values():
    """The floor's arithmetic, on the Linear (4096 x (8192 + 28672) values)."""
    values = S.tokens * (S.hidden + S.ffn)
    assert em.floor_bytes("Linear", "bf16", S) == 2 * values
    assert em.floor_bytes("Linear", "current", S) == values + 8
    assert em.floor_bytes("Linear", "mxfp8", S) == values + values // 32
    assert em.floor_bytes("Linear", "block", S) == values + 4 * (values // 128)


def test_generic_split_holds_more(table):
    """torch's stage_backward_input keeps the graph's saved activations and intermediate
    gradients (x.grad included) until W: for the MLP 5 hidden-wide and 3 ffn-wide activations
    of every token (plus the norm's statistics) against impl's 2 and 2."""
    generic = {r["module"]: r["generic_held_bytes"] for r in table if "generic_held_bytes" in r}
    held = {r["module"]: r["held_bytes"] for r in table if r["precision"] == "bf16"}
    t, h, f = S.tokens, S.hidden, S.ffn
    mlp = 2 * t * (5 * h + 3 * f)
    assert mlp <= generic["LayerNormMLP"] <= mlp + 2**20
    assert held["LayerNormMLP"] == 2 * t * (2 * h + 2 * f)
    for kind in ("Linear", "GroupedLinear"):
        assert generic[kind] == held[kind] + 2 * t * h  # x.grad, kept with x until W


def test_figures_table_is_this_table(table):
    """docs/figures.md's memory table is exactly what ``python -m splitgrad.bench.entry_memory
    --markdown`` prints."""
    assert em.markdown(table) in FIGURES.read_text()


@pytest.mark.cuda
def test_gpu_figures_equal_fake_ones():
    """On a GPU, with the autograd engine and real allocations, the same protocol measures the
    same bytes as the fake-tensor run (smaller shapes here; ci/device.sh runs the real ones)."""
    scale = em.Scale(hidden=1024, ffn=2048, tokens=512, experts=8)
    for kind in em.KINDS:
        for precision in em.PRECISIONS:
            fake = em.measure(kind, precision, scale, "fake")
            real = em.measure(kind, precision, scale, "cuda")
            for key in ("entry_bytes", "held_bytes"):
                assert real[key] == fake[key], (kind, precision, key, real, fake)
