"""``splitgrad.bench.tensor_parallel``: the memory a queued TP entry holds per rank at real scale
(hidden 8192, ffn 28672, 4096 tokens, tp 8, SP, bf16), computed on fake tensors over torch's
fake process group — what stays alive between B and W is the entry, each entry is its floor
(impl) or its floor plus what the reference adds, ``wgrad_gather="backward_dw"`` keeps the
sequence-parallel operand as the shard, and docs/figures.md's table is this table — and the
step-time command on 2 gloo ranks (its memory and bitwise checks; no timing is asserted)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from splitgrad.bench import tensor_parallel as tpb

FIGURES = Path(__file__).resolve().parents[1] / "docs" / "figures.md"
S = tpb.TP_SCALE


@pytest.fixture(scope="module")
def table():
    return tpb.memory_rows()


def test_held_between_b_and_w_is_the_entry(table):
    """After B, with the caller's references dropped, exactly what the queued entry reaches
    stays alive, in every package, module and mode; the fake group is gone afterwards."""
    assert len(table) == len(tpb.PACKAGES) * len(tpb.TP_KINDS) * len(tpb.GATHERS)
    for r in table:
        assert r["pending"] == 1, r
        assert r["held_bytes"] == r["entry_bytes"], r
    assert not dist.is_initialized()


def test_entries_against_the_floor(table):
    """Both packages: ``"backward"`` holds the operands as the GEMMs read them (the floor: a
    row GEMM's bias gradient sums this rank's rows of the gathered dy, no copy of its own),
    ``"backward_dw"`` the sequence-parallel one as the shard."""
    for r in table:
        mode = r["wgrad_gather"]
        want = r["shard_floor_bytes"] if mode == "backward_dw" else r["floor_bytes"]
        assert r["entry_bytes"] == want, r


def test_floor_values():
    """The floor's arithmetic at tp 8 (4096 tokens, 512 per rank; 3584 ffn columns per rank):
    a column layer's input and a row layer's dy are gathered, ``tp`` times the shard."""
    t, h, f = S.tokens, S.hidden, S.ffn // S.tp
    assert tpb.floor_bytes("Linear column", "backward") == 2 * (t * h + t * f)
    assert tpb.floor_bytes("Linear column", "backward_dw") == 2 * (t // 8 * h + t * f)
    assert tpb.floor_bytes("Linear row", "backward_dw") == 2 * (t * f + t // 8 * h)
    mlp = tpb.floor_bytes("LayerNormMLP swiglu", "backward")
    assert mlp == 2 * (t * h + t * 2 * f + t * f + t * h)
    assert mlp - tpb.floor_bytes("LayerNormMLP swiglu", "backward_dw") == 2 * 2 * (t - t // 8) * h


def test_figures_table_is_this_table(table):
    """docs/figures.md's TP memory table is exactly what ``python -m
    splitgrad.bench.tensor_parallel memory --markdown`` prints."""
    assert tpb.markdown(table) in FIGURES.read_text()


def test_fake_group_refuses_an_initialized_process():
    with tpb.fake_process_group(2):
        with pytest.raises(RuntimeError, match="already initialized"):
            with tpb.fake_process_group(2):
                pass
    assert not dist.is_initialized()


def test_fake_group_names_the_torch_version_when_it_moved(monkeypatch):
    import torch

    monkeypatch.setitem(sys.modules, "torch.testing._internal.distributed.fake_pg", None)
    moved = rf"torch {re.escape(torch.__version__)} has no .*FakeStore.*checked on torch 2\.13"
    with pytest.raises(RuntimeError, match=moved):
        with tpb.fake_process_group(2):
            pass
    assert not dist.is_initialized()


def test_command_line_refuses_unknown_packages(capsys):
    with pytest.raises(SystemExit) as exc:
        tpb.main(["memory", "--packages", "te"])
    assert exc.value.code == 2
    assert "unknown ['te']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tpb.main(["time", "--ranks", "2", "--tokens", "15"])
    assert "multiples of --ranks 2" in capsys.readouterr().err


@pytest.mark.distributed
def test_step_time_run_checks_gradients_and_memory():
    """Two tiny layers on 2 gloo ranks: the two modes' gradients are bitwise equal, and the
    stack holds between B and W exactly its entries' operands, the gathered ones (ln_out and
    dy of each layer: 16 tokens) as the 8-token shard in ``"backward_dw"`` mode. Timings are
    reported, not asserted."""
    cfg = tpb.TimingConfig(layers=2, hidden=32, ffn=64, tokens=16, reps=2, warmup=1)
    result = tpb.run_timing(cfg, timeout_s=240)
    assert result["mismatched"] == []
    t, h, f, layers = 16, 32, 64 // 2, 2
    fp32 = 4
    held = {mode: m["held_bytes"] for mode, m in result["modes"].items()}
    assert held["backward"] == layers * fp32 * (2 * t * h + 2 * t * f)
    assert held["backward_dw"] == layers * fp32 * (2 * (t // 2) * h + 2 * t * f)
    for m in result["modes"].values():
        assert m["b_ms"] > 0 and m["w_ms"] > 0 and m["step_ms"] > 0
    text = tpb.timing_text(result)
    assert "bitwise equal" in text and "backward_dw / backward" in text


@pytest.mark.distributed
def test_collectives_table():
    """docs/tensor-parallel.md's collectives table is what ``python -m
    splitgrad.bench.tensor_parallel collectives --markdown`` prints (impl), the reference
    issues the same collectives in each phase (in its own order), and what the table shows
    holds: ``"backward"`` mode's ``backward_dw()`` communicates nothing, ``"backward_dw"``
    mode's gathers the SP operand there, each after an order tag."""
    rows = tpb.collective_rows(("impl", "reference"))
    impl = [r for r in rows if r["package"] == "impl"]
    ref = [r for r in rows if r["package"] == "reference"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "tensor-parallel.md").read_text()
    assert tpb.collectives_markdown(impl) in doc
    for a, b in zip(impl, ref, strict=True):
        for phase in ("forward", "backward", "backward_dw"):
            assert sorted(a[phase]) == sorted(b[phase]), (a, b)
    for r in impl:
        if r["sequence_parallel"] and r["wgrad_gather"] == "backward_dw":
            w = r["backward_dw"]
            assert w and w[::2] == ["order tag"] * (len(w) // 2), r
            assert all(c.startswith("all-gather s×h") for c in w[1::2]), r
        else:
            assert r["backward_dw"] == [], r


SMALL = tpb.TPScale(hidden=64, ffn=256, tokens=64, tp=8)


def test_real_tensors_hold_what_fake_ones_do():
    """The same protocol on real CPU tensors (the autograd engine, real storages) measures the
    fake-tensor bytes, in every package, module and mode."""
    fake = tpb.memory_rows(SMALL, device="fake")
    real = tpb.memory_rows(SMALL, device="cpu")
    for f, r in zip(fake, real, strict=True):
        for key in ("entry_bytes", "held_bytes", "pending"):
            assert r[key] == f[key], (key, r, f)


@pytest.mark.cuda
def test_gpu_holds_what_fake_tensors_do():
    """On a GPU (real CUDA tensors, bf16 GEMMs, the packages' CUDA paths; the group is still
    the fake one), one delayed backward of each TP module holds the fake-tensor bytes, and the
    allocator grew by at least that much."""
    scale = tpb.TPScale(hidden=1024, ffn=4096, tokens=1024, tp=8)
    fake = tpb.memory_rows(scale, device="fake")
    gpu = tpb.memory_rows(scale, device="cuda")
    for f, g in zip(fake, gpu, strict=True):
        for key in ("entry_bytes", "held_bytes", "pending"):
            assert g[key] == f[key], (key, g, f)
        assert g["allocated_bytes"] >= g["held_bytes"], g
