"""``splitgrad bench``: speed and memory ratios of ``splitgrad.impl``, all measured in one run.

Per module (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear) and dtype (fp32, bf16), at
realistic shapes (default: 2048 tokens, hidden 1024, ffn 4096, 8 groups), each timing the median
of ``--reps`` repetitions, the variants of one repetition run back to back (interleaved) so a
noisy neighbour hurts all of them alike:

* ``split``   (backward + backward_dw) / non-delayed backward           target <= 1.03
* ``bare``    impl backward / the bare dgrad + wgrad ``torch.mm`` calls  target <= 1.10 (CPU,
  Linear; the other modules also run norm/activation kernels that the bare GEMMs do not)
* ``nn``      impl backward / the same layer from ``torch.nn`` + autograd target <= 1.0
* ``generic`` impl delayed / PyTorch's generic split
  (``stage_backward_input`` + ``stage_backward_weight``) on the ``torch.nn`` twin: time, peak
  memory, and the memory kept alive between the two halves
* ``grouped`` GroupedLinear ``torch._grouped_mm`` path / per-group loop (forward + backward)
* ``recompute`` LayerNormMLP recomputed / saved activation: backward time, memory kept from
  forward to backward
* ``fused``   peak memory of fused (fp32 ``main_grad``) / plain accumulation (prefilled ``.grad``)
* ``fp8``     per FP8 recipe, on a bf16 ``Linear`` (hidden -> ffn) with ``delay_wgrad_compute``:
  the time of ``backward_dw()`` (the wgrad GEMM) into ``.grad`` and into fp32 ``main_grad``, and
  the bytes one queued entry holds, each against the same module without FP8 (``--no-fp8``
  skips it)

Timings are forward-excluded: each repetition runs the forward untimed, then times the backward.
Memory is counted by a dispatch mode that tracks every storage an operator allocates until it is
freed (CPU has no allocator statistics); it sees every tensor an ATen op returns, not kernel
scratch space. Peak = most bytes alive at once above what existed before the measured step.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import splitgrad.impl as impl
import torch
from splitgrad.impl import _torch_compat, gemm_paths
from splitgrad.properties.front.command_line import USAGE_ERROR, pick, run_error
from torch.multiprocessing.reductions import StorageWeakRef

from .options import output_file, positive_int

__all__ = ["main", "run"]

TARGETS = {"split": 1.03, "bare": 1.10, "nn": 1.0}


# ---- measurement helpers ----------------------------------------------------------------


class PeakMemory(_torch_compat.dispatch_mode_base()):
    """Track bytes of storages allocated by ATen ops inside the block; ``peak`` is the maximum
    alive at once. Ops whose outputs alias an input (views, in-place, ``out=``) allocate
    nothing and are skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _sweep(self) -> None:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            self.current -= self.live.pop(key)[1]

    def alive_bytes(self) -> int:
        """Bytes still alive now (after a sweep)."""
        self._sweep()
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        if not _torch_compat.returns_alias(func):
            for t in _torch_compat.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if storage.nbytes() and key not in self.live:
                        self.live[key] = (StorageWeakRef(storage), storage.nbytes())
                        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


#: What :func:`_timed` reads: wall-clock time (``perf_counter``), or with ``--clock cpu`` the
#: CPU time of this process (``process_time``: every thread's, not the time spent waiting for a
#: core), which keeps a shared machine's other jobs out of the figures.
_clock = time.perf_counter


#: Where the bench runs (``--device``): its modules, inputs and gradients live there.
_DEVICE = "cpu"


def _timed(fn: Callable[[], object]) -> float:
    if _DEVICE == "cuda":
        torch.cuda.synchronize()  # time the work itself, not what was queued before
    start = _clock()
    fn()
    if _DEVICE == "cuda":
        torch.cuda.synchronize()
    return _clock() - start


# ---- the modules under test and their torch.nn twins ---------------------------------------


@dataclasses.dataclass
class Shapes:
    tokens: int
    hidden: int
    ffn: int
    groups: int
    even: bool = False

    def splits(self) -> list[int]:
        """Uneven, deterministic group sizes summing to ``tokens`` (MoE routing is uneven), or
        equal ones when ``even``."""
        if self.even:
            return [self.tokens // self.groups] * (self.groups - 1) + [
                self.tokens - (self.groups - 1) * (self.tokens // self.groups)
            ]
        weights = [3, 1, 2, 2.5, 1.5, 2, 2.25, 1.75][: self.groups] or [1]
        weights += [2] * (self.groups - len(weights))
        raw = [int(self.tokens * w / sum(weights)) for w in weights]
        raw[-1] += self.tokens - sum(raw)
        return raw


class _GroupedTwin(torch.nn.Module):
    def __init__(self, linears: list[torch.nn.Linear], splits: list[int]) -> None:
        super().__init__()
        self.linears = torch.nn.ModuleList(linears)
        self.splits = splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([lin(xi) for lin, xi in zip(self.linears, x.split(self.splits))])


def _build_impl(kind: str, s: Shapes, dtype: torch.dtype, delay: bool, fused: bool):
    kw = dict(params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    kw["device"] = _DEVICE
    if kind == "Linear":
        return impl.Linear(s.hidden, s.ffn, **kw)
    if kind == "LayerNormLinear":
        return impl.LayerNormLinear(s.hidden, s.ffn, **kw)
    if kind == "LayerNormMLP":
        return impl.LayerNormMLP(s.hidden, s.ffn, **kw)
    return impl.GroupedLinear(s.groups, s.hidden, s.ffn, **kw)


def _build_twin(kind: str, src, s: Shapes, dtype: torch.dtype) -> torch.nn.Module:
    """The same layer from ``torch.nn`` modules, with ``src``'s parameter values."""
    nn = torch.nn
    kw = {"dtype": dtype, "device": _DEVICE}

    def linear(weight, bias):
        lin = nn.Linear(weight.shape[1], weight.shape[0], **kw)
        lin.weight.data.copy_(weight.detach())
        lin.bias.data.copy_(bias.detach())
        return lin

    def norm():
        ln = nn.LayerNorm(s.hidden, eps=src.eps, **kw)
        ln.weight.data.copy_(src.layer_norm_weight.detach())
        ln.bias.data.copy_(src.layer_norm_bias.detach())
        return ln

    if kind == "Linear":
        return linear(src.weight, src.bias)
    if kind == "LayerNormLinear":
        return nn.Sequential(norm(), linear(src.weight, src.bias))
    if kind == "LayerNormMLP":
        return nn.Sequential(
            norm(),
            linear(src.fc1_weight, src.fc1_bias),
            nn.GELU(approximate="tanh"),
            linear(src.fc2_weight, src.fc2_bias),
        )
    lins = [linear(getattr(src, f"weight{i}"), getattr(src, f"bias{i}")) for i in range(s.groups)]
    return _GroupedTwin(lins, s.splits())


def _copy_params(dst, src) -> None:
    with torch.no_grad():
        for (_, p), (_, q) in zip(dst.named_parameters(), src.named_parameters()):
            p.copy_(q)


def _prefill(module, fused: bool) -> None:
    """Non-zero starting gradients (steady state of gradient accumulation)."""
    gemm_weights = set(module.gemm_weight_names()) if hasattr(module, "gemm_weight_names") else ()
    for name, p in module.named_parameters():
        if fused and name in gemm_weights:
            p.main_grad = torch.full(p.shape, 1e-3, dtype=torch.float32, device=p.device)
        else:
            p.grad = torch.full_like(p, 1e-3)


def _forward(module, x, splits):
    if isinstance(module, impl.GroupedLinear):
        return module(x, splits)
    if isinstance(_torch_compat.compiled_original(module), impl.GroupedLinear):
        return module(x, splits)
    return module(x)


def _bare_gemms(kind: str, module, x: torch.Tensor, dy: torch.Tensor, s: Shapes):
    """The dgrad and wgrad GEMMs of the layer's backward, nothing else (same shapes)."""
    with torch.no_grad():
        if kind in ("Linear", "LayerNormLinear"):
            w = module.weight

            def run():
                torch.mm(dy, w)
                torch.mm(dy.t(), x)

            return run
        if kind == "LayerNormMLP":
            w1, w2 = module.fc1_weight, module.fc2_weight
            h = torch.empty(x.shape[0], w1.shape[0], dtype=x.dtype, device=x.device)

            def run():
                torch.mm(dy, w2)
                torch.mm(dy.t(), h)
                torch.mm(h, w1)
                torch.mm(h.t(), x)

            return run
        weights = [getattr(module, f"weight{i}") for i in range(s.groups)]
        splits = s.splits()

        def run():
            for w, d, xi in zip(weights, dy.split(splits), x.split(splits)):
                torch.mm(d, w)
                torch.mm(d.t(), xi)

        return run


# ---- one (module, dtype) case ------------------------------------------------------------


def _setup(kind: str, s: Shapes, dtype: torch.dtype):
    """(non-delayed impl, delayed impl, torch.nn twin, x, dy), same parameter values, every
    gradient prefilled (the steady state of accumulation)."""
    torch.manual_seed(0)
    nd = _build_impl(kind, s, dtype, delay=False, fused=False)
    dl = _build_impl(kind, s, dtype, delay=True, fused=False)
    _copy_params(dl, nd)
    twin = _build_twin(kind, nd, s, dtype)
    for m in (nd, dl):
        _prefill(m, fused=False)
    for p in twin.parameters():
        p.grad = torch.full_like(p, 1e-3)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(s.tokens, s.hidden, generator=gen).to(dtype).to(_DEVICE).requires_grad_()
    out_features = s.hidden if kind == "LayerNormMLP" else s.ffn
    dy = torch.randn(s.tokens, out_features, generator=gen).to(dtype).to(_DEVICE)
    return nd, dl, twin, x, dy


def _case(kind: str, dtype: torch.dtype, s: Shapes, reps: int) -> dict:
    nd, dl, twin, x, dy = _setup(kind, s, dtype)
    splits = s.splits()
    x_in = x.detach()
    bare = _bare_gemms(kind, nd, x_in, dy, s)

    def impl_backward(module, delayed):
        y = _forward(module, x, splits)
        x.grad = None

        def run():
            y.backward(dy)
            if delayed:
                module.backward_dw()

        return _timed(run)

    def twin_backward():
        y = twin(x)
        return _timed(lambda: y.backward(dy))

    def generic_split():
        stage_backward_input, stage_backward_weight = _torch_compat.pipelining_split()

        y = twin(x)

        def run():
            _, groups = stage_backward_input([y], [dy], [x], twin.parameters())
            stage_backward_weight(twin.parameters(), groups)

        return _timed(run)

    t = {k: [] for k in ("nd", "delayed", "bare", "nn", "generic")}
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        sample = {
            "nd": impl_backward(nd, False),
            "delayed": impl_backward(dl, True),
            "bare": _timed(bare),
            "nn": twin_backward(),
            "generic": generic_split(),
        }
        if rep:
            for k, v in sample.items():
                t[k].append(v)
    ms = {k: _median_ms(v) for k, v in t.items()}
    row = {
        "module": kind,
        "dtype": str(dtype).replace("torch.", ""),
        "ms": ms,
        "split": ms["delayed"] / ms["nd"],
        "bare": ms["nd"] / ms["bare"],
        "nn": ms["nd"] / ms["nn"],
        "generic_time": ms["delayed"] / ms["generic"],
    }
    row.update(_generic_memory(dl, twin, x, dy, splits))
    row.update(_fused_memory(kind, s, dtype, nd, x, dy, splits))
    if kind == "GroupedLinear":
        row.update(_grouped_vs_loop(nd, x, dy, splits, reps))
    if kind == "LayerNormMLP":
        row.update(_recompute_vs_saved(nd, x, dy, reps))
    return row


def _generic_memory(dl, twin, x, dy, splits) -> dict:
    stage_backward_input, stage_backward_weight = _torch_compat.pipelining_split()

    result = {}
    for name in ("impl", "generic"):
        with PeakMemory() as mem:
            if name == "impl":
                y = _forward(dl, x, splits)
                y.backward(dy)
                del y
                kept = mem.alive_bytes()
                dl.backward_dw()
            else:
                y = twin(x)
                _, groups = stage_backward_input([y], [dy], [x], twin.parameters())
                del y
                kept = mem.alive_bytes()
                stage_backward_weight(twin.parameters(), groups)
                del groups
        result[f"peak_{name}_mb"] = mem.peak / 2**20
        result[f"kept_{name}_mb"] = kept / 2**20
        x.grad = None
    result["generic_peak"] = result["peak_impl_mb"] / result["peak_generic_mb"]
    return result


def _fused_memory(kind, s, dtype, nd, x, dy, splits) -> dict:
    fused = _build_impl(kind, s, dtype, delay=False, fused=True)
    _copy_params(fused, nd)
    _prefill(fused, fused=True)
    peaks = {}
    for name, module in (("plain", nd), ("fused", fused)):
        with PeakMemory() as mem:
            _forward(module, x, splits).backward(dy)
        peaks[name] = mem.peak / 2**20
        x.grad = None
    return {
        "peak_plain_mb": peaks["plain"],
        "peak_fused_mb": peaks["fused"],
        "fused_peak": peaks["fused"] / peaks["plain"],
    }


def _grouped_vs_loop(module, x, dy, splits, reps) -> dict:
    samples = {"grouped": [], "loop": []}
    for rep in range(reps + 1):
        for path in samples:
            module.grouped_gemm = path

            def run():
                _forward(module, x, splits).backward(dy)

            elapsed = _timed(run)
            if rep:
                samples[path].append(elapsed)
    module.grouped_gemm = "auto"
    ran_grouped = impl.gemm.grouped_mm_runs(
        x.dtype, module.in_features, module.out_features, x.device
    )
    ms = {k: _median_ms(v) for k, v in samples.items()}
    return {
        "grouped_ms": ms["grouped"],
        "loop_ms": ms["loop"],
        "grouped": ms["grouped"] / ms["loop"] if ran_grouped else float("nan"),
    }


def _recompute_vs_saved(module, x, dy, reps) -> dict:
    samples = {True: [], False: []}
    kept = {}
    for rep in range(reps + 1):
        for recompute in samples:
            module.recompute_activation = recompute
            y = module(x)
            x.grad = None
            elapsed = _timed(lambda y=y: y.backward(dy))
            if rep:
                samples[recompute].append(elapsed)
    for recompute in samples:
        module.recompute_activation = recompute
        with PeakMemory() as mem:
            y = module(x)
            kept[recompute] = mem.alive_bytes() - y.untyped_storage().nbytes()
            y.backward(dy)
            del y
        x.grad = None
    module.recompute_activation = type(module).recompute_activation
    return {
        "recompute_time": _median_ms(samples[True]) / _median_ms(samples[False]),
        "saved_fwd_mb_recompute": kept[True] / 2**20,
        "saved_fwd_mb_saved": kept[False] / 2**20,
    }


# ---- FP8: wgrad time and queued-entry memory per recipe ------------------------------------


def fp8_recipes() -> dict[str, object]:
    """The recipes the FP8 section measures (the reference's dataclasses, re-exported by impl)."""
    return {
        "delayed": impl.DelayedScaling(),
        "current": impl.Float8CurrentScaling(),
        "mxfp8": impl.MXFP8BlockScaling(),
        "block": impl.Float8BlockScaling(),
    }


def _entry_bytes(module) -> int:
    """Bytes of the distinct storages the module's queued entries hold."""
    seen: dict[int, int] = {}
    for entry in module._wgrad_store:
        for t in entry.saved:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _fp8_variant(s: Shapes, recipe, fused: bool, reps: int) -> tuple[float, int]:
    """(median backward_dw ms, bytes one queued entry holds) for one recipe (None: bf16)."""
    torch.manual_seed(0)
    module = impl.Linear(
        s.hidden,
        s.ffn,
        params_dtype=torch.bfloat16,
        delay_wgrad_compute=True,
        fuse_wgrad_accumulation=fused,
        device=_DEVICE,
    )
    _prefill(module, fused)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(s.tokens, s.hidden, generator=gen).to(torch.bfloat16).to(_DEVICE)
    x.requires_grad_()
    dy = torch.randn(s.tokens, s.ffn, generator=gen).to(torch.bfloat16).to(_DEVICE)
    samples, held = [], 0
    for rep in range(reps + 1):  # the first repetition warms up and is dropped
        with impl.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = module(x)
        y.backward(dy)
        del y
        x.grad = None
        held = _entry_bytes(module)
        elapsed = _timed(module.backward_dw)
        if rep:
            samples.append(elapsed)
    return _median_ms(samples), held


def run_fp8(s: Shapes, reps: int) -> list[dict]:
    """The FP8 section: one row per recipe plus the bf16 baseline (``recipe`` = ``"bf16"``)."""
    rows = []
    variants = {"bf16": None, **fp8_recipes()}
    for name, recipe in variants.items():
        with gemm_paths.recording() as paths:
            plain_ms, held = _fp8_variant(s, recipe, fused=False, reps=reps)
            fused_ms, _ = _fp8_variant(s, recipe, fused=True, reps=reps)
        rows.append(
            {
                "recipe": name,
                "wgrad_ms": plain_ms,
                "wgrad_fused_ms": fused_ms,
                "entry_mb": held / 2**20,
                "gemm_paths": paths.summary(),
            }
        )
    base = rows[0]
    for r in rows:
        r["wgrad_vs_bf16"] = r["wgrad_ms"] / base["wgrad_ms"]
        r["wgrad_fused_vs_bf16"] = r["wgrad_fused_ms"] / base["wgrad_fused_ms"]
        r["entry_vs_bf16"] = r["entry_mb"] / base["entry_mb"]
    return rows


def _print_fp8_table(rows: list[dict], s: Shapes) -> None:
    print(
        f"\nFP8 — bf16 Linear {s.hidden}->{s.ffn}, {s.tokens} tokens, delay_wgrad_compute; "
        "backward_dw() time and what one queued entry holds, vs the same module without FP8"
    )
    _print_rows(
        f"{'recipe':<10}{'wgrad ms':>10}{'vs bf16':>9}{'fused ms':>10}{'vs bf16':>9}"
        f"{'entry MB':>10}{'vs bf16':>9}",
        [
            f"{r['recipe']:<10}{r['wgrad_ms']:10.1f} {_fmt(r['wgrad_vs_bf16']):>8}"
            f"{r['wgrad_fused_ms']:10.1f} {_fmt(r['wgrad_fused_vs_bf16']):>8}"
            f"{r['entry_mb']:10.2f} {_fmt(r['entry_vs_bf16']):>8}"
            for r in rows
        ],
        "wgrad = backward_dw() into .grad (bf16); fused = into fp32 main_grad; entry = bytes of "
        "the tensors one queued entry holds (FP8: column-wise q(dy), q(x), scale_inv, db)",
    )


# ---- per-call cost at small shapes, and torch.compile -------------------------------------


#: (module, tokens, in/hidden, out/ffn, groups): small shapes, where per-call work
#: (validation, autograd plumbing, entries, hooks) shows next to the GEMMs. GroupedLinear: 64
#: groups of 16 rows against a loop of ``torch.nn.Linear``.
SMALL_CASES = (
    ("Linear", 64, 128, 128, 1),
    ("Linear", 256, 256, 512, 1),
    ("LayerNormLinear", 64, 128, 128, 1),
    ("LayerNormLinear", 256, 256, 512, 1),
    ("LayerNormMLP", 64, 128, 128, 1),
    ("LayerNormMLP", 256, 256, 512, 1),
    ("GroupedLinear", 1024, 128, 128, 64),
)


def _small_setup(kind: str, tokens: int, hidden: int, out: int, groups: int, dtype):
    """:func:`_setup` at a small shape, equal groups, ``x.grad`` prefilled; and the splits."""
    s = Shapes(tokens, hidden, out, groups, even=True)
    nd, dl, twin, x, dy = _setup(kind, s, dtype)
    x.grad = torch.zeros_like(x)
    return nd, dl, twin, x, dy, s.splits()


def _interleaved_medians(contenders: dict[str, Callable[[], object]], reps: int) -> dict:
    """Median seconds of each contender over ``reps`` rounds (after 10% warm-up rounds); every
    round runs each contender once, in a new (seeded) random order, so that no contender always
    follows the same one (whose memory traffic would leave it colder or warmer caches)."""
    samples: dict[str, list[float]] = {k: [] for k in contenders}
    names = list(contenders)
    order = random.Random(0)
    warmup = max(2, reps // 10)
    for rep in range(warmup + reps):
        order.shuffle(names)
        for name in names:
            elapsed = _timed(contenders[name])
            if rep >= warmup:
                samples[name].append(elapsed)
    return {k: statistics.median(v) for k, v in samples.items()}


def per_call(kind: str, tokens: int, hidden: int, out: int, groups: int, dtype, reps: int):
    """impl / torch.nn twin at one small shape: forward, forward + backward (non-delayed), and
    forward + backward + ``backward_dw()`` (delayed) against the twin's forward + backward."""
    nd, dl, twin, x, dy, splits = _small_setup(kind, tokens, hidden, out, groups, dtype)

    def delayed():
        _forward(dl, x, splits).backward(dy)
        dl.backward_dw()

    t = _interleaved_medians(
        {
            "impl_fwd": lambda: _forward(nd, x, splits),
            "nn_fwd": lambda: twin(x),
            "impl_fb": lambda: _forward(nd, x, splits).backward(dy),
            "delayed_fb": delayed,
            "nn_fb": lambda: twin(x).backward(dy),
        },
        reps,
    )
    return {
        "module": kind,
        "shape": f"{tokens}x{hidden}->{out}" + (f" ({groups} groups)" if groups > 1 else ""),
        "dtype": str(dtype).replace("torch.", ""),
        "us": {k: v * 1e6 for k, v in t.items()},
        "fwd": t["impl_fwd"] / t["nn_fwd"],
        "fwd_bwd": t["impl_fb"] / t["nn_fb"],
        "fwd_bwd_dw": t["delayed_fb"] / t["nn_fb"],
    }


def run_small(dtypes: list[torch.dtype], kinds: list[str], reps: int) -> list[dict]:
    """The small-shape section: one row per (case, dtype)."""
    return [
        per_call(*case, dtype, reps) for dtype in dtypes for case in SMALL_CASES if case[0] in kinds
    ]


def _print_small_table(rows: list[dict], reps: int, targets: bool = True) -> None:
    print(
        "\nPer-call cost at small shapes — impl / torch.nn twin (same dtype, autograd), median of "
        f"{reps} interleaved reps; < 1 means impl is faster"
    )
    _print_rows(
        f"{'module':<16}{'shape':<28}{'dtype':<10}{'fwd':>6}{'fwd+bwd':>9}{'+dw':>7}"
        f"{'nn fwd+bwd us':>15}",
        [
            f"{r['module']:<16}{r['shape']:<28}{r['dtype']:<10}{_fmt(r['fwd'])}"
            f"   {_fmt(r['fwd_bwd'])} {_fmt(r['fwd_bwd_dw'])}{r['us']['nn_fb']:15.0f}"
            for r in rows
        ],
        "fwd = forward / twin forward; fwd+bwd = forward + backward (non-delayed) / twin's; "
        "+dw = forward + backward + backward_dw() (delayed) / twin's forward + backward"
        + (" (target <= 1.00)" if targets else ""),
    )


#: Where the compiled-vs-eager rows are measured (the larger small shapes).
COMPILE_CASES = tuple(case for case in SMALL_CASES if case[1] >= 256)


def compiled_vs_eager(kind, tokens, hidden, out, groups, dtype, reps: int) -> dict:
    """``torch.compile`` (default inductor backend) against eager, forward + backward (and
    ``backward_dw()`` under delay), for impl and its torch.nn twin; with the graph breaks
    Dynamo counted while compiling impl's modules."""
    counters = _torch_compat.dynamo_counters()
    nd, dl, twin, x, dy, splits = _small_setup(kind, tokens, hidden, out, groups, dtype)
    torch.compiler.reset()
    counters.clear()
    start = time.perf_counter()
    c_nd, c_dl = torch.compile(nd), torch.compile(dl)

    def run(module, delayed=False):
        def step():
            _forward(module, x, splits).backward(dy)
            if delayed:
                module.backward_dw()

        return step

    for step in (run(c_nd), run(c_dl, True)):
        step()  # compiles
    compile_s = time.perf_counter() - start
    breaks = sum(counters["graph_break"].values())
    c_twin = torch.compile(twin)
    c_twin(x).backward(dy)
    t = _interleaved_medians(
        {
            "impl": run(nd),
            "impl_compiled": run(c_nd),
            "delayed": run(dl, True),
            "delayed_compiled": run(c_dl, True),
            "nn": lambda: twin(x).backward(dy),
            "nn_compiled": lambda: c_twin(x).backward(dy),
        },
        reps,
    )
    torch.compiler.reset()
    return {
        "module": kind,
        "shape": f"{tokens}x{hidden}->{out}" + (f" ({groups} groups)" if groups > 1 else ""),
        "dtype": str(dtype).replace("torch.", ""),
        "us": {k: v * 1e6 for k, v in t.items()},
        "graph_breaks": breaks,
        "compile_s": compile_s,
        "impl": t["impl_compiled"] / t["impl"],
        "delayed": t["delayed_compiled"] / t["delayed"],
        "nn": t["nn_compiled"] / t["nn"],
        "vs_nn": t["impl_compiled"] / t["nn_compiled"],
    }


def run_compiled(dtypes: list[torch.dtype], kinds: list[str], reps: int) -> list[dict]:
    """The torch.compile section: one row per (case, dtype)."""
    return [
        compiled_vs_eager(*case, dtype, reps)
        for dtype in dtypes
        for case in COMPILE_CASES
        if case[0] in kinds
    ]


def _print_compiled_table(rows: list[dict], reps: int) -> None:
    print(
        "\ntorch.compile (inductor) / eager, forward + backward, median of "
        f"{reps} interleaved reps; breaks = graph breaks while compiling impl (delay on and off)"
    )
    _print_rows(
        f"{'module':<16}{'shape':<28}{'dtype':<10}{'impl':>6}{'delayed':>9}{'nn':>7}"
        f"{'impl/nn':>9}{'breaks':>8}",
        [
            f"{r['module']:<16}{r['shape']:<28}{r['dtype']:<10}{_fmt(r['impl'])}   "
            f"{_fmt(r['delayed'])} {_fmt(r['nn'])}   {_fmt(r['vs_nn'])}{r['graph_breaks']:8d}"
            for r in rows
        ],
        "impl / delayed / nn = compiled / eager of the same module (delayed: + backward_dw()); "
        "impl/nn = compiled impl / compiled torch.nn twin",
    )


# ---- driver ------------------------------------------------------------------------------


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    clock = "CPU time" if _clock is time.process_time else "wall clock"
    return (
        f"{cpu}; torch {torch.__version__}; {torch.get_num_threads()} threads; "
        f"cuda={'yes' if torch.cuda.is_available() else 'no'}; {clock}"
    )


def _fmt(v: float) -> str:
    return "   n/a" if v != v else f"{v:6.2f}"


def _print_rows(header: str, lines: list[str], note: str) -> None:
    """A table: its header, a rule, its lines and the note under it."""
    print(header)
    print("-" * len(header))
    for line in lines:
        print(line)
    print(note)


def _main_row(r: dict) -> str:
    kept = f"{r['kept_impl_mb']:.1f}/{r['kept_generic_mb']:.1f}"
    return (
        f"{r['module']:<16}{r['dtype']:<9}{r['ms']['nd']:8.1f}{_fmt(r['split'])}"
        f" {_fmt(r['bare'])} {_fmt(r['nn'])} {_fmt(r['generic_time'])}"
        f" {_fmt(r['generic_peak'])}{kept:>15}{_fmt(r['fused_peak'])}"
    )


def _rstripped(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.split("\n"))


def _print_table(rows: list[dict], shapes: Shapes, reps: int, targets: bool = True) -> None:
    print(f"splitgrad bench — {_machine()}")
    if not rows:
        return
    print(
        f"tokens={shapes.tokens} hidden={shapes.hidden} ffn={shapes.ffn} groups={shapes.groups} "
        f"(splits {shapes.splits()}); median of {reps} reps; ratios < 1 mean impl is better"
    )
    goal = {k: f"(target <= {v:.2f})" if targets else "" for k, v in TARGETS.items()}
    _print_rows(
        f"{'module':<16}{'dtype':<9}{'bwd ms':>8}{'split':>7}{'bare':>7}{'nn':>7}"
        f"{'gen.t':>7}{'gen.pk':>7}{'kept MB':>15}{'fused.pk':>9}",
        [_main_row(r) for r in rows],
        _rstripped(
            f"\nsplit  = (backward + backward_dw) / non-delayed backward          {goal['split']}\n"
            f"bare   = impl backward / bare dgrad+wgrad torch.mm calls          {goal['bare']}\n"
            f"nn     = impl backward / torch.nn twin backward (autograd)        {goal['nn']}\n"
            "gen.t  = impl delayed time / stage_backward_input+weight on twin\n"
            "gen.pk = impl delayed peak memory / generic split peak memory\n"
            "kept   = MB alive between backward and backward_dw: impl / generic split\n"
            "fused.pk = peak memory, fused fp32 main_grad / plain .grad accumulation"
        ),
    )
    extra = [r for r in rows if "grouped" in r or "recompute_time" in r]
    for r in extra:
        if "grouped" in r:
            print(
                f"GroupedLinear {r['dtype']}: grouped / loop (fwd+bwd) = {_fmt(r['grouped'])} "
                f"({r['grouped_ms']:.1f} / {r['loop_ms']:.1f} ms)"
            )
        if "recompute_time" in r:
            print(
                f"LayerNormMLP {r['dtype']}: recomputed / saved activation, backward time = "
                f"{_fmt(r['recompute_time'])}; kept fwd->bwd {r['saved_fwd_mb_recompute']:.1f} "
                f"vs {r['saved_fwd_mb_saved']:.1f} MB"
            )


def run(shapes: Shapes, dtypes: list[torch.dtype], kinds: list[str], reps: int) -> list[dict]:
    """Measure every (module, dtype) case; returns one dict of ratios per case, with the GEMM
    paths it took (:mod:`.gemm_paths`) under ``"gemm_paths"``."""
    rows = []
    for dtype in dtypes:
        for kind in kinds:
            with gemm_paths.recording() as paths:
                row = _case(kind, dtype, shapes, reps)
            row["gemm_paths"] = paths.summary()
            rows.append(row)
    return rows


def _print_paths(rows: list[dict], fp8_rows: list[dict]) -> None:
    """Which GEMM path each measured module took, and why; then any fast path a GPU
    refused where its capability says it runs (a FastPathMissed warning each)."""
    print(f"\nGEMM paths taken on {_DEVICE} (fast / fallback / forced / portable / only):")
    for r in rows:
        for p in r["gemm_paths"]:
            print(f"  {r['module']:<16}{r['dtype']:<9}{_path_line(p)}")
    for r in fp8_rows:
        for p in r["gemm_paths"]:
            print(f"  {'Linear fp8:' + r['recipe']:<25}{_path_line(p)}")
    if not any(r["gemm_paths"] for r in (*rows, *fp8_rows)):
        print("  (no decision: every GEMM here has a single path)")
    for line in gemm_paths.missed_fast_paths():
        print(f"FAST PATH MISSED: {line}")


def _path_line(p: dict) -> str:
    shapes = ", ".join("x".join(map(str, sh)) for sh in p["shapes"][:3])
    return f"{p['gemm']:<22}{p['path']:<9}{p['call']} [{shapes}] ({p['reason']})"


#: What ``--modules`` and ``--dtypes`` accept.
MODULE_CHOICES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
DTYPE_CHOICES = ("float32", "bfloat16", "float16")
#: The FP8 section's MXFP8 and block-scaled recipes quantize in blocks of 32 and 128 along every
#: dimension of its Linear (tokens, hidden, ffn), so those must be multiples of the larger one.
FP8_MULTIPLE = 128


def _choices(parser: argparse.ArgumentParser, flag: str, text: str, allowed) -> list[str]:
    """The comma-separated items of ``text``; ``parser.error`` (exit status 2) naming any not in
    ``allowed`` and listing the valid ones."""
    try:
        return list(pick(flag[2:], text, flag[2:-1], allowed, everything=None))
    except ValueError as exc:
        parser.error(str(exc))


#: The sizes and counts: option -> (what it is, default, default under ``--quick``).
_SIZES = {
    "tokens": ("rows of each input", 2048, 256),
    "hidden": ("in_features, hidden_size for LayerNormMLP", 1024, 128),
    "ffn": ("out_features, ffn_hidden_size for LayerNormMLP", 4096, 512),
    "reps": ("repetitions, medians printed", 5, 2),
    "small-reps": (
        "interleaved repetitions of the small-shape and torch.compile sections",
        301,
        21,
    ),
}
#: The sections of a run, each skipped by ``--no-NAME``.
_SECTIONS = {
    "main": "the main table (the realistic shapes)",
    "fp8": "the FP8 section",
    "small": "the small-shape (per-call cost) section",
    "compile": "the torch.compile vs eager section",
}


def build_parser() -> argparse.ArgumentParser:
    """The ``splitgrad bench`` command line."""
    parser = argparse.ArgumentParser(
        prog="splitgrad bench",
        description="Speed and memory ratios of splitgrad.impl, every figure measured in the same "
        "run (split vs non-delayed backward, vs bare torch.mm GEMMs, vs torch.nn with autograd, "
        "vs PyTorch's generic split; grouped GEMM, recomputed activation, fused main_grad, FP8).",
    )
    quick = " ".join(f"--{name} {q}" for name, (_, _, q) in _SIZES.items())
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: the defaults become {quick} (options given explicitly still apply)",
    )
    for name, (what, default, _) in _SIZES.items():
        parser.add_argument(f"--{name}", type=positive_int, help=f"{what} (default: {default})")
    parser.add_argument(
        "--groups", type=positive_int, default=8, help="GroupedLinear's num_gemms (default: 8)"
    )
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help=f"comma-separated, of {', '.join(DTYPE_CHOICES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--modules",
        default="Linear,LayerNormLinear,LayerNormMLP,GroupedLinear",
        help=f"comma-separated, of {', '.join(MODULE_CHOICES)} (default: all four)",
    )
    for name, what in _SECTIONS.items():
        parser.add_argument(f"--no-{name}", action="store_true", help=f"skip {what}")
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="torch.set_num_threads before measuring (default: torch's own choice)",
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time measured: wall clock, or this process's CPU time (for a shared machine; "
        "with --threads 1 it is the thread's own work)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where modules and tensors live (default: %(default)s); the GEMM paths each "
        "module took are printed after the tables",
    )
    parser.add_argument(
        "--json", type=output_file, metavar="PATH", help="also write the results as JSON"
    )
    return parser


def parse_options(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line with ``shapes``, ``reps``, ``dtype_list`` (torch dtypes) and
    ``kinds`` added; a bad value exits with status 2 and a message naming it (nothing runs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, (_, default, quick) in _SIZES.items():
        if getattr(args, name.replace("-", "_")) is None:
            setattr(args, name.replace("-", "_"), quick if args.quick else default)
    args.shapes = Shapes(args.tokens, args.hidden, args.ffn, args.groups)
    if all(getattr(args, f"no_{name}") for name in _SECTIONS):
        flags = " ".join(f"--no-{name}" for name in _SECTIONS)
        parser.error(f"{flags}: every section is off, nothing to measure")
    args.dtype_list = [
        getattr(torch, d) for d in _choices(parser, "--dtypes", args.dtypes, DTYPE_CHOICES)
    ]
    args.kinds = _choices(parser, "--modules", args.modules, MODULE_CHOICES)
    s = args.shapes
    if not args.no_fp8:
        unaligned = [
            f"--{name} {value}"
            for name, value in (("tokens", s.tokens), ("hidden", s.hidden), ("ffn", s.ffn))
            if value % FP8_MULTIPLE
        ]
        if unaligned:
            parser.error(
                f"{', '.join(unaligned)}: the FP8 section (MXFP8 and block scaling) needs "
                f"multiples of {FP8_MULTIPLE}; choose such sizes or pass --no-fp8"
            )
    return args


def smoke_run(args: argparse.Namespace) -> list[str]:
    """Why the run's figures are a smoke run, not measurements (empty: they are): the targets
    hold at the default sizes and repetitions, and smaller runs show per-call overhead and
    timer noise."""
    unused = {"small-reps"} if args.no_small and args.no_compile else set()
    why = [
        f"--{name} {getattr(args, name.replace('-', '_'))} (default {default})"
        for name, (_, default, _) in _SIZES.items()
        if name not in unused and getattr(args, name.replace("-", "_")) < default
    ]
    return (["--quick"] if args.quick else []) + why


def _smoke_warning(why: list[str]) -> str:
    return (
        f"WARNING: smoke run ({', '.join(why)}): these figures only show that everything runs; "
        "they are not measurements, are not meant to be read, and no targets are printed"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``splitgrad bench``."""
    args = parse_options(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        message = "--device cuda, but torch.cuda.is_available() is False"
        return run_error("splitgrad bench", message, USAGE_ERROR)
    shapes, reps, dtypes, kinds = args.shapes, args.reps, args.dtype_list, args.kinds
    global _DEVICE
    _DEVICE = args.device
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    global _clock
    _clock = time.process_time if args.clock == "cpu" else time.perf_counter
    smoke = smoke_run(args)
    if smoke:
        print(_smoke_warning(smoke))
    rows = [] if args.no_main else run(shapes, dtypes, kinds, reps)
    _print_table(rows, shapes, reps, targets=not smoke)
    # FP8 on CPU runs its GEMMs in fp32 after a scalar FP8 conversion: few reps keep the
    # default run near three minutes.
    fp8_rows = [] if args.no_fp8 else run_fp8(shapes, min(reps, 3))
    if fp8_rows:
        _print_fp8_table(fp8_rows, shapes)
    _print_paths(rows, fp8_rows)
    small_reps = args.small_reps
    small_rows = [] if args.no_small else run_small(dtypes, kinds, small_reps)
    if small_rows:
        _print_small_table(small_rows, small_reps, targets=not smoke)
    compiled_rows = [] if args.no_compile else run_compiled(dtypes, kinds, small_reps)
    if compiled_rows:
        _print_compiled_table(compiled_rows, small_reps)
    if smoke:
        print(f"\n{_smoke_warning(smoke)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "machine": _machine(),
                    "shapes": dataclasses.asdict(shapes),
                    "reps": reps,
                    "targets": TARGETS,
                    "smoke_run": smoke,
                    "rows": rows,
                    "fp8": fp8_rows,
                    "small_reps": small_reps,
                    "small": small_rows,
                    "compiled": compiled_rows,
                    "device": args.device,
                    "fast_paths_missed": gemm_paths.missed_fast_paths(),
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
