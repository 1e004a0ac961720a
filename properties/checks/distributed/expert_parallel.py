"""P14 (SPEC §7), and P16 beside it: :class:`~splitgrad.distributed.ExpertParallelMoE` (or the
layer named by ``moe=``) over 2 gloo ranks.

The experts are bitwise the single-process ``GroupedLinear`` over all experts, and their
``backward_dw()`` runs while the dispatch all-to-all of the backward is in flight: read from the
order of events the harness records itself (each ``all_to_all_single`` launched, its work
handle's ``wait()`` called and returned, the experts' ``backward_dw()`` start and end), never
from the layer's own account. A replicated projection in front is reduced by a
:class:`~splitgrad.distributed.GradientReducer` (P16) and compared with the ranks' mean.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from splitgrad.distributed import GradientReducer

from .library import load_library
from .report import DistributedReport, run_checked

__all__ = ["check_expert_parallel", "overlap_failure"]

_MOE = {"tokens": 12, "hidden": 16, "experts": 4}


def _moe_data(seed: int, world: int, tokens: int, hidden: int, experts: int):
    gen = torch.Generator().manual_seed(seed)
    proj_w = torch.randn(hidden, hidden, generator=gen) * 0.3
    proj_b = torch.randn(hidden, generator=gen) * 0.1
    expert_w = [torch.randn(hidden, hidden, generator=gen) * 0.3 for _ in range(experts)]
    expert_b = [torch.randn(hidden, generator=gen) * 0.1 for _ in range(experts)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(world)]
    # rank 0 never routes to the last expert: an empty group on purpose
    assign = [torch.arange(tokens) % (experts - 1)] + [
        torch.randint(0, experts, (tokens,), generator=gen) for _ in range(world - 1)
    ]
    dys = [torch.randn(tokens, hidden, generator=gen) for _ in range(world)]
    return proj_w, proj_b, expert_w, expert_b, xs, assign, dys


def _load(module, values: dict) -> None:
    with torch.no_grad():
        for name, value in values.items():
            getattr(module, name).copy_(value)


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
    and recorded in ``events`` (launched, or run synchronously) and its work handle traced: P14
    reads what ran while the dispatch all-to-all was in flight from this record, kept by the
    harness, never from the layer's own account of itself."""

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


def _render(events: list) -> list[str]:
    return [what if index is None else f"all-to-all {index} {what}" for what, index in events]


def _moe_rank(rank: int, world: int, lib_name: str, moe_name: str) -> dict:
    lib = load_library(lib_name)
    moe_cls = load_library(moe_name)
    tokens, hidden, experts = _MOE["tokens"], _MOE["hidden"], _MOE["experts"]
    local = experts // world
    proj_w, proj_b, expert_w, expert_b, xs, assign, dys = _moe_data(
        0, world, tokens, hidden, experts
    )
    proj = lib.Linear(hidden, hidden, delay_wgrad_compute=True)
    _load(proj, {"weight": proj_w, "bias": proj_b})
    mine = range(rank * local, (rank + 1) * local)
    grouped = lib.GroupedLinear(local, hidden, hidden, delay_wgrad_compute=True)
    _load(grouped, {f"weight{i}": expert_w[e] for i, e in enumerate(mine)})
    _load(grouped, {f"bias{i}": expert_b[e] for i, e in enumerate(mine)})
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
    dw_start = time.perf_counter()
    proj.backward_dw()
    reducer.finish()
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "proj": {"weight": proj.weight.grad, "bias": proj.bias.grad},
        "experts": {
            e: (getattr(grouped, f"weight{i}").grad, getattr(grouped, f"bias{i}").grad)
            for i, e in enumerate(mine)
        },
        "events": events,
        "pending": (proj.pending_wgrad_count, grouped.pending_wgrad_count),
        "launches": [e["time"] for e in reducer.launch_log],
        "dw_start": dw_start,
        "finish": reducer.finish_time,
    }


def _moe_truth(rank: int, world: int, lib_name: str, nranks: int) -> dict:
    lib = load_library(lib_name)
    tokens, hidden, experts = _MOE["tokens"], _MOE["hidden"], _MOE["experts"]
    proj_w, proj_b, expert_w, expert_b, xs, assign, dys = _moe_data(
        0, nranks, tokens, hidden, experts
    )
    proj = lib.Linear(hidden, hidden)
    _load(proj, {"weight": proj_w, "bias": proj_b})
    grouped = lib.GroupedLinear(experts, hidden, hidden)
    _load(grouped, {f"weight{e}": expert_w[e] for e in range(experts)})
    _load(grouped, {f"bias{e}": expert_b[e] for e in range(experts)})
    x = torch.cat(xs).requires_grad_()
    a = torch.cat(assign)
    order = torch.argsort(a, stable=True)  # rank 0's tokens before rank 1's within an expert
    # the projection per rank's tokens: its gradient is then replica 0's + replica 1's, the sum
    # the all-reduce forms (exact in either order for two)
    h = torch.cat([proj(part) for part in x.split(tokens)])
    y_sorted = grouped(h[order], torch.bincount(a, minlength=experts).tolist())
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
    y.backward(torch.cat(dys))
    # the projection's data-parallel mean over the ranks
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "proj": {"weight": proj.weight.grad / nranks, "bias": proj.bias.grad / nranks},
        "experts": {
            e: (getattr(grouped, f"weight{e}").grad, getattr(grouped, f"bias{e}").grad)
            for e in range(experts)
        },
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
    issued = [(i, k) for i, (what, k) in enumerate(events[lo:hi], lo) if k is not None]
    issued = [(i, k) for i, k in issued if events[i][0] in ("launched", "ran synchronously")]
    if not issued:
        return "the backward issued no all_to_all_single (traced at torch.distributed)"
    launch, dispatch = issued[-1]
    if events[launch][0] == "ran synchronously":
        return f"the dispatch all-to-all (all-to-all {dispatch}) ran synchronously: never in flight"
    done = [
        i
        for i, (what, k) in enumerate(events)
        if k == dispatch and what in ("wait() called", "seen completed")
    ]
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
    truths = run_checked(
        report, "single-process baseline", _moe_truth, 1, lib_name, world, timeout_s=timeout_s
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    tokens = _MOE["tokens"]
    for rank, got in enumerate(results):
        rows = slice(rank * tokens, (rank + 1) * tokens)
        report.bitwise(f"rank {rank} output", got["y"], truth["y"][rows])
        report.bitwise(f"rank {rank} x.grad", got["x.grad"], truth["x.grad"][rows])
        for e, (w, b) in got["experts"].items():
            tw, tb = truth["experts"][e]
            report.bitwise(f"rank {rank} expert {e} weight.grad", w, tw)
            report.bitwise(f"rank {rank} expert {e} bias.grad", b, tb)
        report.counted()
        why = overlap_failure(got["events"])
        if why:
            shown = _render(got["events"])
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
    report.bitwise(
        "proj.weight.grad rank 0 vs rank 1",
        results[0]["proj"]["weight"],
        results[1]["proj"]["weight"],
    )
    return report
