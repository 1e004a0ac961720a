"""What every impl module shares on top of the contract
(:class:`splitgrad.reference.contract.ModuleContract`: options, parameters, validation, §5
errors): gradient routing (SPEC §3), the queue and its hooks (§4), and
``backward_dw(stream=None)``.

Each autograd Function builds one wgrad closure per backward that writes every GEMM-parameter
gradient itself (the Function returns ``None`` for them, in both modes). Without delay the
closure runs inside backward; with delay it is queued as a :class:`~.store.WgradEntry`. It is the
same closure either way, so delayed and non-delayed execute the same instructions and their
gradients are bitwise identical on any device (tied weights included: autograd never sums two
uses). Hooks fire after each entry's gradients are written: in :meth:`backward_dw` under delay,
at the end of the module's backward otherwise (GEMM gradients never reach autograd's
AccumulateGrad, so these hooks are the only signal a data-parallel wrapper gets). The queue tells
the optimizer guard (:mod:`splitgrad.reference.pending`) when it becomes non-empty and empty
again, so an optimizer step over a parameter an entry will still write raises.

Per-call cost (``splitgrad bench``, small-shape rows): a Function's backward learns where each
parameter's gradient goes from its own autograd edges (``ctx.next_functions``, one engine query
per parameter) instead of building a gradient edge per parameter, and without delay the closure
runs directly, with no entry object and no grad-mode switch (a backward already runs without
grad). Under ``torch.compile`` the backward runs through :mod:`.compiled`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import torch
from splitgrad.reference import accumulate as acc
from splitgrad.reference import pending
from splitgrad.reference._fsdp_guard import check_not_under_fsdp
from splitgrad.reference._torch_private import (
    active_ddp_module,
    fsdp_in_use,
    functorch_active,
    has_hooks,
    will_engine_execute_node,
)
from splitgrad.reference.contract import (
    ACCUMULATE,
    LEAF_NODE,
    RETURN,
    ModuleContract,
    autocast_off,
    check_not_under_ddp,
    node_destination,
)
from splitgrad.reference.contract import without_autocast as _general_without_autocast
from splitgrad.reference.fp8 import _state as _fp8_state
from splitgrad.reference.routing import differentiated, route_differentiable

from . import _torch_compat, compiled, gemm, twin
from .fp8 import Float8Tensor
from .fp8_gemm import fp8_wgrad_write, pack, unpack
from .store import WeightGradStore, WgradEntry

__all__ = [
    "SplitBackwardModule",
    "FP8WgradPart",
    "autocast_cast",
    "autocast_off",
    "differentiated",
    "edge_routes",
    "backward_routes",
    "store_grad",
    "fp8_not_differentiable",
    "functorch_active",
    "has_hooks",
    "twin",
    "twin_backward",
    "norm_module_backward",
    "fast_apply",
    "take_fp8",
    "without_autocast",
    "wants_graph",
    "NoGradContext",
]


def autocast_cast(dtype: torch.dtype | None, *tensors: torch.Tensor | None) -> tuple:
    """``tensors`` cast to ``dtype`` for a GEMM under ``torch.autocast`` (SPEC §2; ``None``
    stays ``None``); unchanged when ``dtype`` is ``None`` (no autocast). Called inside a
    Function's forward, so the casts are plain tensors, not autograd nodes: each parameter
    keeps its own gradient edge."""
    if dtype is None:
        return tensors
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def without_autocast(backward: Callable) -> Callable:
    """:func:`splitgrad.reference.contract.without_autocast` (a Function's backward runs with
    ``torch.autocast`` off), with one call to see that no autocast is on at all, the usual
    case, and nothing else then."""
    general = _general_without_autocast(backward)

    @functools.wraps(backward)
    def run(ctx, *grads):
        if _any_autocast():
            return general(ctx, *grads)
        return backward(ctx, *grads)

    return run


def edge_routes(ctx, present: Sequence[bool]) -> tuple[list[str | None], list[torch.Tensor | None]]:
    """Where the running backward wants the gradients of the Function's parameters (the inputs
    after ``x``; ``present[i]``: parameter ``i`` was a tensor, ``None`` such as no bias has no
    autograd edge), and for each one the module writes itself
    (:data:`~splitgrad.reference.contract.ACCUMULATE`) the leaf its edge leads to: the tensor the
    forward was given (SPEC §3), never the module's attribute (``None`` for the others). Each
    destination is :func:`~splitgrad.reference.contract.node_destination` of that input's
    autograd edge. Call it inside the Function's backward."""
    edges = ctx.next_functions
    dests: list[str | None] = []
    leaves: list[torch.Tensor | None] = []
    i = 1  # edge 0 is x
    for is_tensor in present:
        dest = leaf = None
        if is_tensor:
            node = edges[i][0]
            dest = node_destination(node)
            if dest == ACCUMULATE:
                leaf = node.variable
            i += 1
        dests.append(dest)
        leaves.append(leaf)
    return dests, leaves


def backward_routes(ctx, module, present: Sequence[bool], returned: int = 0) -> tuple:
    """``(dests, leaves, direct)``: the routes of the running backward (as :func:`edge_routes`
    gives them) and whether they are *direct*. Direct routes are those of the usual backward,
    whose writes need no preparation (:meth:`SplitBackwardModule._begin_writes`) and, without
    delay, run at once, straight into ``.grad`` (:func:`store_grad`, in the order the wgrad
    closure would), before the module's SPEC §4 hooks: one loop over the Function's edges. The
    first ``returned`` parameters (a norm's) are not written: their gradients are returned
    (destination ``RETURN`` where the backward computes them). Not direct (the general way,
    :func:`edge_routes`) under fused accumulation or a forward under ``torch.autocast`` (its
    gradients are cast), and when a written parameter is returned (captured by
    ``torch.autograd.grad``, not a leaf) or its leaf has hooks."""
    if not (module.fuse_wgrad_accumulation or ctx.autocast is not None):
        dests: list[str | None] = []
        leaves: list[torch.Tensor | None] = []
        nodes = iter(ctx.next_functions[1:])  # edge 0 is x; a None input has none
        for k, is_tensor in enumerate(present):
            node = next(nodes)[0] if is_tensor else None
            try:
                executes = node is not None and will_engine_execute_node(node)
            except RuntimeError:  # captured (TorchMoved: raised again on the general way)
                if k >= returned:
                    break
                executes = True
            if not executes or k < returned:
                dests.append(RETURN if executes else None)
                leaves.append(None)
            elif type(node) is LEAF_NODE and not has_hooks(leaf := node.variable):
                dests.append(ACCUMULATE)
                leaves.append(leaf)
            else:
                break
        else:
            return dests, leaves, True
    return (*edge_routes(ctx, present), False)


def store_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad = grad`` when it is ``None``, else ``param.grad += grad`` (SPEC §3, plain):
    what the wgrad closure's plain writes do, for direct routes (:func:`backward_routes`)."""
    current = param.grad
    if current is None:
        param.grad = grad
    else:
        current.add_(grad)


def fp8_not_differentiable(module) -> None:
    """Raise ``RuntimeError``: an FP8 backward cannot be differentiated (create_graph=True)."""
    route_differentiable(module, (), fp8=True)


def take_fp8(ctx) -> tuple[torch.nn.Module, object]:
    """``(module, FP8 operands)`` that an FP8 Function's forward left on ``ctx``, handed over:
    from here on the queued entry, not the autograd graph, keeps the quantized copies alive
    (so ``backward_dw()`` is what frees them). Raises ``RuntimeError`` when the backward is
    differentiated itself or transformed (:func:`fp8_not_differentiable`)."""
    fp8, ctx.fp8 = ctx.fp8, None
    if differentiated():  # create_graph, torch.func
        fp8_not_differentiable(ctx.module)
    return ctx.module, fp8


def norm_module_backward(op_name: str, names, n_saved: int, backward: Callable) -> staticmethod:
    """The ``backward`` of the Function of a module that begins with a norm (``LayerNormLinear``,
    ``LayerNormMLP``), whose inputs are ``x``, the parameters ``names``, module, overwrite,
    autocast, and whose forward saved ``n_saved`` tensors, then the norm's statistics. Traced
    by ``torch.compile``: one call to the module's backward op, registered here as ``op_name``
    (:func:`.compiled.norm_module_backward_op`); differentiated itself: the twin
    (:func:`twin_backward`); otherwise ``backward``, the eager body, on the leaves the
    Function's edges lead to (``direct``: direct routes, see :func:`backward_routes`)."""
    op = compiled.norm_module_backward_op(op_name, names, backward)

    @without_autocast
    def function_backward(ctx, dy):
        saved = ctx.saved_tensors
        if torch.compiler.is_compiling():
            needs = list(ctx.needs_input_grad[:3])
            handle, overwrite = ctx.module._handle, ctx.overwrite
            out = iter(op(handle, dy, saved[:n_saved], saved[n_saved:], overwrite, needs))
            return (*(next(out) if n else None for n in needs), *(None,) * (len(names) + 1))
        if differentiated():  # create_graph, torch.func: see .twin
            return twin_backward(ctx, names, dy, saved[0])
        module, need_x = ctx.module, ctx.needs_input_grad[0]
        dests, leaves, direct = backward_routes(ctx, module, ctx.present, returned=2)  # norm's
        grads = backward(module, dy, saved, need_x, dests, leaves, ctx.overwrite, direct=direct)
        return (*grads, None, None, None)

    return staticmethod(function_backward)


def twin_backward(ctx, names: Sequence[str], dy: torch.Tensor, x: torch.Tensor) -> tuple:
    """A Function's backward when it is differentiated itself or transformed
    (:func:`differentiated`): the gradients of ``x`` and of the parameters ``names`` (as
    ``ctx.params``, ``ctx.present``), all returned through autograd by :mod:`.twin`; ``None``
    for the Function's last three arguments (module, overwrite, autocast)."""
    ctx.param_names, ctx.param_present = names, ctx.present
    grads = twin.differentiable_backward(ctx, ctx.module, dy, x, ctx.params, ctx.autocast)
    return (*grads, None, None, None)


def fast_apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """``function.apply`` for impl's Functions, whose first argument is the input and the rest
    are parameters and plain values. Eagerly it calls autograd's C++ ``apply`` directly: the
    Python wrapper's per-call work (default-argument binding, a dead-functorch-wrapper check on
    every tensor argument: 128 of them in a 64-group ``GroupedLinear``) costs more than the
    Function itself at small shapes; only the input can be such a wrapper. Under
    ``torch.compile`` it is ``function.apply``; a module under a ``torch.func`` transform runs
    :class:`.twin.TwinFunction` instead (see :meth:`SplitBackwardModule._twin_forward`)."""
    c_apply = _torch_compat.function_c_apply(function)

    def apply(x: torch.Tensor, *args) -> torch.Tensor:
        if torch.compiler.is_compiling():
            if not compiled.SUPPORTED:
                compiled.check_supported()
            return function.apply(x, *args)
        return c_apply(_unwrap_if_dead(x), *args)

    return apply


_unwrap_if_dead = _torch_compat.unwrap_if_dead
_set_grad_enabled = _torch_compat.set_grad_enabled
_any_autocast = _torch_compat.any_autocast_enabled
_grad_enabled = torch.is_grad_enabled
_is_compiling = torch.compiler.is_compiling
_Tensor = torch.Tensor


def wants_graph(x: torch.Tensor, params: Sequence[torch.Tensor | None]) -> bool:
    """Whether a forward on ``x`` and ``params`` must record a backward: grad mode on (not
    under ``torch.no_grad`` or ``torch.inference_mode``) and the input or some parameter
    requiring a gradient. Otherwise a module's plain path runs no autograd Function at all."""
    if not _grad_enabled():
        return False
    if x.requires_grad:
        return True
    for p in params:
        if p is not None and p.requires_grad:
            return True
    return False


class NoGradContext:
    """Stands in for an autograd Function's ``ctx`` when its forward runs as a plain function
    (:func:`wants_graph` false): the same instructions, so the same output bitwise; what the
    forward keeps for a backward is dropped with it."""

    def save_for_backward(self, *tensors) -> None:
        pass


@dataclasses.dataclass
class FP8WgradPart:
    """One FP8 GEMM's share of a wgrad entry: ``weight`` gets ``q(dy)^T q(x)`` (None: frozen),
    ``bias`` gets ``db`` (None: no bias or frozen), summed from the unquantized dy in backward."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    dy: Float8Tensor | None
    x: Float8Tensor | None
    db: torch.Tensor | None


class SplitBackwardModule(ModuleContract):
    """Base of the four impl modules."""

    #: How FP8 GEMMs run: ``"auto"``, ``"scaled_mm"`` or ``"dequantize"`` (see :mod:`.fp8_gemm`).
    fp8_gemm: str = "auto"
    #: While an entry whose leaves have hooks runs: the writes it collects (see :meth:`_execute`).
    _collected: list | None = None

    def __init__(self, **options) -> None:
        super().__init__(**options)
        self._wgrad_store = WeightGradStore()
        # Names this module to the opaque ops of a compiled backward (see .compiled).
        self._handle = compiled.register(self)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and unpickling rebuild a module from its state: the copy gets a handle
        # of its own, or a compiled backward of the copy would write the original's gradients.
        super().__setstate__(state)
        self._handle = compiled.register(self)

    # ---- the forward's parameters -----------------------------------------------------------

    def _params_of(self, names: Sequence[str]) -> tuple:
        """The tensors the forward uses for the parameters ``names``: the registered ones (or
        those ``torch.func.functional_call`` put in their place), or a parametrization's
        result. (The modules inline the first case: a dict lookup per parameter.)"""
        params = self._parameters
        return tuple(params[n] if n in params else getattr(self, n) for n in names)

    def _twin_forward(self, x, names, params, autocast, recipe, m_splits=None) -> torch.Tensor:
        """The forward under a ``torch.func`` transform (:mod:`.twin`)."""
        self._check_forward_params(recipe, [])
        return twin.TwinFunction.apply(x, self, autocast, m_splits, tuple(names), *params)

    def _check_weights_used(self, recipe, names: Sequence[str], params: Sequence) -> None:
        """:meth:`_check_forward_params` for the GEMM weights among the forward's parameters
        ``params`` (named ``names``), when fused accumulation or FP8 makes it check anything."""
        if self.fuse_wgrad_accumulation or recipe is not None:
            weights = self._gemm_weight_names
            self._check_forward_params(
                recipe, tuple((n, p) for n, p in zip(names, params) if n in weights)
            )

    def _plain_call(self, inp, params, names, in_features: int) -> bool:
        """Whether this call takes the plain path, which skips :meth:`_run_forward`'s choice of
        path: ``inp`` an ordinary tensor in the dtype of ``params[0]`` (the module's first
        registered parameter, whose dtype is :attr:`compute_dtype`), on its device, with
        ``in_features`` last; no ``torch.autocast``, FP8 recipe, ``torch.func`` transform,
        ``torch.compile`` trace or tensor parallelism. Anything else takes the general way,
        which checks it and raises what SPEC §5 says. The checks every call makes there run
        here too: DDP and FSDP2 (delayed or fused modules), the fused weights' ``main_grad``."""
        first = params[0]
        if not (
            type(inp) is _Tensor
            and "parametrizations" not in self._modules  # torch.nn.utils.parametrize
            and first is not None
            and inp.dtype is first.dtype
            and inp.ndim
            and inp.shape[-1] == in_features
            and self._tp is None
            and inp.device == first.device
            and not _any_autocast()
            and _fp8_state.recipe is None
            and not functorch_active()
            and not _is_compiling()
        ):
            return False
        if self.delay_wgrad_compute or self.fuse_wgrad_accumulation:
            if active_ddp_module() is not None:
                check_not_under_ddp(self)
            if fsdp_in_use():
                check_not_under_fsdp(self)
            if self.fuse_wgrad_accumulation:
                self._check_weights_used(None, names, params)
        return True

    def _plain_forward(self, inp, params, function, c_apply, is_first_microbatch, features):
        """The forward on the plain path (:meth:`_plain_call` true) of a module whose Function
        ``function`` takes ``(x, *params, module, overwrite, autocast)``: ``c_apply``
        (:func:`~._torch_compat.function_c_apply` of it) when a gradient is needed
        (:func:`wants_graph`), else its forward as a plain function (no autograd node).
        ``features``: the output's last dimension."""
        k = inp.shape[-1]
        x = inp if inp.ndim == 2 else inp.reshape(-1, k)
        if wants_graph(x, params):
            overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
            y = c_apply(_unwrap_if_dead(x), *params, self, overwrite, None)
        else:
            y = function.forward(NoGradContext(), x, *params, self, False, None)
        return y if x is inp else y.reshape(*inp.shape[:-1], features)

    def _run_forward(
        self, x, recipe, is_first_microbatch, names, params, apply, fp8_forward
    ) -> torch.Tensor:
        """The forward of a module whose Functions take ``(x, *params, module, overwrite,
        [recipe,] autocast)``, on the path the context chooses: the twin under a ``torch.func``
        transform (:mod:`.twin`), ``apply`` (the Function, :func:`fast_apply`) without FP8,
        ``fp8_forward`` (the FP8 Function, run eagerly) under an FP8 recipe. With
        ``torch.autocast`` on, the Function runs with it off and casts its operands itself.
        ``x``, ``recipe``: what :meth:`_check_input` returned."""
        overwrite = bool(is_first_microbatch) and self.fuse_wgrad_accumulation
        self._check_weights_used(recipe, names, params)
        autocast = self.autocast_dtype()
        if functorch_active():
            with autocast_off(x.device.type):
                return self._twin_forward(x, names, params, autocast, recipe)
        if recipe is None and autocast is None:
            return apply(x, *params, self, overwrite, None)
        with autocast_off(x.device.type):
            if recipe is None:
                return apply(x, *params, self, overwrite, autocast)
            self._check_fp8_shapes(recipe, x.shape[0])
            return fp8_forward(x, *params, self, overwrite, recipe, autocast)

    # ---- gradient routing (§3) ------------------------------------------------------------

    def _begin_writes(self, named_leaves: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """At the start of a backward, for the leaves the module writes itself: under fused
        accumulation their weights need a usable ``main_grad`` and no tensor hook (raised
        before anything is written); hooked leaves get autograd's call without a gradient muted
        (:func:`~splitgrad.reference.accumulate.mute_empty_calls`). Returns whether any has
        hooks."""
        if self.fuse_wgrad_accumulation:
            weights = self._gemm_weight_names
            self._check_main_grads([(n, leaf) for n, leaf in named_leaves if n in weights])
        hooked = False
        for _, leaf in named_leaves:
            if has_hooks(leaf):
                acc.mute_empty_calls(leaf, deferred=self.delay_wgrad_compute)
                hooked = True
        return hooked

    def _write_weight_grad(
        self, param: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
    ) -> None:
        """Write ``dy^T x`` to ``param.main_grad`` (fused) or ``param.grad`` (plain)."""
        if self.fuse_wgrad_accumulation:
            if self._collected is not None:
                later = functools.partial(self._write_weight_grad, param, dy, x, overwrite)
                self._collected.append((param, None, later))
                return
            gemm.wgrad_into_main_grad_(param.main_grad, dy, x, overwrite)
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
        elif self._collected is not None:
            self._collected.append((param, gemm.wgrad(dy, x), None))
        elif param.grad is None:
            param.grad = _in_dtype_of(param, gemm.wgrad(dy, x))
        else:
            gemm.wgrad_accumulate_(param.grad, dy, x)

    def _write_bias_grad(self, param: torch.Tensor, dy: torch.Tensor) -> None:
        """Write ``sum over rows of dy`` to ``param.grad`` (biases never use ``main_grad``)."""
        self._write_bias_value(param, dy.sum(dim=0))

    def _write_bias_value(self, param: torch.Tensor, db: torch.Tensor) -> None:
        """Set or accumulate an already reduced bias gradient into ``param.grad``."""
        if self._collected is not None:
            self._collected.append((param, db, None))
        elif param.grad is None:
            param.grad = _in_dtype_of(param, db)
        else:
            param.grad.add_(db)

    def _execute(
        self, closure: Callable[..., None], saved: tuple, written: tuple, hooked: bool | None = None
    ) -> list:
        """Run a wgrad closure with grad mode off. When a leaf it writes has hooks, its writes
        follow autograd's accumulator (:mod:`splitgrad.reference.accumulate`): every gradient
        is computed and passed through its leaf's tensor hooks first (so a hook that raises
        leaves everything unwritten), then stored. Returns the leaves whose post-accumulate
        hooks :meth:`backward_dw` runs next, after consuming the entry (a deferred entry's
        hooked leaves; none without delay, where autograd's own call on the leaf, which follows
        the backward, runs them). ``written``: the (name, leaf) pairs the closure writes;
        ``hooked``: whether one has hooks, when the caller just looked."""
        # Grad mode set directly, and only when on (a backward already runs without it): the
        # context manager costs more than a small Linear's bias gradient.
        enabled = torch.is_grad_enabled()
        if enabled:
            _set_grad_enabled(False)
        try:
            if hooked is None:
                for _, leaf in written:
                    if has_hooks(leaf):
                        hooked = True
                        break
            if not hooked:
                closure(*saved)
                return []
            self._collected = []
            try:
                closure(*saved)
                collected = self._collected
            finally:
                self._collected = None
        finally:
            if enabled:
                _set_grad_enabled(True)
        names = {id(leaf): name for name, leaf in written}
        kind = type(self).__name__
        with torch.no_grad():
            # (leaf, value after its tensor hooks or None, a fused write to run or None)
            hooked = [
                (leaf, acc.apply_tensor_hooks(leaf, value, f"{kind}.{names[id(leaf)]}"), later)
                if value is not None
                else (leaf, value, later)
                for leaf, value, later in collected
            ]
            for leaf, value, later in hooked:
                if later is not None:
                    later()  # a main_grad write: fused weights have no tensor hooks
                else:
                    acc.accumulate(leaf, value, own=not acc.has_hooks(leaf))
        # A deferred entry's leaves get their post-accumulate hooks from backward_dw(), once
        # the entry is consumed (a hook that raises must not leave it queued: SPEC §4).
        if self.delay_wgrad_compute:
            return list({id(leaf): leaf for leaf, _, _ in hooked}.values())
        return []

    def _submit_fp8_wgrad(
        self,
        parts: Sequence[FP8WgradPart],
        named_weights: Sequence[tuple[str, torch.Tensor]],
        overwrite: bool,
        written: tuple,
    ) -> None:
        """Queue (or run) one entry that writes every part's weight and bias gradient, in order.

        The entry holds each part's two column-wise FP8 copies with their ``scale_inv`` and its
        reduced bias gradient; the closure captures layouts and parameters, no tensor."""
        quantized = []
        for part in parts:
            keep = part.weight is not None
            quantized += [part.dy if keep else None, part.x if keep else None]
        tensors, layouts = pack(*quantized)
        dbs = tuple(part.db if part.bias is not None else None for part in parts)
        targets = [(part.weight, part.bias) for part in parts]
        n = len(tensors)

        def wgrad_closure(*saved):
            self._check_main_grads(named_weights)
            operands = unpack(saved[:n], layouts)
            for i, (weight, bias) in enumerate(targets):
                if weight is not None:
                    dy_q, x_q = operands[2 * i], operands[2 * i + 1]
                    fp8_wgrad_write(self, weight, dy_q, x_q, overwrite)
                if bias is not None:
                    self._write_bias_value(bias, saved[n + i])

        self._submit_wgrad(wgrad_closure, tensors + dbs, written)

    # ---- the queue (§4) -----------------------------------------------------------------

    @property
    def pending_wgrad_count(self) -> int:
        """How many weight-gradient entries wait for :meth:`backward_dw`."""
        return len(self._wgrad_store)

    def _pending_writes(self) -> list[tuple[tuple[str, torch.Tensor], ...]]:
        """For each queued entry, oldest first, the ``(name, leaf)`` pairs it will write (read by
        the optimizer guard, :mod:`splitgrad.reference.pending`)."""
        return [entry.params for entry in self._wgrad_store]

    def backward_dw(self, stream: torch.cuda.Stream | None = None) -> None:
        """Run the oldest queued weight-gradient entry (FIFO), then the hooks.

        No-op on a module built without delay; ``RuntimeError`` when nothing is pending. If the
        wgrad raises (a parameter's tensor hook included), nothing is written and the entry
        stays at the head of the queue; if a post-accumulate hook or a module hook raises, the
        gradients are written, the entry is consumed and the error propagates.

        ``stream`` (CUDA only; ignored on CPU): run the wgrad GEMMs on this side stream so they
        overlap work already queued on the current stream (e.g. an all-to-all). The side stream
        first waits for the current stream (the operands are produced there); afterwards the
        current stream waits for the side stream, so whatever is queued *after* this call
        (hooks, optimizer) sees the gradients while work queued *before* it still overlaps.
        The entry's tensors are ``record_stream``-ed so the caching allocator does not hand
        their memory to the current stream while the side stream may still read them.
        """
        if not self.delay_wgrad_compute:
            return
        store = self._wgrad_store
        if not len(store):
            raise self._nothing_pending()
        entry = store.head()
        if stream is None and not _any_autocast():
            written = self._execute(entry.closure, entry.saved, entry.params)
        else:
            # With torch.autocast off: the entry computes what the non-delayed backward would
            # have (its backward runs with autocast off too), whatever context the caller is in.
            with autocast_off(self.fp8_device.type):
                if stream is not None and _on_cuda(entry):
                    written = self._run_on_side_stream(entry, stream)
                else:
                    written = self._execute(entry.closure, entry.saved, entry.params)
        # The gradients are written: the entry is consumed whatever the hooks below do.
        store.pop_and_release()
        if not len(store):
            pending.drained(self)
        del entry
        for leaf in written:
            acc.run_post_accumulate_hooks(leaf)
        if self._wgrad_hooks:
            self._run_hooks()

    def _submit_wgrad(
        self,
        closure: Callable[..., None],
        saved: tuple[torch.Tensor | None, ...],
        written: tuple[tuple[str, torch.Tensor], ...],
        own_copies: bool = False,
        hooked: bool | None = None,
    ) -> None:
        """Called at the end of the autograd backward: queue ``closure(*saved)`` as an entry
        writing the ``written`` (name, leaf) pairs, or run it now (then the hooks).
        ``own_copies``: the entry keeps copies of ``saved`` (a compiled backward, see
        :mod:`.compiled`); ``hooked``: what :meth:`_begin_writes` returned."""
        if self.delay_wgrad_compute:
            if own_copies:
                saved = tuple(None if t is None else t.clone() for t in saved)
            store = self._wgrad_store
            if not len(store):
                pending.queued(self)
            store.push(WgradEntry(closure, saved, written))
            return
        self._execute(closure, saved, written, hooked)
        if self._wgrad_hooks:
            self._run_hooks()

    def _run_on_side_stream(self, entry: WgradEntry, stream: torch.cuda.Stream) -> list:
        """Run ``entry`` on ``stream`` with the event waits and allocator bookkeeping it
        needs; what :meth:`_execute` returns."""
        main = torch.cuda.current_stream(stream.device)
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            written = self._execute(entry.closure, entry.saved, entry.params)
        for t in entry.saved:
            if t is not None and t.is_cuda:
                t.record_stream(stream)
        for _, p in entry.params:
            # A .grad first created inside the side-stream block belongs to that stream's pool;
            # it is read on the current stream from now on.
            if p.grad is not None and p.grad.is_cuda:
                p.grad.record_stream(main)
        main.wait_stream(stream)
        return written


def _in_dtype_of(param: torch.nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` as ``param``'s gradient: under torch.autocast a GEMM's result comes in the
    autocast dtype, and a parameter's gradient is in the parameter's dtype (SPEC §2)."""
    return grad if grad.dtype == param.dtype else grad.to(param.dtype)


def _on_cuda(entry: WgradEntry) -> bool:
    return any(t is not None and t.is_cuda for t in entry.saved)
