"""SPEC §3–§4 on every module source (``lib`` is splitgrad.reference or splitgrad.impl)."""

from __future__ import annotations

import itertools
import weakref

import pytest
import torch
from cases import (
    KINDS,
    assert_same,
    build,
    fill,
    forward,
    gemm_param_names,
    gemm_weight_names,
    make_dy,
    make_input,
    microbatch,
    prefill_grads,
    snapshot,
    twin_pair,
)
from torch.multiprocessing.reductions import StorageWeakRef

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_delayed_equals_non_delayed_bitwise(lib, kind, dtype, bias, fused):
    plain, delayed = twin_pair(lib, kind, dtype=dtype, bias=bias, fused=fused)
    xp, yp = microbatch(plain, seed=3)
    xd, yd = microbatch(delayed, seed=3)
    assert delayed.pending_wgrad_count == 1
    torch.testing.assert_close(yd, yp, rtol=0, atol=0)
    torch.testing.assert_close(xd.grad, xp.grad, rtol=0, atol=0)
    delayed.backward_dw()
    assert delayed.pending_wgrad_count == 0
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_microbatches_queued_then_drained(lib, kind, fused):
    plain, delayed = twin_pair(lib, kind, dtype=torch.bfloat16, fused=fused)
    for step in range(3):
        first = step == 0
        microbatch(plain, seed=10 + step, is_first_microbatch=first)
        microbatch(delayed, seed=10 + step, is_first_microbatch=first)
        assert delayed.pending_wgrad_count == step + 1
    for left in (2, 1, 0):
        delayed.backward_dw()
        assert delayed.pending_wgrad_count == left
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_schedule(lib, kind):
    """fwd/bwd 0, fwd/bwd 1, dw 0, fwd/bwd 2, dw 1, dw 2 ≡ the non-delayed run (FIFO order)."""
    plain, delayed = twin_pair(lib, kind, dtype=torch.float32, fused=True)
    for seed in (20, 21, 22):
        microbatch(plain, seed)
    microbatch(delayed, 20)
    microbatch(delayed, 21)
    delayed.backward_dw()
    microbatch(delayed, 22)
    delayed.backward_dw()
    delayed.backward_dw()
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_between_backward_and_backward_dw(lib, kind, fused):
    """P5: input and norm grads final, GEMM-parameter grads and main_grad untouched, no hook."""
    plain, delayed = twin_pair(lib, kind, dtype=torch.float32, fused=fused)
    calls = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append("hook"))
    before = snapshot(delayed)
    xp, _ = microbatch(plain, seed=5)
    xd, _ = microbatch(delayed, seed=5)
    torch.testing.assert_close(xd.grad, xp.grad, rtol=0, atol=0)
    after, final = snapshot(delayed), snapshot(plain)
    gemm = set(gemm_param_names(delayed))
    for key in after:
        name = key.split(".")[0]
        expected = before[key] if name in gemm else final[key]
        if expected is None:
            assert after[key] is None, key
        else:
            torch.testing.assert_close(after[key], expected, rtol=0, atol=0, msg=key)
    assert calls == []
    delayed.backward_dw()
    assert calls == ["hook"]


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_fire_in_order_once_per_entry(lib, kind):
    plain, delayed = twin_pair(lib, kind, fused=True)
    calls = []
    for i in range(3):
        delayed.register_wgrad_accumulation_and_reduce_hooks(lambda i=i: calls.append(i))
    for seed in (1, 2):
        microbatch(delayed, seed)
    assert calls == []
    delayed.backward_dw()
    assert calls == [0, 1, 2]
    delayed.backward_dw()
    assert calls == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize("kind", KINDS)
def test_raising_post_accumulate_hook_consumes_the_entry(lib, kind):
    """SPEC §4: a hook that raises inside backward_dw() finds the gradients written and the
    entry consumed, so nothing is written twice (impl once left the entry queued and a second
    backward_dw() doubled the gradient)."""
    plain, delayed = twin_pair(lib, kind, fused=False)
    microbatch(plain, 4)
    expected = snapshot(plain)
    name = gemm_weight_names(delayed)[0]
    param = dict(delayed.named_parameters())[name]

    def raising(p):
        raise ValueError("post-accumulate hook")

    handle = param.register_post_accumulate_grad_hook(raising)
    microbatch(delayed, 4)
    with pytest.raises(ValueError, match="post-accumulate hook"):
        delayed.backward_dw()
    handle.remove()
    assert delayed.pending_wgrad_count == 0
    assert_same(snapshot(delayed), expected)
    with pytest.raises(RuntimeError, match="nothing is pending"):
        delayed.backward_dw()


@pytest.mark.parametrize("kind", KINDS)
def test_hook_sees_written_gradients(lib, kind):
    """Hooks run after the entry's gradients are in place (a reduce hook reads them)."""
    plain, delayed = twin_pair(lib, kind, fused=False)
    microbatch(plain, 4)
    expected = snapshot(plain)
    seen = []
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(snapshot(delayed)))
    microbatch(delayed, 4)
    delayed.backward_dw()
    assert_same(seen[0], expected)


@pytest.mark.parametrize("kind", KINDS)
def test_hooks_fire_without_delay(lib, kind):
    """Without delay the same hooks fire at the end of the module's backward (documented choice:
    GEMM gradients never reach autograd's AccumulateGrad, so hooks are a wrapper's only signal)."""
    module = build(lib, kind)
    calls = []
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    microbatch(module, 0)
    assert calls == [1]


@pytest.mark.parametrize("kind", KINDS)
def test_grad_added_to_main_grad_flag(lib, kind):
    _, delayed = twin_pair(lib, kind, fused=True)
    weights = [p for n, p in delayed.named_parameters() if n in gemm_weight_names(delayed)]
    for p in weights:
        p.grad_added_to_main_grad = False
    microbatch(delayed, 0)
    assert all(p.grad_added_to_main_grad is False for p in weights)
    delayed.backward_dw()
    assert all(p.grad_added_to_main_grad is True for p in weights)
    assert all(p.grad is None for p in weights)


@pytest.mark.parametrize("kind", KINDS)
def test_is_first_microbatch_overwrites_main_grad(lib, kind):
    """P8: the first micro-batch's contribution replaces the random prefill of main_grad."""
    _, delayed = twin_pair(lib, kind, dtype=torch.bfloat16, fused=True)
    zeroed = build(lib, kind, dtype=torch.bfloat16, fused=True)
    fill(zeroed, 0)
    prefill_grads(zeroed, 1, fused=True)
    for name in gemm_weight_names(zeroed):
        getattr(zeroed, name).main_grad.zero_()
    microbatch(delayed, 8, is_first_microbatch=True)
    microbatch(zeroed, 8)
    delayed.backward_dw()
    for name in gemm_weight_names(delayed):
        torch.testing.assert_close(
            getattr(delayed, name).main_grad, getattr(zeroed, name).main_grad, rtol=0, atol=0
        )


@pytest.mark.parametrize("kind", KINDS)
def test_is_first_microbatch_plain_accumulates(lib, kind):
    """Without fusion is_first_microbatch changes no gradient."""
    a, b = build(lib, kind), build(lib, kind)
    for m in (a, b):
        fill(m, 0)
        prefill_grads(m, 1, fused=False)
    microbatch(a, 2, is_first_microbatch=True)
    microbatch(b, 2)
    assert_same(snapshot(a), snapshot(b))


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_tied_weights_two_entries(lib, kind, fused):
    """P7: one module applied twice in one graph queues two entries; the result is bitwise the
    non-delayed one."""
    plain, delayed = (_square(lib, kind, delay=d, fused=fused) for d in (False, True))
    for m in (plain, delayed):
        fill(m, 0)
        prefill_grads(m, 1, fused=fused)
    grads = []
    for m in (plain, delayed):
        x = make_input(m, 3)
        y = forward(m, forward(m, x))
        y.backward(make_dy(m, y, 3))
        grads.append(x.grad)
    assert delayed.pending_wgrad_count == 2
    delayed.backward_dw()
    delayed.backward_dw()
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert_same(snapshot(delayed), snapshot(plain))


def _square(lib, kind, **kw):
    n = 8
    if kind == "Linear":
        return lib.Linear(
            n, n, delay_wgrad_compute=kw["delay"], fuse_wgrad_accumulation=kw["fused"]
        )
    if kind == "LayerNormLinear":
        return lib.LayerNormLinear(
            n, n, delay_wgrad_compute=kw["delay"], fuse_wgrad_accumulation=kw["fused"]
        )
    return lib.LayerNormMLP(
        n, 12, delay_wgrad_compute=kw["delay"], fuse_wgrad_accumulation=kw["fused"]
    )


def test_tied_grouped_linear(lib):
    plain, delayed = (lib.GroupedLinear(2, 6, 6, delay_wgrad_compute=d) for d in (False, True))
    for m in (plain, delayed):
        fill(m, 0)
        prefill_grads(m, 1, fused=False)
    for m in (plain, delayed):
        x = make_input(m, 3, rows=5)
        y = m(m(x, [2, 3]), [4, 1])
        y.backward(make_dy(m, y, 3))
    assert delayed.pending_wgrad_count == 2
    delayed.backward_dw()
    delayed.backward_dw()
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
def test_all_gemm_parameters_frozen_queue_nothing(lib, kind):
    plain, delayed = twin_pair(lib, kind)
    for m in (plain, delayed):
        for name in gemm_param_names(m):
            getattr(m, name).requires_grad_(False)
    xp, _ = microbatch(plain, 2)
    xd, _ = microbatch(delayed, 2)
    assert delayed.pending_wgrad_count == 0
    torch.testing.assert_close(xd.grad, xp.grad, rtol=0, atol=0)
    assert_same(snapshot(delayed), snapshot(plain))
    with pytest.raises(RuntimeError, match="nothing is pending"):
        delayed.backward_dw()


@pytest.mark.parametrize("frozen", ["fc1_weight", "fc2_weight"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_layernorm_mlp_one_frozen_weight(lib, frozen, fused):
    plain, delayed = twin_pair(lib, "LayerNormMLP", fused=fused)
    for m in (plain, delayed):
        p = getattr(m, frozen)
        p.requires_grad_(False)
        p.grad = None
        if hasattr(p, "main_grad"):
            del p.main_grad
    microbatch(plain, 6)
    microbatch(delayed, 6)
    assert delayed.pending_wgrad_count == 1
    delayed.backward_dw()
    assert getattr(delayed, frozen).grad is None
    assert_same(snapshot(delayed), snapshot(plain))


def test_frozen_weight_with_trainable_bias(lib):
    plain, delayed = twin_pair(lib, "Linear")
    for m in (plain, delayed):
        m.weight.requires_grad_(False)
        m.weight.grad = None
    microbatch(plain, 1)
    microbatch(delayed, 1)
    assert delayed.pending_wgrad_count == 1
    delayed.backward_dw()
    assert delayed.weight.grad is None
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
def test_skip_backward_post_hook_marks_deferred_parameters(lib, kind, delay):
    module = build(lib, kind, delay=delay)
    for name, p in module.named_parameters():
        expected = delay and name in gemm_param_names(module)
        assert bool(getattr(p, "skip_backward_post_hook", False)) is expected, name


@pytest.mark.parametrize("kind", KINDS)
def test_need_backward_dw(lib, kind):
    assert build(lib, kind, delay=True).need_backward_dw() is True
    assert build(lib, kind, delay=False).need_backward_dw() is False


@pytest.mark.parametrize("kind", KINDS)
def test_empty_queue_raises(lib, kind):
    module = build(lib, kind, delay=True)
    with pytest.raises(RuntimeError, match="nothing is pending"):
        module.backward_dw()
    microbatch(module, 0)
    module.backward_dw()
    with pytest.raises(RuntimeError, match="nothing is pending"):
        module.backward_dw()


@pytest.mark.parametrize("kind", KINDS)
def test_backward_dw_without_delay_is_a_no_op(lib, kind):
    module = build(lib, kind)
    fill(module, 0)
    microbatch(module, 0)
    before = snapshot(module)
    calls = []
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append(1))
    for _ in range(2):
        assert module.backward_dw() is None
    assert module.pending_wgrad_count == 0
    assert calls == []
    assert_same(snapshot(module), before)


@pytest.mark.parametrize("kind", KINDS)
def test_failing_wgrad_keeps_entry(lib, kind):
    """A wgrad that fails (here: main_grad taken away after backward) writes nothing and stays at
    the head of the queue; once fixed, backward_dw gives the non-delayed result."""
    plain, delayed = twin_pair(lib, kind, fused=True)
    microbatch(plain, 9)
    microbatch(delayed, 9)
    name = gemm_weight_names(delayed)[-1]
    param = getattr(delayed, name)
    saved_main_grad = param.main_grad
    before = snapshot(delayed)
    del param.main_grad
    with pytest.raises(RuntimeError, match=name):
        delayed.backward_dw()
    param.main_grad = saved_main_grad
    assert delayed.pending_wgrad_count == 1
    assert_same(snapshot(delayed), before)
    delayed.backward_dw()
    assert delayed.pending_wgrad_count == 0
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
def test_failing_hook_consumes_entry(lib, kind):
    plain, delayed = twin_pair(lib, kind)
    calls = []

    def bad_hook():
        calls.append("bad")
        raise KeyError("reduce failed")

    delayed.register_wgrad_accumulation_and_reduce_hooks(bad_hook)
    delayed.register_wgrad_accumulation_and_reduce_hooks(lambda: calls.append("second"))
    microbatch(plain, 2)
    microbatch(delayed, 2)
    with pytest.raises(KeyError, match="reduce failed"):
        delayed.backward_dw()
    assert delayed.pending_wgrad_count == 0
    assert calls == ["bad"]
    assert_same(snapshot(delayed), snapshot(plain))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
def test_entry_tensors_freed_after_backward_dw(lib, kind, delay):
    """P11: every tensor the backward saved (except parameters) and the upstream gradient are
    freed once the entry has run; storages are tracked with storage weak references."""
    module = build(lib, kind, delay=delay)
    param_storages = {p.untyped_storage().data_ptr() for p in module.parameters()}
    refs = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages:
            refs.append(StorageWeakRef(t.untyped_storage()))
        return t

    x = make_input(module, 0)
    refs.append(StorageWeakRef(x.untyped_storage()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = forward(module, x)
    dy = make_dy(module, y, 0)
    refs.append(StorageWeakRef(dy.untyped_storage()))
    y.backward(dy)
    del x, y, dy
    if delay:
        assert not all(r.expired() for r in refs), "the queued entry should hold its operands"
        module.backward_dw()
    alive = [i for i, r in enumerate(refs) if not r.expired()]
    assert alive == [], f"storages still alive after the wgrad ran: {alive} of {len(refs)}"


@pytest.mark.parametrize("kind", KINDS)
def test_queue_is_per_module(lib, kind):
    """Two modules keep separate queues (no global state)."""
    a, b = build(lib, kind, delay=True), build(lib, kind, delay=True)
    microbatch(a, 0)
    assert (a.pending_wgrad_count, b.pending_wgrad_count) == (1, 0)
    with pytest.raises(RuntimeError):
        b.backward_dw()
    a.backward_dw()


@pytest.mark.parametrize("kind", KINDS)
def test_module_is_weakly_collectable(lib, kind):
    """Nothing global keeps a module (or its queue) alive."""
    module = build(lib, kind, delay=True)
    microbatch(module, 0)
    ref = weakref.ref(module)
    del module
    import gc

    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_ub_bulk_wgrad_without_delay_changes_nothing(lib, kind, fused):
    a = build(lib, kind, fused=fused)
    b = build(lib, kind, fused=fused, ub_bulk_wgrad=True)
    for m in (a, b):
        fill(m, 0)
        prefill_grads(m, 1, fused=fused)
    xa, ya = microbatch(a, 2)
    xb, yb = microbatch(b, 2)
    torch.testing.assert_close(yb, ya, rtol=0, atol=0)
    torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)
    assert_same(snapshot(b), snapshot(a))


def test_state_dict_is_shared_between_sources():
    """reference and impl use the same parameter names, so a state dict moves unchanged."""
    import splitgrad.impl as impl
    import splitgrad.reference as ref
    from cases import build as b

    if not hasattr(impl, "Linear"):
        pytest.skip("splitgrad.impl does not export the modules yet")
    for kind, bias in itertools.product(KINDS, (True, False)):
        r, i = b(ref, kind, bias=bias), b(impl, kind, bias=bias)
        fill(r, 5)
        sd = r.state_dict()
        assert list(sd) == list(i.state_dict()), kind
        i.load_state_dict(sd)
        for key, value in i.state_dict().items():
            torch.testing.assert_close(value, sd[key], rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gradients_accumulate_into_existing_ones(lib, kind, fused, delay, dtype):
    """§3: a gradient that starts at G0 ends at exactly G0 + g (one ``+=`` in the gradient's
    dtype, as autograd accumulates), where g is what the same micro-batch writes into empty
    gradients (``.grad`` None, ``main_grad`` zero).

    A fused ``main_grad`` that impl accumulates inside the GEMM (``addmm_``) is one fp32
    reduction that includes G0, so it may differ from G0 + g in the last bits on some CPUs
    (budgets.FUSED_ACCUMULATION_STEPS); the reference adds the rounded product: exact."""
    from splitgrad.properties.budgets import fused_accumulation_tolerance

    in_gemm = lib.__name__ == "splitgrad.impl"
    fresh, prefilled = (build(lib, kind, fused=fused, delay=delay, dtype=dtype) for _ in range(2))
    for m in (fresh, prefilled):
        fill(m, 0)
    prefill_grads(prefilled, 1, fused=fused)
    prefill_grads(fresh, 1, fused=fused)
    start = snapshot(prefilled)
    for p in fresh.parameters():
        p.grad = None
        if hasattr(p, "main_grad"):
            p.main_grad.zero_()
    for m in (fresh, prefilled):
        microbatch(m, 4)
        if delay:
            m.backward_dw()
    contribution, end = snapshot(fresh), snapshot(prefilled)
    for key, g in contribution.items():
        if g is None:
            torch.testing.assert_close(end[key], start[key], rtol=0, atol=0, msg=key)
        elif in_gemm and key.endswith(".main_grad"):
            tol = fused_accumulation_tolerance(start[key], g)
            torch.testing.assert_close(end[key], start[key] + g, rtol=0, atol=tol, msg=key)
        else:
            torch.testing.assert_close(end[key], start[key] + g, rtol=0, atol=0, msg=key)
