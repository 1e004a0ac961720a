"""A forgotten ``backward_dw()`` is caught: an optimizer step over a parameter that a queued entry
will still write raises ``RuntimeError`` naming the module, the parameter and the count, and
changes no parameter and no optimizer state (``splitgrad.reference.pending``, one global step
pre-hook). After ``backward_dw()`` the same step runs and is bitwise the non-delayed run's.
Steps over other parameters are unaffected; the guard can be turned off (function, context
manager, ``SPLITGRAD_OPTIMIZER_GUARD=0``); ``splitgrad.distributed.assert_drained`` checks the
same thing explicitly; a DualPipe-style store does not make it misfire.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from cases import KINDS, build, fill, forward, make_input, microbatch, twin_pair
from splitgrad import impl, reference
from splitgrad.distributed import assert_drained, use_weight_grad_store
from splitgrad.reference import pending
from splitgrad.reference.pending import optimizer_guard, optimizer_guard_enabled

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01),
}


def _params(module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def _assert_bitwise(actual, expected, where: str = "") -> None:
    """Bitwise equality of nested dicts / lists of tensors and plain values."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), where
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key in expected:
            _assert_bitwise(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_bitwise(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _gemm_names(module) -> list[str]:
    return [n for n, _ in module.named_parameters() if not n.startswith("layer_norm")]


def _pending_message(lib, kind: str, names, count: int) -> str:
    entries = "entry" if count == 1 else "entries"
    return rf"splitgrad\.{lib.__name__.split('.')[-1]}\.{kind} \(pending_wgrad_count=\d+\): " + (
        ", ".join(rf"{n} \({count} pending {entries}\)" for n in names)
    )


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", KINDS)
def test_step_with_a_pending_entry_raises_changes_nothing_and_works_after_backward_dw(
    lib, kind: str, opt_name: str
) -> None:
    plain, delayed = twin_pair(lib, kind, seed=3)
    opt_plain = OPTIMIZERS[opt_name](plain.parameters())
    opt_delayed = OPTIMIZERS[opt_name](delayed.parameters())
    for step in range(2):  # the second step meets an optimizer with state
        microbatch(plain, 10 + step)
        opt_plain.step()
        microbatch(delayed, 10 + step)
        assert delayed.pending_wgrad_count == 1
        before = _params(delayed), copy.deepcopy(opt_delayed.state_dict())
        with pytest.raises(RuntimeError) as caught:
            opt_delayed.step()
        message = str(caught.value)
        assert re.search(_pending_message(lib, kind, _gemm_names(delayed), 1), message), message
        assert f"{opt_name}.step() refused, nothing was changed" in message
        _assert_bitwise(_params(delayed), before[0], "params")
        _assert_bitwise(opt_delayed.state_dict(), before[1], "optimizer state")
        delayed.backward_dw()
        opt_delayed.step()
        _assert_bitwise(_params(delayed), _params(plain), f"step {step}")
        _assert_bitwise(opt_delayed.state_dict(), opt_plain.state_dict(), f"state {step}")
        for opt in (opt_plain, opt_delayed):
            opt.zero_grad()


def test_an_optimizer_over_other_parameters_is_unaffected(lib) -> None:
    module = build(lib, "LayerNormMLP", delay=True)
    fill(module, 0)
    other = torch.nn.Linear(3, 3)
    norm = [module.layer_norm_weight, module.layer_norm_bias]  # gradients from backward()
    microbatch(module, 0)
    assert module.pending_wgrad_count == 1
    other(torch.randn(2, 3)).sum().backward()
    before = norm[0].detach().clone()
    torch.optim.SGD(other.parameters(), lr=0.1).step()
    torch.optim.AdamW(norm, lr=0.1).step()
    assert not torch.equal(norm[0], before)
    with pytest.raises(RuntimeError, match="fc1_weight"):
        torch.optim.SGD(module.parameters(), lr=0.1).step()
    module.backward_dw()


def test_a_weight_used_twice_reports_two_entries(lib) -> None:
    module = build(lib, "Linear", delay=True)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    x = make_input(module, 0)
    (forward(module, x) + forward(module, 2 * x)).sum().backward()
    assert module.pending_wgrad_count == 2
    with pytest.raises(RuntimeError, match=_pending_message(lib, "Linear", ["weight", "bias"], 2)):
        opt.step()
    module.backward_dw()
    with pytest.raises(RuntimeError, match=_pending_message(lib, "Linear", ["weight", "bias"], 1)):
        opt.step()
    module.backward_dw()
    opt.step()


def test_several_micro_batches_count_each_entry(lib) -> None:
    module = build(lib, "GroupedLinear", delay=True)
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    for seed in range(3):
        microbatch(module, seed)
    with pytest.raises(RuntimeError, match=r"weight0 \(3 pending entries\)"):
        opt.step()
    for _ in range(3):
        module.backward_dw()
    opt.step()


def test_a_weight_tied_between_modules_names_both() -> None:
    a = impl.Linear(4, 4, delay_wgrad_compute=True)
    b = reference.Linear(4, 4, delay_wgrad_compute=True)
    b.weight = a.weight
    opt = torch.optim.SGD([a.weight], lr=0.1)
    b(a(torch.randn(3, 4))).sum().backward()
    with pytest.raises(RuntimeError) as caught:
        opt.step()
    message = str(caught.value)
    assert re.search(r"splitgrad\.impl\.Linear \(pending_wgrad_count=1\): weight \(1 pend", message)
    assert re.search(
        r"splitgrad\.reference\.Linear \(pending_wgrad_count=1\): weight \(1 p", message
    )
    assert "bias" not in message  # not the optimizer's
    a.backward_dw()
    b.backward_dw()
    opt.step()


def test_a_failing_wgrad_keeps_its_entry_counted(lib) -> None:
    module = build(lib, "LayerNormLinear", delay=True, fused=True)
    fill(module, 0)
    module.weight.main_grad = torch.zeros_like(module.weight, dtype=torch.float32)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    microbatch(module, 0)
    main_grad = module.weight.main_grad
    del module.weight.main_grad
    with pytest.raises(RuntimeError, match="main_grad"):
        module.backward_dw()  # fails: the entry stays queued
    assert module.pending_wgrad_count == 1
    with pytest.raises(RuntimeError, match=r"weight \(1 pending entry\), bias \(1 pending entry\)"):
        opt.step()
    module.weight.main_grad = main_grad
    module.backward_dw()
    module.weight.grad = main_grad.clone()  # what a main_grad framework copies before its step
    opt.step()


def test_the_index_is_empty_when_nothing_is_pending_and_forgets_dead_modules(
    lib, monkeypatch
) -> None:
    monkeypatch.setattr(pending, "_QUEUED", {})
    module = build(lib, "Linear", delay=True)
    microbatch(module, 0)
    microbatch(module, 1)
    assert list(pending._QUEUED) == [id(module)]
    module.backward_dw()
    assert list(pending._QUEUED) == [id(module)]
    module.backward_dw()
    assert pending._QUEUED == {}

    # Nothing queued: the pre-hook stops at its truthiness check.
    def must_not_run(_):
        raise AssertionError("the slow path ran with nothing queued")

    monkeypatch.setattr(pending, "check_optimizer_step", must_not_run)
    torch.optim.SGD(module.parameters(), lr=0.1).step()
    monkeypatch.undo()
    monkeypatch.setattr(pending, "_QUEUED", {})
    dead = build(lib, "Linear", delay=True)
    microbatch(dead, 0)
    assert pending._QUEUED
    del dead
    gc.collect()
    assert pending._QUEUED == {}


def test_the_off_switch_function_and_context_manager() -> None:
    module = impl.LayerNormMLP(8, 12, delay_wgrad_compute=True)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    module(torch.randn(3, 8)).sum().backward()
    assert optimizer_guard_enabled()
    with optimizer_guard(False):
        assert not optimizer_guard_enabled()
        opt.step()
    assert optimizer_guard_enabled()
    with pytest.raises(RuntimeError, match="fc2_weight"):
        opt.step()
    optimizer_guard(False)
    try:
        assert not optimizer_guard_enabled()
        opt.step()
        with optimizer_guard(True):
            with pytest.raises(RuntimeError, match="fc2_weight"):
                opt.step()
        assert not optimizer_guard_enabled()
    finally:
        optimizer_guard(True)
    assert optimizer_guard_enabled()
    with pytest.raises(TypeError, match="enabled"):
        optimizer_guard("no")
    module.backward_dw()


_SUBPROCESS = """
import torch
from splitgrad import impl
from splitgrad.reference.pending import optimizer_guard_enabled
m = impl.Linear(4, 4, delay_wgrad_compute=True)
m(torch.randn(2, 4)).sum().backward()
try:
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    print("stepped", optimizer_guard_enabled())
except RuntimeError as e:
    print("refused", optimizer_guard_enabled())
"""


@pytest.mark.parametrize(("value", "expected"), [("0", "stepped False"), ("1", "refused True")])
def test_the_environment_variable_starts_the_guard_off(value: str, expected: str) -> None:
    env = {**os.environ, "SPLITGRAD_OPTIMIZER_GUARD": value}
    proc = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == expected


def test_assert_drained_names_each_module_and_count(lib) -> None:
    model = torch.nn.Sequential(
        lib.Linear(8, 8, delay_wgrad_compute=True),
        torch.nn.GELU(),
        lib.Linear(8, 8, delay_wgrad_compute=True),
        lib.Linear(8, 8),  # not delayed: never pending
    )
    assert_drained(model)
    model(torch.randn(3, 8)).sum().backward()
    model[2](torch.randn(3, 8)).sum().backward()
    with pytest.raises(RuntimeError, match=r"0 \(Linear\): 1, 2 \(Linear\): 2"):
        assert_drained(model)
    with pytest.raises(RuntimeError, match=r"<model> \(Linear\): 1"):
        assert_drained(model[0])
    model[0].backward_dw()
    with pytest.raises(RuntimeError, match=r"assert_drained\(Sequential\).*: 2 \(Linear\): 2;"):
        assert_drained(model)
    model[2].backward_dw()
    model[2].backward_dw()
    assert_drained(model)


class _Store:
    """A weight-gradient store with DualPipe's interface (``enabled``, ``put``), run in order."""

    def __init__(self) -> None:
        self.enabled = False
        self.cache: list = []

    def put(self, fn) -> None:
        self.cache.append(fn)

    def pop_all(self) -> None:
        group, self.cache = self.cache, []
        for fn in group:
            fn()


def test_a_weight_grad_store_does_not_make_the_guard_misfire() -> None:
    plain = torch.nn.Sequential(impl.Linear(8, 8), reference.LayerNormMLP(8, 16))
    model = torch.nn.Sequential(
        impl.Linear(8, 8, delay_wgrad_compute=True),
        reference.LayerNormMLP(8, 16, delay_wgrad_compute=True),
    )
    fill(plain, 0)
    fill(model, 0)
    store = _Store()
    handle = use_weight_grad_store(model, store)
    opt, opt_plain = (torch.optim.AdamW(m.parameters(), lr=0.01) for m in (model, plain))
    for step, enabled in enumerate([True, False, True]):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
        plain(x).sum().backward()
        opt_plain.step()
        store.enabled = enabled
        model(x).sum().backward()
        store.enabled = False
        if enabled:  # handed to the store, still owed: the step is refused
            with pytest.raises(RuntimeError, match=r"splitgrad\.impl\.Linear .*weight \(1 pend"):
                opt.step()
            store.pop_all()
        assert_drained(model)
        opt.step()  # run at once (enabled false) or by the store: no misfire
        _assert_bitwise(_params(model), _params(plain), f"step {step}")
        opt.zero_grad()
        opt_plain.zero_grad()
    handle.remove()
