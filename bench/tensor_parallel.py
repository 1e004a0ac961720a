"""Tensor parallelism (SPEC §9), measured: what one queued entry holds per rank at real scale,
which collectives run in which phase, and the step time of the two ``wgrad_gather`` modes.

``python -m splitgrad.bench.tensor_parallel memory [--markdown] [--json PATH] [--packages ...]
[--device fake|cuda]``

What a queued entry holds between B (``backward()``) and W (``backward_dw()``) depends only on
shapes, dtypes and options, so it is computed exactly on fake tensors, in one process, at shapes
no CPU could hold: hidden 8192, ffn 28672, 4096 tokens, ``tp_size`` 8, bf16, sequence parallel.
The TP group is torch's *fake* process group (``init_process_group("fake", ...)`` with a
``FakeStore``: every collective returns at once with the right shapes and moves no data; see
:func:`fake_process_group`), the tensors are ``FakeTensorMode``'s (sizes, no storage), and the
autograd engine runs as usual (fake CPU tensors). Per module and mode, rank 0 of 8:

* **held B->W**: after one delayed ``backward()``, with every reference the caller held dropped,
  the bytes of the storages still alive among those created since the forward began (a dispatch
  mode keeps a weak reference to each, as :mod:`.entry_memory` does), the ``.grad`` written in
  B (norm parameters) left out;
* **one entry**: the bytes of the distinct tensors the module's queued entry reaches (its
  closure or saved operands, parameters and the module itself left out) — must equal the held
  bytes (checked: nothing else outlives B);
* the **floor**: the wgrad operands as the GEMMs read them, per rank: x and dy of each GEMM with
  the sequence-parallel one gathered (a column layer's input, a row layer's ``dy``: ``tp``
  times the shard). ``wgrad_gather="backward_dw"`` keeps that one as the shard instead, below
  the floor, and gathers it inside ``backward_dw()``.

With ``--device cuda`` the same protocol runs on real CUDA tensors (still over the fake group)
and adds what the allocator grew by. ``backward_dw()`` itself is not run: in ``"backward_dw"``
mode it all-gathers, and the fake group delivers no data (the packages check the ranks' order
with a gathered tag first).

``python -m splitgrad.bench.tensor_parallel collectives [--markdown] [--packages impl]``

Which collectives a delayed TP module issues in its forward, ``backward()`` and
``backward_dw()``, in order, per module, sequence parallelism and ``wgrad_gather``: rank 0 of 2
spawned gloo ranks, every ``c10d`` operator seen by a dispatch mode, its shapes named by
distinct small sizes (s tokens per rank, S the sequence, h hidden, f ffn columns per rank).

``python -m splitgrad.bench.tensor_parallel time [--ranks 2] [--reps 20] [--layers ...]``

A stack of ``LayerNormMLP`` layers (``set_parallel_mode=True``, sequence parallel, delayed)
trained on real ranks (gloo spawned here, or NCCL under ``torchrun``), once per
``wgrad_gather`` mode, with ``backward_dw()`` on every layer after ``backward()``; repetitions
interleave the modes (ABBA) so that both see the same machine, and every figure is a median of
the slowest rank's time, each ratio from the same run. The gradients of the two modes are
compared bitwise first (they must agree: the same values reach the same GEMMs).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import time
import types
from collections.abc import Iterator

import torch
import torch.distributed as dist
from splitgrad.distributed import _torch_private
from splitgrad.impl._torch_compat import dispatch_mode_base, fake_tensor_mode, storage_key

from . import ranks
from .entry_memory import _LiveStorages
from .options import positive_int

__all__ = [
    "TPScale",
    "TP_SCALE",
    "TP_KINDS",
    "GATHERS",
    "fake_process_group",
    "floor_bytes",
    "measure",
    "memory_rows",
    "markdown",
    "collective_rows",
    "collectives_markdown",
    "TimingConfig",
    "run_timing",
    "timing_text",
    "main",
]


@dataclasses.dataclass(frozen=True)
class TPScale:
    """The memory table's shapes: hidden and ffn sizes (global), tokens of one micro-batch's
    sequence (global; ``tokens / tp`` per rank under SP), and the TP size."""

    hidden: int = 8192
    ffn: int = 28672
    tokens: int = 4096
    tp: int = 8


TP_SCALE = TPScale()
#: The table's rows: the parallel modules of SPEC §9 as a transformer uses them.
TP_KINDS = ("Linear column", "Linear row", "LayerNormLinear column", "LayerNormMLP swiglu")
GATHERS = ("backward", "backward_dw")
PACKAGES = ("reference", "impl")


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[object]:
    """The default process group, for the block: torch's fake one, ``world_size`` ranks of which
    this process is ``rank``; its collectives return at once with the right shapes and move no
    data. Its store and backend are private torch, fenced in
    :func:`splitgrad.distributed._torch_private.fake_store` (which names the torch versions it
    was checked on and raises when they moved). Refuses (``RuntimeError``) a process whose
    default group is already initialized."""
    if dist.is_initialized():
        raise RuntimeError(
            "fake_process_group: torch.distributed is already initialized in this process "
            f"(backend {dist.get_backend()!r}); the fake group needs a process of its own"
        )
    store = _torch_private.fake_store()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=store)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


# ---- memory ---------------------------------------------------------------------------------


def _operands(kind: str, s: TPScale) -> list[tuple[int, int, bool]]:
    """(rows, columns, sequence-parallel) of every wgrad operand one rank's entry needs, at the
    full sequence; a sequence-parallel operand is what SP splits across the ranks (a column
    GEMM's input, a row GEMM's ``dy``)."""
    t, h, f = s.tokens, s.hidden, s.ffn // s.tp
    if kind in ("Linear column", "LayerNormLinear column"):
        return [(t, h, True), (t, f, False)]  # x (ln_out), dy
    if kind == "Linear row":
        return [(t, f, False), (t, h, True)]  # x, dy
    # swiglu: fc1 writes [gate; up], 2 f columns per rank; fc2 reads act_out (f) and dy
    return [(t, h, True), (t, 2 * f, False), (t, f, False), (t, h, True)]


def floor_bytes(kind: str, wgrad_gather: str, s: TPScale = TP_SCALE) -> int:
    """The bf16 wgrad operands per rank (see the module docstring); with ``"backward_dw"`` the
    sequence-parallel ones as this rank's shard."""
    total = 0
    for rows, cols, sp in _operands(kind, s):
        if sp and wgrad_gather == "backward_dw":
            rows //= s.tp
        total += 2 * rows * cols
    return total


def _build(
    lib,
    kind: str,
    s: TPScale,
    group,
    wgrad_gather: str,
    sp: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | None = None,
) -> torch.nn.Module:
    kw = dict(
        params_dtype=dtype,
        device=device,
        delay_wgrad_compute=True,
        tp_group=group,
        sequence_parallel=sp,
        wgrad_gather=wgrad_gather,
    )
    if kind == "Linear column":
        return lib.Linear(s.hidden, s.ffn, parallel_mode="column", **kw)
    if kind == "Linear row":
        return lib.Linear(s.ffn, s.hidden, parallel_mode="row", **kw)
    if kind == "LayerNormLinear column":
        return lib.LayerNormLinear(s.hidden, s.ffn, parallel_mode="column", **kw)
    return lib.LayerNormMLP(s.hidden, s.ffn, activation="swiglu", set_parallel_mode=True, **kw)


def _input_shape(kind: str, s: TPScale) -> tuple[int, int]:
    """A row layer's input is the previous column layer's output: every token, this rank's
    feature columns; the others take this rank's shard of the sequence."""
    if kind == "Linear row":
        return s.tokens, s.ffn // s.tp
    return s.tokens // s.tp, s.hidden


def _queued_entries(module: torch.nn.Module) -> list:
    """The module's queued entries: impl's ``_wgrad_store``, the reference's ``_wgrad_queue``."""
    for name in ("_wgrad_store", "_wgrad_queue"):
        if hasattr(module, name):
            return list(getattr(module, name))
    raise TypeError(f"{type(module).__name__} has no wgrad queue this measurement knows")


_ATOMS = (str, bytes, int, float, bool, type(None), type, types.ModuleType, types.CodeType)


def _entry_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages the module's queued entries reach: through closures'
    cells, containers and objects' attributes, not through modules, parameters, functions'
    globals or process groups (what the entry refers to without holding it for W)."""
    seen: set[int] = set()
    storages: dict[int, int] = {}
    stack = _queued_entries(module)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.nn.Module, torch.nn.Parameter, dist.ProcessGroup)):
            continue
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            storages[storage_key(storage)] = storage.nbytes()
        elif isinstance(obj, types.FunctionType):
            stack.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
            stack.extend(obj.__defaults__ or ())
        else:
            stack.extend(gc.get_referents(obj))
    return sum(storages.values())


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _package(name: str):
    import importlib

    return importlib.import_module(f"splitgrad.{name}")


def measure(
    package: str,
    kind: str,
    wgrad_gather: str,
    group,
    s: TPScale = TP_SCALE,
    device: str = "fake",
) -> dict:
    """One row, on the fake group ``group`` (rank 0 of ``s.tp``): on fake tensors
    (``device="fake"``), or on real ones (``"cpu"``, ``"cuda"``: the collectives still move
    nothing, the values of what they return are whatever the memory held; the GPU adds
    ``allocated_bytes``, the allocator's growth over B less the gradients B wrote)."""
    lib = _package(package)
    fake = device == "fake"
    dev = torch.device("cpu" if fake else device)
    with fake_tensor_mode() if fake else contextlib.nullcontext():
        module = _build(lib, kind, s, group, wgrad_gather, device=dev)
        if module._tp is None or module._tp.size != s.tp:
            raise RuntimeError(f"{package} {kind}: built without tensor parallelism")
        cuda = dev.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        with _LiveStorages() as live:
            x = torch.empty(*_input_shape(kind, s), dtype=torch.bfloat16, device=dev)
            if not fake:
                x.normal_()
            y = module(x.requires_grad_())
            dy = torch.empty_like(y) if fake else torch.randn_like(y)
            y.backward(dy)
            del x, y, dy
            grads = tuple(p.grad for p in module.parameters() if p.grad is not None)
            held = live.alive_bytes(leave_out=grads)
        row = {
            "package": package,
            "module": kind,
            "wgrad_gather": wgrad_gather,
            "entry_bytes": _entry_bytes(module),
            "held_bytes": held,
            "floor_bytes": floor_bytes(kind, "backward", s),
            "shard_floor_bytes": floor_bytes(kind, "backward_dw", s),
            "pending": module.pending_wgrad_count,
        }
        if cuda:
            torch.cuda.synchronize()
            written = sum(g.untyped_storage().nbytes() for g in grads)
            row["allocated_bytes"] = torch.cuda.memory_allocated() - before - written
        del module
    return row


def memory_rows(
    s: TPScale = TP_SCALE,
    packages: tuple[str, ...] = PACKAGES,
    kinds: tuple[str, ...] = TP_KINDS,
    gathers: tuple[str, ...] = GATHERS,
    device: str = "fake",
) -> list[dict]:
    """Every (package, module, mode) row, on one fake group of ``s.tp`` ranks."""
    with fake_process_group(s.tp) as group:
        return [
            measure(p, k, g, group, s, device) for p in packages for k in kinds for g in gathers
        ]


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(table: list[dict], s: TPScale = TP_SCALE) -> str:
    """The table as Markdown (docs/figures.md's)."""
    lines = [
        f"hidden {s.hidden}, ffn {s.ffn}, {s.tokens} tokens ({s.tokens // s.tp} per rank), "
        f"tp {s.tp}, sequence parallel; MiB per rank; one delayed backward() of bf16 parameters",
        "",
        "| package | module | wgrad_gather | one entry | held B->W | floor | held / floor "
        "| collective in W |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for r in table:
        in_w = "all-gather" if r["wgrad_gather"] == "backward_dw" else "none"
        lines.append(
            f"| {r['package']} | {r['module']} | {r['wgrad_gather']} | "
            f"{_mib(r['entry_bytes'])} | {_mib(r['held_bytes'])} | {_mib(r['floor_bytes'])} | "
            f"{r['held_bytes'] / r['floor_bytes']:.3f} | {in_w} |"
        )
    return "\n".join(lines)


# ---- which collectives run where -------------------------------------------------------------

#: Sizes of the collectives table's run (2 ranks): each dimension distinct, so that a shape names
#: what it is: s tokens per rank, S = 2 s the sequence, h hidden, f ffn columns per rank.
_C_TOKENS, _C_HIDDEN, _C_FFN = 3, 8, 20
_C_SYMBOLS = {3: "s", 6: "S", 8: "h", 10: "f"}
#: (module, sequence_parallel, wgrad_gather) rows of the collectives table.
COLLECTIVE_CASES = tuple(
    (kind, sp, gather)
    for kind in TP_KINDS
    for sp, gather in ((True, "backward"), (True, "backward_dw"), (False, "backward"))
)


class _CollectiveLog(dispatch_mode_base()):
    """Every ``c10d`` operator called inside the block, in words."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "c10d":
            self.calls.append(_describe(func.__name__.split(".")[0], args))
        return out


def _dims(t: torch.Tensor) -> str:
    try:
        return "×".join(_C_SYMBOLS[n] for n in t.shape)
    except KeyError:
        raise RuntimeError(f"collectives table: unexpected shape {tuple(t.shape)}") from None


def _describe(op: str, args) -> str:
    """``all-gather s×h→S×h`` and the like; the 16-byte order check gather is ``order tag``."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    if tensors and tensors[0].dtype == torch.int64:
        return "order tag"
    if op == "_allgather_base_":
        return f"all-gather {_dims(tensors[1])}→{_dims(tensors[0])}"
    if op == "_reduce_scatter_base_":
        return f"reduce-scatter {_dims(tensors[1])}→{_dims(tensors[0])}"
    if op == "allreduce_":
        return f"all-reduce {_dims(tensors[0])}"
    return op


def _collectives_rank(rank: int, world: int, packages: tuple[str, ...]) -> list[dict]:
    group = dist.group.WORLD
    rows = []
    for package in packages:
        lib = _package(package)
        for kind, sp, gather in COLLECTIVE_CASES:
            torch.manual_seed(0)
            s = TPScale(hidden=_C_HIDDEN, ffn=_C_FFN, tokens=2 * _C_TOKENS, tp=world)
            module = _build(lib, kind, s, group, gather, sp, torch.float32)
            rows_in, cols = _input_shape(kind, s)
            if not sp and kind != "Linear row":
                rows_in = s.tokens
            x = torch.randn(rows_in, cols, requires_grad=True)
            phases = {}
            with _CollectiveLog() as log:
                y = module(x)
            phases["forward"] = log.calls
            with _CollectiveLog() as log:
                y.backward(torch.randn_like(y))
            phases["backward"] = log.calls
            with _CollectiveLog() as log:
                module.backward_dw()
            phases["backward_dw"] = log.calls
            rows.append(
                {
                    "package": package,
                    "module": kind,
                    "sequence_parallel": sp,
                    "wgrad_gather": gather,
                    **phases,
                }
            )
    return rows


def collective_rows(packages: tuple[str, ...] = ("impl",), timeout_s: float = 300.0) -> list[dict]:
    """Per package and :data:`COLLECTIVE_CASES` row, the collectives rank 0 of 2 spawned gloo
    ranks issues in forward, ``backward()`` and ``backward_dw()`` of a delayed module, in order
    (both ranks issue the same ones)."""
    from splitgrad.distributed import run_ranks

    per_rank = run_ranks(_collectives_rank, 2, packages, timeout_s=timeout_s)
    if per_rank[0] != per_rank[1]:
        raise RuntimeError("collectives table: the two ranks issued different collectives")
    return per_rank[0]


def collectives_markdown(table: list[dict]) -> str:
    """The collectives table as Markdown (docs/tensor-parallel.md's)."""
    lines = [
        "2 ranks; s tokens per rank, S = 2 s the sequence, h hidden, f = ffn / tp "
        "(LayerNormMLP: swiglu, whose fc1 has 2 f rows per rank); one delayed step",
        "",
        "| package | module | SP | wgrad_gather | forward | backward() | backward_dw() |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        cells = ["; ".join(r[p]) or "—" for p in ("forward", "backward", "backward_dw")]
        lines.append(
            f"| {r['package']} | {r['module']} | {'yes' if r['sequence_parallel'] else 'no'} | "
            f"{r['wgrad_gather'] if r['sequence_parallel'] else '—'} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


# ---- step time ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """``time``'s options: a stack of ``layers`` ``LayerNormMLP`` (``hidden`` -> ``ffn``, gelu),
    ``tokens`` per step in all (``tokens / ranks`` per rank), ``reps`` timed steps per mode
    after ``warmup``."""

    ranks: int = 2
    layers: int = 4
    hidden: int = 256
    ffn: int = 1024
    tokens: int = 2048
    reps: int = 20
    warmup: int = 3
    dtype: str = "float32"
    backend: str = "impl"
    threads: int = 1

    def validate(self) -> None:
        if self.tokens % self.ranks or self.ffn % self.ranks:
            raise ValueError(
                f"--tokens {self.tokens} and --ffn {self.ffn} must be multiples of --ranks "
                f"{self.ranks} (sequence parallel splits the tokens, column layers the ffn)"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--dtype must be float32 or bfloat16, got {self.dtype!r}")


def _stack(lib, cfg: TimingConfig, mode: str, device: str) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same weights in both modes and on every rank
    return torch.nn.Sequential(
        *(
            lib.LayerNormMLP(
                cfg.hidden,
                cfg.ffn,
                set_parallel_mode=True,
                sequence_parallel=True,
                tp_group=dist.group.WORLD,
                wgrad_gather=mode,
                delay_wgrad_compute=True,
                params_dtype=getattr(torch, cfg.dtype),
                device=device,
            )
            for _ in range(cfg.layers)
        )
    )


def _timing_rank(rank: int, world: int, cfg: TimingConfig, device: str) -> dict:
    from splitgrad.properties.checks.distributed import load_library

    lib = load_library(cfg.backend)
    dtype = getattr(torch, cfg.dtype)
    stacks = {mode: _stack(lib, cfg, mode, device) for mode in GATHERS}
    gen = torch.Generator().manual_seed(1 + rank)
    rows = cfg.tokens // world
    x = torch.randn(rows, cfg.hidden, generator=gen).to(device=device, dtype=dtype)
    dy = torch.randn(rows, cfg.hidden, generator=gen).to(device=device, dtype=dtype)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(mode: str) -> tuple[float, float]:
        stack = stacks[mode]
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        stack(x.detach().requires_grad_()).backward(dy)
        sync()
        t1 = time.perf_counter()
        for layer in reversed(stack):  # the order a backward queued them, on every rank
            layer.backward_dw()
        sync()
        return t1 - t0, time.perf_counter() - t1

    def held(mode: str) -> int:
        """Bytes alive between B and W for the whole stack (real tensors, one step)."""
        stack = stacks[mode]
        with _LiveStorages() as live:
            xi, dyi = x.detach().requires_grad_(), dy.clone()  # as if made in this step
            stack(xi).backward(dyi)
            del xi, dyi
            grads = tuple(p.grad for p in stack.parameters() if p.grad is not None)
            out = live.alive_bytes(leave_out=grads)
            # gloo's worker threads let go of a collective's tensors a moment after wait()
            # returns (more so on a loaded machine): read again until two readings agree.
            for _ in range(100):
                time.sleep(0.01)
                again = live.alive_bytes(leave_out=grads)
                if again == out:
                    break
                out = again
        for layer in reversed(stack):
            layer.backward_dw()
        return out

    # Both modes feed the same values to the same GEMMs: their gradients agree bitwise.
    for mode in GATHERS:
        stacks[mode].zero_grad(set_to_none=True)
        step(mode)
    mismatched = [
        name
        for (name, a), b in zip(
            stacks["backward"].named_parameters(), stacks["backward_dw"].parameters()
        )
        if not torch.equal(a.grad, b.grad)
    ]
    held_bytes = {mode: held(mode) for mode in GATHERS}
    for _ in range(cfg.warmup):
        for mode in GATHERS:
            step(mode)
    times: dict[str, list[tuple[float, float]]] = {mode: [] for mode in GATHERS}
    for i in range(cfg.reps):
        for mode in GATHERS if i % 2 == 0 else GATHERS[::-1]:
            times[mode].append(step(mode))
    return {"times": times, "mismatched": mismatched, "held": held_bytes}


def run_timing(cfg: TimingConfig, timeout_s: float = 600.0) -> dict:
    """Run ``time`` and summarize: per mode the medians over repetitions of the slowest rank's
    B, W and B + W (ms), the ratios ``backward_dw`` / ``backward``, the bytes the stack held
    between B and W per rank, and the parameters whose gradients differ between the modes
    (none expected)."""
    cfg.validate()
    per_rank, where, world = ranks.run(_timing_rank, cfg, cfg.ranks, cfg.threads, timeout_s)
    if per_rank is None:  # a torchrun rank other than 0
        return {}
    out: dict = {"where": where, "ranks": world, "config": dataclasses.asdict(cfg), "modes": {}}
    for mode in GATHERS:
        slowest = [
            tuple(max(r["times"][mode][i][j] for r in per_rank) for j in (0, 1))
            for i in range(cfg.reps)
        ]
        b = statistics.median(t[0] for t in slowest)
        w = statistics.median(t[1] for t in slowest)
        total = statistics.median(t[0] + t[1] for t in slowest)
        out["modes"][mode] = {
            "b_ms": 1e3 * b,
            "w_ms": 1e3 * w,
            "step_ms": 1e3 * total,
            "held_bytes": max(r["held"][mode] for r in per_rank),
        }
    te, dw = out["modes"]["backward"], out["modes"]["backward_dw"]
    out["ratios"] = {k: dw[k] / te[k] for k in ("b_ms", "w_ms", "step_ms", "held_bytes")}
    out["mismatched"] = sorted({n for r in per_rank for n in r["mismatched"]})
    return out


def timing_text(result: dict) -> str:
    """``time``'s report as text."""
    c = result["config"]
    lines = [
        f"tensor parallel step time — {result['where']}, {result['ranks']} ranks; "
        f"{c['layers']} x LayerNormMLP {c['hidden']}->{c['ffn']} (set_parallel_mode, sequence "
        f"parallel, delayed), {c['tokens']} tokens, {c['dtype']}, {c['backend']}; median of "
        f"{c['reps']} interleaved reps, slowest rank",
        "wgrad_gather   B ms     W ms   B+W ms   held B->W MiB/rank",
    ]
    for mode, m in result["modes"].items():
        lines.append(
            f"{mode:<12} {m['b_ms']:7.2f}  {m['w_ms']:7.2f}  {m['step_ms']:7.2f}  "
            f"{m['held_bytes'] / 2**20:10.2f}"
        )
    r = result["ratios"]
    lines.append(
        f"backward_dw / backward: B {r['b_ms']:.2f}, W {r['w_ms']:.2f}, B+W "
        f"{r['step_ms']:.2f}, held {r['held_bytes']:.2f}"
    )
    bad = result["mismatched"]
    lines.append(
        "gradients of the two modes: " + ("bitwise equal" if not bad else f"DIFFER: {bad}")
    )
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``memory``: the table (``--markdown``); ``collectives``: which collectives run in forward,
    ``backward()`` and ``backward_dw()``; ``time``: the gloo (or torchrun) step times."""
    parser = argparse.ArgumentParser(
        prog="python -m splitgrad.bench.tensor_parallel",
        description="Tensor parallelism: entry memory at real scale (fake tensors) and the "
        "step time of the two wgrad_gather modes.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="bytes one queued entry holds per rank (fake tensors)")
    mem.add_argument("--packages", default=",".join(PACKAGES))
    mem.add_argument("--markdown", action="store_true")
    mem.add_argument("--device", choices=("fake", "cuda"), default="fake")
    mem.add_argument("--json", metavar="PATH")
    col = sub.add_parser("collectives", help="collectives per phase (2 gloo ranks)")
    col.add_argument("--packages", default="impl")
    col.add_argument("--markdown", action="store_true")
    tim = sub.add_parser("time", help="step time of wgrad_gather='backward' vs 'backward_dw'")
    ranks.add_run_options(tim, "gloo", 600.0)
    defaults = TimingConfig()
    for name in ("layers", "hidden", "ffn", "tokens", "reps", "warmup"):
        tim.add_argument(f"--{name}", type=positive_int, default=getattr(defaults, name))
    tim.add_argument("--dtype", choices=("float32", "bfloat16"), default=defaults.dtype)
    tim.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.command in ("memory", "collectives"):
        packages = tuple(p for p in args.packages.split(",") if p)
        bad = [p for p in packages if p not in PACKAGES]
        if bad or not packages:
            parser.error(f"--packages: unknown {bad}; choose from {PACKAGES}")
    if args.command == "collectives":
        rows = collective_rows(packages)
        print(collectives_markdown(rows) if args.markdown else json.dumps(rows, indent=2))
        return 0
    if args.command == "memory":
        if args.device == "cuda" and not torch.cuda.is_available():
            print(
                "tensor_parallel: --device cuda, but torch.cuda.is_available() is False",
                file=sys.stderr,
            )
            return 2
        table = memory_rows(packages=packages, device=args.device)
        print(markdown(table) if args.markdown else json.dumps(table, indent=2))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"scale": dataclasses.asdict(TP_SCALE), "rows": table}, f, indent=2)
        wrong = [r for r in table if r["held_bytes"] != r["entry_bytes"] or r["pending"] != 1]
        for r in wrong:
            print(
                f"tensor_parallel: {r['package']} {r['module']} {r['wgrad_gather']}: held "
                f"{r['held_bytes']} bytes between B and W, the entry {r['entry_bytes']} "
                f"(pending {r['pending']})",
                file=sys.stderr,
            )
        return 1 if wrong else 0
    cfg = TimingConfig(
        ranks=ranks.world_size(args.ranks),
        layers=args.layers,
        hidden=args.hidden,
        ffn=args.ffn,
        tokens=args.tokens,
        reps=args.reps,
        warmup=args.warmup,
        dtype=args.dtype,
        backend=args.backend,
        threads=args.threads,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        parser.error(str(exc))
    result = run_timing(cfg, args.timeout)
    if not result:
        return 0
    print(timing_text(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if result["mismatched"] else 0


if __name__ == "__main__":
    sys.exit(main())
