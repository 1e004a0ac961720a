"""What every reference module shares: gradient routing (SPEC §3), the wgrad queue (§4) and
input validation (§5).

Contract, as code states it below:

Gradient routing (§3)
  * Plain (``fuse_wgrad_accumulation=False``): like autograd, ``param.grad`` is set when it is
    ``None`` and accumulated with ``+=`` otherwise. Biases and norm parameters always use ``.grad``.
  * Fused: every GEMM weight that needs a gradient must carry ``main_grad`` (same shape and
    device; float32, or float64 when the parameters are float64) before backward. Its gradient is
    accumulated in fp32 into ``main_grad``; ``weight.grad`` stays ``None``. If the forward of that
    micro-batch got ``is_first_microbatch=True`` the contribution overwrites ``main_grad``. If the
    weight has an attribute ``grad_added_to_main_grad`` it is set to ``True`` afterwards.
    ``is_first_microbatch`` changes nothing in plain mode.
  * Only what the backward asks for, as autograd does (:func:`gradient_destination`): a
    parameter the running backward does not compute — ``backward(inputs=[...])`` without it,
    ``torch.autograd.grad(outputs, inputs)`` without it — gets nothing written and, under
    delay, nothing queued (no entry at all when no GEMM parameter is asked for, and then no
    hook fires). A GEMM parameter that ``torch.autograd.grad`` asks for gets its gradient
    *returned*, computed in the backward in the parameter's dtype, as autograd returns it:
    nothing is written to ``.grad`` or ``main_grad``, nothing queued, no hook fires.

Split backward (§4, ``delay_wgrad_compute=True``)
  * ``backward()`` writes input and norm-parameter gradients only. The GEMM-parameter work of one
    backward of one module becomes one queue entry (a closure over the saved operands), appended
    to this module's own FIFO queue. A module applied twice queues two entries.
  * ``backward_dw()`` runs the oldest entry, writes its gradients by the rules above, calls the
    registered hooks once each in registration order with no arguments, and drops the entry.
  * Without delay the same closure runs inside ``backward()``, followed by the same hooks: both
    modes execute the same instructions, so their gradients are bitwise identical.
  * ``backward_dw()`` with an empty queue raises ``RuntimeError``; on a module built without
    delay it does nothing.
  * If computing the entry's gradients raises, nothing is written and the entry stays at the head
    of the queue. If a hook raises, the gradients are written, the entry is consumed, and the
    exception propagates (the remaining hooks do not run).
  * Deferred parameters carry ``skip_backward_post_hook = True``; frozen parameters are skipped
    and a backward in which no GEMM parameter needs a gradient queues nothing.
  * ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises ``ValueError`` in the
    constructor (an exception, so it holds under ``python -O``); without delay it is accepted and
    changes no result in one process.

Distributed (§8)
  * Inside the forward of torch's ``DistributedDataParallel``, a module with delay or fused
    accumulation raises ``RuntimeError`` (:func:`check_not_under_ddp`): DDP's reduction hooks
    run before such gradients exist, so they would stay unreduced.

Bad input (§5) raises before anything is written or queued
  * ``inp`` not a tensor, or of the wrong dtype (it must be ``params_dtype``) -> ``TypeError``;
    wrong last dimension or device -> ``ValueError``. Each message names expected and actual.
  * ``m_splits`` of the wrong length, with negative or non-int entries, or not summing to the row
    count -> ``ValueError`` naming the values.
  * A missing or unusable ``main_grad`` under fused accumulation -> ``RuntimeError`` naming the
    parameter, at the start of ``backward()`` (nothing written, nothing queued) and again at the
    start of the wgrad closure (the entry then stays queued).
  * Non-positive sizes, ``num_gemms < 1``, unknown ``normalization`` or ``activation`` ->
    ``ValueError`` from the constructor. Under FP8, a shape the recipe cannot quantize ->
    ``ValueError`` naming the recipe, the dimension and the multiple it needs.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence

import torch

from . import functional as F
from .fp8 import Recipe, fp8_active_recipe
from .fp8_gemm import FP8Gemm

__all__ = [
    "GradWrite",
    "WgradEntry",
    "SplitBackwardModule",
    "ACCUMULATE",
    "RETURN",
    "gradient_destination",
    "gradient_destinations",
    "check_not_under_ddp",
]

#: The running backward accumulates this parameter's gradient (``.grad`` / ``main_grad``).
ACCUMULATE = "accumulate"
#: ``torch.autograd.grad`` asked for this input: its gradient is returned, nothing is written.
RETURN = "return"


def gradient_destination(param: torch.Tensor | None) -> str | None:
    """Where the running backward wants ``param``'s gradient: :data:`ACCUMULATE`,
    :data:`RETURN`, or ``None`` when it does not compute it (SPEC §3). Call it inside a backward.

    ``requires_grad`` (``ctx.needs_input_grad``) only says the parameter is trainable; what
    *this* backward computes is the engine's execution plan:
    ``torch._C._will_engine_execute_node`` on the node the parameter's gradient goes to
    (``torch.autograd.graph.get_gradient_edge``: a leaf's ``AccumulateGrad``). It is false for a
    parameter that ``backward(inputs=[...])`` or ``torch.autograd.grad`` leaves out. Asked about
    a leaf that ``torch.autograd.grad`` *captures* (returns instead of accumulating), the engine
    raises: that is :data:`RETURN`. A non-leaf (a parameter seen through a parametrization)
    passes its gradient on through the graph, so it is returned.
    """
    if param is None or not param.requires_grad:
        return None
    node = torch.autograd.graph.get_gradient_edge(param).node
    try:
        executes = torch._C._will_engine_execute_node(node)
    except RuntimeError:
        return RETURN  # a leaf captured by torch.autograd.grad()
    if not executes:
        return None
    return ACCUMULATE if param.is_leaf else RETURN


def check_not_under_ddp(module: torch.nn.Module) -> None:
    """Raise ``RuntimeError`` when ``module`` runs inside the forward of torch's
    ``DistributedDataParallel`` that would have to reduce gradients it never sees (SPEC §8).

    DDP reduces a parameter from a hook on autograd's ``AccumulateGrad``, which runs during
    ``backward()``. A split-backward module writes its GEMM-parameter gradients itself: plain and
    non-delayed, ``.grad`` is written before that hook runs, so DDP reduces it correctly; but
    under ``delay_wgrad_compute`` the gradient arrives later in ``backward_dw()``, and under
    ``fuse_wgrad_accumulation`` it goes to ``main_grad``, which DDP never reads. Either way the
    replicas would silently train on unreduced gradients, so the module refuses to run. Parameters
    DDP is told to ignore (``_ddp_params_and_buffers_to_ignore``) are left to the caller.
    """
    if not (module.delay_wgrad_compute or module.fuse_wgrad_accumulation):
        return
    ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
    if ddp is None:
        return
    reduced = {id(p) for p in getattr(ddp, "_module_parameters", ())}
    names = [
        name
        for name, p in module.named_parameters(recurse=False)
        if p.requires_grad and id(p) in reduced and not name.startswith("layer_norm")
    ]
    if names:
        mode = "delay_wgrad_compute=True" if module.delay_wgrad_compute else ""
        if module.fuse_wgrad_accumulation:
            mode = " and ".join(m for m in (mode, "fuse_wgrad_accumulation=True") if m)
        raise RuntimeError(
            f"{type(module).__name__} with {mode} runs inside torch.nn.parallel."
            f"DistributedDataParallel, which cannot reduce {', '.join(names)}: their gradients "
            "are written outside autograd (by backward_dw() under delay, into main_grad when "
            "fused), after DDP's hooks have run, so the replicas would silently diverge. Use "
            "splitgrad.distributed.GradientReducer(model, process_group) instead of DDP, or list "
            "these parameters in the wrapped module's _ddp_params_and_buffers_to_ignore and "
            "reduce them yourself from register_wgrad_accumulation_and_reduce_hooks"
        )


def gradient_destinations(*params: torch.Tensor | None) -> list[str | None]:
    """:func:`gradient_destination` of each of ``params``."""
    return [gradient_destination(p) for p in params]


@dataclasses.dataclass
class GradWrite:
    """One gradient to write: ``value`` goes to ``param.main_grad`` if ``to_main_grad``, else to
    ``param.grad``."""

    param: torch.nn.Parameter
    value: torch.Tensor
    to_main_grad: bool


@dataclasses.dataclass
class WgradEntry:
    """One queued unit of weight-gradient work (one module, one backward).

    ``wgrad_closure()`` computes and returns the :class:`GradWrite` list without writing anything;
    ``overwrite_main_grad`` is the ``is_first_microbatch`` flag of that micro-batch's forward
    under fused accumulation.
    """

    wgrad_closure: Callable[[], list[GradWrite]]
    overwrite_main_grad: bool


def detached(tensors) -> list[torch.Tensor | None]:
    """Saved tensors without their autograd history (``None`` stays ``None``)."""
    return [None if t is None else t.detach() for t in tensors]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class SplitBackwardModule(torch.nn.Module):
    """Base of the four reference modules: options, queue, hooks, gradient routing, validation."""

    def __init__(
        self,
        *,
        bias: bool,
        params_dtype: torch.dtype,
        device: torch.device | str,
        fuse_wgrad_accumulation: bool,
        delay_wgrad_compute: bool,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(params_dtype, torch.dtype) or not params_dtype.is_floating_point:
            raise ValueError(
                f"params_dtype must be a floating-point torch.dtype, got {params_dtype!r}"
            )
        # Not an assert: the check must hold under `python -O`.
        if ub_bulk_wgrad and delay_wgrad_compute:
            raise ValueError(
                "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute "
                f"(got ub_bulk_wgrad={ub_bulk_wgrad!r}, "
                f"delay_wgrad_compute={delay_wgrad_compute!r})"
            )
        self.use_bias = bool(bias)
        self._device = torch.device(device)
        self.params_dtype = params_dtype
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        # Userbuffers bulk overlap is a multi-GPU communication optimisation; in one process it
        # changes no value, so the reference accepts it and otherwise ignores it.
        self.ub_bulk_wgrad = bool(ub_bulk_wgrad)
        self._gemm_weight_names: list[str] = []
        self._gemm_bias_names: list[str] = []
        # FP8 delayed-scaling state (amax histories and scales) of this module, by tensor role.
        self.fp8_states: dict = {}
        self._wgrad_queue: collections.deque[WgradEntry] = collections.deque()
        self._wgrad_hooks: list[Callable[[], None]] = []

    # ---- parameters ---------------------------------------------------------------------

    def gemm_weight_names(self) -> list[str]:
        """Names of the GEMM weights (the parameters that use ``main_grad`` when fused)."""
        return list(self._gemm_weight_names)

    def gemm_bias_names(self) -> list[str]:
        """Names of the GEMM biases (empty when built with ``bias=False``)."""
        return list(self._gemm_bias_names)

    def _add_gemm_weight(self, name: str, out_features: int, in_features: int) -> None:
        """Register a GEMM weight (out, in), initialised N(0, 0.02^2)."""
        w = torch.empty(out_features, in_features, dtype=self.params_dtype, device=self._device)
        self._add_gemm_parameter(name, torch.nn.init.normal_(w, std=0.02), self._gemm_weight_names)

    def _add_gemm_bias(self, name: str, out_features: int) -> None:
        """Register a zero GEMM bias (out,), or ``None`` when built with ``bias=False``."""
        if not self.use_bias:
            self.register_parameter(name, None)
            return
        b = torch.zeros(out_features, dtype=self.params_dtype, device=self._device)
        self._add_gemm_parameter(name, b, self._gemm_bias_names)

    def _add_gemm_parameter(self, name: str, value: torch.Tensor, names: list[str]) -> None:
        param = torch.nn.Parameter(value)
        if self.delay_wgrad_compute:
            # A DDP wrapper reads this to reduce from the module hooks instead of autograd's.
            param.skip_backward_post_hook = True
        self.register_parameter(name, param)
        names.append(name)

    def _name_of(self, param: torch.nn.Parameter) -> str:
        for name, p in self.named_parameters():
            if p is param:
                return name
        return "<parameter>"

    # ---- validation (§5) ----------------------------------------------------------------

    @property
    def fp8_device(self) -> torch.device:
        return next(self.parameters()).device

    def _check_input(self, inp: object, in_features: int) -> tuple[torch.Tensor, Recipe | None]:
        """Validate ``inp``, flatten it to (rows, in_features); also return the active FP8
        recipe (``None`` outside ``fp8_autocast``)."""
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__}")
        if inp.dim() < 1 or inp.shape[-1] != in_features:
            raise ValueError(
                f"inp's last dimension must be in_features={in_features}, "
                f"got shape {tuple(inp.shape)}"
            )
        if inp.dtype != self.params_dtype:
            raise TypeError(
                f"inp must have dtype {self.params_dtype} (params_dtype), got {inp.dtype}"
            )
        device = next(self.parameters()).device
        if inp.device != device:
            raise ValueError(f"inp must be on the module's device {device}, got {inp.device}")
        check_not_under_ddp(self)
        return inp.reshape(-1, in_features), fp8_active_recipe()

    def _check_main_grads(self, weights: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Fused accumulation needs a usable ``main_grad`` on each weight; raise before writing."""
        for name, w in weights:
            mg = getattr(w, "main_grad", None)
            allowed = (
                (torch.float32, torch.float64) if w.dtype == torch.float64 else (torch.float32,)
            )
            if not isinstance(mg, torch.Tensor):
                raise RuntimeError(
                    f"fuse_wgrad_accumulation=True but {name} has no main_grad tensor "
                    f"(got {type(mg).__name__}); attach an fp32 tensor of shape {tuple(w.shape)}"
                )
            if mg.shape != w.shape:
                raise RuntimeError(
                    f"{name}.main_grad has shape {tuple(mg.shape)}, expected {tuple(w.shape)}"
                )
            if mg.dtype not in allowed:
                raise RuntimeError(f"{name}.main_grad has dtype {mg.dtype}, expected torch.float32")
            if mg.device != w.device:
                raise RuntimeError(f"{name}.main_grad is on {mg.device}, expected {w.device}")

    # ---- the queue (§4) -----------------------------------------------------------------

    @property
    def pending_wgrad_count(self) -> int:
        """How many weight-gradient entries wait for :meth:`backward_dw`."""
        return len(self._wgrad_queue)

    def need_backward_dw(self) -> bool:
        """``True`` iff this module defers weight gradients (``delay_wgrad_compute=True``)."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, fn: Callable[[], None]) -> None:
        """Register ``fn()``, called after each entry's gradients are written (in order)."""
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        self._wgrad_hooks.append(fn)

    def backward_dw(self) -> None:
        """Run the oldest queued weight-gradient entry (FIFO). See the module docstring."""
        if not self.delay_wgrad_compute:
            return
        if not self._wgrad_queue:
            raise RuntimeError(
                f"{type(self).__name__}.backward_dw(): nothing is pending (pending_wgrad_count=0); "
                "call it once per backward() of this module"
            )
        entry = self._wgrad_queue[0]
        writes = self._compute(entry)  # raises -> entry stays at the head, nothing written
        self._wgrad_queue.popleft()
        del entry
        self._write(writes)
        del writes
        self._run_hooks()

    def _submit_wgrad(self, entry: WgradEntry) -> None:
        """Called from the autograd backward: queue the entry, or run it now."""
        if self.delay_wgrad_compute:
            self._wgrad_queue.append(entry)
            return
        writes = self._compute(entry)
        self._write(writes)
        self._run_hooks()

    @staticmethod
    def _compute(entry: WgradEntry) -> list[tuple[GradWrite, bool]]:
        with torch.no_grad():
            return [(w, entry.overwrite_main_grad) for w in entry.wgrad_closure()]

    @staticmethod
    def _write(writes: list[tuple[GradWrite, bool]]) -> None:
        with torch.no_grad():
            for w, overwrite in writes:
                p = w.param
                if w.to_main_grad:
                    if overwrite:
                        p.main_grad.copy_(w.value)
                    else:
                        p.main_grad.add_(w.value)
                    if hasattr(p, "grad_added_to_main_grad"):
                        p.grad_added_to_main_grad = True
                elif p.grad is None:
                    p.grad = w.value
                else:
                    p.grad += w.value

    def _run_hooks(self) -> None:
        for hook in list(self._wgrad_hooks):
            hook()

    # ---- helpers for subclasses -----------------------------------------------------------

    def _weight_write(
        self,
        param: torch.nn.Parameter,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> GradWrite:
        """The gradient of one GEMM weight: ``dy^T x`` in the parameter dtype (plain), or with
        both operands upcast to ``main_grad``'s dtype (fused). Under FP8 the GEMM runs on the
        quantized column-wise copies that ``fp8`` holds (dy and x are then unused)."""
        fused = self.fuse_wgrad_accumulation
        if fp8 is not None:
            out_dtype = param.main_grad.dtype if fused else param.dtype
            return GradWrite(param, fp8.wgrad(out_dtype), fused)
        if fused:
            return GradWrite(param, F.linear_wgrad_fp32(dy, x, param.main_grad.dtype), True)
        return GradWrite(param, F.linear_wgrad(dy, x), False)

    def _returned_weight_grad(
        self,
        param: torch.nn.Parameter,
        dy: torch.Tensor | None,
        x: torch.Tensor | None,
        fp8: FP8Gemm | None = None,
    ) -> torch.Tensor:
        """``dy^T x`` in the parameter's dtype, for a weight ``torch.autograd.grad`` asked for
        (:data:`RETURN`): the plain-mode formula, never ``main_grad``."""
        if fp8 is not None:
            return fp8.wgrad(param.dtype)
        return F.linear_wgrad(dy, x)

    def _bias_write(self, param: torch.nn.Parameter, dy: torch.Tensor) -> GradWrite:
        """The gradient of one GEMM bias, always to ``.grad``."""
        return GradWrite(param, F.bias_grad(dy), False)

    def _begin_wgrad(self, named_weights: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """First step of every wgrad closure (and of every backward): validate ``main_grad``."""
        if self.fuse_wgrad_accumulation:
            self._check_main_grads(named_weights)
