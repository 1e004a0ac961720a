"""The cuda_trace tier: impl's CUDA paths traced on fake CUDA tensors, in CPU CI.

Under :func:`splitgrad.impl.fake_cuda.fake_cuda` every ``device="cuda"`` tensor is fake and each
operator runs its meta function, which repeats the GPU's argument checks (layouts, alignment,
scale shapes); the compute capability impl decides by is sm90 or sm100 and the probes answer
from it. Each traced call must pass those checks, make the host wait for nothing, and give
outputs of the expected shape, dtype and device; where a shape cannot take the fast path the
recorded decision names the fallback and why. Modules are stepped by
:func:`~splitgrad.impl.fake_cuda.module_step` (their autograd Functions' bodies, no engine),
which is checked against autograd on the CPU first. Shapes come from the harness's strategies
(``splitgrad.properties.cases.strategies``), plus pinned shapes where the fast paths need alignment
the strategies rarely draw.
"""

from __future__ import annotations

import inspect
import logging
import sys
import warnings
from pathlib import Path

import pytest
import splitgrad.impl as impl
import torch
import torch._meta_registrations
from cases import assert_same, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st
from splitgrad.impl import (
    fake_cuda,
    fp8_gemm,
    gemm,
    gemm_paths,
    grouped_linear,
    layernorm_linear,
    layernorm_mlp,
    linear,
)
from splitgrad.impl.fp8 import quantize
from splitgrad.properties.backends import build_library_module
from splitgrad.properties.cases import strategies as S
from splitgrad.properties.cases.data import gemm_weight_names, with_layout

ROOT = Path(__file__).resolve().parent.parent
CAPS = list(fake_cuda.CAPABILITIES.items())
CAP_IDS = [name for name, _ in CAPS]
RECIPE_NAMES = (None, "delayed-max-hybrid", "current-hybrid", "mxfp8", "block")
TRACE_DTYPES = ("float32", "bfloat16", "float16")
NAMESPACES = (linear, layernorm_linear, layernorm_mlp, grouped_linear)
ORIGINAL_ATTRS = {
    (ns.__name__, attr): getattr(ns, attr)
    for ns in NAMESPACES
    for attr in ("_apply", "_fp8_forward", "edge_routes")
}


def _dispatch_modes() -> list:
    return list(torch.utils._python_dispatch._get_current_dispatch_mode_stack())


def _function_modes() -> list:
    return list(torch.overrides._get_current_function_mode_stack())


def _assert_clean() -> None:
    """Nothing of a fake-CUDA block survives it."""
    assert gemm_paths.probe_mode() == "kernel"
    assert gemm_paths._STATE.capability is None
    assert not gemm_paths.RECORDERS
    assert _dispatch_modes() == [] and _function_modes() == []
    assert torch.is_grad_enabled()
    for (name, attr), value in ORIGINAL_ATTRS.items():
        current = getattr(__import__(name, fromlist=[attr]), attr)
        assert current is value, f"{name}.{attr} left patched"
    # Probes record a verdict whenever they run (not on a cache hit) and a block empties caches
    # and verdicts together on exit: a CUDA verdict left behind would be a leaked answer.
    assert not any("cuda" in key[1] for key in gemm_paths._VERDICTS), gemm_paths._VERDICTS


@pytest.fixture(autouse=True)
def _clean_after_each_test():
    """Every test of the tier leaves torch and impl as it found them (modes, grad mode, probe
    state, patched attributes, the fake-tensor logger)."""
    level = logging.getLogger("torch._subclasses.fake_tensor").level
    yield
    _assert_clean()
    assert logging.getLogger("torch._subclasses.fake_tensor").level == level


# ---- module_step is what autograd runs (CPU, real tensors) ---------------------------------


def _values(config, mb, seed, device):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((*mb.lead_shape, config.in_features), generator=gen, dtype=torch.float64)
    dy = torch.randn((*mb.lead_shape, config.output_features), generator=gen, dtype=torch.float64)
    x = with_layout(x.to(config.torch_dtype).to(device), mb.x_layout)
    dy = dy.to(config.torch_dtype).to(device)
    if mb.dy_layout.startswith("expanded"):
        dy = torch.ones_like(dy)
    return x, with_layout(dy, mb.dy_layout)


def _seeded(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5).to(p.dtype))
            if getattr(module, "fuse_wgrad_accumulation", False) and p.dim() == 2:
                p.main_grad = torch.randn(p.shape, generator=gen).to(p.device)


@settings(max_examples=25)
@given(
    case=S.cases(
        dtypes=("float32", "bfloat16"),
        recipes=(None, "delayed-max-hybrid", "current-e4m3", "mxfp8", "block"),
        n_micro_batches=(1, 2),
    )
)
def test_module_step_is_autograd_bitwise_on_cpu(case):
    """module_step (the Functions' bodies, called directly) writes the same y, dx, .grad and
    main_grad as y.backward(dy) through the autograd engine, bit for bit, queued or not: so
    the fake-CUDA trace below runs the code a real backward runs."""
    config = case.config
    recipe = None if config.recipe is None else S.make_recipe(config.recipe)
    modules = [build_library_module(impl, config, delay=case.delay) for _ in range(2)]
    for m in modules:
        _seeded(m, case.seed)
    engine, stepped = modules
    for i, mb in enumerate(case.micro_batches):
        x, dy = _values(config, mb, case.seed + i, "cpu")
        splits = list(mb.m_splits) if mb.m_splits is not None else None
        leaf = x.detach().requires_grad_(True)
        with impl.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = (
                engine(leaf, splits, mb.is_first_microbatch)
                if splits is not None
                else engine(leaf, mb.is_first_microbatch)
            )
        y.backward(dy)
        got = fake_cuda.module_step(stepped, x, dy, splits, recipe, mb.is_first_microbatch)
        torch.testing.assert_close(got.y, y.detach(), rtol=0, atol=0, msg="y")
        torch.testing.assert_close(got.dx.reshape(x.shape), leaf.grad, rtol=0, atol=0, msg="dx")
    for m in modules:
        while m.pending_wgrad_count:
            m.backward_dw()
    assert_same(snapshot(stepped), snapshot(engine))


# ---- the modules on fake CUDA --------------------------------------------------------------


def _expected_fp8(cap, recipe_name, shape):
    """(fast?, why) for one FP8 GEMM, by torch's rules (written here independently of impl)."""
    family = S.RECIPES[recipe_name][0]
    if family == "MXFP8BlockScaling":
        runs, align = cap[0] == 10, 16
    elif family == "Float8BlockScaling":
        runs, align = cap[0] == 9, 512
    else:
        runs, align = cap >= (8, 9), 16
    return runs and all(d % align == 0 for d in shape)


def _check_decisions(log, config, cap):
    """Every recorded decision is the one torch's rules allow for this device and shape."""
    for d in log.decisions:
        assert d.device == f"cuda sm{cap[0]}{cap[1]}", d
        if d.gemm == "grouped forward+dgrad":
            aligned = config.in_features % 8 == 0 and config.out_features % 8 == 0
            want = config.torch_dtype == torch.bfloat16 and aligned
            assert (d.path == "fast") == want, d.line()
            assert d.path in ("fast", "fallback"), d.line()
        elif d.gemm == "wgrad->main_grad":
            want = "only" if config.torch_dtype == torch.float32 else "fast"
            assert d.path == want, d.line()
        else:
            assert config.recipe is not None, d.line()
            assert (d.path == "fast") == _expected_fp8(cap, config.recipe, d.shape), d.line()
            if d.path != "fast":
                assert d.path == "fallback" and d.reason, d.line()


def assert_on_cuda(t, shape, dtype, what: str) -> None:
    """``t`` is a CUDA tensor of ``shape`` and ``dtype``; ``what`` names it in the failure."""
    assert isinstance(t, torch.Tensor), f"{what}: {t!r} instead of a tensor"
    got, want = (tuple(t.shape), t.dtype, t.device.type), (tuple(shape), dtype, "cuda")
    assert got == want, f"{what}: (shape, dtype, device) {got}, expected {want}"


def _check_gradients(module, main_grads, what: str, *, all_written: bool) -> None:
    """Every gradient the module holds is where SPEC §3 puts it, on CUDA: ``main_grad`` (the
    very fp32 tensor given) for fused GEMM weights, ``.grad`` in the parameter's shape and
    dtype otherwise; ``all_written``: every parameter has one."""
    for name, p in module.named_parameters():
        if name in main_grads:
            assert p.grad is None and p.main_grad is main_grads[name], f"{what}: {name}"
            assert_on_cuda(p.main_grad, p.shape, torch.float32, f"{what}: {name}.main_grad")
        elif all_written or p.grad is not None:
            assert_on_cuda(p.grad, p.shape, p.dtype, f"{what}: {name}.grad")


def _trace_case(case, cap):
    """Run every micro-batch of ``case`` on fake CUDA at ``cap``; check the shape, dtype and
    device of every output (y, dx, each gradient after each backward and each backward_dw),
    the gradient destinations and the recorded decisions."""
    config = case.config
    recipe = None if config.recipe is None else S.make_recipe(config.recipe)
    with fake_cuda.fake_cuda(cap) as calls, gemm_paths.recording() as log:
        module = build_library_module(impl, config, delay=case.delay)
        weights = set(gemm_weight_names(config))
        main_grads = {}
        for name, p in module.named_parameters():
            if config.fuse_wgrad_accumulation and name in weights:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
                main_grads[name] = p.main_grad
        for i, mb in enumerate(case.micro_batches):
            x = with_layout(
                torch.empty(
                    *mb.lead_shape, config.in_features, dtype=config.torch_dtype, device="cuda"
                ),
                mb.x_layout,
            )
            dy = with_layout(
                torch.empty(
                    *mb.lead_shape, config.output_features, dtype=config.torch_dtype, device="cuda"
                ),
                mb.dy_layout,
            )
            splits = list(mb.m_splits) if mb.m_splits is not None else None
            out = fake_cuda.module_step(module, x, dy, splits, recipe, mb.is_first_microbatch)
            want = config.torch_dtype
            assert_on_cuda(out.y, (*mb.lead_shape, config.output_features), want, f"y[{i}]")
            assert_on_cuda(out.dx, (mb.rows, config.in_features), want, f"dx[{i}]")
            _check_gradients(module, main_grads, f"backward {i}", all_written=not case.delay)
        assert module.pending_wgrad_count == (len(case.micro_batches) if case.delay else 0)
        for i in range(module.pending_wgrad_count):
            module.backward_dw()
            _check_gradients(module, main_grads, f"backward_dw {i}", all_written=True)
        _check_gradients(module, main_grads, "at the end", all_written=True)
    _check_decisions(log, config, cap)
    if any(mb.rows for mb in case.micro_batches):
        assert calls.gemms, "no GEMM was traced"
    return log, calls


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
@settings(max_examples=40)
@given(
    case=S.cases(
        dtypes=TRACE_DTYPES,
        devices=("cuda",),
        recipes=RECIPE_NAMES,
        n_micro_batches=(1, 2),
    )
)
def test_modules_trace_on_fake_cuda(cap, case):
    """Drawn modules (every kind, dtype, recipe, fused or not, delayed or not, drawn layouts,
    empty and one-row groups) pass torch's CUDA checks with no host sync."""
    _trace_case(case, cap)


def _pinned(kind, dtype, recipe, fused, splits=None, rows=512, k=512, n=1024, groups=4):
    config = S.ModuleConfig(
        kind=kind,
        in_features=k,
        out_features=n,
        num_gemms=groups if kind == "GroupedLinear" else 1,
        fuse_wgrad_accumulation=fused,
        dtype=dtype,
        device="cuda",
        recipe=recipe,
    )
    mbs = (S.MicroBatch((rows,), tuple(splits) if splits else None, None),)
    return S.Case(config=config, micro_batches=mbs, seed=0, delay=True)


FAST_SPLITS = {"block": [512, 0, 512, 0], None: [0, 1, 255, 256]}


def _empty_case(kind, recipe, fused, zero_centered, delay):
    """A micro-batch with no rows (every GroupedLinear group empty, overwriting main_grad),
    then one whose groups include empty ones, at sizes where every fast path applies."""
    rows = 1024 if recipe == "block" else 512
    splits = None
    if kind == "GroupedLinear":
        splits = FAST_SPLITS["block"] if recipe == "block" else [0, 32, 224, 256]
    config = S.ModuleConfig(
        kind=kind,
        in_features=512,
        out_features=1024,
        num_gemms=4 if kind == "GroupedLinear" else 1,
        fuse_wgrad_accumulation=fused,
        zero_centered_gamma=zero_centered and kind in S.NORM_KINDS,
        dtype="bfloat16",
        device="cuda",
        recipe=recipe,
    )
    mbs = (
        S.MicroBatch((0,), (0,) * 4 if splits else None, True),
        S.MicroBatch((rows,), tuple(splits) if splits else None, None),
    )
    return S.Case(config=config, micro_batches=mbs, seed=0, delay=delay)


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
@pytest.mark.parametrize("recipe", RECIPE_NAMES, ids=str)
@pytest.mark.parametrize("kind", S.KINDS)
@pytest.mark.parametrize(
    "fused,zero_centered,delay",
    [(False, False, False), (True, True, True)],
    ids=["plain", "fused-zcg-delayed"],
)
def test_empty_problems_trace_on_fake_cuda(cap, recipe, kind, fused, zero_centered, delay):
    """Every module, bf16 and each FP8 recipe, plain and fused, delayed or not, the LayerNorm
    kinds with a zero-centred gamma (CUDA's fp32-copy branch) or not: a micro-batch of zero
    rows (GroupedLinear: every group empty) and groups of size 0 give outputs, input gradients,
    gradients written in backward and entries written by backward_dw in the expected shape,
    dtype and device (SPEC §2: empty dimensions are ordinary)."""
    _trace_case(_empty_case(kind, recipe, fused, zero_centered, delay), cap)


def _cuda_branch_mutant(name: str):
    sys.path.insert(0, str(ROOT / "ci"))
    try:
        import mutants
    finally:
        sys.path.pop(0)
    return next(m for m in mutants.CUDA_BRANCH_MUTANTS if m.name == name)


def _planted(namespace, function: str, mutant):
    """``namespace.function`` with ``mutant``'s edits applied to its source."""
    source = inspect.getsource(getattr(namespace, function))
    for _, old, new in mutant.edits:
        assert old in source, f"{mutant.name}: edit does not apply to {function}"
        source = source.replace(old, new)
    scope = dict(vars(namespace))
    exec(compile(source, f"planted {mutant.name}", "exec"), scope)
    return scope[function]


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
def test_planted_empty_fp32_output_is_caught(monkeypatch, cap):
    """ci/mutants.py's cuda-grouped-empty-fp32 (the grouped GEMM path returning an fp32 output
    for a batch with no rows), planted: the trace names the output and its dtype."""
    mutant = _cuda_branch_mutant("cuda-grouped-empty-fp32")
    monkeypatch.setattr(gemm, "grouped_mm_forward", _planted(gemm, "grouped_mm_forward", mutant))
    with pytest.raises(AssertionError, match=r"y\[0\].*torch.float32"):
        _trace_case(_empty_case("GroupedLinear", None, False, False, True), cap)


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
@pytest.mark.parametrize("recipe", RECIPE_NAMES, ids=str)
@pytest.mark.parametrize("kind", S.KINDS)
def test_fast_paths_at_aligned_shapes(cap, recipe, kind):
    """At aligned shapes every fast path the capability has is the one taken: out_dtype
    main_grad accumulation, the grouped GEMM (with an empty and a one-row group), per-tensor
    FP8 on both, MXFP8 on sm100, 1x128/128x128 blocks on sm90."""
    rows = 1024 if recipe == "block" else 512
    splits = (
        FAST_SPLITS["block" if recipe == "block" else None] if kind == "GroupedLinear" else None
    )
    if splits and recipe is not None and recipe != "block":
        splits = [0, 32, 224, 256]  # FP8 groups stay multiples of the recipe's 32-row blocks
    case = _pinned(kind, "bfloat16", recipe, True, splits, rows=rows, groups=4)
    log, _ = _trace_case(case, cap)
    paths = {(d.gemm, d.path) for d in log.decisions}
    if recipe is None:
        assert ("wgrad->main_grad", "fast") in paths, paths
        if kind == "GroupedLinear":
            assert ("grouped forward+dgrad", "fast") in paths, paths
        return
    family = S.RECIPES[recipe][0]
    runs = {"MXFP8BlockScaling": cap[0] == 10, "Float8BlockScaling": cap[0] == 9}.get(family, True)
    for gemm_name in ("forward", "dgrad", "wgrad"):
        assert (gemm_name, "fast" if runs else "fallback") in paths, (gemm_name, paths)


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
def test_unaligned_shapes_show_the_fallback(cap):
    """K = 24 cannot take torch._scaled_mm (K % 16): the decision says fallback and names the
    size; the dequantize GEMM it runs instead passes the checks."""
    case = _pinned("Linear", "bfloat16", "current-hybrid", False, rows=32, k=24, n=48)
    log, calls = _trace_case(case, cap)
    fallbacks = [d for d in log.decisions if d.path == "fallback"]
    assert {d.gemm for d in fallbacks} == {"forward", "dgrad", "wgrad"}
    assert all("24" in d.reason and "16" in d.reason for d in fallbacks), fallbacks
    assert all(c.op in ("mm", "addmm", "addmm_") for c in calls.gemms), calls.gemms


# ---- CUDA's LayerNorm branch, forced on the CPU (splitgrad verify --impl-path norm_cuda) -------


class _LayerNormCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """The input and gamma dtypes of every native_layer_norm call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.dtype, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.native_layer_norm.default:
            self.calls.append((args[0].dtype, args[2].dtype))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("zero_centered", [False, True])
def test_norm_kernel_cuda_takes_the_cuda_branch_on_the_cpu(zero_centered):
    """``norm_kernel="cuda"`` runs CUDA's branch on real CPU tensors: a zero-centred gamma
    normalizes an fp32 copy of the bf16 input (``"auto"``: the CPU's mixed-dtype call on the
    bf16 input); otherwise the same gamma values as the mixed call. An unknown value raises
    ValueError naming it."""
    torch.manual_seed(0)
    m = impl.LayerNormLinear(16, 8, params_dtype=torch.bfloat16, zero_centered_gamma=zero_centered)
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    seen = {}
    for kernel in ("auto", "cuda"):
        m.norm_kernel = kernel
        with _LayerNormCalls() as log:
            m(x).sum().backward()
        seen[kernel] = log.calls
    assert seen["auto"] == [(torch.bfloat16, torch.float32)]
    want = torch.float32 if zero_centered else torch.bfloat16
    assert seen["cuda"] == [(want, torch.float32)]
    m.norm_kernel = "gpu"
    with pytest.raises(ValueError, match="norm_kernel must be one of .* got 'gpu'"):
        m(x)


# ---- the GEMM layer, call by call -------------------------------------------------------------


def _fp8_operands(recipe_name, m, n, k, device="cuda"):
    """q(x), q(W), q(dy) for a (m tokens, k in, n out) layer, both axes where needed."""
    recipe = S.make_recipe(recipe_name)
    states = {}
    if S.RECIPES[recipe_name][0] == "DelayedScaling":
        from splitgrad.impl.fp8 import DelayedScalingState

        states = {
            r: DelayedScalingState(4, torch.device(device))
            for r in ("input", "weight", "grad_output")
        }
    x = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    w = torch.empty(n, k, dtype=torch.bfloat16, device=device)
    dy = torch.empty(m, n, dtype=torch.bfloat16, device=device)

    def q(t, role, axis):
        return quantize(t, recipe, role, axis, state=states.get(role))

    return {
        "forward": (q(x, "input", 1), False, q(w, "weight", 1), True, (m, n)),
        "dgrad": (q(dy, "grad_output", 1), False, q(w, "weight", 0), False, (m, k)),
        "wgrad": (q(dy, "grad_output", 0), True, q(x, "input", 0), False, (n, k)),
    }


@pytest.mark.parametrize("recipe_name,cap", [("mxfp8", (10, 0)), ("block", (9, 0))])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blockwise_scaled_gemms_pass_torch_checks(recipe_name, cap, out_dtype):
    """Each orientation of the block-scaled GEMM, with the column-wise copies stored transposed
    as the module stores them, passes F.scaled_mm's checks and returns (M, N) in out_dtype."""
    with fake_cuda.fake_cuda(cap) as calls:
        for role, (a, a_t, b, b_t, shape) in _fp8_operands(recipe_name, 1024, 512, 1536).items():
            a = a.with_layout(a_t)
            b = b.with_layout(not b_t)
            y = fp8_gemm._scaled_mm(a, a_t, b, b_t, out_dtype, None)
            assert tuple(y.shape) == shape and y.dtype == out_dtype, role
            assert y.device.type == "cuda", role
    assert [c.op for c in calls.gemms] == ["_scaled_mm_v2"] * 3


def _old_blockwise(a, a_t, b, b_t, A, B, kind, out_dtype):
    """The block-scale layouts impl passed before this tier traced them: unswizzled MX scales,
    and B's 1x128 scales as a (K/128, N) transpose (right only for 128x128 weight blocks)."""
    F = torch.nn.functional
    sa = fp8_gemm._scale_for(a, a_t)
    sb_t = fp8_gemm._scale_for(b, not b_t)
    if kind == "mx":
        st = F.ScalingType.BlockWise1x32
        e8 = torch.float8_e8m0fnu
        return F.scaled_mm(A, B, sa.to(e8), st, sb_t.to(e8).t(), st, output_dtype=out_dtype)
    st = F.ScalingType
    ra = st.BlockWise1x128
    rb = st.BlockWise128x128 if b.block == (128, 128) else st.BlockWise1x128
    return F.scaled_mm(A, B, sa.t().contiguous().t(), ra, sb_t.t(), rb, output_dtype=out_dtype)


@pytest.mark.parametrize(
    "recipe_name,cap,role,message",
    [
        ("mxfp8", (10, 0), "forward", "for MX scaling scale_a must have"),
        ("block", (9, 0), "wgrad", "For 1x128 x 1x128 blockwise scaling"),
    ],
)
@pytest.mark.skipif(
    not hasattr(torch._meta_registrations, "_check_scaled_mm_sizes_v2"),
    reason=f"torch {torch.__version__} checks F.scaled_mm's block scales in C++ only, "
    "not under fake tensors",
)
def test_previous_block_layouts_are_refused(recipe_name, cap, role, message):
    """The tier has teeth: the scale layouts impl used before were refused by torch's checks,
    with the message a GPU would have given (the probe would have fallen back silently).
    (torch 2.13's Python meta function checks them; 2.14 moved the checks to C++.)"""
    with fake_cuda.fake_cuda(cap):
        a, a_t, b, b_t, _ = _fp8_operands(recipe_name, 1024, 512, 1536)[role]
        a, b = a.with_layout(a_t), b.with_layout(not b_t)
        kind = fp8_gemm._kind(a)
        with pytest.raises(RuntimeError, match=message):
            _old_blockwise(a, a_t, b, b_t, a.data, b.data.t(), kind, torch.bfloat16)


@pytest.mark.parametrize("cap", [c for _, c in CAPS], ids=CAP_IDS)
def test_scaled_mm_checks_bite(cap):
    """torch._scaled_mm with a row-major second operand, or K not a multiple of 16, is refused
    under the trace as on the GPU; impl's own call passes with the same operands."""
    with fake_cuda.fake_cuda(cap):
        x = torch.empty(64, 32, dtype=torch.float8_e4m3fn, device="cuda")
        w = torch.empty(48, 32, dtype=torch.float8_e4m3fn, device="cuda")
        one = torch.ones((), device="cuda")
        y = torch._scaled_mm(x, w.t(), one, one, out_dtype=torch.bfloat16)
        assert y.shape == (64, 48) and y.dtype == torch.bfloat16
        with pytest.raises(RuntimeError, match="mat2 must be col_major"):
            torch._scaled_mm(x, w.t().contiguous(), one, one, out_dtype=torch.bfloat16)
        x24 = torch.empty(64, 24, dtype=torch.float8_e4m3fn, device="cuda")
        w24 = torch.empty(48, 24, dtype=torch.float8_e4m3fn, device="cuda")
        with pytest.raises(RuntimeError, match="divisible by 16"):
            torch._scaled_mm(x24, w24.t(), one, one, out_dtype=torch.bfloat16)


@settings(max_examples=30)
@given(
    splits=st.integers(1, 6).flatmap(lambda n: S.m_splits(n, 40)),
    k=st.sampled_from([8, 16, 64]),
    m=st.sampled_from([8, 24, 128]),
    bias=st.booleans(),
)
def test_grouped_gemm_with_empty_and_one_row_groups(splits, k, m, bias):
    """torch._grouped_mm over the stacked weights (empty and one-row groups drawn by the
    harness's m_splits) passes its 16-byte stride checks with int32 offsets, forward and dgrad,
    with and without biases, and returns (rows, out) / (rows, in) bf16 on CUDA."""
    splits = list(splits)
    with fake_cuda.fake_cuda((9, 0)) as calls:
        module = impl.GroupedLinear(
            len(splits), k, m, bias=bias, params_dtype=torch.bfloat16, device="cuda"
        )
        weights = [getattr(module, f"weight{i}") for i in range(len(splits))]
        biases = [getattr(module, f"bias{i}") for i in range(len(splits))] if bias else None
        rows = sum(splits)
        x = torch.empty(rows, k, dtype=torch.bfloat16, device="cuda")
        dy = torch.empty(rows, m, dtype=torch.bfloat16, device="cuda").expand(rows, m)
        stacked = grouped_linear._stacked(weights)
        y = gemm.grouped_mm_forward(x, stacked, biases, splits)
        dx = gemm.grouped_mm_dgrad(dy, stacked, splits)
        assert y.shape == (rows, m) and dx.shape == (rows, k)
        assert y.dtype == dx.dtype == torch.bfloat16 and y.device.type == dx.device.type == "cuda"
    grouped = [c for c in calls.gemms if c.op == "_grouped_mm"]
    assert len(grouped) == 2
    # The weights reach the GEMM as a view of their slots (batch stride = the padded slot),
    # not a stacked copy: W^T (G, K, N) for the forward, W (G, N, K) for dgrad.
    slot = grouped_linear._slot_elements(m, k, torch.bfloat16)
    g = len(splits)
    assert grouped[0].operands[1][:2] == ((g, k, m), (slot, 1, k)), grouped[0].line()
    assert grouped[1].operands[1][:2] == ((g, m, k), (slot, k, 1)), grouped[1].line()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("overwrite", [False, True])
def test_out_dtype_accumulates_into_main_grad(dtype, overwrite):
    """addmm(out_dtype=float32, out=main_grad) on low-precision operands traces, keeps the
    very main_grad tensor, and is what wgrad_into_main_grad_ picks on sm90."""
    with fake_cuda.fake_cuda((9, 0)) as calls, gemm_paths.recording() as log:
        main_grad = torch.zeros(48, 32, device="cuda")
        dy = torch.empty(64, 48, dtype=dtype, device="cuda")
        x = torch.empty(64, 32, dtype=dtype, device="cuda")
        gemm.wgrad_into_main_grad_(main_grad, dy, x, overwrite)
        y = torch.mm(dy.t(), x, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (48, 32)
    (decision,) = log.decisions
    assert decision.path == "fast" and "out_dtype" in decision.call
    assert [c.op for c in calls.gemms] == ["addmm", "mm"]
    assert calls.gemms[0].out[2] == "float32"


def test_host_syncs_are_caught():
    """Reading a CUDA value on the host, or copying it to the host, raises HostSync."""
    with fake_cuda.fake_cuda((9, 0)):
        t = torch.ones(4, device="cuda")
        with pytest.raises(fake_cuda.HostSync, match="item"):
            t.sum().item()
        with pytest.raises(fake_cuda.HostSync):
            bool(t.sum() > 0)
        with pytest.raises(fake_cuda.HostSync, match="device-to-host"):
            t.cpu()
        with pytest.raises(fake_cuda.HostSync, match="nonzero"):
            t.nonzero()
        assert t.add(1).device.type == "cuda"  # device-side work is fine


# ---- the probes under capability_probes -----------------------------------------------------


@pytest.mark.parametrize(
    "cap,out_dtype,grouped,tensor,mx,block",
    [
        ((8, 0), True, False, False, False, False),
        ((8, 9), True, False, True, False, False),
        ((9, 0), True, True, True, False, True),
        ((10, 0), True, True, True, True, False),
    ],
)
def test_probes_answer_from_the_capability(cap, out_dtype, grouped, tensor, mx, block):
    """No kernel runs: each probe gives the capability table's verdict for a fake sm80/89/90/100
    device, and the verdict is kept for the reports."""
    cuda = torch.device("cuda", 0)
    with fake_cuda.fake_cuda(cap):
        assert gemm.cuda_out_dtype_supported(cuda, torch.bfloat16) is out_dtype
        assert gemm._grouped_mm_available(cuda, torch.bfloat16) is grouped
        assert fp8_gemm.scaled_mm_works(cuda, "tensor") is tensor
        assert fp8_gemm.scaled_mm_works(cuda, "mx") is mx
        assert fp8_gemm.scaled_mm_works(cuda, "block") is block
        assert gemm_paths.verdict("scaled_mm", cuda, "mx")


def test_a_refused_fast_path_is_loud_on_a_gpu(monkeypatch):
    """On a real GPU (kernel probes) a probe refusing a path the capability says runs warns
    once with the GEMM's name, layout and shape, and raises under
    SPLITGRAD_REQUIRE_FAST_PATHS=1; a path the capability does not have stays quiet."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemm_paths, "capability_of", lambda device: (9, 0))
    monkeypatch.setattr(gemm_paths, "_MISSED", {})
    gemm_paths.probe_verdict("scaled_mm", cuda, "tensor", False, "probe raised RuntimeError: x")
    call = "FP8 forward GEMM E4M3 A (64, 32) row-major @ E4M3 B (32, 48) column-major"
    with pytest.warns(gemm_paths.FastPathMissed, match=r"A \(64, 32\) row-major.*probe raised"):
        gemm_paths.fast_path_missed("scaled_mm", cuda, "tensor", call)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemm_paths.fast_path_missed("scaled_mm", cuda, "tensor", call)  # once per path
        gemm_paths.fast_path_missed("scaled_mm", cuda, "mx", call)  # sm90 has no MXFP8
    assert len(gemm_paths.missed_fast_paths()) == 1
    monkeypatch.setenv("SPLITGRAD_REQUIRE_FAST_PATHS", "1")
    with pytest.raises(RuntimeError, match="fell back to the portable path on cuda sm90"):
        gemm_paths.fast_path_missed("scaled_mm", cuda, "tensor", call)
    gemm_paths._VERDICTS.clear()


# ---- nothing leaks --------------------------------------------------------------------------


def test_nothing_leaks_from_a_fake_cuda_block():
    """After a block, normal or failed: no mode stays pushed, grad mode is back, the probes
    run kernels again with empty caches, the capability is the device's own (a CPU build has
    none to report), every attribute module_step patched is the original, and the logger's
    level is restored; blocks do not nest."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    with pytest.raises(ZeroDivisionError):
        with fake_cuda.fake_cuda((10, 0)):
            module = impl.Linear(32, 16, params_dtype=torch.bfloat16, device="cuda")
            x = torch.empty(16, 32, dtype=torch.bfloat16, device="cuda")
            fake_cuda.module_step(
                module, x, torch.empty(16, 16, dtype=torch.bfloat16, device="cuda")
            )
            assert gemm_paths.probe_mode() == "capability"
            assert gemm.cuda_out_dtype_supported(torch.device("cuda", 0), torch.bfloat16)
            raise ZeroDivisionError("a failure inside the block")
    _assert_clean()
    assert logger.level == level
    assert gemm.cuda_out_dtype_supported.cache_info().currsize == 0
    assert fp8_gemm.scaled_mm_works.cache_info().currsize == 0
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            gemm_paths.capability_of(torch.device("cuda", 0))
    with fake_cuda.fake_cuda((9, 0)):
        with pytest.raises(RuntimeError, match="do not nest"):
            with fake_cuda.fake_cuda((10, 0)):
                pass
    _assert_clean()
    # A real CPU tensor after the block is a real CPU tensor again.
    assert type(torch.ones(2) + 1) is torch.Tensor
