"""Empty dimensions (SPEC §2): an expert with no tokens or a micro-batch with no rows gives exact
results on every path and under every recipe — zero weight and bias gradients, empty outputs,
never uninitialized memory.

The bug this pins: ``torch._scaled_mm`` with a zero-size reduction dimension returns
uninitialized memory on some machines (torch 2.13), and the wgrad of an expert without tokens is
exactly such a GEMM (``dW = dy^T x`` over zero rows); weight gradients of -1.4e14 were seen where
the truth is 0. On this machine the kernel happens to return zeros, so the tests do not rely on
reproducing it:

* every test runs under ``torch.use_deterministic_algorithms(True)`` with
  ``torch.utils.deterministic.fill_uninitialized_memory`` on, so a read of ``torch.empty``
  memory sees NaN instead of whatever the allocator had;
* :func:`test_scaled_path_never_sees_an_empty_problem` replaces ``torch._scaled_mm`` (and
  ``torch.nn.functional.scaled_mm``) by a kernel that returns NaN whenever a dimension is 0 and
  shows that impl never hands it such a problem: the guard in :mod:`splitgrad.impl.fp8_gemm`
  is what makes the results exact.

Every comparison is exact (``rtol=0, atol=0``): an empty GEMM has an exact result (zeros), an
accumulation of nothing leaves ``main_grad`` / ``.grad`` bitwise as it was, and an
``is_first_microbatch`` overwrite with nothing writes zeros over a prefilled (NaN included)
``main_grad``. Non-empty groups next to empty ones are only checked to be finite here; their
values are judged against the float64 truth with budgets elsewhere (P2, P12).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import splitgrad.impl as impl
import splitgrad.reference as ref
import torch
from splitgrad.impl import fp8 as ifp8
from splitgrad.impl import fp8_gemm

RECIPES = {
    "none": None,
    "delayed": ref.DelayedScaling(amax_history_len=4),
    "current": ref.Float8CurrentScaling(),
    "mxfp8": ref.MXFP8BlockScaling(),
    "block": ref.Float8BlockScaling(),
}
# The multiple every feature size and token count needs under each recipe.
ALIGN = {"none": 1, "delayed": 1, "current": 1, "mxfp8": 32, "block": 128}
PER_TENSOR = ("delayed", "current")
KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
# Where gradients start and go: plain .grad from None or prefilled, fused main_grad accumulated
# or overwritten (is_first_microbatch=True).
MODES = ("plain-none", "plain-prefilled", "fused-accumulate", "fused-overwrite")


@pytest.fixture(autouse=True)
def uninitialized_memory_is_nan():
    """Deterministic mode with uninitialized memory filled (NaN for floats), restored after."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@dataclasses.dataclass(frozen=True)
class EmptyCase:
    """One module run: ``splits`` are GroupedLinear's m_splits (others: ``rows`` = 0)."""

    lib: str
    kind: str
    recipe: str
    path: str  # "default", "scaled_mm" (fp8_gemm) or "grouped" (GroupedLinear.grouped_gemm)
    mode: str
    delay: bool
    splits: tuple[int, ...] | None = None
    dtype: str = "bfloat16"

    @property
    def rows(self) -> int:
        return sum(self.splits) if self.splits is not None else 0

    def __str__(self) -> str:
        splits = "" if self.splits is None else "-" + "_".join(map(str, self.splits))
        delay = "-delay" if self.delay else ""
        where = f"{self.lib}-{self.kind}-{self.dtype}-{self.recipe}-{self.path}"
        return f"{where}-{self.mode}{delay}{splits}"


def _group_splits(recipe: str) -> list[tuple[int, int]]:
    unit = 3 if ALIGN[recipe] == 1 else ALIGN[recipe]
    return [(0, 0), (0, unit), (unit, 0)]


def _paths(lib: str, kind: str, recipe: str) -> list[str]:
    if lib == "reference":
        return ["default"]
    if recipe != "none":
        return ["default", "scaled_mm"]
    return ["default", "grouped"] if kind == "GroupedLinear" else ["default"]


def _cases() -> list[EmptyCase]:
    out = []
    for lib in ("impl", "reference"):
        for kind in KINDS:
            for recipe in RECIPES:
                for path in _paths(lib, kind, recipe):
                    splits = _group_splits(recipe) if kind == "GroupedLinear" else [None]
                    for s in splits:
                        for mode in MODES:
                            for delay in (False, True):
                                case = EmptyCase(lib, kind, recipe, path, mode, delay, s)
                                out.append(case)
                                if lib == "impl" and kind == "GroupedLinear":
                                    # The MoE case also in fp32 (the scaled path's other dtype).
                                    out.append(dataclasses.replace(case, dtype="float32"))
    return out


CASES = _cases()


def _sizes(recipe: str) -> tuple[int, int, int]:
    """(in_features, out_features, ffn): 16-byte rows for the grouped GEMM, block multiples."""
    a = ALIGN[recipe]
    return max(16, a), max(32, a), max(16, a)


def _build(case: EmptyCase, dtype: torch.dtype):
    lib = impl if case.lib == "impl" else ref
    k, m, ffn = _sizes(case.recipe)
    options = dict(
        params_dtype=dtype,
        fuse_wgrad_accumulation=case.mode.startswith("fused"),
        delay_wgrad_compute=case.delay,
    )
    if case.kind == "Linear":
        module = lib.Linear(k, m, **options)
    elif case.kind == "LayerNormLinear":
        module = lib.LayerNormLinear(k, m, **options)
    elif case.kind == "LayerNormMLP":
        module = lib.LayerNormMLP(k, ffn, **options)
    else:
        module = lib.GroupedLinear(len(case.splits), k, m, **options)
    if case.path == "scaled_mm":
        module.fp8_gemm = "scaled_mm"
    elif case.path == "grouped":
        module.grouped_gemm = "grouped"
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5).to(p.dtype))
    return module


def _is_gemm_weight(name: str) -> bool:
    return name.startswith(("weight", "fc1_weight", "fc2_weight"))


def _prefill(module, mode: str) -> None:
    """Random starting gradients (a NaN in every main_grad an overwrite must replace)."""
    gen = torch.Generator().manual_seed(1)
    for name, p in module.named_parameters():
        value = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if mode.startswith("fused") and _is_gemm_weight(name):
            p.main_grad = value.to(torch.float32)
            if mode == "fused-overwrite":
                p.main_grad.view(-1)[0] = float("nan")
        elif mode != "plain-none":
            p.grad = value.to(p.dtype)


def _run(case: EmptyCase):
    """Forward and backward (and the queued wgrad) of one micro-batch; returns
    ``(module, x, y, gradients before)``."""
    dtype = getattr(torch, case.dtype)
    module = _build(case, dtype)
    _prefill(module, case.mode)
    before = {name: _grad_of(p, name, case.mode) for name, p in module.named_parameters()}
    before = {k: None if v is None else v.clone() for k, v in before.items()}
    k = module.hidden_size if case.kind == "LayerNormMLP" else module.in_features
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(case.rows, k, generator=gen, dtype=torch.float64).to(dtype)
    x.requires_grad_()
    recipe = RECIPES[case.recipe]
    first = True if case.mode == "fused-overwrite" else None
    autocast = (
        module_lib(case).fp8_autocast(enabled=True, fp8_recipe=recipe)
        if recipe is not None
        else contextlib.nullcontext()
    )
    with autocast:
        if case.splits is not None:
            y = module(x, list(case.splits), is_first_microbatch=first)
        else:
            y = module(x, is_first_microbatch=first)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(dtype)
    y.backward(dy)
    if case.delay:
        assert module.pending_wgrad_count == 1
        module.backward_dw()
    return module, x, y, before


def module_lib(case: EmptyCase):
    return impl if case.lib == "impl" else ref


def _grad_of(p: torch.nn.Parameter, name: str, mode: str) -> torch.Tensor | None:
    if mode.startswith("fused") and _is_gemm_weight(name):
        return p.main_grad
    return p.grad


def _empty_param(case: EmptyCase, name: str) -> bool:
    """Whether ``name`` saw no rows: every parameter of a 0-row run; a GroupedLinear's
    ``weight{i}`` / ``bias{i}`` of an empty group."""
    if case.splits is None or case.rows == 0:
        return True
    return case.splits[int(name.removeprefix("weight").removeprefix("bias"))] == 0


def _assert_exact(actual: torch.Tensor | None, expected: torch.Tensor, what: str) -> None:
    assert actual is not None, f"{what}: no gradient written (expected {expected.flatten()[:4]})"
    torch.testing.assert_close(
        actual, expected, rtol=0, atol=0, equal_nan=False, msg=lambda m: f"{what}: {m}"
    )


def _check(case: EmptyCase, module, x, y, before) -> None:
    out = module.hidden_size if case.kind == "LayerNormMLP" else module.out_features
    assert y.shape == (case.rows, out), (str(case), y.shape)
    assert x.grad is not None and x.grad.shape == x.shape, str(case)
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all(), str(case)
    for name, p in module.named_parameters():
        got = _grad_of(p, name, case.mode)
        what = f"{case}: {name}"
        if not _empty_param(case, name):
            assert got is not None and torch.isfinite(got).all(), what
            continue
        if before[name] is None:
            _assert_exact(got, torch.zeros_like(p), f"{what}.grad (from None)")
        elif case.mode == "fused-overwrite" and _is_gemm_weight(name):
            _assert_exact(got, torch.zeros_like(p.main_grad), f"{what}.main_grad (overwritten)")
        else:
            _assert_exact(got, before[name], f"{what} (accumulated nothing)")
        if case.mode.startswith("fused") and _is_gemm_weight(name):
            assert p.grad is None, f"{what}.grad written under fused accumulation"


@pytest.mark.parametrize("case", CASES, ids=str)
def test_empty_dimensions_exact(case):
    """Every module x recipe x forced path x gradient mode x delay, with 0-row inputs and
    m_splits holding zeros: exact zeros (or untouched accumulators), empty outputs, no NaN."""
    _check(case, *_run(case))


def _returned_cases() -> list[EmptyCase]:
    out = []
    for c in CASES:
        if c.mode == "plain-none" and not c.delay:
            out.append(dataclasses.replace(c, mode="returned"))
    return out


@pytest.mark.parametrize("case", _returned_cases(), ids=str)
def test_empty_dimensions_returned_gradients(case):
    """``torch.autograd.grad`` over every parameter: the gradients it returns for parameters
    that saw no rows are exact zeros, and nothing is written to ``.grad``."""
    dtype = getattr(torch, case.dtype)
    module = _build(case, dtype)
    names = [n for n, _ in module.named_parameters()]
    params = [p for _, p in module.named_parameters()]
    k = module.hidden_size if case.kind == "LayerNormMLP" else module.in_features
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(case.rows, k, generator=gen, dtype=torch.float64).to(dtype)
    x.requires_grad_()
    recipe = RECIPES[case.recipe]
    autocast = (
        module_lib(case).fp8_autocast(enabled=True, fp8_recipe=recipe)
        if recipe is not None
        else contextlib.nullcontext()
    )
    with autocast:
        y = module(x, list(case.splits)) if case.splits is not None else module(x)
    dy = torch.randn(y.shape, generator=gen, dtype=torch.float64).to(y.dtype)
    dx, *grads = torch.autograd.grad(y, [x, *params], dy)
    assert dx.shape == x.shape and torch.isfinite(dx).all(), str(case)
    for name, p, g in zip(names, params, grads):
        assert p.grad is None, f"{case}: {name}.grad written by torch.autograd.grad"
        if _empty_param(case, name):
            _assert_exact(g, torch.zeros_like(p), f"{case}: returned d{name}")
        else:
            assert torch.isfinite(g).all(), f"{case}: returned d{name}"


# ---- the guard: no empty problem reaches torch's FP8 kernels --------------------------------


class _GarbageOnEmpty:
    """Stands in for an FP8 GEMM kernel: NaN output whenever M, N or K is 0 (what an
    uninitialized output may hold), the real kernel otherwise; counts both kinds of call."""

    def __init__(self, real):
        self.real = real
        self.empty_calls = 0
        self.calls = 0

    def __call__(self, a, b, *args, **kwargs):
        self.calls += 1
        if 0 in (a.shape[0], a.shape[1], b.shape[1]):
            self.empty_calls += 1
            dtype = kwargs.get("out_dtype") or kwargs.get("output_dtype") or torch.float32
            return torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=dtype)
        return self.real(a, b, *args, **kwargs)


@pytest.fixture
def garbage_kernels(monkeypatch):
    """``torch._scaled_mm`` and ``torch.nn.functional.scaled_mm`` replaced by
    :class:`_GarbageOnEmpty` for the test."""
    fake = _GarbageOnEmpty(torch._scaled_mm)
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    # torch.nn.functional.scaled_mm (block scalings) is new in 2.9; 2.8 has only _scaled_mm.
    real_blockwise = getattr(torch.nn.functional, "scaled_mm", None)
    fake_blockwise = _GarbageOnEmpty(real_blockwise) if real_blockwise is not None else None
    if fake_blockwise is not None:
        monkeypatch.setattr(torch.nn.functional, "scaled_mm", fake_blockwise)
    return fake, fake_blockwise


def test_garbage_kernel_bites(garbage_kernels):
    """The stand-in kernel really returns garbage for K=0 when called directly (through impl's
    own unguarded call), so the exact results below are the guard's doing."""
    fake, _ = garbage_kernels
    recipe = RECIPES["current"]
    dy = ifp8.quantize(torch.zeros(0, 16), recipe, "grad_output", 0)
    x = ifp8.quantize(torch.zeros(0, 32), recipe, "input", 0)
    got = fp8_gemm._scaled_mm(dy, True, x, False, torch.float32, None)
    assert got.shape == (16, 32) and torch.isnan(got).all()
    assert fake.empty_calls == 1


SCALED_CASES = [
    c
    for c in CASES
    if c.lib == "impl" and c.path == "scaled_mm" and c.recipe in PER_TENSOR and not c.delay
]


@pytest.mark.parametrize("case", SCALED_CASES, ids=str)
def test_scaled_path_never_sees_an_empty_problem(case, garbage_kernels):
    """The forced ``torch._scaled_mm`` path with a kernel that returns NaN for K=0 (or M=0, N=0):
    results stay exact, the kernel is never called on an empty problem, and it does run for
    the non-empty groups (the path is really taken)."""
    fake, _ = garbage_kernels
    _check(case, *_run(case))
    assert fake.empty_calls == 0, f"{case}: {fake.empty_calls} empty problem(s) reached the kernel"
    if case.rows:
        assert fake.calls > 0, f"{case}: the scaled path never ran"


def _operands(recipe_name: str, m: int, k: int, n: int):
    """Quantized ``(a, a_t, b, b_t)`` with ``op(a)`` (m, k) and ``op(b)`` (k, n), in the three
    orientations impl's GEMMs use (forward, dgrad, wgrad), each quantized along K."""
    recipe = RECIPES[recipe_name]
    state = {"state": ifp8.DelayedScalingState(4, torch.device("cpu"))}
    kw = state if recipe_name == "delayed" else {}
    gen = torch.Generator().manual_seed(3)

    def q(rows, cols, role, axis):
        t = torch.randn(rows, cols, generator=gen)
        return ifp8.quantize(t, recipe, role, axis, **kw)

    return [
        (q(m, k, "input", 1), False, q(n, k, "weight", 1), True),  # forward: x @ W^T
        (q(m, k, "grad_output", 1), False, q(k, n, "weight", 0), False),  # dgrad: dy @ W
        (q(k, m, "grad_output", 0), True, q(k, n, "input", 0), False),  # wgrad: dy^T @ x
    ]


def _shapes(recipe_name: str) -> list[tuple[int, int, int]]:
    """(M, K, N) problems with an empty dimension whose other sizes the recipe can quantize."""
    a = max(ALIGN[recipe_name], 16)
    return [(a, 0, a), (0, a, a), (0, 0, a)]


@pytest.mark.parametrize("path", ["auto", "scaled_mm", "dequantize"])
@pytest.mark.parametrize("recipe_name", [r for r in RECIPES if r != "none"])
def test_fp8_dispatch_skips_empty_problems(recipe_name, path, garbage_kernels, monkeypatch):
    """``fp8_mm`` / ``fp8_mm_accumulate_`` on problems with M, N or K = 0, every recipe and path,
    with the scaled path claimed available for every scaling kind (so the block kinds would
    reach ``torch.nn.functional.scaled_mm`` too): zeros (+ bias), overwrite -> zeros over NaN,
    accumulate -> untouched, and no kernel called on an empty problem."""
    fake, fake_blockwise = garbage_kernels
    monkeypatch.setattr(fp8_gemm, "_use_scaled_mm", lambda *args: path != "dequantize")
    for m, k, n in _shapes(recipe_name):
        for a, a_t, b, b_t in _operands(recipe_name, m, k, n):
            bias = torch.linspace(-1, 1, n).to(torch.bfloat16)
            for out_dtype in (torch.float32, torch.bfloat16):
                y = fp8_gemm.fp8_mm(
                    a, a_t, b, b_t, out_dtype=out_dtype, compute_dtype=torch.float32, path=path
                )
                _assert_exact(y, torch.zeros(m, n, dtype=out_dtype), f"fp8_mm {m}x{k}x{n}")
                y = fp8_gemm.fp8_mm(
                    a,
                    a_t,
                    b,
                    b_t,
                    out_dtype=torch.bfloat16,
                    compute_dtype=torch.float32,
                    bias=bias,
                    path=path,
                )
                _assert_exact(y, bias.expand(m, n), f"fp8_mm + bias {m}x{k}x{n}")
            for overwrite in (False, True):
                start = torch.full((m, n), float("nan") if overwrite else 0.25)
                out = start.clone()
                fp8_gemm.fp8_mm_accumulate_(
                    out,
                    a,
                    a_t,
                    b,
                    b_t,
                    overwrite=overwrite,
                    compute_dtype=torch.float32,
                    path=path,
                )
                want = torch.zeros(m, n) if overwrite else start
                _assert_exact(out, want, f"fp8_mm_accumulate_ {m}x{k}x{n} overwrite={overwrite}")
    assert fake.empty_calls == 0
    assert fake_blockwise is None or fake_blockwise.empty_calls == 0
