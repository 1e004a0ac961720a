"""The cuda_trace tier for tensor parallelism (SPEC §9): impl's TP Functions traced on fake CUDA
tensors at sm90 and sm100, over torch's fake process group of 8 ranks (its collectives return at
once with the right shapes; every GEMM between them sees the per-rank shapes of a real tp 8 run).

``module_step`` runs the TP Functions as the engine would; that is checked first on 2 real gloo
ranks on the CPU (bitwise against autograd, W step included). Then every TP module, sequence
parallel, TE's ``wgrad_gather="backward"`` (``"backward_dw"`` reads its order tag on the host,
which fake tensors cannot do), delayed, in bf16 and under each FP8 recipe, must pass torch's
meta checks of every GEMM, make the host wait for nothing, and give outputs and gradients of
the expected shape, dtype and device.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from splitgrad.bench.tensor_parallel import fake_process_group
from splitgrad.distributed import run_ranks
from splitgrad.impl import fake_cuda
from test_cuda_trace import assert_on_cuda

TP = 8
KINDS = ("Linear column", "Linear row", "LayerNormLinear column", "LayerNormMLP")


def _build(lib, kind: str, hidden: int, group, device=None, **options):
    kw = dict(tp_group=group, sequence_parallel=True, device=device, **options)
    if kind == "LayerNormMLP":
        return lib.LayerNormMLP(
            hidden, 2 * hidden, activation="swiglu", set_parallel_mode=True, **kw
        )
    cls = lib.LayerNormLinear if kind.startswith("LayerNorm") else lib.Linear
    return cls(hidden, hidden, parallel_mode=kind.split()[-1], **kw)


def _input_rows(kind: str, seq: int, tp: int) -> int:
    """Dim 0 of one rank's input: a row Linear takes the whole sequence (its features are
    split), every other SP module this rank's slice of it."""
    return seq if kind == "Linear row" else seq // tp


def _step_matches_autograd(rank: int, world: int) -> int:
    import splitgrad.impl as impl

    g = dist.group.WORLD
    checked = 0
    for kind in KINDS:
        runs, y_shape = [], None
        for stepped in (False, True):
            torch.manual_seed(0)
            m = _build(impl, kind, 16, g, delay_wgrad_compute=True)
            torch.manual_seed(1 + rank)
            features = 16 if kind == "LayerNormMLP" else m.in_features
            x = torch.randn(_input_rows(kind, 4, world), 3, features, requires_grad=True)
            if stepped:
                dy = torch.randn(y_shape, generator=torch.Generator().manual_seed(rank))
                step = fake_cuda.module_step(m, x, dy)
                y, dx = step.y.reshape(y_shape), step.dx.reshape(x.shape)
            else:
                y = m(x)
                y_shape = y.shape
                y.backward(torch.randn(y_shape, generator=torch.Generator().manual_seed(rank)))
                dx = x.grad
            m.backward_dw()
            runs.append([y, dx, *(p.grad for p in m.parameters())])
        for a, b in zip(*runs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            checked += 1
    return checked


@pytest.mark.distributed
def test_module_step_runs_the_tp_functions_as_autograd():
    assert all(n > 0 for n in run_ranks(_step_matches_autograd, 2, timeout_s=120))


def _recipes():
    import splitgrad.impl as impl

    return [
        ("bf16", None, (9, 0)),
        ("delayed", impl.DelayedScaling(), (9, 0)),
        ("current", impl.Float8CurrentScaling(), (9, 0)),
        ("block", impl.Float8BlockScaling(), (9, 0)),
        ("mxfp8", impl.MXFP8BlockScaling(), (10, 0)),
    ]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recipe_name", ["bf16", "delayed", "current", "block", "mxfp8"])
def test_tp_paths_trace_on_fake_cuda(kind, recipe_name):
    import splitgrad.impl as impl

    _, recipe, cap = next(r for r in _recipes() if r[0] == recipe_name)
    hidden, seq, batch = 1024, 1024, 2  # multiples of 128 per rank for the block recipes
    with fake_process_group(TP) as group, fake_cuda.fake_cuda(cap) as calls:
        m = _build(
            impl,
            kind,
            hidden,
            group,
            device="cuda",
            params_dtype=torch.bfloat16,
            delay_wgrad_compute=True,
            fuse_wgrad_accumulation=True,
        )
        for p in m.parameters():
            if p.dim() == 2:
                p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        features = m.in_features if kind != "LayerNormMLP" else hidden
        x = torch.empty(
            _input_rows(kind, seq, TP),
            batch,
            features,
            dtype=torch.bfloat16,
            device="cuda",
            requires_grad=True,
        )
        out_features = hidden if kind in ("Linear row", "LayerNormMLP") else hidden // TP
        out_rows = seq if kind.endswith("column") else seq // TP  # SP: gathered, or scattered
        dy = torch.empty(out_rows, batch, out_features, dtype=torch.bfloat16, device="cuda")
        step = fake_cuda.module_step(m, x, dy, recipe=recipe)
        _check_tp_gradients(m, "backward", deferred=True)
        assert m.pending_wgrad_count == 1
        m.backward_dw()
        assert m.pending_wgrad_count == 0
        _check_tp_gradients(m, "backward_dw", deferred=False)
        assert calls.gemms, "no GEMM was traced"
    assert_on_cuda(step.y, (out_rows, batch, out_features), torch.bfloat16, "y")
    assert_on_cuda(step.dx, (x.numel() // features, features), torch.bfloat16, "dx")


def _check_tp_gradients(m, what: str, *, deferred: bool) -> None:
    """Norm gradients (written in backward) and, unless still ``deferred``, GEMM weights'
    main_grad (fp32) and biases' .grad, in the parameter's shape on CUDA."""
    for name, p in m.named_parameters():
        if p.dim() == 2:
            assert_on_cuda(p.main_grad, p.shape, torch.float32, f"{what}: {name}.main_grad")
        elif "layer_norm" in name or not deferred:
            assert_on_cuda(p.grad, p.shape, torch.bfloat16, f"{what}: {name}.grad")
        else:
            assert p.grad is None, f"{what}: {name}.grad written before backward_dw"
