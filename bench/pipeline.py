"""``splitgrad pipeline``: what the split buys in a pipeline, measured.

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

It spawns gloo ranks on this machine, or runs under ``torchrun`` (NCCL and one GPU per rank
when CUDA is available): :mod:`.ranks`. The actions are recorded by :mod:`.actions`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch
import torch.distributed as dist
from splitgrad.distributed import RankFailure, dw_builder, split_modules
from splitgrad.properties.checks.distributed import load_library, preload_library, stage_layout
from splitgrad.properties.front.command_line import USAGE_ERROR, pick, run_error, usage_error

from . import ranks
from .actions import ActionRecorder, activation_peak, held_between_b_and_w
from .options import SCHEDULES, TORCH_SCHEDULE_NAMES, output_file, positive_int

__all__ = ["PipelineBenchConfig", "run_pipeline_bench", "pipeline_main", "smoke_run"]
_VARIANTS = ("splitgrad", "torch")
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
        pick("schedule", self.schedules or "", "schedule", SCHEDULES, everything=None)
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


# ---- one rank ----------------------------------------------------------------------------------


def _pipeline_rank(rank: int, world: int, cfg: PipelineBenchConfig, device: str) -> dict:
    lib = load_library(cfg.backend)
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

    dtype = getattr(torch, cfg.dtype)
    num_stages, n_mb = cfg.stages(name), cfg.n_microbatches(name)
    indices, _ = stage_layout(SCHEDULES[name], rank, world)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n_mb * cfg.rows, cfg.hidden, generator=gen).to(dev, dtype)
    target = torch.randn(n_mb * cfg.rows, cfg.hidden, generator=gen).to(dev, dtype)
    modules = {i: _build_stage(lib, variant, i, cfg, num_stages, dev) for i in indices}
    recorder = ActionRecorder(dev)
    stages = []
    for i in indices:
        extra = {"dw_builder": dw_builder(modules[i])} if variant == "splitgrad" else {}
        stage = PipelineStage(modules[i], i, num_stages, dev, **extra)
        recorder.wrap(stage, i)
        stages.append(stage)
    schedule = getattr(schedules, SCHEDULES[name])(
        stages if len(stages) > 1 else stages[0],
        n_mb,
        loss_fn=lambda out, tgt: torch.nn.functional.mse_loss(out.float(), tgt.float()),
    )
    losses_seen: list[float] = []

    def one_step(memory: bool) -> tuple[list[dict], float]:
        for m in modules.values():
            m.zero_grad(set_to_none=False)
        dist.barrier()
        spans, wall, losses = recorder.step(schedule, x, target, memory=memory)
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
        return spans, wall

    one_step(False)  # warm-up: shape inference, first allocation of .grad
    steps = []
    for _ in range(cfg.steps):
        spans, wall = one_step(False)
        steps.append({"wall": wall, "busy": sum(s["t1"] - s["t0"] for s in spans), "spans": spans})
    mem_spans, _ = one_step(True)
    return {
        "steps": steps,
        "held": held_between_b_and_w(mem_spans),
        "act_peak": activation_peak(mem_spans),
        "loss": losses_seen[-1] if losses_seen else None,
        "actions": sorted({s["kind"] for s in mem_spans}),
    }


# ---- summarising ---------------------------------------------------------------------------


def _summarise(cfg: PipelineBenchConfig, per_rank: list[dict]) -> list[dict]:
    rows = []
    for name in cfg.schedules:
        for variant in _VARIANTS:
            key = f"{name}/{variant}"
            results = [r[key] for r in per_rank]
            n_steps = len(results[0]["steps"])
            walls = [max(r["steps"][k]["wall"] for r in results) for k in range(n_steps)]
            bubbles = [
                statistics.median(1.0 - s["busy"] / s["wall"] for s in r["steps"]) for r in results
            ]
            helds = [r["held"] for r in results]
            loss = next((r["loss"] for r in results if r["loss"] is not None), None)
            rows.append(
                {
                    "schedule": name,
                    "variant": variant,
                    "step_s": statistics.median(walls),
                    "bubble": bubbles,
                    "held_mib": None
                    if all(h is None for h in helds)
                    else max((h or 0.0) for h in helds) / _MIB,
                    "act_peak_mib": max(r["act_peak"] for r in results) / _MIB,
                    "loss": loss,
                    "actions": "".join(k for k in "FBIW" if k in results[0]["actions"]),
                }
            )
    return rows


#: The sizes below whose defaults a run is a smoke run: its actions then take tens of
#: microseconds, where per-call overhead and scheduling decide the step times and bubbles.
_SMOKE_FIELDS = ("layers", "hidden", "ffn", "rows", "steps")


def smoke_run(cfg: PipelineBenchConfig) -> list[str]:
    """Why ``cfg``'s figures are a smoke run, not measurements (empty: they are)."""
    defaults = {f.name: f.default for f in dataclasses.fields(PipelineBenchConfig)}
    return [
        f"--{name} {getattr(cfg, name)} (default {defaults[name]})"
        for name in _SMOKE_FIELDS
        if getattr(cfg, name) < defaults[name]
    ]


def _print_pipeline(cfg: PipelineBenchConfig, rows: list[dict], device: str, world: int) -> None:
    smoke = smoke_run(cfg)
    warning = (
        f"WARNING: smoke run ({', '.join(smoke)}): these figures only show that every schedule "
        "runs; they are not measurements and are not meant to be read"
    )
    if smoke:
        print(warning)
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
    if smoke:
        print(warning)


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


# ---- command lines -------------------------------------------------------------------------


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
        help=f"comma-separated, of {', '.join(SCHEDULES)} or all (default: all)",
    )
    ranks.add_run_options(p, "pipeline", 1800.0)
    p.add_argument("--layers", type=int, default=8, help="LayerNormMLP layers (default: 8)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--ffn", type=positive_int, default=None, help="ffn size (default: 4 x hidden)")
    p.add_argument("--rows", type=int, default=64, help="tokens per micro-batch (default: 64)")
    p.add_argument(
        "--microbatches",
        type=positive_int,
        default=None,
        help="micro-batches per step (default: 2 x stages)",
    )
    p.add_argument("--steps", type=int, default=3, help="timed steps after a warm-up (default: 3)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (default: float32)")
    p.add_argument(
        "--timeline",
        type=output_file,
        default=None,
        metavar="PATH",
        help="write each rank's F/B/I/W actions of the last step: PATH.json is a Chrome/Perfetto "
        "trace; any other suffix an image (needs matplotlib)",
    )
    p.add_argument(
        "--json", type=output_file, default=None, metavar="PATH", help="also write the rows as JSON"
    )
    return p


def run_pipeline_bench(cfg: PipelineBenchConfig, timeout_s: float = 1800.0):
    """Per-schedule rows (see :func:`_summarise`), the raw per-rank records, the device in words
    and the world size (rows and records are ``None`` on a torchrun rank other than 0)."""
    cfg.validate()
    per_rank, device, world = ranks.run(_pipeline_rank, cfg, cfg.ranks, cfg.threads, timeout_s)
    if per_rank is None:
        return None, None, device, world
    return _summarise(cfg, per_rank), per_rank, device, world


def _config(args: argparse.Namespace) -> PipelineBenchConfig:
    """The run the command line asks for; ``ValueError`` naming a bad option."""
    names = pick("schedule", args.schedule, "schedule", SCHEDULES, TORCH_SCHEDULE_NAMES)
    cfg = PipelineBenchConfig(
        schedules=names,
        ranks=ranks.world_size(args.ranks),
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn or 4 * args.hidden,
        rows=args.rows,
        microbatches=args.microbatches or 0,
        steps=args.steps,
        backend=args.backend,
        dtype=args.dtype,
        threads=args.threads,
    )
    cfg.validate()
    if args.timeline and not args.timeline.endswith(".json"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--timeline {args.timeline}: an image timeline needs matplotlib (pip install "
                "matplotlib); a .json path writes a Chrome/Perfetto trace without it"
            ) from None
    return cfg


def pipeline_main(argv: list[str] | None = None) -> int:
    """Entry point of ``splitgrad pipeline``."""
    parser = _pipeline_parser()
    args = parser.parse_args(argv)
    try:
        cfg = _config(args)
    except ValueError as exc:
        return usage_error(parser, str(exc))
    try:
        preload_library(cfg.backend)
    except ValueError as exc:
        return run_error(parser.prog, str(exc), USAGE_ERROR)
    try:
        rows, per_rank, device, world = run_pipeline_bench(cfg, timeout_s=args.timeout)
    except RankFailure as exc:
        return run_error(parser.prog, str(exc))
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
