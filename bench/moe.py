"""``splitgrad moe``: how much of the expert-parallel layer's dispatch all-to-all the experts'
``backward_dw()`` hides, measured in one run: the all-to-all of the backward alone, the
experts' ``backward_dw()`` alone, and both as :class:`~splitgrad.distributed.ExpertParallelMoE`
runs them (the all-to-all in flight while ``backward_dw()`` computes).

It spawns gloo ranks on this machine, or runs under ``torchrun`` (NCCL on GPUs): :mod:`.ranks`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import statistics
import time

import torch
import torch.distributed as dist
from splitgrad.distributed import ExpertParallelMoE, RankFailure
from splitgrad.properties.checks.distributed import load_library, preload_library
from splitgrad.properties.front.command_line import USAGE_ERROR, run_error, usage_error

from . import ranks

__all__ = ["MoEBenchConfig", "run_moe_bench", "moe_main", "smoke_run"]


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
    lib = load_library(cfg.backend)
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


#: The sizes below whose defaults a run is a smoke run: the all-to-all and backward_dw() then
#: take tens of microseconds, where timer noise and scheduling decide the hidden share.
_SMOKE_FIELDS = ("tokens", "hidden", "repeats")


def smoke_run(cfg: MoEBenchConfig) -> list[str]:
    """Why ``cfg``'s figures are a smoke run, not measurements (empty: they are)."""
    defaults = {f.name: f.default for f in dataclasses.fields(MoEBenchConfig)}
    return [
        f"--{name} {getattr(cfg, name)} (default {defaults[name]})"
        for name in _SMOKE_FIELDS
        if getattr(cfg, name) < defaults[name]
    ]


def _print_moe(cfg: MoEBenchConfig, per_rank: list[dict], device: str, world: int) -> None:
    smoke = smoke_run(cfg)
    warning = (
        f"WARNING: smoke run ({', '.join(smoke)}): these times are too short to measure an "
        "overlap; the figures only show that everything runs and are not meant to be read"
    )
    if smoke:
        print(warning)
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
    if smoke:
        print(warning)


# ---- the command line ----------------------------------------------------------------------


def _moe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitgrad moe",
        description=(
            "Measure how much of the expert-parallel layer's dispatch all-to-all (backward) is "
            "hidden behind the experts' backward_dw(): each alone and both overlapped, in one "
            "run. Spawns gloo ranks, or runs under torchrun (NCCL on GPUs)."
        ),
    )
    ranks.add_run_options(p, "expert-parallel", 900.0)
    p.add_argument("--tokens", type=int, default=2048, help="tokens per rank (default: 2048)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default: 256)")
    p.add_argument("--local-experts", type=int, default=2, help="experts per rank (default: 2)")
    p.add_argument("--repeats", type=int, default=10, help="measurements per mode (default: 10)")
    return p


def run_moe_bench(cfg: MoEBenchConfig, timeout_s: float = 900.0):
    """The per-rank timings (``None`` on a torchrun rank other than 0), the device in words and
    the world size."""
    cfg.validate()
    return ranks.run(_moe_rank, cfg, cfg.ranks, cfg.threads, timeout_s)


def moe_main(argv: list[str] | None = None) -> int:
    """Entry point of ``splitgrad moe``."""
    parser = _moe_parser()
    args = parser.parse_args(argv)
    try:
        cfg = MoEBenchConfig(
            ranks=ranks.world_size(args.ranks),
            tokens=args.tokens,
            hidden=args.hidden,
            local_experts=args.local_experts,
            repeats=args.repeats,
            backend=args.backend,
            threads=args.threads,
        )
        cfg.validate()
    except ValueError as exc:
        return usage_error(parser, str(exc))
    try:
        preload_library(cfg.backend)
    except ValueError as exc:
        return run_error(parser.prog, str(exc), USAGE_ERROR)
    try:
        per_rank, device, world = run_moe_bench(cfg, timeout_s=args.timeout)
    except RankFailure as exc:
        return run_error(parser.prog, str(exc))
    if per_rank is not None:
        _print_moe(cfg, per_rank, device, world)
    return 0
