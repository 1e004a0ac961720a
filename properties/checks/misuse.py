"""P9-P10 (SPEC §4, §5): misuse. ``ub_bulk_wgrad`` with delay raises (also under
``python -O``); bad input and misuse raise SPEC's errors, naming the value, and change nothing.
"""

from __future__ import annotations

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
from ..cases.data import MicroBatchData, gemm_weight_names, make_micro_batches
from ..cases.strategies import KINDS, Case, ModuleConfig, boundary_cases, cases, make_recipe
from ..cases.variants import MISUSES, Misuse
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun, clone_of

__all__ = [
    "UB_MESSAGE",
    "MISUSES",
    "misuses",
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


class _HookError(Exception):
    pass


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


def _hook_raises(m: _Misused) -> None:
    run, t = m.run, m.t
    t.expect(run.delay, "P10 hook_raises needs a delayed case")

    def bad_hook() -> None:
        raise _HookError("hook failed on purpose")

    m.backend.register_hook(run.module, bad_hook)
    eager = m.fb_with_twin()
    _expect_raises(t, "backward_dw() with a raising hook", run.dw, (_HookError,))
    t.equal("pending_wgrad_count after a hook raised (entry consumed)", run.pending(), 0)
    t.bitwise_all("written before the hook raised: ", run.all_snapshot(), eager.all_snapshot())


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
    "hook_raises": _Handling(_hook_raises, judged=True),
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
                    out += _enumerated(name, bases, configs, fused, delay, turn, len(out))
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
