"""Run a campaign's cells in this process and one forked worker, reported in plan order. Cells
that draw the same cases stay together (:func:`~..oracle.truth.memo` keeps their truth), P9's
here, where its ``python -O`` subprocess started. A worker may draw other cases than one process
would (hypothesis draws from loaded modules' constants); each reproduce line still replays.
Ctrl-C stops the run here: the worker ignores SIGINT and is ended from this process."""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from splitgrad.impl import gemm_paths


def default_jobs(device: str = "cpu") -> int:
    """Two processes where two cores are free to this process and the cells run on the CPU
    (CUDA cannot be used in a forked process), else one."""
    if device != "cpu":
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    forks = "fork" in multiprocessing.get_all_start_methods()
    return 2 if cores >= 2 and forks else 1


def _cost(cell: Any) -> float:
    return 15.0 if cell.examples is None else float(cell.examples) + 4.0


def _split(cells: Sequence[Any]) -> tuple[list[int], list[int]]:
    """(this process's cell indices, the worker's), each in plan order: whole groups, the
    largest first to the less loaded side; P9's cells here."""
    groups: dict[tuple, list[int]] = {}
    for i, cell in enumerate(cells):
        group = (cell.kind, cell.dtype, cell.recipe_label, cell.path, cell.autocast)
        groups.setdefault(group, []).append(i)
    home = [i for i, c in enumerate(cells) if c.property_id == "P9"]
    load = [sum(_cost(cells[i]) for i in home), 0.0]
    sides: list[list[int]] = [list(home), []]
    for indices in sorted(groups.values(), key=lambda ix: -sum(_cost(cells[i]) for i in ix)):
        rest = [i for i in indices if i not in home]
        side = 0 if load[0] <= load[1] else 1
        sides[side].extend(rest)
        load[side] += sum(_cost(cells[i]) for i in rest)
    return sorted(sides[0]), sorted(sides[1])


def _worker(run: Callable[[Any], Any], cells: Sequence[Any], indices: list[int], conn) -> None:
    # A terminal's Ctrl-C reaches the whole process group: the main process ends this one and
    # reports what is done; a KeyboardInterrupt here would only race it with its own message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for i in indices:
            with gemm_paths.recording() as log:
                cell = run(cells[i])
            conn.send((i, cell, dict(log.counts)))
    except BaseException as exc:  # the harness itself failed: say so in the main process
        conn.send((None, repr(exc), None))
    finally:
        conn.close()


class CellResults:
    """``(index, run(cell))`` for every cell in plan order, as :func:`run_cells` yields them.
    ``unreported``: index -> result of the cells finished but not yielded (the worker's wait for
    the cells before them); once the iteration stopped early, all of those, the worker's last
    results read from its pipe."""

    def __init__(self, run: Callable[[Any], Any], cells: Sequence[Any], jobs: int) -> None:
        self.unreported: dict[int, Any] = {}
        self._results = self._generate(run, cells, jobs)

    def __iter__(self) -> CellResults:
        return self

    def __next__(self) -> tuple[int, Any]:
        return next(self._results)

    def close(self) -> None:
        """Stop early: the worker is ended, what it finished kept in :attr:`unreported`."""
        self._results.close()

    def _generate(self, run, cells: Sequence[Any], jobs: int) -> Iterator[tuple[int, Any]]:
        if jobs < 2 or len(cells) < 2:
            for i, cell in enumerate(cells):
                yield i, run(cell)
            return
        mine, theirs = _split(cells)
        ctx = multiprocessing.get_context("fork")
        receive, send = ctx.Pipe(duplex=False)
        worker = ctx.Process(target=_worker, args=(run, cells, theirs, send), daemon=True)
        worker.start()
        send.close()
        done, pending = self.unreported, set(theirs)
        try:
            nxt = 0
            for i in mine:
                done[i] = run(cells[i])
                while pending and receive.poll():
                    _receive(receive, done, pending)
                while nxt in done:
                    yield nxt, done.pop(nxt)
                    nxt += 1
            while nxt < len(cells):
                while nxt not in done:
                    _receive(receive, done, pending)
                yield nxt, done.pop(nxt)
                nxt += 1
        finally:
            if worker.is_alive():
                worker.terminate()
            worker.join()
            _drain(receive, done, pending)
            receive.close()


def run_cells(run: Callable[[Any], Any], cells: Sequence[Any], jobs: int = 1) -> CellResults:
    """``(index, run(cell))`` for every cell in plan order, shared with a forked worker when
    ``jobs >= 2``. Stopping early (``close()``, an exception, Ctrl-C) ends the worker; the cells
    finished but not yielded stay in :attr:`CellResults.unreported`."""
    return CellResults(run, cells, jobs)


def _drain(conn, done: dict[int, Any], pending: set[int]) -> None:
    """Read the results an ended worker had sent; a message cut short (Ctrl-C during ``recv``,
    the worker ended mid-send) stops the reading."""
    try:
        while pending and conn.poll():
            _receive(conn, done, pending)
    except Exception:  # a torn message: the results read before it are what is kept
        pass


def _receive(conn, done: dict[int, Any], pending: set[int]) -> None:
    try:
        i, cell, counts = conn.recv()
    except EOFError:
        raise RuntimeError(
            f"the campaign's worker process ended with {len(pending)} cell(s) left"
        ) from None
    if i is None:
        raise RuntimeError(f"the campaign's worker process failed: {cell}")
    for log in gemm_paths.RECORDERS:  # the worker's GEMM path decisions join this process's
        for decision, n in counts.items():
            log.counts[decision] = log.counts.get(decision, 0) + n
    done[i] = cell
    pending.discard(i)
