"""splitgrad.impl's tensor and sequence parallelism (SPEC §9) on spawned gloo ranks: smoke tests
of the P19 claims for impl, one spawn per test running a whole matrix of cases.

For every case (module and parallel mode, SP on/off, ``wgrad_gather``, bias, fused, dtype):

(a) delayed ≡ non-delayed, bitwise, per rank: outputs, input gradients and every gradient
    (``main_grad`` prefilled with random values under fused accumulation);
(b) the single-process impl module holding the full weights, fed the same global input, within
    :data:`RTOL` (outputs, dx, and every gradient sharded as the weights are; the SP partial
    sums after ``dist.all_reduce``);
(c) the replicated parameters' gradients (after that reduction under SP) bitwise equal on every
    rank;
(d) in the default ``wgrad_gather="backward"``, no collective inside ``backward_dw()``; with
    ``"backward_dw"`` under SP, some;
(e) what the queued entry holds: the gathered operand, or the rank's rows of it;
(f) ``torch.autograd.grad`` asking for every gradient gets, bitwise, what the module writes
    otherwise, and nothing is written or queued.

The harness's P19 (``splitgrad.properties``) judges both packages against the float64 truth
with the documented budgets; these tests pin impl's behaviour on small shapes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from splitgrad.distributed import run_ranks
from splitgrad.impl import DelayedScaling
from splitgrad.properties.budgets import BudgetViolation, check_bitwise

pytestmark = pytest.mark.distributed

#: Relative tolerance of the TP run against the single-process module: ``max|tp - single| <=
#: RTOL * max|single|``. TP splits the reductions (a row GEMM's and a column dgrad's sum over
#: features becomes per-rank partial GEMMs added by the collective, in the module dtype) and
#: changes the GEMM shapes (so the kernels block differently): a few rounding steps of the
#: dtype, relative to the largest value. Measured worst ratios on these shapes: ~2e-7 (fp32)
#: and ~8e-3 (bf16, where each partial is rounded to 8 bits before the sum).
RTOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
#: FP8: the TP run's error against the high-precision single process may be FP8_MULTIPLIER
#: times the single-process FP8 module's own, plus RTOL of the largest value for what FP8 does
#: not round (bias gradients are summed from the unquantized dy, in another order under SP). A
#: rank quantizes its own weight shard and (column layers) its own dy columns with their own
#: per-tensor scale, so those roundings land elsewhere than the single process's, with the same
#: size; gathered operands are quantized whole, as in the single process. Measured: at most
#: the single process's own error (ratio <= 1.0) on these shapes, under every recipe.
FP8_MULTIPLIER = 2.0

KINDS = ("linear_column", "linear_row", "lnlinear_column", "lnmlp")
_COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "broadcast",
)


@contextlib.contextmanager
def _counting_collectives():
    """Count every call of torch.distributed's collectives while inside."""
    counts: collections.Counter = collections.Counter()
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, counted(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


# ---- one case ---------------------------------------------------------------------------------


def _build(lib, case, tp_options):
    """The module of ``case`` (global sizes; ``tp_options``: {} for the single-process one)."""
    kind = case["kind"]
    options = dict(
        bias=case["bias"],
        params_dtype=case["dtype"],
        fuse_wgrad_accumulation=case["fused"],
        **tp_options,
    )
    n_in, n_out = case["sizes"]
    if kind == "lnmlp":
        if tp_options:
            options["set_parallel_mode"] = True
        return lib.LayerNormMLP(
            n_in, n_out, activation=case["activation"], normalization=case["norm"], **options
        )
    if tp_options:
        options["parallel_mode"] = "row" if kind == "linear_row" else "column"
    if kind == "lnlinear_column":
        return lib.LayerNormLinear(n_in, n_out, normalization=case["norm"], **options)
    return lib.Linear(n_in, n_out, **options)


def _shard(case, name, t, rank, tp):
    """Rank ``rank``'s part of the full module's parameter (or gradient) ``name``."""
    kind = case["kind"]
    if kind == "linear_row":
        return t.chunk(tp, 1)[rank] if name == "weight" else t
    if kind != "lnmlp":
        return t.chunk(tp, 0)[rank] if name in ("weight", "bias") else t
    if name in ("fc1_weight", "fc1_bias"):
        if case["activation"] in ("swiglu", "geglu"):  # [gate; up]: the rank's rows of each
            gate, up = t.chunk(2, 0)
            return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
        return t.chunk(tp, 0)[rank]
    return t.chunk(tp, 1)[rank] if name == "fc2_weight" else t


def _input_part(case, t, rank, tp):
    """The rank's part of a global input (or of its gradient)."""
    if case["kind"] == "linear_row":
        return t.chunk(tp, -1)[rank]
    return t.chunk(tp, 0)[rank] if case["sp"] else t


def _output_part(case, t, rank, tp):
    """The rank's part of a global output (or of its gradient)."""
    if case["kind"] in ("linear_column", "lnlinear_column"):
        return t.chunk(tp, -1)[rank]
    return t.chunk(tp, 0)[rank] if case["sp"] else t


def _grad(module, name, fused):
    p = getattr(module, name)
    if fused and name in module.gemm_weight_names():
        return p.main_grad
    return p.grad


def _run(module, x, dy, recipe=None):
    """Forward and backward (and, under delay, the entry's shapes and the collectives counted
    inside ``backward_dw()``); ``(y, dx, entry shapes, counts)``."""
    import splitgrad.impl as impl

    x = x.clone().requires_grad_()
    with impl.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
        y = module(x)
    y.backward(dy)
    shapes, counts = None, None
    if module.delay_wgrad_compute:
        saved = module._wgrad_store.head().saved
        shapes = [None if t is None else (tuple(t.shape), t.dtype) for t in saved]
        with _counting_collectives() as counts:
            module.backward_dw()
        assert module.pending_wgrad_count == 0
    return y.detach(), x.grad, shapes, counts


def _gathered_roles(case) -> tuple[str, ...]:
    """The delayed-scaling roles whose tensor every rank quantizes whole (the gathered input of
    a column GEMM, the gathered dy of a row GEMM; the replicated ones without SP), so their
    amax histories equal the single process's."""
    if not isinstance(case.get("recipe"), DelayedScaling):
        return ()
    return {
        "linear_column": ("input",),
        "lnlinear_column": ("input",),
        "linear_row": ("grad_output",),
        "lnmlp": ("fc1.input", "fc2.grad_output"),
    }[case["kind"]]


def _expected_entry_rows(case, rows, tp):
    """Rows of the entry's dy and wgrad input operands: ``(dy rows, x rows)`` (LayerNormMLP:
    fc2's dy and fc1's ln_out)."""
    later = case["sp"] and case["gather"] == "backward_dw"
    full, shard = rows, rows // tp
    if case["kind"] in ("linear_column", "lnlinear_column"):
        return full, shard if later else full
    if case["kind"] == "linear_row":
        return (shard if later else full), full
    return (shard if later else full), (shard if later else full)


def _check_case(rank, tp, group, case) -> list[str]:
    """Every claim of the module docstring for one case; the failures, as messages."""
    import splitgrad.impl as impl

    failures: list[str] = []

    def fail(what, exc):
        failures.append(f"rank {rank} {case['id']}: {what}: {exc}")

    dtype, fused = case["dtype"], case["fused"]
    recipe = case.get("recipe")
    g = torch.Generator().manual_seed(case["seed"])
    params = {
        name: (1.0 if name == "layer_norm_weight" else 0.0)
        + 0.5 * torch.randn(p.shape, generator=g).to(dtype)
        for name, p in _build(impl, case, {}).named_parameters()
    }
    shape = case["input_shape"]
    x = torch.randn(shape, generator=g).to(dtype)
    dy = torch.randn(*shape[:-1], case["out"], generator=g).to(dtype)
    weights = [n for n in params if n.endswith("weight") and not n.startswith("layer_norm")]
    prefill = {n: torch.randn(params[n].shape, generator=g) for n in weights}

    def single(recipe):
        """The single-process module with the full weights: (module, y, dx)."""
        module = _build(impl, case, {})
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(params[name])
        if fused:
            for n, v in prefill.items():
                getattr(module, n).main_grad = v.clone()
        y, dx, _, _ = _run(module, x, dy, recipe)
        return module, y, dx

    full, y_full, dx_full = single(recipe)
    # Under FP8, the yardstick: the single-process module's own error against high precision.
    truth = single(None) if recipe is not None else None

    tp_options = dict(tp_group=group, sequence_parallel=case["sp"], wgrad_gather=case["gather"])
    runs = {}
    for delay in (False, True):
        module = _build(impl, case, dict(tp_options, delay_wgrad_compute=delay))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(_shard(case, name, getattr(full, name), rank, tp))
        if fused:
            for n in module.gemm_weight_names():
                getattr(module, n).main_grad = _shard(case, n, prefill[n], rank, tp).clone()
        xi, dyi = _input_part(case, x, rank, tp), _output_part(case, dy, rank, tp)
        runs[delay] = (module, *_run(module, xi, dyi, recipe))

    (plain, y0, dx0, _, _), (delayed, y1, dx1, shapes, counts) = runs[False], runs[True]
    names = [n for n, p in plain.named_parameters() if p is not None]
    # (a) delayed == non-delayed, bitwise.
    try:
        check_bitwise("output", y1, y0)
        check_bitwise("dx", dx1, dx0)
        for n in names:
            check_bitwise(n, _grad(delayed, n, fused), _grad(plain, n, fused))
    except BudgetViolation as exc:
        fail("delayed vs non-delayed", exc)
    # (f) torch.autograd.grad asking for every gradient: returned, bitwise what the module
    # writes, nothing written or queued (plain mode, where the written value is the product).
    if not fused:
        module = _build(impl, case, dict(tp_options, delay_wgrad_compute=True))
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(_shard(case, name, getattr(full, name), rank, tp))
        xi = _input_part(case, x, rank, tp).clone().requires_grad_()
        with impl.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = module(xi)
        params = [getattr(module, n) for n in names]
        returned = torch.autograd.grad(y, [xi, *params], _output_part(case, dy, rank, tp))
        try:
            check_bitwise("returned dx", returned[0], dx0)
            for n, p, value in zip(names, params, returned[1:]):
                check_bitwise(f"returned {n}", value, _grad(plain, n, fused))
                if p.grad is not None:
                    raise BudgetViolation(n, f"{n}.grad written by torch.autograd.grad")
            if module.pending_wgrad_count:
                raise BudgetViolation("queue", "torch.autograd.grad queued an entry")
        except BudgetViolation as exc:
            fail("torch.autograd.grad", exc)
    # (d) collectives inside backward_dw().
    later = case["sp"] and case["gather"] == "backward_dw"
    n_collectives = sum(counts.values())
    if later and n_collectives == 0:
        fail("wgrad_gather='backward_dw'", "no collective inside backward_dw()")
    if not later and n_collectives:
        fail("wgrad_gather='backward'", f"collectives inside backward_dw(): {dict(counts)}")
    # (e) what the entry holds: dy (LayerNormMLP: fc2's) and the input operand (fc1's), in
    # high precision as (dy, x) / (dy, act, d_fc1, ln_out); under FP8 each operand as two
    # slots (data and scale_inv, or the shard and its scale), the quantized copies in FP8.
    rows = x.numel() // shape[-1]
    want = _expected_entry_rows(case, rows, tp)
    at = (0, -1) if recipe is None else (0, 6 if case["kind"] == "lnmlp" else 2)
    got = tuple(shapes[i][0][0] for i in at)
    if got != want:
        fail("entry", f"(dy rows, x rows) = {got}, expected {want}; saved {shapes}")
    if recipe is not None:
        kept = [shapes[i][1] for i in at]
        gathered = [
            i for i, k in enumerate(kept) if k not in (torch.float8_e4m3fn, torch.float8_e5m2)
        ]
        if later and len(gathered) != (2 if case["kind"] == "lnmlp" else 1):
            fail("entry", f"no high-precision shard to gather in backward_dw(): {shapes}")
        if not later and gathered:
            fail("entry", f"a high-precision operand in a quantized entry: {shapes}")
        for role in _gathered_roles(case):
            try:
                check_bitwise(
                    f"fp8_states[{role!r}].amax_history",
                    plain.fp8_states[role].amax_history,
                    full.fp8_states[role].amax_history,
                )
            except BudgetViolation as exc:
                fail("a gathered operand's amax is not the single process's", exc)
    # (b) against the single-process module; (c) replicated gradients equal on every rank.
    rtol = RTOL[dtype]

    def close(what, got, single, hp=None):
        """``got`` within RTOL of ``single``; under FP8 (``hp``: the high-precision single
        process), ``got``'s error against ``hp`` within FP8_MULTIPLIER times ``single``'s plus
        RTOL of ``max|hp|``."""
        if not got.numel():
            return
        if hp is None:
            err = (got.double() - single.double()).abs().max().item()
            scale = single.double().abs().max().item()
            if not err <= rtol * scale:
                fail(what, f"max error {err:.3g} > {rtol} * max|single| {scale:.3g}")
            return
        err = (got.double() - hp.double()).abs().max().item()
        own = (single.double() - hp.double()).abs().max().item()
        allowed = FP8_MULTIPLIER * own + rtol * hp.double().abs().max().item()
        if not err <= allowed:
            fail(what, f"FP8 error {err:.3g} > {allowed:.3g} (single process's own: {own:.3g})")

    def parts(which):
        """The single process's value of output / dx / a gradient, as this rank holds it, and
        the high-precision one under FP8."""
        part = {"output": _output_part, "dx": _input_part}.get(which)
        values = []
        for module, y, dx in ((full, y_full, dx_full),) + ((truth,) if truth else ()):
            if which == "output":
                t = y
            elif which == "dx":
                t = dx
            else:
                t = _grad(module, which, fused)
            values.append(part(case, t, rank, tp) if part else _shard(case, which, t, rank, tp))
        return values

    close("output", y0, *parts("output"))
    close("dx", dx0, *parts("dx"))
    for n in names:
        p = getattr(plain, n)
        got = _grad(plain, n, fused).clone()
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(got, group=group)
        close(f"{n} gradient", got, *parts(n))
        if not getattr(p, "tensor_model_parallel", False):
            copies = [torch.empty_like(got) for _ in range(tp)]
            dist.all_gather(copies, got.contiguous(), group=group)
            try:
                for r, other in enumerate(copies):
                    check_bitwise(f"{n} gradient of rank {r}", other, got)
            except BudgetViolation as exc:
                fail("replicated gradient across ranks", exc)
    return failures


def _cases(kinds, tp, dtypes, *, sizes=(16, 24), shape=(4, 3)):
    """The matrix: every kind x SP x gather mode (SP only) x bias x fused x dtype; activations
    and norms rotate."""
    activations = itertools.cycle(("gelu", "swiglu", "relu", "geglu"))
    norms = itertools.cycle(("LayerNorm", "RMSNorm"))
    out = []
    for kind, sp, gather, bias, fused, dtype in itertools.product(
        kinds, (False, True), ("backward", "backward_dw"), (True, False), (False, True), dtypes
    ):
        if not sp and gather == "backward_dw":
            continue
        n_in, n_out = sizes
        case = dict(
            kind=kind,
            sp=sp,
            gather=gather,
            bias=bias,
            fused=fused,
            dtype=dtype,
            sizes=sizes,
            activation=next(activations),
            norm=next(norms),
            seed=len(out),
        )
        case["out"] = n_in if kind == "lnmlp" else n_out  # global output features
        case["input_shape"] = (*shape, n_in)
        case["id"] = "-".join(
            [kind, f"sp={sp}", gather, f"bias={bias}", f"fused={fused}", str(dtype)[6:]]
        )
        out.append(case)
    return out


def _refusals(rank, tp, group) -> dict[str, str]:
    """Bad input (ValueError before any collective) and what TP does not support
    (RuntimeError naming the module): each one's message, or "no error"."""
    import splitgrad.impl as impl

    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"

    row = impl.Linear(16, 24, tp_group=group, parallel_mode="row", sequence_parallel=True)
    column = impl.Linear(16, 24, tp_group=group, parallel_mode="column", sequence_parallel=True)
    mlp = impl.LayerNormMLP(16, 24, tp_group=group, set_parallel_mode=True, sequence_parallel=True)
    attempt("row dim 0", lambda: row(torch.randn(3, 2, 16 // tp)))
    attempt("column 1-D", lambda: column(torch.randn(16)))
    attempt("mlp 1-D", lambda: mlp(torch.randn(16)))
    x = torch.randn(4, 16, requires_grad=True)
    attempt("torch.func", lambda: torch.func.vjp(column, x))
    attempt(
        "create_graph",
        lambda: torch.autograd.grad(column(x).square().sum(), x, create_graph=True),
    )
    # Nothing was queued or written by the refused calls: the module still works.
    y = column(x)
    y.sum().backward()
    out["still works"] = str(tuple(y.shape))
    return out


def _matrix(rank, world, kinds, dtypes, refusals):
    group = dist.group.WORLD
    cases = _cases(kinds, world, dtypes)
    failures = [f for case in cases for f in _check_case(rank, world, group, case)]
    return len(cases), failures, (_refusals(rank, world, group) if refusals else {})


def test_tp_matrix_2_ranks():
    """(a)-(e) for every module, mode, SP, gather mode, bias, fused, fp32 and bf16, on 2 ranks;
    bad input and unsupported transforms refused by name."""
    results = run_ranks(_matrix, 2, KINDS, (torch.float32, torch.bfloat16), True, timeout_s=240)
    for n, failures, _ in results:
        assert n == 4 * 3 * 2 * 2 * 2 and not failures, "\n".join(failures)
    refusals = results[0][2]
    assert "3" in refusals["row dim 0"] and "tp_size=2" in refusals["row dim 0"]
    assert refusals["row dim 0"].startswith("ValueError")
    assert refusals["column 1-D"].startswith("ValueError") and "(16,)" in refusals["column 1-D"]
    assert refusals["mlp 1-D"].startswith("ValueError") and "LayerNormMLP" in refusals["mlp 1-D"]
    for name in ("torch.func", "create_graph"):
        assert refusals[name].startswith("RuntimeError"), refusals[name]
        assert "splitgrad.impl.Linear" in refusals[name], refusals[name]
        assert "tensor parallel" in refusals[name], refusals[name]
    assert refusals["still works"] == "(8, 12)"


def _fp8_cases(tp):
    """Every kind x recipe x (SP off, SP with each gather mode), fp32; bias, fused, activation
    and norm rotate. Sizes and rows are multiples of what each recipe's blocks need."""
    import splitgrad.impl as impl

    recipes = [
        (impl.DelayedScaling(), (16, 24), (4, 3)),
        (impl.Float8CurrentScaling(), (16, 24), (4, 3)),
        (impl.MXFP8BlockScaling(), (64, 64), (8, 4)),
        (impl.Float8BlockScaling(), (256, 256), (8, 16)),
    ]
    out = []
    flags = itertools.cycle(itertools.product((True, False), (False, True)))
    activations = itertools.cycle(("swiglu", "gelu", "geglu", "relu"))
    norms = itertools.cycle(("RMSNorm", "LayerNorm"))
    modes = ((False, "backward"), (True, "backward"), (True, "backward_dw"))
    for kind, (recipe, sizes, shape), (sp, gather) in itertools.product(KINDS, recipes, modes):
        bias, fused = next(flags)
        n_in, n_out = sizes
        case = dict(
            kind=kind,
            sp=sp,
            gather=gather,
            bias=bias,
            fused=fused,
            dtype=torch.float32,
            sizes=sizes,
            activation=next(activations),
            norm=next(norms),
            seed=len(out),
            recipe=recipe,
            out=n_in if kind == "lnmlp" else n_out,
            input_shape=(*shape, n_in),
        )
        case["id"] = "-".join(
            [kind, type(recipe).__name__, f"sp={sp}", gather, f"bias={bias}", f"fused={fused}"]
        )
        out.append(case)
    return out


def _fp8_matrix(rank, world):
    cases = _fp8_cases(world)
    group = dist.group.WORLD
    return len(cases), [f for case in cases for f in _check_case(rank, world, group, case)]


def test_tp_fp8_2_ranks():
    """(a)-(e) under every FP8 recipe for every module, SP off and on in both gather modes:
    delayed ≡ non-delayed bitwise, the single-process FP8 module within :data:`FP8_RTOL`, the
    entry holding the quantized gathered operand (or the high-precision shard it re-quantizes
    in ``backward_dw()``), and, under DelayedScaling, the gathered tensors' amax histories
    bitwise the single process's."""
    for n, failures in run_ranks(_fp8_matrix, 2, timeout_s=240):
        assert n == 4 * 4 * 3 and not failures, "\n".join(failures)


def _four_ranks(rank, world):
    """The whole group of 4 (every kind, SP off and on in both gather modes), then two TP groups
    of 2 side by side ({0, 1} and {2, 3}: group ranks differ from global ones)."""
    cases = [c for c in _cases(KINDS, world, (torch.float32,)) if c["bias"] and not c["fused"]]
    failures = [f for c in cases for f in _check_case(rank, world, dist.group.WORLD, c)]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    group = pairs[rank // 2]
    sub = [c for c in _cases(KINDS, 2, (torch.float32,)) if c["sp"] and c["fused"] and c["bias"]]
    failures += [f for c in sub for f in _check_case(rank % 2, 2, group, c)]
    return len(cases) + len(sub), failures


def test_tp_4_ranks():
    """(a)-(e) on 4 ranks: tp_size 4, and two TP groups of 2 within the 4."""
    for n, failures in run_ranks(_four_ranks, 4, timeout_s=240):
        assert n == 4 * 3 + 4 * 2 and not failures, "\n".join(failures)


def _compiled(rank, world):
    """A column + SP ``Linear`` and a ``LayerNormMLP`` under ``torch.compile`` (the TP Function
    runs eagerly, a graph break) against the same modules uncompiled: outputs and every
    gradient bitwise, delayed."""
    import splitgrad.impl as impl

    group = dist.group.WORLD

    def build(kind):
        torch.manual_seed(0)
        options = dict(tp_group=group, sequence_parallel=True, delay_wgrad_compute=True)
        if kind == "linear":
            return impl.Linear(16, 24, parallel_mode="column", **options)
        return impl.LayerNormMLP(16, 24, set_parallel_mode=True, **options)

    failures = []
    for kind in ("linear", "mlp"):
        x = torch.randn(4, 3, 16, generator=torch.Generator().manual_seed(rank))
        runs = []
        for compile_it in (False, True):
            module = build(kind)
            xi = x.clone().requires_grad_()
            fn = torch.compile(lambda t, m=module: m(t).relu()) if compile_it else module
            y = fn(xi) if compile_it else fn(xi).relu()
            y.square().sum().backward()
            module.backward_dw()
            runs.append([y, xi.grad, *(p.grad for p in module.parameters())])
        try:
            for i, (a, b) in enumerate(zip(*runs)):
                check_bitwise(f"{kind} tensor {i}", a, b)
        except BudgetViolation as exc:
            failures.append(f"rank {rank}: {exc}")
    return failures


@pytest.mark.slow
def test_tp_under_torch_compile():
    """torch.compile over TP modules: a graph break around the TP Function, bitwise eager."""
    for failures in run_ranks(_compiled, 2, timeout_s=400):
        assert not failures, "\n".join(failures)
