"""Launch cost, guarded without timing (issue 31): the Python-level work of one call of each impl
module, counted as ``cProfile`` counts function calls, against the floor of
:mod:`splitgrad.bench.launch` (the thinnest Function issuing the same kernels); and a forward
in which nothing needs a gradient runs no autograd Function and gives the same output bitwise.

The call counts are exact for a given torch (they do not depend on the machine or its load).
``EXTRA_CALLS`` is the budget: how many calls one step of impl may make beyond the floor's,
the count measured with the direct routes (the larger of fp32 and bf16) plus a margin of 5
(about a third of a microsecond); docs/figures.md has the measured counts and times."""

from __future__ import annotations

import cProfile
import pstats

import pytest
import splitgrad.impl as impl
import torch
from splitgrad.bench import launch

#: (module, column) -> the most calls impl's step may make beyond the floor's.
EXTRA_CALLS = {
    ("Linear", "fwd+bwd"): 24,
    ("Linear", "delayed fwd+bwd+dw"): 35,
    ("LayerNormLinear", "fwd+bwd"): 37,
    ("LayerNormLinear", "delayed fwd+bwd+dw"): 48,
    ("LayerNormMLP", "fwd+bwd"): 52,
    ("LayerNormMLP", "delayed fwd+bwd+dw"): 65,
    ("GroupedLinear", "fwd+bwd"): 49,
    ("GroupedLinear", "delayed fwd+bwd+dw"): 68,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("module_column", sorted(EXTRA_CALLS), ids=lambda mc: " ".join(mc))
def test_calls_per_step_within_the_budget_over_the_floor(module_column, dtype) -> None:
    kind, column = module_column
    counts = launch.call_counts(kind, dtype, column)
    extra = counts["impl"] - counts["floor"]
    assert extra <= EXTRA_CALLS[module_column], (
        f"{kind} {column} ({dtype}): impl makes {counts['impl']} Python calls per step, the "
        f"floor {counts['floor']}: {extra} more, over the budget of {EXTRA_CALLS[module_column]} "
        "(profile it with: splitgrad launch --calls-only)"
    )


def test_the_count_sees_a_regression(monkeypatch) -> None:
    """The guard can fail: three more calls per backward of impl's Linear exceed its budget
    once they are added on top of a step already at the budget's edge."""
    base = launch.call_counts("Linear", torch.float32, "fwd+bwd")
    original = impl.linear.linear_wgrad

    def slower(*args, **kwargs):
        for _ in range(3):
            _noop()
        return original(*args, **kwargs)

    monkeypatch.setattr(impl.linear, "linear_wgrad", slower)
    after = launch.call_counts("Linear", torch.float32, "fwd+bwd")
    assert after["impl"] == base["impl"] + 4  # the wrapper and its three calls
    assert after["floor"] == base["floor"]


def _noop() -> None:
    pass


# ---- a forward that needs no gradient ---------------------------------------------------------

_OPTIONS = [
    ("Linear", {}),
    ("Linear", {"bias": False}),
    ("LayerNormLinear", {}),
    ("LayerNormLinear", {"normalization": "RMSNorm", "zero_centered_gamma": True}),
    ("LayerNormMLP", {}),
    ("LayerNormMLP", {"activation": "swiglu", "normalization": "RMSNorm", "bias": False}),
    ("GroupedLinear", {}),
    ("GroupedLinear", {"bias": False}),
]


def _module(kind: str, options: dict, dtype: torch.dtype, delay: bool):
    torch.manual_seed(0)
    opts = {"params_dtype": dtype, "delay_wgrad_compute": delay, **options}
    if kind == "Linear":
        return impl.Linear(16, 12, **opts)
    if kind == "LayerNormLinear":
        return impl.LayerNormLinear(16, 12, **opts)
    if kind == "LayerNormMLP":
        return impl.LayerNormMLP(16, 24, **opts)
    return impl.GroupedLinear(3, 16, 12, **opts)


def _functions_applied(call) -> tuple[object, int]:
    """``call()``'s result and how many autograd Functions it applied (``_FunctionBase.apply``
    and the Python ``Function.apply`` both show in the profile as a function named apply)."""
    prof = cProfile.Profile()
    prof.enable()
    try:
        out = call()
    finally:
        prof.disable()
    stats = pstats.Stats(prof).stats
    return out, sum(v[1] for (_, _, name), v in stats.items() if "apply" in name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind_options", _OPTIONS, ids=lambda ko: f"{ko[0]}{sorted(ko[1])}")
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delayed"])
def test_a_forward_without_gradients_runs_no_function_and_matches_bitwise(
    kind_options, dtype, delay
) -> None:
    kind, options = kind_options
    m = _module(kind, options, dtype, delay)
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    args = ([1, 0, 5],) if kind == "GroupedLinear" else ()
    with_graph, applied = _functions_applied(lambda: m(x.requires_grad_(True), *args))
    assert applied >= 1 and with_graph.grad_fn is not None
    expected = with_graph.detach()
    x = x.detach()
    frozen = _module(kind, options, dtype, delay).requires_grad_(False)
    runs = {
        "torch.no_grad": lambda: _under(torch.no_grad(), m, x, args),
        "torch.inference_mode": lambda: _under(torch.inference_mode(), m, x, args),
        "nothing requires grad": lambda: frozen(x, *args),
    }
    for what, run in runs.items():
        y, applied = _functions_applied(run)
        assert applied == 0, f"{what}: {applied} autograd Function(s) applied"
        assert y.grad_fn is None and not y.requires_grad, what
        torch.testing.assert_close(y, expected, rtol=0, atol=0, msg=what)
    assert m.pending_wgrad_count == 0  # the first (graph) forward had no backward
    assert frozen.pending_wgrad_count == 0


def _under(context, m, x, args):
    with context:
        return m(x, *args)


def test_the_function_count_sees_a_function() -> None:
    """The no-Function check can fail: a module run with a gradient needed applies one."""
    m = _module("Linear", {}, torch.float32, False)
    _, applied = _functions_applied(lambda: m(torch.randn(2, 16)))
    assert applied == 1


# ---- the usual backward's direct routes ---------------------------------------------------------


def _grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind_options", _OPTIONS, ids=lambda ko: f"{ko[0]}{sorted(ko[1])}")
def test_the_usual_backward_writes_directly_and_agrees_with_the_general_way(
    kind_options, monkeypatch
) -> None:
    """Without delay and with nothing hooked, a backward writes its GEMM gradients directly
    (no closure is submitted); an identity hook on the first GEMM weight sends it the general
    way (one closure). Two micro-batches each (set, then accumulate): the same gradients bitwise
    both ways, and as the delayed module's after ``backward_dw()``."""
    kind, options = kind_options
    submitted = []
    original = impl.base.SplitBackwardModule._submit_wgrad

    def counting(self, *args, **kwargs):
        submitted.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(impl.base.SplitBackwardModule, "_submit_wgrad", counting)
    g = torch.Generator().manual_seed(2)
    batches = [
        (
            torch.randn(6, 16, generator=g),
            torch.randn(6, 16 if kind == "LayerNormMLP" else 12, generator=g),
        )
        for _ in range(2)
    ]
    args = ([2, 1, 3],) if kind == "GroupedLinear" else ()
    runs = {}
    for way in ("direct", "general", "delayed"):
        m = _module(kind, options, torch.float32, way == "delayed")
        if way == "general":
            weight = m._parameters[m._gemm_weight_names[0]]
            weight.register_hook(lambda grad: grad)
        submitted.clear()
        for x, dy in batches:
            m(x.requires_grad_(True), *args).backward(dy)
            if way == "delayed":
                m.backward_dw()
        expected = {"direct": 0, "general": 2, "delayed": 2}[way]
        assert len(submitted) == expected, f"{way}: {len(submitted)} closures submitted"
        runs[way] = _grads(m)
    assert runs["direct"].keys() == runs["general"].keys() == runs["delayed"].keys()
    for name, value in runs["direct"].items():
        for other in ("general", "delayed"):
            torch.testing.assert_close(
                runs[other][name], value, rtol=0, atol=0, msg=f"{name}: {other} vs direct"
            )
