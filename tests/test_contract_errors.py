"""SPEC §4–§5 errors on every module source: clear exceptions, and nothing changes."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from cases import (
    GROUP_SPLITS,
    KINDS,
    assert_same,
    build,
    fill,
    forward,
    gemm_weight_names,
    make_dy,
    make_input,
    prefill_grads,
    snapshot,
)

UB_MESSAGE = "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"


def _params(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _assert_unchanged(module, params_before, grads_before) -> None:
    assert module.pending_wgrad_count == 0
    assert_same(snapshot(module), grads_before)
    for name, value in _params(module).items():
        torch.testing.assert_close(value, params_before[name], rtol=0, atol=0, msg=name)


# ---- ub_bulk_wgrad ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_ub_bulk_wgrad_with_delay_raises(lib, kind):
    with pytest.raises(ValueError, match=UB_MESSAGE):
        build(lib, kind, delay=True, ub_bulk_wgrad=True)


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_ub_bulk_wgrad_check_survives_python_O(lib, kind):
    """P9: the check is an exception, not an assert, so `python -O` keeps it."""
    code = textwrap.dedent(
        f"""
        import splitgrad.{lib.__name__.split(".")[-1]} as lib
        try:
            lib.{kind}(8, 8, delay_wgrad_compute=True, ub_bulk_wgrad=True)
        except ValueError as e:
            assert {UB_MESSAGE!r} in str(e)
            print("raised")
        else:
            print("accepted")
        """
    )
    out = subprocess.run(
        [sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "raised"


# ---- constructor arguments -------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda lib: lib.Linear(0, 4),
        lambda lib: lib.Linear(4, -1),
        lambda lib: lib.LayerNormLinear(4, 4, normalization="BatchNorm"),
        lambda lib: lib.LayerNormLinear(0, 4),
        lambda lib: lib.LayerNormMLP(4, 8, activation="tanh"),
        lambda lib: lib.LayerNormMLP(4, 8, normalization="layernorm"),
        lambda lib: lib.LayerNormMLP(4, 0),
        lambda lib: lib.GroupedLinear(0, 4, 4),
        lambda lib: lib.GroupedLinear(2, 4, 0),
    ],
    ids=[
        "linear-in0",
        "linear-out-neg",
        "lnl-norm",
        "lnl-in0",
        "mlp-act",
        "mlp-norm-case",
        "mlp-ffn0",
        "grouped-n0",
        "grouped-out0",
    ],
)
def test_invalid_constructor_arguments(lib, make):
    with pytest.raises(ValueError):
        make(lib)


# ---- bad input -------------------------------------------------------------------------------


def _prepared(lib, kind, *, fused=False, delay=False):
    module = build(lib, kind, fused=fused, delay=delay)
    fill(module, 0)
    prefill_grads(module, 1, fused=fused)
    return module, _params(module), snapshot(module)


def _assert_refused(lib, kind, make_x, error, match, *, delay=False) -> None:
    """The input ``make_x(module)`` raises ``error`` matching ``match``; nothing changes."""
    module, params, grads = _prepared(lib, kind, delay=delay)
    with pytest.raises(error, match=match):
        forward(module, make_x(module))
    _assert_unchanged(module, params, grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
def test_wrong_last_dimension(lib, kind, delay):
    def x(module):
        return torch.randn(sum(GROUP_SPLITS), 5, dtype=module.params_dtype, requires_grad=True)

    _assert_refused(lib, kind, x, ValueError, r"8.*5|5.*8", delay=delay)


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_dtype(lib, kind):
    def x(module):
        return make_input(module, 0).detach().to(torch.float64)

    _assert_refused(lib, kind, x, TypeError, r"float32.*float64|float64.*float32")


@pytest.mark.parametrize("kind", KINDS)
def test_wrong_device(lib, kind):
    def x(module):
        return torch.empty(sum(GROUP_SPLITS), 8, device="meta")

    _assert_refused(lib, kind, x, (ValueError, TypeError), "meta")


@pytest.mark.parametrize("kind", KINDS)
def test_not_a_tensor(lib, kind):
    module, params, grads = _prepared(lib, kind)
    with pytest.raises(TypeError, match="list"):
        forward(module, [[0.0] * 8])
    _assert_unchanged(module, params, grads)


@pytest.mark.parametrize(
    "m_splits, pattern",
    [
        ([3, 4], r"num_gemms=3.*\[3, 4\]"),
        ([3, 0, 4, 0], r"num_gemms=3"),
        ([3, -1, 5], r"-1"),
        ([3, 1, 4], r"8.*7|7.*8"),
        ([2, 2, 2], r"6.*7|7.*6"),
        ([3.0, 0, 4], r"3.0"),
    ],
)
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
def test_bad_m_splits(lib, m_splits, pattern, delay):
    module, params, grads = _prepared(lib, "GroupedLinear", delay=delay)
    x = make_input(module, 0)
    with pytest.raises(ValueError, match=pattern):
        module(x, m_splits)
    assert x.grad is None
    _assert_unchanged(module, params, grads)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["nodelay", "delay"])
@pytest.mark.parametrize("problem", ["missing", "shape", "dtype", "not-a-tensor"])
def test_bad_main_grad(lib, kind, delay, problem):
    """§5: a missing or unusable main_grad raises RuntimeError naming the parameter, before any
    gradient (input, norm, GEMM) is written and without queueing anything."""
    module, params, _ = _prepared(lib, kind, fused=True, delay=delay)
    name = gemm_weight_names(module)[0]
    param = getattr(module, name)
    if problem == "missing":
        del param.main_grad
    elif problem == "shape":
        param.main_grad = torch.zeros(param.shape[0] + 1, param.shape[1])
    elif problem == "dtype":
        param.main_grad = torch.zeros(param.shape, dtype=torch.bfloat16)
    else:
        param.main_grad = param.shape
    grads = snapshot(module)
    x = make_input(module, 0)
    y = forward(module, x)
    with pytest.raises(RuntimeError, match=name):
        y.backward(make_dy(module, y, 0))
    assert x.grad is None
    _assert_unchanged(module, params, grads)


def test_fp8_autocast_never_silently_runs_in_high_precision(lib):
    """Under fp8_autocast a module either runs FP8 (its output differs from the high-precision
    one) or raises NotImplementedError; enabled=False is plain high precision."""
    module = lib.Linear(32, 32)
    fill(module, 0)
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(1))
    high = module(x)
    try:
        with lib.fp8_autocast(enabled=True, fp8_recipe=lib.Float8CurrentScaling()):
            low = module(x)
    except NotImplementedError as e:
        assert "FP8" in str(e)
    else:
        assert not torch.equal(low, high)
        # whole-tensor gate: E4M3 rounds each operand by up to 1/16 relative
        assert ((low - high).norm() / high.norm()).item() < 0.25
    with lib.fp8_autocast(enabled=False):
        torch.testing.assert_close(module(x), high, rtol=0, atol=0)


def test_recipes_are_shared(lib):
    """The recipe dataclasses are defined once (in the reference) and re-exported."""
    import splitgrad.reference as ref

    for name in (
        "Format",
        "DelayedScaling",
        "Float8CurrentScaling",
        "MXFP8BlockScaling",
        "Float8BlockScaling",
        "fp8_autocast",
    ):
        assert getattr(lib, name) is getattr(ref, name), name
    with pytest.raises(ValueError, match="amax_compute_algo"):
        lib.DelayedScaling(amax_compute_algo="mean")
