"""P18's module-protocol kinds (SPEC §2, "Every module is a well-behaved ``torch.nn.Module``";
docs/harness.md lists what each checks), dispatched by :mod:`.fidelity`; n/a on a backend whose
modules are the adapter's own (:meth:`~.backends.Backend.module_protocol_reason`). A copy does
not carry ``.grad`` or ``main_grad`` (``Parameter``'s ``deepcopy`` drops them, as for
``torch.nn.Linear``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import pickle
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .. import budgets as B
from ..backends import Backend
from ..cases.case import Case
from ..cases.data import (
    GEMM_BIAS,
    GEMM_WEIGHT,
    MicroBatchData,
    make_micro_batches,
    make_state,
    param_specs,
    role_of,
    with_layout,
)
from .misuse import _expect_raises, _state_snapshot
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun, Snapshot, clone_of


def _what(case: Case) -> str:
    """The prefix of a P18 message: kind, delay, fused accumulation, targets."""
    parts = [case.variant, "delay" if case.delay else "no delay"]
    if case.config.fuse_wgrad_accumulation:
        parts.append("fused")
    if case.asked:
        parts.append("on " + ", ".join(case.asked))
    return f"P18 {parts[0]} ({', '.join(parts[1:])}): "


def _kind(table: dict[str, Callable[[Backend, Case], CheckResult]], *variants: str) -> Callable:
    """Enter the decorated check in ``table`` as the check of the kinds ``variants``."""

    def enter(check: Callable[[Backend, Case], CheckResult]) -> Callable:
        table.update(dict.fromkeys(variants, check))
        return check

    return enter


#: The module-protocol kinds of P18 (``case.variant``) and their checks, in the order below.
PROTOCOL_CHECKS: dict[str, Callable[[Backend, Case], CheckResult]] = {}


def _start(backend: Backend, case: Case, **kw: Any) -> tuple:
    """A check's tracker, message prefix, micro-batches and module run (``kw``: its options)."""
    data = make_micro_batches(case)
    return Tracker(), _what(case), data, ModuleRun(backend, case, delay=case.delay, hooks=0, **kw)


@contextlib.contextmanager
def _torch_defaults(device: str | None = None, dtype: torch.dtype | None = None) -> Iterator[None]:
    """torch's default ``device`` / ``dtype`` for the block, the previous ones restored after."""
    previous_dtype = torch.get_default_dtype()
    previous_device = torch.get_default_device()
    try:
        if dtype is not None:
            torch.set_default_dtype(dtype)
        if device is not None:
            torch.set_default_device(device)
        yield
    finally:
        torch.set_default_device(None if previous_device.type == "cpu" else previous_device)
        torch.set_default_dtype(previous_dtype)


@contextlib.contextmanager
def _seeded(case: Case) -> Iterator[None]:
    """``torch.manual_seed(case.seed)`` for the block, the caller's RNG state restored after."""
    dev = torch.device(case.config.device)
    with torch.random.fork_rng(devices=[dev.index or 0] if dev.type == "cuda" else []):
        torch.manual_seed(case.seed)
        yield


def _values(backend: Backend, module: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.parameters(module).items()}


def _same_parameters(t: Tracker, what: str, backend: Backend, module, want, want_fp8=None) -> None:
    """``module``'s parameters (names, shapes, dtypes, devices, bits) and FP8 state against
    ``want`` and ``want_fp8`` (when given)."""
    got = _values(backend, module)
    t.equal(f"{what}parameter names", sorted(got), sorted(want))
    for name in sorted(want):
        a, e = got[name], want[name]
        t.equal(
            f"{what}{name} (shape, dtype, device)",
            (tuple(a.shape), a.dtype, a.device),
            (tuple(e.shape), e.dtype, e.device),
        )
        t.bitwise(f"{what}{name}", a, e)
    if want_fp8 is not None:
        t.bitwise_all(what, backend.fp8_state(module), want_fp8)


@dataclasses.dataclass
class _Trace:
    """What one module did over some micro-batches."""

    outputs: list[torch.Tensor]
    input_grads: list[torch.Tensor | None]
    pending: list[int]
    grads: Snapshot
    fp8: Snapshot


def _trace(backend: Backend, case: Case, module: Any, data: list[MicroBatchData]) -> _Trace:
    """What ``module`` does over ``data`` from ``.grad`` unset (``main_grad`` prefilled)."""
    for p in backend.parameters(module).values():
        p.grad = None
    run = ModuleRun(backend, case, delay=case.delay, module=module, hooks=0)
    out = _Trace([], [], [], {}, {})
    for d in data:
        x, y = run.fb(d)
        out.outputs.append(y)
        out.input_grads.append(clone_of(x.grad))
        out.pending.append(run.pending())
    run.drain()
    out.grads, out.fp8 = run.all_snapshot(), run.fp8_snapshot()
    return out


def _same_trace(t: Tracker, what: str, got: _Trace, want: _Trace) -> None:
    for i, (a, e) in enumerate(zip(got.outputs, want.outputs)):
        t.bitwise(f"{what}output[micro-batch {i}]", a, e)
    for i, (a, e) in enumerate(zip(got.input_grads, want.input_grads)):
        t.bitwise(f"{what}inp.grad[micro-batch {i}]", a, e)
    t.equal(f"{what}pending_wgrad_count after each backward", got.pending, want.pending)
    t.bitwise_all(what, got.grads, want.grads)
    t.bitwise_all(what, got.fp8, want.fp8)


@_kind(PROTOCOL_CHECKS, "module.placement")
def _check_placement(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    config, delay = case.config, case.delay
    # A default dtype that differs from torch's current one: the case's, else float64.
    other = config.torch_dtype if config.torch_dtype != torch.get_default_dtype() else torch.float64

    def placed(how: str, module: Any, device: str, dtype: torch.dtype) -> None:
        params = backend.parameters(module)
        want = sorted(s.name for s in param_specs(config))
        t.equal(f"{what}{how}: parameter names", sorted(params), want)
        wrong = {
            n: f"{p.device}, {p.dtype}"
            for n, p in params.items()
            if p.device.type != torch.device(device).type or p.dtype != dtype
        }
        t.expect(not wrong, f"{what}{how}: parameters not on {device} in {dtype}: {wrong}")

    with torch.device("meta"):
        m = backend.build_with_torch_defaults(config, delay=delay, omit=("device",))
    how = 'built inside `with torch.device("meta")` without device='
    placed(how, m, "meta", config.torch_dtype)
    with _torch_defaults(device="meta", dtype=other):
        m = backend.build_with_torch_defaults(config, delay=delay, omit=("device", "params_dtype"))
    how = f'built after torch.set_default_device("meta") and set_default_dtype({other}) without'
    placed(f"{how} device= or params_dtype=", m, "meta", other)
    with _torch_defaults(dtype=other):
        m = backend.build_with_torch_defaults(config, delay=delay, omit=("params_dtype",))
    how = f"built after torch.set_default_dtype({other}) without params_dtype="
    placed(how, m, config.device, other)
    with _torch_defaults(device="meta", dtype=other), torch.device("meta"):
        m = backend.build(config, delay=delay)
    how = (
        f"built with device={config.device!r}, params_dtype={config.torch_dtype} inside "
        f'`with torch.device("meta")` after set_default_device("meta") and '
        f"set_default_dtype({other}) (the explicit ones must win)"
    )
    placed(how, m, config.device, config.torch_dtype)
    return t.result


def _reset(backend: Backend, module: Any, what: str) -> None:
    if not callable(getattr(backend.torch_module(module), "reset_parameters", None)):
        raise PropertyViolation(
            f"{what}{type(backend.torch_module(module)).__name__} has no reset_parameters() "
            "(SPEC §2)"
        )
    backend.reset_parameters(module)


@_kind(PROTOCOL_CHECKS, "module.reset_parameters")
def _check_reset(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    config, delay = case.config, case.delay
    data = make_micro_batches(case)
    with _seeded(case):
        eager = backend.build(config, delay=delay)
    initial, initial_fp8 = _values(backend, eager), backend.fp8_state(eager)
    with torch.device("meta"):
        lazy = backend.build_with_torch_defaults(config, delay=delay, omit=("device",))
    off_meta = {n: str(p.device) for n, p in backend.parameters(lazy).items() if not p.is_meta}
    t.expect(
        not off_meta,
        f'{what}built inside `with torch.device("meta")` without device=, parameters are not '
        f"on meta: {off_meta}",
    )
    backend.to_empty(lazy, device=config.device)
    with _seeded(case):
        _reset(backend, lazy, what)
    label = f"{what}built on meta, to_empty(), reset_parameters() vs built eagerly, same seed: "
    _same_parameters(t, label, backend, lazy, initial, initial_fp8)
    got = _trace(backend, case, lazy, data)
    _same_trace(t, label, got, _trace(backend, case, eager, data))
    # A module given other values and run gets its initial values back.
    with _seeded(case):
        used = backend.build(config, delay=delay)
    backend.load_state(used, make_state(config, case.seed))
    run = ModuleRun(backend, case, delay=delay, module=used, hooks=0)
    run.fb(data[0])
    run.drain()
    with _seeded(case):
        _reset(backend, used, what)
    label = f"{what}given the case's values, run, then reset_parameters() vs built eagerly: "
    _same_parameters(t, label, backend, used, initial, initial_fp8)
    return t.result


@_kind(PROTOCOL_CHECKS, "module.reset_queued")
def _check_reset_queued(backend: Backend, case: Case) -> CheckResult:
    t, what, data, run = _start(backend, case, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=case.delay, prefill_grads=True, hooks=0)
    for d in data:
        run.fb(d)
        twin.fb(d)
    refused = f"{what}changed by the refused reset_parameters(): "
    while run.pending():
        before, pending = _state_snapshot(run), run.pending()
        label = f"{what}reset_parameters() with {pending} weight-gradient entries queued"
        _expect_raises(t, label, lambda: _reset(backend, run.module, what), (RuntimeError,))
        t.bitwise_all(refused, _state_snapshot(run), before)
        label = f"{what}pending_wgrad_count after the refused reset_parameters()"
        t.equal(label, run.pending(), pending)
        run.dw()
        twin.dw()
    label = f"{what}after the refused reset_parameters() calls and draining, vs a run without: "
    t.bitwise_all(label, run.all_snapshot(), twin.all_snapshot())
    t.bitwise_all(label, run.fp8_snapshot(), twin.fp8_snapshot())
    # Nothing queued: the reset goes through.
    with _seeded(case):
        initial = _values(backend, backend.build(case.config, delay=case.delay))
    with _seeded(case):
        _reset(backend, run.module, what)
    label = f"{what}reset_parameters() with nothing queued vs built eagerly, same seed: "
    _same_parameters(t, label, backend, run.module, initial)
    return t.result


# ---- initial values: absolute, against TransformerEngine's documented ones ----------------------
#: The standard deviation of TransformerEngine's default weight initialisation: its API docs
#: (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``) say ``init_method`` (and
#: ``LayerNormMLP``'s ``output_layer_init_method``) default to ``normal_(mean=0.0, std=0.023)``.
TE_WEIGHT_STD = 0.023
#: The feature sizes of the module whose weights are tested as a sample (tens of thousands of
#: values: a wrong standard deviation by a tenth is many standard errors off).
STATISTICAL_FEATURES = 128


def _initial(config: Any, name: str) -> float | None:
    """The value every element of parameter ``name`` starts with (``None``: a drawn weight):
    zero biases and ``layer_norm_bias``, ``layer_norm_weight`` one, zero when it stores
    ``gamma - 1`` (TransformerEngine's ``zero_centered_gamma``)."""
    if name == "layer_norm_weight":
        return 0.0 if config.zero_centered_gamma else 1.0
    return None if role_of(name) == GEMM_WEIGHT else 0.0


def _two_sided(alpha: float) -> float:
    """The standard normal's ``z`` with ``P(|N| > z) = alpha``."""
    return -float(torch.special.ndtri(torch.tensor(alpha / 2, dtype=torch.float64)))


def _normal_sample(t: Tracker, label: str, w: torch.Tensor, std: float) -> None:
    """``w``'s values as a sample of N(0, std²): its mean, its mean square and its largest
    magnitude, each at the false-alarm rate :data:`~.budgets.INIT_FALSE_ALARM`."""
    x = w.detach().double().flatten().cpu()
    n = x.numel()
    if n == 0:
        return
    alpha = B.INIT_FALSE_ALARM
    shown = f"{label}: {n} initial values as a sample of N(0, {std}²) (false-alarm rate {alpha})"
    t.expect(bool(torch.isfinite(x).all()), f"{shown}: not all finite")
    z_crit = _two_sided(alpha)
    z_mean = float(x.sum()) / (std * math.sqrt(n))
    worst = abs(z_mean) / z_crit
    t.expect(
        abs(z_mean) <= z_crit,
        f"{shown}: mean {float(x.mean()):.4g} is {z_mean:.3g} standard errors from 0 "
        f"(at most {z_crit:.3g})",
    )
    if n >= B.INIT_MEAN_SQUARE_MIN_SAMPLES:
        # sum(x²)/std² is chi-square with n degrees of freedom; its cube root of the mean is
        # close to N(1 - v, v), v = 2 / (9 n) (Wilson-Hilferty).
        ratio = float((x * x).mean()) / std**2
        v = 2.0 / (9.0 * n)
        z_ms = (ratio ** (1.0 / 3.0) - (1.0 - v)) / math.sqrt(v)
        t.expect(
            abs(z_ms) <= z_crit,
            f"{shown}: root mean square {math.sqrt(ratio) * std:.4g}, {z_ms:.3g} standard "
            f"errors from {std} (at most {z_crit:.3g})",
        )
        worst = max(worst, abs(z_ms) / z_crit)
    # P(max|x| > c) <= n P(|N(0, std²)| > c); one rounding step of the dtype on top.
    bound = std * _two_sided(alpha / n) * (1.0 + torch.finfo(w.dtype).eps)
    largest = float(x.abs().max())
    t.expect(largest <= bound, f"{shown}: largest magnitude {largest:.4g} > {bound:.4g}")
    t._note(max(worst, largest / bound))  # a statistical comparison: worst statistic / limit


def _initialized(backend: Backend, case: Case, config: Any, what: str) -> Iterator[tuple]:
    """``(how, module)``: modules of ``config`` given their initial values three ways, under the
    case's seed: built; given other values, then ``reset_parameters()``; built on meta,
    ``to_empty()``, ``reset_parameters()``."""
    with _seeded(case):
        built = backend.build(config, delay=case.delay)
    yield "built", built
    with _seeded(case):
        used = backend.build(config, delay=case.delay)
    backend.load_state(used, make_state(config, case.seed))
    with _seeded(case):
        _reset(backend, used, what)
    yield "given other values, then reset_parameters()", used
    with torch.device("meta"):
        lazy = backend.build_with_torch_defaults(config, delay=case.delay, omit=("device",))
    backend.to_empty(lazy, device=config.device)
    with _seeded(case):
        _reset(backend, lazy, what)
    yield "built on meta, to_empty(), reset_parameters()", lazy


_PLAIN = (bool, int, float, str, torch.dtype, torch.device, type(None))


def _settings(backend: Backend, module: Any) -> dict[str, Any]:
    """What a reset must not change: the module's public plain attributes (its options), and
    each parameter's object, ``requires_grad`` and plain attributes (an optimizer holds the
    objects; ``skip_backward_post_hook`` and the TP marks are attributes)."""
    m = backend.torch_module(module)
    out: dict[str, Any] = {
        k: v for k, v in vars(m).items() if not k.startswith("_") and isinstance(v, _PLAIN)
    }
    for name, p in backend.parameters(module).items():
        marks = {k: v for k, v in vars(p).items() if isinstance(v, _PLAIN)}
        out[f"parameter {name}"] = (id(p), p.requires_grad, marks)
    return out


def _initial_values(t: Tracker, label: str, backend: Backend, module: Any, case: Case) -> None:
    """Every parameter's initial value, and which carry ``skip_backward_post_hook`` (SPEC §4:
    exactly the deferred ones, the GEMM parameters under delay)."""
    params = backend.parameters(module)
    config = case.config
    for name in sorted(params):
        p = params[name]
        value = _initial(config, name)
        if value is None:
            _normal_sample(t, f"{label}{name}", p, TE_WEIGHT_STD)
        else:
            t.bitwise(f"{label}{name} (all {value:g})", p.detach(), torch.full_like(p, value))
        deferred = case.delay and role_of(name) in (GEMM_WEIGHT, GEMM_BIAS)
        flag = getattr(p, "skip_backward_post_hook", False)
        t.expect(
            flag is True if deferred else not flag,
            f"{label}{name}.skip_backward_post_hook is {flag!r} "
            f"(SPEC §4: True exactly on the deferred parameters; "
            f"{'deferred' if deferred else 'not deferred'}, delay {case.delay}, {config.kind})",
        )


@_kind(PROTOCOL_CHECKS, "module.initial_values")
def _check_initial_values(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    big = dataclasses.replace(
        case.config, in_features=STATISTICAL_FEATURES, out_features=STATISTICAL_FEATURES
    )
    for config in (case.config, big):
        sized = dataclasses.replace(case, config=config)
        size = f"{config.kind}({config.in_features}, {config.out_features}) "
        for how, module in _initialized(backend, sized, config, what):
            _initial_values(t, f"{what}{size}{how}: ", backend, module, sized)
    # Resets under one seed give the same bits and change no option or parameter attribute.
    with _seeded(case):
        module = backend.build(case.config, delay=case.delay)
    first, settings = _values(backend, module), _settings(backend, module)
    for i in (1, 2):
        with _seeded(case):
            _reset(backend, module, what)
        label = f"{what}reset_parameters() #{i} under the seed it was built with: "
        _same_parameters(t, label, backend, module, first)
        t.equal(f"{label}options and parameter attributes", _settings(backend, module), settings)
    return t.result


# ---- zero-centred gamma: the module normalizes as with torch.nn's initial norm ------------------


def _torch_norm_parameters(config: Any) -> dict[str, torch.Tensor]:
    """The initial ``weight`` (and ``bias``) of torch.nn's own ``LayerNorm`` / ``RMSNorm`` of the
    module's features, by the module's names."""
    kw = {"device": config.device, "dtype": config.torch_dtype}
    if config.normalization == "LayerNorm":
        norm = torch.nn.LayerNorm(config.in_features, **kw)
        return {"layer_norm_weight": norm.weight.detach(), "layer_norm_bias": norm.bias.detach()}
    norm = torch.nn.RMSNorm(config.in_features, **kw)
    return {"layer_norm_weight": norm.weight.detach()}


@_kind(PROTOCOL_CHECKS, "module.zero_centered_gamma")
def _check_zero_centered_gamma(backend: Backend, case: Case) -> CheckResult:
    """A module built or reset with ``zero_centered_gamma=True`` computes what the same module
    without it computes with torch.nn's initial norm parameters (gamma one, beta zero) and its
    own GEMM parameters: bitwise (outputs, input and parameter gradients), since the two only
    differ in how gamma is stored. On CUDA in a 16-bit dtype a kernel may take zero-centred
    gamma on another path (impl widens the input), so the comparison runs in float64 there."""
    t, what = Tracker(), _what(case)
    config = case.config
    if not config.has_norm:
        raise ValueError(f"{what}{config.kind} has no norm, so no zero_centered_gamma")
    if config.device != "cpu" and config.torch_dtype in (torch.bfloat16, torch.float16):
        config = dataclasses.replace(config, dtype="float64", recipe=None, autocast=None)
    centred = dataclasses.replace(config, zero_centered_gamma=True)
    plain = dataclasses.replace(config, zero_centered_gamma=False)
    zcase = dataclasses.replace(case, config=centred)
    pcase = dataclasses.replace(case, config=plain)
    data = make_micro_batches(zcase)
    twin_norm = _torch_norm_parameters(config)
    name = f"torch.nn.{config.normalization}"
    for how, module in _initialized(backend, zcase, centred, what):
        twin = backend.build(plain, delay=case.delay)
        backend.load_state(twin, {**_values(backend, module), **twin_norm})
        label = (
            f"{what}{how} with zero_centered_gamma=True vs the module without it given "
            f"{name}'s initial parameters (and the same GEMM parameters): "
        )
        _same_trace(
            t, label, _trace(backend, zcase, module, data), _trace(backend, pcase, twin, data)
        )
    return t.result


def _shown(text: str, name: str) -> list[str]:
    """The values ``name=...`` has in ``text`` (quotes kept)."""
    return re.findall(rf"(?<![\w.]){re.escape(name)}=([^,)\s]+)", text)


def _unquoted(value: str) -> str:
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


def _expected_repr(case: Case) -> tuple[dict[str, str], dict[str, tuple[str, str]]]:
    """The sizes (``name: value``) and options (``name: (value, default)``) as text."""
    c = case.config
    sizes = {"in_features": c.in_features, "out_features": c.out_features}
    if c.kind == "LayerNormMLP":
        sizes = {"hidden_size": c.in_features, "ffn_hidden_size": c.out_features}
    elif c.kind == "GroupedLinear":
        sizes = {"num_gemms": c.num_gemms, **sizes}
    options = {
        "bias": (str(c.bias), "True"),
        "delay_wgrad_compute": (str(case.delay), "False"),
        "fuse_wgrad_accumulation": (str(c.fuse_wgrad_accumulation), "False"),
    }
    if c.has_norm:
        options["normalization"] = (c.normalization, "LayerNorm")
        options["zero_centered_gamma"] = (str(c.zero_centered_gamma), "False")
    if c.kind == "LayerNormMLP":
        options["activation"] = (c.activation, "gelu")
    return {k: str(v) for k, v in sizes.items()}, options


@_kind(PROTOCOL_CHECKS, "module.repr")
def _check_repr(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    c = case.config
    text = repr(backend.torch_module(backend.build(c, delay=case.delay)))
    shown = f"{what}repr {text!r}"
    t.expect(text.startswith(f"{c.kind}("), f"{shown} does not start with {c.kind}(")
    sizes, options = _expected_repr(case)
    for name, value in sizes.items():
        t.equal(f"{shown}: the values shown for {name}", _shown(text, name), [value])
    for name, (value, default) in options.items():
        seen = [_unquoted(v) for v in _shown(text, name)]
        if value != default:
            t.expect(seen, f"{shown} does not show {name}={value} (it differs from the default)")
        t.expect(
            all(v == value for v in seen),
            f"{shown} shows {name}={', '.join(seen)}, but the module has {name}={value}",
        )
    if c.torch_dtype != torch.get_default_dtype():
        dtypes = [v.removeprefix("torch.") for v in _shown(text, "params_dtype")]
        default = torch.get_default_dtype()
        label = f"{shown}: params_dtype (it differs from torch's default {default})"
        t.equal(label, dtypes, [c.dtype])
    return t.result


_MODES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "with grad": contextlib.nullcontext,
    "under torch.no_grad()": torch.no_grad,
    "under torch.inference_mode()": torch.inference_mode,
}


@_kind(PROTOCOL_CHECKS, "module.output_not_view")
def _check_output_not_view(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    k = case.config.in_features
    # One module per mode: state a forward creates under inference_mode (FP8 scaling) is an
    # inference tensor, which no later forward outside it may update.
    runs = {mode: ModuleRun(backend, case, delay=case.delay, hooks=0) for mode in _MODES}
    for i, d in enumerate(make_micro_batches(case)):
        x2 = with_layout(d.x.detach().reshape(-1, k), d.spec.x_layout)
        for mode, context in _MODES.items():
            x = x2.detach().requires_grad_(mode == "with grad")
            with context():
                y = runs[mode].forward(x, d.spec.m_splits, None)
            base = y._base
            t.expect(
                not y._is_view() and y is not x,
                f"{what}micro-batch {i}: the output for a 2-D input of shape {tuple(x.shape)} "
                f"({d.spec.x_layout}) {mode} is a view"
                + (f" of a tensor of shape {tuple(base.shape)}" if base is not None else "")
                + " (SPEC §2: a tensor of its own, as torch.nn.Linear's)",
            )
    return t.result


def _torch_save_copy(module: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


_COPIES: dict[str, Callable[[Any], Any]] = {
    "module.pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "module.torch_save": _torch_save_copy,
    "module.deepcopy": copy.deepcopy,
}


@_kind(PROTOCOL_CHECKS, *_COPIES, "module.to_empty")
def _check_copy(backend: Backend, case: Case) -> CheckResult:
    t, what, data, original = _start(backend, case)
    warm, rest = (data[:1], data[1:]) if len(data) > 1 else ([], data)
    for d in warm:
        original.fb(d)
        original.drain()
    if case.variant == "module.to_empty":
        second = ModuleRun(backend, case, delay=case.delay, hooks=0)
        for d in warm:
            second.fb(d)
            second.drain()
        state = backend.torch_module(original.module).state_dict()
        backend.to_empty(second.module, device=case.config.device)
        backend.torch_module(second.module).load_state_dict(state)
        copied = second.module
        label = f"{what}a module run the same way, to_empty() and given its state_dict, vs it: "
    else:
        copied = _COPIES[case.variant](original.module)
        t.expect(copied is not original.module, f"{what}the copy is the original module object")
        mine = backend.parameters(original.module)
        ptrs = {p.untyped_storage().data_ptr() for p in mine.values() if p.numel() > 0}
        for name, q in backend.parameters(copied).items():
            p = mine.get(name)
            shared = p is not None and (
                q is p or (q.numel() > 0 and q.untyped_storage().data_ptr() in ptrs)
            )
            t.expect(not shared, f"{what}{name} shares its tensor or storage with the original's")
        label = f"{what}the copy vs the original: "
    want_fp8 = backend.fp8_state(original.module)
    _same_parameters(t, label, backend, copied, _values(backend, original.module), want_fp8)
    want = _trace(backend, case, original.module, rest)
    _same_trace(t, label, _trace(backend, case, copied, rest), want)
    return t.result


#: The module-protocol kinds of P18 (``case.variant``), in the order every cell enumerates them.
PROTOCOL_VARIANTS = tuple(PROTOCOL_CHECKS)
#: The kinds that apply to the modules with a norm only (``LayerNormLinear``, ``LayerNormMLP``).
NORM_ONLY_VARIANTS = ("module.zero_centered_gamma",)
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def protocol_explicit(base: list[Case]) -> list[Case]:
    """The module-protocol cases of a P18 cell: every kind on each of the cell's boundary cases
    ``base``, delay on and off in turn (``module.reset_queued`` always delayed)."""
    out = []
    for variant in PROTOCOL_VARIANTS:
        for j, c in enumerate(base):
            if variant in NORM_ONLY_VARIANTS and not c.config.has_norm:
                continue
            c = dataclasses.replace(c, micro_batches=c.micro_batches[:2], variant=variant, asked=())
            if c.config.has_norm and variant in ("module.initial_values", NORM_ONLY_VARIANTS[0]):
                # Both normalizations, and gamma stored both ways, whatever the base cases hold.
                config = dataclasses.replace(
                    c.config,
                    normalization=NORMALIZATIONS[(j // 2) % 2],
                    zero_centered_gamma=variant in NORM_ONLY_VARIANTS or (j // 2) % 2 == 1,
                )
                c = dataclasses.replace(c, config=config)
            delay = variant == "module.reset_queued" or j % 2 == 0
            out.append(dataclasses.replace(c, delay=delay, seed=100 + len(out)))
    return out
