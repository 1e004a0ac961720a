"""P14 (SPEC §7), and P16 beside it: :class:`~splitgrad.distributed.ExpertParallelMoE` (or the
layer named by ``moe=``) over 2 gloo ranks.

The experts are bitwise the single-process ``GroupedLinear`` over all experts, and their
``backward_dw()`` runs while the dispatch all-to-all of the backward is in flight: read from
events the harness records itself (:class:`_AllToAllTrace`), never from the layer's own account.
A replicated projection in front is reduced by a ``GradientReducer`` (P16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from splitgrad.distributed import GradientReducer

from .library import load_library
from .report import DistributedReport, baseline, run_checked

_TOKENS, _HIDDEN, _EXPERTS = 12, 16, 4


def _moe_modules(lib: Any, held: range, world: int, **options: Any) -> tuple:
    """The projection and a ``GroupedLinear`` of the experts ``held`` (built with ``options``),
    holding the values every rank draws, and each rank's input, routing and output gradient."""
    gen = torch.Generator().manual_seed(0)
    proj_w = torch.randn(_HIDDEN, _HIDDEN, generator=gen) * 0.3
    proj_b = torch.randn(_HIDDEN, generator=gen) * 0.1
    expert_w = [torch.randn(_HIDDEN, _HIDDEN, generator=gen) * 0.3 for _ in range(_EXPERTS)]
    expert_b = [torch.randn(_HIDDEN, generator=gen) * 0.1 for _ in range(_EXPERTS)]
    xs = [torch.randn(_TOKENS, _HIDDEN, generator=gen) for _ in range(world)]
    # rank 0 never routes to the last expert: an empty group on purpose
    assign = [torch.arange(_TOKENS) % (_EXPERTS - 1)] + [
        torch.randint(0, _EXPERTS, (_TOKENS,), generator=gen) for _ in range(world - 1)
    ]
    dys = [torch.randn(_TOKENS, _HIDDEN, generator=gen) for _ in range(world)]
    proj = lib.Linear(_HIDDEN, _HIDDEN, **options)
    grouped = lib.GroupedLinear(len(held), _HIDDEN, _HIDDEN, **options)
    with torch.no_grad():
        proj.weight.copy_(proj_w)
        proj.bias.copy_(proj_b)
        for i, e in enumerate(held):
            getattr(grouped, f"weight{i}").copy_(expert_w[e])
            getattr(grouped, f"bias{i}").copy_(expert_b[e])
    return proj, grouped, xs, assign, dys


def _expert_grads(grouped: Any, held: range) -> dict:
    return {
        f"expert {e} {kind}.grad": getattr(grouped, f"{kind}{i}").grad
        for i, e in enumerate(held)
        for kind in ("weight", "bias")
    }


def _traced_backward_dw(module, events: list) -> None:
    """Bracket ``module.backward_dw()`` with events in ``events`` (on the instance, so the
    layer under test cannot leave them out)."""
    original = module.backward_dw

    def backward_dw(*args, **kwargs):
        events.append(("experts backward_dw start", None))
        result = original(*args, **kwargs)
        events.append(("experts backward_dw end", None))
        return result

    module.backward_dw = backward_dw


class _TracedWork:
    """A collective's work handle that records in ``events`` when ``wait()`` is called and
    returns, and the first ``is_completed()`` that says ``True``."""

    def __init__(self, work, index: int, events: list) -> None:
        self._work, self._index, self._events = work, index, events
        self._completed = False

    def wait(self, *args, **kwargs):
        self._events.append(("wait() called", self._index))
        result = self._work.wait(*args, **kwargs)
        self._events.append(("wait() returned", self._index))
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and not self._completed:
            self._completed = True
            self._events.append(("seen completed", self._index))
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class _AllToAllTrace:
    """While active, every ``torch.distributed.all_to_all_single`` of this process is numbered
    and recorded in ``events`` (launched, or run synchronously) and its work handle traced
    (``wait()`` called and returned)."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.launched = 0

    def __enter__(self) -> _AllToAllTrace:
        import torch.distributed.distributed_c10d as c10d

        original = c10d.all_to_all_single
        self._saved = [(m, m.all_to_all_single) for m in (dist, c10d)]

        def all_to_all_single(*args, **kwargs):
            index = self.launched
            self.launched += 1
            work = original(*args, **kwargs)
            if work is None:
                self.events.append(("ran synchronously", index))
                return None
            self.events.append(("launched", index))
            return _TracedWork(work, index, self.events)

        for m, _ in self._saved:
            m.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc) -> None:
        for m, fn in self._saved:
            m.all_to_all_single = fn


def _moe_rank(rank: int, world: int, lib_name: str, moe_name: str) -> dict:
    lib = load_library(lib_name)
    moe_cls = load_library(moe_name)
    local = _EXPERTS // world
    held = range(rank * local, (rank + 1) * local)
    proj, grouped, xs, assign, dys = _moe_modules(lib, held, world, delay_wgrad_compute=True)
    moe = moe_cls(grouped)
    events: list = []
    _traced_backward_dw(grouped, events)
    model = torch.nn.ModuleDict({"proj": proj, "moe": moe})
    # data parallel for the replicated projection, the experts left to expert parallelism
    reducer = GradientReducer(
        model, ignore=[n for n, _ in model.named_parameters() if n.startswith("moe.")]
    )
    x = xs[rank].clone().requires_grad_()
    with _AllToAllTrace(events):
        y = moe(proj(x), assign[rank])
        events.append(("backward() called", None))
        y.backward(dys[rank])
        events.append(("backward() returned", None))
    proj.backward_dw()
    reducer.finish()
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "proj": {"weight": proj.weight.grad, "bias": proj.bias.grad},
        "experts": _expert_grads(grouped, held),
        "events": events,
        "pending": (proj.pending_wgrad_count, grouped.pending_wgrad_count),
        "launches": [e["time"] for e in reducer.launch_log],
        "finish": reducer.finish_time,
    }


def _moe_truth(rank: int, world: int, lib_name: str, nranks: int) -> dict:
    proj, grouped, xs, assign, dys = _moe_modules(load_library(lib_name), range(_EXPERTS), nranks)
    x = torch.cat(xs).requires_grad_()
    a = torch.cat(assign)
    order = torch.argsort(a, stable=True)  # rank 0's tokens before rank 1's within an expert
    # the projection per rank's tokens: its gradient is then replica 0's + replica 1's, the sum
    # the all-reduce forms (exact in either order for two)
    h = torch.cat([proj(part) for part in x.split(_TOKENS)])
    y_sorted = grouped(h[order], torch.bincount(a, minlength=_EXPERTS).tolist())
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
    y.backward(torch.cat(dys))
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        # the projection's data-parallel mean over the ranks
        "proj": {"weight": proj.weight.grad / nranks, "bias": proj.bias.grad / nranks},
        "experts": _expert_grads(grouped, range(_EXPERTS)),
    }


def overlap_failure(events: list) -> str | None:
    """Why ``events`` (see :class:`_AllToAllTrace`) do not show the experts' backward_dw() run
    once, start and end, while the dispatch all-to-all of the backward (the last all-to-all the
    backward launched) was in flight: after its launch, before its ``wait()`` was called (or an
    ``is_completed()`` said ``True``); ``None`` if they do."""
    lo = events.index(("backward() called", None))
    hi = events.index(("backward() returned", None))
    runs = [i for i, (what, _) in enumerate(events) if what == "experts backward_dw start"]
    if len(runs) != 1:
        return f"the experts' backward_dw() ran {len(runs)} times, expected 1"
    (start,) = runs
    ends = [j for j, (what, _) in enumerate(events) if what == "experts backward_dw end"]
    ends = [j for j in ends if j > start]
    issuing = ("launched", "ran synchronously")
    issued = [(i, k) for i, (what, k) in enumerate(events[lo:hi], lo) if what in issuing]
    if not issued:
        return "the backward issued no all_to_all_single (traced at torch.distributed)"
    launch, dispatch = issued[-1]
    if events[launch][0] == "ran synchronously":
        return f"the dispatch all-to-all (all-to-all {dispatch}) ran synchronously: never in flight"
    waited = ("wait() called", "seen completed")
    done = [i for i, (what, k) in enumerate(events) if k == dispatch and what in waited]
    if not done:
        return f"the dispatch all-to-all (all-to-all {dispatch}) was never waited on"
    if not (ends and launch < start < ends[0] < done[0]):
        return (
            f"the experts' backward_dw() did not run while the dispatch all-to-all (all-to-all "
            f"{dispatch}) was in flight (after its launch, before its wait())"
        )
    return None


def check_expert_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    moe: str = "splitgrad.distributed:ExpertParallelMoE",
    timeout_s: float = 300.0,
) -> DistributedReport:
    """P14 (and P16 beside it) on 2 gloo ranks; ``moe`` names the expert-parallel layer
    (``"module:Class"``, built as ``Class(grouped_linear)``)."""
    world = 2
    report = DistributedReport(f"P14 {lib_name} on {world} ranks")
    results = run_checked(
        report, "expert-parallel ranks", _moe_rank, world, lib_name, moe, timeout_s=timeout_s
    )
    truth = baseline(report, _moe_truth, lib_name, world, timeout_s=timeout_s)
    if results is None or truth is None:
        return report
    for rank, got in enumerate(results):
        rows = slice(rank * _TOKENS, (rank + 1) * _TOKENS)
        report.bitwise(f"rank {rank} output", got["y"], truth["y"][rows])
        report.bitwise(f"rank {rank} x.grad", got["x.grad"], truth["x.grad"][rows])
        for name, g in got["experts"].items():
            report.bitwise(f"rank {rank} {name}", g, truth["experts"][name])
        report.counted()
        why = overlap_failure(got["events"])
        if why:
            shown = [w if i is None else f"all-to-all {i} {w}" for w, i in got["events"]]
            report.failures.append(f"rank {rank}: {why}; events in order: {shown}")
        if got["pending"] != (0, 0):
            report.failures.append(f"rank {rank}: entries left pending {got['pending']}")
        for name, g in got["proj"].items():
            report.bitwise(
                f"rank {rank} proj.{name}.grad (replica0 + replica1) / 2", g, truth["proj"][name]
            )
        if not got["launches"] or max(got["launches"]) > got["finish"]:
            report.failures.append(
                f"rank {rank}: the projection's reduction was not launched before finish()"
            )
    weights = [r["proj"]["weight"] for r in results]
    report.bitwise("proj.weight.grad rank 0 vs rank 1", weights[0], weights[1])
    return report
