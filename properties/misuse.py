"""P9-P10 (SPEC §4, §5): misuse. ``ub_bulk_wgrad`` with delay raises (also under
``python -O``); bad input and misuse raise SPEC's errors, naming the value, and change nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
from hypothesis import strategies as st

from .backends import Backend
from .data import GEMM_WEIGHT, make_micro_batches, param_specs
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun
from .strategies import KINDS, Case, ModuleConfig, boundary_cases, cases, make_recipe

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


# =============================================================================================
# P9: ub_bulk_wgrad
# =============================================================================================

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
    _OPTIMIZED_RUNNING[backend_name] = subprocess.Popen(
        [sys.executable, "-O", "-c", _OPTIMIZED_SCRIPT, backend_name, *kinds],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # The backend may live on a path this process added (a test, a conftest).
        env={
            **os.environ,
            "PYTHONOPTIMIZE": "1",
            "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        },
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
    ctor = backend.constructor(kind)
    args = (2, 4, 3) if kind == "GroupedLinear" else (4, 3)
    try:
        ctor(*args, ub_bulk_wgrad=True, delay_wgrad_compute=True)
    except ValueError as exc:
        t.expect(
            UB_MESSAGE in str(exc), f"{kind}: ValueError message {str(exc)!r} lacks {UB_MESSAGE!r}"
        )
    else:
        raise PropertyViolation(
            f"{kind}(ub_bulk_wgrad=True, delay_wgrad_compute=True) did not raise ValueError"
        )
    result = optimized_constructor_results(backend.name, P9_KINDS)
    t.expect(
        result.get(kind, "").startswith("ValueError") and UB_MESSAGE in result[kind],
        f"under python -O, {kind}(ub_bulk_wgrad=True, delay_wgrad_compute=True) gave "
        f"{result.get(kind)!r}",
    )
    data = make_micro_batches(case)
    plain = ModuleRun(backend, case, delay=False, prefill_grads=True)
    bulk = ModuleRun(backend, case, delay=False, prefill_grads=True, ub_bulk_wgrad=True)
    for i, d in enumerate(data):
        xp, yp = plain.fb(d)
        xb, yb = bulk.fb(d)
        t.bitwise(f"ub_bulk_wgrad output[{i}]", yb, yp)
        t.bitwise(f"ub_bulk_wgrad inp.grad[{i}]", xb.grad, xp.grad)
    t.bitwise_all("ub_bulk_wgrad: ", bulk.all_snapshot(), plain.all_snapshot())
    t.bitwise_all("ub_bulk_wgrad: ", bulk.fp8_snapshot(), plain.fp8_snapshot())
    return t.result


# =============================================================================================
# P10: bad input and misuse
# =============================================================================================


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def _expect_raises(
    t: Tracker, what: str, fn: Callable[[], Any], types: tuple[type, ...], *needles: str
) -> BaseException:
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
            f"{what}: raised {type(exc).__name__}({exc}) instead of "
            f"{'/'.join(x.__name__ for x in types)}"
        ) from exc
    raise PropertyViolation(
        f"{what}: no error raised (expected {'/'.join(x.__name__ for x in types)})"
    )


def _state_snapshot(run: ModuleRun) -> dict[str, Any]:
    snap: dict[str, Any] = dict(run.all_snapshot())
    snap.update(run.fp8_snapshot())
    for name, p in run.params.items():
        snap[f"{name} (value)"] = p.detach().clone()
    return snap


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


MISUSES = (
    "bad_last_dim",
    "bad_dtype",
    "bad_device",
    "dw_empty",
    "dw_no_delay",
    "bad_ctor",
    "hook_raises",
    "m_splits_len",
    "m_splits_negative",
    "m_splits_sum",
    "main_grad_missing",
    "main_grad_shape",
    "main_grad_dtype",
    "main_grad_device",
    "wgrad_fails",
    "fp8_tokens",
    "fp8_features",
)

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


def check_p10(backend: Backend, case: Case) -> CheckResult:
    """P10: the misuse named by ``case.variant`` raises the SPEC error, with a message naming
    the offending value, and leaves parameters, gradients, ``main_grad`` and the queue exactly
    as they were (bitwise); a valid micro-batch afterwards still matches a fresh module."""
    t = Tracker()
    config, misuse = case.config, case.variant.split(":")[0]
    target = case.variant.split(":")[1] if ":" in case.variant else None
    data = make_micro_batches(case)
    d = data[0]
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    before, pending = _state_snapshot(run), run.pending()
    dt = config.torch_dtype
    splits = d.spec.m_splits
    inp = d.fresh_input()

    flag = d.spec.is_first_microbatch

    def call(x, ms=splits):
        return run.forward(x, ms, flag)

    if misuse == "bad_last_dim":
        bad = torch.zeros(*d.spec.lead_shape, config.in_features + 1, dtype=dt, requires_grad=True)
        _expect_raises(
            t,
            "wrong last dimension",
            lambda: call(bad),
            (ValueError,),
            str(config.in_features),
            str(config.in_features + 1),
        )
    elif misuse == "bad_dtype":
        other = torch.float64 if dt != torch.float64 else torch.float32
        _expect_raises(
            t,
            "wrong input dtype",
            lambda: call(inp.detach().to(other)),
            (TypeError, ValueError),
            _dtype_name(dt),
            _dtype_name(other),
        )
    elif misuse == "bad_device":
        _expect_raises(
            t,
            "wrong input device",
            lambda: call(inp.detach().to("meta")),
            (ValueError, TypeError),
            "meta",
            config.device,
        )
    elif misuse in ("m_splits_len", "m_splits_negative", "m_splits_sum"):
        s = list(splits or [])
        if misuse == "m_splits_len":
            ms = s + [0]
        elif misuse == "m_splits_negative":
            ms = [-1] + s[1:-1] + [s[-1] + 1 + s[0]] if len(s) > 1 else [-1]
        else:
            ms = s[:-1] + [s[-1] + 1]
        _expect_raises(
            t,
            f"m_splits={ms}",
            lambda: call(inp, ms),
            (ValueError,),
            str(ms[-1]) if misuse != "m_splits_negative" else "-1",
        )
    elif misuse == "fp8_tokens":
        # One more half-block of rows (in the first group for GroupedLinear).
        extra = config.alignment // 2
        if config.kind == "GroupedLinear":
            ms = [splits[0] + extra, *splits[1:]]
            bad = torch.zeros(sum(ms), config.in_features, dtype=dt, requires_grad=True)
            size = ms[0]
        else:
            bad = torch.zeros(d.spec.rows + extra, config.in_features, dtype=dt)
            bad.requires_grad_(True)
            ms, size = None, d.spec.rows + extra
        _expect_fp8_shape_error(
            t,
            f"{size} tokens under {config.recipe}",
            lambda: call(bad, ms),
            config,
            size,
            _TOKEN_WORDS,
        )
    elif misuse == "fp8_features":
        # A module whose in_features is half a block off; its forward must refuse, untouched.
        size = config.in_features + config.alignment // 2
        odd = ModuleRun(
            backend, case, delay=run.delay, config=dataclasses.replace(config, in_features=size)
        )
        x = torch.zeros(*d.spec.lead_shape, size, dtype=dt, requires_grad=True)
        odd_before = _state_snapshot(odd)
        _expect_fp8_shape_error(
            t,
            f"in_features={size} under {config.recipe}",
            lambda: odd.forward(x, splits, None),
            config,
            size,
            _FEATURE_WORDS,
        )
        _unchanged(t, "the module that refused", odd, odd_before, 0)
    elif misuse == "dw_empty":
        if run.delay:
            _expect_raises(
                t, "backward_dw() with nothing pending", run.dw, (RuntimeError,), "pending"
            )
            run.fb(d)
            run.dw()
            before, pending = _state_snapshot(run), run.pending()
            _expect_raises(
                t, "backward_dw() after the queue drained", run.dw, (RuntimeError,), "pending"
            )
        else:
            run.dw()  # must be a no-op on a module built without delay
    elif misuse == "dw_no_delay":
        run = ModuleRun(backend, case, delay=False, prefill_grads=True)
        run.fb(d)
        before, pending, calls = _state_snapshot(run), run.pending(), len(run.hook_calls)
        run.dw()
        t.equal("hook calls of backward_dw() without delay", len(run.hook_calls), calls)
    elif misuse == "bad_ctor":
        ctor = backend.constructor(config.kind)
        bad_calls: list[tuple[str, Callable[[], Any]]] = [
            ("in_features=0", lambda: ctor(*_ctor_args(config, in_features=0)))
        ]
        bad_calls.append(("negative out size", lambda: ctor(*_ctor_args(config, out_features=-3))))
        if config.kind == "GroupedLinear":
            bad_calls.append(("num_gemms=0", lambda: ctor(0, 4, 3)))
        if config.has_norm:
            bad_calls.append(
                ("normalization='BatchNorm'", lambda: ctor(4, 3, normalization="BatchNorm"))
            )
        if config.kind == "LayerNormMLP":
            bad_calls.append(("activation='tanh'", lambda: ctor(4, 3, activation="tanh")))
        for what, fn in bad_calls:
            _expect_raises(t, f"{config.kind}({what})", fn, (ValueError,))
    elif misuse == "hook_raises":
        t.expect(run.delay, "P10 hook_raises needs a delayed case")
        eager = ModuleRun(backend, case, delay=False, prefill_grads=True)

        def bad_hook() -> None:
            raise _HookError("hook failed on purpose")

        backend.register_hook(run.module, bad_hook)
        run.fb(d)
        eager.fb(d)
        _expect_raises(t, "backward_dw() with a raising hook", run.dw, (_HookError,))
        t.equal("pending_wgrad_count after a hook raised (entry consumed)", run.pending(), 0)
        t.bitwise_all("written before the hook raised: ", run.all_snapshot(), eager.all_snapshot())
        return t.result
    elif misuse.startswith("main_grad") or misuse == "wgrad_fails":
        name = target or run.weight_names[0]
        p = run.params[name]
        good = p.main_grad
        broken = {
            "main_grad_missing": None,
            "main_grad_shape": torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
            "main_grad_dtype": torch.zeros(p.shape, dtype=torch.bfloat16),
            "main_grad_device": torch.zeros(p.shape, dtype=torch.float32, device="meta"),
            "wgrad_fails": torch.zeros(p.shape[0] + 1, *p.shape[1:], dtype=torch.float32),
        }[misuse]
        if misuse == "wgrad_fails":
            t.expect(run.delay, "P10 wgrad_fails needs a delayed case")
            eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
            run.fb(d)
            eager.fb(d)
            before, pending = _state_snapshot(run), run.pending()
            _set_main_grad(p, broken)
            _expect_raises(
                t, f"backward_dw() with a broken {name}.main_grad", run.dw, (RuntimeError,), name
            )
            _set_main_grad(p, good)
            _unchanged(t, "failed backward_dw()", run, before, pending)
            run.dw()
            t.bitwise_all("retried entry: ", run.all_snapshot(), eager.all_snapshot())
            return t.result
        _set_main_grad(p, broken)
        y = call(inp)
        # The forward itself succeeded: under delayed scaling it moved the input and weight
        # histories; the failing backward must move nothing more (not even grad_output's).
        before.update(run.fp8_snapshot())
        _expect_raises(
            t,
            f"backward with {misuse} on {name}",
            lambda: run.backward_outputs([y], [d.dy]),
            (RuntimeError,),
            name,
        )
        _set_main_grad(p, good)
    else:
        raise ValueError(f"unknown P10 misuse {case.variant!r}; expected one of {MISUSES}")
    _unchanged(t, f"after {misuse}", run, before, pending)
    t.expect(inp.grad is None, f"after {misuse}: the input got a gradient")
    # The module must still work normally, and match a module that never saw the misuse.
    fresh = ModuleRun(backend, case, delay=run.delay, prefill_grads=True)
    if misuse in ("dw_empty",) and run.delay:
        fresh.fb(d)
        fresh.dw()
    if misuse == "dw_no_delay":
        fresh.fb(d)
    if misuse.startswith("main_grad"):
        fresh.forward(d.fresh_input(), splits, flag)  # the same forwards moved its histories
    run.fb(d)
    fresh.fb(d)
    run.drain()
    fresh.drain()
    t.bitwise_all(
        f"after {misuse}, a valid micro-batch: ", run.all_snapshot(), fresh.all_snapshot()
    )
    return t.result


def _set_main_grad(p: torch.nn.Parameter, value: torch.Tensor | None) -> None:
    if value is None:
        if hasattr(p, "main_grad"):
            del p.main_grad
    else:
        p.main_grad = value


def _ctor_args(config: ModuleConfig, **override: int) -> list[int]:
    k = override.get("in_features", config.in_features)
    m = override.get("out_features", config.out_features)
    return [config.num_gemms, k, m] if config.kind == "GroupedLinear" else [k, m]


@st.composite
def p10_cases(draw, kinds, dtypes, devices, recipes):
    """One micro-batch (its ``is_first_microbatch`` flag passed to every forward) and a misuse
    from :func:`misuses` as ``variant`` (``main_grad_*`` and ``wgrad_fails`` name the weight,
    e.g. ``"main_grad_shape:fc2_weight"``)."""
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 1), recipes=recipes))
    variant = draw(st.sampled_from(misuses(case.config, case.delay)))
    if variant.startswith("main_grad") or variant == "wgrad_fails":
        weights = [s.name for s in param_specs(case.config) if s.role == GEMM_WEIGHT]
        variant = f"{variant}:{draw(st.sampled_from(weights))}"
    return dataclasses.replace(case, variant=variant)


# Misuses whose outcome the is_first_microbatch flag can change under fused accumulation (a
# backward or backward_dw() runs with the overwrite flag); the others raise in the forward.
_FLAGGED = ("main_grad", "wgrad_fails", "dw_empty", "dw_no_delay", "hook_raises")


def _weights(config: ModuleConfig) -> list[str]:
    return [s.name for s in param_specs(config) if s.role == GEMM_WEIGHT]


def p10_explicit(kinds, dtypes, devices, recipes) -> list[Case]:
    """P10's enumeration (SPEC §7): every misuse of :func:`misuses` for every module kind,
    fused and plain accumulation, delay on and off; under fused accumulation each misuse that
    runs a backward for each ``is_first_microbatch`` flag (``None``, ``True``, ``False``), and
    each ``main_grad`` misuse on every GEMM weight. Recipes, boundary shapes and layouts cycle
    through :func:`~.strategies.boundary_cases` (a misuse of block recipes only on those)."""
    base = boundary_cases(kinds, dtypes, devices, n_micro_batches=(1, 1), recipes=recipes)
    out: list[Case] = []
    counter = 0
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
                for variant in names:
                    fits = [i for i, cfg in enumerate(configs) if variant in misuses(cfg, delay)]
                    if variant.startswith(("main_grad", "wgrad_fails")):
                        # The configs with the most GEMM weights: every weight gets a case.
                        most = max(len(_weights(configs[i])) for i in fits)
                        fits = [i for i in fits if len(_weights(configs[i])) == most]
                    flags = (
                        (None, True, False) if fused and variant.startswith(_FLAGGED) else (None,)
                    )
                    weights = (
                        [s.name for s in param_specs(configs[fits[0]]) if s.role == GEMM_WEIGHT]
                        if variant.startswith(("main_grad", "wgrad_fails"))
                        else [""]
                    )
                    for j in range(max(len(flags), len(weights))):
                        i = fits[counter % len(fits)]
                        counter += 1
                        c = bases[i]
                        if weights[0]:
                            names_i = [
                                s.name for s in param_specs(configs[i]) if s.role == GEMM_WEIGHT
                            ]
                            target = f"{variant}:{names_i[j % len(names_i)]}"
                        else:
                            target = variant
                        (mb,) = c.micro_batches
                        flag = flags[j % len(flags)] if len(flags) > 1 else mb.is_first_microbatch
                        out.append(
                            dataclasses.replace(
                                c,
                                config=configs[i],
                                micro_batches=(dataclasses.replace(mb, is_first_microbatch=flag),),
                                delay=delay,
                                variant=target,
                                seed=len(out),
                            )
                        )
    return out
