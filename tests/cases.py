"""Building blocks for the contract tests: build a module of any kind from either source, fill it
with seeded values, run micro-batches, snapshot its gradients; and ``ci/mutants.py`` as a
module, for the tests that check its mutants."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

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


def ci_mutants():
    """``ci/mutants.py``, imported (its mutants and how they are applied)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    return mutants
