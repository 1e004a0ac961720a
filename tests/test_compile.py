"""impl under ``torch.compile`` (see ``splitgrad/impl/compiled.py``): every module's forward
compiles without a graph break (delay on and off, fp32 and bf16; FP8 breaks once, on purpose),
the compiled gradients are within the harness's budgets of the float64 truth, delayed ≡
non-delayed still holds bitwise, and ``backward_dw()`` runs what a compiled backward queued.

The matrix runs on the ``aot_eager`` backend (Dynamo and AOTAutograd, the same graphs and the
same opaque backward ops as inductor, without generating kernels), so it stays fast; inductor
itself runs on one module here and on all of them in the ``slow`` test."""

from __future__ import annotations

import copy

import pytest
import splitgrad.impl as impl
import torch
from cases import GROUP_SPLITS, KINDS, build, fill
from splitgrad.properties.budgets import (
    DGRAD,
    NORM_GRAD,
    OUTPUT,
    WGRAD,
    check_bitwise,
    check_error_budget,
)
from splitgrad.reference import upcast
from torch._dynamo.utils import counters

DTYPES = (torch.float32, torch.bfloat16)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _module(kind: str, dtype: torch.dtype, delay: bool, seed: int = 0):
    module = build(impl, kind, dtype=dtype, delay=delay)
    fill(module, seed)
    return module


def _inputs(module, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(GROUP_SPLITS)
    x = torch.randn(2, rows, module_in(module), generator=gen, dtype=torch.float64)
    out = module.hidden_size if hasattr(module, "hidden_size") else module.out_features
    dy = torch.randn(2, rows, out, generator=gen, dtype=torch.float64)
    return x, dy


def module_in(module) -> int:
    return module.hidden_size if hasattr(module, "hidden_size") else module.in_features


def _splits(rows: int) -> list[int]:
    """GROUP_SPLITS (an empty group included) scaled to ``rows``."""
    return [s * (rows // sum(GROUP_SPLITS)) for s in GROUP_SPLITS]


def _call(module, x, kind: str):
    if kind == "GroupedLinear":
        flat = x.reshape(-1, x.shape[-1])
        return module(flat, _splits(flat.shape[0])).reshape(*x.shape[:-1], -1)
    return module(x)


def _steps(module, runner, x64, dy64, kind: str, steps: int = 2):
    """``steps`` forward + backward (+ ``backward_dw()`` under delay) on the same data, so the
    second one accumulates; returns (last output, x.grad, {name: param.grad})."""
    dtype = next(module.parameters()).dtype
    x = x64.to(dtype, copy=True).requires_grad_()
    for _ in range(steps):
        y = _call(runner, x, kind)
        y.backward(dy64.to(y.dtype))
        if module.delay_wgrad_compute:
            assert module.pending_wgrad_count == 1
            module.backward_dw()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _check_runs_bitwise(plain, delayed) -> None:
    """Two :func:`_steps` results, non-delayed and delayed, are bitwise equal."""
    (y0, dx0, g0), (y1, dx1, g1) = plain, delayed
    check_bitwise("output", y1, y0)
    check_bitwise("inp.grad", dx1, dx0)
    for name in g0:
        check_bitwise(f"{name}.grad", g1[name], g0[name])


def _budget(name: str):
    if name.startswith("layer_norm"):
        return NORM_GRAD
    return WGRAD


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_gradients_within_budget_of_truth(kind, delay, dtype):
    """Compiled impl (aot_eager) against the float64 truth, with the naive reference in the
    module's dtype as the yardstick: the budgets of properties/budgets.py, as for eager impl."""
    module = _module(kind, dtype, delay)
    truth, naive = upcast(module), upcast(module, dtype)
    x64, dy64 = _inputs(module, seed=1)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    y, dx, grads = _steps(module, compiled, x64, dy64, kind)
    y_t, dx_t, grads_t = _steps(truth, truth, x64, dy64, kind)
    y_n, dx_n, grads_n = _steps(naive, naive, x64, dy64, kind)
    assert sum(counters["graph_break"].values()) == 0
    check_error_budget("output", y, y_t, y_n, OUTPUT)
    check_error_budget("inp.grad", dx, dx_t, dx_n, DGRAD)
    for name, g in grads.items():
        check_error_budget(f"{name}.grad", g, grads_t[name], grads_n[name], _budget(name))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_compiled_delayed_equals_compiled_non_delayed_bitwise(kind, dtype):
    """P4 inside compiled graphs: the backward op runs the same closure in both modes."""
    plain = _module(kind, dtype, delay=False)
    delayed = _module(kind, dtype, delay=True)
    x64, dy64 = _inputs(plain, seed=2)
    runs = [
        _steps(m, torch.compile(m, backend="aot_eager"), x64, dy64, kind) for m in (plain, delayed)
    ]
    _check_runs_bitwise(*runs)


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_under_autocast_dtypes_and_delayed_equals_non_delayed_bitwise(kind):
    """torch.autocast around a compiled float32 module (SPEC §2): the output in bf16, the
    gradients in float32, and delayed ≡ non-delayed bitwise (inductor, the default backend)."""
    runs = []
    for delay in (False, True):
        module = _module(kind, torch.float32, delay)
        x64, dy64 = _inputs(module, seed=3)
        compiled = torch.compile(module)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y, dx, grads = _steps(module, compiled, x64, dy64, kind)
        assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
        assert all(g is None or g.dtype == torch.float32 for g in grads.values())
        runs.append((y, dx, grads))
    _check_runs_bitwise(*runs)


@pytest.mark.parametrize("kind", KINDS)
def test_backward_dw_after_compiled_backward(kind):
    """§4 after a compiled backward: the entry is queued (one per backward, FIFO), GEMM
    gradients and hooks wait for backward_dw(), which writes what eager impl writes."""
    module = _module(kind, torch.float32, delay=True)
    eager = copy.deepcopy(module)
    fired = []
    module.register_wgrad_accumulation_and_reduce_hooks(lambda: fired.append(1))
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    x64, dy64 = _inputs(module, seed=3)
    gemm = [n for n, _ in module.named_parameters() if not n.startswith("layer_norm")]
    for step in range(2):  # two micro-batches queued, then drained in order
        x = x64[step : step + 1].float().requires_grad_()
        _call(compiled, x, kind).backward(dy64[step : step + 1].float())
        assert all(getattr(module, n).grad is None for n in gemm)
        x = x64[step : step + 1].float().requires_grad_()
        _call(eager, x, kind).backward(dy64[step : step + 1].float())
    assert module.pending_wgrad_count == 2 and not fired
    if hasattr(module, "layer_norm_weight"):
        assert module.layer_norm_weight.grad is not None  # written by backward() itself
    module.backward_dw()
    assert module.pending_wgrad_count == 1 and fired == [1]
    module.backward_dw()
    eager.backward_dw()
    eager.backward_dw()
    assert fired == [1, 1]
    with pytest.raises(RuntimeError, match="nothing is pending"):
        module.backward_dw()
    for (name, p), (_, q) in zip(module.named_parameters(), eager.named_parameters()):
        check_bitwise(f"{name}.grad", p.grad, q.grad)


@pytest.mark.parametrize("kind", KINDS)
def test_input_only_backward_under_compile(kind):
    """P17 in a compiled graph: backward(inputs=[x]) writes and queues nothing for the
    parameters; torch.autograd.grad on a GEMM parameter cannot be returned through the graph
    and says so."""
    module = _module(kind, torch.float32, delay=True)
    compiled = torch.compile(module, backend="aot_eager")
    x64, dy64 = _inputs(module, seed=4)
    x = x64.float().requires_grad_()
    _call(compiled, x, kind).backward(dy64.float(), inputs=[x])
    assert x.grad is not None and module.pending_wgrad_count == 0
    assert all(p.grad is None for p in module.parameters())
    names = ("weight", "fc1_weight", "weight0")
    weight = next(p for n, p in module.named_parameters() if n in names)
    y = _call(compiled, x64.float().requires_grad_(), kind)
    with pytest.raises(RuntimeError, match="cannot return GEMM-parameter gradients"):
        torch.autograd.grad(y.sum(), [weight])
    assert module.pending_wgrad_count == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delayed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_has_no_graph_break(kind, delay, dtype):
    module = _module(kind, dtype, delay)
    x64, _ = _inputs(module, seed=5)
    x = x64.to(dtype).requires_grad_()
    flat = x.reshape(-1, x.shape[-1])
    args = (flat, _splits(flat.shape[0])) if kind == "GroupedLinear" else (x,)
    explained = torch._dynamo.explain(module)(*args)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_forward_breaks_once_and_stays_exact(kind):
    """FP8 runs eagerly inside a compiled graph (its operands live in Python objects): one
    graph break per module, results bitwise those of eager impl, the recipe guarded (turning
    fp8_autocast on after compiling switches to FP8)."""
    dtype = torch.bfloat16
    kw = {"params_dtype": dtype, "delay_wgrad_compute": True}
    if kind == "GroupedLinear":
        module, args = impl.GroupedLinear(2, 32, 32, **kw), ([32, 32],)
    elif kind == "LayerNormMLP":
        module, args = impl.LayerNormMLP(32, 64, **kw), ()
    else:
        module, args = getattr(impl, kind)(32, 32, **kw), ()
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, backend="aot_eager")
    x = torch.randn(64, 32, dtype=dtype, generator=torch.Generator().manual_seed(6))
    compiled(x, *args).float().sum().backward()  # compiled without FP8 first
    module.backward_dw()
    eager(x, *args).float().sum().backward()
    eager.backward_dw()
    counters.clear()
    recipe = impl.MXFP8BlockScaling()
    for runner, m in ((compiled, module), (eager, eager)):
        with impl.fp8_autocast(enabled=True, fp8_recipe=recipe):
            y = runner(x, *args)
        y.float().sum().backward()
        saved = [t for t in m._wgrad_store.head().saved if t is not None]
        assert any(t.dtype == torch.float8_e4m3fn for t in saved)
        m.backward_dw()
    # One break per module, at the FP8 forward; Dynamo records it in every frame on the way,
    # none with an operation of its own: the module's forward, SplitBackwardModule._run_forward
    # (GroupedLinear dispatches in its own forward) and impl.compiled.eager_apply's wrapper.
    assert all("FP8Function.apply" in reason for reason in counters["graph_break"]), counters
    frames = 2 if kind == "GroupedLinear" else 3
    assert sum(counters["graph_break"].values()) == frames
    for (name, p), (_, q) in zip(module.named_parameters(), eager.named_parameters()):
        check_bitwise(f"{name}.grad", p.grad, q.grad)


def test_one_graph_serves_every_instance_and_copy():
    """A stack of layers, each compiled on its own (``torch.compile(layer)``, also what
    ``copy.deepcopy`` of a prototype gives): Dynamo compiles the forward once for all of them
    (the module's handle is a graph input, not a guarded constant), and each layer's compiled
    backward queues into its own module."""
    prototype = impl.Linear(8, 8, delay_wgrad_compute=True)
    fill(prototype, 0)
    layers = [prototype] + [copy.deepcopy(prototype) for _ in range(9)]  # past the 8 recompiles
    eager = [copy.deepcopy(layer) for layer in layers]
    compiled = [torch.compile(layer, backend="aot_eager") for layer in layers]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(8))
    for stack in (compiled, eager):
        h = x.clone().requires_grad_()
        for layer in stack:
            h = torch.tanh(layer(h))
        h.backward(torch.ones_like(h))
    assert counters["stats"]["unique_graphs"] == 1
    for layer, twin in zip(layers, eager):
        assert layer.pending_wgrad_count == 1
        layer.backward_dw()
        twin.backward_dw()
        for (name, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
            check_bitwise(f"{name}.grad", p.grad, q.grad)


def _inductor_case(kind: str, dtype: torch.dtype) -> None:
    plain, delayed = _module(kind, dtype, False), _module(kind, dtype, True)
    truth, naive = upcast(plain), upcast(plain, dtype)
    x64, dy64 = _inputs(plain, seed=7)
    runs = [_steps(m, torch.compile(m, fullgraph=True), x64, dy64, kind) for m in (plain, delayed)]
    for name, a, b in zip(("output", "inp.grad"), runs[1][:2], runs[0][:2]):
        check_bitwise(name, a, b)
    for name in runs[0][2]:
        check_bitwise(f"{name}.grad", runs[1][2][name], runs[0][2][name])
    y_t, dx_t, g_t = _steps(truth, truth, x64, dy64, kind)
    y_n, dx_n, g_n = _steps(naive, naive, x64, dy64, kind)
    y, dx, g = runs[0]
    check_error_budget("output", y, y_t, y_n, OUTPUT)
    check_error_budget("inp.grad", dx, dx_t, dx_n, DGRAD)
    for name in g:
        check_error_budget(f"{name}.grad", g[name], g_t[name], g_n[name], _budget(name))


def test_inductor_layernorm_linear():
    """The default backend, on the module with a norm (the CPU LayerNorm conditioning check is
    branch-free when compiled): bitwise delayed ≡ non-delayed, within budget of the truth."""
    _inductor_case("LayerNormLinear", torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inductor_every_module(kind, dtype):
    _inductor_case(kind, dtype)
