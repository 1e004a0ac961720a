"""P18 (SPEC §2, §3, §7): autograd fidelity. A module that writes its own GEMM gradients (now,
or at ``backward_dw()``) must behave as autograd does for whatever a user attaches to its
parameters or wraps around it: ``functional_call``, ``parametrize``, tensor hooks (also one that
returns another size, several chained on one parameter, one that keeps the tensor it is shown),
post-accumulate hooks (also before the module's reduce hooks), double backward, a gradient
penalty and ``torch.func`` transforms (``case.variant``: :data:`VARIANTS`, on the parameters
``case.asked``; docs/harness.md lists what each kind checks). The differentiating kinds give the
right result or raise a ``RuntimeError`` naming the module, and only the error under FP8; they
may refuse only where a gradient would be deferred or accumulated into ``main_grad``
(``backward(create_graph=True)`` with delay or fused accumulation) or under a ``torch.func``
transform (:func:`_refusal_allowed`; docs/budgets.md says how the results are judged). The
module-protocol half of SPEC §2's list is :mod:`.protocol`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import warnings
from collections.abc import Callable

import torch
from hypothesis import strategies as st

from .. import budgets as B
from ..backends import Backend, BackendUnavailable
from ..cases.data import (
    GEMM_BIAS,
    GEMM_WEIGHT,
    NORM,
    MicroBatchData,
    generator,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    param_specs,
    role_of,
)
from ..cases.strategies import LOW_PRECISION_DTYPES, Case, cases
from ..oracle.kink import CaseRejected, has_relu_kink, kink_sites
from ..oracle.truth import float64_twin, judge_steps, reference_backend
from .protocol import PROTOCOL_CHECKS, PROTOCOL_VARIANTS, _kind, _start, _what, protocol_explicit
from .results import CheckResult, PropertyViolation, Tracker
from .runner import AccuracyRun, ModuleRun, Snapshot, Step, clone_of, fb_steps

#: The substitution kinds (``case.variant``) and their checks, in the order of the checks below.
_CHECKS: dict[str, Callable[[Backend, Case], CheckResult]] = {}
#: Kinds that act on some parameters (``case.asked``), and how many they take at most.
_TARGETED = {
    "functional_call": None,
    "parametrize": 1,
    "tensor_hook": 2,
    "tensor_hook_wrong_size": 1,
    "post_accumulate_hook": None,
    "tensor_hook_chain": 2,
    "tensor_hook_kept": 2,
    "post_accumulate_reduce": None,
}


def names_module(message: str, kind: str) -> bool:
    """Whether ``message`` names module ``kind`` (or a parameter) as a word
    (``splitgrad.impl.LayerNormMLP`` names ``LayerNormMLP``; ``LayerNormLinear`` not ``Linear``)."""
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(kind)}(?![A-Za-z0-9_])", message) is not None


def _snapshot(run: ModuleRun, tensors: dict[str, torch.Tensor]) -> tuple[Snapshot, Snapshot]:
    """(norm, gemm) snapshots of ``tensors``, keyed as :meth:`ModuleRun.snapshot` keys them."""
    norm: Snapshot = {}
    gemm: Snapshot = {}
    for name, t in tensors.items():
        out = gemm if name in run.gemm_names else norm
        if run.uses_main_grad(name):
            out[f"{name}.main_grad"] = clone_of(t.main_grad)
        out[f"{name}.grad"] = clone_of(t.grad)
    return norm, gemm


def _plain(case: Case) -> Case:
    """``case`` without fused accumulation or ``is_first_microbatch`` flags."""
    return dataclasses.replace(
        case,
        config=dataclasses.replace(case.config, fuse_wgrad_accumulation=False),
        micro_batches=tuple(
            dataclasses.replace(mb, is_first_microbatch=None) for mb in case.micro_batches
        ),
    )


def _judge(t: Tracker, case: Case, xgrads: list, norm: Snapshot, gemm: Snapshot, **kw) -> None:
    """Input and final gradients after every micro-batch's forward and backward against the
    float64 truth, as P2/P3 judge them (``kw``: :func:`~.truth.judge_steps`')."""
    got = AccuracyRun([], xgrads, norm, gemm)
    judge_steps(t, case, fb_steps(len(case.micro_batches)), got, **kw)


def _targets(case: Case, run: ModuleRun) -> list[str]:
    unknown = [n for n in case.asked if n not in run.params]
    if unknown:
        raise ValueError(f"P18 case targets unknown parameters {unknown}")
    return list(case.asked)


def _refusal_allowed(case: Case) -> str | None:
    """Why a differentiating kind may refuse ``case`` (SPEC §2, §6), or ``None`` when nothing in
    it is deferred, fused or quantized and only a result will do."""
    if case.config.recipe is not None:
        return "FP8 GEMMs have no derivative (SPEC §6)"
    if case.variant.startswith("func."):
        return "SPEC §2 lets a torch.func transform raise a RuntimeError naming the module"
    if case.variant == "backward_create_graph" and case.delay:
        return "a deferred gradient cannot carry a graph"
    if case.variant == "backward_create_graph" and case.config.fuse_wgrad_accumulation:
        return "main_grad is outside autograd: a gradient added into it loses its graph"
    return None


def _refused(case: Case, what: str, exc: BaseException) -> None:
    """Accept ``exc`` as SPEC §2's clear refusal (a ``RuntimeError`` naming the module) or
    raise a :class:`~.results.PropertyViolation`."""
    kind = case.config.kind
    text = f"{type(exc).__name__}: {str(exc).strip()[:400]}"
    if not isinstance(exc, RuntimeError):
        raise PropertyViolation(
            f"{what}raised {text}; SPEC §2 allows the right result or a RuntimeError naming the "
            f"module ({kind})"
        ) from exc
    if not names_module(str(exc), kind):
        raise PropertyViolation(
            f"{what}raised a RuntimeError that does not name the module ({kind}), an error from "
            f"deep inside torch rather than SPEC §2's clear refusal: {text}"
        ) from exc


# ---- functional_call -----------------------------------------------------------------------
def _functional_run(backend: Backend, case: Case, delay: bool, t: Tracker, what: str):
    """One functional_call run, drained: x gradients, norm and GEMM snapshots of what it used."""
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=delay, prefill_grads=True, hooks=0)
    names = _targets(case, run)
    # Fresh leaves with the targets' values, prefilled as the module's own.
    prefill = make_grad_prefill(run.config, case.seed)
    main = make_main_grads(run.config, case.seed) if run.config.fuse_wgrad_accumulation else {}
    leaves = {name: run.params[name].detach().clone().requires_grad_(True) for name in names}
    for name, leaf in leaves.items():
        if run.uses_main_grad(name):
            leaf.main_grad = main[name].clone()
            leaf.grad_added_to_main_grad = False
        else:
            leaf.grad = prefill[name].clone()
    own_before = {k: v for k, v in run.all_snapshot().items() if k.split(".")[0] in names}
    leaves_before = _snapshot(run, leaves)[1]
    xgrads = []
    for d in data:
        x = d.fresh_input()
        y = run.functional_forward(leaves, x, d.spec.m_splits, d.spec.is_first_microbatch)
        backend.backward(run.module, [y], [d.dy])
        xgrads.append(clone_of(x.grad))
    if delay:
        now = _snapshot(run, leaves)[1]
        label = f"{what}substituted GEMM leaf written before backward_dw(): "
        t.bitwise_all(label, now, leaves_before)
        t.equal(f"{what}pending_wgrad_count after the backwards", run.pending(), len(data))
    run.drain()
    own_after = {k: v for k, v in run.all_snapshot().items() if k in own_before}
    t.bitwise_all(f"{what}the module's own substituted parameter changed: ", own_after, own_before)
    norm, gemm = _snapshot(run, {n: leaves.get(n, p) for n, p in run.params.items()})
    return xgrads, norm, gemm


@_kind(_CHECKS, "functional_call")
def _check_functional_call(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    xgrads, norm, gemm = _functional_run(backend, case, case.delay, t, what)
    _judge(t, case, xgrads, norm, gemm, prefill_grads=True, label=what)
    if case.delay:
        # Tier 1: the same substitution without delay, bitwise.
        xs, norm0, gemm0 = _functional_run(backend, case, False, t, what)
        for i, (a, e) in enumerate(zip(xgrads, xs)):
            t.bitwise(f"{what}inp.grad[micro-batch {i}] delayed vs not", a, e)
        t.bitwise_all(f"{what}delayed vs not: ", {**norm, **gemm}, {**norm0, **gemm0})
    return t.result


# ---- parametrize ---------------------------------------------------------------------------
class _Twice(torch.nn.Module):
    """The parametrization ``W = 2 * original`` (exact in every float format)."""

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        return original * 2


@_kind(_CHECKS, "parametrize")
def _check_parametrize(backend: Backend, case: Case) -> CheckResult:
    t, what, data, run = _start(backend, case)
    (name,) = _targets(case, run)
    original = run.params[name]
    with torch.no_grad():
        original.mul_(0.5)  # the forward sees 2 * original: exactly the case's value
    backend.parametrize(run.module, name, _Twice())
    xgrads: list[torch.Tensor | None] = []
    for d in data:
        x = d.fresh_input()
        try:
            y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
            backend.backward(run.module, [y], [d.dy])
        except RuntimeError as exc:
            if run.uses_main_grad(name) and names_module(str(exc), name):
                return t.result  # a main_grad belongs to a leaf: refused, naming the weight
            raise
        xgrads.append(clone_of(x.grad))
    queued = len(data) if case.delay and set(run.gemm_names) - {name} else 0
    t.equal(f"{what}pending_wgrad_count after the backwards", run.pending(), queued)
    label = f"{what}parametrizations.{name}.original.grad"
    arrived = clone_of(original.grad)
    t.expect(
        arrived is not None,
        f"{label} is None after backward(): a weight that is not a leaf gets its gradient "
        "through autograd during backward (SPEC §3)",
    )
    run.drain()
    t.bitwise(f"{label} changed by backward_dw()", clone_of(original.grad), arrived)
    # original.grad = 2 * the weight's gradient, exactly: judged as the weight's gradient.
    got = {f"{name}.grad": arrived / 2}
    norm, gemm = (got, {}) if name in run.norm_names else ({}, got)

    def keep(key: str) -> bool:
        return key.startswith("inp.grad") or key == f"{name}.grad"

    _judge(t, _plain(case), xgrads, norm, gemm, only=keep, label=f"{label} / 2 and x: ")
    return t.result


# ---- tensor hooks and post-accumulate hooks ------------------------------------------------
class _Recorder:
    """What the hooks of one check saw, by parameter, with the call (phase) they ran in."""

    def __init__(self) -> None:
        self.phase = "forward"
        self.calls: dict[str, list[tuple[str, torch.Tensor | None]]] = {}

    def record(self, name: str, value: torch.Tensor | None) -> None:
        self.calls.setdefault(name, []).append((self.phase, value))

    def phases(self, name: str) -> list[str]:
        return [p for p, _ in self.calls.get(name, [])]

    def drive(self, run: ModuleRun, data: list[MicroBatchData], delay: bool) -> tuple[list, dict]:
        """Every forward and backward, then each ``backward_dw()`` under delay, each call its
        own phase; returns the input gradients and the gradients after each phase."""
        xgrads: list[torch.Tensor | None] = []
        after: dict[str, Snapshot] = {}
        for i, d in enumerate(data):
            self.phase = f"backward {i}"
            x, _ = run.fb(d)
            xgrads.append(clone_of(x.grad))
            after[self.phase] = run.all_snapshot()
        for i in range(len(data) if delay else 0):
            self.phase = f"backward_dw {i}"
            run.dw()
            after[self.phase] = run.all_snapshot()
        self.phase = "after"
        run.drain()
        return xgrads, after


def _expected_phases(run: ModuleRun, name: str, delay: bool, n: int) -> list[str]:
    """Where SPEC §3-§4 put the gradient of each of ``n`` micro-batches for parameter ``name``."""
    call = "backward_dw" if delay and name in run.gemm_names else "backward"
    return [f"{call} {i}" for i in range(n)]


@_kind(_CHECKS, "tensor_hook")
def _check_tensor_hook(backend: Backend, case: Case) -> CheckResult:
    t, what, data, run = _start(backend, case, prefill_grads=True)
    names = _targets(case, run)
    prefill = run.all_snapshot()
    rec = _Recorder()
    replaced: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def make_hook(name: str, mask: torch.Tensor):
        def p18_mask_hook(g):
            rec.record(name, clone_of(g))
            if g is None:
                return None
            out = g * mask
            replaced[name].append(out.detach().clone())
            return out

        return p18_mask_hook

    for j, name in enumerate(names):
        p, g = run.params[name], generator(case.seed, 30_000 + j)
        mask = torch.rand(p.shape, generator=g, dtype=torch.float64) < 0.5
        p.register_hook(make_hook(name, mask.to(dtype=p.dtype, device=p.device)))
    fused_hooked = [n for n in names if run.uses_main_grad(n)]
    try:
        xgrads, _ = rec.drive(run, data, case.delay)
    except RuntimeError as exc:
        if fused_hooked and any(names_module(str(exc), n) for n in fused_hooked):
            return t.result  # no gradient tensor exists for a hook on a fused weight: refused
        raise
    t.expect(
        not fused_hooked,
        f"{what}tensor hooks on {fused_hooked} under fused accumulation were accepted: the "
        "weight gradient is added into main_grad inside the GEMM (SPEC §3), so no hook can see "
        "or replace it; a RuntimeError naming the weight is required",
    )
    # What the hooks saw, accumulated as autograd would have without them, is judged below.
    norm, gemm = run.norm_snapshot(), run.gemm_snapshot()
    for name in names:
        calls = rec.calls.get(name, [])
        nones = sum(g is None for _, g in calls)
        t.expect(
            nones == 0,
            f"{what}{name}: the tensor hook saw None in {nones} of its calls "
            f"({rec.phases(name)}); it must see each gradient the module writes",
        )
        expected = _expected_phases(run, name, case.delay, len(data))
        t.equal(f"{what}{name}: the phases its tensor hook ran in", rec.phases(name), expected)
        # .grad = prefill + each replacement, accumulated in order, bitwise.
        acc = seen = prefill[f"{name}.grad"]
        for r, (_, g) in zip(replaced[name], calls):
            acc = r.clone() if acc is None else acc + r
            seen = g.clone() if seen is None else seen + g
        label = f"{what}{name}.grad vs its prefill plus what its hook returned"
        t.bitwise(label, clone_of(run.params[name].grad), acc)
        (norm if name in run.norm_names else gemm)[f"{name}.grad"] = seen
    label = f"{what}what the hooks saw (accumulated) and the rest: "
    _judge(t, case, xgrads, norm, gemm, prefill_grads=True, label=label)
    return t.result


@_kind(_CHECKS, "tensor_hook_wrong_size")
def _check_tensor_hook_wrong_size(backend: Backend, case: Case) -> CheckResult:
    t, what, data, run = _start(backend, case, prefill_grads=True)
    (name,) = _targets(case, run)
    seen: list[torch.Tensor | None] = []

    def p18_wrong_size_hook(g):
        seen.append(clone_of(g))
        return None if g is None else torch.cat([g.reshape(-1), g.new_zeros(1)])

    handle = run.params[name].register_hook(p18_wrong_size_hook)
    wrong = f"{what}a tensor hook on {name} returned a tensor of another size and "
    if not (case.delay and name in run.gemm_names):
        d = data[0]
        x = d.fresh_input()
        y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
        try:
            backend.backward(run.module, [y], [d.dy])
        except RuntimeError:
            t.expect(seen and seen[0] is not None, f"{what}the hook never saw a gradient")
            return t.result
        raise PropertyViolation(
            f"{wrong}backward() raised nothing (autograd raises RuntimeError 'hook ... has "
            "changed the size of value')"
        )
    for d in data:
        run.fb(d)
    t.equal(f"{what}tensor hook calls during backward()", len(seen), 0)
    pending = run.pending()
    t.equal(f"{what}pending_wgrad_count after the backwards", pending, len(data))
    before = run.gemm_snapshot()
    with contextlib.suppress(RuntimeError):
        run.dw()
        raise PropertyViolation(f"{wrong}backward_dw() raised nothing")
    t.equal(f"{what}pending_wgrad_count after the failed backward_dw()", run.pending(), pending)
    t.bitwise_all(f"{what}written by the failed backward_dw(): ", run.gemm_snapshot(), before)
    handle.remove()
    run.drain()
    label = f"{what}after removing the hook and draining: "
    norm, gemm = run.norm_snapshot(), run.gemm_snapshot()

    def keep(key: str) -> bool:
        return not key.startswith("inp.grad")  # the inputs' gradients are P2's

    _judge(t, case, [None] * len(data), norm, gemm, prefill_grads=True, only=keep, label=label)
    return t.result


@_kind(_CHECKS, "post_accumulate_hook")
def _check_post_accumulate_hook(backend: Backend, case: Case) -> CheckResult:
    t, what, data, run = _start(backend, case, prefill_grads=True)
    names = _targets(case, run)
    rec = _Recorder()

    def make_hook(name: str):
        def p18_post_hook(leaf):
            rec.record(name, clone_of(leaf.main_grad if run.uses_main_grad(name) else leaf.grad))

        return p18_post_hook

    for name in names:
        run.params[name].register_post_accumulate_grad_hook(make_hook(name))
    _, after = rec.drive(run, data, case.delay)
    for name in names:
        expected = _expected_phases(run, name, case.delay, len(data))
        label = f"{what}{name}: the phases its post-accumulate hook fired in"
        t.equal(label, rec.phases(name), expected)
        key = f"{name}.main_grad" if run.uses_main_grad(name) else f"{name}.grad"
        for phase, value in rec.calls.get(name, []):
            label = f"{what}{key} read by its post-accumulate hook in {phase} vs after it"
            t.bitwise(label, value, after[phase][key])
    return t.result


# ---- several hooks, a hook that keeps its tensor, post-accumulate hooks and module hooks -----
def _accumulated(start: torch.Tensor | None, parts: list[torch.Tensor], dtype) -> torch.Tensor:
    """``start`` plus each of ``parts`` in order, as autograd's accumulator stores them (the
    first set when ``start`` is ``None``, each cast to the leaf's ``dtype``)."""
    acc = start
    for part in parts:
        part = part.to(dtype)
        acc = part.clone() if acc is None else acc + part
    return acc


def _no_nones(t: Tracker, what: str, rec: _Recorder, name: str, hook: str) -> None:
    nones = sum(g is None for _, g in rec.calls.get(name, []))
    t.expect(
        nones == 0,
        f"{what}{name}: its {hook} saw None in {nones} of its calls ({rec.phases(name)}); it "
        "must see each gradient the module writes",
    )


def _judge_seen(t, case, run, xgrads, seen: dict, prefill_grads: bool, what: str) -> None:
    """What the first hook on each target saw, accumulated as autograd would have stored it
    without hooks (``seen``: ``{"<name>.grad": tensor}``), and the rest of the module's
    gradients, against the float64 truth."""
    norm, gemm = run.norm_snapshot(), run.gemm_snapshot()
    for key, value in seen.items():
        (norm if key.split(".")[0] in run.norm_names else gemm)[key] = value
    label = f"{what}what the first hooks saw (accumulated) and the rest: "
    _judge(t, case, xgrads, norm, gemm, prefill_grads=prefill_grads, label=label)


@_kind(_CHECKS, "tensor_hook_chain")
def _check_tensor_hook_chain(backend: Backend, case: Case) -> CheckResult:
    """Three hooks on each target, as autograd chains them: a clip (returns a new tensor), an
    observer (returns ``None``), a scale by 1/2: each sees what the last one that returned a
    tensor returned, and ``.grad`` gets the last result."""
    t, what, data, run = _start(backend, case, prefill_grads=True)
    names = _targets(case, run)
    prefill = run.all_snapshot()
    calls: dict[str, list[list[torch.Tensor]]] = {n: [[], [], [], []] for n in names}
    rec = _Recorder()

    def make_hooks(name: str):
        seen_clip, clipped, seen_observer, seen_scale = calls[name]

        def p18_clip_hook(g):
            rec.record(name, clone_of(g))
            if g is None:
                return None
            seen_clip.append(clone_of(g))
            bound = g.abs().amax() * 0.5
            out = g.clamp(-bound, bound)
            clipped.append(clone_of(out))
            return out

        def p18_observer_hook(g):
            if g is not None:
                seen_observer.append(clone_of(g))

        def p18_scale_hook(g):
            if g is None:
                return None
            seen_scale.append(clone_of(g))
            return g * 0.5

        return p18_clip_hook, p18_observer_hook, p18_scale_hook

    for name in names:
        for hook in make_hooks(name):
            run.params[name].register_hook(hook)
    xgrads, _ = rec.drive(run, data, case.delay)
    seen: dict[str, torch.Tensor] = {}
    for name in names:
        p = run.params[name]
        expected = _expected_phases(run, name, case.delay, len(data))
        _no_nones(t, what, rec, name, "first tensor hook")
        label = f"{what}{name}: the phases its first tensor hook ran in"
        t.equal(label, rec.phases(name), expected)
        seen_clip, clipped, seen_observer, seen_scale = calls[name]
        for hook, got in (("second (observer)", seen_observer), ("third (scale)", seen_scale)):
            t.equal(f"{what}{name}: calls of its {hook} hook", len(got), len(clipped))
            for i, (a, e) in enumerate(zip(got, clipped)):
                label = f"{what}{name}: what its {hook} hook saw in call {i} vs the clip's result"
                t.bitwise(label, a, e)
        last = [g * 0.5 for g in clipped]  # what the scale hook returned, when it saw the clip's
        grad = _accumulated(prefill[f"{name}.grad"], last, p.dtype)
        label = f"{what}{name}.grad vs its prefill plus the last hook's results"
        t.bitwise(label, clone_of(p.grad), grad)
        seen[f"{name}.grad"] = _accumulated(prefill[f"{name}.grad"], seen_clip, p.dtype)
    _judge_seen(t, case, run, xgrads, seen, True, what)
    return t.result


@_kind(_CHECKS, "tensor_hook_kept")
def _check_tensor_hook_kept(backend: Backend, case: Case) -> CheckResult:
    """A logger that keeps the very tensor it is shown (returns ``None``), and on a target that
    is not a GEMM weight after it a running statistic that keeps what it returns (half), from
    ``.grad`` unset over two or more micro-batches: autograd never makes a tensor a hook holds
    ``.grad`` (it stores a copy), so nothing changes a kept tensor after it was shown."""
    t, what, data, run = _start(backend, case)  # no prefill: the first write sets .grad
    names = _targets(case, run)
    rec = _Recorder()
    kept: dict[str, list[tuple[str, str, torch.Tensor, torch.Tensor]]] = {n: [] for n in names}
    stored: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def make_hooks(name: str, statistic: bool):
        def p18_logger_hook(g):
            rec.record(name, clone_of(g))
            if g is None:
                return
            kept[name].append((rec.phase, "shown to its logger", g, clone_of(g)))
            if not statistic:
                stored[name].append(clone_of(g))

        def p18_statistic_hook(g):
            if g is None:
                return None
            out = g * 0.5
            kept[name].append((rec.phase, "returned by its running statistic", out, clone_of(out)))
            stored[name].append(clone_of(out))
            return out

        return (p18_logger_hook, p18_statistic_hook) if statistic else (p18_logger_hook,)

    for name in names:
        for hook in make_hooks(name, statistic=role_of(name) != GEMM_WEIGHT):
            run.params[name].register_hook(hook)
    xgrads, _ = rec.drive(run, data, case.delay)
    seen: dict[str, torch.Tensor] = {}
    for name in names:
        p = run.params[name]
        expected = _expected_phases(run, name, case.delay, len(data))
        _no_nones(t, what, rec, name, "logger hook")
        t.equal(f"{what}{name}: the phases its logger hook ran in", rec.phases(name), expected)
        grad = p.grad
        for phase, role, tensor, value in kept[name]:
            about = f"{what}{name}: the tensor {role} in {phase}"
            t.expect(
                grad is None
                or tensor.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr(),
                f"{about} is {name}.grad's memory: autograd stores a copy of a gradient a hook "
                "holds (SPEC §3), so later accumulation cannot change what the hook kept",
            )
            t.bitwise(f"{about}, after the run vs when it was", tensor, value)
        label = f"{what}{name}.grad vs the sum of what its last hook passed on"
        t.bitwise(label, clone_of(grad), _accumulated(None, stored[name], p.dtype))
        shown = [v for _, role, _, v in kept[name] if role.startswith("shown")]
        seen[f"{name}.grad"] = _accumulated(None, shown, p.dtype)
    _judge_seen(t, case, run, xgrads, seen, False, what)
    return t.result


@_kind(_CHECKS, "post_accumulate_reduce")
def _check_post_accumulate_reduce(backend: Backend, case: Case) -> CheckResult:
    """A post-accumulate hook on each target clips its gradient in place; a module hook
    (``register_wgrad_accumulation_and_reduce_hooks``, a reducer) records every target's
    gradient. In each ``backward_dw()`` the post-accumulate hooks run as part of writing the
    entry's gradients (SPEC §3), before the module hooks (SPEC §4): a reducer sends the clipped
    gradient. In both modes nothing changes a gradient after its last post-accumulate hook."""
    if not backend.has_hooks():
        raise BackendUnavailable(
            f"P18 post_accumulate_reduce is n/a on {backend.name}: no module hooks (SPEC §4)"
        )
    t, what, data, run = _start(backend, case, prefill_grads=True)
    names = _targets(case, run)
    rec = _Recorder()
    events: list[tuple[str, str]] = []
    left: dict[str, list[tuple[str, torch.Tensor]]] = {n: [] for n in names}
    reduced: list[tuple[str, Snapshot]] = []

    def make_hook(name: str):
        def p18_clip_post_hook(leaf):
            g = leaf.main_grad if run.uses_main_grad(name) else leaf.grad
            rec.record(name, clone_of(g))
            if g is None:
                return
            with torch.no_grad():
                bound = g.abs().amax() * 0.5
                g.clamp_(-bound, bound)
            left[name].append((rec.phase, clone_of(g)))
            events.append((rec.phase, name))

        return p18_clip_post_hook

    def p18_reduce_hook() -> None:
        events.append((rec.phase, "module hook"))
        reduced.append((rec.phase, {n: clone_of(run.grad_of(n)) for n in names}))

    for name in names:
        run.params[name].register_post_accumulate_grad_hook(make_hook(name))
    backend.register_hook(run.module, p18_reduce_hook)
    rec.drive(run, data, case.delay)
    for name in names:
        expected = _expected_phases(run, name, case.delay, len(data))
        label = f"{what}{name}: the phases its post-accumulate hook fired in"
        t.equal(label, rec.phases(name), expected)
        key = f"{name}.main_grad" if run.uses_main_grad(name) else f"{name}.grad"
        if left[name]:
            label = f"{what}{key} after the run vs what its last post-accumulate hook left"
            t.bitwise(label, clone_of(run.grad_of(name)), left[name][-1][1])
    if not case.delay:
        return t.result  # the module hooks run inside backward(), before autograd's call
    gemm = [n for n in names if n in run.gemm_names]
    for i in range(len(data)):
        phase = f"backward_dw {i}"
        order = [e for p, e in events if p == phase]
        label = f"{what}the hooks that ran in {phase}, in order"
        t.equal(label, order, [e for e in order if e != "module hook"] + ["module hook"])
        t.equal(f"{what}post-accumulate hooks in {phase}", sorted(order[:-1]), sorted(gemm))
        seen = [s for p, s in reduced if p == phase]
        for name in gemm:
            mine = [g for p, g in left[name] if p == phase]
            if not (seen and mine):
                continue
            key = f"{name}.main_grad" if run.uses_main_grad(name) else f"{name}.grad"
            label = (
                f"{what}{key} seen by the module hook in {phase} vs what its post-accumulate "
                "hook left (a reducer must send the clipped gradient)"
            )
            t.bitwise(label, seen[0][name], mine[0])
    return t.result


# ---- double backward and torch.func --------------------------------------------------------
def _budget_of(key: str) -> B.ErrorBudget:
    if key.startswith("second order"):
        return B.SECOND_ORDER
    name = key.split(" ")[-1].split(".")[0]
    if name == "inp":
        return B.DGRAD
    return {NORM: B.NORM_GRAD, GEMM_WEIGHT: B.WGRAD, GEMM_BIAS: B.WGRAD}[role_of(name)]


def _compare(t: Tracker, what: str, case: Case, got: dict, naive: dict, truth: dict, keep) -> None:
    """Each tensor of ``got`` against ``truth`` with ``naive`` as yardstick, under the budget its
    name picks (docs/budgets.md, P18)."""
    for key in sorted(set(got) | set(truth)):
        if not keep(key):
            continue
        a, n, r = got.get(key), naive.get(key), truth.get(key)
        there = r if a is None else a  # the one that is there when the other is not
        if (a is None) != (r is None) and not bool(there.numel() and there.abs().max() > 0):
            continue
        if a is not None and n is not None:
            message = f"{what}{key}: dtype {a.dtype}, but the reference gives {n.dtype}"
            t.expect(a.dtype == n.dtype, message)
        if n is None and r is not None:
            n = torch.zeros_like(r)
        t.budget(what + key, a, r, n, _budget_of(key), module_dtype=case.config.torch_dtype)


def _params(run: ModuleRun) -> dict[str, torch.Tensor]:
    return {n: p for n, p in run.params.items() if p.requires_grad}


def _double_backward(run: ModuleRun, data: list, case: Case, returned: bool) -> dict:
    """First-order gradients with ``create_graph=True`` (``returned`` by ``autograd.grad``, else
    written by ``backward``), then the second order: what a backward of a penalty on them (a
    random vector's dot product with each) leaves on ``x`` and the parameters."""
    d = data[0]
    x = d.fresh_input()
    params = _params(run)
    y = run.forward(x, d.spec.m_splits, None)
    if returned:
        gs = run.backend.grad(run.module, [y], [d.dy], [x, *params.values()], create_graph=True)
        firsts = dict(zip(["inp", *params], gs))
        source = "returned with create_graph=True"
    else:
        with warnings.catch_warnings():
            # torch's advice against a .grad that holds its own graph: this run is thrown away.
            warnings.filterwarnings("ignore", message="Using backward.. with create_graph=True")
            run.backend.backward(run.module, [y], [d.dy], create_graph=True)
        run.drain()
        # Accumulated: first order plus the penalty's gradient, as autograd leaves them.
        firsts = {"inp": x.grad, **{n: p.grad for n, p in params.items()}}
        source = "written by backward(create_graph=True)"
    out: dict = {f"first order {n}.grad": clone_of(g) for n, g in firsts.items()}
    penalty = []
    for j, g in enumerate(firsts.values()):
        if g is not None and g.requires_grad:
            gen = generator(case.seed, 40_000 + j)
            v = torch.randn(g.shape, generator=gen, dtype=torch.float64)
            penalty.append((g * v.to(dtype=g.dtype, device=g.device)).sum())
    if not penalty:
        raise RuntimeError(
            f"P18: no gradient {source} carries a graph (nothing to differentiate twice)"
        )
    run.backend.backward(run.module, [torch.stack(penalty).sum()], [torch.ones((), dtype=y.dtype)])
    run.drain()
    out["second order inp.grad"] = clone_of(x.grad)
    for n, p in params.items():
        out[f"second order {n}.grad"] = clone_of(p.grad)
    return out


def _torch_func(run: ModuleRun, data: list, case: Case) -> dict:
    """``torch.func``'s ``grad``, ``vjp``, ``jacrev`` or per-sample ``vmap(grad(...))`` (two
    micro-batches) of ``functional_call`` of the module, as ``case.variant`` says."""
    d = data[0]
    params, x = {n: p.detach() for n, p in _params(run).items()}, d.x.detach()

    def f(params, x):
        return run.functional_forward(params, x, d.spec.m_splits, None)

    def loss(params, x, dy):
        return (f(params, x) * dy).sum()

    if case.variant == "func.grad":
        gp, gx = torch.func.grad(loss, argnums=(0, 1))(params, x, d.dy)
    elif case.variant == "func.vjp":
        gp, gx = torch.func.vjp(f, params, x)[1](d.dy)
    elif case.variant == "func.jacrev":
        jp, jx = torch.func.jacrev(f, argnums=(0, 1))(params, x)
        return {"jacobian inp.grad": jx, **{f"jacobian {n}.grad": j for n, j in jp.items()}}
    else:
        xs = torch.stack([x, data[1].x.detach()])
        dys = torch.stack([d.dy, data[1].dy])
        per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0))
        gp, gx = per_sample(params, xs, dys)
    return {"inp.grad": gx, **{f"{n}.grad": g for n, g in gp.items()}}


def _gradient_penalty(run: ModuleRun, data: list, case: Case) -> dict:
    """A gradient penalty: ``x``'s gradient alone taken with ``create_graph=True`` (of the loss
    ``(dy * y).sum() + (y * y).sum() / 2``, whose output gradient ``dy + y`` depends on ``y``),
    which writes and queues nothing; then the backward of a penalty on it (a random vector's
    dot product), which goes back through the module's backward with grad mode off, so a
    delayed module queues one entry there, drained here."""
    what = _what(case)
    d = data[0]
    x = d.fresh_input()
    before = run.all_snapshot()
    y = run.forward(x, d.spec.m_splits, None)
    (gx,) = run.backend.grad(run.module, [y], [d.dy + y], [x], create_graph=True)
    if run.pending() or any(not _same(a, before[k]) for k, a in run.all_snapshot().items()):
        raise PropertyViolation(
            f"{what}torch.autograd.grad(..., inputs=[x], create_graph=True) queued "
            f"{run.pending()} entries or wrote a parameter's gradient: it asks for x alone "
            "(SPEC §3, only what the backward asks for)"
        )
    if gx is None or not gx.requires_grad:
        raise PropertyViolation(f"{what}x's gradient taken with create_graph=True has no graph")
    v = torch.randn(gx.shape, generator=generator(case.seed, 41_000), dtype=torch.float64)
    penalty = (gx * v.to(dtype=gx.dtype, device=gx.device)).sum()
    run.backend.backward(run.module, [penalty], [torch.ones((), dtype=y.dtype)])
    queued = 1 if run.delay else 0
    if run.pending() != queued:
        raise PropertyViolation(
            f"{what}pending_wgrad_count after the penalty's backward: got {run.pending()}, "
            f"expected {queued} (one entry per module per backward, SPEC §4)"
        )
    run.drain()
    out = {"first order inp.grad": clone_of(gx), "second order inp.grad": clone_of(x.grad)}
    for n, p in _params(run).items():
        out[f"second order {n}.grad"] = clone_of(p.grad)
    return out


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b if a is None or b is None else torch.equal(a, b)


#: How each differentiating kind gets its result from ``(run, micro-batches, case)``.
_PROCEDURES: dict[str, Callable[[ModuleRun, list, Case], dict]] = {
    "grad_of_grad": functools.partial(_double_backward, returned=True),
    "backward_create_graph": functools.partial(_double_backward, returned=False),
    "gradient_penalty": _gradient_penalty,
    **dict.fromkeys(("func.grad", "func.vjp", "func.jacrev", "func.vmap"), _torch_func),
}


def _judge_first_order(t: Tracker, case: Case, got: dict, what: str, index=0, keep=None) -> None:
    """First-order gradients of micro-batch ``index`` (``"inp.grad"``, ``"<param>.grad"``)
    against the float64 truth as P2/P3 judge a plain module's."""
    specs = param_specs(case.config)
    norm = {f"{s.name}.grad": got.get(f"{s.name}.grad") for s in specs if s.role == NORM}
    gemm = {f"{s.name}.grad": got.get(f"{s.name}.grad") for s in specs if s.role != NORM}
    xgrads: list[torch.Tensor | None] = [None] * len(case.micro_batches)
    xgrads[index] = got.get("inp.grad")
    steps = tuple(Step("fb", i) for i in range(index)) + (
        (Step("zero"), Step("fb", index)) if index else (Step("fb", 0),)
    )

    def only(key: str) -> bool:
        if key.startswith("inp.grad"):
            return key == f"inp.grad[micro-batch {index}]" and (keep is None or keep("inp.grad"))
        return keep is None or keep(key)

    judge_steps(t, _plain(case), steps, AccuracyRun([], xgrads, norm, gemm), only=only, label=what)


@_kind(_CHECKS, *_PROCEDURES)
def _check_differentiating(backend: Backend, case: Case) -> CheckResult:
    t, what = Tracker(), _what(case)
    vmap = case.variant == "func.vmap"
    # Micro-batch 0 (func.vmap: two samples of its shape, the second from micro-batch 1's stream).
    one = dataclasses.replace(case, micro_batches=case.micro_batches[:1] * (2 if vmap else 1))
    # The reference in the case's dtype (the yardstick), its float64 twin (the truth), the module.
    plain, ref = _plain(one), reference_backend()
    naive = ModuleRun(ref, plain, delay=False, hooks=0)
    truth = float64_twin(ref, plain, naive, recipe=None, autocast=None)
    test = ModuleRun(backend, one, delay=case.delay, hooks=0)
    data = make_micro_batches(one)
    before = test.all_snapshot()
    procedure = _PROCEDURES[case.variant]
    try:
        got = procedure(test, data, case)
    except (AssertionError, CaseRejected):
        raise
    except Exception as exc:
        _refused(case, what, exc)
        why = _refusal_allowed(case)
        if why is None:
            raise PropertyViolation(
                f"{what}refused ({type(exc).__name__}: {str(exc).strip()[:300]}), but nothing "
                "here is deferred, accumulated into main_grad or quantized: the gradients are "
                "returned through autograd or written by a module without delay or fused "
                "accumulation, so they carry their graph (SPEC §2-§3) and a result is required"
            ) from exc
        return t.result
    if case.config.recipe is not None:
        raise PropertyViolation(
            f"{what}gave a result under FP8 ({case.config.recipe}): the quantized GEMMs (SPEC "
            "§6) have no derivative, so SPEC §2's only outcome here is a RuntimeError naming "
            "the module"
        )
    if case.variant.startswith("func."):
        label = f"{what}written into the module's own parameters: "
        t.bitwise_all(label, test.all_snapshot(), before)
        t.equal(f"{what}pending_wgrad_count", test.pending(), 0)
    if case.config.dtype not in LOW_PRECISION_DTYPES:
        return t.result  # float64 has no wider truth (as P1-P3, which never draw it)
    fused = set(test.weight_names) if case.config.fuse_wgrad_accumulation else set()

    def not_fused(key: str) -> bool:
        # Fused weights' first-order gradients live in main_grad, outside autograd (SPEC §3).
        return key.split(" ")[-1].split(".")[0] not in fused or case.variant == "grad_of_grad"

    if case.variant in ("func.grad", "func.vjp"):
        _judge_first_order(t, one, got, what)
        return t.result
    if vmap:
        for i in range(2):
            sample = {k: (None if v is None else v[i]) for k, v in got.items()}
            _judge_first_order(t, one, sample, f"{what}sample {i}: ", index=i)
        return t.result
    if case.variant in ("grad_of_grad", "backward_create_graph"):
        first = {k[len("first order ") :]: v for k, v in got.items() if k.startswith("first")}
        _judge_first_order(t, one, first, f"{what}first order: ", keep=not_fused)
    if has_relu_kink(one) and kink_sites(one):
        # Second-order and Jacobian budgets take no candidate truths (docs/budgets.md).
        raise CaseRejected("relu pre-activations within rounding distance of 0 (P18, unjudged)")
    wide = [dataclasses.replace(d, x=d.x.double(), dy=d.dy.double()) for d in data]
    naive_got, truth_got = procedure(naive, data, case), procedure(truth, wide, case)

    def keep(key: str) -> bool:
        first = key.startswith("first order") and case.variant != "gradient_penalty"
        return not first and not_fused(key)

    _compare(t, what, one, got, naive_got, truth_got, keep)
    return t.result


# ---- the property --------------------------------------------------------------------------

#: The substitution kinds (``case.variant``), enumerated by every cell (SPEC §7).
VARIANTS = tuple(_CHECKS)
#: Kinds that differentiate the module's backward or transform it: the right result or, where
#: :func:`_refusal_allowed` says, a ``RuntimeError`` naming the module.
DIFFERENTIATING_VARIANTS = tuple(_PROCEDURES)


def check_p18(backend: Backend, case: Case) -> CheckResult:
    """P18 on ``case``: an autograd-fidelity kind or a module-protocol kind (:mod:`.protocol`,
    n/a where the backend gives a reason)."""
    check = {**_CHECKS, **PROTOCOL_CHECKS}.get(case.variant)
    if check is None:
        raise ValueError(
            f"P18 variant must be one of {VARIANTS + PROTOCOL_VARIANTS}, got {case.variant!r}"
        )
    why = backend.module_protocol_reason() if case.variant in PROTOCOL_VARIANTS else None
    if why is not None:
        raise BackendUnavailable(f"P18 {case.variant} is n/a on {backend.name}: {why}")
    return check(backend, case)


#: Kinds whose hooks must be accepted: on a fused weight (refused, SPEC §3) they target none.
_HOOKS_ACCEPTED = ("tensor_hook_chain", "tensor_hook_kept")


def _ordered(case: Case, variant: str) -> list[str]:
    """The parameters ``variant`` may target, GEMM weights first, norm parameters last."""
    order = {GEMM_WEIGHT: 0, GEMM_BIAS: 1, NORM: 2}
    names = [s.name for s in sorted(param_specs(case.config), key=lambda s: order[s.role])]
    if variant in ("tensor_hook_wrong_size", "post_accumulate_reduce"):
        names = [n for n in names if role_of(n) != NORM]  # (reduce hooks: GEMM parameters')
    if variant in _HOOKS_ACCEPTED and case.config.fuse_wgrad_accumulation:
        names = [n for n in names if role_of(n) != GEMM_WEIGHT]
    return names


def _prepare(case: Case, variant: str) -> Case:
    """``case`` made into a P18 case of ``variant``, before its targets are chosen: the
    wrong-size hook and the gradient penalty without fused accumulation (a fused weight
    refuses any tensor hook; the penalty's second pass splits a weight's gradient between
    main_grad and .grad), the kinds of :data:`_HOOKS_ACCEPTED` too where a fused module leaves
    them no target, the module hooks' kind under delay (they run in ``backward_dw()``), the
    kept tensor over at least two micro-batches (the second accumulates)."""
    config, delay, mbs = case.config, case.delay, case.micro_batches
    plain = variant in ("tensor_hook_wrong_size", "gradient_penalty")
    if variant in _HOOKS_ACCEPTED:
        case = dataclasses.replace(case, variant=variant)
        plain = not _ordered(case, variant)
    if plain and config.fuse_wgrad_accumulation:
        config = dataclasses.replace(config, fuse_wgrad_accumulation=False)
    if variant == "post_accumulate_reduce":
        delay = True
    if variant == "tensor_hook_kept" and len(mbs) == 1:
        mbs = mbs * 2
    return dataclasses.replace(case, config=config, variant=variant, delay=delay, micro_batches=mbs)


@st.composite
def p18_cases(draw, kinds, dtypes, devices, recipes):
    """1-2 micro-batches, a substitution kind from :data:`VARIANTS`, and up to
    :data:`_TARGETED` of its parameters (at least one); GEMM weights first, so that shrinking
    goes to them."""
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 2), recipes=recipes))
    variant = draw(st.sampled_from(VARIANTS))
    case = _prepare(case, variant)
    names = _ordered(case, variant)
    targets: tuple[str, ...] = ()
    if variant in _TARGETED:
        order = draw(st.permutations(names))
        count = draw(st.integers(1, min(_TARGETED[variant] or len(names), len(names))))
        targets = tuple(n for n in names if n in order[:count])
    return dataclasses.replace(case, asked=targets)


#: The explicit cases of a cell: (kind, delay, fused, targets), targets ``"all"``, ``"w"``
#: (from the GEMM weights on) or ``"o"`` (from the other end: norm parameters, biases).
EXPLICIT = (
    ("functional_call", True, False, "all"),
    ("functional_call", False, True, "w"),
    ("functional_call", True, True, "all"),
    ("parametrize", True, False, "w"),
    ("parametrize", False, False, "o"),
    ("parametrize", True, True, "w"),
    ("tensor_hook", True, False, "w"),
    ("tensor_hook", False, False, "o"),
    ("tensor_hook", False, True, "w"),
    ("tensor_hook_wrong_size", True, False, "w"),
    ("tensor_hook_wrong_size", False, False, "o"),
    ("post_accumulate_hook", True, False, "all"),
    ("post_accumulate_hook", False, False, "o"),
    ("post_accumulate_hook", True, True, "w"),
    ("tensor_hook_chain", True, False, "w"),
    ("tensor_hook_chain", False, False, "o"),
    ("tensor_hook_chain", True, True, "o"),
    ("tensor_hook_kept", True, False, "w"),
    ("tensor_hook_kept", False, False, "w"),
    ("post_accumulate_reduce", True, False, "all"),
    ("post_accumulate_reduce", True, True, "w"),
    ("grad_of_grad", False, False, ""),
    ("grad_of_grad", True, True, ""),
    ("grad_of_grad", True, False, ""),
    ("grad_of_grad", False, True, ""),
    ("gradient_penalty", True, False, ""),
    ("gradient_penalty", False, False, ""),
    ("backward_create_graph", False, False, ""),
    ("backward_create_graph", True, False, ""),
    ("backward_create_graph", False, True, ""),
    ("func.grad", False, False, ""),
    ("func.vjp", False, False, ""),
    ("func.jacrev", False, False, ""),
    ("func.vmap", False, False, ""),
    ("func.grad", True, True, ""),
    ("func.vmap", True, True, ""),
)


def p18_explicit(base: list[Case]) -> list[Case]:
    """The explicit cases of a P18 cell: :data:`EXPLICIT`, each on the next of the boundary
    cases ``base``, then every module-protocol kind on each of them."""
    out = []
    for k, (variant, delay, fused, pick) in enumerate(EXPLICIT):
        c = base[k % len(base)]
        c = dataclasses.replace(c, micro_batches=c.micro_batches[:2], delay=delay, seed=k)
        c = dataclasses.replace(
            c, config=dataclasses.replace(c.config, fuse_wgrad_accumulation=fused)
        )
        c = _prepare(c, variant)
        names = _ordered(c, variant)
        targets = tuple(names) if pick == "all" else ()
        if pick in ("w", "o"):
            start = 0 if pick == "w" else len(names) // 2
            picked = [names[(start + j) % len(names)] for j in range(_TARGETED[variant] or 2)]
            targets = tuple(dict.fromkeys(picked))
        out.append(dataclasses.replace(c, asked=targets))
    return out + protocol_explicit(base)
