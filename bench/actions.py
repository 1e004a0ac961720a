"""Recording what a ``torch.distributed.pipelining`` schedule does on one rank: one span per F, B
(or I, input gradient only) and W action, timed where the schedule calls it, with the
allocator's delta on a profiled step; and what the spans add up to (the memory held between a
micro-batch's input-gradient backward and its W action).

Used by ``splitgrad pipeline`` (:mod:`.pipeline`) and ``examples/llama_pipeline.py``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

import torch

__all__ = ["ActionRecorder", "quiet_stderr", "held_between_b_and_w", "activation_peak"]

_ACTION_METHODS = (
    ("forward_one_chunk", "F"),
    ("backward_one_chunk", "B"),
    ("backward_weight_one_chunk", "W"),
)
_PROFILER_LABEL = "splitgrad-action:"


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Drop what C++ writes to fd 2 meanwhile (the profiler prints a line at each start and stop,
    the CPU allocator warns on frees of blocks from before profiling)."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class ActionRecorder:
    """Wraps pipeline stages' action methods and records one span per action.

    A span is a dict: ``kind`` (F, B, I or W), ``stage``, ``mb`` (micro-batch), ``t0``/``t1``
    (seconds from the step's start) and, on a step run with ``memory=True``, ``bytes`` (the
    allocator's net change over the action). Timed steps use the host clock on the CPU and CUDA
    events on the current stream on a GPU (no synchronization, so the schedule's overlap is
    untouched). Memory is read directly on CUDA (synchronizing around each action) and through
    ``torch.profiler`` ranges on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: list[dict] = []
        self._memory = False
        self._host0 = 0.0
        self._origin = None
        self._holds_first = self._holds_last = False

    def wrap(self, stage, stage_index: int) -> None:
        """Record every F/B/W action ``stage`` (a ``PipelineStage``) runs from now on."""
        for attr, kind in _ACTION_METHODS:
            setattr(stage, attr, self._recording(getattr(stage, attr), kind, stage_index))
        self._holds_first |= stage.is_first
        self._holds_last |= stage.is_last

    def step(
        self, schedule, inputs, target, *, memory: bool = False
    ) -> tuple[list[dict], float, list[torch.Tensor]]:
        """Run one ``schedule.step``, given ``inputs`` where this rank holds the first stage and
        ``target`` where it holds the last: its spans, its wall-clock seconds and the last
        stage's losses (none on other ranks)."""
        losses: list[torch.Tensor] = []
        self._memory = memory
        prof = None
        if memory and self.device.type != "cuda":
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            with quiet_stderr():
                prof.__enter__()
        self._start_step()
        t0 = time.perf_counter()
        with quiet_stderr() if prof is not None else contextlib.nullcontext():
            schedule.step(
                *((inputs,) if self._holds_first else ()),
                target=target if self._holds_last else None,
                losses=losses if self._holds_last else None,
            )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        if prof is not None:
            with quiet_stderr():
                prof.__exit__(None, None, None)
            deltas = {
                e.name[len(_PROFILER_LABEL) :]: e.cpu_memory_usage
                for e in prof.events()
                if e.name.startswith(_PROFILER_LABEL)
            }
            for s in self.spans:
                s["bytes"] = deltas[f"{s['kind']}{s['stage']}.{s['mb']}"]
        return self._step_spans(), wall, losses

    def _start_step(self) -> None:
        self.spans = []
        self._origin = None
        if self.device.type == "cuda":
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self._host0 = time.perf_counter()

    def _step_spans(self) -> list[dict]:
        """The step's spans, ``t0``/``t1`` from its start (CUDA event times are read here, after
        the step synchronized)."""
        out = []
        for span in self.spans:
            span = dict(span)
            events = span.pop("events", None)
            if events is not None:
                span["t0"] = self._origin.elapsed_time(events[0]) / 1e3
                span["t1"] = self._origin.elapsed_time(events[1]) / 1e3
            else:
                span["t0"] -= self._host0
                span["t1"] -= self._host0
            out.append(span)
        return out

    def _recording(self, original, kind: str, stage_index: int):
        def run(*args, **kwargs):
            mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
            this = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
            span = {"kind": this, "stage": stage_index, "mb": int(mb)}
            cuda = self.device.type == "cuda"
            if cuda and not self._memory:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                out = original(*args, **kwargs)
                end.record()
                span["events"] = (start, end)
            elif cuda:
                torch.cuda.synchronize(self.device)
                before = torch.cuda.memory_allocated(self.device)
                span["t0"] = time.perf_counter()
                out = original(*args, **kwargs)
                torch.cuda.synchronize(self.device)
                span["t1"] = time.perf_counter()
                span["bytes"] = torch.cuda.memory_allocated(self.device) - before
            else:
                span["t0"] = time.perf_counter()
                if self._memory:
                    label = f"{_PROFILER_LABEL}{this}{stage_index}.{mb}"
                    with torch.profiler.record_function(label):
                        out = original(*args, **kwargs)
                else:
                    out = original(*args, **kwargs)
                span["t1"] = time.perf_counter()
            self.spans.append(span)
            return out

        return run


def held_between_b_and_w(spans: list[dict]) -> float | None:
    """Peak bytes kept alive for W actions still to run: each W action's net release, summed
    over the W actions pending at any moment (None: the schedule has no W action)."""
    release = {(s["stage"], s["mb"]): max(0, -s["bytes"]) for s in spans if s["kind"] == "W"}
    if not release:
        return None
    held = peak = 0
    for s in sorted(spans, key=lambda s: s["t1"]):
        key = (s["stage"], s["mb"])
        if s["kind"] == "I" and key in release:
            held += release[key]
        elif s["kind"] == "W" and key in release:
            held -= release[key]
        peak = max(peak, held)
    return float(peak)


def activation_peak(spans: list[dict]) -> float:
    """Peak of the allocator's net growth over the step, at action ends."""
    total = peak = 0
    for s in sorted(spans, key=lambda s: s["t1"]):
        total += s["bytes"]
        peak = max(peak, total)
    return float(peak)
