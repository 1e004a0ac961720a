"""What the split buys across ranks, measured: ``splitgrad pipeline`` and ``splitgrad moe``.

``splitgrad pipeline`` trains a few steps of a stack of ``LayerNormMLP`` layers (residual, no
optimizer update: every step is the same work) under ``torch.distributed.pipelining`` schedules,
twice per schedule in the same run: the package's delayed modules with splitgrad's
:func:`~splitgrad.distributed.dw_builder`, and their ``torch.nn`` twins (``LayerNorm``,
``Linear``, tanh-GELU, ``Linear``, holding the same values) on a ``PipelineStage`` without
``dw_builder``, which is torch's own input/weight split. Each stage's F, B (or I, input gradient
only) and W actions are timed where the schedule calls them (host clock on the CPU, CUDA
events on the stream on a GPU, without synchronizing), so per rank:

* step time: one ``schedule.step`` after a barrier (median over the timed steps; the slowest
  rank's);
* bubble fraction: the share of the step that rank spends outside its actions (waiting for a
  neighbour or a peer's send);
* held B->W: the peak of the memory kept alive between a micro-batch's input-gradient backward
  and its W action (each W action's net release, summed over the W actions pending at any
  moment), from a separate profiled step: allocator deltas of each action
  (``torch.profiler``'s ``profile_memory`` on the CPU, ``torch.cuda.memory_allocated`` on CUDA).

``splitgrad moe`` measures the expert-parallel layer's overlap in one run: the dispatch
all-to-all of the backward alone, the experts' ``backward_dw()`` alone, and both as
:class:`~splitgrad.distributed.ExpertParallelMoE` runs them (the all-to-all in flight while
``backward_dw()`` computes), and prints the share of the all-to-all's time hidden.

Both spawn gloo ranks on this machine (``run_ranks``), or run under ``torchrun`` (NCCL and one
GPU per rank when CUDA is available).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from .launch import RankFailure, run_ranks
from .modules import split_modules

__all__ = [
    "SCHEDULE_ALIASES",
    "PipelineBenchConfig",
    "MoEBenchConfig",
    "run_pipeline_bench",
    "run_moe_bench",
    "pipeline_main",
    "moe_main",
]

#: Short names of the schedules ``splitgrad pipeline --schedule`` takes.
SCHEDULE_ALIASES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
_VARIANTS = ("splitgrad", "torch")
_ACTION_METHODS = (
    ("forward_one_chunk", "F"),
    ("backward_one_chunk", "B"),
    ("backward_weight_one_chunk", "W"),
)
_MIB = 1024.0 * 1024.0


# ---- configuration -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineBenchConfig:
    """``splitgrad pipeline``'s options (see ``splitgrad pipeline --help``)."""

    schedules: tuple[str, ...] = ("zbv",)
    ranks: int = 2
    layers: int = 8
    hidden: int = 256
    ffn: int = 1024
    rows: int = 64
    microbatches: int = 0  # 0: 2 x the number of stages
    steps: int = 3
    backend: str = "impl"
    dtype: str = "float32"
    threads: int = 1

    def stages(self, schedule: str) -> int:
        return self.ranks * (1 if schedule in ("gpipe", "1f1b") else 2)

    def n_microbatches(self, schedule: str) -> int:
        return self.microbatches or 2 * self.stages(schedule)

    def validate(self) -> None:
        unknown = [s for s in self.schedules if s not in SCHEDULE_ALIASES]
        if unknown or not self.schedules:
            raise ValueError(
                f"unknown schedule(s) {unknown or list(self.schedules)}; expected a "
                f"comma-separated subset of {', '.join(SCHEDULE_ALIASES)} or 'all'"
            )
        for name in ("ranks", "layers", "hidden", "ffn", "rows", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.ranks < 2:
            raise ValueError(f"--ranks must be >= 2 for a pipeline, got {self.ranks}")
        if self.microbatches < 0:
            raise ValueError(f"--microbatches must be >= 1, got {self.microbatches}")
        for s in self.schedules:
            stages = self.stages(s)
            if self.layers % stages:
                raise ValueError(
                    f"--layers {self.layers} does not split evenly into the {stages} stages of "
                    f"{s} on {self.ranks} ranks"
                )
            n_mb = self.n_microbatches(s)
            if s != "gpipe" and n_mb < stages:
                raise ValueError(
                    f"--microbatches {n_mb} is fewer than the {stages} stages of {s}; "
                    "its warm-up needs at least one per stage"
                )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")


# ---- the model -----------------------------------------------------------------------------


class _Residual(torch.nn.Module):
    """``x + layer(x)`` for each layer in turn."""

    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


class TorchMLP(torch.nn.Module):
    """The ``torch.nn`` twin of a ``LayerNormMLP`` (LayerNorm, tanh-GELU): same values."""

    def __init__(self, hidden: int, ffn: int, *, dtype, device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.norm = torch.nn.LayerNorm(hidden, eps=1e-5, **kw)
        self.fc1 = torch.nn.Linear(hidden, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, hidden, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(self.norm(x)), approximate="tanh")
        return self.fc2(h)


def _layer_values(seed: int, hidden: int, ffn: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape: int, scale: float) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    return {
        "norm_weight": 1.0 + draw(hidden, scale=0.1),
        "norm_bias": draw(hidden, scale=0.1),
        "fc1_weight": draw(ffn, hidden, scale=hidden**-0.5),
        "fc1_bias": draw(ffn, scale=0.02),
        "fc2_weight": draw(hidden, ffn, scale=0.5 * ffn**-0.5),
        "fc2_bias": draw(hidden, scale=0.02),
    }


def _build_stage(lib, variant: str, stage: int, cfg: PipelineBenchConfig, num_stages: int, dev):
    dtype = getattr(torch, cfg.dtype)
    per_stage = cfg.layers // num_stages
    layers: list[torch.nn.Module] = []
    for j in range(per_stage):
        v = _layer_values(10_000 + stage * per_stage + j, cfg.hidden, cfg.ffn)
        if variant == "splitgrad":
            layer = lib.LayerNormMLP(
                cfg.hidden, cfg.ffn, delay_wgrad_compute=True, params_dtype=dtype, device=dev
            )
            pairs = [
                (layer.layer_norm_weight, v["norm_weight"]),
                (layer.layer_norm_bias, v["norm_bias"]),
                (layer.fc1_weight, v["fc1_weight"]),
                (layer.fc1_bias, v["fc1_bias"]),
                (layer.fc2_weight, v["fc2_weight"]),
                (layer.fc2_bias, v["fc2_bias"]),
            ]
        else:
            layer = TorchMLP(cfg.hidden, cfg.ffn, dtype=dtype, device=dev)
            pairs = [
                (layer.norm.weight, v["norm_weight"]),
                (layer.norm.bias, v["norm_bias"]),
                (layer.fc1.weight, v["fc1_weight"]),
                (layer.fc1.bias, v["fc1_bias"]),
                (layer.fc2.weight, v["fc2_weight"]),
                (layer.fc2.bias, v["fc2_bias"]),
            ]
        with torch.no_grad():
            for p, value in pairs:
                p.copy_(value.to(dtype))
        layers.append(layer)
    return _Residual(layers)


def _stage_layout(schedule: str, rank: int, ranks: int) -> list[int]:
    if schedule in ("gpipe", "1f1b"):
        return [rank]
    if schedule in ("interleaved-1f1b", "interleaved-zb"):
        return [rank, rank + ranks]
    return [rank, 2 * ranks - 1 - rank]  # a V: zbv, dualpipev


# ---- recording actions ---------------------------------------------------------------------


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints a line to fd 2 at each start and stop; drop those."""
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class _Recorder:
    """Wraps a stage's action methods and records one span per action.

    Timed steps: host clock on the CPU; on CUDA, events on the current stream (no
    synchronization, so the schedule's overlap is untouched; read after the step). With
    ``memory`` set: allocator deltas too, read directly on CUDA (synchronizing around each
    action) and through profiler ranges on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: list[dict] = []
        self.memory = False
        self._host0 = 0.0
        self._origin = None

    def start_step(self) -> None:
        self.spans = []
        self._origin = None
        if self.device.type == "cuda":
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
        self._host0 = time.perf_counter()

    def step_spans(self) -> list[dict]:
        """The step's spans, ``t0``/``t1`` in seconds from its start (on CUDA, call after
        synchronizing: event times are read here)."""
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

    def wrap(self, stage, stage_index: int) -> None:
        for attr, kind in _ACTION_METHODS:
            original = getattr(stage, attr)

            def run(*args, _original=original, _kind=kind, **kwargs):
                mb = args[0] if args else kwargs.get("fwd_chunk_id", kwargs.get("bwd_chunk_id"))
                if _kind == "B" and not kwargs.get("full_backward", True):
                    _kind = "I"
                span = {"kind": _kind, "stage": stage_index, "mb": int(mb)}
                cuda = self.device.type == "cuda"
                if cuda and not self.memory:
                    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                    start.record()
                    out = _original(*args, **kwargs)
                    end.record()
                    span["events"] = (start, end)
                elif cuda:
                    torch.cuda.synchronize(self.device)
                    before = torch.cuda.memory_allocated(self.device)
                    span["t0"] = time.perf_counter()
                    out = _original(*args, **kwargs)
                    torch.cuda.synchronize(self.device)
                    span["t1"] = time.perf_counter()
                    span["bytes"] = torch.cuda.memory_allocated(self.device) - before
                else:
                    label = f"{_kind}{stage_index}.{mb}"
                    span["t0"] = time.perf_counter()
                    if self.memory:
                        with torch.profiler.record_function(f"splitgrad-action:{label}"):
                            out = _original(*args, **kwargs)
                    else:
                        out = _original(*args, **kwargs)
                    span["t1"] = time.perf_counter()
                self.spans.append(span)
                return out

            setattr(stage, attr, run)


def _held_between_b_and_w(spans: list[dict]) -> float | None:
    """Peak bytes kept alive for W actions still to run (None: the schedule has no W action)."""
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


def _activation_peak(spans: list[dict]) -> float:
    """Peak of the allocator's net growth over the step, at action ends."""
    total = peak = 0
    for s in sorted(spans, key=lambda s: s["t1"]):
        total += s["bytes"]
        peak = max(peak, total)
    return float(peak)


# ---- one rank ----------------------------------------------------------------------------------


def _pipeline_rank(rank: int, world: int, cfg: PipelineBenchConfig, device: str) -> dict:
    from .conformance import load_package

    lib = load_package(cfg.backend)
    dev = torch.device(device)
    return {
        f"{name}/{variant}": _bench_variant(lib, name, variant, cfg, rank, world, dev)
        for name in cfg.schedules
        for variant in _VARIANTS
    }


def _bench_variant(lib, name: str, variant: str, cfg, rank: int, world: int, dev) -> dict:
    """One schedule, one variant, on this rank: a warm-up step, the timed steps, and a profiled
    step for the allocator deltas."""
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    from .pipeline import dw_builder

    dtype = getattr(torch, cfg.dtype)
    num_stages, n_mb = cfg.stages(name), cfg.n_microbatches(name)
    indices = _stage_layout(name, rank, world)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n_mb * cfg.rows, cfg.hidden, generator=gen).to(dev, dtype)
    target = torch.randn(n_mb * cfg.rows, cfg.hidden, generator=gen).to(dev, dtype)
    first, last = 0 in indices, num_stages - 1 in indices
    modules = {i: _build_stage(lib, variant, i, cfg, num_stages, dev) for i in indices}
    recorder = _Recorder(dev)
    stages = []
    for i in indices:
        extra = {"dw_builder": dw_builder(modules[i])} if variant == "splitgrad" else {}
        stage = PipelineStage(modules[i], i, num_stages, dev, **extra)
        recorder.wrap(stage, i)
        stages.append(stage)
    schedule = getattr(schedules, SCHEDULE_ALIASES[name])(
        stages if len(stages) > 1 else stages[0],
        n_mb,
        loss_fn=lambda out, tgt: torch.nn.functional.mse_loss(out.float(), tgt.float()),
    )
    losses_seen: list[float] = []

    def one_step(profile: bool) -> tuple[list[dict], float]:
        for m in modules.values():
            m.zero_grad(set_to_none=False)
        recorder.memory = profile
        losses: list[torch.Tensor] = []
        dist.barrier()
        prof = None
        if profile and dev.type != "cuda":
            prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
            )
            with _quiet_stderr():
                prof.__enter__()
        quiet = _quiet_stderr() if prof is not None else contextlib.nullcontext()
        recorder.start_step()
        t0 = time.perf_counter()
        with quiet:  # the CPU allocator warns on frees of blocks from before profiling
            schedule.step(
                *((x,) if first else ()),
                target=target if last else None,
                losses=losses if last else None,
            )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
        if prof is not None:
            with _quiet_stderr():
                prof.__exit__(None, None, None)
            deltas = {
                e.name.split(":", 1)[1]: e.cpu_memory_usage
                for e in prof.events()
                if e.name.startswith("splitgrad-action:")
            }
            for s in recorder.spans:
                s["bytes"] = deltas[f"{s['kind']}{s['stage']}.{s['mb']}"]
        if variant == "splitgrad":
            left = {
                f"stage {i}/{sm.name or 'module'}": sm.module.pending_wgrad_count
                for i, m in modules.items()
                for sm in split_modules(m)
                if sm.module.pending_wgrad_count
            }
            if left:
                raise RuntimeError(f"{name}: entries left pending after step(): {left}")
        if losses:
            losses_seen.append(float(torch.stack([v.detach() for v in losses]).mean()))
        return recorder.step_spans(), wall

    one_step(False)  # warm-up: shape inference, first allocation of .grad
    steps = []
    for _ in range(cfg.steps):
        spans, wall = one_step(False)
        steps.append({"wall": wall, "busy": sum(s["t1"] - s["t0"] for s in spans), "spans": spans})
    mem_spans, _ = one_step(True)
    return {
        "steps": steps,
        "held": _held_between_b_and_w(mem_spans),
        "act_peak": _activation_peak(mem_spans),
        "loss": losses_seen[-1] if losses_seen else None,
        "actions": sorted({s["kind"] for s in mem_spans}),
    }


# ---- summarising ---------------------------------------------------------------------------


def _summarise(cfg: PipelineBenchConfig, per_rank: list[dict]) -> list[dict]:
    rows = []
    for name in cfg.schedules:
        for variant in _VARIANTS:
            key = f"{name}/{variant}"
            ranks = [r[key] for r in per_rank]
            n_steps = len(ranks[0]["steps"])
            walls = [max(r["steps"][k]["wall"] for r in ranks) for k in range(n_steps)]
            bubbles = [
                statistics.median(1.0 - s["busy"] / s["wall"] for s in r["steps"]) for r in ranks
            ]
            helds = [r["held"] for r in ranks]
            loss = next((r["loss"] for r in ranks if r["loss"] is not None), None)
            rows.append(
                {
                    "schedule": name,
                    "variant": variant,
                    "step_s": statistics.median(walls),
                    "bubble": bubbles,
                    "held_mib": None
                    if all(h is None for h in helds)
                    else max((h or 0.0) for h in helds) / _MIB,
                    "act_peak_mib": max(r["act_peak"] for r in ranks) / _MIB,
                    "loss": loss,
                    "actions": "".join(k for k in "FBIW" if k in ranks[0]["actions"]),
                }
            )
    return rows


def _print_pipeline(cfg: PipelineBenchConfig, rows: list[dict], device: str, world: int) -> None:
    print(
        f"splitgrad pipeline: {world} ranks ({device}), {cfg.layers} LayerNormMLP layers "
        f"{cfg.hidden}->{cfg.ffn}->{cfg.hidden} ({cfg.dtype}), {cfg.rows} rows per micro-batch, "
        f"backend {cfg.backend}; median of {cfg.steps} steps after one warm-up"
    )
    print(
        "  bubble = share of the step a rank spends outside its F/B/I/W actions; held B->W = "
        "peak memory kept for W actions not yet run"
    )
    header = (
        f"  {'schedule':<17}{'variant':<11}{'actions':<9}{'step ms':>9}{'vs torch':>10}"
        f"{'bubble per rank':>24}{'held B->W MiB':>15}{'act. peak MiB':>15}  loss"
    )
    print(header)
    by_key = {(r["schedule"], r["variant"]): r for r in rows}
    for r in rows:
        twin = by_key[(r["schedule"], "torch")]
        ratio = r["step_s"] / twin["step_s"]
        bubble = " ".join(f"{b:.0%}" for b in r["bubble"])
        held = "-" if r["held_mib"] is None else f"{r['held_mib']:.2f}"
        loss = "-" if r["loss"] is None else f"{r['loss']:.6g}"
        print(
            f"  {r['schedule']:<17}{r['variant']:<11}{r['actions']:<9}"
            f"{r['step_s'] * 1e3:>9.1f}{ratio:>10.2f}{bubble:>24}{held:>15}"
            f"{r['act_peak_mib']:>15.2f}  {loss}"
        )
    for name in cfg.schedules:
        a, b = by_key[(name, "splitgrad")]["loss"], by_key[(name, "torch")]["loss"]
        if a is not None and b is not None:
            rel = abs(a - b) / max(abs(b), 1e-30)
            print(f"  {name}: splitgrad and torch.nn losses differ by {rel:.1e} (relative)")


def _write_timeline(path: str, cfg: PipelineBenchConfig, per_rank: list[dict]) -> None:
    """The last timed step of each schedule and variant, per rank: a Chrome/Perfetto trace for
    ``.json``, an image through matplotlib otherwise."""
    if path.endswith(".json"):
        events = []
        for pid, key in enumerate(f"{s}/{v}" for s in cfg.schedules for v in _VARIANTS):
            events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": key}})
            for rank, res in enumerate(per_rank):
                for s in res[key]["steps"][-1]["spans"]:
                    events.append(
                        {
                            "name": f"{s['kind']}{s['mb']} (stage {s['stage']})",
                            "cat": s["kind"],
                            "ph": "X",
                            "pid": pid,
                            "tid": rank,
                            "ts": s["t0"] * 1e6,
                            "dur": (s["t1"] - s["t0"]) * 1e6,
                            "args": {"stage": s["stage"]},
                        }
                    )
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [f"{s}/{v}" for s in cfg.schedules for v in _VARIANTS]
    colors = {"F": "tab:blue", "B": "tab:orange", "I": "tab:orange", "W": "tab:green"}
    fig, axes = plt.subplots(len(keys), 1, figsize=(12, 1.0 + 0.6 * len(per_rank) * len(keys)))
    for ax, key in zip(axes if len(keys) > 1 else [axes], keys):
        for rank, res in enumerate(per_rank):
            for s in res[key]["steps"][-1]["spans"]:
                ax.broken_barh(
                    [(s["t0"] * 1e3, (s["t1"] - s["t0"]) * 1e3)],
                    (rank - 0.4, 0.8),
                    color=colors[s["kind"]],
                )
                ax.text(
                    (s["t0"] + s["t1"]) / 2 * 1e3,
                    rank,
                    f"{s['kind']}{s['mb']}",
                    ha="center",
                    va="center",
                    fontsize=6,
                )
        ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- the expert-parallel overlap -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MoEBenchConfig:
    """``splitgrad moe``'s options (see ``splitgrad moe --help``)."""

    ranks: int = 2
    tokens: int = 2048
    hidden: int = 256
    local_experts: int = 2
    repeats: int = 10
    backend: str = "impl"
    threads: int = 1

    def validate(self) -> None:
        for name in ("ranks", "tokens", "hidden", "local_experts", "repeats", "threads"):
            if getattr(self, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be >= 1, got {getattr(self, name)}")


def _moe_rank(rank: int, world: int, cfg: MoEBenchConfig, device: str) -> dict:
    from .conformance import load_package
    from .expert_parallel import ExpertParallelMoE

    lib = load_package(cfg.backend)
    dev = torch.device(device)
    timeout = datetime.timedelta(seconds=120)
    experts = lib.GroupedLinear(
        cfg.local_experts, cfg.hidden, cfg.hidden, delay_wgrad_compute=True, device=dev
    )
    moe = ExpertParallelMoE(experts, overlap_backward_dw=False, timeout=timeout)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(cfg.tokens, cfg.hidden, generator=gen).to(dev)
    index = torch.randint(0, moe.num_experts, (cfg.tokens,), generator=gen).to(dev)
    # the dispatch all-to-all of the backward sends back the rows this rank received
    counts = torch.bincount(index, minlength=moe.num_experts)
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts)
    send = counts.view(world, -1).sum(1).tolist()
    recv = recv_counts.view(world, -1).sum(1).tolist()
    grad_rows = torch.randn(sum(recv), cfg.hidden, generator=gen).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def queue_entries() -> None:
        xi = x.detach().requires_grad_()
        moe(xi, index).sum().backward()
        if experts.pending_wgrad_count < 1:
            raise RuntimeError("the experts queued no wgrad entry: is delay_wgrad_compute on?")

    def start_a2a():
        out = torch.empty(sum(send), cfg.hidden, device=dev)
        return dist.all_to_all_single(out, grad_rows, send, recv, async_op=True)

    def drain() -> None:
        while experts.pending_wgrad_count:
            experts.backward_dw()

    def timed(mode: str) -> float:
        if mode != "a2a":
            queue_entries()
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        if mode == "a2a":
            start_a2a().wait(timeout)
        elif mode == "dw":
            drain()
        else:
            work = start_a2a()
            drain()
            work.wait(timeout)
        sync()
        return time.perf_counter() - t0

    for mode in ("a2a", "dw", "both"):  # warm-up
        timed(mode)
    times: dict[str, list[float]] = {"a2a": [], "dw": [], "both": []}
    for _ in range(cfg.repeats):  # interleaved, so drift hits the three alike
        for mode in times:
            times[mode].append(timed(mode))
    return {"times": times, "send_rows": sum(send), "recv_rows": sum(recv)}


def _print_moe(cfg: MoEBenchConfig, per_rank: list[dict], device: str, world: int) -> None:
    print(
        f"splitgrad moe: {world} ranks ({device}), {cfg.tokens} tokens x {cfg.hidden} per rank, "
        f"{cfg.local_experts} experts per rank (GroupedLinear, backend {cfg.backend}); "
        f"median of {cfg.repeats}, interleaved"
    )
    print("  hidden = (all-to-all alone + backward_dw alone - both overlapped) / all-to-all alone")
    print(
        f"  {'rank':<6}{'rows out':>9}{'a2a ms':>9}{'backward_dw ms':>16}{'both ms':>9}"
        f"{'sum ms':>9}{'a2a hidden':>12}"
    )
    for rank, res in enumerate(per_rank):
        med = {k: statistics.median(v) for k, v in res["times"].items()}
        hidden = (med["a2a"] + med["dw"] - med["both"]) / med["a2a"] if med["a2a"] else math.nan
        print(
            f"  {rank:<6}{res['recv_rows']:>9}{med['a2a'] * 1e3:>9.2f}{med['dw'] * 1e3:>16.2f}"
            f"{med['both'] * 1e3:>9.2f}{(med['a2a'] + med['dw']) * 1e3:>9.2f}"
            f"{min(max(hidden, 0.0), 1.0):>12.0%}"
        )


# ---- running: spawned gloo ranks, or under torchrun ----------------------------------------


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _world_size(requested: int | None) -> int:
    """``--ranks``, checked against torchrun's ``WORLD_SIZE`` when run under it."""
    if not _under_torchrun():
        return 2 if requested is None else requested
    world = int(os.environ["WORLD_SIZE"])
    if requested is not None and requested != world:
        raise ValueError(
            f"--ranks {requested} but torchrun started WORLD_SIZE={world} processes: drop "
            "--ranks or make them agree"
        )
    return world


def _run(fn, cfg, ranks: int, threads: int, timeout_s: float) -> tuple[list[dict], str, int]:
    """Per-rank results on this process's rank 0 (``None`` on the others under torchrun)."""
    if _under_torchrun():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s)
            )
        device = f"cuda:{torch.cuda.current_device()}" if cuda else "cpu"
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = fn(rank, world, cfg, device)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        backend = dist.get_backend()
        dist.destroy_process_group()
        return (gathered if rank == 0 else None), f"{backend}, {device.split(':')[0]}", world
    per_rank = run_ranks(
        fn,
        ranks,
        cfg,
        "cpu",
        timeout_s=timeout_s,
        collective_timeout_s=min(timeout_s, 300.0),
        threads_per_rank=threads,
    )
    return per_rank, f"gloo, cpu, {threads} thread(s) each", ranks


def run_pipeline_bench(cfg: PipelineBenchConfig, timeout_s: float = 1800.0):
    """Per-schedule rows (see :func:`_summarise`) and the raw per-rank records."""
    cfg.validate()
    per_rank, device, world = _run(_pipeline_rank, cfg, cfg.ranks, cfg.threads, timeout_s)
    if per_rank is None:
        return None, None, device, world
    return _summarise(cfg, per_rank), per_rank, device, world


def run_moe_bench(cfg: MoEBenchConfig, timeout_s: float = 900.0):
    cfg.validate()
    return _run(_moe_rank, cfg, cfg.ranks, cfg.threads, timeout_s)


# ---- command lines -------------------------------------------------------------------------


def _add_run_options(p: argparse.ArgumentParser, what: str, timeout_s: float) -> None:
    """The options both commands share: where the ranks come from and what runs on them."""
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"{what} ranks to spawn (default: 2; under torchrun, its WORLD_SIZE)",
    )
    p.add_argument(
        "--backend",
        default="impl",
        help="impl, reference, module:NAME, NAME:ATTR or path:DIR (default: impl)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per spawned rank (default: 1)"
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=timeout_s,
        help=f"seconds before the run fails ({timeout_s:.0f})",
    )


def _pipeline_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitgrad pipeline",
        description=(
            "Train a few steps of a stack of LayerNormMLP layers under torch.distributed."
            "pipelining schedules and print, per schedule, step time, the bubble fraction of "
            "each rank and the peak memory held between B and W: splitgrad's dw_builder and "
            "torch's own split (torch.nn twins, PipelineStage without dw_builder) side by side "
            "in one run. Spawns gloo ranks on this machine, or runs under torchrun (NCCL on "
            "GPUs)."
        ),
    )
    p.add_argument(
        "--schedule",
        default="all",
        help=f"comma-separated subset of {', '.join(SCHEDULE_ALIASES)}, or all (default: all)",
    )
    _add_run_options(p, "pipeline", 1800.0)
    p.add_argument("--layers", type=int, default=8, help="LayerNormMLP layers (default: 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--ffn", type=int, default=0, help="ffn size (default: 4 x hidden)")
    p.add_argument("--rows", type=int, default=64, help="tokens per micro-batch (default: 64)")
    p.add_argument(
        "--microbatches", type=int, default=0, help="micro-batches per step (default: 2 x stages)"
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up (default: 3)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    p.add_argument(
        "--timeline",
        default=None,
        metavar="PATH",
        help="write each rank's F/B/I/W actions of the last step: PATH.json is a Chrome/Perfetto "
        "trace; any other suffix an image (needs matplotlib)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    return p


def pipeline_main(argv: list[str] | None = None) -> int:
    args = _pipeline_parser().parse_args(argv)
    names = (
        list(SCHEDULE_ALIASES)
        if args.schedule == "all"
        else [s.strip() for s in args.schedule.split(",") if s.strip()]
    )
    try:
        ranks = _world_size(args.ranks)
    except ValueError as exc:
        print(f"splitgrad pipeline: {exc}", file=sys.stderr)
        return 2
    cfg = PipelineBenchConfig(
        schedules=tuple(names),
        ranks=ranks,
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn or 4 * args.hidden,
        rows=args.rows,
        microbatches=args.microbatches,
        steps=args.steps,
        backend=args.backend,
        dtype=args.dtype,
        threads=args.threads,
    )
    try:
        cfg.validate()
        if args.timeline and not args.timeline.endswith(".json"):
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError(
                    f"--timeline {args.timeline} is an image and needs matplotlib "
                    "(pip install matplotlib); a .json path writes a Chrome/Perfetto trace "
                    "without it"
                ) from None
    except ValueError as exc:
        print(f"splitgrad pipeline: {exc}", file=sys.stderr)
        return 2
    try:
        rows, per_rank, device, world = run_pipeline_bench(cfg, timeout_s=args.timeout)
    except RankFailure as exc:
        print(f"splitgrad pipeline: {exc}", file=sys.stderr)
        return 1
    if rows is None:
        return 0  # a torchrun rank other than 0
    _print_pipeline(cfg, rows, device, world)
    if args.timeline:
        _write_timeline(args.timeline, cfg, per_rank)
        print(f"  timeline of the last step: {args.timeline}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": dataclasses.asdict(cfg), "device": device, "rows": rows}, f)
    return 0


def _moe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitgrad moe",
        description=(
            "Measure how much of the expert-parallel layer's dispatch all-to-all (backward) is "
            "hidden behind the experts' backward_dw(): each alone and both overlapped, in one "
            "run. Spawns gloo ranks, or runs under torchrun (NCCL on GPUs)."
        ),
    )
    _add_run_options(p, "expert-parallel", 900.0)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (default: 2048)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--local-experts", type=int, default=2, help="experts per rank (default: 2)")
    p.add_argument("--repeats", type=int, default=10, help="measurements per mode (default: 10)")
    return p


def moe_main(argv: list[str] | None = None) -> int:
    args = _moe_parser().parse_args(argv)
    try:
        ranks = _world_size(args.ranks)
    except ValueError as exc:
        print(f"splitgrad moe: {exc}", file=sys.stderr)
        return 2
    cfg = MoEBenchConfig(
        ranks=ranks,
        tokens=args.tokens,
        hidden=args.hidden,
        local_experts=args.local_experts,
        repeats=args.repeats,
        backend=args.backend,
        threads=args.threads,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"splitgrad moe: {exc}", file=sys.stderr)
        return 2
    try:
        per_rank, device, world = run_moe_bench(cfg, timeout_s=args.timeout)
    except RankFailure as exc:
        print(f"splitgrad moe: {exc}", file=sys.stderr)
        return 1
    if per_rank is not None:
        _print_moe(cfg, per_rank, device, world)
    return 0
