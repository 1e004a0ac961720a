"""Building blocks for the contract tests: build a module of any kind from either source, fill it
with seeded values, run micro-batches, snapshot its gradients; and ``ci/mutants.py`` as a
module, for the tests that check its mutants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from splitgrad.reference import fp8 as _recipes

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
IN, OUT, FFN, ROWS = 8, 6, 12, 7
GROUP_SPLITS = [3, 0, 4]  # an empty group on purpose

LOW_PRECISION = (torch.bfloat16, torch.float16)


def build(lib, kind: str, *, dtype=torch.float32, bias=True, fused=False, delay=False, **extra):
    """A small module of ``kind`` from ``lib`` (``splitgrad.reference`` or ``splitgrad.impl``)."""
    common = dict(
        bias=bias, params_dtype=dtype, fuse_wgrad_accumulation=fused, delay_wgrad_compute=delay
    )
    common.update(extra)
    if kind == "Linear":
        return lib.Linear(IN, OUT, **common)
    if kind == "LayerNormLinear":
        return lib.LayerNormLinear(IN, OUT, **common)
    if kind == "LayerNormMLP":
        return lib.LayerNormMLP(IN, FFN, **common)
    if kind == "GroupedLinear":
        return lib.GroupedLinear(len(GROUP_SPLITS), IN, OUT, **common)
    raise ValueError(f"unknown kind {kind!r}")


def out_features(module) -> int:
    return module.hidden_size if hasattr(module, "hidden_size") else module.out_features


def in_features(module) -> int:
    return module.hidden_size if hasattr(module, "hidden_size") else module.in_features


def gemm_weight_names(module) -> list[str]:
    names = [n for n, _ in module.named_parameters() if n.startswith(("weight", "fc1_w", "fc2_w"))]
    return names


def gemm_param_names(module) -> list[str]:
    return [n for n, _ in module.named_parameters() if not n.startswith("layer_norm")]


def fill(module, seed: int) -> None:
    """Seeded values for every parameter (non-zero biases, non-trivial norm weights)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in module.named_parameters():
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5).to(p.dtype))


def prefill_grads(module, seed: int, *, fused: bool) -> None:
    """Random non-zero starting gradients, so accumulation (not assignment) is what is tested:
    ``main_grad`` (fp32) on GEMM weights when fused, ``.grad`` on every other parameter."""
    gen = torch.Generator().manual_seed(seed)
    weights = set(gemm_weight_names(module))
    for name, p in module.named_parameters():
        value = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if fused and name in weights:
            p.main_grad = value.to(torch.float32)
        else:
            p.grad = value.to(p.dtype)


def make_input(module, seed: int, rows: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = sum(GROUP_SPLITS) if rows is None else rows
    x = torch.randn(n, in_features(module), generator=gen, dtype=torch.float64)
    return x.to(module.params_dtype).requires_grad_()


def make_dy(module, y: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)


def forward(module, x, is_first_microbatch=None, m_splits=None):
    if hasattr(module, "num_gemms"):
        splits = GROUP_SPLITS if m_splits is None else m_splits
        return module(x, splits, is_first_microbatch=is_first_microbatch)
    return module(x, is_first_microbatch=is_first_microbatch)


def microbatch(module, seed: int, is_first_microbatch=None):
    """Forward + backward of one micro-batch; returns (x, y) with x.grad filled."""
    x = make_input(module, seed)
    y = forward(module, x, is_first_microbatch)
    y.backward(make_dy(module, y, seed))
    return x, y


def snapshot(module) -> dict[str, torch.Tensor | None]:
    """Copies of every ``.grad`` and ``main_grad`` of the module, by name."""
    out: dict[str, torch.Tensor | None] = {}
    for name, p in module.named_parameters():
        out[f"{name}.grad"] = None if p.grad is None else p.grad.detach().clone()
        mg = getattr(p, "main_grad", None)
        if isinstance(mg, torch.Tensor):
            out[f"{name}.main_grad"] = mg.detach().clone()
    return out


def assert_same(actual: dict, expected: dict) -> None:
    """Bitwise equality of two snapshots (``None`` must match ``None``)."""
    assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
    for key in expected:
        a, e = actual[key], expected[key]
        if e is None or a is None:
            assert a is None and e is None, f"{key}: {a} vs {e}"
        else:
            torch.testing.assert_close(a, e, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def twin_pair(lib, kind, *, seed=0, **options):
    """Two modules with identical parameters and gradients: (non-delayed, delayed)."""
    fused = options.get("fused", False)
    plain = build(lib, kind, delay=False, **options)
    delayed = build(lib, kind, delay=True, **options)
    for m in (plain, delayed):
        fill(m, seed)
        prefill_grads(m, seed + 1, fused=fused)
    return plain, delayed


# ---- FP8 -------------------------------------------------------------------------------------


def fp8_size(recipe) -> int:
    """A size every recipe quantizes: MXFP8's block (32) or Float8BlockScaling's tile (128)."""
    return 128 if isinstance(recipe, _recipes.Float8BlockScaling) else 32


def build_fp8(lib, kind, recipe, *, dtype=torch.float32, delay=False, fused=False, **extra):
    """A module of ``kind`` from ``lib`` sized for ``recipe`` (:func:`fp8_size`), with seeded
    parameters in FP8's comfortable range and, when fused, a random ``main_grad`` on each GEMM
    weight."""
    n = fp8_size(recipe)
    kw = dict(params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    kw.update(extra)
    module = {
        "Linear": lambda: lib.Linear(n, n, **kw),
        "LayerNormLinear": lambda: lib.LayerNormLinear(n, 2 * n, **kw),
        "LayerNormMLP": lambda: lib.LayerNormMLP(n, n, activation="swiglu", **kw),
        "GroupedLinear": lambda: lib.GroupedLinear(3, n, n, **kw),
    }[kind]()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if "weight" in name else 0.1))
            if fused and name in module.gemm_weight_names():
                p.main_grad = torch.randn(p.shape, generator=g)
    return module


def fp8_step(module, recipe, seed, *, fp8=True):
    """One micro-batch of a :func:`build_fp8` module under ``recipe`` (or in high precision),
    2n rows (GroupedLinear splits [n, 0, n]): returns (x, y) with x.grad."""
    n = fp8_size(recipe)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * n, n, generator=g).to(module.params_dtype).requires_grad_()
    with _recipes.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        y = module(x, [n, 0, n]) if hasattr(module, "num_gemms") else module(x)
    y.backward(torch.randn(y.shape, generator=g).to(y.dtype))
    return x, y


def fp8_snapshot(module) -> dict[str, torch.Tensor | None]:
    """:func:`snapshot` and the module's delayed-scaling state (amax histories, scales)."""
    out = snapshot(module)
    for key, state in module.fp8_states.items():
        out[f"{key}.amax_history"] = state.amax_history.clone()
        out[f"{key}.scale"] = state.scale.clone()
    return out


def check_fp8_delay_bitwise(lib, kind: str, recipe, fused: bool) -> None:
    """Gradients (``.grad``, prefilled ``main_grad``), amax histories and scales of ``lib``'s
    ``kind`` are bitwise equal delayed vs not over three bf16 steps whose wgrad runs only after
    the next step's forward and backward have moved the scales."""
    plain = build_fp8(lib, kind, recipe, dtype=torch.bfloat16, fused=fused)
    delayed = build_fp8(lib, kind, recipe, dtype=torch.bfloat16, fused=fused, delay=True)
    for step in range(3):
        xp, yp = fp8_step(plain, recipe, step)
        xd, yd = fp8_step(delayed, recipe, step)
        torch.testing.assert_close(yd, yp, rtol=0, atol=0)
        torch.testing.assert_close(xd.grad, xp.grad, rtol=0, atol=0)
        if step:
            delayed.backward_dw()  # the previous step's entry, after this step's update
    delayed.backward_dw()
    assert delayed.pending_wgrad_count == 0
    assert_same(fp8_snapshot(delayed), fp8_snapshot(plain))
    if isinstance(recipe, _recipes.DelayedScaling):
        assert any(s.amax_history.count_nonzero() > 1 for s in plain.fp8_states.values())


def available_backend(name: str):
    """The harness backend ``name``, or a pytest skip saying why it is unavailable."""
    from splitgrad.properties.backends import get_backend

    backend = get_backend(name)
    why = backend.unavailable_reason()
    if why:
        pytest.skip(why)
    return backend


def ci_mutants():
    """``ci/mutants.py``, imported (its mutants and how they are applied)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    return mutants
