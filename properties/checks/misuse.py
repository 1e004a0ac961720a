"""P9-P10 (SPEC §4, §5): misuse. ``ub_bulk_wgrad`` with delay raises (also under
``python -O``); bad input and misuse raise SPEC's errors, naming the value, and change nothing.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from hypothesis import strategies as st

from ..backends import Backend
from ..cases.data import (
    MicroBatchData,
    gemm_bias_names,
    gemm_weight_names,
    make_micro_batches,
    make_state,
    param_specs,
)
from ..cases.strategies import KINDS, Case, ModuleConfig, boundary_cases, cases, make_recipe
from ..cases.variants import MISUSES, Misuse
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun, clone_of

__all__ = [
    "UB_MESSAGE",
    "MISUSES",
    "RAISING_HOOKS",
    "HookPosition",
    "misuses",
    "raising_hook_positions",
    "optimized_constructor_results",
    "check_p9",
    "check_p10",
    "p10_cases",
    "p10_explicit",
]


UB_MESSAGE = "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"
_OPTIMIZED_CACHE: dict[str, dict[str, str]] = {}

_OPTIMIZED_SCRIPT = """
import json, sys
from splitgrad.properties.backends import get_backend
backend = get_backend(sys.argv[1])
out = {}
for kind in sys.argv[2:]:
    try:
        backend.constructor(kind)(*([2, 4, 3] if kind == "GroupedLinear" else [4, 3]),
                                  ub_bulk_wgrad=True, delay_wgrad_compute=True)
        out[kind] = "no error"
    except ValueError as exc:
        out[kind] = "ValueError: " + str(exc)
    except Exception as exc:
        out[kind] = type(exc).__name__ + ": " + str(exc)
print(json.dumps({"optimize": sys.flags.optimize, "results": out}))
"""
_OPTIMIZED_RUNNING: dict[str, subprocess.Popen] = {}
#: The kinds P9 asks the ``python -O`` subprocess about.
P9_KINDS = tuple(k for k in KINDS if k != "GroupedLinear")


def start_optimized_constructor_results(
    backend_name: str, kinds: tuple[str, ...] = P9_KINDS
) -> None:
    """Start the ``python -O`` subprocess of :func:`optimized_constructor_results` in the
    background (a campaign that will check P9 calls this first: the subprocess spends seconds
    importing torch and the backend while other cells run)."""
    if backend_name in _OPTIMIZED_CACHE or backend_name in _OPTIMIZED_RUNNING:
        return
    # The backend may live on a path this process added (a test, a conftest).
    path = os.pathsep.join(p for p in sys.path if p)
    _OPTIMIZED_RUNNING[backend_name] = subprocess.Popen(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT, backend_name, *kinds],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONOPTIMIZE": "1", "PYTHONPATH": path},
    )


def optimized_constructor_results(
    backend_name: str, kinds: tuple[str, ...] = P9_KINDS
) -> dict[str, str]:
    """What the constructors raise for ``ub_bulk_wgrad=True, delay_wgrad_compute=True`` in a
    ``python -O`` subprocess (cached per backend: a subprocess costs seconds)."""
    if backend_name not in _OPTIMIZED_CACHE:
        start_optimized_constructor_results(backend_name, kinds)
        proc = _OPTIMIZED_RUNNING.pop(backend_name)
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise PropertyViolation(
                f"python -O subprocess for backend {backend_name!r} took over 300 s"
            ) from None
        if proc.returncode != 0:
            raise PropertyViolation(
                f"python -O subprocess for backend {backend_name!r} failed:\n{stderr[-2000:]}"
            )
        payload = json.loads(stdout.strip().splitlines()[-1])
        if payload["optimize"] < 1:
            raise PropertyViolation("the subprocess did not run with python -O")
        _OPTIMIZED_CACHE[backend_name] = payload["results"]
    return _OPTIMIZED_CACHE[backend_name]


def check_p9(backend: Backend, case: Case) -> CheckResult:
    """P9: ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises ``ValueError``
    containing the SPEC message, in this process and under ``python -O``; without delay
    ``ub_bulk_wgrad=True`` changes no result (bitwise)."""
    t = Tracker()
    kind = case.config.kind
    call = f"{kind}(ub_bulk_wgrad=True, delay_wgrad_compute=True)"
    ctor = backend.constructor(kind)
    args = (2, 4, 3) if kind == "GroupedLinear" else (4, 3)
    try:
        ctor(*args, ub_bulk_wgrad=True, delay_wgrad_compute=True)
    except ValueError as exc:
        msg = str(exc)
        t.expect(UB_MESSAGE in msg, f"{kind}: ValueError message {msg!r} lacks {UB_MESSAGE!r}")
    else:
        raise PropertyViolation(f"{call} did not raise ValueError")
    got = optimized_constructor_results(backend.name, P9_KINDS).get(kind)
    raised = (got or "").startswith("ValueError") and UB_MESSAGE in got
    t.expect(raised, f"under python -O, {call} gave {got!r}")
    data = make_micro_batches(case)
    plain = ModuleRun(backend, case, delay=False, prefill_grads=True)
    bulk = ModuleRun(backend, case, delay=False, prefill_grads=True, ub_bulk_wgrad=True)
    for i, d in enumerate(data):
        xp, yp = plain.fb(d)
        xb, yb = bulk.fb(d)
        t.bitwise(f"ub_bulk_wgrad output[{i}]", yb, yp)
        t.bitwise(f"ub_bulk_wgrad inp.grad[{i}]", xb.grad, xp.grad)
    t.same_run("ub_bulk_wgrad: ", bulk, plain)
    return t.result


def _expect_raises(
    t: Tracker, what: str, fn: Callable[[], Any], types: tuple[type, ...], *needles: str
) -> BaseException:
    expected = "/".join(x.__name__ for x in types)
    try:
        fn()
    except types as exc:
        msg = str(exc)
        for needle in needles:
            t.expect(
                needle.lower() in msg.lower(),
                f"{what}: {type(exc).__name__} message {msg!r} does not name {needle!r}",
            )
        return exc
    except Exception as exc:
        raise PropertyViolation(
            f"{what}: raised {type(exc).__name__}({exc}) instead of {expected}"
        ) from exc
    raise PropertyViolation(f"{what}: no error raised (expected {expected})")


def _state_snapshot(run: ModuleRun) -> dict[str, Any]:
    values = {f"{name} (value)": clone_of(p) for name, p in run.params.items()}
    return {**run.all_snapshot(), **run.fp8_snapshot(), **values}


def _unchanged(t: Tracker, what: str, run: ModuleRun, before: dict[str, Any], pending: int) -> None:
    t.bitwise_all(f"{what} changed ", _state_snapshot(run), before)
    t.equal(f"{what}: pending_wgrad_count", run.pending(), pending)


def misuses(config: ModuleConfig, delay: bool) -> list[str]:
    """The P10 misuse variants that apply to ``config`` built with or without delay."""
    out = ["bad_last_dim", "bad_dtype", "bad_device", "dw_empty", "dw_no_delay", "bad_ctor"]
    if delay:
        out.append("hook_raises")
    if config.recipe is None:
        # Under FP8 a skipped micro-batch would also change the scales of the later ones, so the
        # twin that skips it is no yardstick there: only hook_raises, whose twin skips nothing.
        out += [
            n for n in RAISING_HOOKS if n != "hook_raises" and raising_hook_positions(config, n)
        ]
    if config.kind == "GroupedLinear":
        out += ["m_splits_len", "m_splits_negative", "m_splits_sum"]
    if config.fuse_wgrad_accumulation:
        out += ["main_grad_missing", "main_grad_shape", "main_grad_dtype", "main_grad_device"]
        if delay:
            out.append("wgrad_fails")
    if config.alignment > 1:
        out += ["fp8_tokens", "fp8_features"]
    return out


# How a message may name the dimension a block recipe cannot quantize.
_TOKEN_WORDS = ("tokens", "rows")
_FEATURE_WORDS = ("in_features", "out_features", "hidden_size", "ffn_hidden_size")


def _expect_fp8_shape_error(
    t: Tracker, what: str, fn: Callable[[], Any], config: ModuleConfig, size: int, words
) -> None:
    """``fn`` raises ``ValueError`` naming the recipe, the dimension, its size and the multiple
    it needs (SPEC §5 / reference/base.py)."""
    recipe = type(make_recipe(config.recipe)).__name__
    exc = _expect_raises(t, what, fn, (ValueError,), recipe, str(size), str(config.alignment))
    t.expect(
        any(w in str(exc) for w in words),
        f"{what}: ValueError message {str(exc)!r} names none of the dimensions {words}",
    )


@dataclasses.dataclass
class _Misused:
    """One P10 example under way: the misuse ``name``, the module it is tried on (``run``), the
    state it must keep (``before``, ``pending``), the micro-batch ``d`` and the input ``inp``."""

    backend: Backend
    case: Case
    config: ModuleConfig
    name: str
    t: Tracker
    run: ModuleRun
    d: MicroBatchData
    inp: torch.Tensor
    before: dict[str, Any]
    pending: int

    @classmethod
    def start(cls, backend: Backend, case: Case) -> _Misused:
        d = make_micro_batches(case)[0]
        run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
        before, pending = _state_snapshot(run), run.pending()
        name = case.variant.name
        return cls(
            backend, case, case.config, name, Tracker(), run, d, d.fresh_input(), before, pending
        )

    def call(self, x: torch.Tensor, m_splits: Any = None) -> Any:
        """A forward of ``x`` with the micro-batch's flag (and its ``m_splits`` unless given)."""
        splits = self.d.spec.m_splits if m_splits is None else m_splits
        return self.run.forward(x, splits, self.d.spec.is_first_microbatch)

    def settle(self) -> None:
        """The module's state now is what the misuse must leave as it is."""
        self.before, self.pending = _state_snapshot(self.run), self.run.pending()

    def fb_with_twin(self) -> ModuleRun:
        """A forward and backward of the micro-batch, and of it on a non-delayed twin (returned)."""
        eager = ModuleRun(self.backend, self.case, delay=False, prefill_grads=True)
        self.run.fb(self.d)
        eager.fb(self.d)
        return eager

    @contextlib.contextmanager
    def broken_main_grad(self) -> Iterator[str]:
        """The misused weight's ``main_grad`` broken as :data:`_BROKEN_MAIN_GRAD` says, restored
        afterwards; yields the weight's name."""
        name = self.case.variant.weight or self.run.weight_names[0]
        p = self.run.params[name]
        good, broken = p.main_grad, _BROKEN_MAIN_GRAD[self.name](p)
        if broken is None:
            del p.main_grad
        else:
            p.main_grad = broken
        yield name
        p.main_grad = good


# Each misuse: provoke it and check the error.


def _bad_last_dim(m: _Misused) -> None:
    k = m.config.in_features
    bad = torch.zeros(*m.d.spec.lead_shape, k + 1, dtype=m.config.torch_dtype, requires_grad=True)
    sizes = (str(k), str(k + 1))
    _expect_raises(m.t, "wrong last dimension", lambda: m.call(bad), (ValueError,), *sizes)


def _bad_dtype(m: _Misused) -> None:
    dt = m.config.torch_dtype
    other = torch.float64 if dt != torch.float64 else torch.float32
    bad = m.inp.detach().to(other)
    names = tuple(str(d).replace("torch.", "") for d in (dt, other))
    _expect_raises(m.t, "wrong input dtype", lambda: m.call(bad), (TypeError, ValueError), *names)


def _bad_device(m: _Misused) -> None:
    bad, device = m.inp.detach().to("meta"), m.config.device
    _expect_raises(
        m.t, "wrong input device", lambda: m.call(bad), (ValueError, TypeError), "meta", device
    )


_BAD_SPLITS: dict[str, Callable[[list[int]], list[int]]] = {
    "m_splits_len": lambda s: s + [0],
    "m_splits_negative": lambda s: [-1] + s[1:-1] + [s[-1] + 1 + s[0]] if len(s) > 1 else [-1],
    "m_splits_sum": lambda s: s[:-1] + [s[-1] + 1],
}


def _bad_m_splits(m: _Misused) -> None:
    ms = _BAD_SPLITS[m.name](list(m.d.spec.m_splits or []))
    named = "-1" if m.name == "m_splits_negative" else str(ms[-1])
    _expect_raises(m.t, f"m_splits={ms}", lambda: m.call(m.inp, ms), (ValueError,), named)


def _fp8_tokens(m: _Misused) -> None:
    # One more half-block of rows (in the first group for GroupedLinear).
    config, spec = m.config, m.d.spec
    extra = config.alignment // 2
    if config.kind == "GroupedLinear":
        ms = [spec.m_splits[0] + extra, *spec.m_splits[1:]]
        rows, size = sum(ms), ms[0]
    else:
        ms, rows = None, spec.rows + extra
        size = rows
    bad = torch.zeros(rows, config.in_features, dtype=config.torch_dtype, requires_grad=True)
    what = f"{size} tokens under {config.recipe}"
    _expect_fp8_shape_error(m.t, what, lambda: m.call(bad, ms), config, size, _TOKEN_WORDS)


def _fp8_features(m: _Misused) -> None:
    # A module whose in_features is half a block off; its forward must refuse, untouched.
    config = m.config
    size = config.in_features + config.alignment // 2
    odd_config = dataclasses.replace(config, in_features=size)
    odd = ModuleRun(m.backend, m.case, delay=m.run.delay, config=odd_config)
    x = torch.zeros(*m.d.spec.lead_shape, size, dtype=config.torch_dtype, requires_grad=True)
    odd_before = _state_snapshot(odd)
    what = f"in_features={size} under {config.recipe}"
    refused = functools.partial(odd.forward, x, m.d.spec.m_splits, None)
    _expect_fp8_shape_error(m.t, what, refused, config, size, _FEATURE_WORDS)
    _unchanged(m.t, "the module that refused", odd, odd_before, 0)


def _dw_empty(m: _Misused) -> None:
    run = m.run
    if not run.delay:
        run.dw()  # must be a no-op on a module built without delay
        return
    _expect_raises(m.t, "backward_dw() with nothing pending", run.dw, (RuntimeError,), "pending")
    run.fb(m.d)
    run.dw()
    m.settle()
    _expect_raises(m.t, "backward_dw() after the queue drained", run.dw, (RuntimeError,), "pending")


def _dw_no_delay(m: _Misused) -> None:
    m.run = ModuleRun(m.backend, m.case, delay=False, prefill_grads=True)
    m.run.fb(m.d)
    m.settle()
    calls = len(m.run.hook_calls)
    m.run.dw()
    m.t.equal("hook calls of backward_dw() without delay", len(m.run.hook_calls), calls)


def _bad_ctor(m: _Misused) -> None:
    config = m.config
    ctor = m.backend.constructor(config.kind)
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("in_features=0", lambda: ctor(*_ctor_args(config, in_features=0))),
        ("negative out size", lambda: ctor(*_ctor_args(config, out_features=-3))),
    ]
    if config.kind == "GroupedLinear":
        calls.append(("num_gemms=0", lambda: ctor(0, 4, 3)))
    if config.has_norm:
        calls.append(("normalization='BatchNorm'", lambda: ctor(4, 3, normalization="BatchNorm")))
    if config.kind == "LayerNormMLP":
        calls.append(("activation='tanh'", lambda: ctor(4, 3, activation="tanh")))
    for what, fn in calls:
        _expect_raises(m.t, f"{config.kind}({what})", fn, (ValueError,))


# What each main_grad misuse puts in place of a weight's main_grad (None: deleted).
_BROKEN_MAIN_GRAD: dict[str, Callable[[torch.Tensor], torch.Tensor | None]] = {
    "main_grad_missing": lambda p: None,
    "main_grad_shape": lambda p: torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
    "main_grad_dtype": lambda p: torch.zeros(p.shape, dtype=torch.bfloat16),
    "main_grad_device": lambda p: torch.zeros(p.shape, dtype=torch.float32, device="meta"),
    "wgrad_fails": lambda p: torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
}


def _main_grad(m: _Misused) -> None:
    with m.broken_main_grad() as name:
        y = m.call(m.inp)
        # The forward itself succeeded: under delayed scaling it moved the input and weight
        # histories; the failing backward must move nothing more (not even grad_output's).
        m.before.update(m.run.fp8_snapshot())
        backward = functools.partial(m.run.backward_outputs, [y], [m.d.dy])
        _expect_raises(m.t, f"backward with {m.name} on {name}", backward, (RuntimeError,), name)


def _wgrad_fails(m: _Misused) -> None:
    run, t = m.run, m.t
    t.expect(run.delay, "P10 wgrad_fails needs a delayed case")
    eager = m.fb_with_twin()
    m.settle()
    with m.broken_main_grad() as name:
        what = f"backward_dw() with a broken {name}.main_grad"
        _expect_raises(t, what, run.dw, (RuntimeError,), name)
    _unchanged(t, "failed backward_dw()", run, m.before, m.pending)
    run.dw()
    t.bitwise_all("retried entry: ", run.all_snapshot(), eager.all_snapshot())


# ---- a hook raises (SPEC §3, §4): every hook kind at every position --------------------------

#: The misuses where a hook raises, and what registers the hook: on a parameter, or on the
#: module (``hook_raises``: SPEC §4's wgrad hooks; the others ``torch.nn.Module`` hooks).
RAISING_HOOKS = {
    "tensor_hook_raises": "register_hook",
    "post_hook_raises": "register_post_accumulate_grad_hook",
    "hook_raises": "register_wgrad_accumulation_and_reduce_hooks",
    "backward_hook_raises": "register_full_backward_hook",
    "backward_pre_hook_raises": "register_full_backward_pre_hook",
    "forward_hook_raises": "register_forward_hook",
}
_PARAM_HOOKS = ("tensor_hook_raises", "post_hook_raises")
#: Hooks of the misuse's kind registered at its site; one of them raises.
HOOKS_AT_SITE = 3
#: Micro-batches a raising-hook misuse runs (the hook raises while the one it names is handled).
RAISING_MICRO_BATCHES = 2


@dataclasses.dataclass(frozen=True)
class HookPosition:
    """Where a raising hook sits: on parameter ``param`` (``None``: on the module), the
    ``hook``-th of :data:`HOOKS_AT_SITE` registered there, raising while micro-batch
    ``micro_batch`` is handled (its backward, or under delay its entry's ``backward_dw()``).
    String form ``"weight#1mb0"`` (``"#2mb1"`` on the module), kept in ``Misuse.weight``."""

    param: str | None
    hook: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.param or ''}#{self.hook}mb{self.micro_batch}"

    @classmethod
    def parse(cls, text: str | None) -> HookPosition:
        """``"weight#1mb0"``; ``None`` is the last hook on the module, first micro-batch."""
        if text is None:
            return cls(None, HOOKS_AT_SITE - 1, 0)
        param, _, rest = text.partition("#")
        hook, _, mb = rest.partition("mb")
        if not (hook.isdigit() and mb.isdigit()) or int(hook) >= HOOKS_AT_SITE:
            raise ValueError(
                f"raising-hook position {text!r} is not PARAM#HOOKmbMICRO_BATCH with HOOK below "
                f"{HOOKS_AT_SITE} (e.g. 'weight#1mb0', '#2mb1' on the module)"
            )
        return cls(param or None, int(hook), int(mb))


def raising_hook_params(config: ModuleConfig) -> list[str]:
    """The parameters a raising tensor or post-accumulate hook may sit on, in SPEC §2's order
    (a fused weight takes no tensor hook: SPEC §3; the caller drops it for those)."""
    return [s.name for s in param_specs(config)]


def _hook_sites(config: ModuleConfig, name: str) -> list[str]:
    params = raising_hook_params(config)
    if name == "tensor_hook_raises" and config.fuse_wgrad_accumulation:
        fused = set(gemm_weight_names(config))
        params = [p for p in params if p not in fused]
    return params


def raising_hook_positions(config: ModuleConfig, name: str) -> list[HookPosition]:
    """Every position of a raising hook of misuse ``name`` on ``config``."""
    sites = _hook_sites(config, name) if name in _PARAM_HOOKS else [None]
    return [
        HookPosition(p, h, e)
        for p in sites
        for h in range(HOOKS_AT_SITE)
        for e in range(RAISING_MICRO_BATCHES)
    ]


class _HookError(Exception):
    """What a hook raises on purpose; P10 expects this very object back."""


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _step_name(step: tuple[str, int]) -> str:
    op, index = step
    return f"forward+backward of micro-batch {index}" if op == "fb" else f"backward_dw() #{index}"


class _HookedRun:
    """A module with :data:`HOOKS_AT_SITE` recording hooks of one kind at one site; under test
    (``raises``) the hook at the position raises once, on its call for the named micro-batch.
    Non-raising tensor hooks replace the gradient by twice it (exact), so a hook skipped or run
    twice shows in the values. A recording wgrad hook (when the kind is another) shows which
    module hooks ran."""

    def __init__(
        self, m: _Misused, at: HookPosition, raises: bool, module: torch.nn.Module | None = None
    ) -> None:
        self.m, self.at = m, at
        self.run = ModuleRun(
            m.backend, m.case, delay=m.case.delay, prefill_grads=True, hooks=0, module=module
        )
        self.data = _raising_data(m.case)
        self.log: list[str] = []
        self.step_logs: list[list[str]] = []
        self.inputs: dict[int, torch.Tensor] = {}
        self.error = _HookError(f"{m.name} at {at} raised on purpose") if raises else None
        self.raised = False
        self.handles: list[Any] = []
        self.labels = [self._label(i) for i in range(HOOKS_AT_SITE)]
        for i in range(HOOKS_AT_SITE):
            self.handles.append(self._register(i))
        if m.name != "hook_raises" and m.backend.has_hooks() and module is None:
            m.backend.register_hook(self.run.module, lambda: self.log.append("wgrad hook"))

    def _fire(self, label: str, index: int, calls: list[int]) -> None:
        self.log.append(label)
        calls[0] += 1
        armed = self.error is not None and index == self.at.hook and not self.raised
        if armed and calls[0] - 1 == self.at.micro_batch:
            self.raised = True
            raise self.error

    def _label(self, i: int) -> str:
        at = f" on {self.at.param}" if self.at.param else ""
        return f"{self.m.name.removesuffix('_raises')}[{i}]{at}"

    def _register(self, i: int) -> Any:
        name, at, calls, label = self.m.name, self.at, [0], self.labels[i]
        if name == "tensor_hook_raises":

            def tensor_hook(grad):
                self._fire(label, i, calls)
                return None if i == at.hook else grad * 2

            return self.run.params[at.param].register_hook(tensor_hook)
        if name == "post_hook_raises":
            param = self.run.params[at.param]
            return param.register_post_accumulate_grad_hook(lambda _p: self._fire(label, i, calls))
        if name == "hook_raises":
            self.m.backend.register_hook(self.run.module, lambda: self._fire(label, i, calls))
            return None
        module = self.m.backend.torch_module(self.run.module)
        register = getattr(module, RAISING_HOOKS[name])
        return register(lambda *_args: self._fire(label, i, calls))

    def remove_raising_hook(self) -> None:
        """Take the raising hook away (its handle; a wgrad hook, which has none, stops
        raising: it raises once anyway)."""
        handle = self.handles[self.at.hook]
        if handle is not None:
            handle.remove()

    def do(self, step: tuple[str, int]) -> None:
        start = len(self.log)
        try:
            op, index = step
            if op == "fb":
                d = self.data[index]
                x = self.inputs[index] = d.fresh_input()
                y = self.run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
                self.m.backend.backward(self.run.module, [y], [d.dy])
            else:
                self.run.dw()
        finally:
            self.step_logs.append(self.log[start:])


def _raising_data(case: Case) -> list[MicroBatchData]:
    return make_micro_batches(_with_two_micro_batches(case))


def _with_two_micro_batches(case: Case) -> Case:
    """``case`` with :data:`RAISING_MICRO_BATCHES` micro-batches (a later one copies the first's
    shape and does not overwrite ``main_grad``)."""
    mbs = case.micro_batches
    if len(mbs) >= RAISING_MICRO_BATCHES:
        return case
    later = dataclasses.replace(mbs[0], is_first_microbatch=False)
    mbs = mbs + (later,) * (RAISING_MICRO_BATCHES - len(mbs))
    return dataclasses.replace(case, micro_batches=mbs)


def _schedule(delay: bool, skipped: int | None = None) -> list[tuple[str, int]]:
    """Every micro-batch's forward and backward, then under delay a ``backward_dw()`` per
    entry; ``skipped``: that micro-batch never runs (so one entry fewer)."""
    fbs = [("fb", i) for i in range(RAISING_MICRO_BATCHES) if i != skipped]
    return fbs + ([("dw", i) for i in range(len(fbs))] if delay else [])


def _raising_site(m: _Misused, at: HookPosition) -> tuple[str, int]:
    """The step in which the hook is due to raise: under delay a GEMM parameter's hooks and the
    wgrad hooks run in its entry's ``backward_dw()``; everything else in the backward (or, a
    forward hook, the forward) of the micro-batch."""
    gemm = at.param is not None and at.param not in _norm_names(m.config)
    if m.case.delay and (m.name == "hook_raises" or gemm):
        return ("dw", at.micro_batch)
    return ("fb", at.micro_batch)


def _norm_names(config: ModuleConfig) -> set[str]:
    gemm = set(gemm_weight_names(config)) | set(gemm_bias_names(config))
    return {n for n in raising_hook_params(config) if n not in gemm}


def _run_all(run: _HookedRun, schedule: list[tuple[str, int]], remove_before: int) -> list:
    """``schedule`` on a twin; the raising hook's counterpart goes before step
    ``remove_before`` (as on the run under test); returns the snapshot before each step and
    after the last."""
    snaps = []
    for s, step in enumerate(schedule):
        if s == remove_before:
            run.remove_raising_hook()
        snaps.append(run.run.all_snapshot())
        run.do(step)
    snaps.append(run.run.all_snapshot())
    return snaps


def _position_of(m: _Misused) -> HookPosition:
    """The case's :class:`HookPosition`, refused with ``ValueError`` naming it when it does not
    fit the module (a parameter it lacks, a parameter for a module hook, a later micro-batch
    than the misuse runs)."""
    at = HookPosition.parse(m.case.variant.weight)
    sites = _hook_sites(m.config, m.name) if m.name in _PARAM_HOOKS else [None]
    if at.param not in sites or at.micro_batch >= RAISING_MICRO_BATCHES:
        raise ValueError(
            f"{m.name}: position {str(at)!r} does not fit {m.config.kind}; the hook sits on one "
            f"of {sites} (None: the module) while one of micro-batches "
            f"0..{RAISING_MICRO_BATCHES - 1} is handled"
        )
    return at


def _raising_hook(m: _Misused) -> None:
    """A hook of kind ``m.name`` raises at ``case.variant.weight``'s position (a
    :class:`HookPosition`). The hook's own exception object propagates, from the step where the
    hook is due; in that step the hooks before it ran and none after it; each gradient is
    written once or not at all, as SPEC §4 and autograd say; ``pending_wgrad_count`` is what
    they imply. Then, the raising hook removed, the rest of the run (a failed ``backward_dw()``
    retried, the later micro-batches, the queue drained) ends with every gradient bitwise that
    of a twin whose hook never raised: the twin that ran the failed micro-batch where its
    writes happened (or are still queued), the twin that skipped it where they did not."""
    t, case = m.t, m.case
    at = _position_of(m)
    delay, kind = case.delay, m.name
    t.expect(kind != "hook_raises" or delay, "P10 hook_raises needs a delayed case")
    site = _raising_site(m, at)
    schedule = _schedule(delay)
    fail = schedule.index(site)
    with_twin = _HookedRun(m, at, raises=False)
    with_snaps = _run_all(with_twin, schedule, fail + 1)
    a = _HookedRun(m, at, raises=True)
    where = f"{kind} at {at}, delay={delay}"
    for s in range(fail):
        try:
            a.do(schedule[s])
        except Exception as exc:
            raise PropertyViolation(
                f"{where}: {_step_name(schedule[s])} raised {type(exc).__name__}({exc}); the "
                f"hook is due to raise in {_step_name(site)}"
            ) from exc
    before, pending = a.run.all_snapshot(), a.run.pending()
    try:
        a.do(site)
    except Exception as exc:
        t.expect(
            exc is a.error,
            f"{where}: {_step_name(site)} raised {type(exc).__name__}({exc}) instead of the "
            f"hook's own {a.error!r}",
        )
    else:
        t.expect(a.raised, f"{where}: the hook was not called for micro-batch {at.micro_batch}")
        raise PropertyViolation(
            f"{where}: the hook raised in {_step_name(site)}, but the call returned normally "
            "(the exception was swallowed)"
        )
    seen, due = a.step_logs[-1], with_twin.step_logs[fail]
    t.expect(
        seen == due[: len(seen)] and seen[-1:] == [a.labels[at.hook]],
        f"{where}: hooks called in the failing {_step_name(site)} {seen} are not those of the "
        f"twin up to the raising one, then none ({due})",
    )
    after = a.run.all_snapshot()
    if site[0] == "dw":
        _after_failed_dw(m, a, with_twin, where, before, pending, after, with_snaps[fail + 1])
        return
    queued = delay and kind in (*_PARAM_HOOKS, "backward_hook_raises")
    t.equal(
        f"{where}: pending_wgrad_count after the failed backward",
        a.run.pending(),
        pending + (1 if queued else 0),
    )
    a.remove_raising_hook()
    twin_after = with_snaps[fail + 1]
    written = _written_at_failure(m, at, a, before, after, twin_after, queued)
    x = a.inputs.get(at.micro_batch)
    x_twin = with_twin.inputs[at.micro_batch].grad
    if x is not None and x.grad is not None:
        t.bitwise(f"{where}: inp.grad of the failed micro-batch", x.grad, x_twin)
    nothing = kind in ("backward_hook_raises", "backward_pre_hook_raises", "forward_hook_raises")
    if nothing or (kind == "tensor_hook_raises" and at.param not in _norm_names(m.config)):
        t.expect(x is None or x.grad is None, f"{where}: the input got a gradient")
    if _has_torch_nn_twin(m):
        _as_torch_nn_linear(m, at, a, site, before, after)
    without_twin = _HookedRun(m, at, raises=False)
    skipped = _schedule(delay, skipped=at.micro_batch)
    without_snaps = _run_all(without_twin, skipped, fail)
    if queued or not delay:
        rest, twin_logs = schedule[fail + 1 :], with_twin.step_logs[fail + 1 :]
    else:
        rest, twin_logs = skipped[fail:], without_twin.step_logs[fail:]
    for step in rest:
        a.do(step)
    t.equal(f"{where}: pending_wgrad_count after the run", a.run.pending(), 0)
    t.expect(
        a.step_logs[fail + 1 :] == twin_logs,
        f"{where}: hooks after the failure {a.step_logs[fail + 1 :]} differ from the twin's "
        f"{twin_logs}",
    )
    final = a.run.all_snapshot()
    for key in sorted(final):
        twin = with_snaps[-1] if written[key] else without_snaps[-1]
        which = "ran" if written[key] else "skipped"
        t.bitwise(
            f"{where}: {key} (twin that {which} micro-batch {at.micro_batch}) ",
            final[key],
            twin[key],
        )


class _TorchNNLinear(torch.nn.Linear):
    """``torch.nn.Linear`` taking the forward's ``is_first_microbatch`` (and ignoring it), with
    nothing ever pending: where autograd alone decides what a raising hook does."""

    pending_wgrad_count = 0

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        return super().forward(inp)


def _has_torch_nn_twin(m: _Misused) -> bool:
    c = m.config
    plain = not (m.case.delay or c.fuse_wgrad_accumulation or c.recipe or c.autocast)
    return plain and c.kind == "Linear" and isinstance(m.case.variant, Misuse)


def _as_torch_nn_linear(m: _Misused, at: HookPosition, a: _HookedRun, site, before, after):
    """Without delay a ``Linear``'s hooks raise as ``torch.nn.Linear``'s with the same weights,
    gradients and hooks do: the same hook object propagates from the same step, the hooks
    called in that step up to the raising one are the same (SPEC §4's wgrad hooks aside:
    ``torch.nn`` has none), and the raising parameter's gradient is written or not alike (and,
    for a module hook, the input's). Parameters that neither autograd nor SPEC orders (which
    leaf autograd reaches first) are not compared here."""
    t, c = m.t, m.config
    where = f"{m.name} at {at}, torch.nn.Linear twin"
    module = _TorchNNLinear(
        c.in_features, c.out_features, bias=c.bias, dtype=c.torch_dtype, device=c.device
    )
    m.backend.load_state(module, make_state(c, m.case.seed))
    twin = _HookedRun(m, at, raises=True, module=module)
    schedule = _schedule(False)
    fail = schedule.index(site)
    for step in schedule[:fail]:
        twin.do(step)
    twin_before = twin.run.all_snapshot()
    try:
        twin.do(site)
    except Exception as exc:
        t.expect(exc is twin.error, f"{where}: autograd raised {exc!r}, not the hook's own")
    else:
        raise PropertyViolation(f"{where}: autograd swallowed the hook's exception")
    twin_after = twin.run.all_snapshot()
    ours = [c for c in a.step_logs[fail] if c != "wgrad hook"]
    t.equal(f"{where}: hooks called in the failing step", ours, twin.step_logs[fail])
    if at.param is not None:
        key = f"{at.param}.grad"
        ours_written = not _same(after[key], before[key])
        theirs_written = not _same(twin_after[key], twin_before[key])
        t.equal(f"{where}: {key} written by the failed backward", ours_written, theirs_written)
    else:
        x, x_twin = a.inputs.get(at.micro_batch), twin.inputs.get(at.micro_batch)
        ours_x = x is not None and x.grad is not None
        theirs_x = x_twin is not None and x_twin.grad is not None
        t.equal(f"{where}: inp.grad written by the failed backward", ours_x, theirs_x)


def _written_at_failure(m, at, a, before, after, twin_after, queued) -> dict[str, bool]:
    """For each gradient after a backward that failed: whether the failed micro-batch's
    contribution is in it (or, a delayed GEMM parameter's, queued). Written or not, never
    half: each equals the twin's after the step or what it was before. The raising parameter's
    own is determined (autograd: tensor hooks run before the write, post-accumulate hooks
    after), and so is everything when the hook runs before the module's backward or after its
    forward (nothing written)."""
    t, where = m.t, f"{m.name} at {at}"
    own = {f"{at.param}.grad", f"{at.param}.main_grad"} if at.param else set()
    before_module = m.name in ("backward_pre_hook_raises", "forward_hook_raises")
    out = {}
    for key in sorted(after):
        name = key.partition(".")[0]
        deferred = m.case.delay and name not in _norm_names(m.config)
        if deferred:
            t.bitwise(f"{where}: deferred {key} after the failed backward", after[key], before[key])
            out[key] = queued
            continue
        done = _same(after[key], twin_after[key])
        kept = _same(after[key], before[key])
        t.expect(
            done or kept,
            f"{where}: {key} after the failed backward is neither its value before nor the "
            "twin's after (written in part, or twice)",
        )
        if key in own or before_module:
            expected = m.name == "post_hook_raises" and not before_module
            t.expect(
                done if expected else kept,
                f"{where}: {key} {'not ' if expected else ''}written by the failed backward",
            )
            out[key] = expected
        else:
            out[key] = done
    return out


def _after_failed_dw(m, a, twin, where, before, pending, after, twin_after) -> None:
    """SPEC §4 for a hook raising in ``backward_dw()``: a tensor hook runs before anything is
    written, so nothing is and the entry stays at the head (retried); a post-accumulate or wgrad
    hook runs after every gradient is written, so the entry is consumed."""
    t = m.t
    retried = m.name == "tensor_hook_raises"
    t.equal(
        f"{where}: pending_wgrad_count after the failed backward_dw()",
        a.run.pending(),
        pending if retried else pending - 1,
    )
    if retried:
        t.bitwise_all(f"{where}: written by a failed backward_dw() ", after, before)
    else:
        t.bitwise_all(
            f"{where}: not written by the backward_dw() whose hook raised ", after, twin_after
        )
    fail = len(a.step_logs) - 1
    schedule = _schedule(True)
    if retried:
        a.do(("dw", -1))  # the raising hook is still there, and raises only once
    a.remove_raising_hook()
    for step in schedule[fail + 1 :]:
        a.do(step)
    twin_logs = twin.step_logs[fail if retried else fail + 1 :]
    t.expect(
        a.step_logs[fail + 1 :] == twin_logs,
        f"{where}: hooks after the failure {a.step_logs[fail + 1 :]} differ from the twin's "
        f"{twin_logs}",
    )
    t.equal(f"{where}: pending_wgrad_count after the run", a.run.pending(), 0)
    t.bitwise_all(f"{where}: after the run ", a.run.all_snapshot(), twin.run.all_snapshot())


# Then: the module still works, as one that never saw the misuse.


def _catch_up_drained_queue(m: _Misused, fresh: ModuleRun) -> None:
    if m.run.delay:
        fresh.fb(m.d)
        fresh.dw()


def _catch_up_forward(m: _Misused, fresh: ModuleRun) -> None:
    # The misused module's forward moved its FP8 histories; the fresh one runs the same.
    fresh.forward(m.d.fresh_input(), m.d.spec.m_splits, m.d.spec.is_first_microbatch)


def _still_works(m: _Misused, catch_up: Callable[[_Misused, ModuleRun], None] | None) -> None:
    """The misuse changed nothing, gave the input no gradient, and a valid micro-batch
    afterwards matches a module that never saw it (after ``catch_up``)."""
    t, name = m.t, m.name
    _unchanged(t, f"after {name}", m.run, m.before, m.pending)
    t.expect(m.inp.grad is None, f"after {name}: the input got a gradient")
    fresh = ModuleRun(m.backend, m.case, delay=m.run.delay, prefill_grads=True)
    if catch_up is not None:
        catch_up(m, fresh)
    m.run.fb(m.d)
    fresh.fb(m.d)
    m.run.drain()
    fresh.drain()
    t.bitwise_all(
        f"after {name}, a valid micro-batch: ", m.run.all_snapshot(), fresh.all_snapshot()
    )


class _Handling(NamedTuple):
    """How P10 checks one misuse: ``provoke`` it and check the error; then, unless ``judged``
    (it checked the aftermath itself), :func:`_still_works` after ``catch_up``."""

    provoke: Callable[[_Misused], None]
    catch_up: Callable[[_Misused, ModuleRun], None] | None = None
    judged: bool = False


_HANDLING: dict[str, _Handling] = {
    "bad_last_dim": _Handling(_bad_last_dim),
    "bad_dtype": _Handling(_bad_dtype),
    "bad_device": _Handling(_bad_device),
    "dw_empty": _Handling(_dw_empty, _catch_up_drained_queue),
    "dw_no_delay": _Handling(_dw_no_delay, lambda m, fresh: fresh.fb(m.d)),
    "bad_ctor": _Handling(_bad_ctor),
    **{n: _Handling(_raising_hook, judged=True) for n in RAISING_HOOKS},
    "wgrad_fails": _Handling(_wgrad_fails, judged=True),
    "fp8_tokens": _Handling(_fp8_tokens),
    "fp8_features": _Handling(_fp8_features),
    **{n: _Handling(_bad_m_splits) for n in _BAD_SPLITS},
    "main_grad_missing": _Handling(_main_grad, _catch_up_forward),
    "main_grad_shape": _Handling(_main_grad, _catch_up_forward),
    "main_grad_dtype": _Handling(_main_grad, _catch_up_forward),
    "main_grad_device": _Handling(_main_grad, _catch_up_forward),
}


def check_p10(backend: Backend, case: Case) -> CheckResult:
    """P10: the misuse ``case.variant`` (a :class:`~.variants.Misuse`) raises the SPEC error,
    with a message naming the offending value, and leaves parameters, gradients, ``main_grad``
    and the queue exactly as they were (bitwise); a valid micro-batch afterwards still matches
    a fresh module."""
    if not isinstance(case.variant, Misuse):
        raise ValueError(f"unknown P10 misuse {case.variant!r}; expected one of {MISUSES}")
    handling = _HANDLING[case.variant.name]
    m = _Misused.start(backend, case)
    handling.provoke(m)
    if not handling.judged:
        _still_works(m, handling.catch_up)
    return m.t.result


def _ctor_args(config: ModuleConfig, **override: int) -> list[int]:
    k = override.get("in_features", config.in_features)
    m = override.get("out_features", config.out_features)
    return [config.num_gemms, k, m] if config.kind == "GroupedLinear" else [k, m]


@st.composite
def p10_cases(draw, kinds, dtypes, devices, recipes):
    """One micro-batch and a misuse from :func:`misuses` as ``variant`` (``main_grad_*`` and
    ``wgrad_fails`` on a drawn GEMM weight: ``Misuse("main_grad_shape", "fc2_weight")``)."""
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 1), recipes=recipes))
    misuse = Misuse(draw(st.sampled_from(misuses(case.config, case.delay))))
    if misuse.breaks_main_grad:
        misuse = Misuse(misuse.name, draw(st.sampled_from(gemm_weight_names(case.config))))
    if misuse.name in RAISING_HOOKS:
        at = draw(st.sampled_from(raising_hook_positions(case.config, misuse.name)))
        case = _with_two_micro_batches(case)
        misuse = Misuse(misuse.name, str(at))
    return dataclasses.replace(case, variant=misuse)


# Misuses whose outcome the is_first_microbatch flag can change under fused accumulation (a
# backward or backward_dw() runs with the overwrite flag); the others raise in the forward.
_FLAGGED = ("main_grad", "wgrad_fails", "dw_empty", "dw_no_delay", "hook_raises")


def p10_explicit(kinds, dtypes, devices, recipes) -> list[Case]:
    """P10's enumeration (SPEC §7): every misuse of :func:`misuses` for every module kind, fused
    and plain, delay on and off (:func:`_enumerated`); recipes, boundary shapes and layouts cycle
    through :func:`~.strategies.boundary_cases` (a misuse of block recipes only on those)."""
    base = boundary_cases(kinds, dtypes, devices, n_micro_batches=(1, 1), recipes=recipes)
    out: list[Case] = []
    turn = itertools.count()  # which of the boundary cases that fit a misuse it runs on next
    nth = collections.defaultdict(itertools.count)  # cases of each raising-hook misuse so far
    for kind in kinds:
        bases = [c for c in base if c.config.kind == kind] or [
            dataclasses.replace(c, config=dataclasses.replace(c.config, kind=kind))
            for c in base
            if c.config.kind != "GroupedLinear" and kind != "GroupedLinear"
        ]
        for fused in (False, True):
            for delay in (False, True):
                configs = [
                    dataclasses.replace(c.config, fuse_wgrad_accumulation=fused) for c in bases
                ]
                names: list[str] = []
                for cfg in configs:
                    names += [v for v in misuses(cfg, delay) if v not in names]
                for name in names:
                    if name in RAISING_HOOKS:
                        out += _raising_cases(
                            name, bases, configs, fused, delay, turn, nth[name], len(out)
                        )
                    else:
                        out += _enumerated(name, bases, configs, fused, delay, turn, len(out))
    return out


# Positions of a raising hook per (kind, fused, delay): on a parameter the first, middle and last
# it may sit on; on the module one (two of SPEC §4's wgrad hooks, which run under delay only).
# The n-th case of a misuse takes the hook and micro-batch _RAISING_TURNS[(n + n // 3) % 6]:
# over fused x delay each parameter position meets every hook and both micro-batches.
_RAISING_PARAM_POSITIONS = (0, 0.5, 1)
_RAISING_TURNS = tuple((h, e) for e in range(RAISING_MICRO_BATCHES) for h in range(HOOKS_AT_SITE))


def _raising_cases(name, bases, configs, fused, delay, turn, nth, seed) -> list[Case]:
    """The cases of raising-hook misuse ``name`` for one (kind, fused, delay), each on the next
    boundary case that fits it, with two micro-batches (``is_first_microbatch`` of the first
    cycling through ``None``, ``True``, ``False`` under fused accumulation); ``nth``: how many
    cases of ``name`` came before (a counter)."""
    fits = [i for i, cfg in enumerate(configs) if name in misuses(cfg, delay)]
    out = []
    if name in _PARAM_HOOKS:
        spots: tuple = _RAISING_PARAM_POSITIONS
    else:
        spots = (None, None) if name == "hook_raises" else (None,)
    for j, spot in enumerate(spots):
        k, n = next(turn), next(nth)
        i = fits[k % len(fits)]
        sites = _hook_sites(configs[i], name)
        param = None if spot is None else sites[round(spot * (len(sites) - 1))]
        at = HookPosition(param, *_RAISING_TURNS[(n + n // 3) % len(_RAISING_TURNS)])
        (mb,) = bases[i].micro_batches
        flag = (None, True, False)[n % 3] if fused else mb.is_first_microbatch
        mbs = (dataclasses.replace(mb, is_first_microbatch=flag),)
        case = dataclasses.replace(bases[i], config=configs[i], micro_batches=mbs, delay=delay)
        case = _with_two_micro_batches(case)
        out.append(dataclasses.replace(case, variant=Misuse(name, str(at)), seed=seed + j))
    return out


def _enumerated(name, bases, configs, fused, delay, turn, seed) -> list[Case]:
    """The cases of misuse ``name`` for one (kind, fused, delay): each ``is_first_microbatch``
    flag (``None``, ``True``, ``False``) where it runs a backward under fused accumulation, each
    GEMM weight where it breaks a ``main_grad``, each on the next boundary case that fits it."""
    fits = [i for i, cfg in enumerate(configs) if name in misuses(cfg, delay)]
    on_weights = Misuse(name).breaks_main_grad
    if on_weights:
        # The configs with the most GEMM weights: every weight gets a case.
        most = max(len(gemm_weight_names(configs[i])) for i in fits)
        fits = [i for i in fits if len(gemm_weight_names(configs[i])) == most]
    flags = (None, True, False) if fused and name.startswith(_FLAGGED) else (None,)
    count = max(len(flags), len(gemm_weight_names(configs[fits[0]])) if on_weights else 1)
    out = []
    for j in range(count):
        i = fits[next(turn) % len(fits)]
        weights = gemm_weight_names(configs[i])
        misuse = Misuse(name, weights[j % len(weights)]) if on_weights else Misuse(name)
        (mb,) = bases[i].micro_batches
        flag = flags[j % len(flags)] if len(flags) > 1 else mb.is_first_microbatch
        mbs = (dataclasses.replace(mb, is_first_microbatch=flag),)
        case = dataclasses.replace(bases[i], config=configs[i], micro_batches=mbs, delay=delay)
        out.append(dataclasses.replace(case, variant=misuse, seed=seed + j))
    return out
