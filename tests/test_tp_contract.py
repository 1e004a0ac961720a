"""SPEC §9, the shared contract of tensor parallelism, checked absolutely (both packages share
this code, so no differential check could see a bug in it): per-rank shapes, Megatron's
parameter attributes (kept through ``to_empty`` from meta), TP size 1 changing nothing bitwise,
and every bad input refused with a ``ValueError`` naming the value before any collective."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.distributed as dist
from splitgrad.distributed import run_ranks

pytestmark = pytest.mark.distributed

PACKAGES = ("splitgrad.reference", "splitgrad.impl")


def _shapes_and_attributes(rank: int, world: int, lib_name: str) -> dict:
    lib = importlib.import_module(lib_name)
    g = dist.group.WORLD
    out = {}
    col = lib.Linear(16, 8, tp_group=g, parallel_mode="column", sequence_parallel=True)
    row = lib.Linear(16, 8, tp_group=g, parallel_mode="row", sequence_parallel=True)
    lnl = lib.LayerNormLinear(16, 8, tp_group=g, parallel_mode="column", sequence_parallel=True)
    mlp = lib.LayerNormMLP(
        16, 12, tp_group=g, set_parallel_mode=True, sequence_parallel=True, activation="swiglu"
    )
    with torch.device("meta"):
        meta = lib.LayerNormMLP(
            16,
            12,
            tp_group=g,
            set_parallel_mode=True,
            sequence_parallel=True,
            delay_wgrad_compute=True,
        )
    meta.to_empty(device="cpu")
    grouped = lib.GroupedLinear(3, 16, 8, tp_size=world, parallel_mode="row", bias=False)
    for name, m in (
        ("col", col),
        ("row", row),
        ("lnl", lnl),
        ("mlp", mlp),
        ("meta", meta),
        ("grouped", grouped),
    ):
        out[name] = {
            n: (
                tuple(p.shape),
                getattr(p, "tensor_model_parallel", None),
                getattr(p, "partition_dim", None),
                getattr(p, "partition_stride", None),
                getattr(p, "sequence_parallel", None),
                getattr(p, "skip_backward_post_hook", None),
            )
            for n, p in m.named_parameters()
        }
    out["sizes"] = (
        col.in_features,
        col.out_features,
        row.in_features,
        row.out_features,
        mlp.ffn_hidden_size,
        mlp.size_per_partition,
        col.tp_size,
    )
    out["repr"] = repr(row)
    return out


@pytest.mark.parametrize("lib_name", PACKAGES)
def test_shapes_and_parameter_attributes(lib_name):
    results = run_ranks(_shapes_and_attributes, 2, lib_name, timeout_s=120)
    assert results[0] == results[1]
    r = results[0]
    tp = (True, 0, 1, None, None)
    assert r["col"] == {"weight": ((4, 16), *tp), "bias": ((4,), *tp)}
    assert r["row"] == {
        "weight": ((8, 8), True, 1, 1, None, None),
        "bias": ((8,), None, None, None, True, None),
    }
    assert r["lnl"]["layer_norm_weight"] == ((16,), None, None, None, True, None)
    assert r["lnl"]["layer_norm_bias"] == ((16,), None, None, None, True, None)
    assert r["lnl"]["weight"] == ((4, 16), *tp)
    # swiglu: fc1 holds the rank's gate rows and its up rows, 2 * 12 / 2 of them.
    assert r["mlp"]["fc1_weight"] == ((12, 16), *tp)
    assert r["mlp"]["fc1_bias"] == ((12,), *tp)
    assert r["mlp"]["fc2_weight"] == ((16, 6), True, 1, 1, None, None)
    assert r["mlp"]["fc2_bias"] == ((16,), None, None, None, True, None)
    # Built on meta and materialized: the attributes survive to_empty's new Parameters.
    assert r["meta"]["fc2_weight"] == ((16, 6), True, 1, 1, None, True)
    assert r["meta"]["fc2_bias"] == ((16,), None, None, None, True, True)
    assert r["meta"]["layer_norm_weight"][4] is True
    assert r["grouped"]["weight0"] == ((8, 8), True, 1, 1, None, None)
    # As TransformerEngine: in/out_features become the rank's sizes; ffn_hidden_size stays.
    assert r["sizes"] == (16, 4, 8, 8, 12, 6, 2)
    assert "parallel_mode='row'" in r["repr"] and "sequence_parallel=True" in r["repr"]


def _bad_inputs(rank: int, world: int, lib_name: str) -> list[str]:
    lib = importlib.import_module(lib_name)
    g = dist.group.WORLD
    errors = []

    def expect(fn):
        try:
            fn()
        except ValueError as e:
            errors.append(str(e))
        else:
            errors.append("no error")

    expect(lambda: lib.Linear(16, 8, tp_group=g, parallel_mode="diagonal"))
    expect(lambda: lib.Linear(16, 8, tp_size=2, parallel_mode="column"))
    expect(lambda: lib.Linear(16, 9, tp_group=g, parallel_mode="column"))
    expect(lambda: lib.Linear(15, 8, tp_group=g, parallel_mode="row"))
    expect(lambda: lib.Linear(16, 8, tp_group=g, tp_size=4, parallel_mode="row"))
    expect(lambda: lib.LayerNormLinear(16, 8, tp_group=g, parallel_mode="row"))
    expect(lambda: lib.LayerNormMLP(16, 8, tp_group=g))
    expect(lambda: lib.GroupedLinear(2, 16, 8, tp_size=2, parallel_mode="column"))
    expect(lambda: lib.Linear(16, 8, tp_group=g, parallel_mode="row", wgrad_gather="never"))
    # A group without this rank: the module is refused on the ranks outside it.
    solo = dist.new_group([0])
    if rank == 1:
        expect(lambda: lib.Linear(16, 8, tp_group=solo, parallel_mode="column"))
    else:
        errors.append("not refused on the group's own rank")
    # Under SP a row layer reduce-scatters dim 0: 3 rows do not split over 2 ranks; and an
    # input without a sequence dimension. Both refused before any collective (a rank that
    # entered one would hang, since the other refuses too).
    row = lib.Linear(16, 8, tp_group=g, parallel_mode="row", sequence_parallel=True)
    expect(lambda: row(torch.randn(3, 2, 8)))
    expect(lambda: row(torch.randn(8)))
    return errors


@pytest.mark.parametrize("lib_name", PACKAGES)
def test_bad_input_raises_before_any_collective(lib_name):
    results = run_ranks(_bad_inputs, 2, lib_name, timeout_s=120)
    e = results[1]
    assert "'diagonal'" in e[0]
    assert "tp_size=2" in e[1] and "tp_group" in e[1]
    assert "out_features=9" in e[2]
    assert "in_features=15" in e[3]
    assert "tp_size=4" in e[4]
    assert "parallel_mode='row'" in e[5]
    assert "set_parallel_mode=True" in e[6]
    assert "bias=True" in e[7]
    assert "'never'" in e[8]
    assert "does not contain this process" in e[9]
    assert results[0][9] == "not refused on the group's own rank"
    assert "3" in e[10] and "tp_size=2" in e[10]
    assert "(8,)" in e[11]


def _size_one_changes_nothing(rank: int, world: int, lib_name: str) -> int:
    """A TP size of 1 (a one-rank group) changes nothing, bitwise."""
    lib = importlib.import_module(lib_name)
    solo = dist.new_group([rank]) if world > 1 else dist.group.WORLD
    checked = 0
    for build, tp_kwargs in (
        (lambda **k: lib.Linear(16, 8, **k), dict(parallel_mode="column")),
        (lambda **k: lib.Linear(16, 8, **k), dict(parallel_mode="row", sequence_parallel=True)),
        (lambda **k: lib.LayerNormLinear(16, 8, **k), dict(parallel_mode="column")),
        (lambda **k: lib.LayerNormMLP(16, 8, **k), dict(set_parallel_mode=True)),
    ):
        grads = []
        for kwargs in ({}, dict(tp_group=solo, **tp_kwargs)):
            torch.manual_seed(0)
            m = build(delay_wgrad_compute=True, **kwargs)
            x = torch.randn(4, 3, 16, requires_grad=True)
            y = m(x)
            y.square().sum().backward()
            m.backward_dw()
            grads.append([y, x.grad, *(p.grad for p in m.parameters())])
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            checked += 1
    return checked


@pytest.mark.parametrize("lib_name", PACKAGES)
def test_tp_size_one_changes_nothing(lib_name):
    assert all(n > 0 for n in run_ranks(_size_one_changes_nothing, 1, lib_name, timeout_s=60))


def _w_out_of_order(rank: int, world: int, lib_name: str) -> list[str]:
    """wgrad_gather="backward_dw": two same-shaped layers whose W steps two ranks run in
    opposite orders. Their gathers would pair one layer's shard with the other's (a silently
    wrong gradient, since the shapes agree); instead every rank raises, naming both, and the
    entries stay queued."""
    lib = importlib.import_module(lib_name)
    g = dist.group.WORLD
    kw = dict(
        tp_group=g,
        parallel_mode="column",
        sequence_parallel=True,
        delay_wgrad_compute=True,
        wgrad_gather="backward_dw",
    )
    a, b = lib.Linear(8, 8, **kw), lib.Linear(8, 8, **kw)
    x = torch.randn(2, 3, 8, requires_grad=True)
    (a(x).sum() + b(x).sum()).backward()
    first, second = (a, b) if rank == 0 else (b, a)
    try:
        first.backward_dw()
        return ["no error"]
    except RuntimeError as e:
        message = str(e)
    # Nothing written, both entries still queued; in the same order the W steps then work.
    state = [
        a.weight.grad is None,
        b.weight.grad is None,
        a.pending_wgrad_count,
        b.pending_wgrad_count,
    ]
    a.backward_dw()
    b.backward_dw()
    return [message, state, a.weight.grad is not None and b.weight.grad is not None]


@pytest.mark.parametrize("lib_name", PACKAGES)
def test_backward_dw_order_mismatch_raises_on_every_rank(lib_name):
    for rank, (message, state, written) in enumerate(
        run_ranks(_w_out_of_order, 2, lib_name, timeout_s=120)
    ):
        assert "same order" in message and f"rank {1 - rank}: module #" in message
        assert state == [True, True, 1, 1]
        assert written
