"""SPEC §8, DualPipe and other weight-gradient stores: ``use_weight_grad_store(model, store)``.

Under DeepSeek's DualPipe (the real ``dualpipe`` package, an optional extra that CI installs;
skipped with a reason without it), on 2 spawned gloo ranks: every gradient after each of two
training steps is bitwise that of the same steps with the same modules built without delay, and
nothing is left pending. In one process, with a store of our own: entries of one pass are handed
in the order the non-delayed backward would accumulate them (a weight tied three ways), an
``enabled=False`` pass runs them at once, and misuse is refused naming the value.
"""

from __future__ import annotations

import time
import warnings

import dualpipe_ranks
import pytest
import torch
from cases import assert_same, fill, snapshot
from splitgrad.distributed import RankFailure, run_ranks, use_weight_grad_store

H = 8


class FifoStore:
    """A weight-gradient store with DualPipe's interface, run in put() order (or reversed, to
    plant a store that breaks FIFO)."""

    def __init__(self, reverse: bool = False) -> None:
        self.enabled = False
        self.cache: list = []
        self.groups: list = []
        self.reverse = reverse

    def put(self, fn) -> None:
        self.cache.append(fn)

    def flush(self) -> None:
        self.groups.append(self.cache)
        self.cache = []

    def pop(self) -> None:
        group = self.groups.pop(0)
        for fn in reversed(group) if self.reverse else group:
            fn()


class Tied(torch.nn.Module):
    """Delayed modules of both packages; ``a`` runs twice and shares its weight with ``b``, so
    the weight gets three contributions per backward, added in backward order."""

    def __init__(self, reference, impl, delay: bool) -> None:
        super().__init__()
        self.a = impl.Linear(H, H, delay_wgrad_compute=delay)
        self.b = reference.Linear(H, H, delay_wgrad_compute=delay)
        self.c = impl.LayerNormMLP(H, 2 * H, delay_wgrad_compute=delay)
        for i, m in enumerate((self.a, self.b, self.c)):
            fill(m, i)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.c(self.a(torch.nn.functional.gelu(self.b(self.a(x)))))


def _pair():
    from splitgrad import impl, reference

    return Tied(reference, impl, True), Tied(reference, impl, False)


def _backward(model, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, H, generator=gen, requires_grad=True)
    y = model(x)
    y.backward(torch.randn(y.shape, generator=gen))
    return x.grad


def _pending(model) -> list[int]:
    return [m.pending_wgrad_count for m in (model.a, model.b, model.c)]


def test_store_gets_each_entry_in_backward_order_and_grads_are_bitwise_non_delayed():
    delayed, plain = _pair()
    store = FifoStore()
    handle = use_weight_grad_store(delayed, store)
    assert handle.modules == ["a (Linear)", "b (Linear)", "c (LayerNormMLP)"]
    entries = {"a": 0, "b": 0, "c": 0}
    for seed, enabled in enumerate([True, True, False, True]):
        store.enabled = enabled
        dx = _backward(delayed, seed)
        store.enabled = False
        store.flush()
        torch.testing.assert_close(dx, _backward(plain, seed), rtol=0, atol=0)
        if enabled:
            assert _pending(delayed) == [2, 1, 1]
            assert handle.outstanding == {"a (Linear)": 2, "b (Linear)": 1, "c (LayerNormMLP)": 1}
            # backward order: c, the second call of a, b, the first call of a; the tied weight
            # adds a, b, a as the non-delayed backward does (a's two entries first would not)
            expected = []
            for name, kind in [("c", "LayerNormMLP"), ("a", "Linear"), ("b", "Linear")] + [
                ("a", "Linear")
            ]:
                expected.append(f"entry #{entries[name]} of {name} ({kind})")
                entries[name] += 1
            assert [e.label for e in store.groups[-1]] == expected
        else:  # run at once, at the end of the backward
            assert store.groups[-1] == [] and _pending(delayed) == [0, 0, 0]
        while store.groups:
            store.pop()
        assert _pending(delayed) == [0, 0, 0] and handle.outstanding == {}
        assert_same(snapshot(delayed), snapshot(plain))
    assert (handle.handed, handle.ran_at_once) == (12, 4)


def test_input_only_backward_hands_nothing():
    delayed, _ = _pair()
    store = FifoStore()
    store.enabled = True
    handle = use_weight_grad_store(delayed, store)
    x = torch.randn(5, H, requires_grad=True)
    (dx,) = torch.autograd.grad(delayed(x).sum(), x)
    assert dx.shape == x.shape
    assert store.cache == [] and _pending(delayed) == [0, 0, 0] and handle.handed == 0


def _one_group(delayed, store):
    store.enabled = True
    _backward(delayed, 0)
    store.enabled = False
    store.flush()
    return store.groups[-1]


def _owed_group():
    """A delayed model connected to a ``FifoStore``, the store, and the callables it got from one
    backward pass (not run)."""
    delayed, _ = _pair()
    store = FifoStore()
    use_weight_grad_store(delayed, store)
    return delayed, store, _one_group(delayed, store)


def test_a_store_that_breaks_fifo_is_refused_and_runs_nothing():
    delayed, plain = _pair()
    store = FifoStore(reverse=True)
    use_weight_grad_store(delayed, store)
    group = _one_group(delayed, store)
    with pytest.raises(RuntimeError, match=r"ran entry #1 of a \(Linear\) before entry #0 of a"):
        store.pop()  # reversed: a's second entry comes first
    assert _pending(delayed) == [2, 1, 1]
    for fn in group:  # in put() order the same callables finish the work
        fn()
    _backward(plain, 0)
    assert_same(snapshot(delayed), snapshot(plain))


def test_a_callable_run_twice_is_refused():
    _, store, group = _owed_group()
    store.pop()
    assert all(e.done for e in group)
    with pytest.raises(RuntimeError, match=r"ran entry #0 of c \(LayerNormMLP\) twice"):
        group[0]()


def test_backward_dw_run_behind_the_stores_back_is_refused():
    delayed, _, group = _owed_group()
    delayed.c.backward_dw()
    with pytest.raises(RuntimeError, match=r"c \(LayerNormMLP\) has 0 entries pending but owes"):
        group[0]()


def test_a_pass_outside_enabled_while_entries_are_owed_raises():
    delayed, _, _ = _owed_group()
    with pytest.raises(RuntimeError, match=r"FifoStore.enabled false on modules that still owe"):
        _backward(delayed, 1)


def test_entries_queued_by_a_forward_before_the_connection_are_refused():
    delayed, _ = _pair()
    x = torch.randn(5, H)
    y = delayed(x)  # forward unconnected: its backward is not seen
    store = FifoStore()
    use_weight_grad_store(delayed, store)
    y.sum().backward()
    with pytest.raises(
        RuntimeError, match=r"c \(LayerNormMLP\) had 1 entries pending when this backward reached"
    ):
        _backward(delayed, 1)


def test_remove_disconnects_and_handed_callables_stay_valid():
    delayed, plain = _pair()
    store = FifoStore()
    handle = use_weight_grad_store(delayed, store)
    group = _one_group(delayed, store)
    handle.remove()
    store.enabled = True
    _backward(delayed, 1)  # unconnected: queued on the modules, nothing handed
    assert store.cache == [] and _pending(delayed) == [4, 2, 2]
    for fn in group:
        fn()
    for m in (delayed.c, delayed.a, delayed.b, delayed.a):  # backward order (tied weight)
        m.backward_dw()
    _backward(plain, 0)
    _backward(plain, 1)
    assert_same(snapshot(delayed), snapshot(plain))
    again = use_weight_grad_store(delayed, store)  # removed: may be connected again
    assert again.modules == handle.modules


def test_bad_input_is_refused_naming_the_value():
    from splitgrad import impl

    delayed, _ = _pair()

    class NoPut:
        enabled = False

    class PutNotCallable:
        enabled = False
        put = None

    with pytest.raises(TypeError, match=r"lacks enabled and put"):
        use_weight_grad_store(delayed, object())
    with pytest.raises(TypeError, match=r"NoPut object .* lacks put"):
        use_weight_grad_store(delayed, NoPut())
    with pytest.raises(TypeError, match=r"lacks a callable put"):
        use_weight_grad_store(delayed, PutNotCallable())
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, got 'model'"):
        use_weight_grad_store("model", FifoStore())

    use_weight_grad_store(delayed, FifoStore())
    with pytest.raises(
        RuntimeError, match=r"use_weight_grad_store\(Tied\): a \(Linear\) is already"
    ):
        use_weight_grad_store(delayed, FifoStore())
    with pytest.raises(RuntimeError, match=r"LayerNormMLP is already connected"):
        use_weight_grad_store(delayed.c, FifoStore())  # a part of a connected model

    with pytest.warns(UserWarning, match=r"use_weight_grad_store\(Sequential\): the model has no"):
        use_weight_grad_store(torch.nn.Sequential(impl.Linear(H, H)), FifoStore())

    busy = impl.Linear(H, H, delay_wgrad_compute=True)
    busy(torch.randn(2, H)).sum().backward()
    with pytest.raises(RuntimeError, match=r"Linear has 1 entries queued already"):
        use_weight_grad_store(busy, FifoStore())


# ---- under DualPipe, 2 gloo ranks -----------------------------------------------------------


@pytest.mark.distributed
def test_dualpipe_steps_are_bitwise_the_non_delayed_steps():
    """Two DualPipe training steps on 2 ranks (stages of reference and impl modules, an SGD
    update between the steps): every gradient after each step bitwise the non-delayed run's."""
    pytest.importorskip("dualpipe", reason="dualpipe is not installed: pip install '.[dualpipe]'")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing may warn (e.g. a stage found not delayed)
        results = run_ranks(dualpipe_ranks.dualpipe_delayed_and_not, 2, timeout_s=240)
    compared = 0
    for rank, out in enumerate(results):
        delayed, plain = out["delayed"], out["plain"]
        assert len(delayed["grads"]) == dualpipe_ranks.STEPS
        for step, (got, expected) in enumerate(zip(delayed["grads"], plain["grads"])):
            assert sorted(got) == sorted(expected) == sorted(delayed["params"]), (rank, step)
            for name in expected:
                torch.testing.assert_close(
                    got[name], expected[name], rtol=0, atol=0, msg=f"rank {rank} step {step} {name}"
                )
                compared += 1
            assert set(delayed["pending"][step].values()) == {0}, delayed["pending"][step]
            assert delayed["outstanding"][step] == {}
        for a, b in zip(delayed["losses"], plain["losses"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        # both paths taken: DualPipe's zero-bubble backward chunks put entries into its store,
        # the others ran them at once
        assert delayed["handed"] > 0 and delayed["ran_at_once"] > 0, delayed
    assert compared == 2 * dualpipe_ranks.STEPS * 30


@pytest.mark.distributed
def test_a_failing_rank_fails_the_dualpipe_run_instead_of_hanging():
    pytest.importorskip("dualpipe", reason="dualpipe is not installed: pip install '.[dualpipe]'")
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 fails on purpose"):
        run_ranks(dualpipe_ranks.dualpipe_with_a_failing_rank, 2, timeout_s=120)
    assert time.monotonic() - start < 120


def test_a_callable_whose_backward_dw_raises_keeps_its_entry():
    delayed, plain = _pair()
    store = FifoStore()
    handle = use_weight_grad_store(delayed, store)
    group = _one_group(delayed, store)
    real = delayed.c.backward_dw
    delayed.c.backward_dw = lambda: (_ for _ in ()).throw(RuntimeError("wgrad failed"))
    with pytest.raises(RuntimeError, match="wgrad failed"):
        group[0]()
    assert not group[0].done and handle.outstanding["c (LayerNormMLP)"] == 1
    delayed.c.backward_dw = real
    for fn in group:  # called again, it runs its entry
        fn()
    _backward(plain, 0)
    assert_same(snapshot(delayed), snapshot(plain))


def test_order_of_entries_when_a_reached_call_queued_nothing():
    """A module whose new entries do not match the forward calls the pass reached gets them all
    where the pass first reached it."""
    from splitgrad.distributed.weight_grad_store import _order

    a, b = object(), object()
    assert _order([a, b, a], {a: 2, b: 1}) == [a, b, a]
    assert _order([a, b, a], {a: 1, b: 1}) == [a, b]
    assert _order([a, b, a], {b: 1}) == [b]
