"""Launch cost: the Python cost of one module call against the thinnest split that can exist.

On a GPU a step with little work per module is bound by the host: the Python run per call decides
whether the GPU waits. On the CPU, at small shapes, that cost is CPU time and can be measured
here exactly. For each module this compares three things on the same parameters and input:

* ``torch.nn``: the module's ``torch.nn`` twin through plain autograd (``Linear``; ``LayerNorm``
  + ``Linear``; ``LayerNorm`` + ``Linear`` + tanh-GELU + ``Linear``; a loop of ``Linear`` over
  ``torch.split``) — no split;
* ``floor``: the thinnest ``torch.autograd.Function`` that splits the same math — it issues the
  very kernels ``splitgrad.impl`` issues on this path (same GEMMs, same norm and activation
  kernels, same precision steps) and nothing else: no option, input or hook checks, no
  routing; delayed, its backward queues one closure per call on a list that its
  ``backward_dw()`` pops (no check that anything is queued). No Python-level split can cost less;
* ``impl``: ``splitgrad.impl``'s module.

Columns: ``forward`` (under ``torch.no_grad()``), ``fwd+bwd`` (forward, ``backward(dy)``), and
``delayed fwd+bwd+dw`` (``delay_wgrad_compute=True``: forward, backward, ``backward_dw()``).
Measurement: one intra-op thread, process CPU time, ``--rounds`` interleaved rounds (each round
runs every variant of a cell ``--calls`` times back to back, in a rotating order), the median of
the per-round ratios. Ratios from one run only: this machine is noisy, so nothing here is a test.

    splitgrad launch [--rounds 15] [--calls 200] [--markdown] [--json PATH]
        [--modules Linear,...] [--dtypes float32,bfloat16] [--no-fp8] [--calls-only]

``--calls-only`` prints the number of Python function calls (``cProfile``) of one forward +
backward of each variant instead: a count that does not depend on timing
(``tests/test_launch_cost.py`` bounds it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable

import splitgrad.impl as impl
import torch
import torch.nn.functional as F
from splitgrad.impl.fp8 import quantize
from splitgrad.impl.fp8_gemm import fp8_mm
from splitgrad.properties.front.command_line import pick
from splitgrad.reference.fp8 import fp8_active_recipe

from .options import output_file, positive_int

__all__ = ["FLOORS", "TWINS", "build", "call_counts", "main", "measure"]

#: The small shapes (tokens, hidden, out/ffn, groups): host-bound on a GPU.
SHAPES = {"tokens": 64, "hidden": 128, "out": 128, "ffn": 256, "groups": 4}
MODULES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: The FP8 recipe of the FP8 rows (Linear, bf16): per-tensor current scaling.
FP8_RECIPE = "Float8CurrentScaling"
COLUMNS = ("forward", "fwd+bwd", "delayed fwd+bwd+dw")


# ---- the floors -----------------------------------------------------------------------------


def _write(param: torch.Tensor, g: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = g
    else:
        param.grad.add_(g)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _ln_fwd(x, g, b, eps):
    # impl's CPU LayerNorm: the fused kernel with fp32 gamma/beta (mixed dtype for bf16); in
    # fp32 the ill-conditioning test (one aminmax and a host read) that impl also runs.
    y, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], _f32(g), _f32(b), eps)
    if x.dtype == torch.float32:
        lo, hi = torch.aminmax(mean * rstd)
        lo.item() < -1 or hi.item() > 1
    return y, mean, rstd


def _ln_bwd(d, x, mean, rstd, g, b):
    k = [x.shape[-1]]
    if x.dtype == torch.float32:
        return torch.ops.aten.native_layer_norm_backward(d, x, k, mean, rstd, g, b, [True] * 3)
    dt, g, b = g.dtype, _f32(g), _f32(b)
    dx = torch.ops.aten.native_layer_norm_backward(d, x, k, mean, rstd, g, b, [True, False, False])[
        0
    ]
    _, dg, db = torch.ops.aten.native_layer_norm_backward(
        d.float(), x.float(), k, mean, rstd, g, b, [False, True, True]
    )
    return dx, dg.to(dt), db.to(dt)


class _FloorLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, queue):
        ctx.save_for_backward(x, w)
        ctx.queue = queue
        return torch.addmm(b, x, w.t())

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = torch.mm(dy, w)
        if ctx.queue is not None:
            ctx.queue.append((dy, x))
            return dx, None, None, None
        return dx, torch.mm(dy.t(), x), dy.sum(0), None


class _FloorFP8Linear(torch.autograd.Function):
    """The FP8 floor: impl's own quantizer (:func:`splitgrad.impl.fp8.quantize`) and FP8 GEMM
    (:func:`splitgrad.impl.fp8_gemm.fp8_mm`) calls, one row-wise copy per tensor serving both
    directions (the per-tensor recipes' scales do), the bias gradient summed from the
    unquantized dy as impl does."""

    @staticmethod
    def forward(ctx, x, w, b, recipe, queue):
        xq, wq = quantize(x, recipe, "input", 1), quantize(w, recipe, "weight", 1)
        ctx.xq, ctx.wq, ctx.recipe, ctx.queue, ctx.w_dtype = xq, wq, recipe, queue, w.dtype
        return fp8_mm(xq, False, wq, True, out_dtype=x.dtype, compute_dtype=_F32, bias=b)

    @staticmethod
    def backward(ctx, dy):
        xq, wq, ctx.xq, ctx.wq = ctx.xq, ctx.wq, None, None
        dyq = quantize(dy, ctx.recipe, "grad_output", 1)
        dx = fp8_mm(dyq, False, wq, False, out_dtype=dy.dtype, compute_dtype=_F32)
        if ctx.queue is not None:
            ctx.queue.append((dyq, xq, dy.sum(0)))
            return dx, None, None, None, None
        dw = fp8_mm(dyq, True, xq, False, out_dtype=ctx.w_dtype, compute_dtype=_F32)
        return dx, dw, dy.sum(0), None, None


_F32 = torch.float32


class _FloorLayerNormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, beta, w, b, queue, eps):
        y, mean, rstd = _ln_fwd(x, g, beta, eps)
        ctx.save_for_backward(x, y, mean, rstd, g, beta, w)
        ctx.queue = queue
        return torch.addmm(b, y, w.t())

    @staticmethod
    def backward(ctx, dy):
        x, ln_out, mean, rstd, g, beta, w = ctx.saved_tensors
        dx, dg, dbeta = _ln_bwd(torch.mm(dy, w), x, mean, rstd, g, beta)
        if ctx.queue is not None:
            ctx.queue.append((dy, ln_out))
            return dx, dg, dbeta, None, None, None, None
        return dx, dg, dbeta, torch.mm(dy.t(), ln_out), dy.sum(0), None, None


class _FloorLayerNormMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, beta, w1, b1, w2, b2, queue, eps):
        y, mean, rstd = _ln_fwd(x, g, beta, eps)
        h = torch.addmm(b1, y, w1.t())
        a = F.gelu(h, approximate="tanh")
        ctx.save_for_backward(x, y, mean, rstd, g, beta, w1, h, a, w2)
        ctx.queue = queue
        return torch.addmm(b2, a, w2.t())

    @staticmethod
    def backward(ctx, dy):
        x, ln_out, mean, rstd, g, beta, w1, h, a, w2 = ctx.saved_tensors
        dh = torch.ops.aten.gelu_backward(torch.mm(dy, w2), h, approximate="tanh")
        dx, dg, dbeta = _ln_bwd(torch.mm(dh, w1), x, mean, rstd, g, beta)
        if ctx.queue is not None:
            ctx.queue.append((dy, a, dh, ln_out))
            return dx, dg, dbeta, None, None, None, None, None, None
        dw2, db2 = torch.mm(dy.t(), a), dy.sum(0)
        dw1, db1 = torch.mm(dh.t(), ln_out), dh.sum(0)
        return dx, dg, dbeta, dw1, db1, dw2, db2, None, None


class _FloorGrouped(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, queue, *params):
        n = len(params) // 2
        xs = torch.split(x, m_splits)
        out = torch.cat([torch.addmm(b, xi, w.t()) for xi, w, b in zip(xs, params[:n], params[n:])])
        ctx.save_for_backward(x, *params[:n])
        ctx.m_splits, ctx.queue = m_splits, queue
        return out

    @staticmethod
    def backward(ctx, dy):
        x, *ws = ctx.saved_tensors
        dys, xs = torch.split(dy, ctx.m_splits), torch.split(x, ctx.m_splits)
        dx = torch.cat([torch.mm(d, w) for d, w in zip(dys, ws)])
        if ctx.queue is not None:
            ctx.queue.append((dys, xs))
            return dx, None, None, *(None,) * (2 * len(ws))
        dws = [torch.mm(d.t(), xi) for d, xi in zip(dys, xs)]
        return dx, None, None, *dws, *(d.sum(0) for d in dys)


class _Floor(torch.nn.Module):
    """A floor module on ``params`` (the impl module's, copied): ``forward`` and, delayed,
    ``backward_dw`` (the wgrads of the oldest queued call into ``.grad``)."""

    def __init__(self, kind: str, source: torch.nn.Module, delay: bool) -> None:
        super().__init__()
        self.kind, self.eps = kind, getattr(source, "eps", 1e-5)
        for name, p in source.named_parameters():
            self.register_parameter(name, torch.nn.Parameter(p.detach().clone()))
        self.queue: list | None = [] if delay else None
        p = self._parameters
        names = {
            "Linear": ("weight", "bias"),
            "LayerNormLinear": ("layer_norm_weight", "layer_norm_bias", "weight", "bias"),
            "LayerNormMLP": (
                "layer_norm_weight",
                "layer_norm_bias",
                "fc1_weight",
                "fc1_bias",
                "fc2_weight",
                "fc2_bias",
            ),
        }.get(kind)
        if names is None:
            n = source.num_gemms
            names = tuple(f"weight{i}" for i in range(n)) + tuple(f"bias{i}" for i in range(n))
        self.params = tuple(p[n] for n in names)

    def forward(self, x, m_splits=None):
        q, ps = self.queue, self.params
        if self.kind == "Linear":
            recipe = fp8_active_recipe()
            if recipe is not None:
                return _FloorFP8Linear.apply(x, *ps, recipe, q)
            return _FloorLinear.apply(x, *ps, q)
        if self.kind == "LayerNormLinear":
            return _FloorLayerNormLinear.apply(x, *ps, q, self.eps)
        if self.kind == "LayerNormMLP":
            return _FloorLayerNormMLP.apply(x, *ps, q, self.eps)
        return _FloorGrouped.apply(x, m_splits, q, *ps)

    def backward_dw(self) -> None:
        saved, ps = self.queue.pop(0), self.params
        with torch.no_grad():
            if len(saved) == 3:  # FP8 Linear
                dyq, xq, db = saved
                w = ps[0]
                _write(w, fp8_mm(dyq, True, xq, False, out_dtype=w.dtype, compute_dtype=_F32))
                _write(ps[1], db)
            elif self.kind in ("Linear", "LayerNormLinear"):
                dy, x = saved
                _write(ps[-2], torch.mm(dy.t(), x))
                _write(ps[-1], dy.sum(0))
            elif self.kind == "LayerNormMLP":
                dy, a, dh, ln_out = saved
                _write(ps[4], torch.mm(dy.t(), a))
                _write(ps[5], dy.sum(0))
                _write(ps[2], torch.mm(dh.t(), ln_out))
                _write(ps[3], dh.sum(0))
            else:
                dys, xs = saved
                n = len(ps) // 2
                for w, b, d, xi in zip(ps[:n], ps[n:], dys, xs):
                    _write(w, torch.mm(d.t(), xi))
                    _write(b, d.sum(0))


#: The floor of each module: ``FLOORS[kind](impl_module, delay)``.
FLOORS: dict[str, Callable[..., torch.nn.Module]] = {
    k: (lambda source, delay, k=k: _Floor(k, source, delay)) for k in MODULES
}


class _GroupedTwin(torch.nn.Module):
    def __init__(self, source) -> None:
        super().__init__()
        n = source.num_gemms
        self.linears = torch.nn.ModuleList()
        for i in range(n):
            dt = source.weight0.dtype
            lin = torch.nn.Linear(source.in_features, source.out_features, dtype=dt)
            with torch.no_grad():
                lin.weight.copy_(getattr(source, f"weight{i}"))
                lin.bias.copy_(getattr(source, f"bias{i}"))
            self.linears.append(lin)

    def forward(self, x, m_splits):
        return torch.cat([lin(xi) for lin, xi in zip(self.linears, torch.split(x, m_splits))])


def _twin(kind: str, source: torch.nn.Module) -> torch.nn.Module:
    """The ``torch.nn`` twin of an impl module, with its values."""
    if kind == "GroupedLinear":
        return _GroupedTwin(source)
    dt = next(source.parameters()).dtype
    h = SHAPES["hidden"]
    layers = []
    if kind != "Linear":
        ln = torch.nn.LayerNorm(h, eps=source.eps, dtype=dt)
        with torch.no_grad():
            ln.weight.copy_(source.layer_norm_weight)
            ln.bias.copy_(source.layer_norm_bias)
        layers.append(ln)
    pairs = [("weight", "bias")] if kind != "LayerNormMLP" else [("fc1_weight", "fc1_bias")]
    if kind == "LayerNormMLP":
        pairs.append(("fc2_weight", "fc2_bias"))
    for j, (w, b) in enumerate(pairs):
        wt = getattr(source, w)
        lin = torch.nn.Linear(wt.shape[1], wt.shape[0], dtype=dt)
        with torch.no_grad():
            lin.weight.copy_(wt)
            lin.bias.copy_(getattr(source, b))
        layers.append(lin)
        if kind == "LayerNormMLP" and j == 0:
            layers.append(torch.nn.GELU(approximate="tanh"))
    return layers[0] if kind == "Linear" else torch.nn.Sequential(*layers)


#: The ``torch.nn`` twin of each module: ``TWINS[kind](impl_module)``.
TWINS = {k: (lambda source, k=k: _twin(k, source)) for k in MODULES}


def build(
    kind: str, dtype: torch.dtype, delay: bool, seed: int = 0, package=impl
) -> torch.nn.Module:
    """The module of the small shapes from ``package`` (impl, or a baseline copy of it),
    parameters in ``dtype``."""
    torch.manual_seed(seed)
    s, opts = SHAPES, {"params_dtype": dtype, "delay_wgrad_compute": delay}
    if kind == "Linear":
        return package.Linear(s["hidden"], s["out"], **opts)
    if kind == "LayerNormLinear":
        return package.LayerNormLinear(s["hidden"], s["out"], **opts)
    if kind == "LayerNormMLP":
        return package.LayerNormMLP(s["hidden"], s["ffn"], **opts)
    return package.GroupedLinear(s["groups"], s["hidden"], s["out"], **opts)


#: A second impl (``--baseline DIR``: a copy of an older ``impl/``), timed in the same rounds.
BASELINE: list = []


# ---- one call of each column -----------------------------------------------------------------


def _inputs(kind: str, dtype: torch.dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    s = SHAPES
    x = torch.randn(s["tokens"], s["hidden"], generator=g).to(dtype)
    out = s["hidden"] if kind == "LayerNormMLP" else s["out"]
    dy = torch.randn(s["tokens"], out, generator=g).to(dtype)
    args = ([s["tokens"] // s["groups"]] * s["groups"],) if kind == "GroupedLinear" else ()
    return x, dy, args


def _calls(module, x, dy, args, column: str, delayed: bool) -> Callable[[], None]:
    """A zero-argument call running one ``column`` step of ``module``."""
    if column == "forward":

        def run():
            with torch.no_grad():
                module(x, *args)

        return run
    xg = x.detach().requires_grad_(True)

    def step():
        xg.grad = None
        module(xg, *args).backward(dy)
        if delayed:
            module.backward_dw()

    return step


def _variants(kind: str, dtype: torch.dtype, column: str, fp8: bool = False) -> dict:
    """name -> zero-argument step, for one cell."""
    delayed = column.startswith("delayed")
    source = build(kind, dtype, delayed)
    x, dy, args = _inputs(kind, dtype)
    out = {}
    if not delayed:
        out["torch.nn"] = _calls(TWINS[kind](source), x, dy, args, column, False)
    out["floor"] = _calls(FLOORS[kind](source, delayed), x, dy, args, column, delayed)
    out["impl"] = _calls(source, x, dy, args, column, delayed)
    for package in BASELINE:
        other = build(kind, dtype, delayed, package=package)
        out["baseline"] = _calls(other, x, dy, args, column, delayed)
    if fp8:
        return {k: _under_fp8(v) for k, v in out.items() if k != "torch.nn"}
    return out


def _under_fp8(step: Callable[[], None]) -> Callable[[], None]:
    recipe = getattr(impl, FP8_RECIPE)()

    def run():
        with impl.fp8_autocast(fp8_recipe=recipe):
            step()

    return run


def measure(steps: dict[str, Callable[[], None]], rounds: int, calls: int) -> dict[str, float]:
    """Median over ``rounds`` of each variant's CPU time per call (µs) and of its ratio to
    ``floor`` / ``torch.nn`` within the round (``impl / floor`` ...)."""
    names = list(steps)
    for step in steps.values():  # warm up: first-call caches, lazy imports
        for _ in range(3):
            step()
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for n in order:
            step = steps[n]
            t0 = time.process_time()
            for _ in range(calls):
                step()
            per_round[n].append((time.process_time() - t0) / calls * 1e6)
    out = {f"{n} us": statistics.median(v) for n, v in per_round.items()}
    for base in ("floor", "torch.nn"):
        if base not in per_round:
            continue
        for n in names:
            if n != base:
                ratios = [a / b for a, b in zip(per_round[n], per_round[base])]
                out[f"{n} / {base}"] = statistics.median(ratios)
    return out


def call_counts(kind: str, dtype: torch.dtype, column: str = "fwd+bwd") -> dict[str, int]:
    """Python function calls (``cProfile``'s count, builtins included) of one step of each
    variant, after warm-up."""
    out = {}
    for name, step in _variants(kind, dtype, column).items():
        for _ in range(3):
            step()
        prof = cProfile.Profile()
        prof.enable()
        step()
        prof.disable()
        out[name] = pstats.Stats(prof).total_calls
    return out


def run(modules, dtypes, rounds: int, calls: int, fp8: bool) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    cells = [(k, d, c, False) for k in modules for d in dtypes for c in COLUMNS]
    if fp8 and "Linear" in modules:
        cells += [("Linear", "bfloat16", c, True) for c in COLUMNS]
    for kind, dname, column, fp8_cell in cells:
        steps = _variants(kind, DTYPES[dname], column, fp8_cell)
        row = {"module": kind, "dtype": dname + (f" {FP8_RECIPE}" if fp8_cell else "")}
        row.update(column=column, **measure(steps, rounds, calls))
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict) -> str:
    ratios = "  ".join(f"{k} {v:.3f}" for k, v in row.items() if " / " in k)
    return f"{row['module']:16s} {row['dtype']:28s} {row['column']:20s} {ratios}"


def markdown(rows: list[dict]) -> str:
    s = SHAPES
    ratios = ["impl / floor", "baseline / floor", "impl / torch.nn", "floor / torch.nn"]
    ratios = [k for k in ratios if any(k in r for r in rows)]
    lines = [
        f"Small shapes: {s['tokens']} tokens, hidden {s['hidden']}, out {s['out']}, ffn "
        f"{s['ffn']}, {s['groups']} groups; one thread, CPU time, median of per-round ratios.",
        "",
        "| module | dtype | column | " + " | ".join(ratios) + " | impl µs |",
        "|---|---|---|" + "---|" * (len(ratios) + 1),
    ]
    for r in rows:
        cells = [f"{r[k]:.3f}" if k in r else "—" for k in ratios]
        lines.append(
            f"| {r['module']} | {r['dtype']} | {r['column']} | "
            + " | ".join(cells)
            + f" | {r['impl us']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="splitgrad launch",
        description="Per-call CPU cost of splitgrad.impl's modules against the thinnest "
        "Python split (the floor) and torch.nn, at small shapes (one thread, CPU time, "
        "interleaved rounds, medians of per-round ratios).",
    )
    parser.add_argument("--rounds", type=positive_int, default=15, help="(default: 15)")
    parser.add_argument(
        "--calls", type=positive_int, default=200, help="calls per variant per round (200)"
    )
    parser.add_argument("--modules", default=",".join(MODULES), help="comma-separated")
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated")
    parser.add_argument("--no-fp8", action="store_true", help="skip the FP8 Linear rows")
    parser.add_argument(
        "--calls-only", action="store_true", help="print Python calls per step only (no timing)"
    )
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    parser.add_argument("--json", type=output_file, help="write the rows to this file")
    parser.add_argument(
        "--baseline",
        metavar="DIR",
        help="a copy of another impl/ package (e.g. an older commit's), timed in the same "
        "interleaved rounds as 'baseline'",
    )
    args = parser.parse_args(argv)
    if args.baseline:
        from splitgrad.properties.backends.library import load_library_from_path

        BASELINE.append(load_library_from_path(args.baseline, "splitgrad_launch_baseline"))
    try:
        modules = pick("modules", args.modules, "module", MODULES, everything=None)
        dtypes = pick("dtypes", args.dtypes, "dtype", tuple(DTYPES), everything=None)
    except ValueError as exc:
        parser.error(str(exc))
    if args.calls_only:
        for kind in modules:
            for d in dtypes:
                for column in COLUMNS[1:]:
                    print(f"{kind:16s} {d:9s} {column:20s}", call_counts(kind, DTYPES[d], column))
        return 0
    rows = run(modules, dtypes, args.rounds, args.calls, not args.no_fp8)
    if args.markdown:
        print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
