"""How an impl module's backward runs inside a ``torch.compile``-d graph.

Dynamo traces each module's forward (the autograd ``Function``'s forward) into the graph and
speculates its backward. The backward of a split-backward module has effects that no traced
graph can hold: it asks the autograd engine where each gradient goes (SPEC §3), writes ``.grad``
and ``main_grad``, queues entries, fires hooks. So under tracing the Function's backward is one
call to an opaque custom op per module (``splitgrad::linear_backward`` …, defined next to each
Function), which at run time executes the same eager backward body as the uncompiled module:
delayed ≡ non-delayed still holds bitwise, ``backward_dw()`` runs the queued closure, and the
hooks fire where they do in eager mode.

What the compiled graph fixes at trace time, and so differs from eager mode:

* The op's outputs are the gradients of the Function's non-parameter inputs (and of the norm
  parameters, which go through autograd), as ``needs_input_grad`` said at trace time; one that
  the running backward does not want comes back as zeros and autograd discards it.
* A GEMM parameter's gradient can never be *returned* through the graph (it is written outside
  autograd), so ``torch.autograd.grad`` asking for a GEMM parameter of a compiled module raises
  ``RuntimeError`` instead of returning it; ``backward(inputs=[...])`` and ``torch.autograd.grad``
  on other tensors work as in eager mode.
* A queued entry keeps its own copies of its operands: inductor may reuse the memory of a
  buffer after the op that last reads it, and the entry reads it later.

Each op is registered as an ordered side effect (:func:`effectful`): without that, a backward op
whose outputs nobody reads (the input does not require grad: its work is all side effects) would
be dead code to AOTAutograd and inductor, and two of them could be reordered.

Modules are named to the op by a handle (custom ops take tensors and scalars, not modules), an
integer held in a 0-d tensor so that one compiled graph serves every instance of a module class;
:func:`register` hands one out and :func:`module_of` looks it up (weakly held, so the registry
keeps no module alive).

Nothing here imports Dynamo (``torch._dynamo``, about as long to import as torch itself): the
functions that must run eagerly inside a compiled graph (:func:`eager_apply`,
:func:`check_supported`) get ``torch.compiler.disable`` when a traced graph first reaches them,
so ``import splitgrad.impl`` costs what importing torch costs.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Callable

import torch
from splitgrad.reference.contract import RETURN, autocast_off, gradient_destinations

from . import _torch_compat

#: Whether this torch can compile the modules' backward (see ``_torch_compat.MINIMUM``).
SUPPORTED = _torch_compat.at_least(_torch_compat.MINIMUM["torch.compile support"])

__all__ = [
    "register",
    "module_of",
    "backward_op",
    "norm_module_backward_op",
    "effectful",
    "destinations",
    "zeros_for_unwanted",
    "no_returned_gemm_grads",
    "parameters",
    "op_targets",
    "eager_apply",
]

_modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_handles = itertools.count()


def register(module: torch.nn.Module) -> torch.Tensor:
    """A new handle naming ``module`` to the compiled backward ops: a 0-d int64 CPU tensor, so
    that Dynamo takes it as a graph input rather than a constant to guard on (an int would make
    every instance of a module class compile its own graph, past the recompile limit)."""
    handle = next(_handles)
    _modules[handle] = module
    return torch.tensor(handle, dtype=torch.int64)


def module_of(handle: torch.Tensor) -> torch.nn.Module:
    """The module registered under ``handle``."""
    return _modules[int(handle)]


def backward_op(name: str) -> Callable:
    """Decorator defining a module's compiled backward: the custom op ``name``
    (``torch.library.custom_op``; its writes are outside the graph, so it mutates no argument),
    registered as an ordered side effect (:func:`effectful`)."""

    def define(fn: Callable):
        return effectful(torch.library.custom_op(name, mutates_args=())(fn))

    return define


def norm_module_backward_op(name: str, names, backward: Callable):
    """The compiled backward of a module that begins with a norm (``LayerNormLinear``,
    ``LayerNormMLP``; parameters ``names``): the op ``name`` takes the module's handle, ``dy``,
    the tensors its Function's forward saved before the norm's statistics (``None`` where not
    kept), the statistics, ``overwrite`` and which of x, layer_norm_weight, layer_norm_bias
    the traced graph ``needs``; it runs ``backward``, the eager backward's body, on the
    module's registered parameters and returns those gradients."""

    @backward_op(name)
    def op(
        handle: torch.Tensor,
        dy: torch.Tensor,
        saved: list[torch.Tensor | None],
        stats: list[torch.Tensor],
        overwrite: bool,
        needs: list[bool],
    ) -> list[torch.Tensor]:
        module, leaves, dests = op_targets(handle, names)
        with autocast_off(dy.device.type):
            grads = backward(module, dy, (*saved, *stats), needs[0], dests, leaves, overwrite, True)
        return zeros_for_unwanted(grads[:3], saved[:3], needs)

    @op.register_fake
    def _(handle, dy, saved, stats, overwrite, needs):
        return [t.new_empty(t.shape) for t, n in zip(saved[:3], needs) if n]

    return op


def effectful(op):
    """Register the custom op ``op`` as an ordered side effect (kept and kept in order by
    AOTAutograd and inductor, which thread an effect token through it); returns ``op``. On a
    torch older than compile support needs, nothing is registered: :func:`check_supported`
    refuses the compiled backward there instead."""
    if SUPPORTED:
        _torch_compat.register_ordered_effect(op)
    return op


def _check_supported() -> None:
    """Raise ``TorchTooOld`` (a ``RuntimeError``) naming both versions when a module is traced by
    ``torch.compile`` on a torch whose AOTAutograd cannot keep the backward's effects (run
    eagerly, so the error reaches the caller instead of a silent fallback to eager mode)."""
    _torch_compat.require("torch.compile support")


# key -> a function that runs eagerly even inside a compiled graph, under
# torch.compiler.disable once a graph is traced (torch.compiler.disable imports Dynamo).
_EAGER_ONLY: dict[str, Callable] = {"check_supported": _check_supported}


def eager_apply(function: type[torch.autograd.Function]) -> Callable:
    """``function.apply`` for a Function that must run eagerly when ``torch.compile`` traces its
    caller (a graph break there), as under ``torch.compiler.disable``, without importing Dynamo
    (as long to import as torch itself) before a graph is traced. The modules' FP8 Functions run
    so: their quantized operands and delayed-scaling state live in Python objects the compiled
    backward op cannot take.

    Eagerly the returned wrapper calls ``function.apply``. Traced, it calls this module's
    attribute of the same key, which :func:`__getattr__` builds with ``torch.compiler.disable``
    on first use (Dynamo reads a module attribute missing from the module's ``__dict__`` with a
    real ``getattr``). The graph breaks once; Dynamo records the break in every frame on the
    way, the wrapper's included, which holds no operation."""

    def apply(*args):
        return function.apply(*args)

    apply.__module__ = function.__module__
    apply.__name__, apply.__qualname__ = "apply", f"{function.__qualname__}.apply"
    key = f"{function.__module__.rpartition('.')[2]}__{function.__name__}"
    _EAGER_ONLY[key] = apply
    this = sys.modules[__name__]

    def run(*args):
        if torch.compiler.is_compiling():
            return getattr(this, key)(*args)
        return function.apply(*args)

    run.__module__, run.__name__, run.__qualname__ = apply.__module__, "apply", apply.__qualname__
    return run


def __getattr__(name: str) -> Callable:
    """The ``torch.compiler.disable``-d form of an eager-only function (``check_supported`` or a
    key of :func:`eager_apply`), built and kept on first use."""
    fn = _EAGER_ONLY.get(name)
    if fn is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    disabled = torch.compiler.disable(fn)
    globals()[name] = disabled
    return disabled


def destinations(*params: torch.Tensor | None) -> list[str | None]:
    """:func:`~splitgrad.reference.contract.gradient_destination` of ``params``, called from
    inside a custom op's kernel. The dispatcher runs a kernel with autograd's keys excluded,
    and finding a leaf's ``AccumulateGrad`` node needs them (it records a view), so they are
    re-enabled for the lookup only."""
    with _torch_compat.autograd_dispatch_keys_enabled(), torch.enable_grad():
        return gradient_destinations(*params)


def parameters(module: torch.nn.Module, names) -> list[torch.Tensor | None]:
    """The module's registered parameters ``names``: what a compiled backward writes (a traced
    graph does not keep the forward's own tensors). A parametrized one is refused."""
    params = module._parameters
    missing = [name for name in names if name not in params]
    if missing:
        raise RuntimeError(
            f"a torch.compile-d {type(module).__name__} cannot write the gradient of "
            f"{', '.join(missing)}, which is parametrized (torch.nn.utils.parametrize): run "
            "this module uncompiled (torch.compiler.disable)"
        )
    return [params[name] for name in names]


def no_returned_gemm_grads(module: torch.nn.Module, names_and_dests) -> None:
    """Raise ``RuntimeError`` when ``torch.autograd.grad`` asks a compiled backward for a GEMM
    parameter's gradient (see the module docstring)."""
    asked = [name for name, dest in names_and_dests if dest == RETURN]
    if asked:
        raise RuntimeError(
            f"torch.autograd.grad asked a torch.compile-d {type(module).__name__} for the "
            f"gradient of {', '.join(asked)}: a compiled graph cannot return GEMM-parameter "
            "gradients (they are written outside autograd). Run this module uncompiled "
            "(torch.compiler.disable) for that backward, or ask for other inputs only."
        )


def op_targets(handle: torch.Tensor, names=None) -> tuple[torch.nn.Module, list, list[str | None]]:
    """What a compiled backward op writes: the module ``handle`` names, its registered
    parameters ``names`` (:func:`parameters`; ``None``: its GEMM weights, then biases) and where
    the running backward wants each one's gradient (:func:`destinations`). Raises when it asks
    for a GEMM parameter's (:func:`no_returned_gemm_grads`)."""
    module = module_of(handle)
    gemm = module._gemm_weight_names + module._gemm_bias_names
    names = gemm if names is None else names
    leaves = parameters(module, names)
    dests = destinations(*leaves)
    no_returned_gemm_grads(module, [(n, d) for n, d in zip(names, dests) if n in gemm])
    return module, leaves, dests


def zeros_for_unwanted(grads, likes, needs) -> list[torch.Tensor]:
    """The op's outputs, one for each input of ``likes`` whose gradient the traced graph
    ``needs``: its gradient, or zeros shaped like it where the running backward did not
    compute it (autograd discards those)."""
    return [
        g if g is not None else torch.zeros_like(t) for g, t, n in zip(grads, likes, needs) if n
    ]
