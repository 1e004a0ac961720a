"""A rounding-error interpreter: how far a correct low-precision run may be from the float64
truth, element by element, for any summation order. :func:`rounding_bounds` replays a case
along the reference's formulas on :class:`Bounded` values with :class:`Arith`'s rules
(docs/budgets.md derives each); the budgets take the result as a per-element floor.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from .. import budgets as B
from ..cases.case import Case, make_recipe
from ..cases.data import (
    GEMM_WEIGHT,
    make_grad_prefill,
    make_main_grads,
    make_micro_batches,
    make_state,
    param_specs,
)
from ..checks.runner import Step, fb_steps
from .internals import NORM_EPS, norm_projection


def unit_roundoff(dtype: torch.dtype) -> float:
    """Round-to-nearest unit roundoff of ``dtype``: half its epsilon."""
    return torch.finfo(dtype).eps / 2


def sum_gamma(k: int, u: float) -> float:
    """Higham's ``gamma_k = k u / (1 - k u)``: a sum of ``k`` terms in any order is within
    ``gamma_k * sum|terms|`` of the exact sum (no bound for ``k u >= 1``)."""
    if k * u >= 1.0:
        raise ValueError(f"sum_gamma: no rounding bound for a sum of k={k} terms at u={u}")
    return k * u / (1.0 - k * u)


@dataclasses.dataclass
class Bounded:
    """An intermediate: ``v`` its float64 truth, ``s`` the sum of the squares of the rounding
    errors a correct run may carry on it, carried to later results through ``J**2``."""

    v: torch.Tensor
    s: torch.Tensor

    @staticmethod
    def exact(v: torch.Tensor) -> Bounded:
        """A value every run holds bit for bit (an input, a parameter, ``dy``)."""
        v = v.detach().double().cpu()
        return Bounded(v, torch.zeros_like(v))

    def rows(self, sl: slice) -> Bounded:
        return Bounded(self.v[sl], self.s[sl])

    def cols(self, sl: slice) -> Bounded:
        return Bounded(self.v[:, sl], self.s[:, sl])

    def t(self) -> Bounded:
        return Bounded(self.v.t(), self.s.t())

    def bound(self) -> torch.Tensor:
        """The elementwise rounding bound (a rounding to nearest errs uniformly within half an
        ulp: a standard deviation of 1/sqrt(3) of it)."""
        return B.ROUNDING_SIGMAS * (self.s / 3.0).sqrt()


def _worst(site: torch.Tensor) -> torch.Tensor:
    """A reduction's worst case ``site`` as a term of ``s``: three variances of its size."""
    return 3.0 * site**2


def _cat(parts: list[Bounded], dim: int, empty: torch.Tensor) -> Bounded:
    if not parts:
        return Bounded(empty, empty)
    return Bounded(*(torch.cat([getattr(p, f) for p in parts], dim) for f in "vs"))


class Arith:
    """Operations on :class:`Bounded` values, rounding where the reference rounds: ``u`` the
    unit roundoff of a stored result, ``uc`` that of the compute dtype."""

    def __init__(
        self, dtype: torch.dtype, cast_operands: bool = False, recipe: str | None = None
    ) -> None:
        self.u = unit_roundoff(dtype)
        self.uc = unit_roundoff(torch.float32 if dtype != torch.float64 else dtype)
        self.cast_operands = cast_operands
        self.recipe = None if recipe is None else make_recipe(recipe)
        # Per (GEMM, role) under delayed scaling: the largest scale_inv so far, and whether a
        # computed value was among the amaxes (then the scale itself may differ).
        self._scale_inv: dict[tuple[str, str], float] = {}
        self._tainted: set[tuple[str, str]] = set()

    def quant(self, a: Bounded, gemm: str, role: str) -> Bounded:
        """A GEMM operand quantized to FP8 as ``role`` of GEMM ``gemm``: where two correct runs
        may hold it apart (computed, or a computed value in a delayed scale's history), one FP8
        step of the element more, at the largest scale the recipe can be at."""
        if self.recipe is None or a.v.numel() == 0:
            return a
        from splitgrad.reference import fp8 as R
        from splitgrad.reference.fp8_quant import format_for

        fmt = format_for(self.recipe, role)
        margin = getattr(self.recipe, "margin", 0)
        amax = float(a.v.abs().max())
        scale_inv = amax * 2.0**margin / B.FP8_MAX[fmt]
        key = (gemm, role)
        computed = bool((a.s > 0).any())
        if isinstance(self.recipe, R.DelayedScaling):
            # Conservative in the order of uses: never below the initial scale 1.
            scale_inv = max(1.0, self._scale_inv.get(key, 1.0), scale_inv)
            self._scale_inv[key] = scale_inv
            if computed:
                self._tainted.add(key)
            computed = key in self._tainted
        if not computed:
            return a
        step = B.fp8_step(a.v, fmt, scale_inv)
        return Bounded(a.v, a.s + _worst(step))

    def operand(self, a: Bounded) -> Bounded:
        """A GEMM operand, rounded to the autocast dtype first under ``torch.autocast``."""
        return self.store(a) if self.cast_operands else a

    def param(self, w: torch.Tensor) -> Bounded:
        """A parameter as a GEMM operand (see :meth:`operand`)."""
        return self.operand(Bounded.exact(w))

    def store(self, a: Bounded, u: float | None = None) -> Bounded:
        """``a`` rounded once to the module dtype (or to unit roundoff ``u``)."""
        u = self.u if u is None else u
        return Bounded(a.v, a.s + (u * a.v) ** 2)

    def mm(self, a: Bounded, b: Bounded) -> Bounded:
        """``a @ b`` accumulated in fp32 in any order."""
        site = sum_gamma(a.v.shape[-1], self.uc) * (a.v.abs() @ b.v.abs())
        return Bounded(a.v @ b.v, a.v**2 @ b.s + a.s @ b.v**2 + _worst(site))

    def sum0(self, a: Bounded) -> Bounded:
        """Sum over rows in any order."""
        site = sum_gamma(a.v.shape[0], self.uc) * a.v.abs().sum(0)
        return Bounded(a.v.sum(0), a.s.sum(0) + _worst(site))

    def add(self, a: Bounded, b: Bounded) -> Bounded:
        """``a + b`` in the compute dtype."""
        v = a.v + b.v
        return Bounded(v, a.s + b.s + (self.uc * v) ** 2)

    def mul(self, a: Bounded, b: Bounded) -> Bounded:
        """``a * b`` in the compute dtype."""
        v = a.v * b.v
        return Bounded(v, a.s * b.v**2 + a.v**2 * b.s + (self.uc * v) ** 2)

    def fn(self, f, fprime, a: Bounded, size: torch.Tensor) -> Bounded:
        """Elementwise ``f(a)``: the operand's error through ``f'``, plus the formula's own,
        :data:`~.budgets.ACTIVATION_EVAL_STEPS` compute-dtype roundings of ``size``."""
        d = fprime(a.v)
        own = (B.ACTIVATION_EVAL_STEPS * self.uc * size) ** 2
        return Bounded(f(a.v), d**2 * a.s + own)


def _through(jac: torch.Tensor, a: Bounded) -> torch.Tensor:
    """``s`` of ``a``'s error through the exact per-row Jacobian ``jac`` (N, K_out, K_in)."""
    return (jac**2 @ a.s[:, :, None]).squeeze(-1)


def _norm_fwd(ar: Arith, x: Bounded, state, c) -> tuple[Bounded, dict]:
    """The norm of ``x`` along ``layer_norm_fwd`` / ``rms_norm_fwd`` (docs/budgets.md)."""
    layer_norm = c.normalization == "LayerNorm"
    k = x.v.shape[-1]
    gamma = state["layer_norm_weight"] + (1.0 if c.zero_centered_gamma else 0.0)
    mean = x.v.mean(-1, keepdim=True) if layer_norm else torch.zeros_like(x.v[:, :1])
    d = x.v - mean
    var = (d * d).mean(-1, keepdim=True)
    rstd = (var + NORM_EPS).rsqrt()
    xhat = d * rstd
    proj = norm_projection(xhat, layer_norm)
    sq = _through(rstd[:, :, None] * proj, x)
    gk = sum_gamma(k + 1, ar.uc)
    rel_var = var / (var + NORM_EPS)
    if layer_norm:
        sq = sq + _worst(rstd * gk * x.v.abs().mean(-1, keepdim=True))
    sq = sq + _worst(xhat.abs() * 0.5 * gk * rel_var)
    # x - mean, d * d, rsqrt (twice: not correctly rounded), d * rstd: one rounding each.
    sq = sq + ar.uc**2 * (rstd**2 * d**2 + 0.25 * rel_var**2 * xhat**2 + 5 * xhat**2)
    # rstd: var's summation, two roundings of rsqrt, and the input's error through
    # d rstd / dx = -rstd^2 xhat / K (first order).
    rstd_b = Bounded(
        rstd,
        _worst(0.5 * rstd * gk * rel_var)
        + (ar.uc * rstd) ** 2 * (4 + rel_var**2)
        + ((rstd**2 * xhat / k) ** 2 * x.s).sum(-1, keepdim=True),
    )
    xh = Bounded(xhat, sq)
    y = xhat * gamma
    yb = Bounded(y, gamma**2 * sq + (ar.uc * y) ** 2 * (1 + (4 if c.zero_centered_gamma else 0)))
    if layer_norm:
        yb = ar.add(yb, Bounded.exact(state["layer_norm_bias"].expand_as(y)))
    return ar.store(yb), {"xhat": xh, "rstd": rstd_b, "gamma": gamma, "proj": proj}


def _norm_bwd(ar: Arith, dy: Bounded, saved: dict, c) -> tuple[Bounded, Bounded, Bounded | None]:
    """dx, dgamma, dbeta along ``layer_norm_bwd`` / ``rms_norm_bwd``, before the slot's rounding
    (docs/budgets.md)."""
    layer_norm = c.normalization == "LayerNorm"
    xh, rstd, gamma, proj = saved["xhat"], saved["rstd"], saved["gamma"], saved["proj"]
    k = xh.v.shape[-1]
    r = rstd.v
    g = dy.v * gamma
    mgx = (g * xh.v).mean(-1, keepdim=True)
    mg = g.mean(-1, keepdim=True) if layer_norm else torch.zeros_like(mgx)
    dx = r * (g - mg - xh.v * mgx)
    sq = _through(r[:, :, None] * proj * gamma[None, None, :], dy)
    # Through the saved xhat: d dx = -rstd (d xhat * mean(g xhat) + xhat * mean(g d xhat)).
    sq = sq + r**2 * (xh.s * mgx**2 + xh.v**2 * (g**2 * xh.s).sum(-1, keepdim=True) / k**2)
    # Through rstd: dx is proportional to it.
    sq = sq + (dx / r) ** 2 * rstd.s
    # The formula's own work: its two means (any order) and five roundings of its terms.
    gk = sum_gamma(k + 1, ar.uc)
    means = g.abs().mean(-1, keepdim=True) + xh.v.abs() * (g * xh.v).abs().mean(-1, keepdim=True)
    terms = g.abs() + mg.abs() + (xh.v * mgx).abs()
    sq = sq + _worst(r * gk * means) + (ar.uc * r * terms) ** 2 * 5
    dxb = ar.store(Bounded(dx, sq))
    prod = Bounded(dy.v * xh.v, dy.s * xh.v**2 + dy.v**2 * xh.s + (ar.uc * dy.v * xh.v) ** 2)
    return dxb, ar.sum0(prod), ar.sum0(dy) if layer_norm else None


def _linear_fwd(ar: Arith, x: Bounded, w: torch.Tensor, b, gemm: str) -> Bounded:
    """``x W^T + b``: the GEMM rounded to the module dtype, then the bias sum rounded again."""
    xq = ar.quant(ar.operand(x), gemm, "input")
    y = ar.store(ar.mm(xq, ar.quant(ar.param(w), gemm, "weight").t()))
    if b is not None:
        y = ar.store(ar.add(y, ar.param(b.expand_as(y.v))))
    return y


def _act_pieces(name: str):
    from splitgrad.reference import functional as F

    return {
        "gelu": (F.gelu_tanh, F.gelu_tanh_grad),
        "geglu": (F.gelu_tanh, F.gelu_tanh_grad),
        "relu": (F.relu, F.relu_grad),
        "swiglu": (F.silu, F.silu_grad),
    }[name]


def _second_derivative(fprime, v: torch.Tensor) -> torch.Tensor:
    """``f''`` by central differences of the reference's own ``f'`` in float64."""
    step = 1e-5 * (1.0 + v.abs())
    return (fprime(v + step) - fprime(v - step)) / (2 * step)


def _module_bounds(ar: Arith, c, state, x: Bounded, dy_of) -> tuple[Bounded, dict]:
    """One use of a Linear / LayerNormLinear / LayerNormMLP on the rows ``x``, backward from
    ``dy_of(y)``: ``(y, grads)``, grads keyed ``"x"`` and by parameter (pre-rounding)."""
    grads: dict[str, Bounded] = {}
    h_in, saved = _norm_fwd(ar, x, state, c) if c.has_norm else (x, {})
    if c.kind in ("Linear", "LayerNormLinear"):
        y = _linear_fwd(ar, h_in, state["weight"], state.get("bias") if c.bias else None, "weight")
        dy = dy_of(y)
        dyq = ar.quant(dy, "weight", "grad_output")
        d_in = ar.store(ar.mm(dyq, ar.quant(ar.param(state["weight"]), "weight", "weight")))
        grads["weight"] = ar.mm(dyq.t(), ar.quant(ar.operand(h_in), "weight", "input"))
        if c.bias:
            grads["bias"] = ar.sum0(dy)
    else:
        f, fprime = _act_pieces(c.activation)
        gated = c.activation in ("swiglu", "geglu")
        w1, w2 = state["fc1_weight"], state["fc2_weight"]
        h = _linear_fwd(ar, h_in, w1, state.get("fc1_bias") if c.bias else None, "fc1")
        half = h.v.shape[-1] // 2
        a = h.cols(slice(0, half)) if gated else h
        fa = ar.fn(f, fprime, a, a.v.abs() + f(a.v).abs())
        act = ar.store(ar.mul(fa, h.cols(slice(half, None))) if gated else fa)
        y = _linear_fwd(ar, act, w2, state.get("fc2_bias") if c.bias else None, "fc2")
        dy = dy_of(y)
        dyq = ar.quant(dy, "fc2", "grad_output")
        d_act = ar.store(ar.mm(dyq, ar.quant(ar.param(w2), "fc2", "weight")))
        # relu' is judged at the truth's side of the kink (properties/oracle/kink.py): no jump here.
        curv = (lambda v: v * 0.0) if c.activation == "relu" else None
        slope = ar.fn(fprime, curv or (lambda v: _second_derivative(fprime, v)), a, 1.0 + a.v.abs())
        if gated:
            b = h.cols(slice(half, None))
            d_fc1 = ar.store(_cat([ar.mul(ar.mul(d_act, slope), b), ar.mul(d_act, fa)], -1, h.v))
        else:
            d_fc1 = ar.store(ar.mul(d_act, slope))
        d_fc1q = ar.quant(d_fc1, "fc1", "grad_output")
        d_in = ar.store(ar.mm(d_fc1q, ar.quant(ar.param(w1), "fc1", "weight")))
        grads["fc2_weight"] = ar.mm(dyq.t(), ar.quant(act, "fc2", "input"))
        grads["fc1_weight"] = ar.mm(d_fc1q.t(), ar.quant(ar.operand(h_in), "fc1", "input"))
        if c.bias:
            grads["fc2_bias"] = ar.sum0(dy)
            grads["fc1_bias"] = ar.sum0(d_fc1)
    if c.has_norm:
        dx, dgamma, dbeta = _norm_bwd(ar, d_in, saved, c)
        grads["layer_norm_weight"] = dgamma
        if dbeta is not None:
            grads["layer_norm_bias"] = dbeta
    else:
        dx = d_in
    grads["x"] = dx
    return y, grads


def _use(ar: Arith, c, state, x: Bounded, dy_of, splits) -> tuple[Bounded, dict]:
    """One use of the module on the rows ``x``; a GroupedLinear as a Linear per group of rows."""
    if c.kind != "GroupedLinear":
        return _module_bounds(ar, c, state, x, dy_of)
    lin = dataclasses.replace(c, kind="Linear", num_gemms=1)
    bounds = []
    for i, (start, n) in enumerate(zip(itertools.accumulate((0, *splits)), splits)):
        s = {"weight": state[f"weight{i}"]}
        if c.bias:
            s["bias"] = state[f"bias{i}"]
        bounds.append((slice(start, start + n), s))
    ys = [_module_bounds(ar, lin, s, x.rows(r), lambda y: y)[0] for r, s in bounds]
    dy = dy_of(_cat(ys, 0, x.v.new_zeros(0, c.out_features)))
    grads: dict[str, Bounded] = {}
    dxs = []
    for i, (r, s) in enumerate(bounds):
        _, g = _module_bounds(ar, lin, s, x.rows(r), lambda _y, r=r: dy.rows(r))
        dxs.append(g.pop("x"))
        grads.update({f"{k}{i}": v for k, v in g.items()})
    grads["x"] = _cat(dxs, 0, x.v.new_zeros(0, c.in_features))
    return _cat(ys, 0, x.v.new_zeros(0, c.out_features)), grads


class _Replay:
    """One module's gradient slots across steps, and its outputs' and input gradients' bounds."""

    def __init__(self, case: Case, prefill_grads: bool, frozen: Sequence[str]) -> None:
        c = self.config = case.config
        self.case = case
        self.ar = Arith(c.compute_dtype, cast_operands=c.autocast is not None, recipe=c.recipe)
        self.state = {k: v.detach().double().cpu() for k, v in make_state(c, case.seed).items()}
        self.data = make_micro_batches(case)
        self.flags = [mb.is_first_microbatch for mb in case.micro_batches]
        fused = c.fuse_wgrad_accumulation
        self.main = {s.name for s in param_specs(c) if s.role == GEMM_WEIGHT and fused}
        self.prefill_main = make_main_grads(c, case.seed)
        prefill = make_grad_prefill(c, case.seed) if prefill_grads else {}
        prefill.update({name: self.prefill_main[name] for name in self.main})
        self.slots: dict[str, Bounded | None] = {
            s.name: Bounded.exact(prefill[s.name]) if s.name in prefill else None
            for s in param_specs(c)
            if s.name not in frozen
        }
        self.out: dict[str, torch.Tensor] = {}

    def accumulate(self, grads: dict[str, Bounded], rows: int, flag: bool | None) -> None:
        """One use's parameter gradients into their slots: ``main_grad`` in fp32 (overwritten
        when flagged, SPEC §3), ``.grad`` in the module dtype."""
        ar, u32 = self.ar, unit_roundoff(torch.float32)
        for name, g in grads.items():
            if name not in self.slots:
                continue
            prev = self.slots[name]
            if name in self.main:
                if flag or prev is None:
                    self.slots[name] = ar.store(g, u32)
                    continue
                site = sum_gamma(rows + 1, u32) * (prev.v.abs() + g.v.abs())
                summed = Bounded(prev.v + g.v, prev.s + g.s + _worst(site))
                self.slots[name] = ar.store(summed, u32)
            else:
                g = ar.store(g)
                summed = g if prev is None else ar.store(Bounded(prev.v + g.v, prev.s + g.s))
                self.slots[name] = summed

    def record(self, i: int, y: Bounded, dx: Bounded) -> None:
        lead = self.case.micro_batches[i].lead_shape
        c = self.config
        self.out[f"output[micro-batch {i}]"] = y.bound().reshape(*lead, c.output_features)
        self.out[f"inp.grad[micro-batch {i}]"] = dx.bound().reshape(*lead, c.in_features)

    def use(self, i: int, dy_of=None, x: Bounded | None = None) -> tuple[Bounded, dict]:
        """Micro-batch ``i`` (or rows ``x``) through the module once, backward from ``dy_of(y)``."""
        d, c = self.data[i], self.config
        if x is None:
            x = Bounded.exact(d.x.reshape(-1, c.in_features))
        dy = Bounded.exact(d.dy.reshape(-1, c.output_features))
        return _use(self.ar, c, self.state, x, dy_of or (lambda _y: dy), d.spec.m_splits)

    def step(self, step: Step) -> None:
        i = step.index
        if step.op == "zero":  # every .grad to None, a fused weight's main_grad to zeros
            for name in self.slots:
                zero = torch.zeros_like(self.prefill_main[name]) if name in self.main else None
                self.slots[name] = None if zero is None else Bounded.exact(zero)
            return
        rows = self.case.micro_batches[i].rows
        if step.op == "fb":
            y, g = self.use(i)
            self.record(i, y, g.pop("x"))
            self.accumulate(g, rows, self.flags[i])
        elif step.op == "tied":
            y0, g0 = self.use(i)
            y1, g1 = self.use(i + 1)
            self.record(i, y0, g0.pop("x"))
            self.record(i + 1, y1, g1.pop("x"))
            # The second use's wgrad runs first.
            self.accumulate(g1, self.case.micro_batches[i + 1].rows, None)
            self.accumulate(g0, rows, self.flags[i])
        else:  # chain: y = m(m(x)), one backward
            inner: dict[str, Bounded] = {}

            def second(y0: Bounded) -> Bounded:
                y1, g1 = self.use(i, x=y0)
                inner.update(g1, y=y1)
                return inner.pop("x")

            _, g0 = self.use(i, second)
            self.record(i, inner.pop("y"), g0.pop("x"))
            self.accumulate(inner, rows, None)
            self.accumulate(g0, rows, self.flags[i])

    def bounds(self) -> dict[str, torch.Tensor]:
        out = dict(self.out)
        for name, slot in self.slots.items():
            if slot is not None:
                out[f"{name}.{'main_grad' if name in self.main else 'grad'}"] = slot.bound()
        return out


def rounding_bounds(
    case: Case,
    steps: Sequence[Step] | None = None,
    prefill_grads: bool = False,
    frozen: Sequence[str] = (),
) -> dict[str, torch.Tensor]:
    """Per compared tensor (outputs, input gradients, gradient slots' snapshot keys), the
    elementwise bound on a correct run's rounding error after ``steps`` (default: one forward and
    backward per micro-batch), on a module prepared as the check prepared it; under FP8, how far
    two correct runs can be apart. Empty in float64."""
    if case.config.torch_dtype == torch.float64:
        return {}
    replay = _Replay(case, prefill_grads, frozen)
    for step in fb_steps(len(replay.data)) if steps is None else steps:
        replay.step(step)
    return replay.bounds()
