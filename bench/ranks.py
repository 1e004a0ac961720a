"""Where the measuring commands' ranks come from: spawned gloo ranks on this machine
(:func:`splitgrad.distributed.run_ranks`), or the processes ``torchrun`` started (NCCL and one
GPU per rank when CUDA is available). The package they import is checked before any starts, by
:func:`splitgrad.properties.checks.distributed.preload_library`."""

from __future__ import annotations

import argparse
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from splitgrad.distributed import run_ranks
from splitgrad.properties.front.command_line import BACKEND_HELP, backend_spec

from .options import positive_float

__all__ = ["add_run_options", "world_size", "run", "under_torchrun"]


def add_run_options(p: argparse.ArgumentParser, what: str, timeout_s: float) -> None:
    """The options the rank-spawning commands share: where the ranks come from, what runs on
    them."""
    p.add_argument(
        "--ranks",
        type=int,
        default=None,
        help=f"{what} ranks to spawn (default: 2; under torchrun, its WORLD_SIZE)",
    )
    p.add_argument("--backend", type=backend_spec, default="impl", help=BACKEND_HELP)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads per spawned rank (default: 1)"
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=timeout_s,
        help=f"seconds before the run fails ({timeout_s:.0f})",
    )


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def world_size(requested: int | None) -> int:
    """``--ranks``, checked against torchrun's ``WORLD_SIZE`` when run under it."""
    if not under_torchrun():
        return 2 if requested is None else requested
    world = int(os.environ["WORLD_SIZE"])
    if requested is not None and requested != world:
        raise ValueError(
            f"--ranks {requested} but torchrun started WORLD_SIZE={world} processes: drop "
            "--ranks or make them agree"
        )
    return world


def run(fn, cfg, ranks: int, threads: int, timeout_s: float) -> tuple[list[dict], str, int]:
    """``fn(rank, world, cfg, device)`` on every rank: the per-rank results on this process's
    rank 0 (``None`` on the others under torchrun), the device in words, the world size."""
    if under_torchrun():
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
