"""P17 (SPEC §3 "only what the backward asks for", §7): a backward that does not compute a
parameter's gradient writes nothing to it and queues nothing for it.

A case runs 1-3 micro-batches on a module with prefilled ``.grad`` / ``main_grad``; one of them
(``case.variant = "<mode>@<index>"``) gets a *partial* backward that asks only for
``case.asked`` (``"inp"``, the input, and/or parameter names):

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

import torch
from hypothesis import strategies as st

from .backends import Backend
from .data import make_micro_batches, param_specs
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun
from .strategies import Case, cases
from .truth import Step, judge_steps

__all__ = ["check_p17", "p17_cases", "MODES", "parse_variant"]

MODES = ("grad", "inputs")
INPUT = "inp"


def parse_variant(case: Case) -> tuple[str, int]:
    """``(mode, index)`` of ``case.variant`` (``"grad@1"``); raises ``ValueError`` naming it."""
    mode, _, index = case.variant.partition("@")
    if mode not in MODES or not index.isdigit() or int(index) >= len(case.micro_batches):
        raise ValueError(
            f"P17 variant must be '<mode>@<micro-batch>' with mode in {MODES} and a micro-batch "
            f"of the case, got {case.variant!r}"
        )
    return mode, int(index)


def _param(key: str) -> str:
    return key.split(".", 1)[0]


def check_p17(backend: Backend, case: Case) -> CheckResult:
    """P17 on ``case`` (see the module docstring)."""
    mode, index = parse_variant(case)
    asked = set(case.asked)
    t = Tracker()
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    twin = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    unknown = asked - set(run.params) - {INPUT}
    if unknown:
        raise ValueError(f"P17 case asks for unknown tensors {sorted(unknown)}")
    asked_params = [n for n in run.params if n in asked]
    asked_gemm = [n for n in asked_params if n in run.gemm_names]
    what = f"{mode} asking for {sorted(asked)} at micro-batch {index}"
    hooks_per_entry = run.hook_count
    entries = 0
    xgrads: list[torch.Tensor | None] = [None] * len(data)
    returned: dict[str, torch.Tensor | None] = {}
    for i, d in enumerate(data):
        if i != index:
            x, _ = run.fb(d)
            xt, _ = twin.fb(d)
            xgrads[i] = None if x.grad is None else x.grad.detach().clone()
            t.bitwise(f"inp.grad[micro-batch {i}] (full backward) vs twin", x.grad, xt.grad)
            entries += 1
            continue
        before = run.all_snapshot()
        pending, calls = run.pending(), len(run.hook_calls)
        x = d.fresh_input()
        y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
        inputs = ([x] if INPUT in asked else []) + [run.params[n] for n in asked_params]
        if mode == "grad":
            got = backend.grad(run.module, [y], [d.dy], inputs)
            if len(got) != len(inputs):
                raise PropertyViolation(
                    f"{what}: torch.autograd.grad returned {len(got)} gradients for "
                    f"{len(inputs)} inputs"
                )
            names = ([INPUT] if INPUT in asked else []) + asked_params
            returned = dict(zip(names, got))
            xgrads[i] = returned.get(INPUT)
            t.expect(x.grad is None, f"{what}: autograd.grad wrote x.grad")
            t.bitwise_all(f"{what}: written by autograd.grad: ", run.all_snapshot(), before)
            t.equal(f"{what}: pending_wgrad_count", run.pending(), pending)
            t.equal(f"{what}: hook calls", len(run.hook_calls), calls)
        else:
            backend.backward(run.module, [y], [d.dy], inputs=inputs)
            t.expect(
                (x.grad is not None) == (INPUT in asked),
                f"{what}: x.grad is {'None' if x.grad is None else 'set'}",
            )
            xgrads[i] = None if x.grad is None else x.grad.detach().clone()
            queued = 1 if case.delay and asked_gemm else 0
            t.equal(f"{what}: pending_wgrad_count", run.pending(), pending + queued)
            fired = hooks_per_entry if asked_gemm and not case.delay else 0
            t.equal(
                f"{what}: hook calls right after the backward", len(run.hook_calls) - calls, fired
            )
            now = run.all_snapshot()
            # Not asked: untouched. Asked GEMM parameters under delay: untouched until dw.
            untouched = {
                k: v
                for k, v in now.items()
                if _param(k) not in asked or (case.delay and _param(k) in run.gemm_names)
            }
            t.bitwise_all(
                f"{what}: changed by the backward: ",
                untouched,
                {k: before[k] for k in untouched},
            )
            entries += 1 if asked_gemm else 0
    run.drain()
    twin.drain()
    t.equal("pending_wgrad_count after draining", run.pending(), 0)
    t.equal(
        f"hook calls over the run ({what})",
        len(run.hook_calls),
        hooks_per_entry * entries,
    )
    final, skipped = run.all_snapshot(), twin.all_snapshot()
    for key in sorted(final):
        if mode == "grad" or _param(key) not in asked:
            t.bitwise(
                f"{key} after draining, vs a twin that never ran micro-batch {index} ({what})",
                final[key],
                skipped.get(key),
            )
    _judge_asked(t, case, mode, index, asked, xgrads, returned, run)
    return t.result


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
    ``"grad@i"``/``"inputs@i"``) asking for a drawn subset of the input and the parameters
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
    return dataclasses.replace(case, variant=f"{mode}@{index}", asked=asked)
