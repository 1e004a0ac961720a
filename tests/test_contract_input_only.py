"""SPEC §3, "only what the backward asks for" (P17), on both sources.

A backward that does not compute a parameter's gradient -- ``torch.autograd.grad(y, x)``,
``y.backward(inputs=[...])`` without it -- writes nothing to its ``.grad`` / ``main_grad`` and
queues nothing for it; no entry at all (and no hook) when no GEMM parameter is asked for.
``torch.autograd.grad`` asking for a GEMM parameter gets the gradient *returned*, exactly the
value a plain (non-fused) full backward writes into an empty ``.grad``, with nothing written or
queued. Every subset of parameters is tried; values are compared bitwise with the same source's
full backward (the same closures and formulas run).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from cases import KINDS, build, fill, forward, make_dy, make_input, prefill_grads, snapshot

MODES = ("autograd.grad", "backward(inputs)")


def _gemm_names(module) -> set[str]:
    return {n for n, _ in module.named_parameters() if not n.startswith("layer_norm")}


def _subsets(names: list[str]):
    for r in range(len(names) + 1):
        yield from itertools.combinations(names, r)


def _full_run(lib, kind, *, delay, fused, dtype):
    """Gradients of a plain full backward from empty ``.grad`` (the values any subset must get)."""
    m = build(lib, kind, delay=delay, fused=False, dtype=dtype)
    fill(m, 0)
    x = make_input(m, 1)
    y = forward(m, x)
    y.backward(make_dy(m, y, 1))
    while m.pending_wgrad_count:
        m.backward_dw()
    grads = {n: p.grad for n, p in m.named_parameters()}
    return x.grad, grads


def _prefilled(lib, kind, *, delay, fused, dtype):
    m = build(lib, kind, delay=delay, fused=fused, dtype=dtype)
    fill(m, 0)
    # Fused: main_grad prefilled and .grad None on GEMM weights; plain: .grad prefilled.
    prefill_grads(m, 2, fused=fused)
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
@pytest.mark.parametrize("kind", KINDS)
def test_only_asked_parameters_get_gradients(lib, kind, delay, fused, mode, dtype):
    dx_full, full = _full_run(lib, kind, delay=delay, fused=fused, dtype=dtype)
    # What a full backward writes on top of the same prefill: asked-for parameters end there.
    twin = _prefilled(lib, kind, delay=delay, fused=fused, dtype=dtype)
    x = make_input(twin, 1)
    y = forward(twin, x)
    y.backward(make_dy(twin, y, 1))
    while twin.pending_wgrad_count:
        twin.backward_dw()
    full_end = snapshot(twin)
    names = [n for n, _ in twin.named_parameters()]
    for subset in _subsets(names):
        m = _prefilled(lib, kind, delay=delay, fused=fused, dtype=dtype)
        before = snapshot(m)
        fired = []
        m.register_wgrad_accumulation_and_reduce_hooks(lambda fired=fired: fired.append(1))
        params = dict(m.named_parameters())
        x = make_input(m, 1)
        y = forward(m, x)
        dy = make_dy(m, y, 1)
        asked = [params[n] for n in subset]
        where = f"{kind} asked for x + {list(subset)} via {mode}"
        if mode == "autograd.grad":
            got = torch.autograd.grad(y, [x, *asked], dy)
            torch.testing.assert_close(got[0], dx_full, rtol=0, atol=0, msg=where)
            for name, g in zip(subset, got[1:]):
                torch.testing.assert_close(g, full[name], rtol=0, atol=0, msg=f"{where}: {name}")
            assert x.grad is None, where
            assert m.pending_wgrad_count == 0, where
            assert not fired, f"{where}: a hook fired"
            expected_end = before
        else:
            y.backward(dy, inputs=[x, *asked])
            torch.testing.assert_close(x.grad, dx_full, rtol=0, atol=0, msg=where)
            asked_gemm = _gemm_names(m) & set(subset)
            assert m.pending_wgrad_count == (1 if delay and asked_gemm else 0), where
            if delay and asked_gemm:
                assert not fired, f"{where}: a hook fired before backward_dw()"
                m.backward_dw()
            assert len(fired) == (1 if asked_gemm else 0), f"{where}: hooks fired {len(fired)}x"
            expected_end = {
                key: full_end[key] if key.split(".")[0] in subset else value
                for key, value in before.items()
            }
        after = snapshot(m)
        for key, value in expected_end.items():
            if value is None:
                assert after[key] is None, f"{where}: {key} was written"
            else:
                torch.testing.assert_close(after[key], value, rtol=0, atol=0, msg=f"{where}: {key}")


@pytest.mark.parametrize("kind", KINDS)
def test_input_only_backward_queues_nothing_across_microbatches(lib, kind):
    """The pattern of pipelining's metadata inference: an input-only backward between two
    real ones leaves the queue of the real ones exactly as it was (FIFO order kept)."""
    m = build(lib, kind, delay=True)
    fill(m, 0)
    for seed in (1, 2):
        x = make_input(m, seed)
        y = forward(m, x)
        if seed == 2:
            torch.autograd.grad(y, x, make_dy(m, y, seed))
        else:
            y.backward(make_dy(m, y, seed))
    assert m.pending_wgrad_count == 1
    m.backward_dw()
    assert m.pending_wgrad_count == 0
    ref = build(lib, kind, delay=False)
    fill(ref, 0)
    x = make_input(ref, 1)
    y = forward(ref, x)
    y.backward(make_dy(ref, y, 1))
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("recipe", ["current", "delayed"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_only_asked_parameters_under_fp8(lib, kind, mode, recipe):
    """The same under FP8, delayed: each GEMM weight alone, and none (input only)."""
    make_recipe = {"current": lib.Float8CurrentScaling, "delayed": lib.DelayedScaling}[recipe]

    def run(subset, full=False):
        m = build(lib, kind, delay=True, dtype=torch.bfloat16)
        fill(m, 0)
        params = dict(m.named_parameters())
        x = make_input(m, 1)
        with lib.fp8_autocast(enabled=True, fp8_recipe=make_recipe()):
            y = forward(m, x)
        dy = make_dy(m, y, 1)
        if full:
            y.backward(dy)
            while m.pending_wgrad_count:
                m.backward_dw()
            return m, x.grad, {n: p.grad for n, p in params.items()}
        if mode == "autograd.grad":
            got = torch.autograd.grad(y, [x, *(params[n] for n in subset)], dy)
            return m, got[0], dict(zip(subset, got[1:]))
        y.backward(dy, inputs=[x, *(params[n] for n in subset)])
        while m.pending_wgrad_count:
            m.backward_dw()
        return m, x.grad, {n: params[n].grad for n in subset}

    _, dx_full, full = run((), full=True)
    names = [n for n, _ in build(lib, kind).named_parameters()]
    for subset in [()] + [(n,) for n in names if n not in ("layer_norm_weight", "layer_norm_bias")]:
        m, dx, got = run(subset)
        where = f"{kind} {recipe} asked for x + {list(subset)} via {mode}"
        torch.testing.assert_close(dx, dx_full, rtol=0, atol=0, msg=where)
        for name, p in m.named_parameters():
            if name in subset:
                torch.testing.assert_close(got[name], full[name], rtol=0, atol=0, msg=where)
                if mode == "autograd.grad":
                    assert p.grad is None, f"{where}: {name}.grad written"
            else:
                assert p.grad is None, f"{where}: {name}.grad written"
