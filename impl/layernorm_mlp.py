"""impl ``LayerNormMLP``: norm, fc1, activation, fc2 — one queue entry covers fc2 and fc1.

Saved vs recomputed activation (measured with ``splitgrad bench``, CPU, 2048 tokens, hidden 1024,
ffn 4096): the forward keeps ``ln_out``, fc1's output ``h`` (the activation backward needs it)
and ``act(h)`` (fc2's wgrad operand), like a ``torch.nn`` MLP does. Recomputing ``act(h)`` in
backward instead saves one (N, ffn) tensor per micro-batch between forward and backward (40 vs
72 MB kept at fp32, 20 vs 36 MB at bf16) but made the backward 6% (fp32) to 14% (bf16) slower,
because the tanh-GELU pass costs as much as half a bf16 GEMM on CPU; speed wins by default. Set
``LayerNormMLP.recompute_activation = True`` (class or instance) to trade it back. Either way a
queued entry holds exactly ``dy, act(h), d_fc1, ln_out`` (the wgrad operands), so delay keeps
nothing the non-delayed backward would not have kept.
"""

from __future__ import annotations

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, LayerNormMLPContract

from . import compiled, gemm
from .activation import act_bwd, act_fwd
from .base import (
    FP8WgradPart,
    SplitBackwardModule,
    autocast_cast,
    edge_routes,
    fast_apply,
    norm_module_backward,
    take_fp8,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .norm import norm_bwd, norm_fwd

__all__ = ["LayerNormMLP"]


def _needs(dest) -> tuple[bool, ...]:
    """From the destinations of (layer_norm_weight, layer_norm_bias, fc1_weight, fc1_bias,
    fc2_weight, fc2_bias): whether each norm gradient is computed at all, and whether each GEMM
    parameter's is written (accumulated) by the wgrad closure."""
    return (dest[0] is not None, dest[1] is not None, *(d == ACCUMULATE for d in dest[2:]))


_NAMES = LayerNormMLPContract._parameter_names


def _written(leaves, need_w1: bool, need_b1: bool, need_w2: bool, need_b2: bool) -> tuple:
    """The (name, leaf) pairs the closure writes, in writing order: fc2's, then fc1's."""
    _, _, w1, b1, w2, b2 = leaves
    pairs = (("fc2_weight", w2, need_w2), ("fc2_bias", b2, need_b2))
    pairs += (("fc1_weight", w1, need_w1), ("fc1_bias", b1, need_b1))
    return tuple((name, leaf) for name, leaf, need in pairs if need)


def _backward(module, dy, saved, need_x, dest, leaves, overwrite, compiled_graph=False):
    """``(dx, d_layer_norm_weight, d_layer_norm_bias, dW1, db1, dW2, db2)`` from the forward's
    ``saved`` tensors: fc2 dgrad, activation, fc1 dgrad and norm backward now; one wgrad
    closure for fc2 and fc1 run now or queued; the gradients ``torch.autograd.grad`` asked for
    returned. The body of both the eager Function's backward and the compiled op."""
    x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, act_out, fc2_weight, *stats = saved
    to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
    need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = _needs(dest)
    _, _, w1, b1, w2, b2 = leaves
    written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
    named_weights = [(n, leaf) for n, leaf in written if n.endswith("weight")]
    hooked = module._begin_writes(written)

    need_norm = need_x or need_lnw or need_lnb
    d_fc1_out = None
    if need_norm or to_w1 is not None or to_b1 is not None:
        d_act = torch.mm(dy, fc2_weight)
        d_fc1_out, recomputed = act_bwd(
            d_act, fc1_out, module.activation, want_out=to_w2 is not None and act_out is None
        )
        del d_act
        if recomputed is not None:
            act_out = recomputed
    elif to_w2 is not None and act_out is None:
        act_out = act_fwd(fc1_out, module.activation)
    d_ln_out = torch.mm(d_fc1_out, fc1_weight) if need_norm else None
    dx, d_lnw, d_lnb = norm_bwd(
        module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
    )
    del d_ln_out

    if written:

        def wgrad_closure(dy, act_out, d_fc1_out, ln_out):
            module._check_main_grads(named_weights)
            if need_w2:
                module._write_weight_grad(w2, dy, act_out, overwrite)
            if need_b2:
                module._write_bias_grad(b2, dy)
            if need_w1:
                module._write_weight_grad(w1, d_fc1_out, ln_out, overwrite)
            if need_b1:
                module._write_bias_grad(b1, d_fc1_out)

        # Keep only what this entry reads; None for operands of frozen parameters.
        saved = (
            dy if (need_w2 or need_b2) else None,
            act_out.detach() if need_w2 else None,
            d_fc1_out if (need_w1 or need_b1) else None,
            ln_out.detach() if need_w1 else None,
        )
        module._submit_wgrad(wgrad_closure, saved, written, compiled_graph, hooked)
    # Asked for by torch.autograd.grad: returned now, nothing written or queued.
    returned = (
        gemm.wgrad(d_fc1_out, ln_out) if to_w1 == RETURN else None,
        d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
        gemm.wgrad(dy, act_out) if to_w2 == RETURN else None,
        dy.sum(dim=0) if to_b2 == RETURN else None,
    )
    return dx, d_lnw, d_lnb, *returned


class _LayerNormMLPFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias, module, ow, autocast
    ):
        ctx.module, ctx.overwrite, ctx.autocast = module, ow, autocast
        ctx.params = (ln_weight, ln_bias, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
        ctx.present = tuple(p is not None for p in ctx.params)
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: the norm in the parameters' dtype; both GEMMs, and the
        # activation between them (on fc1's output), in the autocast dtype.
        ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias = autocast_cast(
            autocast, ln_out, fc1_weight, fc1_bias, fc2_weight, fc2_bias
        )
        fc1_out = gemm.linear_forward(ln_out, fc1_weight, fc1_bias)
        act_out = act_fwd(fc1_out, module.activation)
        kept_act = None if module.recompute_activation else act_out
        ctx.save_for_backward(
            x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, kept_act, fc2_weight, *stats
        )
        return gemm.linear_forward(act_out, fc2_weight, fc2_bias)

    # Compiled, it calls the op splitgrad::layernorm_mlp_backward (see :mod:`.compiled`) on the
    # saved x, ln_weight, ln_bias, ln_out, fc1_weight, fc1_out, act_out (None when recomputed),
    # fc2_weight.
    backward = norm_module_backward("splitgrad::layernorm_mlp_backward", _NAMES, 8, _backward)


_apply = fast_apply(_LayerNormMLPFunction)


class _LayerNormMLPFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe: fc1 and fc2 are FP8 GEMMs (states ``fc1.*``,
    ``fc2.*``); norm and activation run in high precision between them. The entry holds fc2's
    and fc1's column-wise FP8 operands and the two bias gradients."""

    @staticmethod
    def forward(ctx, x, ln_weight, ln_bias, w1, b1, w2, b2, module, overwrite, recipe, autocast):
        needs = ctx.needs_input_grad
        need_norm = any(needs[:3])
        need_d_fc1 = need_norm or needs[3] or needs[4]
        ln_out, stats = norm_fwd(module, x, ln_weight, ln_bias)
        # SPEC §2 under torch.autocast: fc1's input and both biases in the autocast dtype (so
        # are fc1's output, the activation and fc2's output); weights quantized from their own.
        ln_out, b1, b2 = autocast_cast(autocast, ln_out, b1, b2)
        fc1 = FP8GemmOperands(module, recipe, "fc1")
        fc2 = FP8GemmOperands(module, recipe, "fc2")
        fc1_out = fc1.fprop(ln_out, w1, b1, keep_x=needs[3], keep_w=need_norm)
        del ln_out
        act_out = act_fwd(fc1_out, module.activation)
        y = fc2.fprop(act_out, w2, b2, keep_x=needs[5], keep_w=need_d_fc1)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.overwrite, ctx.fp8 = module, overwrite, (fc1, fc2)
        ctx.present = tuple(p is not None for p in (ln_weight, ln_bias, w1, b1, w2, b2))
        ctx.weight_dtypes = (w1.dtype, w2.dtype)
        ctx.save_for_backward(x, ln_weight, ln_bias, fc1_out, *stats)
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module, (fc1, fc2) = take_fp8(ctx)
        x, ln_weight, ln_bias, fc1_out, *stats = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dest, leaves = edge_routes(ctx, ctx.present)
        to_lnw, to_lnb, to_w1, to_b1, to_w2, to_b2 = dest
        need_lnw, need_lnb, need_w1, need_b1, need_w2, need_b2 = _needs(dest)
        _, _, w1, b1, w2, b2 = leaves
        written = _written(leaves, need_w1, need_b1, need_w2, need_b2)
        named_weights = [(n, leaf) for n, leaf in written if n.endswith("weight")]
        module._begin_writes(written)
        need_norm = need_x or need_lnw or need_lnb
        need_d_fc1 = need_norm or to_w1 is not None or to_b1 is not None
        d_act = fc2.dgrad(dy, need_dx=need_d_fc1, keep_dy=to_w2 is not None)
        d_fc1_out = d_ln_out = None
        if need_d_fc1:
            d_fc1_out, _ = act_bwd(d_act, fc1_out, module.activation, want_out=False)
            del d_act
            d_ln_out = fc1.dgrad(d_fc1_out, need_dx=need_norm, keep_dy=to_w1 is not None)
        update_delayed_scaling(module, fc2.recipe, ("grad_output",))
        dx, d_lnw, d_lnb = norm_bwd(
            module, d_ln_out, x, ln_weight, ln_bias, stats, (need_x, need_lnw, need_lnb)
        )
        del d_ln_out
        dy2, act_q = fc2.take_wgrad_operands()
        dy1, ln_q = fc1.take_wgrad_operands()
        # Asked for by torch.autograd.grad: returned now, nothing written or queued.
        w1_dtype, w2_dtype = ctx.weight_dtypes
        returned = (
            fp8_wgrad_value(module, w1_dtype, dy1, ln_q) if to_w1 == RETURN else None,
            d_fc1_out.sum(dim=0) if to_b1 == RETURN else None,
            fp8_wgrad_value(module, w2_dtype, dy2, act_q) if to_w2 == RETURN else None,
            dy.sum(dim=0) if to_b2 == RETURN else None,
        )
        if written:
            parts = [
                FP8WgradPart(w2, b2, dy2, act_q, dy.sum(dim=0) if need_b2 else None),
                FP8WgradPart(w1, b1, dy1, ln_q, d_fc1_out.sum(dim=0) if need_b1 else None),
            ]
            module._submit_fp8_wgrad(parts, named_weights, ctx.overwrite, written)
        return dx, d_lnw, d_lnb, *returned, None, None, None, None


_fp8_forward = compiled.eager_apply(_LayerNormMLPFP8Function)


class LayerNormMLP(LayerNormMLPContract, SplitBackwardModule):
    """``y = fc2(act(fc1(norm(x))))``.

    Same constructor, parameters and behaviour as ``splitgrad.reference.LayerNormMLP`` (the
    shared contract: :class:`~splitgrad.reference.contract.LayerNormMLPContract`). One
    deferrable entry per backward writes ``dW2``, ``db2``, ``dW1``, ``db1`` in that order. See
    the module docstring for the saved-vs-recomputed activation choice.
    """

    #: Recompute ``act(fc1_out)`` in backward instead of keeping it from the forward.
    recompute_activation: bool = False

    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        x, recipe = self._check_input(inp, self.hidden_size)
        p = self._parameters
        try:
            params = tuple(p[name] for name in _NAMES)
        except KeyError:  # parametrized
            params = self._params_of(_NAMES)
        y = self._run_forward(x, recipe, is_first_microbatch, _NAMES, params, _apply, _fp8_forward)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.hidden_size)
