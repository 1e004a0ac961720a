"""P17 (SPEC §3 "only what the backward asks for", §7): a backward that does not compute a
parameter's gradient writes nothing to it and queues nothing for it.

A case runs 1-3 micro-batches on a module with prefilled ``.grad`` / ``main_grad``; one of them
(``case.variant``, a :class:`~.variants.PartialBackward`) gets a *partial* backward that asks
only for ``case.asked`` (``"inp"``, the input, and/or parameter names):

* ``grad``: ``torch.autograd.grad(y, asked, dy)``. Autograd returns the asked gradients and
  writes none: no parameter slot changes, nothing is queued, no hook fires, ``x.grad`` stays
  ``None``. The returned gradients are judged against the float64 truth with the P2/P3 budgets
  (the contribution of that micro-batch alone, as a plain module writes it into an empty
  ``.grad``).
* ``inputs``: ``y.backward(dy, inputs=asked)``. The asked parameters get their gradients as
  usual (written, or queued under delay: one entry when some GEMM parameter is asked, none
  otherwise); the others are not touched. After draining, every parameter slot that was not
  asked equals, bitwise, a twin module that never ran that micro-batch; the asked ones are
  judged against the float64 truth of all the micro-batches.

The other micro-batches get full backwards, before and after the partial one, so the queue's
FIFO order across it is exercised (the pattern of ``torch.distributed.pipelining``'s metadata
inference: an input-only backward before the first real step). Under delayed scaling the partial
micro-batch is the last (its forward moves the amax histories, which the twin would not see).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
from hypothesis import strategies as st

from ..backends import Backend
from ..cases.data import make_micro_batches, param_specs
from ..cases.strategies import Case, cases
from ..cases.variants import INPUT_ONLY_MODES, PartialBackward
from ..oracle.truth import Step, judge_steps
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun

__all__ = ["check_p17", "p17_cases", "MODES", "parse_variant"]

MODES = INPUT_ONLY_MODES
INPUT = "inp"


def parse_variant(case: Case) -> tuple[str, int]:
    """``(mode, index)`` of ``case.variant`` (a :class:`~.variants.PartialBackward`, string
    form ``"grad@1"``); raises ``ValueError`` naming it when it is not one on a micro-batch of
    the case."""
    variant = case.variant
    if not isinstance(variant, PartialBackward) or variant.micro_batch >= len(case.micro_batches):
        raise ValueError(
            f"P17 variant must be '<mode>@<micro-batch>' with mode in {MODES} and a micro-batch "
            f"of the case, got {str(variant)!r}"
        )
    return variant.mode, variant.micro_batch


def _param(key: str) -> str:
    return key.split(".", 1)[0]


@dataclasses.dataclass
class _Partial:
    """One P17 example under way: ``run`` gets the partial backward at micro-batch ``index``,
    ``twin`` never runs that micro-batch; ``entries`` counts the queued (or hooked) entries,
    ``xgrads`` the input gradients, ``returned`` what autograd.grad gave back."""

    backend: Backend
    case: Case
    mode: str
    index: int
    t: Tracker
    run: ModuleRun
    twin: ModuleRun
    entries: int = 0
    xgrads: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    returned: dict[str, torch.Tensor | None] = dataclasses.field(default_factory=dict)

    @property
    def asked(self) -> set[str]:
        return set(self.case.asked)

    @property
    def asked_params(self) -> list[str]:
        return [n for n in self.run.params if n in self.asked]

    @property
    def asked_gemm(self) -> list[str]:
        return [n for n in self.asked_params if n in self.run.gemm_names]

    @property
    def what(self) -> str:
        return f"{self.mode} asking for {sorted(self.asked)} at micro-batch {self.index}"


def check_p17(backend: Backend, case: Case) -> CheckResult:
    """P17 on ``case`` (see the module docstring)."""
    mode, index = parse_variant(case)
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    p = _Partial(backend, case, mode, index, Tracker(), run, twin, xgrads=[None] * len(data))
    unknown = p.asked - set(run.params) - {INPUT}
    if unknown:
        raise ValueError(f"P17 case asks for unknown tensors {sorted(unknown)}")
    for i, d in enumerate(data):
        if i != index:
            _full_backward(p, i, d)
        else:
            # The state before the partial micro-batch's forward: what it may change.
            before = _Before(run.all_snapshot(), run.pending(), len(run.hook_calls))
            x = d.fresh_input()
            y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
            (_by_autograd_grad if mode == "grad" else _by_backward_inputs)(p, d, x, y, before)
    _after_draining(p)
    _judge_asked(p.t, case, mode, index, p.asked, p.xgrads, p.returned, run)
    return p.t.result


def _full_backward(p: _Partial, i: int, d) -> None:
    x, _ = p.run.fb(d)
    xt, _ = p.twin.fb(d)
    p.xgrads[i] = None if x.grad is None else x.grad.detach().clone()
    p.t.bitwise(f"inp.grad[micro-batch {i}] (full backward) vs twin", x.grad, xt.grad)
    p.entries += 1


def _inputs_of(p: _Partial, x: torch.Tensor) -> list[torch.Tensor]:
    return ([x] if INPUT in p.asked else []) + [p.run.params[n] for n in p.asked_params]


class _Before(NamedTuple):
    snapshot: dict[str, torch.Tensor | None]
    pending: int
    hook_calls: int


def _by_autograd_grad(p: _Partial, d, x: torch.Tensor, y: torch.Tensor, b: _Before) -> None:
    """``torch.autograd.grad``: the asked gradients come back, nothing is written or queued."""
    run, t, what = p.run, p.t, p.what
    before, pending, calls = b
    inputs = _inputs_of(p, x)
    got = p.backend.grad(run.module, [y], [d.dy], inputs)
    if len(got) != len(inputs):
        raise PropertyViolation(
            f"{what}: torch.autograd.grad returned {len(got)} gradients for {len(inputs)} inputs"
        )
    names = ([INPUT] if INPUT in p.asked else []) + p.asked_params
    p.returned = dict(zip(names, got))
    p.xgrads[p.index] = p.returned.get(INPUT)
    t.expect(x.grad is None, f"{what}: autograd.grad wrote x.grad")
    t.bitwise_all(f"{what}: written by autograd.grad: ", run.all_snapshot(), before)
    t.equal(f"{what}: pending_wgrad_count", run.pending(), pending)
    t.equal(f"{what}: hook calls", len(run.hook_calls), calls)


def _by_backward_inputs(p: _Partial, d, x: torch.Tensor, y: torch.Tensor, b: _Before) -> None:
    """``backward(inputs=...)``: the asked gradients are written (or queued), nothing else."""
    run, t, what, delay = p.run, p.t, p.what, p.case.delay
    before, pending, calls = b
    p.backend.backward(run.module, [y], [d.dy], inputs=_inputs_of(p, x))
    t.expect(
        (x.grad is not None) == (INPUT in p.asked),
        f"{what}: x.grad is {'None' if x.grad is None else 'set'}",
    )
    p.xgrads[p.index] = None if x.grad is None else x.grad.detach().clone()
    queued = 1 if delay and p.asked_gemm else 0
    t.equal(f"{what}: pending_wgrad_count", run.pending(), pending + queued)
    fired = run.hook_count if p.asked_gemm and not delay else 0
    t.equal(f"{what}: hook calls right after the backward", len(run.hook_calls) - calls, fired)
    # Not asked: untouched. Asked GEMM parameters under delay: untouched until dw.
    untouched = {
        k: v
        for k, v in run.all_snapshot().items()
        if _param(k) not in p.asked or (delay and _param(k) in run.gemm_names)
    }
    t.bitwise_all(
        f"{what}: changed by the backward: ", untouched, {k: before[k] for k in untouched}
    )
    p.entries += 1 if p.asked_gemm else 0


def _after_draining(p: _Partial) -> None:
    """Every entry ran its hooks once; what was not asked equals the twin's, bitwise."""
    run, t, what = p.run, p.t, p.what
    run.drain()
    p.twin.drain()
    t.equal("pending_wgrad_count after draining", run.pending(), 0)
    t.equal(f"hook calls over the run ({what})", len(run.hook_calls), run.hook_count * p.entries)
    final, skipped = run.all_snapshot(), p.twin.all_snapshot()
    for key in sorted(final):
        if p.mode == "grad" or _param(key) not in p.asked:
            t.bitwise(
                f"{key} after draining, vs a twin that never ran micro-batch {p.index} ({what})",
                final[key],
                skipped.get(key),
            )


def _judge_asked(t, case, mode, index, asked, xgrads, returned, run) -> None:
    """Tier 2: what the partial backward produced for the asked tensors, and every input
    gradient, against the float64 truth."""
    from .accuracy import AccuracyRun

    def keep(name: str) -> bool:
        if name.startswith("inp.grad[micro-batch "):
            i = int(name[len("inp.grad[micro-batch ") : -1])
            return i != index or INPUT in asked
        return _param(name) in asked

    n = len(case.micro_batches)
    if mode == "inputs":
        got = AccuracyRun([], xgrads, run.norm_snapshot(), run.gemm_snapshot())
        steps = tuple(Step("fb", i) for i in range(n))
        judge_steps(t, case, steps, got, prefill_grads=True, only=keep, label=f"P17 {mode}: ")
        return
    # autograd.grad: the contribution of micro-batch `index` alone, as a plain module writes it
    # into an empty .grad; earlier micro-batches still run first (FP8 histories), then a zero.
    plain = dataclasses.replace(
        case, config=dataclasses.replace(case.config, fuse_wgrad_accumulation=False)
    )
    norm_names = {s.name for s in param_specs(case.config)} - set(run.gemm_names)
    norm = {f"{k}.grad": v for k, v in returned.items() if k in norm_names}
    gemm = {f"{k}.grad": v for k, v in returned.items() if k in run.gemm_names}
    only_x = [None] * n
    only_x[index] = returned.get(INPUT)
    got = AccuracyRun([], only_x, norm, gemm)
    steps = tuple(Step("fb", i) for i in range(index)) + (Step("zero"), Step("fb", index))

    def keep_returned(name: str) -> bool:
        if name.startswith("inp.grad[micro-batch "):
            return name == f"inp.grad[micro-batch {index}]" and INPUT in asked
        return _param(name) in asked

    judge_steps(t, plain, steps, got, only=keep_returned, label="returned by autograd.grad: ")


@st.composite
def p17_cases(draw, kinds, dtypes, devices, recipes):
    """1-3 micro-batches with prefills; one gets a partial backward (``variant``
    ``PartialBackward(mode, i)``) asking for a drawn subset of the input and the parameters
    (``asked``; never empty)."""
    case = draw(cases(kinds, dtypes, devices, recipes=recipes))
    n = len(case.micro_batches)
    recipe = case.config.recipe or ""
    index = n - 1 if recipe.startswith("delayed") else draw(st.integers(0, n - 1))
    names = [s.name for s in param_specs(case.config)]
    # A prefix of a drawn permutation: every parameter as likely as any other to be asked for
    # (booleans per parameter would start from none).
    order = draw(st.permutations(names))
    chosen = set(order[: draw(st.integers(0, len(names)))])
    params = tuple(n_ for n_ in names if n_ in chosen)
    with_x = draw(st.booleans()) if params else True
    asked = ((INPUT,) if with_x else ()) + params
    mode = draw(st.sampled_from(MODES))
    return dataclasses.replace(case, variant=PartialBackward(mode, index), asked=asked)
