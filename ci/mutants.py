"""Mutation check: does the harness catch deliberate bugs in a copy of ``splitgrad.impl``?

Each mutant is a few exact text edits to a copy of ``impl/``; the copy is then run through
``splitgrad verify --backend path:COPY`` under a hypothesis profile (``ci`` by default) and the
mutant counts as caught when some property fails. The report says which property caught it
first and after how many examples (in that cell, and in the whole campaign so far).

    python ci/mutants.py [--profile ci] [--jobs 2] [--only NAME ...] [--full] [--markdown]

Exit status 1 when a mutant survives or an edit no longer applies (impl changed: update the
edit), so this doubles as a ``slow`` test (``tests/test_mutants.py``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IMPL = ROOT / "impl"


@dataclasses.dataclass(frozen=True)
class Mutant:
    """A named bug: ``edits`` are (file relative to the ``package`` folder, impl/ unless it
    names another, exact old text, new text)."""

    name: str
    bug: str
    edits: tuple[tuple[str, str, str], ...]
    package: str = "impl"


_LINEAR_FORWARD = (
    "    def forward(self, inp: torch.Tensor, is_first_microbatch: bool | None = None) -> "
    "torch.Tensor:\n"
)


def _ub_bulk_override(condition: str) -> str:
    """A ``Linear.__init__`` that drops ``ub_bulk_wgrad`` under delay when ``condition``."""
    return (
        "    def __init__(self, *args, ub_bulk_wgrad=False, delay_wgrad_compute=False, **kw):\n"
        f"        if ub_bulk_wgrad and delay_wgrad_compute and {condition}:\n"
        "            ub_bulk_wgrad = False\n"
        "        super().__init__(*args, ub_bulk_wgrad=ub_bulk_wgrad,\n"
        "                         delay_wgrad_compute=delay_wgrad_compute, **kw)\n\n"
    )


_WRITE_WEIGHT = (
    "        elif param.grad is None:\n"
    "            param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))\n"
    "        else:\n"
    "            gemm.wgrad_accumulate_(param.grad, dy, x)\n"
)

MUTANTS = (
    Mutant(
        "dw-overwrites",
        "backward_dw() overwrites .grad instead of accumulating (a bug TransformerEngine once had)",
        (
            (
                "base.py",
                "        entry = store.head()\n",
                "        entry = store.head()\n"
                "        for _name, p in entry.params:\n"
                "            if not (self.fuse_wgrad_accumulation and p.dim() == 2):\n"
                "                p.grad = None\n",
            ),
        ),
    ),
    Mutant(
        "lifo",
        "backward_dw() runs the newest entry (LIFO) instead of the oldest",
        (
            ("store.py", "return self[0]", "return self[-1]"),
            ("store.py", "self.popleft().release()", "self.pop().release()"),
        ),
    ),
    Mutant(
        "bias-dropped",
        "the bias gradient is never written",
        (
            (
                "base.py",
                '        """Set or accumulate an already reduced bias gradient into '
                '``param.grad``."""\n',
                '        """Set or accumulate an already reduced bias gradient into '
                '``param.grad``."""\n        return\n',
            ),
        ),
    ),
    Mutant(
        "bias-in-backward",
        "Linear writes its bias gradient during backward() under delay",
        (
            (
                "linear.py",
                "            if need_b:\n                module._write_bias_grad(b, dy)\n",
                "",
            ),
            (
                "linear.py",
                "        saved = (dy, x.detach()) if need_w else (dy,)\n",
                "        if need_b:\n            module._write_bias_grad(b, dy)\n"
                "        saved = (dy, x.detach()) if need_w else (dy,)\n",
            ),
        ),
    ),
    Mutant(
        "wgrad-operands-swapped",
        "wgrad GEMMs compute x^T dy instead of dy^T x (transposed / swapped operands)",
        (
            ("gemm.py", "torch.mm(dy.t(), x)", "torch.mm(x.t(), dy).t().contiguous().t()"),
            ("gemm.py", "main_grad.addmm_(dy.t(), x)", "main_grad.addmm_(x.t(), dy)"),
            ("gemm.py", "torch.mm(dy.t(), x, out=main_grad)", "torch.mm(x.t(), dy, out=main_grad)"),
            ("gemm.py", "a, b = dy.t().to(acc), x.to(acc)", "a, b = x.t().to(acc), dy.to(acc)"),
        ),
    ),
    Mutant(
        "main-grad-bf16",
        "fused accumulation adds a low-precision dW into main_grad in the operands' dtype",
        (
            (
                "gemm.py",
                "    a, b = dy.t().to(acc), x.to(acc)\n    if overwrite:\n"
                "        torch.mm(a, b, out=main_grad)\n"
                "    else:\n        main_grad.addmm_(a, b)\n",
                "    low = torch.mm(dy.t(), x)\n    if overwrite:\n        main_grad.copy_(low)\n"
                "    else:\n        main_grad.copy_(main_grad.to(low.dtype) + low)\n",
            ),
        ),
    ),
    Mutant(
        "first-microbatch-ignored",
        "is_first_microbatch is ignored: main_grad is always accumulated",
        (
            (
                "base.py",
                "gemm.wgrad_into_main_grad_(param.main_grad, dy, x, overwrite)",
                "gemm.wgrad_into_main_grad_(param.main_grad, dy, x, False)",
            ),
        ),
    ),
    Mutant(
        "ub-bulk-check-removed",
        "Linear drops ub_bulk_wgrad under delay instead of raising the ValueError",
        (("linear.py", _LINEAR_FORWARD, _ub_bulk_override("True") + _LINEAR_FORWARD),),
    ),
    Mutant(
        "ub-bulk-assert",
        "Linear's ub_bulk_wgrad check only holds while assertions run (gone under python -O)",
        (("linear.py", _LINEAR_FORWARD, _ub_bulk_override("not __debug__") + _LINEAR_FORWARD),),
    ),
    Mutant(
        "empty-group-skipped",
        "GroupedLinear writes no gradient for an empty group (None instead of zeros)",
        (
            (
                "grouped_linear.py",
                "                if need_w[i]:\n",
                "                if need_w[i] and dy_g.shape[0]:\n",
            ),
            (
                "grouped_linear.py",
                "                if need_b[i]:\n",
                "                if need_b[i] and dy_g.shape[0]:\n",
            ),
        ),
    ),
    Mutant(
        "entry-kept",
        "backward_dw() keeps the finished entry (and its tensors) alive",
        (
            (
                "store.py",
                "        self.popleft().release()\n",
                "        self.last_entry = self.popleft()\n",
            ),
        ),
    ),
    Mutant(
        "hooks-before-write",
        "backward_dw() fires the hooks before the gradients are written",
        (
            (
                "base.py",
                "        entry = store.head()\n",
                "        self._run_hooks()\n        entry = store.head()\n",
            ),
            (
                "base.py",
                "            acc.run_post_accumulate_hooks(leaf)\n        if self._wgrad_hooks:\n"
                "            self._run_hooks()\n",
                "            acc.run_post_accumulate_hooks(leaf)\n",
            ),
        ),
    ),
    # Blind spots of a sampled campaign: boundary sizes, gradient layouts and
    # misuse variants the default depth must always run (SPEC §7: enumerated, not sampled).
    Mutant(
        "grouped-mm-one-row-bias",
        "grouped GEMM path: the forward bias is skipped for a group of one row",
        (
            (
                "gemm.py",
                "            if y_g.shape[0]:\n                y_g.add_(b)\n",
                "            if y_g.shape[0] > 1:\n                y_g.add_(b)\n",
            ),
        ),
    ),
    Mutant(
        "grouped-mm-expanded-dy",
        "grouped GEMM path: dgrad hands the grouped GEMM the dy autograd gave, unmade "
        "contiguous (the stride-0 dy of loss.sum() is refused)",
        (
            (
                "gemm.py",
                "    return _torch_compat.grouped_mm(_row_major(dy), stacked_weights, offs)",
                "    return _torch_compat.grouped_mm(dy, stacked_weights, offs)",
            ),
        ),
    ),
    Mutant(
        "main-grad-check-skipped-on-first",
        "Linear's wgrad closure skips the main_grad check when is_first_microbatch overwrites "
        "(a queued entry then writes into a broken main_grad instead of raising)",
        (
            (
                "linear.py",
                "        def wgrad_closure(dy, x=None):\n"
                "            if module.fuse_wgrad_accumulation:\n",
                "        def wgrad_closure(dy, x=None):\n"
                "            if module.fuse_wgrad_accumulation and not overwrite:\n",
            ),
        ),
    ),
)


# FP8 mutants (SPEC §6): run with ``--recipe all`` added to verify's arguments.
FP8_MUTANTS = (
    Mutant(
        "fp8-empty-uninitialized",
        "an FP8 GEMM with M, N or K of 0 (an expert with no tokens) returns uninitialized memory, "
        "as torch._scaled_mm does for K=0 on some machines (torch 2.13)",
        (
            (
                "fp8_gemm.py",
                "        y = torch.zeros(empty, dtype=compute_dtype, device=a.data.device)\n",
                "        y = torch.empty(empty, dtype=compute_dtype, device=a.data.device)\n",
            ),
        ),
    ),
    Mutant(
        "fp8-wgrad-rowwise",
        "wgrad multiplies the row-wise FP8 copies of dy and x instead of the column-wise ones "
        "(quantized along the wrong dimension for that GEMM; only block recipes have two copies)",
        (
            (
                "fp8_gemm.py",
                '        self._x_wgrad = self._other_axis(x, x_row, "input") if keep_x else None\n',
                "        self._x_wgrad = x_row if keep_x else None\n",
            ),
            (
                "fp8_gemm.py",
                '        self._dy_wgrad = self._other_axis(dy, dy_row, "grad_output") '
                "if keep_dy else None\n",
                "        self._dy_wgrad = dy_row if keep_dy else None\n",
            ),
        ),
    ),
    Mutant(
        "fp8-entry-live-scale",
        "a queued FP8 wgrad entry dequantizes dy with the module's live delayed-scaling scale "
        "(moved by later steps) instead of the scale_inv it was quantized with",
        (
            (
                "base.py",
                "                    dy_q, x_q = operands[2 * i], operands[2 * i + 1]\n",
                "                    dy_q, x_q = operands[2 * i], operands[2 * i + 1]\n"
                "                    live = [st for k, st in sorted(self.fp8_states.items())\n"
                '                            if k.endswith("grad_output")]\n'
                "                    if live and dy_q.block == (0, 0):\n"
                "                        dy_q = dataclasses.replace(\n"
                "                            dy_q,\n"
                "                            scale_inv=torch.reciprocal(\n"
                "                                live[i % len(live)].scale),\n"
                "                        )\n",
            ),
        ),
    ),
)

# Blind spots of a harness that compares an implementation only with itself:
# each bug sits on the path the delayed and the non-delayed run share, under one condition a
# differential property draws; P3 (fresh modules, no .grad prefill, no zeroing) never meets it.
#: The direct routes' write (impl/base.py store_grad): a shared-path mutant edits it too, so that
#: the delayed and the non-delayed run keep sharing the bug (only the truth can catch it).
_STORE_BODY = (
    "    current = param.grad\n"
    "    if current is None:\n"
    "        param.grad = grad\n"
    "    else:\n"
    "        current.add_(grad)\n"
)


def _direct_empty_rows(indent: str, guard: str, leaf: str, rows: str, call: str) -> tuple[str, str]:
    """(old, new) for a direct weight write ``if guard: store_grad(leaf, call)``: over zero rows
    a prefilled ``.grad`` not yet written is zeroed (empty-rows-reset-prefill)."""
    old = f"{indent}if {guard}:\n{indent}    store_grad({leaf}, {call})\n"
    new = (
        f"{indent}if {guard} and {leaf}.grad is not None and {rows} == 0 "
        f"and not getattr({leaf}, '_written_once', False):\n"
        f"{indent}    {leaf}.grad.zero_()\n"
        f"{indent}elif {guard}:\n"
        f"{indent}    store_grad({leaf}, {call})\n"
        f"{indent}if {guard}:\n"
        f"{indent}    {leaf}._written_once = True\n"
    )
    return old, new


SHARED_PATH_MUTANTS = (
    Mutant(
        "prefill-counted-twice",
        "a weight gradient written into a .grad that held a value before the parameter's first "
        "write (a prefilled .grad) is added twice, in both modes",
        (
            (
                "base.py",
                _WRITE_WEIGHT,
                "        elif param.grad is None:\n"
                "            param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))\n"
                "        else:\n"
                "            if not getattr(param, '_written_once', False):\n"
                "                gemm.wgrad_accumulate_(param.grad, dy, x)\n"
                "            gemm.wgrad_accumulate_(param.grad, dy, x)\n"
                "        param._written_once = True\n",
            ),
            (
                "base.py",
                _STORE_BODY,
                "    current = param.grad\n"
                "    if current is None:\n"
                "        param.grad = grad\n"
                "    else:\n"
                "        if param.dim() == 2 and not getattr(param, '_written_once', False):\n"
                "            current.add_(grad)\n"
                "        current.add_(grad)\n"
                "    if param.dim() == 2:\n"
                "        param._written_once = True\n",
            ),
        ),
    ),
    Mutant(
        "zeroed-grad-dropped",
        "after zero_grad(set_to_none) a weight that already had a gradient gets none, in both "
        "modes (the next contribution is dropped)",
        (
            (
                "base.py",
                _WRITE_WEIGHT,
                "        elif param.grad is None:\n"
                "            if not getattr(param, '_written_once', False):\n"
                "                param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))\n"
                "        else:\n"
                "            gemm.wgrad_accumulate_(param.grad, dy, x)\n"
                "        param._written_once = True\n",
            ),
            (
                "base.py",
                _STORE_BODY,
                "    current = param.grad\n"
                "    if current is None:\n"
                "        if not (param.dim() == 2 and getattr(param, '_written_once', False)):\n"
                "            param.grad = grad\n"
                "    else:\n"
                "        current.add_(grad)\n"
                "    if param.dim() == 2:\n"
                "        param._written_once = True\n",
            ),
        ),
    ),
    Mutant(
        "empty-rows-reset-prefill",
        "a weight gradient over zero rows (an empty group, an empty micro-batch) resets a "
        "prefilled .grad to zeros instead of adding nothing, in GroupedLinear and Linear alike",
        (
            (
                "base.py",
                _WRITE_WEIGHT,
                "        elif param.grad is None:\n"
                "            param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))\n"
                "        elif x.shape[0] == 0 and not getattr(param, '_written_once', False):\n"
                "            param.grad.zero_()\n"
                "        else:\n"
                "            gemm.wgrad_accumulate_(param.grad, dy, x)\n"
                "        param._written_once = True\n",
            ),
            (
                "linear.py",
                *_direct_empty_rows(
                    "        ", "w is not None", "w", "x.shape[0]", "gemm.wgrad(dy, x)"
                ),
            ),
            (
                "grouped_linear.py",
                *_direct_empty_rows(
                    "            ",
                    "weight_params[i] is not None",
                    "weight_params[i]",
                    "xs[i].shape[0]",
                    "gemm.wgrad(dy_g, xs[i])",
                ),
            ),
            (
                "layernorm_mlp.py",
                *_direct_empty_rows(
                    "        ", "need_w2", "w2", "dy.shape[0]", "gemm.wgrad(dy, act_out)"
                ),
            ),
            (
                "layernorm_mlp.py",
                *_direct_empty_rows(
                    "        ",
                    "need_w1",
                    "w1",
                    "d_fc1_out.shape[0]",
                    "gemm.wgrad(d_fc1_out, ln_out)",
                ),
            ),
        ),
    ),
    Mutant(
        "frozen-bias-drops-fc2",
        "LayerNormMLP: with fc1_bias frozen, fc2's weight gradient is never written (both modes)",
        (
            (
                "layernorm_mlp.py",
                "            if need_w2:\n"
                "                module._write_weight_grad(w2, dy, act_out",
                "            b1_mod = module.fc1_bias\n"
                "            frozen_b1 = b1_mod is not None and not b1_mod.requires_grad\n"
                "            if need_w2 and not frozen_b1:\n"
                "                module._write_weight_grad(w2, dy, act_out",
            ),
            (
                "layernorm_mlp.py",
                "        if need_w2:\n            store_grad(w2, gemm.wgrad(dy, act_out))\n",
                "        b1_mod = module.fc1_bias\n"
                "        frozen_b1 = b1_mod is not None and not b1_mod.requires_grad\n"
                "        if need_w2 and not frozen_b1:\n"
                "            store_grad(w2, gemm.wgrad(dy, act_out))\n",
            ),
        ),
    ),
    Mutant(
        "tied-bias-dropped",
        "Linear used twice in one graph (tied): the bias gradient of the use whose backward runs "
        "first is dropped (both modes)",
        (
            (
                "linear.py",
                "    (to_w, to_b), (w, b) = dests, leaves\n"
                "    if direct and not module.delay_wgrad_compute:\n",
                "    (to_w, to_b), (w, b) = dests, leaves\n"
                "    if getattr(module, '_uses', 1) > 1:\n"
                "        to_b, b = None, None\n"
                "    module._uses = 0\n"
                "    if direct and not module.delay_wgrad_compute:\n",
            ),
            (
                "linear.py",
                '        params = (p.get("weight"), p.get("bias"))\n',
                '        params = (p.get("weight"), p.get("bias"))\n'
                "        self._uses = getattr(self, '_uses', 0) + 1\n",
            ),
        ),
    ),
)

# Fast paths that are the default only on a GPU: on the CPU the default
# campaign never takes them unless they are forced (splitgrad verify --impl-path).
FORCED_PATH_MUTANTS = (
    Mutant(
        "grouped-mm-bias-misaligned",
        "grouped GEMM path: the bias loop skips empty groups' outputs but not their biases (a "
        "group after an empty one gets the wrong bias)",
        (
            (
                "gemm.py",
                "        for y_g, b in zip(y.split(m_splits), biases):\n",
                "        for y_g, b in zip(\n"
                "            [g for g in y.split(m_splits) if g.shape[0]], biases\n"
                "        ):\n",
            ),
        ),
    ),
    Mutant(
        "grouped-mm-dgrad-offsets",
        "grouped GEMM path: dgrad's group offsets are computed from the splits reversed",
        (
            (
                "gemm.py",
                "    offs = _offsets(m_splits, dy.device)\n",
                "    offs = _offsets(m_splits[::-1], dy.device)\n",
            ),
        ),
    ),
    Mutant(
        "scaled-mm-main-grad-overwritten",
        "_scaled_mm path, fused accumulation: the FP8 weight gradient overwrites main_grad "
        "instead of adding to it",
        (
            (
                "fp8_gemm.py",
                "        product = _scaled_mm(a, a_t, b, b_t, out.dtype, None)\n"
                "        out.copy_(product) if overwrite else out.add_(product)\n",
                "        product = _scaled_mm(a, a_t, b, b_t, out.dtype, None)\n"
                "        out.copy_(product)\n",
            ),
        ),
    ),
    Mutant(
        "scaled-mm-bias-twice",
        "_scaled_mm path: a bias fused into the GEMM epilogue is added again afterwards",
        (
            (
                "fp8_gemm.py",
                "    if bias is not None and not fused_bias:\n        y = y.add_(bias.to(y.dtype))",
                "    if bias is not None:\n        y = y.add_(bias.to(y.dtype))",
            ),
        ),
    ),
    Mutant(
        "recompute-in-bf16",
        "LayerNormMLP with recompute_activation: the recomputed activation (fc2's wgrad "
        "operand) is computed in bf16 whatever the module dtype",
        (
            (
                "activation.py",
                "    return dh, (_elementwise(h, activation) if want_out else None)",
                "    return dh, (\n"
                "        _elementwise(h.to(torch.bfloat16), activation).to(h.dtype)"
                " if want_out else None\n    )",
            ),
        ),
    ),
)

# SPEC §3 "only what the backward asks for" (P17).
P17_MUTANTS = (
    Mutant(
        "unasked-written",
        "every parameter of a module gets its gradient written (or queued) whatever the "
        "backward asked for: torch.autograd.grad(y, x) writes .grad",
        (
            (
                "base.py",
                "            dest = node_destination(node)\n",
                "            dest = ACCUMULATE if node_destination(node) else None\n",
            ),
        ),
    ),
    Mutant(
        "returned-also-written",
        "Linear: a weight gradient torch.autograd.grad asks for is returned and also written "
        "(or queued)",
        (
            (
                "linear.py",
                "    need_w, need_b = to_w == ACCUMULATE, to_b == ACCUMULATE\n    written = (",
                "    need_w, need_b = to_w is not None, to_b == ACCUMULATE\n"
                "    w = module.weight if w is None else w\n    written = (",
            ),
        ),
    ),
)

# SPEC §3 "to the tensor the forward used" and "hooks on a parameter run as autograd runs them"
# (P18).
P18_MUTANTS = (
    Mutant(
        "backward-reads-module-weight",
        "Linear: the backward writes the weight gradient to the module's weight attribute as it "
        "is when backward runs, not to the leaf the forward used (a leaf substituted by "
        "functional_call gets nothing, the module's own Parameter gets it)",
        (
            (
                "linear.py",
                "    (to_w, to_b), (w, b) = dests, leaves\n",
                "    (to_w, to_b), (w, b) = dests, leaves\n"
                '    w = module._parameters["weight"] if w is not None else w\n',
            ),
        ),
    ),
    Mutant(
        "tensor-hook-skipped",
        "a gradient the module writes itself is stored as computed, past the parameter's tensor "
        "hooks: a hook never sees it or replaces it",
        (
            (
                "base.py",
                'acc.apply_tensor_hooks(leaf, value, f"{kind}.{names[id(leaf)]}")',
                "value",
            ),
        ),
    ),
    Mutant(
        "post-hook-early",
        "under delay, autograd's call on the weight during backward() reaches its "
        "post-accumulate hooks, before the deferred gradient is written",
        (
            (
                "base.py",
                "acc.mute_empty_calls(leaf, deferred=self.delay_wgrad_compute)",
                "acc.mute_empty_calls(leaf, deferred=False)",
            ),
        ),
    ),
)

# SPEC §2 "Every module is a well-behaved torch.nn.Module" (P18's module-protocol kinds). impl
# takes parameter creation and reset_parameters() from the reference's contract, so these bugs
# are impl overrides of it.
_PARAMS_SECTION = "    def _params_of(self, names: Sequence[str]) -> tuple:\n"

PROTOCOL_MUTANTS = (
    Mutant(
        "meta-device-ignored",
        "parameters are created on the CPU when no device= is given, whatever torch's default "
        'device (with torch.device("meta"), torch.set_default_device)',
        (
            (
                "base.py",
                _PARAMS_SECTION,
                "    def _new_tensor(self, *shape: int) -> torch.Tensor:\n"
                '        device = self._device if self._device is not None else "cpu"\n'
                "        return torch.empty(*shape, dtype=self.params_dtype, device=device)\n\n"
                + _PARAMS_SECTION,
            ),
        ),
    ),
    Mutant(
        "reset-weights-reversed",
        "reset_parameters() called after construction draws the GEMM weights last to first "
        "(the constructor's call draws them first to last): a module built on meta, "
        "to_empty() and reset under the same seed differs from the eager one",
        (
            (
                "base.py",
                _PARAMS_SECTION,
                "    def reset_parameters(self) -> None:\n"
                '        if not getattr(self, "_reset_once", False):\n'
                "            self._reset_once = True\n"
                "            return super().reset_parameters()\n"
                "        names = self._gemm_weight_names\n"
                "        self._gemm_weight_names = names[::-1]\n"
                "        try:\n"
                "            super().reset_parameters()\n"
                "        finally:\n"
                "            self._gemm_weight_names = names\n\n" + _PARAMS_SECTION,
            ),
        ),
    ),
    Mutant(
        "output-view",
        "Linear returns a view of its result for a 2-D input (y.view(y.shape))",
        (
            (
                "linear.py",
                "            return self._plain_forward(\n"
                "                inp, params, _LinearFunction, _c_apply, is_first_microbatch, "
                "self.out_features\n"
                "            )\n",
                "            y = self._plain_forward(\n"
                "                inp, params, _LinearFunction, _c_apply, is_first_microbatch, "
                "self.out_features\n"
                "            )\n"
                "            return y.view(y.shape) if inp.dim() == 2 else y\n",
            ),
        ),
    ),
)

# Tensor parallel (SPEC §9), in a copy of the reference: P19 (``splitgrad distributed --check
# p19``, every case on 2 and 4 ranks) must catch each. The check's naive yardstick is the
# installed reference, so the copy's bug shows against it and against the float64 truth.
_GATHER = "    _all_gather(out, t.contiguous(), group=tp.group)\n    return out\n"
TP_MUTANTS = (
    Mutant(
        "tp-dgrad-unscattered",
        "a column layer under sequence parallel keeps its own rows of its partial input gradient: "
        "the dgrad reduce-scatter is missing (shapes all right)",
        (
            (
                "linear.py",
                "            dx = C.reduce_rows(dx, tp)  # each rank's dx is its output columns' "
                "share\n",
                "            dx = dx.chunk(tp.size)[tp.rank].clone() if tp.sequence_parallel "
                "else C.reduce_rows(dx, tp)\n",
            ),
        ),
        "reference",
    ),
    Mutant(
        "tp-sp-bias-unmarked",
        "a row-parallel bias under sequence parallel (a per-rank partial sum) does not carry "
        "sequence_parallel=True",
        (
            (
                "contract.py",
                '            self._mark_parallel("bias", None, sp=True)\n',
                '            self._mark_parallel("bias", None, sp=False)\n',
            ),
        ),
        "reference",
    ),
    Mutant(
        "tp-gather-wrong-dim",
        "the sequence all-gather stacks the ranks' shards along dim 1 (rows interleaved), "
        "then takes the shape of a gather along dim 0",
        (
            (
                "collectives.py",
                _GATHER,
                _GATHER.replace(
                    "return out",
                    "return out.view(tp.size, *t.shape).transpose(0, 1).reshape(out.shape)",
                ),
            ),
        ),
        "reference",
    ),
    Mutant(
        "tp-default-gathers-in-w",
        "the default wgrad_gather='backward' keeps the shard and all-gathers it inside "
        "backward_dw(), as 'backward_dw' does: a collective in the W step, which a schedule "
        "does not expect there",
        (
            (
                "parallel.py",
                '        return self.sequence_parallel and self.wgrad_gather == "backward_dw"\n',
                "        return self.sequence_parallel\n",
            ),
        ),
        "reference",
    ),
    Mutant(
        "tp-entry-buffer-reused",
        "every sequence all-gather writes into one buffer per width and dtype, reused: a queued "
        "entry's gathered operand is overwritten by the next gather",
        (
            (
                "collectives.py",
                "    out = t.new_empty(t.shape[0] * tp.size, *t.shape[1:])\n" + _GATHER,
                "    shape = torch.Size((t.shape[0] * tp.size, *t.shape[1:]))\n"
                '    buffers = gather_rows.__dict__.setdefault("buffers", {})\n'
                "    key = (id(tp.group), t.dtype, tuple(t.shape[1:]))\n"
                "    if key not in buffers or buffers[key].numel() < shape.numel():\n"
                "        buffers[key] = t.new_empty(shape.numel())\n"
                "    out = buffers[key][: shape.numel()].view(shape)\n" + _GATHER,
            ),
        ),
        "reference",
    ),
)

# Issue 32's classes, one tuple per class (each filled by the change that adds its checks).
#: P18 hook semantics (chained tensor hooks, a kept tensor, post-accumulate before reduce hooks)
#: and differentiated backwards that defer nothing.
_TWIN_ROUTE = "    targets = route_differentiable(module, param_targets(ctx, module), fp8=False)\n"


def _twin_refusal(condition: str, why: str) -> str:
    """impl's twin backward refusing whenever ``condition`` holds, before routing."""
    return (
        f"    if {condition}:\n"
        "        raise RuntimeError(\n"
        f'            f"{{qualified_name(module)}} {why} cannot be differentiated twice"\n'
        "        )\n" + _TWIN_ROUTE
    )


HOOK_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "tensor-hooks-unchained",
        "impl runs a leaf's tensor hooks in a loop of its own, each on the gradient as computed "
        "(not on the previous hook's result), and keeps the last result",
        (
            (
                "base.py",
                'acc.apply_tensor_hooks(leaf, value, f"{kind}.{names[id(leaf)]}")',
                "_each_hook_on(leaf, value)",
            ),
            (
                "base.py",
                "def _on_cuda(entry: WgradEntry) -> bool:\n",
                "def _each_hook_on(leaf, grad):\n"
                "    out = grad\n"
                "    for hook in acc._user_tensor_hooks(leaf):\n"
                "        result = hook(grad)\n"
                "        out = out if result is None else result\n"
                "    return out\n\n\n"
                "def _on_cuda(entry: WgradEntry) -> bool:\n",
            ),
        ),
    ),
    Mutant(
        "hook-tensor-installed",
        "a gradient the leaf's tensor hooks saw becomes .grad without a copy (the copy dropped "
        "as per-call cost): a hook that keeps the tensor it was shown sees it change when the "
        "next micro-batch accumulates into .grad in place",
        (
            (
                "base.py",
                "acc.accumulate(leaf, value, own=not acc.has_hooks(leaf))",
                "acc.accumulate(leaf, value)",
            ),
        ),
    ),
    Mutant(
        "reduce-hooks-before-post-accumulate",
        "backward_dw() calls the module's reduce hooks before the written leaves' "
        "post-accumulate hooks: a reducer sends the gradient before a clipping hook changed it",
        (
            (
                "base.py",
                "        for leaf in written:\n            acc.run_post_accumulate_hooks(leaf)\n",
                "",
            ),
            (
                "base.py",
                "        del entry\n",
                "        del entry\n"
                "        self._run_hooks()\n"
                "        for leaf in written:\n"
                "            acc.run_post_accumulate_hooks(leaf)\n"
                "        return\n",
            ),
        ),
    ),
    Mutant(
        "create-graph-refused-under-delay",
        "a differentiated backward of a delayed module is refused even when it defers nothing "
        "(torch.autograd.grad of the input or of every parameter, create_graph=True)",
        (("twin.py", _TWIN_ROUTE, _twin_refusal("module.delay_wgrad_compute", "with delay")),),
    ),
    Mutant(
        "create-graph-refused-when-fused",
        "a differentiated backward of a fused-accumulation module is refused even when nothing "
        "goes to main_grad (torch.autograd.grad(..., [x, *params], create_graph=True))",
        (
            (
                "twin.py",
                _TWIN_ROUTE,
                _twin_refusal("module.fuse_wgrad_accumulation", "with fused accumulation"),
            ),
        ),
    ),
)
#: Every hook kind raising at every position (P10 misuse).
_POP = (
    "        store.pop_and_release()\n"
    "        if not len(store):\n"
    "            pending.drained(self)\n"
    "        del entry\n"
)
_HOOKS_THEN_NEXT = "            self._run_hooks()\n\n    def _submit_wgrad(\n"
_HOOKED_WRITES = (
    "            hooked = [\n"
    "                (leaf, acc.apply_tensor_hooks(leaf, value, "
    'f"{kind}.{names[id(leaf)]}"), later)\n'
    "                if value is not None\n"
    "                else (leaf, value, later)\n"
    "                for leaf, value, later in collected\n"
    "            ]\n"
)
_WRITE_HOOKED = (
    "            for leaf, value, later in hooked:\n"
    "                if later is not None:\n"
    "                    later()  # a main_grad write: fused weights have no tensor hooks\n"
    "                else:\n"
    "                    acc.accumulate(leaf, value, own=not acc.has_hooks(leaf))\n"
)
_RUN_POST_HOOKS = "        for leaf in written:\n            acc.run_post_accumulate_hooks(leaf)\n"

RAISING_HOOK_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "post-hook-before-pop",
        "the old bug: a deferred entry's post-accumulate hooks run inside its wgrad execution, "
        "before the entry is consumed, so one that raises leaves the written entry queued and "
        "the next backward_dw() writes its gradients again",
        (
            (
                "base.py",
                "            return list({id(leaf): leaf for leaf, _, _ in hooked}.values())\n",
                "            for leaf in {id(leaf): leaf for leaf, _, _ in hooked}.values():\n"
                "                acc.run_post_accumulate_hooks(leaf)\n",
            ),
        ),
    ),
    Mutant(
        "pop-after-hooks",
        "backward_dw() consumes the entry after its hooks have seen the gradients, so a "
        "post-accumulate or wgrad hook that raises leaves the written entry queued",
        (
            ("base.py", _POP + _RUN_POST_HOOKS, _RUN_POST_HOOKS),
            (
                "base.py",
                _HOOKS_THEN_NEXT,
                "            self._run_hooks()\n"
                "        store.pop_and_release()\n"
                "        if not len(store):\n"
                "            pending.drained(self)\n\n"
                "    def _submit_wgrad(\n",
            ),
        ),
    ),
    Mutant(
        "entry-taken-before-wgrad",
        "backward_dw() takes the entry off the queue before running it, so a wgrad that raises "
        "(a parameter's tensor hook) loses the entry",
        (
            (
                "base.py",
                "        entry = store.head()\n",
                "        entry = store.popleft()\n",
            ),
            ("base.py", "        store.pop_and_release()\n", "        entry.release()\n"),
        ),
    ),
    Mutant(
        "tensor-hooks-as-written",
        "each gradient goes through its tensor hooks and is written in one pass, so a hook that "
        "raises on a later parameter leaves the earlier ones written and the entry queued (its "
        "retry writes them again)",
        (
            (
                "base.py",
                _HOOKED_WRITES + _WRITE_HOOKED,
                "            hooked = []\n"
                "            for leaf, value, later in collected:\n"
                "                if later is not None:\n"
                "                    later()\n"
                "                else:\n"
                '                    where = f"{kind}.{names[id(leaf)]}"\n'
                "                    value = acc.apply_tensor_hooks(leaf, value, where)\n"
                "                    acc.accumulate(leaf, value, own=not acc.has_hooks(leaf))\n"
                "                hooked.append((leaf, value, later))\n",
            ),
        ),
    ),
    Mutant(
        "tensor-hook-error-swallowed",
        "a tensor hook that raises inside a module's write is ignored (the gradient stored as "
        "computed) instead of propagating",
        (
            (
                "base.py",
                _HOOKED_WRITES,
                "            hooked = []\n"
                "            for leaf, value, later in collected:\n"
                "                if value is not None:\n"
                "                    try:\n"
                '                        where = f"{kind}.{names[id(leaf)]}"\n'
                "                        value = acc.apply_tensor_hooks(leaf, value, where)\n"
                "                    except Exception:  # a broken hook must not lose it\n"
                "                        pass\n"
                "                hooked.append((leaf, value, later))\n",
            ),
        ),
    ),
    Mutant(
        "post-hook-error-wrapped",
        "backward_dw() re-raises a post-accumulate hook's exception as a RuntimeError naming "
        "the module, instead of the hook's own",
        (
            (
                "base.py",
                _RUN_POST_HOOKS,
                "        for leaf in written:\n"
                "            try:\n"
                "                acc.run_post_accumulate_hooks(leaf)\n"
                "            except Exception as exc:\n"
                '                msg = f"{type(self).__name__}: a post-accumulate hook raised"\n'
                "                raise RuntimeError(msg) from exc\n",
            ),
        ),
    ),
    Mutant(
        "wgrad-hooks-in-finally",
        "backward_dw() runs the wgrad (reduce) hooks even when a post-accumulate hook raised "
        "before them",
        (
            (
                "base.py",
                _RUN_POST_HOOKS + "        if self._wgrad_hooks:\n            self._run_hooks()\n",
                "        try:\n"
                "            for leaf in written:\n"
                "                acc.run_post_accumulate_hooks(leaf)\n"
                "        finally:\n"
                "            if self._wgrad_hooks:\n"
                "                self._run_hooks()\n",
            ),
        ),
    ),
    Mutant(
        "wgrad-hooks-stuck-after-raise",
        "a guard against re-entrant wgrad hooks is never reset when one raises, so the module "
        "skips its wgrad (reduce) hooks for every later entry",
        (
            (
                "base.py",
                "    def _submit_wgrad(\n",
                "    def _run_hooks(self) -> None:\n"
                '        if getattr(self, "_in_wgrad_hooks", False):\n'
                "            return\n"
                "        self._in_wgrad_hooks = True\n"
                "        super()._run_hooks()\n"
                "        self._in_wgrad_hooks = False\n\n"
                "    def _submit_wgrad(\n",
            ),
        ),
    ),
)
#: Shared contract code (construction, reset_parameters, conversion): absolute checks. The code
#: is the reference's and impl imports it, so each edits a copy of the reference, which verify
#: runs as the backend (``path:``; its modules import the copy's contract). P18's
#: module.initial_values and module.zero_centered_gamma catch the construction ones; what
#: convert_linears does is checked by tests/test_convert.py, which plants the conversion one.
_FILL_GAMMA = "                gamma.fill_(0.0 if self.zero_centered_gamma else 1.0)\n"
_DRAW = "                torch.nn.init.normal_(self._own_parameter(name), std=0.023)\n"
#: Mutants no verify property meets (verify builds no torch.nn model to convert), by name: the
#: suite test that plants the same edits and asserts its checks fail on them.
SUITE_CAUGHT = {
    "convert-builds-on-the-device": "tests/test_convert.py::"
    "test_a_conversion_that_builds_on_the_device_is_caught",
}
CONTRACT_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "zero-centred-gamma-reset-to-one",
        "reset_parameters() fills layer_norm_weight with ones whatever zero_centered_gamma says: "
        "a zero-centred module (gamma stored as gamma - 1) scales its normalized input by 2",
        (("contract.py", _FILL_GAMMA, "                gamma.fill_(1.0)\n"),),
        "reference",
    ),
    Mutant(
        "bias-reset-drawn",
        "reset_parameters() draws the GEMM biases like the weights instead of zeroing them",
        (
            (
                "contract.py",
                "            for name in self._gemm_bias_names:\n"
                "                self._own_parameter(name).zero_()\n",
                "            for name in self._gemm_bias_names:\n" + _DRAW,
            ),
        ),
        "reference",
    ),
    Mutant(
        "init-std-not-te",
        "GEMM weights drawn with std 0.02 (a common default) instead of TransformerEngine's "
        "documented 0.023",
        (("contract.py", _DRAW, _DRAW.replace("0.023", "0.02")),),
        "reference",
    ),
    Mutant(
        "skip-hook-on-every-parameter",
        "after a conversion (to_empty from meta, a device move) every parameter of a delayed "
        "module is marked skip_backward_post_hook, the norm parameters too, whose gradients are "
        "not deferred: a DDP wrapper would never reduce them",
        (
            (
                "contract.py",
                "            for name in self._gemm_weight_names + self._gemm_bias_names:\n"
                "                self._own_parameter(name).skip_backward_post_hook = True\n",
                "            for param in self.parameters(recurse=False):\n"
                "                param.skip_backward_post_hook = True\n",
            ),
        ),
        "reference",
    ),
    Mutant(
        "convert-builds-on-the-device",
        "convert_linears builds each new Linear on the layer's device, allocating and drawing a "
        "throw-away weight before it takes the layer's parameters: the global RNG moves, so a "
        "seeded run changes because of the conversion",
        (
            (
                "convert.py",
                '            device="meta",\n',
                "            device=layer.weight.device,\n",
            ),
        ),
        "reference",
    ),
)
#: CUDA branches whose values fake tensors cannot see (MXFP8 swizzle, LayerNorm gamma branch).
_MX_TILES = "    return tiles.permute(0, 3, 2, 1, 4).reshape(-1).to(torch.float8_e8m0fnu)\n"
_CUDA_AFFINE = (
    "    if zero_centered or weight.dtype != dtype or (bias is not None and bias.dtype != dtype):\n"
    "        return None\n"
    "    return weight, bias\n"
)
_GROUPED_FORWARD = (
    "    offs = _offsets(m_splits, x.device)\n"
    "    y = _torch_compat.grouped_mm(_row_major(x), stacked_weights.transpose(1, 2), offs)\n"
)
#: Caught by verify's forced paths mxfp8_scaled (a CPU stand-in for the block-scaled GEMM that
#: reads the scales by cuBLAS's documented layout), norm_cuda and grouped; the swizzle ones also
#: by tests/test_mxfp8_swizzle.py, the empty-problem one by tests/test_cuda_trace.py (each plants
#: these very edits).
CUDA_BRANCH_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "mx-swizzle-inner-transposed",
        "MXFP8 scales for the CUDA GEMM: each 4x4 group of a 128x4 tile stored transposed (row "
        "group r // 32 and scale column swapped)",
        (("fp8_gemm.py", _MX_TILES, _MX_TILES.replace("(0, 3, 2, 1, 4)", "(0, 3, 2, 4, 1)")),),
    ),
    Mutant(
        "mx-swizzle-32-4-swapped",
        "MXFP8 scales for the CUDA GEMM: a 128x4 tile stored as 4x32x4 (row r at line r // 32) "
        "instead of 32x4x4",
        (("fp8_gemm.py", _MX_TILES, _MX_TILES.replace("(0, 3, 2, 1, 4)", "(0, 3, 1, 2, 4)")),),
    ),
    Mutant(
        "cuda-norm-gamma-unshifted",
        "CUDA LayerNorm branch: a zero-centred gamma already in the input's dtype is handed to "
        "the kernel as stored (gamma - 1), without adding 1",
        (
            (
                "norm.py",
                _CUDA_AFFINE,
                _CUDA_AFFINE.replace("if zero_centered or weight.dtype", "if weight.dtype"),
            ),
        ),
    ),
    Mutant(
        "cuda-grouped-empty-fp32",
        "CUDA grouped GEMM path: a batch with no rows skips the kernel and returns an empty "
        "output made without the input's dtype (fp32 where bf16 is due)",
        (
            (
                "gemm.py",
                _GROUPED_FORWARD,
                "    if not x.shape[0]:  # no rows: nothing for the grouped kernel to do\n"
                "        return torch.zeros(0, stacked_weights.shape[1], device=x.device)\n"
                + _GROUPED_FORWARD,
            ),
        ),
    ),
)

# Data parallel (SPEC §8, P16), in a copy of splitgrad.distributed: ``splitgrad distributed
# --check p16 --reducer COPY:GradientReducer`` (alone: 3 steps on 2 ranks, 2 on 3; fully_shard on
# 2 and 3 ranks, Shard(1) weights, 3 micro-batches, hooks on the sharded parameters) must catch
# each.
P16_MUTANTS = (
    Mutant(
        "p16-tied-count-kept",
        "the end-of-step reset forgets how many of a tied weight's modules ran their last entry "
        "(finality tested with >=): from step 2 on the shared weight launches after the first",
        (
            (
                "reducer_finality.py",
                "            st.passes, st.last_task, st.ready, st.owners_final = "
                "0, -1, False, 0\n",
                "            st.passes, st.last_task, st.ready = 0, -1, False\n",
            ),
            (
                "reducer_finality.py",
                "            if st.owners_final == len(st.owners):\n",
                "            if st.owners_final >= len(st.owners) and not st.ready:\n",
            ),
        ),
        "distributed",
    ),
    Mutant(
        "p16-shard0-assumed",
        "the FSDP2 reduce-scatter copies every gradient in as Shard(0): a Shard(1) weight "
        "(shard_placement_fn) is not rearranged into dim-0 chunks first",
        (("fsdp.py", "            if dim != 0 and world > 1:\n", "            if False:\n"),),
        "distributed",
    ),
    Mutant(
        "p16-divide-order-swapped",
        "FSDP2's pre- and post-divide factors taken in swapped order: forced sum divides "
        "before the SUM (exact on 2 ranks, rounded on 3)",
        (
            (
                "fsdp.py",
                "        pre, self.post, op, _ = _torch_private.gradient_divide_factors(\n",
                "        self.post, pre, op, _ = _torch_private.gradient_divide_factors(\n",
            ),
        ),
        "distributed",
    ),
    Mutant(
        "p16-sharded-hooks-skipped",
        "the reduced shard is written into the sharded .grad without running the parameter's "
        "post-accumulate-grad hooks (FSDP2 runs them)",
        (
            (
                "fsdp.py",
                "            for hook in _torch_private.post_accumulate_grad_hooks(sharded):\n"
                "                hook(sharded)\n",
                "",
            ),
        ),
        "distributed",
    ),
    Mutant(
        "p16-later-passes-param-dtype",
        "under a reduce_dtype other than the gradients', only the first non-final pass moves "
        "into the reduce_dtype sum; later ones accumulate on .grad in the parameter dtype",
        (
            (
                "fsdp.py",
                "    if accumulated is not None:\n        accumulated += grad\n"
                "        _torch_private.unsharded_param(fsdp_param).grad = None\n"
                "        return accumulated\n",
                "    if accumulated is not None:\n        return accumulated\n",
            ),
        ),
        "distributed",
    ),
)

#: The direct routes of the usual backward (launch cost, issue 31): its writes straight into
#: ``.grad`` and the choice to take them.
_STORE = (
    "    if current is None:\n        param.grad = grad\n    else:\n        current.add_(grad)\n"
)
DIRECT_MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "direct-overwrites",
        "the usual backward's direct write sets .grad instead of accumulating into it",
        (("base.py", _STORE, "    param.grad = grad\n"),),
    ),
    Mutant(
        "direct-hooks-ignored",
        "direct routes taken for a leaf with hooks: its gradient written past its tensor hooks",
        (
            (
                "base.py",
                "            elif type(node) is LEAF_NODE and not has_hooks(leaf := node.variable)",
                "            elif type(node) is LEAF_NODE and (leaf := node.variable) is not None",
            ),
        ),
    ),
    Mutant(
        "direct-captured-dropped",
        "a weight captured by torch.autograd.grad read as not computed on the direct routes",
        (
            (
                "base.py",
                "                if k >= returned:\n"
                "                    break\n"
                "                executes = True\n",
                "                executes = k < returned\n",
            ),
        ),
    ),
    Mutant(
        "direct-reduce-hooks-skipped",
        "without delay, the direct writes of Linear skip the module's SPEC §4 hooks",
        (
            (
                "linear.py",
                "        if module._wgrad_hooks and (w is not None or b is not None):\n"
                "            module._run_hooks()\n",
                "",
            ),
        ),
    ),
)

ALL_MUTANTS = (
    MUTANTS
    + FP8_MUTANTS
    + SHARED_PATH_MUTANTS
    + FORCED_PATH_MUTANTS
    + P17_MUTANTS
    + P18_MUTANTS
    + PROTOCOL_MUTANTS
    + TP_MUTANTS
    + P16_MUTANTS
    + HOOK_MUTANTS
    + RAISING_HOOK_MUTANTS
    + CONTRACT_MUTANTS
    + CUDA_BRANCH_MUTANTS
    + DIRECT_MUTANTS
)


@dataclasses.dataclass
class MutantResult:
    name: str
    bug: str
    status: str  # "caught", "SURVIVED", "edit does not apply", "error"
    caught_by: list[str] = dataclasses.field(default_factory=list)
    examples_in_cell: int | None = None
    examples_total: int = 0
    seconds: float = 0.0
    detail: str = ""


def apply(mutant: Mutant, dest: Path) -> str | None:
    """Copy the mutant's package (impl/) to ``dest`` and apply the edits; returns why an edit
    failed, or None."""
    source = ROOT / mutant.package
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    for rel, old, new in mutant.edits:
        path = dest / rel
        text = path.read_text()
        if old not in text:
            return f"{rel}: text to replace not found: {old.strip()[:80]!r}"
        path.write_text(text.replace(old, new))
    return None


def run_mutant(mutant: Mutant, profile: str, full: bool, workdir: Path) -> MutantResult:
    start = time.perf_counter()
    dest = workdir / mutant.name.replace("-", "_")
    why = apply(mutant, dest)
    if why:
        return MutantResult(mutant.name, mutant.bug, "edit does not apply", detail=why)
    if mutant in TP_MUTANTS:
        return _run_tp_mutant(mutant, dest, start)
    if mutant in P16_MUTANTS:
        return _run_p16_mutant(mutant, dest, start)
    if mutant.name in SUITE_CAUGHT:
        return _run_suite_mutant(mutant, start)
    out = workdir / f"{mutant.name}.json"
    cmd = [
        sys.executable,
        "-m",
        "splitgrad.properties.front.verify",
        "--backend",
        f"path:{dest}",
        "--profile",
        profile,
        "--quiet",
        "--json",
        str(out),
    ]
    if mutant in FP8_MUTANTS:
        # FP8 cells only: every recipe family, the properties an FP8 mutant can break.
        cmd += ["--recipe", "all", "--property", "P1,P2,P3,P4,P5,P6,P12,P13"]
    if mutant in CONTRACT_MUTANTS:
        # Values loaded into every case hide initial values from all but P18's module protocol.
        cmd += ["--property", "P18"]
    if not full:
        cmd.append("--fail-fast")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir, timeout=1800)
    result = MutantResult(mutant.name, mutant.bug, "SURVIVED", seconds=time.perf_counter() - start)
    if not out.exists():
        result.status, result.detail = "error", (proc.stdout + proc.stderr)[-2000:]
        return result
    cells = json.loads(out.read_text())["cells"]
    total = 0
    for c in cells:
        if c["status"] in ("FAIL", "ERROR"):
            if result.examples_in_cell is None:
                result.examples_in_cell = c["first_failure_at"]
                result.examples_total = total + (c["first_failure_at"] or 0)
                result.detail = c["message"].splitlines()[0][:200] if c["message"] else ""
            recipe = c.get("recipe", "none")
            path = c.get("path", "default")
            where = f"{c['property_id']} {c['kind']} {c['dtype']}"
            where += f" fp8:{recipe}" if recipe != "none" else ""
            where += f" path={path}" if path != "default" else ""
            result.caught_by.append(where)
        if result.examples_in_cell is None:
            total += c["examples"]
    if result.caught_by:
        result.status = "caught"
    else:
        result.examples_total = total
    return result


def _run_suite_mutant(mutant: Mutant, start: float) -> MutantResult:
    """A mutant verify cannot meet: the suite test that plants the same edits in a copy and
    asserts its checks fail on it; caught when that test passes."""
    node = SUITE_CAUGHT[mutant.name]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", node]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)
    result = MutantResult(mutant.name, mutant.bug, "SURVIVED", seconds=time.perf_counter() - start)
    if proc.returncode == 0:
        result.status, result.caught_by = "caught", [node]
    else:
        result.detail = (proc.stdout + proc.stderr)[-2000:]
    return result


def _run_tp_mutant(mutant: Mutant, dest: Path, start: float) -> MutantResult:
    """A P19 mutant: ``splitgrad distributed --check p19`` on the mutated copy (the ``ci``
    matrix on 2 and 4 ranks); caught when P19 fails (exit status 1)."""
    return _run_distributed_mutant(mutant, "p19", ["--backend", f"path:{dest}"], dest, start)


def _run_p16_mutant(mutant: Mutant, dest: Path, start: float) -> MutantResult:
    """A P16 mutant (a copy of splitgrad.distributed, importable by its folder's name):
    ``splitgrad distributed --check p16`` with the copy's ``GradientReducer``; caught when P16
    fails (exit status 1)."""
    reducer = ["--reducer", f"{dest.name}:GradientReducer"]
    return _run_distributed_mutant(mutant, "p16", reducer, dest, start)


def _run_distributed_mutant(
    mutant: Mutant, check: str, args: list[str], dest: Path, start: float
) -> MutantResult:
    """``splitgrad distributed --check CHECK ARGS`` run beside the mutated copy ``dest``:
    caught when the check's row says FAIL (exit status 1), an error on any other failure."""
    cmd = [sys.executable, "-m", "splitgrad.cli", "distributed", "--check", check, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=dest.parent, timeout=1800)
    result = MutantResult(mutant.name, mutant.bug, "SURVIVED", seconds=time.perf_counter() - start)
    lines = proc.stdout.splitlines()
    if proc.returncode == 1 and any(line.startswith(f"{check}     FAIL") for line in lines):
        failures = [line.strip() for line in lines if line.startswith("        ")]
        result.status, result.caught_by = "caught", [f"{check.upper()} (splitgrad distributed)"]
        result.detail = failures[0][:200] if failures else ""
    elif proc.returncode != 0:
        result.status, result.detail = "error", (proc.stdout + proc.stderr)[-2000:]
    return result


def markdown(results: list[MutantResult], profile: str) -> str:
    lines = [
        f"| mutant | bug | caught (`{profile}` profile) | first caught by "
        "| examples in that cell | examples in campaign |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        by = r.caught_by[0] if r.caught_by else "-"
        more = f" (+{len(r.caught_by) - 1} more cells)" if len(r.caught_by) > 1 else ""
        lines.append(
            f"| `{r.name}` | {r.bug} | {r.status} | {by}{more} | "
            f"{'-' if r.examples_in_cell is None else r.examples_in_cell} | {r.examples_total} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="ci", choices=("dev", "ci", "nightly", "gpu"))
    parser.add_argument("--jobs", type=int, default=2, help="mutants run in parallel")
    parser.add_argument("--only", action="append", help="run only these mutants")
    parser.add_argument(
        "--full",
        action="store_true",
        help="run every cell for every mutant (default: stop at the first failure)",
    )
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--json", type=Path, help="write the results as JSON")
    args = parser.parse_args(argv)
    names = {m.name for m in ALL_MUTANTS}
    for n in args.only or []:
        if n not in names:
            parser.error(f"unknown mutant {n!r}; expected one of {', '.join(sorted(names))}")
    chosen = [m for m in ALL_MUTANTS if not args.only or m.name in args.only]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="splitgrad-mutants-") as tmp:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futures = [
                pool.submit(run_mutant, m, args.profile, args.full, Path(tmp)) for m in chosen
            ]
            results = [f.result() for f in futures]
    if args.markdown:
        print(markdown(results, args.profile))
    else:
        w = max(len(r.name) for r in results)
        print(
            f"{'mutant':<{w}}  {'status':<20} {'first caught by':<36} "
            f"{'ex/cell':>7} {'ex/total':>8} {'s':>6}"
        )
        for r in results:
            by = r.caught_by[0] if r.caught_by else "-"
            print(
                f"{r.name:<{w}}  {r.status:<20} {by:<36} "
                f"{'-' if r.examples_in_cell is None else r.examples_in_cell:>7} "
                f"{r.examples_total:>8} {r.seconds:6.1f}"
            )
            if r.status != "caught" and r.detail:
                print(f"    {r.detail}")
    caught = sum(r.status == "caught" for r in results)
    print(
        f"\n{caught}/{len(results)} mutants caught under the {args.profile!r} profile "
        f"in {time.perf_counter() - start:.0f}s"
    )
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
