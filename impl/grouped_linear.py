"""impl ``GroupedLinear``: ``num_gemms`` Linears over consecutive row blocks of one input.

GEMM paths (chosen per forward by :attr:`GroupedLinear.grouped_gemm`):

* ``"grouped"`` (where :func:`.gemm.grouped_mm_runs`, else the loop): forward and dgrad are
  one ``torch._grouped_mm`` each over the stacked weights.
  The weights are allocated as slots of one storage, each slot starting on a 64-byte boundary
  (the CPU allocator's alignment), so the stack is a free (G, M, K) view with a padded batch
  stride; if that layout is lost (``.to()``, ``.data =``) the weights are stacked per call.
  Aligned slots also keep the loop path bitwise equal to a ``Linear`` (whose weight is its own
  aligned allocation): some CPU GEMM kernels sum in another order for a misaligned operand
  (measured: a 37x1 weight at a 20-byte offset, AMD EPYC, torch 2.13).
* ``"loop"``: one ``addmm``/``mm`` per non-empty group into a fresh tensor, then one ``cat``;
  each group runs exactly the GEMM a ``Linear`` runs on that group's rows. (Writing each GEMM
  straight into its row block with ``out=`` saves the copy but is not bitwise a ``Linear``: some
  CPU GEMM kernels sum in another order for an output at another alignment, measured on an AMD
  EPYC with torch 2.13.)
* ``"auto"`` (default): ``"grouped"`` where :func:`.gemm.grouped_mm_supported` says so (sm90+
  CUDA, bf16, aligned sizes), ``"loop"`` elsewhere: on CPU ``_grouped_mm`` runs but was measured
  no faster than the loop (``splitgrad bench``).

The wgrad is always a loop of per-group GEMMs straight into each ``.grad`` / ``main_grad``:
``_grouped_mm`` can only return a (G, M, K) tensor in the operand dtype, i.e. a weight-sized
temporary and, under fused accumulation, a bf16 rounding before the fp32 accumulator. Empty
groups are handled by the same calls (a GEMM over zero rows yields zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from splitgrad.reference.contract import ACCUMULATE, RETURN, GroupedLinearContract

from . import compiled, gemm, gemm_paths
from ._torch_compat import function_c_apply, storage_key
from ._torch_compat import unwrap_if_dead as _unwrap_if_dead
from .base import (
    FP8WgradPart,
    NoGradContext,
    SplitBackwardModule,
    autocast_cast,
    autocast_off,
    backward_routes,
    differentiated,
    edge_routes,
    fast_apply,
    functorch_active,
    store_grad,
    take_fp8,
    twin,
    wants_graph,
    without_autocast,
)
from .fp8 import update_delayed_scaling
from .fp8_gemm import FP8GemmOperands, fp8_wgrad_value
from .gemm_paths import RECORDERS

__all__ = ["GroupedLinear"]

_PATHS = ("auto", "grouped", "loop")

#: The Functions' arguments before the parameters: x, m_splits, module, overwrite, the path (or
#: FP8 recipe), the autocast dtype.
_N_ARGS = 6


_SLOT_ALIGNMENT_BYTES = 64


def _slot_elements(m: int, k: int, dtype: torch.dtype) -> int:
    """Elements from one weight's start to the next in the shared storage: ``m * k`` rounded up
    to a whole number of 64-byte lines."""
    per_line = max(1, _SLOT_ALIGNMENT_BYTES // torch.empty((), dtype=dtype).element_size())
    return -(-m * k // per_line) * per_line


def _stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The weights as one (G, M, K) tensor: a view when they sit in consecutive slots of one
    storage (see the module docstring), a stacked copy otherwise."""
    w0 = weights[0]
    m, k = w0.shape
    slot = _slot_elements(m, k, w0.dtype)
    # Storage identity and element offsets rather than data pointers: the same test holds for
    # fake tensors (the CUDA trace tier), whose storages have no address.
    storage, start = storage_key(w0.untyped_storage()), w0.storage_offset()
    if all(
        w.is_contiguous()
        and storage_key(w.untyped_storage()) == storage
        and w.storage_offset() == start + i * slot
        for i, w in enumerate(weights)
    ):
        return w0.detach().as_strided((len(weights), m, k), (slot, k, 1))
    return torch.stack([w.detach() for w in weights])


def _returned_grads(to_w, to_b, dy, x, m_splits) -> list[torch.Tensor | None]:
    """The gradients ``torch.autograd.grad`` asked for (``RETURN``), computed now: one per
    weight, then one per bias (none without biases)."""
    n = len(to_w)
    out: list[torch.Tensor | None] = [None] * (n + len(to_b))
    if RETURN not in to_w and RETURN not in to_b:
        return out
    for i, (dy_g, x_g) in enumerate(zip(dy.split(m_splits), x.split(m_splits))):
        if to_w[i] == RETURN:
            out[i] = gemm.wgrad(dy_g, x_g)
        if to_b and to_b[i] == RETURN:
            out[n + i] = dy_g.sum(dim=0)
    return out


def _written(module, leaves, need_w, need_b) -> tuple:
    """The (name, leaf) pairs a closure writes: the weights, then the biases."""
    names = module._gemm_weight_names + module._gemm_bias_names
    return tuple([(n, leaf) for n, leaf, need in zip(names, leaves, [*need_w, *need_b]) if need])


def _backward(
    module,
    dy,
    x,
    weights,
    m_splits,
    use_grouped,
    need_x,
    dest,
    leaves,
    overwrite,
    compiled_graph=False,
    direct=False,
):
    """``(dx, *weight grads, *bias grads)``: dgrad now; one wgrad closure for all groups run
    now or queued, writing the leaves the forward used (``direct``: direct routes, see
    :func:`~.base.backward_routes`: without delay its writes run here); the gradients
    ``torch.autograd.grad`` asked for returned. ``dest`` / ``leaves``: of weight0..n-1, then of
    bias0..n-1 (none without biases). The body of both the eager Function's backward and the
    compiled op."""
    n = module.num_gemms
    weight_params, bias_params = leaves[:n], leaves[n:] or [None] * n
    now = direct and not module.delay_wgrad_compute  # the closure's writes, here
    if not now:
        to_w, to_b = dest[:n], dest[n:]
        need_w = [d == ACCUMULATE for d in to_w]
        need_b = [d == ACCUMULATE for d in to_b] or [False] * n
        n_w = sum(need_w)
        written = _written(module, leaves, need_w, need_b)
        named_weights = written[:n_w]
        hooked = not direct and module._begin_writes(written)
    dx = None
    if need_x:
        if use_grouped:
            dx = gemm.grouped_mm_dgrad(dy, _stacked(weights), m_splits)
        else:
            dx = torch.cat(
                [torch.mm(dy_g, weights[i]) for i, dy_g in enumerate(dy.split(m_splits))]
            )
    if now:
        xs = x.split(m_splits)
        for i, dy_g in enumerate(dy.split(m_splits)):
            if weight_params[i] is not None:
                store_grad(weight_params[i], gemm.wgrad(dy_g, xs[i]))
            if bias_params[i] is not None:
                store_grad(bias_params[i], dy_g.sum(dim=0))
        if module._wgrad_hooks and any(leaf is not None for leaf in leaves):
            module._run_hooks()
        return (dx, *(None,) * len(leaves))
    if written:

        def wgrad_closure(dy, x=None):
            if module.fuse_wgrad_accumulation:
                module._check_main_grads(named_weights)
            xs = x.split(m_splits) if x is not None else (None,) * n
            for i, (dy_g, x_g) in enumerate(zip(dy.split(m_splits), xs)):
                if need_w[i]:
                    module._write_weight_grad(weight_params[i], dy_g, x_g, overwrite)
                if need_b[i]:
                    module._write_bias_grad(bias_params[i], dy_g)

        saved = (dy, x.detach()) if n_w else (dy,)
        module._submit_wgrad(wgrad_closure, saved, written, compiled_graph, hooked)
    return (dx, *_returned_grads(to_w, to_b, dy, x, m_splits))


class _GroupedLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, m_splits, module, overwrite, use_grouped, autocast, *params):
        n = module.num_gemms
        weights, biases = params[:n], params[n:] or None
        if autocast is not None:
            # SPEC §2 under torch.autocast: every group's GEMM in the autocast dtype.
            weights = autocast_cast(autocast, *weights)
            biases = autocast_cast(autocast, *biases) if biases else None
        ctx.module, ctx.m_splits, ctx.overwrite, ctx.use_grouped = (
            module,
            m_splits,
            overwrite,
            use_grouped,
        )
        ctx.params, ctx.autocast = params, autocast
        ctx.save_for_backward(x, *weights)
        if use_grouped:
            return gemm.grouped_mm_forward(x, _stacked(weights), biases, m_splits)
        # One GEMM per group, concatenated: a GEMM written into a row block of a larger output
        # can round differently from Linear's (an unaligned start picks another kernel path),
        # and P12 holds GroupedLinear bitwise to a list of Linears.
        # (gemm.linear_forward's two calls, inlined: once per group per forward)
        if biases is None:
            return torch.cat([torch.mm(x_g, w.t()) for x_g, w in zip(x.split(m_splits), weights)])
        groups = zip(x.split(m_splits), weights, biases)
        return torch.cat([torch.addmm(b, x_g, w.t()) for x_g, w, b in groups])

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        x, *weights = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        if torch.compiler.is_compiling():
            out = torch.ops.splitgrad.grouped_linear_backward(
                ctx.module._handle,
                dy,
                x,
                weights,
                ctx.m_splits,
                ctx.overwrite,
                ctx.use_grouped,
                need_x,
            )
            n_params = len(ctx.needs_input_grad) - _N_ARGS
            return ((out[0] if need_x else None), *(None,) * (_N_ARGS - 1 + n_params))
        module = ctx.module
        present = (True,) * (len(ctx.needs_input_grad) - _N_ARGS)
        if differentiated():  # create_graph, torch.func: see .twin
            ctx.param_names = module._gemm_weight_names + module._gemm_bias_names
            ctx.param_present = present
            grads = twin.differentiable_backward(
                ctx, module, dy, x, ctx.params, ctx.autocast, ctx.m_splits
            )
            return (grads[0], *(None,) * (_N_ARGS - 1), *grads[1:])
        dest, leaves, direct = backward_routes(ctx, module, present)
        dx, *returned = _backward(
            module,
            dy,
            x,
            weights,
            ctx.m_splits,
            ctx.use_grouped,
            need_x,
            dest,
            leaves,
            ctx.overwrite,
            direct=direct,
        )
        return (dx, *(None,) * (_N_ARGS - 1), *returned)


_apply = fast_apply(_GroupedLinearFunction)
_c_apply = function_c_apply(_GroupedLinearFunction)


@compiled.backward_op("splitgrad::grouped_linear_backward")
def _grouped_linear_backward_op(
    handle: torch.Tensor,
    dy: torch.Tensor,
    x: torch.Tensor,
    weights: list[torch.Tensor],
    m_splits: list[int],
    overwrite: bool,
    use_grouped: bool,
    need_x: bool,
) -> list[torch.Tensor]:
    """The backward of a compiled ``GroupedLinear`` (see :mod:`.compiled`): ``[dx]`` or ``[]``."""
    module, leaves, dest = compiled.op_targets(handle)
    with autocast_off(dy.device.type):
        dx = _backward(
            module, dy, x, weights, m_splits, use_grouped, need_x, dest, leaves, overwrite, True
        )[0]
    return [dx] if need_x else []


@_grouped_linear_backward_op.register_fake
def _(handle, dy, x, weights, m_splits, overwrite, use_grouped, need_x):
    return [x.new_empty(x.shape)] if need_x else []


class _GroupedLinearFP8Function(torch.autograd.Function):
    """The same layer under an FP8 recipe: every group quantizes its own rows and weight (own
    scales and ``gemm{i}.*`` amax histories, empty groups included), one FP8 GEMM per group
    written into its row block; one entry covers all groups."""

    @staticmethod
    def forward(ctx, x, m_splits, module, overwrite, recipe, autocast, *params):
        n = module.num_gemms
        # SPEC §2 under torch.autocast: biases in the autocast dtype (x comes in it), weights
        # quantized from their own dtype.
        weights, biases = params[:n], (autocast_cast(autocast, *params[n:]) or (None,) * n)
        need_x = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[_N_ARGS : _N_ARGS + n]
        gemms = [FP8GemmOperands(module, recipe, f"gemm{i}") for i in range(n)]
        y = x.new_empty(x.shape[0], module.out_features)
        for i, (x_g, y_g) in enumerate(zip(x.split(m_splits), y.split(m_splits))):
            out = gemms[i].fprop(x_g, weights[i], biases[i], keep_x=need_w[i], keep_w=need_x)
            y_g.copy_(out)
        update_delayed_scaling(module, recipe, ("input", "weight"))
        ctx.module, ctx.m_splits, ctx.overwrite, ctx.fp8 = module, m_splits, overwrite, gemms
        ctx.weight_dtypes = [w.dtype for w in weights]
        return y

    @staticmethod
    @without_autocast
    def backward(ctx, dy):
        module, gemms = take_fp8(ctx)
        n, m_splits = module.num_gemms, ctx.m_splits
        need_x = ctx.needs_input_grad[0]
        dest, leaves = edge_routes(ctx, (True,) * (len(ctx.needs_input_grad) - _N_ARGS))
        to_w, to_b = dest[:n], dest[n:] or [None] * n
        weight_params, bias_params = leaves[:n], leaves[n:] or [None] * n
        need_w = [d == ACCUMULATE for d in to_w]
        need_b = [d == ACCUMULATE for d in to_b]
        returned = [None] * (2 * n if module.use_bias else n)
        written = _written(module, leaves, need_w, need_b if dest[n:] else [])
        named_weights = written[: sum(need_w)]
        module._begin_writes(written)
        dx = dy.new_empty(dy.shape[0], module.in_features) if need_x else None
        dx_parts = dx.split(m_splits) if need_x else (None,) * n
        parts = []
        for i, dy_g in enumerate(dy.split(m_splits)):
            dx_g = gemms[i].dgrad(dy_g, need_dx=need_x, keep_dy=to_w[i] is not None)
            if need_x:
                dx_parts[i].copy_(dx_g)
            dy_q, x_q = gemms[i].take_wgrad_operands()
            # Asked for by torch.autograd.grad: returned now, nothing written or queued.
            if to_w[i] == RETURN:
                returned[i] = fp8_wgrad_value(module, ctx.weight_dtypes[i], dy_q, x_q)
            if to_b[i] == RETURN:
                returned[n + i] = dy_g.sum(dim=0)
            bias = bias_params[i] if need_b[i] else None
            db = dy_g.sum(dim=0) if need_b[i] else None
            parts.append(FP8WgradPart(weight_params[i] if need_w[i] else None, bias, dy_q, x_q, db))
        update_delayed_scaling(module, gemms[0].recipe, ("grad_output",))
        if any(need_w) or any(need_b):
            module._submit_fp8_wgrad(parts, named_weights, ctx.overwrite, written)
        return (dx, *(None,) * (_N_ARGS - 1), *returned)


_fp8_forward = compiled.eager_apply(_GroupedLinearFP8Function)


class GroupedLinear(GroupedLinearContract, SplitBackwardModule):
    """``num_gemms`` independent Linears applied to consecutive row blocks of one input.

    Same constructor, parameters and behaviour as ``splitgrad.reference.GroupedLinear`` (the
    shared contract: :class:`~splitgrad.reference.contract.GroupedLinearContract`); the weights
    live in 64-byte aligned slots of one storage (see the module docstring). Forward:
    ``module(inp, m_splits, is_first_microbatch=None)``. One deferrable entry per backward
    covers all groups. See the module docstring for the GEMM paths.
    """

    #: ``"auto"``, ``"grouped"`` or ``"loop"``: which GEMM path forward and dgrad take (set it
    #: on an instance to choose per module).
    grouped_gemm: str = "auto"

    def _group_weight_tensors(self, n: int, out_features: int, in_features: int):
        """Slots of one storage, each starting on a 64-byte boundary, so the grouped path can
        view the weights as (G, M, K) and the loop path runs a ``Linear``'s GEMM."""
        slot = _slot_elements(out_features, in_features, self.params_dtype)
        storage = torch.empty(n * slot, dtype=self.params_dtype, device=self._device)
        size = out_features * in_features
        shape = (out_features, in_features)
        return [storage[i * slot : i * slot + size].view(shape) for i in range(n)]

    def _plain_grouped_forward(self, inp, m_splits, params, is_first_microbatch) -> torch.Tensor:
        """:meth:`forward` on the plain path (:meth:`~.base.SplitBackwardModule._plain_call`):
        ``m_splits`` checked (a list or tuple of ``num_gemms`` non-negative ints summing to the
        rows is taken as it is; anything else goes through the full check, which says what is
        wrong), then the Function, or its forward as a plain function when nothing needs a
        gradient."""
        k = self.in_features
        x = inp if inp.ndim == 2 else inp.reshape(-1, k)
        rows = x.shape[0]
        if (
            type(m_splits) in (list, tuple)
            and len(m_splits) == self.num_gemms
            and set(map(type, m_splits)) == {int}
            and min(m_splits) >= 0
            and sum(m_splits) == rows
        ):
            splits = list(m_splits)
        else:
            splits = self._check_m_splits(m_splits, rows)
        use_grouped = self._use_grouped(x)
        if wants_graph(x, params):
            ow = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
            y = _c_apply(_unwrap_if_dead(x), splits, self, ow, use_grouped, None, *params)
        else:
            ctx = NoGradContext()
            y = _GroupedLinearFunction.forward(
                ctx, x, splits, self, False, use_grouped, None, *params
            )
        return y if x is inp else y.reshape(*inp.shape[:-1], self.out_features)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        path = self.grouped_gemm
        if path == "auto":
            grouped = gemm.grouped_mm_supported(
                x.device, x.dtype, self.in_features, self.out_features
            )
        elif path == "grouped":
            # A forced "grouped" still falls back where _grouped_mm rejects the shapes.
            grouped = gemm.grouped_mm_runs(x.dtype, self.in_features, self.out_features, x.device)
        elif path == "loop":
            grouped = False
        else:
            raise ValueError(f"grouped_gemm must be one of {_PATHS}, got {path!r}")
        if RECORDERS or (not grouped and path != "loop" and x.is_cuda):
            self._after_choice(x, grouped)
        return grouped

    def _after_choice(self, x: torch.Tensor, grouped: bool) -> None:
        """Record the decision (when recording) and, on CUDA, warn where the probe refused an
        aligned problem (:mod:`.gemm_paths`). Off the CPU eager path."""
        if RECORDERS:
            self._note_grouped(x, grouped)
        if not grouped and x.is_cuda and self.grouped_gemm != "loop":
            self._check_grouped_missed(x)

    def _check_grouped_missed(self, x: torch.Tensor) -> None:
        """On CUDA: warn (:func:`.gemm_paths.fast_path_missed`) when aligned sizes fell back
        because the probe refused ``_grouped_mm`` (alignment fallbacks are expected)."""
        k, m = self.in_features, self.out_features
        if gemm.grouped_mm_aligned(x.dtype, k, m) and not gemm._grouped_mm_available(
            x.device, x.dtype
        ):
            call = (
                f"GroupedLinear forward+dgrad: x {tuple(x.shape)} row-major @ "
                f"{self.num_gemms} x ({m}, {k}) weights as (G, K, N) column-major, {x.dtype}"
            )
            gemm_paths.fast_path_missed("grouped_mm", x.device, x.dtype, call)

    def _note_grouped(self, x: torch.Tensor, grouped: bool) -> None:
        """Record the path of this forward (and its dgrad) and why (:mod:`.gemm_paths`)."""
        k, m = self.in_features, self.out_features
        if self.grouped_gemm == "loop":
            path, why = gemm_paths.path_label(False, x.device, forced=True), "grouped_gemm='loop'"
        elif self.grouped_gemm == "auto":
            why = gemm.grouped_mm_choice(x.device, x.dtype, k, m)[1]
            path = gemm_paths.path_label(grouped, x.device)
        else:
            path = gemm_paths.path_label(grouped, x.device)
            why = "grouped_gemm='grouped'" if grouped else "_grouped_mm refuses these sizes"
        call = "torch._grouped_mm" if grouped else f"loop of {self.num_gemms} mm"
        gemm_paths.note(
            "grouped forward+dgrad",
            call,
            path,
            why,
            x.device,
            x.dtype,
            (x.shape[0], m, k),
            "A row-major, B (G, K, N) column-major" if grouped else "",
        )

    def forward(
        self, inp: torch.Tensor, m_splits: Sequence[int], is_first_microbatch: bool | None = None
    ) -> torch.Tensor:
        names = self._gemm_weight_names + self._gemm_bias_names
        params = tuple(map(self._parameters.get, names))
        if self._plain_call(inp, params, names, self.in_features):
            return self._plain_grouped_forward(inp, m_splits, params, is_first_microbatch)
        x, recipe = self._check_input(inp, self.in_features)
        splits = self._check_m_splits(m_splits, x.shape[0])
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        names = self._gemm_weight_names + self._gemm_bias_names
        params = self._params_of(names)
        self._check_weights_used(recipe, names, params)
        autocast = self.autocast_dtype()
        if functorch_active():
            with autocast_off(x.device.type):
                y = self._twin_forward(x, names, params, autocast, recipe, splits)
        elif recipe is None and autocast is None:
            use_grouped = self._use_grouped(x)
            y = _apply(x, splits, self, overwrite, use_grouped, None, *params)
        elif recipe is None:
            use_grouped = self._use_grouped(x)
            with autocast_off(x.device.type):
                y = _apply(x, splits, self, overwrite, use_grouped, autocast, *params)
        else:
            self._check_fp8_shapes(recipe, splits)
            with autocast_off(x.device.type):
                y = _fp8_forward(x, splits, self, overwrite, recipe, autocast, *params)
        return y if x is inp or inp.dim() == 2 else y.reshape(*inp.shape[:-1], self.out_features)
