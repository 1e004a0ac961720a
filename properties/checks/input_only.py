"""P17 (SPEC §3 "only what the backward asks for", §7): a backward that does not compute a
parameter's gradient writes nothing to it and queues nothing for it.

A case runs 1-3 micro-batches with prefilled ``.grad`` / ``main_grad``; one of them
(``case.variant``, a :class:`~.variants.PartialBackward`) gets a *partial* backward that asks
only for ``case.asked`` (``"inp"``, the input, and/or parameter names):

* ``grad``: ``torch.autograd.grad(y, asked, dy)`` returns the asked gradients and writes none
  (no slot changes, nothing is queued, no hook fires, ``x.grad`` stays ``None``); they are
  judged against the float64 truth of that micro-batch alone written into an empty ``.grad``.
* ``inputs``: ``y.backward(dy, inputs=asked)`` writes (or, under delay, queues one entry for)
  the asked parameters only. After draining, every slot not asked equals, bitwise, a twin that
  never ran that micro-batch; the asked ones are judged against the float64 truth.

The other micro-batches get full backwards before and after it, so the queue's FIFO order
across it is exercised (as in ``torch.distributed.pipelining``'s metadata inference: an
input-only backward before the first real step). Under delayed scaling the partial micro-batch
is the last (its forward moves the amax histories, which the twin would not see).
"""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from ..backends import Backend
from ..cases.data import make_micro_batches, param_specs
from ..cases.strategies import Case, cases
from ..cases.variants import INPUT_ONLY_MODES, PartialBackward
from ..oracle.truth import judge_steps
from .results import CheckResult, PropertyViolation, Tracker
from .runner import AccuracyRun, ModuleRun, Snapshot, Step, clone_of, fb_steps

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
    """One P17 example under way: ``run`` gets the partial backward at micro-batch ``index``;
    ``entries`` counts the queued (or hooked) entries, ``xgrads`` the input gradients,
    ``returned`` what autograd.grad gave back; ``before`` is (snapshot, pending entries, hook
    calls) before the partial micro-batch's forward."""

    backend: Backend
    case: Case
    mode: str
    index: int
    t: Tracker
    run: ModuleRun
    entries: int = 0
    xgrads: list[torch.Tensor | None] = dataclasses.field(default_factory=list)
    returned: dict[str, torch.Tensor | None] = dataclasses.field(default_factory=dict)
    before: tuple[Snapshot, int, int] = ({}, 0, 0)

    def __post_init__(self) -> None:
        self.asked = set(self.case.asked)
        self.asked_params = [n for n in self.run.params if n in self.asked]
        self.asked_gemm = [n for n in self.asked_params if n in self.run.gemm_names]
        self.asked_names = ([INPUT] if INPUT in self.asked else []) + self.asked_params
        self.what = f"{self.mode} asking for {sorted(self.asked)} at micro-batch {self.index}"


def check_p17(backend: Backend, case: Case) -> CheckResult:
    """P17 on ``case`` (see the module docstring)."""
    mode, index = parse_variant(case)
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)  # skips `index`
    p = _Partial(backend, case, mode, index, Tracker(), run, xgrads=[None] * len(data))
    unknown = p.asked - set(run.params) - {INPUT}
    if unknown:
        raise ValueError(f"P17 case asks for unknown tensors {sorted(unknown)}")
    for i, d in enumerate(data):
        if i != index:
            x, _ = run.fb(d)
            xt, _ = twin.fb(d)
            p.xgrads[i] = clone_of(x.grad)
            p.t.bitwise(f"inp.grad[micro-batch {i}] (full backward) vs twin", x.grad, xt.grad)
            p.entries += 1
        else:
            p.before = (run.all_snapshot(), run.pending(), len(run.hook_calls))
            x = d.fresh_input()
            y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
            (_by_autograd_grad if mode == "grad" else _by_backward_inputs)(p, d, x, y)
    # After draining: every entry ran its hooks once; what was not asked equals the twin's.
    run.drain()
    twin.drain()
    p.t.equal("pending_wgrad_count after draining", run.pending(), 0)
    calls = run.hook_count * p.entries
    p.t.equal(f"hook calls over the run ({p.what})", len(run.hook_calls), calls)
    final, skipped = run.all_snapshot(), twin.all_snapshot()
    for key in sorted(final):
        if mode == "grad" or _param(key) not in p.asked:
            where = f"{key} after draining, vs a twin that never ran micro-batch {index}"
            p.t.bitwise(f"{where} ({p.what})", final[key], skipped.get(key))
    _judge_asked(p)
    return p.t.result


def _inputs_of(p: _Partial, x: torch.Tensor) -> list[torch.Tensor]:
    return [x if n == INPUT else p.run.params[n] for n in p.asked_names]


def _by_autograd_grad(p: _Partial, d, x: torch.Tensor, y: torch.Tensor) -> None:
    """``torch.autograd.grad``: the asked gradients come back, nothing is written or queued."""
    run, t, what = p.run, p.t, p.what
    before, pending, calls = p.before
    inputs = _inputs_of(p, x)
    got = p.backend.grad(run.module, [y], [d.dy], inputs)
    if len(got) != len(inputs):
        raise PropertyViolation(
            f"{what}: torch.autograd.grad returned {len(got)} gradients for {len(inputs)} inputs"
        )
    p.returned = dict(zip(p.asked_names, got))
    p.xgrads[p.index] = p.returned.get(INPUT)
    t.expect(x.grad is None, f"{what}: autograd.grad wrote x.grad")
    t.bitwise_all(f"{what}: written by autograd.grad: ", run.all_snapshot(), before)
    t.equal(f"{what}: pending_wgrad_count", run.pending(), pending)
    t.equal(f"{what}: hook calls", len(run.hook_calls), calls)


def _by_backward_inputs(p: _Partial, d, x: torch.Tensor, y: torch.Tensor) -> None:
    """``backward(inputs=...)``: the asked gradients are written (or queued), nothing else."""
    run, t, what, delay = p.run, p.t, p.what, p.case.delay
    before, pending, calls = p.before
    p.backend.backward(run.module, [y], [d.dy], inputs=_inputs_of(p, x))
    x_grad = "None" if x.grad is None else "set"
    t.expect((x.grad is not None) == (INPUT in p.asked), f"{what}: x.grad is {x_grad}")
    p.xgrads[p.index] = clone_of(x.grad)
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
    was = {k: before[k] for k in untouched}
    t.bitwise_all(f"{what}: changed by the backward: ", untouched, was)
    p.entries += 1 if p.asked_gemm else 0


def _judge_asked(p: _Partial) -> None:
    """Tier 2: what the partial backward produced for the asked tensors, and every input
    gradient, against the float64 truth."""
    case, index, run = p.case, p.index, p.run

    def keep(name: str) -> bool:
        # The asked tensors, and the input gradients of the micro-batches that had a full one.
        prefix = "inp.grad[micro-batch "
        if not name.startswith(prefix):
            return _param(name) in p.asked
        i = int(name[len(prefix) : -1])
        return INPUT in p.asked if i == index else p.mode == "inputs"

    if p.mode == "inputs":
        got = AccuracyRun([], p.xgrads, run.norm_snapshot(), run.gemm_snapshot())
        steps = fb_steps(len(case.micro_batches))
        judge_steps(p.t, case, steps, got, prefill_grads=True, only=keep, label="P17 inputs: ")
        return
    # autograd.grad: the contribution of micro-batch `index` alone, as a plain module writes it
    # into an empty .grad; earlier micro-batches still run first (FP8 histories), then a zero.
    plain = dataclasses.replace(
        case, config=dataclasses.replace(case.config, fuse_wgrad_accumulation=False)
    )
    norm = {f"{k}.grad": v for k, v in p.returned.items() if k in run.norm_names}
    gemm = {f"{k}.grad": v for k, v in p.returned.items() if k in run.gemm_names}
    only_x = [None] * len(case.micro_batches)
    only_x[index] = p.returned.get(INPUT)
    got = AccuracyRun([], only_x, norm, gemm)
    steps = fb_steps(index) + (Step("zero"), Step("fb", index))
    judge_steps(p.t, plain, steps, got, only=keep, label="returned by autograd.grad: ")


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
