"""impl: what a queued entry holds, that it is freed after ``backward_dw``, and the store's
failure rules. Storages are tracked with ``StorageWeakRef`` (a weak reference to a Python tensor
would die with the alias while the memory lives on)."""

from __future__ import annotations

import pytest
import splitgrad.impl as impl
import torch
from cases import fill, prefill_grads
from splitgrad.impl.store import WeightGradStore, WgradEntry
from torch.multiprocessing.reductions import StorageWeakRef

ROWS, HIDDEN, FFN = 6, 8, 16


def _mlp(delay: bool, **kw) -> impl.LayerNormMLP:
    m = impl.LayerNormMLP(HIDDEN, FFN, delay_wgrad_compute=delay, **kw)
    fill(m, 0)
    return m


def _saved_storages(module, x):
    """Forward under a saved-tensors hook; returns (y, {name: StorageWeakRef}) of every
    non-parameter tensor the forward saved, keyed by its position."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    refs = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            refs.append((tuple(t.shape), StorageWeakRef(t.untyped_storage())))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = module(x)
    return y, refs


@pytest.mark.parametrize("recompute", [True, False])
def test_layernorm_mlp_entry_holds_only_wgrad_operands(recompute):
    """Under delay, after backward the only live storages are the four wgrad operands
    (dy, act_out, d_fc1_out, ln_out): x, fc1_out and the norm statistics are already gone, as in
    the non-delayed backward."""
    module = _mlp(True)
    module.recompute_activation = recompute
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    y, refs = _saved_storages(module, x)
    dy = torch.randn_like(y)
    y.backward(dy)
    del y, dy, x
    (entry,) = list(module._wgrad_store)
    held = {t.untyped_storage().data_ptr() for t in entry.saved if t is not None}
    assert len(entry.saved) == 4 and all(t is not None for t in entry.saved)
    shapes = [tuple(t.shape) for t in entry.saved]
    assert shapes == [(ROWS, HIDDEN), (ROWS, FFN), (ROWS, FFN), (ROWS, HIDDEN)]
    alive = [shape for shape, r in refs if not r.expired()]
    # Only ln_out (and act_out when it was saved, not recomputed) survive from the forward.
    expected = [(ROWS, HIDDEN)] if recompute else [(ROWS, HIDDEN), (ROWS, FFN)]
    assert sorted(alive) == sorted(expected)
    storage_refs = [StorageWeakRef(t.untyped_storage()) for t in entry.saved]
    del entry
    assert len(held) == 4
    module.backward_dw()
    assert all(r.expired() for r in storage_refs)
    assert all(r.expired() for _, r in refs)


def test_frozen_weight_entry_keeps_no_operand_of_it():
    """fc2 frozen: the entry does not keep act_out (only fc2's wgrad reads it)."""
    module = _mlp(True)
    module.fc2_weight.requires_grad_(False)
    x = torch.randn(ROWS, HIDDEN)
    module(x).sum().backward()
    (entry,) = list(module._wgrad_store)
    assert entry.saved[1] is None
    assert entry.saved[0] is not None  # fc2_bias still needs dy


@pytest.mark.parametrize("fused", [False, True])
def test_linear_entry_freed_after_backward_dw(fused):
    module = impl.Linear(HIDDEN, 4, delay_wgrad_compute=True, fuse_wgrad_accumulation=fused)
    if fused:
        module.weight.main_grad = torch.zeros(4, HIDDEN)
    x = torch.randn(ROWS, HIDDEN)
    dy = torch.randn(ROWS, 4)
    refs = [StorageWeakRef(x.untyped_storage()), StorageWeakRef(dy.untyped_storage())]
    module(x).backward(dy)
    del x, dy
    assert not any(r.expired() for r in refs)
    module.backward_dw()
    assert all(r.expired() for r in refs)


def test_failing_wgrad_keeps_entry_and_its_tensors():
    module = impl.Linear(HIDDEN, 4, delay_wgrad_compute=True, fuse_wgrad_accumulation=True)
    module.weight.main_grad = torch.zeros(4, HIDDEN)
    x = torch.randn(ROWS, HIDDEN)
    ref = StorageWeakRef(x.untyped_storage())
    module(x).sum().backward()
    del x
    good = module.weight.main_grad
    module.weight.main_grad = torch.zeros(4, HIDDEN, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="weight.main_grad has dtype torch.float16"):
        module.backward_dw()
    assert module.pending_wgrad_count == 1 and not ref.expired()
    module.weight.main_grad = good
    module.backward_dw()
    assert ref.expired()
    assert good.abs().sum() > 0


def test_failing_hook_releases_entry():
    module = impl.Linear(HIDDEN, 4, delay_wgrad_compute=True)
    x = torch.randn(ROWS, HIDDEN)
    ref = StorageWeakRef(x.untyped_storage())
    module(x).sum().backward()
    del x

    def hook():
        raise ValueError("boom")

    module.register_wgrad_accumulation_and_reduce_hooks(hook)
    with pytest.raises(ValueError, match="boom"):
        module.backward_dw()
    assert module.pending_wgrad_count == 0 and ref.expired()
    assert module.weight.grad is not None


def test_store_is_fifo_and_release_drops_tensors():
    store = WeightGradStore()
    order = []
    for i in range(3):
        t = torch.full((2,), float(i))
        store.push(WgradEntry(lambda t, i=i: order.append(i), (t,), ()))
    while len(store):
        store.head().run()
        head = store.head()
        store.pop_and_release()
        assert head.saved == ()
        with pytest.raises(RuntimeError, match="already run"):
            head.run()
    assert order == [0, 1, 2]


def test_backward_dw_runs_under_no_grad():
    """Saved inputs that require grad must not build a graph inside backward_dw."""
    seen = []
    module = impl.Linear(HIDDEN, 4, delay_wgrad_compute=True)
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: seen.append(module.weight.grad))
    x = torch.randn(ROWS, HIDDEN, requires_grad=True)
    module(x).sum().backward()
    module.backward_dw()
    assert seen[0].grad_fn is None and not seen[0].requires_grad


def test_plain_accumulation_in_place_and_like_autograd():
    """Plain mode: first gradient assigned, later ones accumulated (in place, one rounding)."""
    module = impl.Linear(HIDDEN, 4)
    fill(module, 0)
    prefill_grads(module, 1, fused=False)
    grad_before = module.weight.grad
    start = grad_before.clone()
    x = torch.randn(ROWS, HIDDEN, dtype=torch.float64).float()
    dy = torch.randn(ROWS, 4, dtype=torch.float64).float()
    module(x).backward(dy)
    assert module.weight.grad is grad_before
    expected = start.double() + dy.double().t() @ x.double()
    torch.testing.assert_close(module.weight.grad.double(), expected, rtol=1e-6, atol=1e-6)
