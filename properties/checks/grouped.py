"""P12 (SPEC §7): ``GroupedLinear`` == a list of ``Linear``\\ s on ``torch.split(x, m_splits)``,
empty groups included, and its own gradients within budget of the float64 truth."""

from __future__ import annotations

import dataclasses

import torch

from .. import budgets as B
from ..backends import Backend
from ..cases.case import Case
from ..cases.data import (
    MicroBatchData,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    make_state,
)
from ..oracle.truth import judge_steps, truth_runs
from .results import CheckResult, Tracker
from .runner import AccuracyRun, ModuleRun, Snapshot, clone_of, fb_steps


def check_p12(backend: Backend, case: Case) -> CheckResult:
    """P12: ``GroupedLinear(n)`` against ``n`` ``Linear``\\ s with the same weights on
    ``torch.split(x, m_splits)`` (empty groups included), delayed or not: outputs, input grads,
    weight/bias gradients and ``main_grad`` bitwise when :meth:`Backend.p12_bitwise`, else within
    :data:`~.budgets.GROUPED_GEMM` of the float64 truth relative to the Linears' error."""
    t = Tracker()
    config = case.config
    if config.kind != "GroupedLinear":
        raise ValueError(f"P12 needs a GroupedLinear case, got {config.kind}")
    data = make_micro_batches(case)
    grouped = ModuleRun(backend, case, delay=case.delay, prefill_grads=True)
    linears = _linears(backend, case)
    bitwise = backend.p12_bitwise(config)
    xgrads = []
    pairs: list[_Pair] = []
    for k, d in enumerate(data):
        xg, yg = grouped.fb(d)
        xgrads.append(clone_of(xg.grad))
        y_lin, dx_lin = _linears_fb(linears, d, yg)
        if bitwise:
            t.bitwise(f"output[micro-batch {k}] grouped vs linears", yg, y_lin)
            t.bitwise(f"inp.grad[micro-batch {k}] grouped vs linears", xg.grad, dx_lin)
        pairs.append((yg, y_lin, xg.grad, dx_lin.detach()))
    grouped.drain()
    norm = grouped.norm_snapshot()
    for lin in linears:
        lin.drain()
    got = grouped.gemm_snapshot()
    lin_grads: Snapshot = {}  # Linear i's gradients by the grouped module's names
    for i, lin in enumerate(linears):
        for key, value in lin.gemm_snapshot().items():
            gkey = key.replace(".", f"{i}.", 1)  # weight.grad -> weight{i}.grad
            lin_grads[gkey] = value
            if bitwise:
                t.bitwise(f"{gkey} grouped vs linear {i}", got.get(gkey), value)
            else:
                t.expect(gkey in got, f"{gkey} missing from the grouped module's gradients")
    # FP8: group i quantizes with its own scales and history, exactly as Linear i does.
    got_fp8 = grouped.fp8_snapshot()
    for i, lin in enumerate(linears):
        for key, value in lin.fp8_snapshot().items():
            gkey = key.replace("fp8_states[", f"fp8_states[gemm{i}.", 1)
            t.bitwise(f"{gkey} grouped vs linear {i}", got_fp8.get(gkey), value)
    if not bitwise:
        # Within budget: the float64 truth is the reference GroupedLinear in float64.
        _p12_budget(t, case, got, lin_grads, pairs)
    # Both sides may share a bug (the grouped module reusing Linear's code): judge the grouped
    # module's own gradients against the float64 truth as well.
    judged = AccuracyRun([], xgrads, norm, got)
    judge_steps(t, case, fb_steps(len(data)), judged, prefill_grads=True)
    return t.result


# (grouped output, Linears' output, grouped input grad, Linears' input grad) of a micro-batch
_Pair = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]


def _linears(backend: Backend, case: Case) -> list[ModuleRun]:
    """One ``Linear`` per group, with that group's weights, ``main_grad`` and ``.grad``
    prefills (the grouped module's, group by group)."""
    config = case.config
    lin_config = dataclasses.replace(config, kind="Linear", num_gemms=1)
    state = make_state(config, case.seed)
    mg = make_main_grads(config, case.seed)
    pre = make_grad_prefill(config, case.seed)
    linears = []
    for i in range(config.num_gemms):
        s = {name: state[f"{name}{i}"] for name in ("weight", "bias") if f"{name}{i}" in state}
        main_grads = {"weight": mg[f"weight{i}"]}
        lin = ModuleRun(
            backend, case, delay=case.delay, config=lin_config, state=s, main_grads=main_grads
        )
        for name, p in lin.params.items():
            if not lin.uses_main_grad(name):
                p.grad = pre[f"{name}{i}"].clone()
        linears.append(lin)
    return linears


def _linears_fb(
    linears: list[ModuleRun], d: MicroBatchData, yg: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward of each group's rows through its ``Linear``: (output, input grad).
    The Linears see the very views torch.split gives (same addresses as the grouped module's
    row blocks): some CPU GEMM kernels sum in another order for an operand at another
    alignment, which is a different kernel, not a different rule."""
    splits = list(d.spec.m_splits or ())
    x_all = d.fresh_input()  # the same layout as the grouped module's input
    ys = []
    for lin, xi, dyi in zip(linears, x_all.split(splits), d.dy.split(splits)):
        yi = lin.forward(xi, None, d.spec.is_first_microbatch)
        lin.backend.backward(lin.module, [yi], [dyi])
        ys.append(yi.detach())
    y_lin = torch.cat(ys) if ys else yg
    return y_lin, x_all.grad if x_all.grad is not None else torch.zeros_like(x_all)


def _p12_budget(t: Tracker, case: Case, got: Snapshot, lin_grads: Snapshot, pairs: list[_Pair]):
    """Grouped within :data:`~.budgets.GROUPED_GEMM` of the float64 truth, relative to the
    Linears' own error: outputs, input gradients, and every weight/bias gradient."""
    runs = truth_runs(case, fb_steps(len(case.micro_batches)))
    # Under FP8 every quantized operand is an input: the truth is the same recipe in float64.
    truth = runs.truth8 if runs.truth8 is not None else runs.truth
    dt = case.config.compute_dtype
    for k, (yg, y_lin, dxg, dx_lin) in enumerate(pairs):
        t.budget(f"output[micro-batch {k}]", yg, truth.outputs[k], y_lin, B.GROUPED_GEMM, dt, dt)
        t.budget(f"inp.grad[micro-batch {k}]", dxg, truth.xgrads[k], dx_lin, B.GROUPED_GEMM, dt, dt)
    for gkey, value in lin_grads.items():
        wdt = torch.float32 if gkey.endswith(".main_grad") else dt
        t.budget(gkey, got.get(gkey), truth.gemm.get(gkey), value, B.GROUPED_GEMM, wdt, dt)
