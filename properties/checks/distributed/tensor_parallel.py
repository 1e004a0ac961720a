"""P19 (SPEC §7, §9): tensor and sequence parallel modules of any package on gloo ranks.

Every module (``Linear`` column and row, ``LayerNormLinear`` column, ``LayerNormMLP`` with
``set_parallel_mode=True``), sequence parallel on and off, fused and plain, with and without
bias, in float64, float32, bfloat16 and under every FP8 recipe, on 2 and 4 ranks: the whole
matrix of one world size runs inside one spawn (:func:`~splitgrad.distributed.run_ranks`), the
single-process baselines inside one more. On every rank, two micro-batches (the second with one
row per rank under SP) go forward and backward, then, delayed, every ``backward_dw()``:

1. delayed ≡ non-delayed, bitwise, per rank, in both ``wgrad_gather`` modes, from a random
   ``.grad`` / ``main_grad`` prefill;
2. outputs, input gradients and every parameter gradient (after the SP reduction) within budget
   of the float64 truth: the single-process module holding the full weights, sharded as §9
   says. float64 runs meet a floor alone (:data:`~..budgets.TENSOR_PARALLEL_FLOAT64`, the
   check of the TP structure); float32 and bfloat16 runs the tier-2 budgets, against the worse
   of two naive runs: ``splitgrad.reference`` under the same TP (it rounds the partial sums a
   correct TP run rounds) and in one process; FP8 runs the FP8 budget;
3. the replicated parameters' gradients bitwise equal on every rank after
   ``allreduce_sequence_parallel_grads``; the §9 attributes on every parameter;
4. no collective inside ``backward_dw()`` in the default mode (``"backward"``), one at least in
   ``"backward_dw"`` mode under SP: every dispatched ``c10d`` op is counted (:class:`_Ops`), so
   an alias imported before the check starts is seen too;
5. what an entry holds, measured from the storages it releases in its ``backward_dw()``: in the
   default mode the gathered operand (the input of a column layer, ``dy`` of a row layer,
   ``LayerNormMLP``'s ``ln_out`` and ``dy``: ``tp`` times the shard's rows), at least
   ``(tp - 1)`` shards more than in ``"backward_dw"`` mode, which keeps the shard; and every
   tensor of the micro-batch's rows freed by its ``backward_dw()`` (P11 under TP).

``splitgrad distributed --check p19``; ``profile="nightly"`` runs every fused x bias
combination under FP8 and a second seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from ... import budgets as B
from ...backends import BACKEND_NAMES, LibraryBackend, get_backend
from ...backends.library import keywords
from .library import load_library
from .model import RECIPES
from .report import DistributedReport, baseline, run_checked

#: The module kinds P19 runs, with their parallel mode.
TP_KINDS = ("Linear-column", "Linear-row", "LayerNormLinear-column", "LayerNormMLP")
TP_DTYPES = ("float64", "float32", "bfloat16")
TP_PROFILES = ("ci", "nightly")
#: The reduction of the replicated parameters' gradients the check calls after the step.
SP_REDUCE = "splitgrad.distributed:allreduce_sequence_parallel_grads"

_WEIGHTS = ("weight", "fc1_weight", "fc2_weight")
_NORMS = ("layer_norm_weight", "layer_norm_bias")
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class TPCase:
    """One configuration of the matrix at one world size; sizes are global."""

    kind: str
    sp: bool
    fused: bool
    bias: bool
    dtype: str
    recipe: str | None
    world: int
    seed: int = 0
    activation: str = "gelu"
    normalization: str = "LayerNorm"

    @property
    def module(self) -> str:
        return self.kind.split("-")[0]

    @property
    def mode(self) -> str | None:
        return self.kind.split("-")[1] if "-" in self.kind else None

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def label(self) -> str:
        parts = [self.kind, "SP" if self.sp else "no-SP", "fused" if self.fused else "plain"]
        parts += ["bias" if self.bias else "no-bias", self.dtype]
        if self.recipe:
            parts.append(f"fp8:{self.recipe}")
        if self.module != "Linear":
            parts.append(self.normalization)
        if self.module == "LayerNormMLP":
            parts.append(self.activation)
        return " ".join(parts) + (f" seed={self.seed}" if self.seed else "")

    def sizes(self) -> tuple[int, int, tuple[int, ...]]:
        """(in, out) features (``LayerNormMLP``: hidden, ffn) and each micro-batch's tokens:
        every per-rank GEMM dimension a multiple of the recipe's block; otherwise sizes whose
        shards are no token count (so a tensor's rows tell what it is), and a second
        micro-batch of one row per rank."""
        w = self.world
        if self.recipe == "block":
            hidden = 128 if self.module == "LayerNormMLP" else 128 * w
            return (hidden, 128 * w, (128 * w,) * 2)
        if self.recipe == "mxfp8":
            return (
                (64, 128, (128, 128)) if self.module == "LayerNormMLP" else (128, 128, (128,) * 2)
            )
        if self.module == "LayerNormMLP":
            return 20, 36, (4 * w, w)
        return 20, 28, (4 * w, w)


def tp_cases(
    world: int,
    profile: str = "ci",
    *,
    kinds: tuple[str, ...] = TP_KINDS,
    dtypes: tuple[str, ...] = TP_DTYPES,
    recipes: tuple[str | None, ...] = (None, *RECIPES),
    sp: tuple[bool, ...] = (False, True),
) -> list[TPCase]:
    """The matrix of one world size, enumerated: every kind x SP x fused x bias in each
    high-precision dtype; under FP8 (bf16) every kind x SP with fused and bias alternating
    (``nightly``: every combination, and all of it again with a second seed). LayerNormMLP
    alternates gelu and swiglu, the norm modules LayerNorm and RMSNorm. ``ci`` leaves
    ``Float8BlockScaling`` (GEMMs 128 x world wide) to 2 ranks."""
    if profile not in TP_PROFILES:
        raise ValueError(f"unknown profile {profile!r}; expected one of {', '.join(TP_PROFILES)}")
    out = []
    seeds = (0, 1) if profile == "nightly" else (0,)
    flags = [(f, b) for f in (False, True) for b in (True, False)]
    for seed in seeds:
        for recipe in recipes:
            if recipe == "block" and world > 2 and profile == "ci":
                continue  # 512-wide GEMMs on 4 ranks sharing 2 cores: nightly only
            for d in dtypes if recipe is None else ("bfloat16",):
                for i, (kind, s) in enumerate((k, s) for k in kinds for s in sp):
                    full = recipe is None or profile == "nightly"
                    for j, (fused, bias) in enumerate(flags if full else [flags[i % 4]]):
                        n = i + j + seed
                        out.append(
                            TPCase(
                                kind,
                                s,
                                fused,
                                bias,
                                d,
                                recipe,
                                world,
                                seed,
                                activation=("gelu", "swiglu")[n % 2],
                                normalization=("LayerNorm", "RMSNorm")[(n // 2) % 2],
                            )
                        )
    return out


# ---- what a rank holds: §9's sharding -------------------------------------------------------
def _rows(t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    return t.chunk(w, 0)[r]


def _cols(t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    return t.chunk(w, 1)[r]


def replicated(case: TPCase, name: str) -> bool:
    """Whether every rank holds the whole parameter ``name`` (row bias, norm, ``fc2_bias``)."""
    if name in _NORMS or name == "fc2_bias":
        return True
    return case.mode == "row" and name == "bias"


def shard_param(case: TPCase, name: str, t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    """Rank ``r``'s part of the full parameter ``name``: column rows ``r``, row columns ``r``,
    a gated ``fc1``'s ``[gate rows r; up rows r]``; a replicated one whole."""
    if replicated(case, name):
        return t
    if name in ("fc1_weight", "fc1_bias"):
        halves = t.chunk(2, 0) if case.gated else (t,)
        return torch.cat([_rows(h, r, w) for h in halves])
    if name == "fc2_weight" or case.mode == "row":
        return _cols(t, r, w)
    return _rows(t, r, w)


def shard_input(case: TPCase, t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    """Rank ``r``'s input (or input gradient): a row layer's feature columns; a column layer's
    sequence rows under SP, all of it otherwise."""
    if case.mode == "row":
        return _cols(t, r, w)
    return _rows(t, r, w) if case.sp else t


def shard_output(case: TPCase, t: torch.Tensor, r: int, w: int) -> torch.Tensor:
    """Rank ``r``'s output (or output gradient): a column layer's feature columns; a row
    layer's (and ``LayerNormMLP``'s) sequence rows under SP, all of it otherwise."""
    if case.mode == "column":
        return _cols(t, r, w)
    return _rows(t, r, w) if case.sp else t


def partition_dim(case: TPCase, name: str) -> int | None:
    """Megatron's ``partition_dim`` §9 gives parameter ``name`` (``None``: not sharded)."""
    if replicated(case, name):
        return None
    return 1 if name == "fc2_weight" or (case.mode == "row" and name == "weight") else 0


def gathered_operands(case: TPCase) -> int:
    """How many operands a delayed entry gets gathered along the sequence under SP (each
    ``tokens x hidden`` or ``tokens x in``/``out``): the column input, the row ``dy``,
    ``LayerNormMLP``'s both."""
    return 2 if case.module == "LayerNormMLP" else 1


def _operand_width(case: TPCase) -> int:
    k, n, _ = case.sizes()
    if case.module == "LayerNormMLP":
        return k  # ln_out and dy are both (tokens, hidden)
    return n if case.mode == "row" else k


# ---- values every process draws alike --------------------------------------------------------
def _full_shapes(case: TPCase) -> dict[str, tuple[int, ...]]:
    k, n, _ = case.sizes()
    shapes: dict[str, tuple[int, ...]] = {}
    if case.module != "Linear":
        shapes["layer_norm_weight"] = (k,)
        if case.normalization == "LayerNorm":
            shapes["layer_norm_bias"] = (k,)
    if case.module == "LayerNormMLP":
        fc1 = 2 * n if case.gated else n
        shapes["fc1_weight"] = (fc1, k)
        if case.bias:
            shapes["fc1_bias"] = (fc1,)
        shapes["fc2_weight"] = (k, n)
        if case.bias:
            shapes["fc2_bias"] = (k,)
        return shapes
    shapes["weight"] = (n, k)
    if case.bias:
        shapes["bias"] = (n,)
    return shapes


@dataclasses.dataclass
class Values:
    """The full parameters, each micro-batch's global input and output gradient (all rounded to
    the case's dtype) and the gradient prefill (fp32 for a fused weight's ``main_grad``)."""

    params: dict[str, torch.Tensor]
    data: list[tuple[torch.Tensor, torch.Tensor]]
    prefill: dict[str, torch.Tensor]


def values(case: TPCase) -> Values:
    """``case``'s :class:`Values`, drawn from its seed alike in every process: weights scaled
    by ``1/sqrt(fan_in)``, ``layer_norm_weight`` around one, every value rounded to the case's
    dtype first (the float64 truth holds the same numbers)."""
    gen = torch.Generator().manual_seed(19_000 + case.seed)
    dtype = _DTYPES[case.dtype]
    k, n, tokens = case.sizes()
    params = {}
    for name, shape in sorted(_full_shapes(case).items()):
        v = torch.randn(shape, generator=gen, dtype=torch.float64)
        if len(shape) == 2:
            v = v / math.sqrt(shape[1])
        elif name == "layer_norm_weight":
            v = 1.0 + 0.3 * v
        else:
            v = 0.3 * v
        params[name] = v.to(dtype)
    width_out = k if case.module == "LayerNormMLP" else n
    data = [
        (
            torch.randn(t, k, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(t, width_out, generator=gen, dtype=torch.float64).to(dtype),
        )
        for t in tokens
    ]
    prefill = {}
    for name, p in params.items():
        fused = case.fused and name in _WEIGHTS
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        prefill[name] = torch.randn(p.shape, generator=gen, dtype=torch.float64).to(
            wide if fused else dtype
        )
    return Values(params, data, prefill)


# ---- one run of one module -------------------------------------------------------------------
def build(lib: Any, case: TPCase, dtype: torch.dtype, **options: Any) -> torch.nn.Module:
    """``case``'s module of ``lib`` in ``dtype``, with ``options`` (the TP ones, delay)."""
    k, n, _ = case.sizes()
    kw = dict(bias=case.bias, params_dtype=dtype, fuse_wgrad_accumulation=case.fused, **options)
    if case.module != "Linear":
        kw["normalization"] = case.normalization
    if case.module == "LayerNormMLP":
        if "tp_group" in options:
            kw["set_parallel_mode"] = True
        return lib.LayerNormMLP(k, n, activation=case.activation, **kw)
    if "tp_group" in options:
        kw["parallel_mode"] = case.mode
    return getattr(lib, case.module)(k, n, **kw)


class _Ops(TorchDispatchMode):
    """While active: the storage of every tensor an op returns and the number of collectives
    (``c10d`` ops) dispatched. A storage is kept as its address (``StorageWeakRef.cdata``, its
    identity: the weak reference held here keeps the address from being reused), the weak
    reference, its size and the shape of the tensor first seen on it."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[int, StorageWeakRef, int, tuple[int, ...]]] = []
        self.collectives = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in _COLLECTIVE_NAMESPACES:
            self.collectives += 1
        for t in _tensors(out):
            if t.device.type != "meta":
                self.note(t)
        return out

    def note(self, t: torch.Tensor) -> None:
        s = t.untyped_storage()
        if s.nbytes():
            ref = StorageWeakRef(s)
            self.storages.append((ref.cdata, ref, s.nbytes(), tuple(t.shape)))


def _tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in an op's result (a tensor, or tuples and lists of them: a collective
    returns its tensors and a work handle)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _tensors(item)]
    return []


def _alive(ops: _Ops, exclude: set[int]) -> dict[int, tuple[StorageWeakRef, int, tuple]]:
    """The storages ``ops`` saw that are still alive and not in ``exclude``, by address:
    ``(weak reference, bytes, shape)``."""
    out: dict[int, tuple[StorageWeakRef, int, tuple]] = {}
    for key, ref, nbytes, shape in ops.storages:
        if key not in exclude and not ref.expired():
            out.setdefault(key, (ref, nbytes, shape))
    return out


def _settle(refs: list[StorageWeakRef], quiet_s: float = 0.02, limit_s: float = 2.0) -> None:
    """Wait until none of ``refs`` has expired for ``quiet_s`` (at most ``limit_s``): gloo's
    worker threads drop their reference to a collective's tensors a moment after ``wait()``
    returns (a moment as long as the scheduler keeps the thread off a busy core), so a storage
    the step no longer holds may still be alive for that moment."""
    if not refs:
        return
    deadline = time.monotonic() + limit_s
    alive = sum(not r.expired() for r in refs)
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(quiet_s / 5)
        now = sum(not r.expired() for r in refs)
        if now != alive:
            alive, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return


def _owned(module: torch.nn.Module) -> set[int]:
    """The addresses of the module's parameters' storages, their gradients' and
    ``main_grad``'s."""
    out = set()
    for p in module.parameters():
        for t in (p, p.grad, getattr(p, "main_grad", None)):
            if isinstance(t, torch.Tensor):
                out.add(StorageWeakRef(t.untyped_storage()).cdata)
    return out


def gradients(module: torch.nn.Module, fused: bool) -> dict[str, torch.Tensor | None]:
    """Copies of every parameter's gradient: ``main_grad`` of a fused GEMM weight."""
    out = {}
    for name, p in module.named_parameters():
        g = p.main_grad if fused and name in _WEIGHTS else p.grad
        out[name] = None if g is None else g.detach().clone()
    return out


def _recipe(lib: Any, name: str | None) -> Any:
    return None if name is None else getattr(lib, RECIPES[name])()


def run_module(
    lib: Any,
    case: TPCase,
    vals: Values,
    rank: int,
    group: Any,
    sp_reduce: Any,
    *,
    delay: bool,
    gather: str = "backward",
    quiet_s: float = 0.02,
) -> dict:
    """One step of ``case``'s TP module on rank ``rank``: both micro-batches forward and
    backward, then (``delay``) each ``backward_dw()`` in FIFO order, each counted (and traced
    without FP8: what it releases, what it leaves alive);
    then ``sp_reduce(module, group)``."""
    w = dist.get_world_size(group)
    dtype = _DTYPES[case.dtype]
    options: dict[str, Any] = dict(
        tp_group=group, sequence_parallel=case.sp, delay_wgrad_compute=delay
    )
    if gather != "backward":
        options["wgrad_gather"] = gather
    module = build(lib, case, dtype, **options)
    params = dict(module.named_parameters())
    shards = {n: shard_param(case, n, v, rank, w) for n, v in vals.params.items()}
    if set(params) != set(shards) or any(params[n].shape != shards[n].shape for n in shards):
        got = {n: tuple(p.shape) for n, p in params.items()}
        want = {n: tuple(s.shape) for n, s in shards.items()}
        return {"error": f"parameters {got}, expected (§9's shards) {want}"}
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shards[name])
            prefill = shard_param(case, name, vals.prefill[name], rank, w).clone()
            if case.fused and name in _WEIGHTS:
                p.main_grad = prefill
            else:
                p.grad = prefill
    recipe = _recipe(lib, case.recipe)
    trace = delay and recipe is None
    ops = [_Ops() for _ in vals.data]
    outputs, dxs = [], []
    for i, (x, dy) in enumerate(vals.data):
        xi = shard_input(case, x, rank, w).clone().requires_grad_()
        dyi = shard_output(case, dy, rank, w).clone()
        if trace:
            ops[i].note(xi)
            ops[i].note(dyi)
        with contextlib.ExitStack() as stack:
            if trace:
                stack.enter_context(ops[i])
            if recipe is not None:
                stack.enter_context(lib.fp8_autocast(enabled=True, fp8_recipe=recipe))
            y = module(xi)
        with ops[i] if trace else contextlib.nullcontext():
            y.backward(dyi)
        outputs.append(y.detach().clone())
        dxs.append(None if xi.grad is None else xi.grad.clone())
        del xi, dyi, y
    held, leaked, dw_collectives = [], [], []
    if delay:
        owned = _owned(module)
        _settle([ref for o in ops for _, ref, _, _ in o.storages], quiet_s)
        before = [_alive(o, owned) for o in ops]
        for i, (_, dy) in enumerate(vals.data):
            counter = _Ops()
            with counter:
                module.backward_dw()
            dw_collectives.append(counter.collectives)
            if not trace:
                continue
            _settle([ref for ref, _, _ in before[i].values()], quiet_s)
            freed = [v for v in before[i].values() if v[0].expired()]
            held.append(sum(nbytes for _, nbytes, _ in freed))
            rows = {dy.shape[0], dy.shape[0] // w}
            leaked.append(
                sorted(
                    {
                        shape
                        for ref, _, shape in before[i].values()
                        if not ref.expired() and len(shape) >= 2 and shape[0] in rows
                    }
                )
            )
    pending = int(module.pending_wgrad_count) if delay else 0
    pre = gradients(module, case.fused)
    sp_reduce(module, group)
    marks = {
        n: (
            bool(getattr(p, "tensor_model_parallel", False)),
            getattr(p, "partition_dim", None),
            bool(getattr(p, "sequence_parallel", False)),
        )
        for n, p in params.items()
    }
    return {
        "outputs": outputs,
        "dxs": dxs,
        "pre": pre,
        "post": gradients(module, case.fused),
        "marks": marks,
        "pending": pending,
        "held": held,
        "leaked": leaked,
        "dw_collectives": dw_collectives,
    }


def _sum_sequence_parallel_grads(module: torch.nn.Module, group: Any) -> None:
    """Until ``splitgrad.distributed`` has it: sum the ``.grad`` of every parameter marked
    ``sequence_parallel`` over ``group`` (what §9 says of
    ``allreduce_sequence_parallel_grads``)."""
    for p in module.parameters():
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def _sp_reduce(name: str) -> Any:
    try:
        return load_library(name)
    except AttributeError:
        if name != SP_REDUCE:
            raise
        return _sum_sequence_parallel_grads


def gather_modes(lib: Any, case: TPCase) -> tuple[str, ...]:
    """The ``wgrad_gather`` modes ``case`` runs: both under SP where ``lib`` has the option
    (splitgrad's; TransformerEngine has only the default), the default alone without SP (where
    nothing is gathered the modes are one)."""
    if not case.sp:
        return ("backward",)
    accepted = keywords(getattr(lib, case.module))
    if accepted is not None and "wgrad_gather" not in accepted:
        return ("backward",)
    return ("backward", "backward_dw")


def _tp_rank(rank: int, world: int, lib_name: str, cases: list[TPCase], reduce_name: str) -> list:
    """Every case on this rank: per ``wgrad_gather`` mode the non-delayed and the delayed run,
    and the naive yardstick, the reference's non-delayed run reduced by ``SP_REDUCE``, unless
    that is the package's own run."""
    from splitgrad.properties.front.campaign import deterministic

    lib = load_library(lib_name)
    reference = load_library("reference")
    sp_reduce, reduce_truly = _sp_reduce(reduce_name), _sp_reduce(SP_REDUCE)
    own_naive = lib is reference and sp_reduce is reduce_truly
    group = dist.group.WORLD
    out = []
    with deterministic():
        for case in cases:
            vals = values(case)
            runs: dict[str, Any] = {}
            for gather in gather_modes(lib, case):
                for delay in (False, True):
                    key = f"{gather} {'delayed' if delay else 'non-delayed'}"
                    runs[key] = run_module(
                        lib, case, vals, rank, group, sp_reduce, delay=delay, gather=gather
                    )
            _remeasure_if_suspect(lib, case, vals, rank, group, sp_reduce, runs)
            if not own_naive and case.dtype != "float64":
                runs["naive"] = run_module(
                    reference, case, vals, rank, group, reduce_truly, delay=False
                )
            out.append(runs)
    return out


def _remeasure_if_suspect(lib, case, vals, rank, group, sp_reduce, runs) -> None:
    """If (5) fails on any rank, every rank runs the delayed runs again and measures what
    their entries hold after waiting 10 times longer for gloo's threads: a storage a worker
    thread let go late is no finding, a real one shows again (every rank agrees on the
    re-run: it has collectives)."""
    if any("error" in r for r in runs.values()):
        return
    suspect = torch.tensor([float(bool(memory_findings(case, rank, runs)))])
    dist.all_reduce(suspect, op=dist.ReduceOp.MAX, group=group)
    if not suspect.item():
        return
    for key in [k for k in runs if k.endswith(" delayed")]:
        again = run_module(
            lib, case, vals, rank, group, sp_reduce, delay=True, gather=key.split()[0], quiet_s=0.2
        )
        runs[key].update(held=again["held"], leaked=again["leaked"], remeasured=True)


# ---- the single-process baselines -------------------------------------------------------------
def _single(lib: Any, case: TPCase, vals: Values, dtype: torch.dtype, recipe: Any) -> dict:
    """The module holding the full weights, without delay, in one process: both micro-batches
    from the prefill. A fused ``main_grad`` in float64 (the truth) is a plain ``.grad``."""
    fused = case.fused and dtype != torch.float64
    module = build(lib, dataclasses.replace(case, fused=fused), dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(vals.params[name].to(dtype))
            pre = vals.prefill[name]
            if fused and name in _WEIGHTS:
                p.main_grad = pre.clone()
            else:
                p.grad = pre.to(dtype).clone()
    outputs, dxs = [], []
    for x, dy in vals.data:
        xi = x.to(dtype).clone().requires_grad_()
        ctx = (
            lib.fp8_autocast(enabled=True, fp8_recipe=recipe)
            if recipe
            else contextlib.nullcontext()
        )
        with ctx:
            y = module(xi)
        y.backward(dy.to(dtype))
        outputs.append(y.detach().clone())
        dxs.append(xi.grad.clone())
    return {"outputs": outputs, "dxs": dxs, "grads": gradients(module, fused)}


def _tp_truth(rank: int, world: int, cases: list[TPCase]) -> list:
    """Per case: the float64 truth and, below float64, the naive run (``splitgrad.reference``
    in the case's dtype and recipe), both single-process."""
    from splitgrad.properties.front.campaign import deterministic

    ref = load_library("reference")
    out = []
    with deterministic():
        for case in cases:
            vals = values(case)
            truth = _single(ref, case, vals, torch.float64, None)
            naive = None
            if case.dtype != "float64":
                dtype = _DTYPES[case.dtype]
                naive = _single(ref, case, vals, dtype, _recipe(ref, case.recipe))
            out.append({"truth": truth, "naive": naive, "prefill": vals.prefill})
    return out


# ---- judging -----------------------------------------------------------------------------------
def _budget_of(name: str) -> B.ErrorBudget:
    if name.startswith("output"):
        return B.OUTPUT
    if name.startswith("inp.grad"):
        return B.DGRAD
    return B.NORM_GRAD if name.split(".")[0] in _NORMS else B.WGRAD


def _judge(
    report: DistributedReport,
    where: str,
    case: TPCase,
    name: str,
    got: torch.Tensor | None,
    truth: torch.Tensor | None,
    naives: list[torch.Tensor | None],
    prefill: torch.Tensor | None = None,
) -> None:
    """One tensor against the float64 truth: float64 with :data:`~..budgets.
    TENSOR_PARALLEL_FLOAT64`'s floor, below with the tier-2 budget of its kind against the
    worse of ``naives``, under FP8 with :data:`~..budgets.FP8`."""
    label = f"{where} {name}"
    dtype = _DTYPES[case.dtype]
    main_grad = case.fused and name.split(".")[0] in _WEIGHTS and dtype != torch.float64
    floor_dtype = torch.float32 if main_grad else dtype
    magnitude = None
    if prefill is not None and truth is not None and truth.numel():
        magnitude = B.accumulation_magnitude(truth, prefill)
    try:
        if got is not None and truth is not None and got.shape != truth.shape:
            raise B.BudgetViolation(
                label, f"{label}: shape {tuple(got.shape)}, expected {tuple(truth.shape)}"
            )
        if case.dtype == "float64":
            ratio = B.check_error_budget(
                label, got, truth, truth, B.TENSOR_PARALLEL_FLOAT64, floor_magnitude=magnitude
            )
        else:
            present = [
                n for n in naives if n is not None and truth is not None and n.shape == truth.shape
            ]
            naive = max(
                present,
                key=lambda n: float((n.double() - truth.double()).abs().max()),
                default=None,
            )
            if case.recipe is None:
                ratio = B.check_error_budget(
                    label,
                    got,
                    truth,
                    naive,
                    _budget_of(name),
                    floor_dtype,
                    dtype,
                    floor_magnitude=magnitude,
                )
            else:
                # gradients meet E5M2 under the per-tensor recipes' HYBRID format
                coarse = case.recipe in ("delayed", "current") and not name.startswith("output")
                k, n, tokens = case.sizes()
                ratio = B.check_fp8_budget(
                    label,
                    got,
                    truth,
                    naive,
                    B.FP8,
                    floor_dtype,
                    dtype,
                    case.recipe,
                    2.0**-2 if coarse else 2.0**-3,
                    min(k, n // case.world, *tokens),
                )
    except B.BudgetViolation as exc:
        report.counted(exc.ratio)
        report.failures.append(str(exc))
        return
    report.counted(ratio)


def _prefill_after(case: TPCase, name: str, prefill: torch.Tensor) -> torch.Tensor:
    """What the prefill of ``name`` amounts to after the SP reduction: summed over the ranks
    for a parameter it reduces."""
    return prefill * case.world if case.sp and replicated(case, name) else prefill


def _expected_truth(case: TPCase, name: str, truth: torch.Tensor, prefill: torch.Tensor):
    """The truth of a gradient after the SP reduction (every rank's prefill summed too)."""
    if case.sp and replicated(case, name):
        return truth + (case.world - 1) * prefill.double()
    return truth


def _compare_case(report: DistributedReport, case: TPCase, ranks: list[dict], base: dict) -> None:
    """Properties (1)-(5) of one case from every rank's runs and the baselines."""
    w = case.world
    truth, naive_single, prefills = base["truth"], base["naive"], base["prefill"]
    for rank, runs in enumerate(ranks):
        errors = {k: r["error"] for k, r in runs.items() if "error" in r}
        if errors:
            for k, e in errors.items():
                report.failures.append(f"{case.label} rank {rank} {k}: {e}")
            report.counted(math.inf)
            continue
        modes = sorted({k.split()[0] for k in runs if k != "naive"})
        for gather in modes:
            nd, d = runs[f"{gather} non-delayed"], runs[f"{gather} delayed"]
            where = f"{case.label} world {w} rank {rank} wgrad_gather={gather}"
            # (1) delayed == non-delayed, bitwise, before the SP reduction
            for i in range(len(nd["outputs"])):
                report.bitwise(f"{where} output[{i}] delayed", d["outputs"][i], nd["outputs"][i])
                report.bitwise(f"{where} inp.grad[{i}] delayed", d["dxs"][i], nd["dxs"][i])
            for name in nd["pre"]:
                report.bitwise(f"{where} {name} delayed vs not", d["pre"][name], nd["pre"][name])
            report.counted()
            if d["pending"]:
                report.failures.append(f"{where}: {d['pending']} entries left pending")
            # (2) within budget of the float64 truth, after the SP reduction
            naive_tp = runs.get("naive", nd)
            for i, (x, dy) in enumerate(zip(truth["outputs"], truth["dxs"])):
                out_name, dx_name = f"output[micro-batch {i}]", f"inp.grad[micro-batch {i}]"
                naives = (
                    [shard_output(case, naive_single["outputs"][i], rank, w)]
                    if naive_single
                    else []
                )
                _judge(
                    report,
                    where,
                    case,
                    out_name,
                    d["outputs"][i],
                    shard_output(case, x, rank, w),
                    naives + [naive_tp["outputs"][i]],
                )
                naives = (
                    [shard_input(case, naive_single["dxs"][i], rank, w)] if naive_single else []
                )
                _judge(
                    report,
                    where,
                    case,
                    dx_name,
                    d["dxs"][i],
                    shard_input(case, dy, rank, w),
                    naives + [naive_tp["dxs"][i]],
                )
            for name, g in d["post"].items():
                pre = shard_param(case, name, prefills[name], rank, w)
                want = _expected_truth(
                    case, name, shard_param(case, name, truth["grads"][name], rank, w), pre
                )
                naives = [naive_tp["post"].get(name)]
                if naive_single is not None:
                    single = shard_param(case, name, naive_single["grads"][name], rank, w)
                    naives.append(_expected_truth(case, name, single.double(), pre))
                slot = f"{name}.main_grad" if case.fused and name in _WEIGHTS else f"{name}.grad"
                _judge(report, where, case, slot, g, want, naives, _prefill_after(case, name, pre))
            # (4) collectives inside backward_dw()
            report.counted()
            counts = d["dw_collectives"]
            if gather == "backward" and any(counts):
                report.failures.append(
                    f"{where}: collectives inside backward_dw() in the default mode: {counts} "
                    "per call (SPEC §9: every TP collective finishes inside backward())"
                )
            if gather == "backward_dw" and not all(counts):
                report.failures.append(
                    f"{where}: backward_dw() ran {counts} collectives per call; in "
                    "'backward_dw' mode each must all-gather its entry's shard"
                )
        report.failures += memory_findings(case, rank, runs, report.counted)
        if any(r.get("remeasured") for r in runs.values()):
            report.notes.append(f"{case.label} world {w} rank {rank}: entries measured again")
    _compare_replicas(report, case, ranks)


def memory_findings(
    case: TPCase, rank: int, runs: dict, counted: Callable[[], None] = lambda: None
) -> list[str]:
    """(5) from one rank's runs of ``case`` (without FP8, whose entries hold quantized copies):
    every tensor of a micro-batch's rows freed by its ``backward_dw()`` (P11 under TP); under
    SP, at least the gathered operands (``tp`` shards each) released by each default-mode
    entry, at least ``tp - 1`` shards each more than by a ``"backward_dw"``-mode entry.
    ``counted`` is called once per comparison."""
    if case.recipe is not None:
        return []
    w, elem = case.world, torch.empty((), dtype=_DTYPES[case.dtype]).element_size()
    out = []
    for key, run in runs.items():
        for i, shapes in enumerate(run["leaked"] if key.endswith(" delayed") else ()):
            counted()
            if shapes:
                out.append(
                    f"{case.label} world {w} rank {rank} wgrad_gather={key.split()[0]}: "
                    f"micro-batch {i}'s tensors of shapes {shapes} still alive after its "
                    "backward_dw()"
                )
    if not case.sp:
        return out  # nothing is gathered
    te = runs["backward delayed"]["held"]
    lazy = runs.get("backward_dw delayed", {}).get("held")
    _, _, tokens = case.sizes()
    for i, t in enumerate(tokens):
        shard = gathered_operands(case) * (t // w) * _operand_width(case) * elem
        where = f"{case.label} world {w} rank {rank} micro-batch {i}"
        counted()
        if te[i] < w * shard:
            out.append(
                f"{where}: the default-mode entry released {te[i]} bytes in backward_dw(), less "
                f"than the gathered operand(s) it must hold ({w} x {shard} bytes)"
            )
        if lazy is not None:
            counted()
            if te[i] - lazy[i] < (w - 1) * shard:
                out.append(
                    f"{where}: the 'backward_dw'-mode entry held {lazy[i]} bytes, the default "
                    f"mode's {te[i]}: expected at least {(w - 1) * shard} bytes ({w - 1} "
                    "shards) less, the entry keeping only the shard"
                )
    return out


def _compare_replicas(report: DistributedReport, case: TPCase, ranks: list[dict]) -> None:
    """(3) and the §9 attributes: replicated gradients bitwise equal on every rank after the
    SP reduction, each run's parameters marked as §9 says."""
    if any("error" in r for runs in ranks for r in runs.values()):
        return
    marked = False
    for key, first in ranks[0].items():
        if key == "naive":
            continue
        for name in first["post"]:
            if not replicated(case, name):
                continue
            for rank in range(1, len(ranks)):
                report.bitwise(
                    f"{case.label} world {case.world} {key} {name} rank {rank} vs rank 0 after "
                    "the SP reduction",
                    ranks[rank][key]["post"][name],
                    first["post"][name],
                )
        if marked:
            continue
        marked = True  # the attributes once per case: every run builds the same module
        for name, (tmp, dim, sp) in first["marks"].items():
            want = (partition_dim(case, name) is not None, partition_dim(case, name))
            want_sp = case.sp and replicated(case, name)
            report.counted()
            if (tmp, dim) != want or sp != want_sp:
                report.failures.append(
                    f"{case.label} world {case.world} {key} {name}: attributes "
                    f"tensor_model_parallel={tmp}, partition_dim={dim}, sequence_parallel={sp}; "
                    f"§9 gives {want[0]}, {want[1]}, {want_sp}"
                )


# ---- support and the check ----------------------------------------------------------------------
def not_a_package(lib_name: str) -> bool:
    """Whether ``lib_name`` names a backend of the harness that is no package of modules
    (``torch-split``: PyPI's generic split on ``torch.nn`` twins, which has no TP options)."""
    return lib_name in BACKEND_NAMES and not isinstance(get_backend(lib_name), LibraryBackend)


def tp_support(lib_name: str) -> str | None:
    """Why P19 cannot run on the package ``lib_name`` names (``None``: it can): a backend that
    is no package of modules, or modules without §9's options. A package that cannot be
    imported raises what importing it raised."""
    if not_a_package(lib_name):
        return f"backend {lib_name!r} is no package of modules with SPEC §9's options"
    if lib_name == "transformer_engine":
        return (
            "TransformerEngine's modules run on CUDA over NCCL; P19 runs gloo ranks on the CPU "
            "(the cases TE's own tests leave unchecked: TransformerEngineBackend.notes)"
        )
    lib = load_library(lib_name)
    missing = []
    for kind, option in (
        ("Linear", "parallel_mode"),
        ("LayerNormLinear", "parallel_mode"),
        ("LayerNormMLP", "set_parallel_mode"),
    ):
        cls = getattr(lib, kind, None)
        options = {"tp_group", option, "sequence_parallel"}
        if cls is None:
            missing.append(f"no {kind}")
            continue
        accepted = keywords(cls)
        if accepted is None:
            # **kwargs: SPEC §2's modules keep their options as attributes of the same name
            accepted = {o for o in options if hasattr(cls(4, 4), o)} | {"tp_group"}
        if not options <= accepted:
            missing.append(f"{kind}() takes no tp_group / {option} / sequence_parallel")
    return "; ".join(missing) or None


def check_tensor_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    world_sizes: tuple[int, ...] = (2, 4),
    profile: str = "ci",
    kinds: tuple[str, ...] = TP_KINDS,
    dtypes: tuple[str, ...] = TP_DTYPES,
    recipes: tuple[str | None, ...] = (None, *RECIPES),
    sp: tuple[bool, ...] = (False, True),
    sp_reduce: str = SP_REDUCE,
    timeout_s: float = 600.0,
) -> DistributedReport:
    """P19 on each of ``world_sizes`` gloo worlds (one spawn each, every case inside it) and
    the single-process baselines (one spawn). ``kinds``, ``dtypes``, ``recipes``, ``sp``
    narrow the matrix of :func:`tp_cases`; ``sp_reduce`` names the reduction of the replicated
    gradients (``"module:function"``, called as ``fn(module, tp_group)``). A package without
    §9's options gives a report that is ``not_supported``, naming why."""
    report = DistributedReport(f"P19 {lib_name} on {'/'.join(map(str, world_sizes))} ranks")
    why = tp_support(lib_name)
    if why is not None:
        report.not_supported = why
        return report
    per_world = {
        w: tp_cases(w, profile, kinds=kinds, dtypes=dtypes, recipes=recipes, sp=sp)
        for w in world_sizes
    }
    unique = list(dict.fromkeys(c for cases in per_world.values() for c in cases))
    truth = baseline(report, _tp_truth, unique, timeout_s=timeout_s)
    if truth is None:
        return report
    base = dict(zip(unique, truth))
    for w, cases in per_world.items():
        results = run_checked(
            report, f"{w} TP ranks", _tp_rank, w, lib_name, cases, sp_reduce, timeout_s=timeout_s
        )
        if results is None:
            continue
        for k, case in enumerate(cases):
            _compare_case(report, case, [r[k] for r in results], base[case])
    report.notes.append(
        "entry holdings are measured under SP without FP8 (an FP8 entry holds quantized copies)"
        + ("; Float8BlockScaling on 2 ranks only (nightly: 4 too)" if profile == "ci" else "")
    )
    return report
