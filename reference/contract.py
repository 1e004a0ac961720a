"""The contract every splitgrad module keeps, written once: constructor options and their
validation, parameter names, shapes and initial values, input validation, where the running
backward wants each gradient, and the error messages of SPEC §4–§5.

This is API, not math (STYLE.md): ``splitgrad.impl`` builds its modules on these classes and
imports these functions, so the two packages cannot drift apart on names, options or messages.
The numerics — formulas, rounding points, quantizers, the queue's implementation — are never
shared. The harness checks this contract on its own (P9, P10), so sharing it hides nothing.

Options (SPEC §2), keyword-only, every module: ``bias=True``, ``params_dtype=None`` (a
floating-point dtype; ``None``: ``torch.get_default_dtype()``), ``device=None`` (``None``:
torch's current default device, so ``with torch.device("meta"):`` and
``torch.set_default_device`` decide), ``fuse_wgrad_accumulation=False``,
``delay_wgrad_compute=False``; ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` also take
``ub_bulk_wgrad=False``, and ``ub_bulk_wgrad=True`` with ``delay_wgrad_compute=True`` raises
``ValueError`` ("ub_bulk_wgrad is not supported when enabling delay_wgrad_compute"; an exception,
so it holds under ``python -O``). The norm modules take ``eps=1e-5``,
``normalization="LayerNorm" | "RMSNorm"`` and ``zero_centered_gamma=False``; ``LayerNormMLP``
takes ``activation`` in :data:`ACTIVATIONS`.

Parameters, in registration order (so ``named_parameters()`` and state dicts match):

* ``layer_norm_weight`` (features; ones, or zeros when ``zero_centered_gamma`` stores
  ``gamma - 1``) and ``layer_norm_bias`` (zeros; LayerNorm only, ``None`` for RMSNorm);
* GEMM weights ``(out_features, in_features)`` drawn from N(0, 0.023²) (TransformerEngine's
  documented default ``init_method``) — ``weight``,
  ``fc1_weight`` / ``fc2_weight``, ``weight0`` … ``weight{n-1}`` — each followed by, or (for
  ``GroupedLinear``) after all weights, its zero bias (``None`` with ``bias=False``).
  ``LayerNormMLP``'s ``fc1_weight`` is ``(2 * ffn, hidden)`` for the gated activations.
* Under ``delay_wgrad_compute`` every GEMM parameter carries ``skip_backward_post_hook = True``.
* The constructor creates them on the module's device, then calls ``reset_parameters()``, which
  gives these values (GEMM weights drawn in registration order), so a module built under
  ``with torch.device("meta"):``, materialized with ``to_empty(device=...)`` and reset under
  the same seed is bitwise one built eagerly.

Bad input (§5) raises before anything is written or queued:

* ``inp`` not a tensor, or of the wrong dtype (it must be ``params_dtype``) -> ``TypeError``;
  wrong last dimension or device -> ``ValueError``. Each message names expected and actual.
* ``m_splits`` of the wrong length, with negative or non-int entries, or not summing to the row
  count -> ``ValueError`` naming the values.
* A missing or unusable ``main_grad`` under fused accumulation -> ``RuntimeError`` naming the
  parameter, at the start of ``backward()`` (nothing written, nothing queued) and again at the
  start of the queued wgrad (the entry then stays queued).
* Non-positive sizes, ``num_gemms < 1``, unknown ``normalization`` or ``activation`` ->
  ``ValueError`` from the constructor. Under FP8, a shape the recipe cannot quantize ->
  ``ValueError`` naming the recipe, the dimension and the multiple it needs
  (:func:`check_fp8_gemm_shape`).
* ``backward_dw()`` with nothing pending on a delayed module -> ``RuntimeError`` saying so.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import sys
from collections.abc import Callable, Sequence

import torch

from ._fsdp_guard import check_not_under_fsdp
from ._torch_private import (
    TorchMoved,
    active_ddp_module,
    ddp_parameters,
    functorch_active,
    will_engine_execute_node,
)
from .accumulate import check_no_tensor_hooks
from .fp8 import MX_BLOCK, TILE, Float8BlockScaling, MXFP8BlockScaling, Recipe, fp8_active_recipe
from .parallel import divide, mark_parallel_parameter, resolve_tensor_parallel, serial_number

__all__ = [
    "ACCUMULATE",
    "RETURN",
    "LEAF_NODE",
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "NORMALIZATIONS",
    "gradient_destination",
    "gradient_destinations",
    "node_destination",
    "check_positive",
    "check_flag",
    "qualified_name",
    "check_not_under_ddp",
    "check_fp8_gemm_shape",
    "is_dtensor",
    "AUTOCAST_DTYPES",
    "autocast_off",
    "without_autocast",
    "ModuleContract",
    "LinearContract",
    "LayerNormLinearContract",
    "LayerNormMLPContract",
    "GroupedLinearContract",
]

NORMALIZATIONS = ("LayerNorm", "RMSNorm")
#: ``"gelu"`` is the tanh approximation; the gated ones split fc1's output in two halves.
ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
GATED_ACTIVATIONS = frozenset({"swiglu", "geglu"})

# ---- torch.autocast (SPEC §2) ----------------------------------------------------------------

#: The ``torch.autocast`` dtypes the modules follow: their GEMMs run in it.
AUTOCAST_DTYPES = (torch.bfloat16, torch.float16)


def _autocast_on(device_type: str) -> bool:
    """Whether ``torch.autocast`` is enabled for ``device_type`` (the meta device, where a model
    is built before it is materialized, has no autocast)."""
    return device_type != "meta" and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context where ``torch.autocast`` for ``device_type`` is off (nothing when it already
    is). A module casts its operands itself (:meth:`ModuleContract.autocast_dtype`) and runs its
    forward, backward and ``backward_dw()`` inside this, so an fp32 accumulation stays fp32 and
    the result does not depend on whether the caller's ``backward()`` or ``backward_dw()`` runs
    under autocast (delayed ≡ non-delayed)."""
    if _autocast_on(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def without_autocast(backward: Callable) -> Callable:
    """Decorate an autograd Function's ``backward(ctx, *grads)`` to run it with
    ``torch.autocast`` off (:func:`autocast_off`), eagerly; a traced backward
    (``torch.compile``) runs as it is."""

    @functools.wraps(backward)
    def run(ctx, *grads):
        if torch.compiler.is_compiling():
            return backward(ctx, *grads)
        g = next((t for t in grads if isinstance(t, torch.Tensor)), None)
        with autocast_off(g.device.type if g is not None else "cpu"):
            return backward(ctx, *grads)

    return run


# ---- where the running backward wants a gradient (SPEC §3) ---------------------------------

#: The running backward accumulates this parameter's gradient (``.grad`` / ``main_grad``).
ACCUMULATE = "accumulate"
#: ``torch.autograd.grad`` asked for this input: its gradient is returned, nothing is written.
RETURN = "return"


def node_destination(node: torch.autograd.graph.Node | None) -> str | None:
    """Where the running backward sends what reaches ``node``, the autograd node a parameter's
    gradient goes to (a leaf's ``AccumulateGrad``; ``None`` for a parameter that needs none):
    :data:`ACCUMULATE`, :data:`RETURN`, or ``None`` when this backward does not compute it.

    ``requires_grad`` only says a parameter is trainable; what *this* backward computes is the
    engine's execution plan, ``torch._C._will_engine_execute_node``: false for a node that
    ``backward(inputs=[...])`` or ``torch.autograd.grad`` leaves out. Asked about a leaf that
    ``torch.autograd.grad`` *captures* (returns instead of accumulating), the engine raises:
    that is :data:`RETURN`. A non-leaf (a parameter seen through a parametrization) passes its
    gradient on through the graph, so it is returned too.
    """
    if node is None:
        return None
    try:
        executes = will_engine_execute_node(node)
    except TorchMoved:
        raise
    except RuntimeError:
        return RETURN  # a leaf captured by torch.autograd.grad()
    if not executes:
        return None
    return ACCUMULATE if type(node) is LEAF_NODE else RETURN


#: The type of a leaf's autograd node (``torch._C._functions.AccumulateGrad``), read from a leaf
#: so that a renamed class path cannot break it.
LEAF_NODE = type(torch.zeros(1, requires_grad=True).expand(1).grad_fn.next_functions[0][0])


def gradient_destination(param: torch.Tensor | None) -> str | None:
    """:func:`node_destination` of ``param``'s gradient edge
    (``torch.autograd.graph.get_gradient_edge``). Call it inside a backward."""
    if param is None or not param.requires_grad:
        return None
    return node_destination(torch.autograd.graph.get_gradient_edge(param).node)


def gradient_destinations(*params: torch.Tensor | None) -> list[str | None]:
    """:func:`gradient_destination` of each of ``params``."""
    return [gradient_destination(p) for p in params]


def qualified_name(module: torch.nn.Module) -> str:
    """``"splitgrad.reference.Linear"``: the package and class, for messages."""
    return f"{type(module).__module__.rsplit('.', 1)[0]}.{type(module).__name__}"


# ---- validation -----------------------------------------------------------------------------


def check_flag(name: str, value: object) -> bool:
    """``value`` as a bool, or ``TypeError`` naming the option: ``None``, a string or another
    number passed for an on/off option would otherwise silently mean something. Python's and
    numpy's bools and the ints 0 and 1 are taken."""
    is_bool = type(value).__name__ in ("bool", "bool_")
    if not is_bool and not (type(value) is int and value in (0, 1)):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _check_choice(name: str, value: object, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_fp8_gemm_shape(recipe: Recipe, gemm: str, tokens: int, k: int, m: int) -> None:
    """Raise ``ValueError`` if ``recipe`` cannot quantize the operands of a (tokens, k) x (m, k)
    GEMM, naming the recipe, the dimension and the multiple it needs: MXFP8 scales blocks of 32
    values and Float8BlockScaling tiles of 128 along each GEMM's reduction axis, and every one
    of the three dimensions is the reduction axis of one of the three GEMMs."""
    if isinstance(recipe, MXFP8BlockScaling):
        multiple = MX_BLOCK
    elif isinstance(recipe, Float8BlockScaling):
        multiple = TILE
    else:
        return  # per-tensor scales quantize any shape
    prefix = f"{gemm}." if gemm else ""
    for name, size in (("in_features", k), ("out_features", m), ("tokens", tokens)):
        if size % multiple:
            raise ValueError(
                f"{type(recipe).__name__} cannot quantize {prefix}{name}={size}: it must be a "
                f"multiple of {multiple}"
            )


def check_not_under_ddp(module: ModuleContract) -> None:
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
    ddp = active_ddp_module()
    if ddp is None:
        return
    reduced = {id(p) for p in ddp_parameters(ddp)}
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


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor`` (imports nothing: none
    exists unless that module was loaded)."""
    loaded = sys.modules.get("torch.distributed.tensor")
    return loaded is not None and isinstance(tensor, loaded.DTensor)


# ---- the module contract --------------------------------------------------------------------


class ModuleContract(torch.nn.Module):
    """Options, parameters, validation and hook registration of every splitgrad module.

    The reference's and impl's ``SplitBackwardModule`` add the queue and the gradient routing on
    top; the four module contracts below add each module's constructor. A module class is
    ``class Linear(LinearContract, SplitBackwardModule)``: the contract first, so its
    ``__init__`` (the public signature) runs and hands the options on.
    """

    def __init__(
        self,
        *,
        bias: bool,
        params_dtype: torch.dtype | None,
        device: torch.device | str | None,
        fuse_wgrad_accumulation: bool,
        delay_wgrad_compute: bool,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        if params_dtype is None:  # as torch.nn layers: torch.set_default_dtype decides
            params_dtype = torch.get_default_dtype()
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
        self.use_bias = check_flag("bias", bias)
        # None: torch's current default device (``with torch.device("meta"):``,
        # torch.set_default_device), which a factory call given device=None follows.
        self._device = None if device is None else torch.device(device)
        self.params_dtype = params_dtype
        self.fuse_wgrad_accumulation = check_flag(
            "fuse_wgrad_accumulation", fuse_wgrad_accumulation
        )
        self.delay_wgrad_compute = check_flag("delay_wgrad_compute", delay_wgrad_compute)
        # Userbuffers bulk overlap is a multi-GPU communication optimisation; in one process it
        # changes no value, so it is accepted and otherwise ignored.
        self.ub_bulk_wgrad = check_flag("ub_bulk_wgrad", ub_bulk_wgrad)
        self._gemm_weight_names: list[str] = []
        self._gemm_bias_names: list[str] = []
        # Tensor parallelism (SPEC §9, :mod:`.parallel`): off until a constructor sets it.
        self.tp_group, self.tp_size, self.parallel_mode = None, 1, None
        self.sequence_parallel, self.wgrad_gather, self._tp = False, "backward", None
        # name -> (partition_dim or None, sequence_parallel): the attributes of §9.
        self._parallel_marks: dict[str, tuple[int | None, bool]] = {}
        # FP8 delayed-scaling state (amax histories and scales) of this module, by tensor role
        # ("input", "fc1.grad_output", ...).
        self.fp8_states: dict = {}
        self._wgrad_hooks: list[Callable[[], None]] = []

    # ---- parameters ---------------------------------------------------------------------

    def gemm_weight_names(self) -> list[str]:
        """Names of the GEMM weights (the parameters that use ``main_grad`` when fused)."""
        return list(self._gemm_weight_names)

    def gemm_bias_names(self) -> list[str]:
        """Names of the GEMM biases (empty when built with ``bias=False``)."""
        return list(self._gemm_bias_names)

    def _new_tensor(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, dtype=self.params_dtype, device=self._device)

    def _add_gemm_weight(self, name: str, value: torch.Tensor) -> None:
        """Register ``value`` (out, in, uninitialised) as a GEMM weight."""
        self._add_gemm_parameter(name, value)
        self._gemm_weight_names.append(name)

    def _add_gemm_bias(self, name: str, out_features: int) -> None:
        """Register a GEMM bias (out,), or ``None`` when built with ``bias=False``."""
        if not self.use_bias:
            self.register_parameter(name, None)
            return
        self._add_gemm_parameter(name, self._new_tensor(out_features))
        self._gemm_bias_names.append(name)

    def _add_gemm_parameter(self, name: str, value: torch.Tensor) -> None:
        param = torch.nn.Parameter(value)
        if self.delay_wgrad_compute:
            # A DDP wrapper reads this to reduce from the module hooks instead of autograd's.
            param.skip_backward_post_hook = True
        self.register_parameter(name, param)

    def _add_sharded_linear(self, in_features: int, out_features: int) -> None:
        """``weight`` and ``bias`` of a ``Linear`` / ``LayerNormLinear`` with global sizes
        ``in_features``, ``out_features``: the rank's rows (column) or columns (row) of them,
        with their §9 attributes; ``in_features`` / ``out_features`` become the rank's sizes."""
        mode, tp = self.parallel_mode, self.tp_size
        if mode == "column":
            out_features = divide("out_features", out_features, tp)
        elif mode == "row":
            in_features = divide("in_features", in_features, tp)
        self.in_features, self.out_features = in_features, out_features
        self._add_gemm_weight("weight", self._new_tensor(out_features, in_features))
        self._add_gemm_bias("bias", out_features)
        if mode == "column":
            self._mark_parallel("weight", 0)
            self._mark_parallel("bias", 0)
        elif mode == "row":
            self._mark_parallel("weight", 1)
            self._mark_parallel("bias", None, sp=True)

    def _add_norm_parameters(self, features: int) -> None:
        """``layer_norm_weight`` (gamma, or ``gamma - 1`` when zero-centred) and, for LayerNorm,
        ``layer_norm_bias``."""
        self.layer_norm_weight = torch.nn.Parameter(self._new_tensor(features))
        if self.normalization == "LayerNorm":
            self.layer_norm_bias = torch.nn.Parameter(self._new_tensor(features))
        else:
            self.register_parameter("layer_norm_bias", None)

    def _set_tensor_parallel(
        self,
        *,
        tp_group: object,
        tp_size: object,
        parallel_mode: object,
        sequence_parallel: object,
        wgrad_gather: object,
        communicates: bool = True,
    ) -> None:
        """Validate and keep the TP options (SPEC §9, :func:`.parallel.resolve_tensor_parallel`),
        before any parameter is created."""
        self.tp_size, self.parallel_mode, self.sequence_parallel, self._tp = (
            resolve_tensor_parallel(
                tp_group=tp_group,
                tp_size=tp_size,
                parallel_mode=parallel_mode,
                sequence_parallel=sequence_parallel,
                wgrad_gather=wgrad_gather,
                communicates=communicates,
            )
        )
        self.tp_group, self.wgrad_gather = tp_group, wgrad_gather
        if self._tp is not None:
            # Names this module across ranks, to check that they gather in the same order.
            self._tp_serial, self._w_gathers = serial_number(tp_group), 0

    def _mark_parallel(self, name: str, partition_dim: int | None, sp: bool = False) -> None:
        """Give parameter ``name`` Megatron's TP attributes (:func:`.parallel.
        mark_parallel_parameter`), now and after every ``_apply`` that replaces it."""
        if partition_dim is None and not (sp and self.sequence_parallel):
            return
        self._parallel_marks[name] = (partition_dim, sp and self.sequence_parallel)
        param = self._own_parameter(name)
        if param is not None:
            mark_parallel_parameter(param, *self._parallel_marks[name])

    def register_parameter(self, name: str, param: torch.nn.Parameter | None) -> None:
        # torch's parallelize_module (DTensor TP styles) registers new Parameter objects in
        # place of the module's: they carry what the module's own carried (SPEC §4, §9).
        if param is not None and getattr(self, "_tp", None) is not None and is_dtensor(param):
            raise ValueError(
                f"{type(self).__name__} built with tp_group / parallel_mode={self.parallel_mode!r} "
                f"communicates itself; a DTensor {name} (torch's parallelize_module) would shard "
                "it twice: use one of the two"
            )
        super().register_parameter(name, param)
        if param is None or "_parallel_marks" not in self.__dict__:
            return  # the constructor marks the parameters it creates
        if self.delay_wgrad_compute and name in self._gemm_weight_names + self._gemm_bias_names:
            param.skip_backward_post_hook = True
        if name in self._parallel_marks:
            mark_parallel_parameter(param, *self._parallel_marks[name])

    def _apply(self, fn, recurse=True):
        # A conversion that creates new Parameter objects (to_empty from meta, a device move
        # torch cannot do in place) drops their attributes: mark them again.
        out = super()._apply(fn, recurse)
        if self.delay_wgrad_compute:
            for name in self._gemm_weight_names + self._gemm_bias_names:
                self._own_parameter(name).skip_backward_post_hook = True
        for name, marks in self._parallel_marks.items():
            param = self._own_parameter(name)
            if param is not None:
                mark_parallel_parameter(param, *marks)
        return out

    def _own_parameter(self, name: str) -> torch.Tensor | None:
        """Parameter ``name`` itself, or its original when it is parametrized."""
        if name in self._parameters:
            return self._parameters[name]
        return self.parametrizations[name].original

    def reset_parameters(self) -> None:
        """Give every parameter its initial value, as the constructor does (it calls this): the
        GEMM weights drawn from N(0, 0.023²) in registration order, GEMM biases and
        ``layer_norm_bias`` zero, ``layer_norm_weight`` one (zero when ``zero_centered_gamma``
        stores ``gamma - 1``); FP8 scaling state starts afresh. Under the same seed, a module
        built on the meta device, materialized with ``to_empty(device=...)`` and reset is
        bitwise one built eagerly (SPEC §2). Refused (``RuntimeError``) while weight-gradient
        entries are queued: they would write into re-initialised weights."""
        pending = getattr(self, "pending_wgrad_count", 0)
        if pending:
            raise RuntimeError(
                f"{type(self).__name__}.reset_parameters() with {pending} weight-gradient "
                "entries queued: they would write gradients of the old weights into the new "
                "ones; run backward_dw() for each (or discard the module) first"
            )
        with torch.no_grad():
            for name in self._gemm_weight_names:
                torch.nn.init.normal_(self._own_parameter(name), std=0.023)
            for name in self._gemm_bias_names:
                self._own_parameter(name).zero_()
            if hasattr(self, "normalization"):
                gamma = self._own_parameter("layer_norm_weight")
                gamma.fill_(0.0 if self.zero_centered_gamma else 1.0)
                if self.normalization == "LayerNorm":
                    self._own_parameter("layer_norm_bias").zero_()
        self.fp8_states.clear()

    def extra_repr(self) -> str:
        """Sizes, ``bias``, and every option that differs from its default, in ``torch.nn``'s
        style: ``in_features=16, out_features=24, bias=True, delay_wgrad_compute=True``."""
        parts = [f"{name}={getattr(self, name)}" for name in self._size_names]
        parts.append(f"bias={self.use_bias}")
        if self.params_dtype != torch.get_default_dtype():
            parts.append(f"params_dtype={self.params_dtype}")
        for name, default in self._option_defaults:
            value = getattr(self, name, default)
            if value != default:
                parts.append(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")
        return ", ".join(parts)

    #: The positional sizes, by attribute name (each module class sets its own).
    _size_names: tuple[str, ...] = ()
    #: Every parameter the module may have, in registration order (``None`` ones included:
    #: no bias, RMSNorm); ``GroupedLinear``'s depend on ``num_gemms``.
    _parameter_names: tuple[str, ...] = ()
    #: Keyword options shown by :meth:`extra_repr` when they differ from these defaults.
    _option_defaults: tuple[tuple[str, object], ...] = (
        ("eps", 1e-5),
        ("normalization", "LayerNorm"),
        ("zero_centered_gamma", False),
        ("activation", "gelu"),
        ("fuse_wgrad_accumulation", False),
        ("delay_wgrad_compute", False),
        ("ub_bulk_wgrad", False),
        ("tp_size", 1),
        ("parallel_mode", None),
        ("set_parallel_mode", False),
        ("sequence_parallel", False),
        ("wgrad_gather", "backward"),
    )

    # ---- validation (§5) ----------------------------------------------------------------

    def _first_parameter(self) -> torch.Tensor:
        """The first registered parameter; a parametrized one's original when the module's own
        are all parametrized (``torch.nn.utils.parametrize`` moves them to a submodule)."""
        for p in self._parameters.values():
            if p is not None:
                return p
        return next(self.parameters())

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the module computes in and expects inputs in: its parameters' current
        dtype (SPEC §2: ``params_dtype`` only sets how they are created; ``module.to(dtype)``,
        ``.bfloat16()``, ``.double()`` move it)."""
        p = next(iter(self._parameters.values()), None)
        return (p if p is not None else self._first_parameter()).dtype

    @property
    def fp8_device(self) -> torch.device:
        """The module's device: where its parameters are (the first one registered)."""
        p = next(iter(self._parameters.values()), None)
        return (p if p is not None else self._first_parameter()).device

    #: Where the module's first operation reads its input under ``torch.autocast``: a GEMM
    #: (the autocast dtype) or a norm (``"norm"``: float32, the module's own compute dtype).
    _autocast_entry = "gemm"

    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype this module's GEMMs run in under an enabled ``torch.autocast`` for its
        device (SPEC §2), or ``None`` (no autocast; a float64 module, which torch.autocast
        leaves alone as it does float64 tensors). Raises ``TypeError`` naming an autocast dtype
        other than :data:`AUTOCAST_DTYPES`."""
        device_type = self.fp8_device.type
        if not _autocast_on(device_type) or self.compute_dtype == torch.float64:
            return None
        dtype = torch.get_autocast_dtype(device_type)
        if dtype not in AUTOCAST_DTYPES:
            raise TypeError(
                f"torch.autocast dtype {dtype} is not supported by splitgrad modules (GEMMs run "
                f"in one of {AUTOCAST_DTYPES}); got it for device type {device_type!r}"
            )
        return dtype

    def _check_input(self, inp: object, in_features: int) -> tuple[torch.Tensor, Recipe | None]:
        """Validate ``inp``; return it flattened to (rows, in_features) and the active FP8
        recipe (``None`` outside an enabled ``fp8_autocast``). Under ``torch.autocast``
        (:meth:`autocast_dtype`) ``inp`` may also come in the autocast dtype (or float32) and is
        returned cast to where the module's first operation reads it: the autocast dtype for a
        GEMM, the parameters' dtype for a norm (an autograd cast: its gradient comes back in
        ``inp``'s dtype)."""
        if not isinstance(inp, torch.Tensor):
            raise TypeError(f"inp must be a torch.Tensor, got {type(inp).__name__}")
        shape = inp.shape
        if not shape or shape[-1] != in_features:
            raise ValueError(
                f"inp's last dimension must be in_features={in_features}, got shape {tuple(shape)}"
            )
        dtype = self.compute_dtype
        autocast = self.autocast_dtype()
        if autocast is not None:
            allowed = {dtype, autocast, torch.float32}
            if inp.dtype not in allowed:
                raise TypeError(
                    f"inp must have dtype {dtype} (the module's parameters' dtype), {autocast} "
                    f"(the torch.autocast dtype) or torch.float32, got {inp.dtype}"
                )
            entry = dtype if self._autocast_entry == "norm" else autocast
            if inp.dtype != entry:
                inp = inp.to(entry)
        elif inp.dtype != dtype:
            raise TypeError(
                f"inp must have dtype {dtype} (the module's parameters' dtype), got {inp.dtype}"
            )
        device = self.fp8_device
        if inp.device != device:
            raise ValueError(f"inp must be on the module's device {device}, got {inp.device}")
        if self.delay_wgrad_compute or self.fuse_wgrad_accumulation:
            check_not_under_ddp(self)
            check_not_under_fsdp(self)
        return (inp if len(shape) == 2 else inp.reshape(-1, in_features)), fp8_active_recipe()

    def _check_main_grads(self, named_weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Fused accumulation needs, on each weight the module writes, a usable ``main_grad``
        (float32, or float64 for float64 parameters; same shape and device) and no tensor hook
        (:func:`.accumulate.check_no_tensor_hooks`); raise before anything is written.
        ``named_weights``: (parameter name, the leaf tensor the forward used)."""
        if not self.fuse_wgrad_accumulation:
            return
        kind = type(self).__name__
        for name, w in named_weights:
            where = f"{kind}.{name}"
            mg = getattr(w, "main_grad", None)
            if not isinstance(mg, torch.Tensor):
                raise RuntimeError(
                    f"fuse_wgrad_accumulation=True but {where} has no main_grad tensor "
                    f"(got {type(mg).__name__}); attach an fp32 tensor of shape {tuple(w.shape)}"
                )
            if mg.shape != w.shape:
                raise RuntimeError(
                    f"{where}.main_grad has shape {tuple(mg.shape)}, expected {tuple(w.shape)}"
                )
            wide = w.dtype == torch.float64
            allowed = (torch.float32, torch.float64) if wide else (torch.float32,)
            if mg.dtype not in allowed:
                raise RuntimeError(
                    f"{where}.main_grad has dtype {mg.dtype}, expected torch.float32"
                )
            if mg.device != w.device:
                raise RuntimeError(f"{where}.main_grad is on {mg.device}, expected {w.device}")
            check_no_tensor_hooks(w, where)

    def _check_forward_params(
        self, recipe: object, weights: Sequence[tuple[str, torch.Tensor | None]]
    ) -> None:
        """Called by the forward, before anything runs: FP8 does not run under ``torch.func``
        transforms, and under fused accumulation a weight that is not a leaf has no
        ``main_grad`` its gradient could go to. Neither runs on DTensor weights (torch's
        tensor-parallel styles): FP8 would take amaxes and scales of the global tensor, and
        ``main_grad`` would have to be a DTensor of the same layout."""
        if (recipe is not None or self.fuse_wgrad_accumulation) and any(
            is_dtensor(w) for _, w in weights
        ):
            what = "an FP8 recipe" if recipe is not None else "fuse_wgrad_accumulation=True"
            raise RuntimeError(
                f"{qualified_name(self)} with {what} does not run on DTensor weights (torch's "
                "parallelize_module): use it without, or build the module with tp_group and "
                "parallel_mode instead of a DTensor plan (SPEC §9)"
            )
        if recipe is not None and functorch_active():
            raise RuntimeError(
                f"{qualified_name(self)} under FP8 does not support torch.func transforms "
                "(grad, vjp, jacrev, vmap): its FP8 scaling state is updated in place"
            )
        if not self.fuse_wgrad_accumulation:
            return
        for name, w in weights:
            if w is not None and w.requires_grad and w.grad_fn is not None:
                raise RuntimeError(
                    f"{type(self).__name__}.{name} is not a leaf tensor (parametrized, or "
                    "computed from another tensor), but fuse_wgrad_accumulation=True "
                    "accumulates a weight's gradient into the main_grad of the leaf itself. "
                    "Build the module with fuse_wgrad_accumulation=False to let autograd take "
                    "the gradient through the parametrization"
                )

    def _nothing_pending(self) -> RuntimeError:
        """The error of ``backward_dw()`` on a delayed module with an empty queue (§4)."""
        return RuntimeError(
            f"{type(self).__name__}.backward_dw(): nothing is pending (pending_wgrad_count=0); "
            "call it once per backward() of this module"
        )

    # ---- split backward API (§4) ----------------------------------------------------------

    def need_backward_dw(self) -> bool:
        """``True`` iff this module defers weight gradients (``delay_wgrad_compute=True``)."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, fn: Callable[[], None]) -> None:
        """Register ``fn()``, called with no arguments after each entry's gradients are written,
        in registration order."""
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        self._wgrad_hooks.append(fn)

    def _run_hooks(self) -> None:
        if self._wgrad_hooks:
            for hook in list(self._wgrad_hooks):  # a hook may register another
                hook()


class _TorchLinear(torch.nn.Linear):
    """``torch.nn.Linear`` as a base whose ``__init__`` creates nothing: the contract creates
    the parameters (``ModuleContract.__init__``'s ``super().__init__()`` lands here)."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)


class LinearContract(ModuleContract, _TorchLinear):
    """``Linear(in_features, out_features, *, bias=True, params_dtype=None,
    device=None, fuse_wgrad_accumulation=False, delay_wgrad_compute=False,
    ub_bulk_wgrad=False)``: parameters ``weight`` (out_features, in_features) and ``bias``
    (out_features). A ``torch.nn.Linear`` subclass (as torchao's ``Float8Linear``), so that
    torch's DTensor tensor-parallel styles, which check for one, accept it (SPEC §9)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
        tp_group: object = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        wgrad_gather: str = "backward",
    ) -> None:
        check_positive("in_features", in_features)
        check_positive("out_features", out_features)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        self._set_tensor_parallel(
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
            wgrad_gather=wgrad_gather,
        )
        self._add_sharded_linear(in_features, out_features)
        self.reset_parameters()

    _size_names = ("in_features", "out_features")
    _parameter_names = ("weight", "bias")

    def _check_fp8_shapes(self, recipe: Recipe, rows: int) -> None:
        check_fp8_gemm_shape(recipe, "", rows, self.in_features, self.out_features)


class _NormContract(ModuleContract):
    """The norm options shared by ``LayerNormLinear`` and ``LayerNormMLP``."""

    _autocast_entry = "norm"

    def _set_norm_options(
        self, features: int, eps: float, normalization: str, zero_centered_gamma: bool
    ) -> None:
        self.eps, self.normalization = float(eps), normalization
        self.zero_centered_gamma = check_flag("zero_centered_gamma", zero_centered_gamma)
        self._add_norm_parameters(features)
        # Under SP the norm runs on the rank's tokens: its gradients are partial sums.
        self._mark_parallel("layer_norm_weight", None, sp=True)
        self._mark_parallel("layer_norm_bias", None, sp=True)


class LayerNormLinearContract(_NormContract):
    """``LayerNormLinear(in_features, out_features, *, eps=1e-5, normalization="LayerNorm",
    zero_centered_gamma=False, bias=True, params_dtype=None, device=None,
    fuse_wgrad_accumulation=False, delay_wgrad_compute=False, ub_bulk_wgrad=False)``:
    parameters ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm only), ``weight``
    (out_features, in_features), ``bias`` (out_features)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
        tp_group: object = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        wgrad_gather: str = "backward",
    ) -> None:
        check_positive("in_features", in_features)
        check_positive("out_features", out_features)
        _check_choice("normalization", normalization, NORMALIZATIONS)
        if parallel_mode == "row":
            raise ValueError(
                "LayerNormLinear does not take parallel_mode='row': its norm needs every feature "
                "of a token, and a row-parallel layer's input holds a slice of them; use "
                "parallel_mode='column', or a norm followed by Linear(parallel_mode='row')"
            )
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        self._set_tensor_parallel(
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode=parallel_mode,
            sequence_parallel=sequence_parallel,
            wgrad_gather=wgrad_gather,
        )
        self._set_norm_options(in_features, eps, normalization, zero_centered_gamma)
        self._add_sharded_linear(in_features, out_features)
        self.reset_parameters()

    _size_names = ("in_features", "out_features")
    _parameter_names = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")

    def _check_fp8_shapes(self, recipe: Recipe, rows: int) -> None:
        check_fp8_gemm_shape(recipe, "", rows, self.in_features, self.out_features)


class LayerNormMLPContract(_NormContract):
    """``LayerNormMLP(hidden_size, ffn_hidden_size, *, eps=1e-5, normalization="LayerNorm",
    zero_centered_gamma=False, activation="gelu", bias=True, params_dtype=None,
    device=None, fuse_wgrad_accumulation=False, delay_wgrad_compute=False,
    ub_bulk_wgrad=False)``: parameters ``layer_norm_weight``, ``layer_norm_bias`` (LayerNorm
    only), ``fc1_weight`` (ffn, hidden) — (2 * ffn, hidden) for the gated activations —
    ``fc1_bias``, ``fc2_weight`` (hidden, ffn), ``fc2_bias`` (hidden)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        eps: float = 1e-5,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        activation: str = "gelu",
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
        tp_group: object = None,
        tp_size: int = 1,
        set_parallel_mode: bool = False,
        sequence_parallel: bool = False,
        wgrad_gather: str = "backward",
    ) -> None:
        check_positive("hidden_size", hidden_size)
        check_positive("ffn_hidden_size", ffn_hidden_size)
        _check_choice("normalization", normalization, NORMALIZATIONS)
        _check_choice("activation", activation, ACTIVATIONS)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
            ub_bulk_wgrad=ub_bulk_wgrad,
        )
        self.set_parallel_mode = check_flag("set_parallel_mode", set_parallel_mode)
        self._set_tensor_parallel(
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode="column" if self.set_parallel_mode else None,
            sequence_parallel=sequence_parallel,
            wgrad_gather=wgrad_gather,
        )
        # The fc1 column / fc2 row pair is one parallel mode of its own (shown as
        # set_parallel_mode, not parallel_mode).
        self.parallel_mode = None
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        self.size_per_partition = divide("ffn_hidden_size", ffn_hidden_size, self.tp_size)
        if self.tp_size > 1 and not self.set_parallel_mode:
            raise ValueError(
                f"LayerNormMLP with tp_size={self.tp_size} needs set_parallel_mode=True (fc1 "
                "column-parallel, fc2 row-parallel): without it fc2's output would be a partial "
                "sum that nothing reduces"
            )
        self._set_norm_options(hidden_size, eps, normalization, zero_centered_gamma)
        ffn = self.size_per_partition
        # Gated: the rank's rows of the gate and of the up projection, one after the other.
        fc1_out = 2 * ffn if activation in GATED_ACTIVATIONS else ffn
        self._add_gemm_weight("fc1_weight", self._new_tensor(fc1_out, hidden_size))
        self._add_gemm_bias("fc1_bias", fc1_out)
        self._add_gemm_weight("fc2_weight", self._new_tensor(hidden_size, ffn))
        self._add_gemm_bias("fc2_bias", hidden_size)
        if self.set_parallel_mode:
            self._mark_parallel("fc1_weight", 0)
            self._mark_parallel("fc1_bias", 0)
            self._mark_parallel("fc2_weight", 1)
            self._mark_parallel("fc2_bias", None, sp=True)
        self.reset_parameters()

    _size_names = ("hidden_size", "ffn_hidden_size")
    _parameter_names = (
        "layer_norm_weight",
        "layer_norm_bias",
        "fc1_weight",
        "fc1_bias",
        "fc2_weight",
        "fc2_bias",
    )

    def _check_fp8_shapes(self, recipe: Recipe, rows: int) -> None:
        fc1_out = self.fc1_weight.shape[0]
        check_fp8_gemm_shape(recipe, "fc1", rows, self.hidden_size, fc1_out)
        check_fp8_gemm_shape(recipe, "fc2", rows, self.size_per_partition, self.hidden_size)


class GroupedLinearContract(ModuleContract):
    """``GroupedLinear(num_gemms, in_features, out_features, *, bias=True,
    params_dtype=None, device=None, fuse_wgrad_accumulation=False,
    delay_wgrad_compute=False)``: parameters ``weight0`` … ``weight{n-1}`` (out_features,
    in_features), then ``bias0`` … ``bias{n-1}`` (out_features). Forward takes ``m_splits``:
    ``num_gemms`` non-negative ints summing to the row count (:meth:`_check_m_splits`)."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        tp_group: object = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
    ) -> None:
        check_positive("num_gemms", num_gemms)
        check_positive("in_features", in_features)
        check_positive("out_features", out_features)
        super().__init__(
            bias=bias,
            params_dtype=params_dtype,
            device=device,
            fuse_wgrad_accumulation=fuse_wgrad_accumulation,
            delay_wgrad_compute=delay_wgrad_compute,
        )
        # SPEC §9: shapes only; the MoE dispatch does the communication.
        self._set_tensor_parallel(
            tp_group=tp_group,
            tp_size=tp_size,
            parallel_mode=parallel_mode,
            sequence_parallel=False,
            wgrad_gather="backward",
            communicates=False,
        )
        if self.tp_size > 1 and self.use_bias:
            raise ValueError(
                f"GroupedLinear with tp_size={self.tp_size} takes no bias (got bias=True): a "
                "sharded expert's bias would be added on every rank"
            )
        if self.parallel_mode == "column":
            out_features = divide("out_features", out_features, self.tp_size)
        elif self.parallel_mode == "row":
            in_features = divide("in_features", in_features, self.tp_size)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        for i, w in enumerate(self._group_weight_tensors(num_gemms, out_features, in_features)):
            self._add_gemm_weight(f"weight{i}", w)
        for i in range(num_gemms):
            self._add_gemm_bias(f"bias{i}", out_features)
        if self.parallel_mode is not None:
            for i in range(num_gemms):
                self._mark_parallel(f"weight{i}", 0 if self.parallel_mode == "column" else 1)
        self.reset_parameters()

    _size_names = ("num_gemms", "in_features", "out_features")

    def _group_weight_tensors(self, n: int, out_features: int, in_features: int):
        """The ``n`` uninitialised (out, in) weight tensors; where they live in memory is an
        implementation's choice (impl packs them into one storage)."""
        return [self._new_tensor(out_features, in_features) for _ in range(n)]

    def _check_m_splits(self, m_splits: object, rows: int) -> list[int]:
        """``m_splits`` as a list of ints, or ``ValueError`` naming the values."""
        n = self.num_gemms
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise ValueError(f"m_splits must be a list of {n} ints, got {m_splits!r}")
        try:
            splits = [operator.index(s) for s in m_splits]
        except TypeError:
            raise ValueError(f"m_splits entries must be ints, got {list(m_splits)!r}") from None
        if len(splits) != n:
            raise ValueError(
                f"m_splits must have num_gemms={n} entries, got {len(splits)}: {splits}"
            )
        if any(isinstance(s, bool) for s in m_splits) or min(splits) < 0:
            raise ValueError(f"m_splits entries must be non-negative ints, got {splits}")
        if sum(splits) != rows:
            raise ValueError(f"m_splits {splits} sum to {sum(splits)}, but inp has {rows} rows")
        return splits

    def _check_fp8_shapes(self, recipe: Recipe, splits: list[int]) -> None:
        for i, rows in enumerate(splits):
            check_fp8_gemm_shape(recipe, f"gemm{i}", rows, self.in_features, self.out_features)
