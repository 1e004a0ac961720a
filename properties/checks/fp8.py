"""P13 (SPEC §6, §7), FP8: a backend's FP8 quantizers equal the reference's bit for bit, and a
delayed module's amax histories, scales and gradients equal a non-delayed one's over several
steps.

Quantizers: every operand the case's GEMMs quantize (input ``(tokens, K)``, weight ``(M, K)``,
grad_output ``(tokens, M)`` per GEMM weight and micro-batch), along rows (``axis=1``) and
columns (``axis=0``), must come back from the backend's ``quantize(x, recipe, role, axis,
state)`` as the reference's FP8 bytes (compared as ``uint8``: the sign of zero and saturated
values count) and ``scale_inv``. Delayed scaling threads one state per role through both sides,
compared after each quantization and each update. ``case.variant`` picks the values: ``randn``
(a wide exponent range), ``specials`` (+-0, +-inf, past the format's maximum, subnormal range,
an all-zero block) or ``outliers`` (a few 1000x the rest); no NaN: SPEC says only that NaN
stays NaN, not which NaN.

Modules: over at least two micro-batches, the delayed module runs each entry's
``backward_dw()`` only after the *next* micro-batch moved the scales. Outputs, input gradients,
histories and scales compare bitwise after every step, all gradients at the end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from hypothesis import strategies as st

from ..backends import Backend
from ..cases.data import generator, make_micro_batches
from ..cases.strategies import RECIPES, Case, cases, make_recipe
from .results import CheckResult, PropertyViolation, Tracker
from .runner import ModuleRun

# Value patterns P13's quantizer operands are drawn with (see the module docstring).
P13_VALUES = ("randn", "specials", "outliers")


def quantizer_operands(case: Case) -> list[tuple[str, str, torch.Tensor, tuple[int, ...]]]:
    """``(label, role, tensor, axes)`` for every operand the case's GEMMs quantize (values from
    the case's seed and ``variant``; empty token counts left out)."""
    c = case.config
    token_counts = []
    for mb in case.micro_batches:
        token_counts.extend(mb.m_splits if c.kind == "GroupedLinear" else (mb.rows,))
    shapes = c.gemm_shapes()
    g = generator(case.seed, 30_000)
    out = []
    for gi, (m, k) in enumerate(shapes if c.kind != "GroupedLinear" else shapes[:1]):
        out.append((f"gemm{gi}.weight", "weight", _values(case, (m, k), g), (1, 0)))
        for ti, n in enumerate(token_counts):
            if n == 0:
                continue
            for role, shape in (("input", (n, k)), ("grad_output", (n, m))):
                out.append((f"gemm{gi}.{role}[{ti}]", role, _values(case, shape, g), (1, 0)))
    return out


def _values(case: Case, shape: tuple[int, int], g: torch.Generator) -> torch.Tensor:
    """One operand in the case's dtype: normal values at a drawn exponent, plus the variant's."""
    scale = 2.0 ** float(torch.randint(-12, 13, (), generator=g))
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale
    flat = x.view(-1)
    n = flat.numel()
    if case.variant == "specials" and n:
        big = 1e6 * scale
        picks = torch.randperm(n, generator=g)[:8].tolist()
        # All-zero blocks: row 0 (row-wise blocks and tiles) and column 0 (column-wise ones).
        x[0].zero_()
        x[:, 0].zero_()
        values = [0.0, -0.0, math.inf, -math.inf, big, -big, scale * 2.0**-30, -scale * 2.0**-40]
        for i, v in zip(picks, values):
            flat[i] = v
    elif case.variant == "outliers" and n:
        picks = torch.randperm(n, generator=g)[: max(1, n // 64)]
        flat[picks] *= 1000.0
    return x.to(case.config.torch_dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8)


def _compare_state(t: Tracker, label: str, got: Any, want: Any) -> None:
    t.bitwise(f"{label}: amax_history", got.amax_history, want.amax_history)
    t.bitwise(f"{label}: scale", got.scale, want.scale)


def check_quantizers(backend: Backend, case: Case, t: Tracker) -> None:
    """The quantizer half of P13 (see the module docstring)."""
    from splitgrad.reference import fp8_quant as ref

    test = backend.fp8_quantizer()
    recipe = make_recipe(case.config.recipe)
    delayed = type(recipe).__name__ == "DelayedScaling"
    states: dict[str, tuple[Any, Any]] = {}
    for label, role, x, axes in quantizer_operands(case):
        if delayed and role not in states:
            state_class = getattr(test, "DelayedScalingState", ref.DelayedScalingState)
            states[role] = (
                state_class(recipe.amax_history_len, x.device),
                ref.DelayedScalingState(recipe.amax_history_len, x.device),
            )
        for axis in axes:
            got_state, want_state = states.get(role, (None, None))
            want = ref.quantize(x, recipe, role, axis, state=want_state)
            got = test.quantize(x, recipe, role, axis, state=got_state)
            what = f"{label} {role} axis={axis} ({case.config.recipe})"
            t.equal(f"{what}: fp8 dtype", got.data.dtype, want.data.dtype)
            t.bitwise(f"{what}: fp8 bytes", _bits(got.data), _bits(want.data))
            # As fp32: an E8M0 scale converts exactly (it is a power of two).
            t.bitwise(f"{what}: scale_inv", got.scale_inv.to(torch.float32), want.scale_inv)
            if delayed:
                _compare_state(t, f"{label} {role} after quantizing", got_state, want_state)
        if delayed:
            got_state, want_state = states[role]
            fmt = ref.format_for(recipe, role)
            want_state.update(recipe, fmt)
            got_state.update(recipe, fmt)
            _compare_state(t, f"{label} {role} after the update", got_state, want_state)


def check_histories(backend: Backend, case: Case, t: Tracker) -> None:
    """The module half of P13 (see the module docstring)."""
    data = make_micro_batches(case)
    if len(data) < 2:
        raise PropertyViolation("P13 needs at least two micro-batches (histories must move)")
    eager = ModuleRun(backend, case, delay=False, prefill_grads=True)
    late = ModuleRun(backend, case, delay=True, prefill_grads=True)
    for i, d in enumerate(data):
        xe, ye = eager.fb(d)
        xl, yl = late.fb(d)
        t.bitwise(f"step {i}: output", yl, ye)
        t.bitwise(f"step {i}: inp.grad", xl.grad, xe.grad)
        if i:
            late.dw()  # the previous step's entry, after this step moved the scales
        t.bitwise_all(f"step {i}: ", late.fp8_snapshot(), eager.fp8_snapshot())
    late.drain()
    t.bitwise_all("after draining: ", late.all_snapshot(), eager.all_snapshot())
    t.bitwise_all("after draining: ", late.fp8_snapshot(), eager.fp8_snapshot())
    if case.config.recipe.startswith("delayed"):
        # Harness self-check: the forwards really ran under the recipe and histories moved.
        state = eager.fp8_snapshot()
        moved = [k for k in state if k.endswith(".amax_history")]
        t.expect(bool(moved), f"no amax history after {len(data)} FP8 steps")
        busy = any(int(state[k].count_nonzero()) > 1 for k in moved)
        t.expect(busy, "no amax history holds more than one step")


def check_p13(backend: Backend, case: Case) -> CheckResult:
    """P13 on ``case`` (an FP8 case: ``case.config.recipe`` is set)."""
    if case.config.recipe is None:
        raise ValueError("P13 needs an FP8 case (config.recipe is None)")
    t = Tracker()
    check_quantizers(backend, case, t)
    check_histories(backend, case, t)
    return t.result


@st.composite
def p13_cases(draw, kinds, dtypes, devices, recipes):
    """FP8 cases (every recipe when ``recipes`` has none) of 2-3 micro-batches, with a value
    pattern from :data:`P13_VALUES` as ``variant``."""
    fp8 = tuple(r for r in recipes if r is not None) or tuple(RECIPES)
    case = draw(cases(kinds, dtypes, devices, n_micro_batches=(2, 3), recipes=fp8))
    return dataclasses.replace(case, variant=draw(st.sampled_from(P13_VALUES)))
