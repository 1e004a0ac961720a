"""Run a function on several local ranks with torch.distributed, and never hang.

:func:`run_ranks` spawns ``world_size`` processes, initializes a process group in each (gloo on
CPU by default, with a timeout on every collective), runs ``fn(rank, world_size, *args)`` and
returns what each rank returned. If a rank raises, every other rank is stopped and
:class:`RankFailure` carries each failed rank's traceback; if the whole run exceeds
``timeout_s`` (a rank stuck outside a collective), every rank is killed and ``RankFailure`` says
so. The tests use it; so can a project's own tests of its split-backward layers.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

__all__ = ["run_ranks", "RankFailure"]


class RankFailure(RuntimeError):
    """One or more ranks failed or the run timed out; ``tracebacks`` maps rank -> text."""

    def __init__(self, message: str, tracebacks: dict[int, str]) -> None:
        details = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__(message + details)
        self.tracebacks = tracebacks


def _entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    init_file: str,
    out_dir: str,
    backend: str,
    collective_timeout_s: float,
    threads: int,
) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    # The result is on disk before teardown, so a crash while tearing down is told apart.
    try:
        payload = pickle.dumps(outcome)
    except Exception as exc:  # e.g. fn returned a lambda or an open file
        outcome = ("error", f"rank {rank}: fn's result cannot be pickled back: {exc!r}")
        payload = pickle.dumps(outcome)
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        f.write(payload)
    # Objects that hold the process group (a DistributedDataParallel whose forward raised, kept
    # in a reference cycle) are freed now, not at interpreter exit after the group is gone: gloo
    # aborts the process ("terminate called without an active exception") in that order.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    if outcome[0] == "error":
        sys.exit(1)  # the parent sees the exit and stops the other ranks


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 300.0,
    collective_timeout_s: float = 60.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
) -> list[Any]:
    """``[fn(0, world_size, *args), ..., fn(world_size - 1, world_size, *args)]``, each on its
    own process in a fresh process group. ``fn`` and its results must be picklable (a
    module-level function; tensors are fine)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    with tempfile.TemporaryDirectory(prefix="splitgrad-ranks-") as tmp:
        init_file = os.path.join(tmp, "init")
        ctx = mp.start_processes(
            _entry,
            args=(
                fn,
                world_size,
                args,
                init_file,
                tmp,
                backend,
                collective_timeout_s,
                threads_per_rank,
            ),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        failure: str | None = None
        try:
            while not ctx.join(timeout=1.0):
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout_s:.0f} s"
                    break
        except ProcessException as exc:
            index, code = getattr(exc, "error_index", "?"), getattr(exc, "exit_code", "?")
            failure = f"rank {index} failed (exit code {code})"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
        results, tracebacks = [], {}
        for rank in range(world_size):
            path = os.path.join(tmp, f"rank{rank}.pkl")
            if not os.path.exists(path):
                tracebacks[rank] = "(no result: the rank was killed or died before finishing)"
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                tracebacks[rank] = value
            results.append(value if status == "ok" else None)
        if failure or tracebacks:
            raise RankFailure(failure or "ranks failed", tracebacks)
        return results
