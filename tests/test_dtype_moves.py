"""Dtype moves (SPEC §2): ``params_dtype`` only sets how parameters are created. After
``module.to(dtype)`` / ``.bfloat16()`` / ``.half()`` / ``.double()`` a module computes in its
parameters' dtype, bit for bit as a module built in that dtype with the same values, with and
without delay, plain and fused, and under FP8 (whose scaling state stays float32)."""

from __future__ import annotations

import itertools

import pytest
import splitgrad.impl as impl
import splitgrad.reference as reference
import torch

PACKAGES = {"reference": reference, "impl": impl}
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
SPLITS = [1, 0, 5]


def _build(pkg, kind: str, dtype: torch.dtype, **kw):
    torch.manual_seed(0)
    if kind == "Linear":
        return pkg.Linear(16, 8, params_dtype=dtype, **kw)
    if kind == "LayerNormLinear":
        return pkg.LayerNormLinear(16, 8, params_dtype=dtype, **kw)
    if kind == "LayerNormMLP":
        return pkg.LayerNormMLP(16, 32, params_dtype=dtype, **kw)
    return pkg.GroupedLinear(3, 16, 8, params_dtype=dtype, **kw)


def _train(m, kind: str, dtype: torch.dtype, delay: bool, fused: bool) -> list:
    if fused:
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        for name, p in m.named_parameters():
            if "weight" in name and not name.startswith("layer_norm"):
                p.main_grad = torch.zeros_like(p, dtype=wide)
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(2):
        x = torch.randn(6, 16, generator=g).to(dtype).requires_grad_()
        y = m(x, SPLITS) if kind == "GroupedLinear" else m(x)
        y.backward(torch.randn(y.shape, generator=g).to(dtype))
        if delay:
            m.backward_dw()
        out += [y.detach(), x.grad]
    for p in m.parameters():
        out.append(p.main_grad if getattr(p, "main_grad", None) is not None else p.grad)
    return out


MOVES = {
    "to(bfloat16)": (lambda m: m.to(torch.bfloat16), torch.bfloat16),
    "half()": (lambda m: m.half(), torch.float16),
    "double()": (lambda m: m.double(), torch.float64),
}


@pytest.mark.parametrize(("delay", "fused"), list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("move", list(MOVES))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("package", list(PACKAGES))
def test_a_moved_module_computes_like_one_built_in_that_dtype(package, kind, move, delay, fused):
    pkg = PACKAGES[package]
    fn, dtype = MOVES[move]
    moved = fn(
        _build(pkg, kind, torch.float32, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    )
    built = _build(pkg, kind, dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
    built.load_state_dict(moved.state_dict())
    assert moved.params_dtype == torch.float32  # the option as given, not a lock
    for a, b in zip(
        _train(moved, kind, dtype, delay, fused), _train(built, kind, dtype, delay, fused)
    ):
        assert a.dtype == b.dtype == (a.dtype if a.dtype == torch.float32 else dtype)
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("package", list(PACKAGES))
def test_after_a_move_inputs_in_the_old_dtype_are_refused_naming_both(package):
    m = PACKAGES[package].Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"torch\.bfloat16 .*got torch\.float32"):
        m(torch.randn(2, 4))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("package", list(PACKAGES))
def test_fp8_after_a_move_keeps_its_state_in_float32(package, recipe):
    pkg = PACKAGES[package]
    runs = []
    for moved in (True, False):
        torch.manual_seed(0)
        m = pkg.LayerNormMLP(
            32,
            64,
            params_dtype=torch.float32 if moved else torch.bfloat16,
            delay_wgrad_compute=True,
        )
        runs.append(m)
    runs[0].to(torch.bfloat16)
    runs[1].load_state_dict(runs[0].state_dict())
    results = []
    for m in runs:
        rec = pkg.DelayedScaling() if recipe == "delayed" else pkg.Float8CurrentScaling()
        g = torch.Generator().manual_seed(3)
        out = []
        for _ in range(3):
            x = torch.randn(32, 32, generator=g).to(torch.bfloat16).requires_grad_()
            with pkg.fp8_autocast(enabled=True, fp8_recipe=rec):
                y = m(x)
            y.backward(torch.randn(y.shape, generator=g).to(torch.bfloat16))
            m.backward_dw()
            out += [y.detach(), x.grad]
        results.append(out + [p.grad for p in m.parameters()])
        for name, buf in m.named_buffers():
            assert not buf.is_floating_point() or buf.dtype == torch.float32, name
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
