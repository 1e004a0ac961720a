"""Expert parallel: an MoE layer whose experts' weight gradients hide the dispatch all-to-all
(SPEC §8, P14).

Forward, on each rank of the expert-parallel group: tokens are sorted by their expert, sent to
the rank that owns it (``all_to_all_single``), regrouped expert-major and run through the rank's
local experts (one ``GroupedLinear``), then sent home by a second all-to-all and unsorted.

Backward runs in reverse: the combine all-to-all brings the output gradients to the experts, the
experts' backward computes their input gradients (and, with ``delay_wgrad_compute=True``, queues
their weight gradients), then the dispatch all-to-all sends those input gradients home. That last
all-to-all is started asynchronously and the experts' ``backward_dw()`` runs while it is in flight:
the weight-gradient GEMMs hide the communication, which is the point of the split.

Every collective is asynchronous and waited on with a timeout, so a failed rank turns into an
error on the others instead of a hang.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .modules import is_split_module

__all__ = ["all_to_all", "ExpertParallelMoE"]

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


def _wait(work, timeout: datetime.timedelta, what: str) -> None:
    try:
        work.wait(timeout)
    except RuntimeError as exc:
        raise RuntimeError(f"{what} did not complete within {timeout}") from exc


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, during_backward, timeout, timeline):
        ctx.splits = (output_splits, input_splits)
        ctx.group, ctx.during_backward, ctx.timeout = group, during_backward, timeout
        ctx.timeline = timeline
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        work = dist.all_to_all_single(
            out, x.contiguous(), output_splits, input_splits, group=group, async_op=True
        )
        _wait(work, timeout, "all_to_all (forward)")
        return out

    @staticmethod
    def backward(ctx, grad):
        dx, work = _AllToAll.start_reverse(ctx, grad)
        if ctx.during_backward is not None:
            ctx.during_backward()  # overlaps the all-to-all in flight
        _wait(work, ctx.timeout, "all_to_all (backward)")
        _AllToAll.note(ctx, "wait done")
        return dx, None, None, None, None, None, None

    @staticmethod
    def start_reverse(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Launch the backward's reverse all-to-all of ``grad``: ``(dx, work)``."""
        output_splits, input_splits = ctx.splits
        dx = grad.new_empty(sum(input_splits), *grad.shape[1:])
        work = dist.all_to_all_single(
            dx, grad.contiguous(), input_splits, output_splits, group=ctx.group, async_op=True
        )
        _AllToAll.note(ctx, "start")
        return dx, work

    @staticmethod
    def note(ctx, event: str) -> None:
        """Append ``"<label> all-to-all backward <event>"`` to the timeline, if there is one."""
        label, events = ctx.timeline or (None, None)
        if label:
            events.append(f"{label} all-to-all backward {event}")


def all_to_all(
    x: torch.Tensor,
    output_splits: Sequence[int],
    input_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    during_backward: Callable[[], None] | None = None,
    timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
    timeline: list[str] | None = None,
    label: str = "all_to_all",
) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` over dim 0: rank r receives ``output_splits[s]`` rows
    from each rank s and sends ``input_splits[s]`` rows to it. Its backward is the reverse
    all-to-all, started asynchronously; ``during_backward()`` runs while it is in flight. With a
    ``timeline`` list, the backward appends ``"<label> all-to-all backward start"`` once the
    collective is launched and ``"<label> all-to-all backward wait done"`` once it is waited on,
    so what ran in between can be read from the order of events."""
    trace = (label, timeline) if timeline is not None else None
    return _AllToAll.apply(
        x, list(output_splits), list(input_splits), group, during_backward, timeout, trace
    )


class ExpertParallelMoE(torch.nn.Module):
    """Top-1 routed experts spread over an expert-parallel group.

    Args:
        experts: this rank's ``local`` experts as one ``GroupedLinear`` (``num_gemms`` = local
            experts, input and output features equal); rank r owns global experts
            ``r * local ... (r + 1) * local - 1``.
        group: the expert-parallel process group (default: the world).
        overlap_backward_dw: run ``experts.backward_dw()`` inside the dispatch all-to-all's
            backward (only when the experts are built with ``delay_wgrad_compute=True``).
        timeout: for every collective of the layer.

    ``forward(x, expert_index)``: ``x`` (tokens, hidden), ``expert_index`` (tokens,) int64 global
    expert ids; returns (tokens, hidden), row t being expert ``expert_index[t]`` applied to
    ``x[t]``. Gating weights and top-k (a token repeated k times) are the caller's.
    """

    def __init__(
        self,
        experts: torch.nn.Module,
        group: dist.ProcessGroup | None = None,
        *,
        overlap_backward_dw: bool = True,
        timeout: datetime.timedelta = _DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        if not hasattr(experts, "num_gemms"):
            raise TypeError(f"experts must be a GroupedLinear, got {type(experts).__name__}")
        if experts.in_features != experts.out_features:
            raise ValueError(
                "experts must map hidden to hidden, got "
                f"in_features={experts.in_features}, out_features={experts.out_features}"
            )
        self.experts = experts
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.local_experts = experts.num_gemms
        self.num_experts = self.local_experts * self.world_size
        self.overlap_backward_dw = overlap_backward_dw
        self.timeout = timeout
        #: ``pending_wgrad_count`` of the experts each time the overlapped backward_dw ran
        #: (one list per step is up to the caller to clear; for tests and tracing).
        self.overlap_log: list[int] = []
        #: Events in the order they happened (clearing is up to the caller): the backward's
        #: ``"dispatch all-to-all backward start"`` / ``"... wait done"`` and the same for
        #: ``combine``; a caller may append its own (P14 brackets the experts' backward_dw()).
        self.timeline: list[str] = []

    def _experts_backward_dw(self) -> None:
        pending = self.experts.pending_wgrad_count
        self.overlap_log.append(pending)
        for _ in range(pending):
            self.experts.backward_dw()

    def forward(self, x: torch.Tensor, expert_index: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or expert_index.shape != x.shape[:1]:
            raise ValueError(
                f"x must be (tokens, hidden) and expert_index (tokens,), got {tuple(x.shape)} "
                f"and {tuple(expert_index.shape)}"
            )
        if expert_index.numel() and (
            int(expert_index.min()) < 0 or int(expert_index.max()) >= self.num_experts
        ):
            raise ValueError(
                f"expert_index must lie in [0, {self.num_experts}), got values in "
                f"[{int(expert_index.min())}, {int(expert_index.max())}]"
            )
        world, local = self.world_size, self.local_experts
        counts = torch.bincount(expert_index, minlength=self.num_experts)
        # per_src[s][i]: tokens rank s sends to my local expert i
        recv_counts = torch.empty_like(counts)
        work = dist.all_to_all_single(recv_counts, counts, group=self.group, async_op=True)
        _wait(work, self.timeout, "all_to_all (expert counts)")
        per_src = recv_counts.view(world, local).tolist()
        send = counts.view(world, local).sum(dim=1).tolist()
        recv = [sum(row) for row in per_src]

        order = torch.argsort(expert_index, stable=True)
        overlap = None
        if self.overlap_backward_dw and is_split_module(self.experts):
            if self.experts.need_backward_dw():
                overlap = self._experts_backward_dw
        dispatched = all_to_all(
            x[order],
            recv,
            send,
            self.group,
            during_backward=overlap,
            timeout=self.timeout,
            timeline=self.timeline,
            label="dispatch",
        )
        # received rows are (source, expert)-major; the experts want them expert-major
        blocks = dispatched.split([n for row in per_src for n in row])
        by_expert = [blocks[s * local + i] for i in range(local) for s in range(world)]
        m_splits = [sum(per_src[s][i] for s in range(world)) for i in range(local)]
        y_local = self.experts(torch.cat(by_expert), m_splits)
        parts = y_local.split([per_src[s][i] for i in range(local) for s in range(world)])
        back = torch.cat([parts[i * world + s] for s in range(world) for i in range(local)])
        combined = all_to_all(
            back,
            send,
            recv,
            self.group,
            timeout=self.timeout,
            timeline=self.timeline,
            label="combine",
        )
        return torch.empty_like(combined).index_copy(0, order, combined)
