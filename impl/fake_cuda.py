"""impl's CUDA paths run on fake CUDA tensors, without a GPU: the trace tier and the memory table.

torch's fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``) carry sizes, strides,
dtype and a device but no storage, and run each operator's meta function, which for the CUDA
GEMMs repeats the GPU's own argument checks: ``torch._scaled_mm`` refuses a row-major second
operand (``mat2 must be col_major``) or K not a multiple of 16, ``F.scaled_mm`` checks the
block-scale shapes, strides and swizzle, ``torch._grouped_mm`` its 16-byte strides. A value read
on the host (``.item()``, ``bool()``, ``nonzero``) has no data to read and raises.

:func:`fake_cuda` opens such a block on any torch build, with

* the compute capability impl decides by set to ``capability`` and the probes answering from
  it (:func:`.gemm_paths.capability_probes`: no kernel runs);
* grad mode off (the autograd engine cannot run on a CUDA device that does not exist; building
  a graph over fake CUDA tensors aborts a CPU build of torch), so modules are stepped by
  :func:`module_step`, which calls their autograd Functions' ``forward`` and ``backward`` bodies
  itself;
* :class:`CallLog`, which records every GEMM call (op, shapes, strides, dtypes) and raises
  :class:`HostSync` on anything that would make the host wait for the device;
* on a CPU-only build, a shim for the few Python bindings that take a CUDA device guard before
  dispatching (``Tensor.copy_``, ``contiguous``, indexing, ``addmm(out=)``...): they fail with
  "PyTorch is not linked with support for cuda devices" before any kernel or meta function
  runs; the shim sends the same call to the ATen operator (which takes no guard), so the meta
  checks still run. A CUDA build never reaches it.

Everything is restored on exit: modes, grad mode, probe mode and caches, the logger level,
every patched module attribute (``tests/test_cuda_trace.py`` checks that nothing leaks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence

import torch
from splitgrad.reference._torch_private import has_hooks
from splitgrad.reference.contract import ACCUMULATE, RETURN
from torch.overrides import TorchFunctionMode, resolve_name

from . import gemm_paths
from ._torch_compat import (
    dispatch_mode_base,
    fake_tensor_logger,
    fake_tensor_mode,
    op_overload_type,
    out_arguments,
    tree_leaves,
)

__all__ = [
    "CallLog",
    "GemmCall",
    "HostSync",
    "StepResult",
    "fake_cuda",
    "module_step",
    "CAPABILITIES",
]

#: The capabilities the trace tier runs under: Hopper (H100/H200) and Blackwell (B200).
CAPABILITIES = {"sm90": (9, 0), "sm100": (10, 0)}

aten = torch.ops.aten
_NO_CUDA = "not linked with support for cuda devices"
_GEMM_OPS = {
    aten.mm,
    aten.addmm,
    aten.addmm_,
    aten.bmm,
    aten._scaled_mm,
    aten._scaled_mm_v2,
    aten._grouped_mm,
}
# Operators whose result the host must read from the device.
_HOST_READS = {
    aten._local_scalar_dense: ".item() / bool() / float() of a tensor",
    aten.nonzero: "nonzero (output size depends on the data)",
    aten.masked_select: "masked_select (output size depends on the data)",
    aten.equal: "torch.equal (returns a Python bool)",
    aten.is_nonzero: "bool() of a one-element tensor",
}


class HostSync(RuntimeError):
    """A CUDA path asked the host to wait for the device."""


@dataclasses.dataclass(frozen=True)
class GemmCall:
    """One GEMM operator call seen on fake CUDA tensors: ``op`` and, per tensor argument,
    shape, strides and dtype; ``out`` likewise for the result."""

    op: str
    operands: tuple[tuple[tuple[int, ...], tuple[int, ...], str], ...]
    out: tuple[tuple[int, ...], tuple[int, ...], str] | None

    def line(self) -> str:
        def one(t):
            return f"{t[2]}{list(t[0])}/{list(t[1])}"

        out = f" -> {one(self.out)}" if self.out else ""
        return f"{self.op}({', '.join(one(t) for t in self.operands)}){out}"


def _describe(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], str]:
    return tuple(t.shape), tuple(t.stride()), str(t.dtype).replace("torch.", "")


def _is_cuda(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


class CallLog(dispatch_mode_base()):
    """Records the GEMM calls made inside it and raises :class:`HostSync` on a host read of a
    CUDA tensor or a device-to-host copy."""

    def __init__(self) -> None:
        super().__init__()
        self.gemms: list[GemmCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        flat = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if packet in _HOST_READS and any(_is_cuda(t) for t in flat):
            raise HostSync(f"{func} on a CUDA tensor: {_HOST_READS[packet]} makes the host wait")
        out = func(*args, **kwargs)
        if packet in (aten._to_copy, aten.copy_) and isinstance(out, torch.Tensor):
            sources = [t for t in flat if t is not out]
            if out.device.type == "cpu" and any(_is_cuda(t) for t in sources):
                raise HostSync(f"{func}: a device-to-host copy makes the host wait")
        if packet in _GEMM_OPS:
            result = out if isinstance(out, torch.Tensor) else None
            self.gemms.append(
                GemmCall(
                    str(packet).replace("aten.", ""),
                    tuple(_describe(t) for t in flat if t.dim() >= 1),
                    _describe(result) if result is not None else None,
                )
            )
        return out


def _basic_index(t: torch.Tensor, index) -> torch.Tensor:
    """``t[index]`` for ints, slices, ``None`` and one ``...`` through ATen view operators."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        consumed = sum(isinstance(i, (int, slice)) for i in items)
        items[at : at + 1] = [slice(None)] * (t.dim() - consumed)
    out, dim = t, 0
    for item in items:
        if item is None:
            out = aten.unsqueeze.default(out, dim)
            dim += 1
        elif isinstance(item, int):
            out = aten.select.int(out, dim, item)
        elif isinstance(item, slice):
            step = 1 if item.step is None else item.step
            out = aten.slice.Tensor(out, dim, item.start, item.stop, step)
            dim += 1
        else:
            raise TypeError(
                f"the fake-CUDA binding shim indexes with ints, slices, None and ... only, "
                f"got {type(item).__name__} ({item!r})"
            )
    return out


def _setitem(t: torch.Tensor, index, value) -> None:
    view = _basic_index(t, index)
    if isinstance(value, torch.Tensor):
        aten.copy_.default(view, value)
    else:
        aten.fill_.Scalar(view, value)


class _GuardShim(TorchFunctionMode):
    """Re-issues through ATen the Python-binding calls a CPU-only build refuses on a CUDA device
    before dispatching (see the module docstring); every other error propagates unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            if _NO_CUDA not in str(exc):
                raise
            # The text only: keeping the exception would tie its traceback's frames (and their
            # tensors) into a reference cycle that outlives the call.
            failure = str(exc)
        if isinstance(func, op_overload_type()):
            name, packet = str(func), func.overloadpacket
            outs = out_arguments(func)
        else:
            name = resolve_name(func) or getattr(func, "__name__", repr(func))
            short = name.rsplit(".", 1)[-1]
            if short == "__getitem__":
                return _basic_index(*args)
            if short == "__setitem__":
                return _setitem(*args)
            packet = getattr(aten, short, None)
            outs = ["out"] if "out" in kwargs else []
        if packet is None or len(outs) > 1 or any(o not in kwargs for o in outs):
            raise RuntimeError(
                f"{name} on a fake CUDA tensor: the CPU build's binding refuses it and the "
                f"shim cannot re-issue it through ATen ({failure})"
            ) from None
        if outs:
            # The out= variants' fake kernels copy into the output from Python
            # (``out.copy_(result)``), which the same guard refuses: run the functional
            # operator, then copy through ATen.
            out = kwargs.pop(outs[0])
            aten.copy_.default(out, packet(*args, **kwargs))
            return out
        return packet(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda(capability: tuple[int, int] = (9, 0)) -> Iterator[CallLog]:
    """A block where ``device="cuda"`` tensors are fake and impl decides as on a GPU of
    ``capability`` (see the module docstring). Yields the :class:`CallLog`."""
    logger = fake_tensor_logger()
    level = logger.level
    # A refused meta check is logged at ERROR before it is raised; the raise is what we read.
    logger.setLevel(logging.CRITICAL)
    log = CallLog()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(gemm_paths.capability_probes(capability))
            stack.enter_context(torch.no_grad())
            stack.enter_context(fake_tensor_mode(allow_non_fake_inputs=False))
            stack.enter_context(log)
            if not torch.cuda.is_available():
                stack.enter_context(_GuardShim())
            yield log
    finally:
        logger.setLevel(level)


# ---- stepping a module without the autograd engine ------------------------------------------


@dataclasses.dataclass
class StepResult:
    """What :func:`module_step` gives back: the output and the input gradient."""

    y: torch.Tensor
    dx: torch.Tensor | None


class _Ctx:
    """Stands in for autograd's ``ctx``: attributes, saved tensors, ``needs_input_grad``."""

    def __init__(self, args: Sequence[object]) -> None:
        x = args[0]
        self.needs_input_grad = tuple(
            isinstance(a, torch.Tensor) and (a is x or a.requires_grad) for a in args
        )
        self._tensor_inputs = [a for a in args if isinstance(a, torch.Tensor)]
        self.saved_tensors: tuple = ()

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors


def _edge_routes(ctx: _Ctx, present: Sequence[bool]) -> tuple[list, list]:
    """:func:`.base.edge_routes` for a plain ``backward()``: every parameter that requires a
    gradient accumulates into the tensor the forward was given."""
    params = iter(ctx._tensor_inputs[1:])
    dests, leaves = [], []
    for is_tensor in present:
        leaf = next(params) if is_tensor else None
        accumulate = leaf is not None and leaf.requires_grad
        dests.append(ACCUMULATE if accumulate else None)
        leaves.append(leaf if accumulate else None)
    return dests, leaves


def _backward_routes(ctx: _Ctx, module, present: Sequence[bool], returned: int = 0) -> tuple:
    """:func:`.base.backward_routes` for a plain ``backward()``: :func:`_edge_routes`, direct
    unless the real one takes the general way for the module (fused accumulation,
    ``torch.autocast``) or for a hooked leaf; the first ``returned`` parameters (a norm's)
    returned when direct. So the step traces the usual backward: its direct writes."""
    dests, leaves = _edge_routes(ctx, present)
    if module.fuse_wgrad_accumulation or ctx.autocast is not None:
        return dests, leaves, False
    if any(leaf is not None and has_hooks(leaf) for leaf in leaves[returned:]):
        return dests, leaves, False
    for k in range(returned):
        dests[k], leaves[k] = (RETURN if dests[k] is not None else None), None
    return dests, leaves, True


def _routes_in(namespace: object) -> dict:
    """The routing functions ``namespace`` calls, replaced by :func:`_edge_routes` and
    :func:`_backward_routes`."""
    routes = {"edge_routes": _edge_routes}
    if hasattr(namespace, "backward_routes"):
        routes["backward_routes"] = _backward_routes
    return routes


def _tp_function_table() -> dict[str, tuple[type, type]]:
    """The (plain, FP8) Functions of each module that communicates (SPEC §9)."""
    from . import layernorm_linear, layernorm_mlp, linear

    return {
        "Linear": (linear._LinearTPFunction, linear._LinearTPFP8Function),
        "LayerNormLinear": (
            layernorm_linear._LayerNormLinearTPFunction,
            layernorm_linear._LayerNormLinearTPFP8Function,
        ),
        "LayerNormMLP": (
            layernorm_mlp._LayerNormMLPTPFunction,
            layernorm_mlp._LayerNormMLPTPFP8Function,
        ),
    }


def _function_table() -> dict[str, tuple[object, type, type]]:
    from . import grouped_linear, layernorm_linear, layernorm_mlp, linear

    return {
        "Linear": (linear, linear._LinearFunction, linear._LinearFP8Function),
        "LayerNormLinear": (
            layernorm_linear,
            layernorm_linear._LayerNormLinearFunction,
            layernorm_linear._LayerNormLinearFP8Function,
        ),
        "LayerNormMLP": (
            layernorm_mlp,
            layernorm_mlp._LayerNormMLPFunction,
            layernorm_mlp._LayerNormMLPFP8Function,
        ),
        "GroupedLinear": (
            grouped_linear,
            grouped_linear._GroupedLinearFunction,
            grouped_linear._GroupedLinearFP8Function,
        ),
    }


@contextlib.contextmanager
def _patched(namespace: object, **values: object) -> Iterator[None]:
    old = {k: getattr(namespace, k) for k in values}
    for k, v in values.items():
        setattr(namespace, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(namespace, k, v)


def _general_path(module, *args) -> bool:
    """``SplitBackwardModule._plain_call`` inside :func:`module_step`: never the plain path."""
    return False


def module_step(
    module: torch.nn.Module,
    x: torch.Tensor,
    dy: torch.Tensor,
    m_splits: Sequence[int] | None = None,
    recipe: object | None = None,
    is_first_microbatch: bool | None = None,
) -> StepResult:
    """One forward and backward of an impl ``module`` as ``y = module(x); y.backward(dy)``
    would run it, with grad mode off and no autograd engine: the module's own ``forward()``
    (input checks and all) runs, its autograd Function's ``forward`` and ``backward`` bodies are
    called directly, and the backward writes or queues the weight gradients exactly as under
    the engine (every parameter that requires a gradient accumulates). ``recipe``: run under
    ``fp8_autocast`` with it. Works on real tensors too (``tests/test_cuda_trace.py`` checks
    it equals autograd's run bitwise on the CPU). A module that communicates (``module._tp``,
    SPEC §9) runs its tensor-parallel Functions, with their collectives on the process group it
    was built with (torch's fake one, for fake tensors)."""
    from splitgrad.reference.fp8 import fp8_autocast

    kind = type(module).__name__
    namespace, function, fp8_function = _function_table()[kind]
    captured: dict[str, object] = {}

    def capture(fn: type) -> Callable[..., torch.Tensor]:
        def run(*args):
            ctx = _Ctx(args)
            captured["ctx"], captured["fn"], captured["args"] = ctx, fn, args
            return fn.forward(ctx, *args)

        return run

    patch = dict(_apply=capture(function), _fp8_forward=capture(fp8_function))
    if getattr(module, "_tp", None) is not None:
        patch = dict(_TP_APPLY=tuple(capture(f) for f in _tp_function_table()[kind]))
    from . import base

    # Grad mode off, as autograd runs a Function's forward and (without create_graph) backward;
    # the general path, since the plain one runs no Function when grad mode is off.
    general = _patched(base.SplitBackwardModule, _plain_call=_general_path)
    with torch.no_grad(), _patched(namespace, **patch), general:
        with fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            if kind == "GroupedLinear":
                y = module(x, list(m_splits), is_first_microbatch=is_first_microbatch)
            else:
                y = module(x, is_first_microbatch=is_first_microbatch)
    if "ctx" not in captured:
        raise RuntimeError(f"{kind}.forward did not reach its autograd Function (torch.func?)")
    ctx, fn = captured["ctx"], captured["fn"]
    grad = dy if dy.shape == y.shape else dy.reshape(y.shape)
    flat = grad.reshape(-1, grad.shape[-1]) if grad.dim() != 2 else grad
    with (
        torch.no_grad(),
        _patched(namespace, **_routes_in(namespace)),
        _patched(base, **_routes_in(base)),  # the norm modules' shared backward
    ):
        grads = fn.backward(ctx, flat)
        # What autograd's AccumulateGrad does with the gradients the Function returns (norm
        # parameters; GEMM parameters are written by the module itself and come back None).
        for arg, g in zip(captured["args"][1:], grads[1:]):
            if g is None or not isinstance(arg, torch.Tensor) or not arg.requires_grad:
                continue
            if arg.grad is None:
                arg.grad = g.detach().clone(memory_format=torch.contiguous_format)
            else:
                arg.grad += g
    return StepResult(y, grads[0])
