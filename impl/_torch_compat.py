"""Which torch each optional feature of splitgrad needs, and every private torch API
``splitgrad.impl`` uses, in one place.

Every feature that rests on a torch API newer than the eager modules' minimum is named here with
the oldest torch it was checked on. :func:`require` raises at the point of use, naming the
feature, the torch found and the minimum, so that an older torch still imports the package and
runs the eager modules (``ci/torch_matrix.sh`` runs both minimums).

Every private torch API (``torch._C``, private ops, private modules and attributes) sits behind
one function below that names what it reads, checked on the torch versions in
:data:`CHECKED_ON`. Where it is missing, calling the function raises
:class:`~splitgrad.reference._torch_private.TorchMoved` naming the running torch version; nothing
falls back quietly. ``tests/test_private_torch.py`` keeps every other module of the package off
torch's private names.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable

import torch
from splitgrad.reference._torch_private import TorchMoved

__all__ = [
    "MINIMUM",
    "torch_version",
    "at_least",
    "require",
    "TorchTooOld",
    "CHECKED_ON",
    "TorchMoved",
    "set_grad_enabled",
    "unwrap_if_dead",
    "any_autocast_enabled",
    "function_c_apply",
    "autograd_dispatch_keys_enabled",
    "register_ordered_effect",
    "has_grouped_mm",
    "grouped_mm",
    "scaled_mm",
    "storage_key",
    "dispatch_mode_base",
    "tree_leaves",
    "returns_alias",
    "fake_tensor_mode",
    "fake_tensor_logger",
    "op_overload_type",
    "out_arguments",
    "pipelining_split",
    "compiled_original",
    "dynamo_counters",
]

#: Oldest torch each feature was checked on (ci/torch_matrix.sh).
MINIMUM: dict[str, str] = {
    # torch.library effect registration, and AOTAutograd partitioning of effect tokens in a
    # backward graph (2.10's partitioner drops the backward token: "Node ... was invalid").
    "torch.compile support": "2.11",
}


class TorchTooOld(RuntimeError):
    """A feature was used on a torch older than the one it needs."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch), ignoring local/pre tags."""
    text = (version or torch.__version__).split("+")[0]
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"cannot read a torch version from {text!r}") from exc


def at_least(minimum: str) -> bool:
    """Whether the running torch is at least ``minimum`` ("2.11")."""
    return torch_version() >= torch_version(minimum)


def require(feature: str) -> None:
    """Raise :class:`TorchTooOld` if the running torch is older than ``MINIMUM[feature]``."""
    if feature not in MINIMUM:
        raise KeyError(f"unknown feature {feature!r}; known: {sorted(MINIMUM)}")
    if not at_least(MINIMUM[feature]):
        raise TorchTooOld(
            f"{feature} needs torch>={MINIMUM[feature]}, found torch {torch.__version__}; "
            "the eager modules work on this torch"
        )


# ---- private torch APIs ---------------------------------------------------------------------
# Those on the modules' per-call path are looked up once, here, at import: calling them costs
# what calling torch's own did.

#: The torch versions the private APIs below were checked on.
CHECKED_ON = "2.8, 2.13, 2.14"


def _moved(what: str, consequence: str) -> TorchMoved:
    return TorchMoved(
        f"torch {torch.__version__} has no {what} (splitgrad.impl was checked on torch "
        f"{CHECKED_ON}); {consequence}"
    )


def _raiser(what: str, consequence: str) -> Callable:
    def raise_moved(*_args, **_kwargs):
        raise _moved(what, consequence)

    return raise_moved


def _bound(lookup: Callable[[], Callable], what: str, consequence: str) -> Callable:
    """What ``lookup()`` finds, once, or :func:`_raiser` of ``what`` where it is missing."""
    try:
        return lookup()
    except (AttributeError, KeyError):
        return _raiser(what, consequence)


_EAGER = "splitgrad.impl's modules cannot run their backward on this torch"

#: ``torch._C._set_grad_enabled(mode)``: grad mode set directly, a tenth of the cost of
#: ``torch.no_grad()`` (a small Linear's wgrad entry pays it once per run).
set_grad_enabled: Callable[[bool], None] = _bound(
    lambda: torch._C._set_grad_enabled, "torch._C._set_grad_enabled", _EAGER
)

#: ``torch._C._functorch.unwrap_if_dead(x)``: ``x`` itself, or the tensor inside a functorch
#: wrapper whose transform has ended (what ``Function.apply`` does to each argument).
unwrap_if_dead: Callable[[torch.Tensor], torch.Tensor] = _bound(
    lambda: torch._C._functorch.unwrap_if_dead, "torch._C._functorch.unwrap_if_dead", _EAGER
)

#: ``torch._C._is_any_autocast_enabled()``: whether ``torch.autocast`` is on for any device,
#: one call (a module's plain path asks it once per forward and backward).
any_autocast_enabled: Callable[[], bool] = _bound(
    lambda: torch._C._is_any_autocast_enabled, "torch._C._is_any_autocast_enabled", _EAGER
)

_C_APPLY = _bound(
    lambda: torch._C._FunctionBase.__dict__["apply"], "torch._C._FunctionBase.apply", _EAGER
)


def function_c_apply(function: type[torch.autograd.Function]) -> Callable[..., torch.Tensor]:
    """``torch._C._FunctionBase.apply`` bound to ``function``: autograd's C++ ``apply``, without
    the Python wrapper ``function.apply`` puts around it."""
    return _C_APPLY.__get__(None, function)


def autograd_dispatch_keys_enabled() -> contextlib.AbstractContextManager:
    """A guard under which the dispatcher's thread-local exclude set no longer holds autograd's
    keys, as it does inside a custom op's kernel: ``torch._C._ForceDispatchKeyGuard`` over
    ``torch._C._dispatch_tls_local_include_set()`` and the exclude set less
    ``DispatchKey.AutogradCPU`` and ``ADInplaceOrView`` (removing one backend's autograd key
    clears autograd's functionality bit for all of them)."""
    C = torch._C
    try:
        include = C._dispatch_tls_local_include_set()
        exclude = C._dispatch_tls_local_exclude_set()
        for key in (C.DispatchKey.AutogradCPU, C.DispatchKey.ADInplaceOrView):
            exclude = exclude.remove(key)
        return C._ForceDispatchKeyGuard(include, exclude)
    except AttributeError as exc:
        raise _moved(
            f"torch._C.{exc.name}" if exc.name else "torch._C's dispatch-key guard",
            "a torch.compile-d module's backward cannot find where its gradients go",
        ) from None


def register_ordered_effect(op) -> None:
    """Register the custom op ``op`` (``torch.library.custom_op``) as an ordered side effect:
    ``torch.library._register_effectful_op(op._qualname,
    torch._library.effects.EffectType.ORDERED)`` (torch 2.11 and newer: see :data:`MINIMUM`)."""
    try:
        from torch._library.effects import EffectType

        register = torch.library._register_effectful_op
        name = op._qualname
    except (ImportError, AttributeError):
        raise _moved(
            "torch.library._register_effectful_op / torch._library.effects.EffectType",
            "splitgrad.impl cannot keep its compiled backward's side effects",
        ) from None
    register(name, EffectType.ORDERED)


# ---- private GEMM ops (looked up at each call: tests stand in for them on torch) -----------

_GEMM = "splitgrad.impl cannot run this fast path (the portable one always runs)"


def has_grouped_mm() -> bool:
    """Whether this torch has ``torch._grouped_mm`` at all (a kernel for a device is another
    matter: :func:`.gemm.grouped_mm_runs`)."""
    return hasattr(torch, "_grouped_mm")


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(a, b, offs=offs)``: one GEMM per group of ``a``'s rows (group ends
    ``offs``) against ``b``'s matching slice."""
    try:
        op = torch._grouped_mm
    except AttributeError:
        raise _moved("torch._grouped_mm", _GEMM) from None
    return op(a, b, offs=offs)


def scaled_mm(a, b, scale_a, scale_b, *, bias, out_dtype) -> torch.Tensor:
    """``torch._scaled_mm(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)``: the FP8
    GEMM with per-tensor scales."""
    try:
        op = torch._scaled_mm
    except AttributeError:
        raise _moved("torch._scaled_mm", _GEMM) from None
    return op(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype)


def storage_key(storage: torch.UntypedStorage) -> int:
    """``storage._cdata``: what identifies a storage (two tensors share one when their keys are
    equal), for fake tensors too, whose storages have no address."""
    try:
        return storage._cdata
    except AttributeError:
        raise _moved("UntypedStorage._cdata", "splitgrad.impl cannot tell storages apart") from None


# ---- measurement (splitgrad bench, entry_memory): imported when first used ------------------

_TOOLS = "splitgrad.impl's measurements cannot run on this torch"


def dispatch_mode_base() -> type:
    """``torch.utils._python_dispatch.TorchDispatchMode``, the base of a mode that sees every
    operator call."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        raise _moved("torch.utils._python_dispatch.TorchDispatchMode", _TOOLS) from None
    return TorchDispatchMode


def tree_leaves(tree: object) -> list:
    """``torch.utils._pytree.tree_flatten(tree)[0]``: the leaves of an operator's output."""
    try:
        from torch.utils._pytree import tree_flatten
    except ImportError:
        raise _moved("torch.utils._pytree.tree_flatten", _TOOLS) from None
    return tree_flatten(tree)[0]


def returns_alias(func) -> bool:
    """Whether the operator overload ``func`` returns a view of an input (``func._schema``: a
    return with ``alias_info``)."""
    try:
        returns = func._schema.returns
    except AttributeError:
        raise _moved("OpOverload._schema", _TOOLS) from None
    return any(r.alias_info is not None for r in returns)


def _fake_tensor_mode_type() -> type:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError:
        raise _moved("torch._subclasses.fake_tensor.FakeTensorMode", _TOOLS) from None
    return FakeTensorMode


def fake_tensor_mode(**options) -> contextlib.AbstractContextManager:
    """A new ``torch._subclasses.fake_tensor.FakeTensorMode(**options)``: tensors with sizes and
    no storage."""
    return _fake_tensor_mode_type()(**options)


def fake_tensor_logger() -> logging.Logger:
    """The logger of the module defining ``FakeTensorMode``, where fake kernels log a refused
    meta check before raising it."""
    return logging.getLogger(_fake_tensor_mode_type().__module__)


def op_overload_type() -> type:
    """``torch._ops.OpOverload``: one overload of an operator, as a dispatch mode sees it."""
    try:
        return torch._ops.OpOverload
    except AttributeError:
        raise _moved("torch._ops.OpOverload", _TOOLS) from None


def out_arguments(func) -> list[str]:
    """The names of the operator overload ``func``'s ``out=`` arguments (``func._schema``)."""
    try:
        arguments = func._schema.arguments
    except AttributeError:
        raise _moved("OpOverload._schema", _TOOLS) from None
    return [a.name for a in arguments if a.is_out]


def pipelining_split() -> tuple[Callable, Callable]:
    """``(stage_backward_input, stage_backward_weight)`` of
    ``torch.distributed.pipelining._backward``: torch's own B/W split of a backward."""
    try:
        from torch.distributed.pipelining._backward import (
            stage_backward_input,
            stage_backward_weight,
        )
    except ImportError:
        raise _moved(
            "torch.distributed.pipelining._backward.stage_backward_input/_weight", _TOOLS
        ) from None
    return stage_backward_input, stage_backward_weight


_optimized_module: type | None = None


def compiled_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``, of
    ``torch._dynamo.eval_frame``), or ``module`` itself when it is not such a wrapper (cheap:
    imports nothing while Dynamo is not loaded, when no module can be one)."""
    global _optimized_module
    if _optimized_module is None:
        if "torch._dynamo" not in sys.modules:
            return module
        try:
            from torch._dynamo.eval_frame import OptimizedModule
        except ImportError:
            raise _moved("torch._dynamo.eval_frame.OptimizedModule", _TOOLS) from None
        _optimized_module = OptimizedModule
    if not isinstance(module, _optimized_module):
        return module
    try:
        return module._orig_mod
    except AttributeError:
        raise _moved("OptimizedModule._orig_mod", _TOOLS) from None


def dynamo_counters() -> dict:
    """``torch._dynamo.utils.counters``: what Dynamo counted while compiling
    (``["graph_break"]``: the graph breaks by reason)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        raise _moved("torch._dynamo.utils.counters", _TOOLS) from None
    return counters
