"""Autograd's rules for a leaf's gradient, applied by a module that writes the gradient itself
(SPEC §3).

A splitgrad module writes the gradient of a GEMM parameter itself — now, or at
``backward_dw()`` under delay — so its autograd Function returns ``None`` for that parameter.
When autograd accumulates a gradient into a leaf it

1. runs the leaf's tensor hooks (``register_hook``) in registration order: each sees the
   gradient and may replace it by a tensor of the same shape, dtype and device;
2. stores it in ``.grad``: set when ``.grad`` is ``None`` (in the leaf's memory layout; a copy
   when a hook also holds it), added in place otherwise;
3. runs the leaf's post-accumulate hooks (``register_post_accumulate_grad_hook``) with the leaf.

:func:`apply_tensor_hooks`, :func:`accumulate` and :func:`run_post_accumulate_hooks` are those
three steps for a gradient a module writes. A module runs step 1 for every gradient of an entry
before it writes any, so a hook that raises leaves the entry unwritten (and queued).

Because the Function returns ``None``, autograd still reaches the leaf's accumulator during
``backward()``, with no gradient, and would call the leaf's hooks there: tensor hooks with
``None``, and post-accumulate hooks, before a deferred gradient exists (and, under delay, never
after it). :func:`mute_empty_calls` wraps the leaf's hooks so that tensor hooks never see such
a call, and post-accumulate hooks do only when nothing was deferred. A gradient that another use
of the same leaf sends through autograd (a weight tied to a torch operation) still reaches them,
as it would without splitgrad.

So, per backward pass: a tensor hook sees each gradient the module writes (two, for a module
applied twice); post-accumulate hooks fire once after the pass without delay (autograd's own
call, which comes after the module's writes), and after each entry's write in ``backward_dw()``
under delay (once per entry: a module applied twice has two).

Under fused accumulation the GEMM accumulates into ``main_grad`` and no gradient tensor exists
for a tensor hook to see, so a fused weight with tensor hooks is refused
(:func:`check_no_tensor_hooks`); its post-accumulate hooks run after ``main_grad`` is written,
with ``.grad`` still ``None``. Hooks registered on the accumulator node itself
(``get_gradient_edge(p).node.register_hook``) run when autograd reaches the node in
``backward()``, as they always did; no gradient is in them there.
"""

from __future__ import annotations

import torch

from ._torch_private import has_hooks, post_accumulate_hook_dict, tensor_hook_dict

__all__ = [
    "has_hooks",
    "apply_tensor_hooks",
    "accumulate",
    "run_post_accumulate_hooks",
    "mute_empty_calls",
    "check_no_tensor_hooks",
]


class _GradientOnly:
    """A tensor hook that autograd calls only with a gradient."""

    __slots__ = ("hook",)

    def __init__(self, hook) -> None:
        self.hook = hook

    def __call__(self, grad):
        return None if grad is None else self.hook(grad)


class _Arrival:
    """A tensor hook that decides whether autograd's current call on the leaf reaches its
    post-accumulate hooks: yes when a gradient arrived, or when nothing was deferred (a
    non-delayed module wrote the gradient before autograd got here)."""

    __slots__ = ("deferred", "fire")

    def __init__(self) -> None:
        self.deferred, self.fire = False, True

    def __call__(self, grad) -> None:
        self.fire = grad is not None or not self.deferred
        self.deferred = False


class _AfterGradient:
    """A post-accumulate hook that autograd's call reaches only when :class:`_Arrival` says."""

    __slots__ = ("hook", "arrival")

    def __init__(self, hook, arrival: _Arrival) -> None:
        self.hook, self.arrival = hook, arrival

    def __call__(self, leaf) -> None:
        if self.arrival.fire:
            self.hook(leaf)


def _user_tensor_hooks(leaf: torch.Tensor) -> list:
    hooks = tensor_hook_dict(leaf)
    if not hooks:
        return []
    return [
        h.hook if isinstance(h, _GradientOnly) else h
        for h in list(hooks.values())
        if not isinstance(h, _Arrival)
    ]


def _user_post_hooks(leaf: torch.Tensor) -> list:
    hooks = post_accumulate_hook_dict(leaf)
    if not hooks:
        return []
    return [h.hook if isinstance(h, _AfterGradient) else h for h in list(hooks.values())]


def _hook_name(hook) -> str:
    return getattr(hook, "__name__", type(hook).__name__)


def apply_tensor_hooks(leaf: torch.Tensor, grad: torch.Tensor, where: str) -> torch.Tensor:
    """``grad`` after ``leaf``'s tensor hooks, each seeing the previous one's result. A hook
    that returns a tensor of another shape, dtype or device raises autograd's error, prefixed
    with ``where`` (``"Linear.weight"``)."""
    for hook in _user_tensor_hooks(leaf):
        out = hook(grad)
        if out is None:
            continue
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"{where}: expected Variable, but hook '{_hook_name(hook)}' returned "
                f"'{type(out).__name__}'"
            )
        changed = None
        if out.dtype != grad.dtype or out.layout != grad.layout:
            changed = f"type of value (was {grad.dtype} got {out.dtype})"
        elif out.device != grad.device:
            changed = f"type of value (was a {grad.device} tensor got a {out.device} tensor)"
        elif out.shape != grad.shape:
            changed = f"size of value (was {list(grad.shape)} got {list(out.shape)})"
        if changed:
            raise RuntimeError(f"{where}: hook '{_hook_name(hook)}' has changed the {changed}")
        grad = out
    return grad


def _in_layout_of(leaf: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` with ``leaf``'s strides (autograd's gradient layout contract), copied if not."""
    if grad.stride() == leaf.stride():
        return grad
    return torch.empty_like(leaf, dtype=grad.dtype).copy_(grad)


def accumulate(leaf: torch.Tensor, grad: torch.Tensor, *, own: bool = True) -> None:
    """Store ``grad`` in ``leaf.grad`` as autograd's accumulator does outside ``create_graph``
    (a differentiated backward returns its gradients to autograd instead: :mod:`.routing`):
    set when ``None``, else added in place, whatever the caller's grad mode. ``own``: nothing
    else holds ``grad`` (no hook saw it), so a first gradient may be stored without a copy."""
    with torch.no_grad():
        if grad.dtype != leaf.dtype:  # e.g. a GEMM under torch.autocast: the leaf's dtype wins
            grad, own = grad.to(leaf.dtype), True
        if leaf.grad is None:
            leaf.grad = _in_layout_of(leaf, grad if own else grad.clone())
        else:
            leaf.grad += grad


def run_post_accumulate_hooks(leaf: torch.Tensor) -> None:
    """Call ``leaf``'s post-accumulate hooks with ``leaf``, in registration order."""
    for hook in _user_post_hooks(leaf):
        hook(leaf)


def mute_empty_calls(leaf: torch.Tensor, *, deferred: bool) -> None:
    """Wrap ``leaf``'s hooks for autograd's call without a gradient (see the module docstring):
    its tensor hooks never see ``None``. ``deferred``: the running backward defers the leaf's
    gradient (a delayed module), so that call must not reach its post-accumulate hooks either;
    they run after the deferred write instead. Without it the call does reach them, after the
    module's own write, once per backward as for any leaf. Idempotent; ``handle.remove()``
    keeps working."""
    pre, post = tensor_hook_dict(leaf), post_accumulate_hook_dict(leaf)
    if pre:
        for key, hook in list(pre.items()):
            if not isinstance(hook, (_GradientOnly, _Arrival)):
                pre[key] = _GradientOnly(hook)
    if not (deferred and post):
        return
    arrival = next((h for h in (pre or {}).values() if isinstance(h, _Arrival)), None)
    if arrival is None:
        arrival = _Arrival()
        leaf.register_hook(arrival)
    for key, hook in list(post.items()):
        if not isinstance(hook, _AfterGradient):
            post[key] = _AfterGradient(hook, arrival)
    arrival.deferred = True


def check_no_tensor_hooks(leaf: torch.Tensor, where: str) -> None:
    """Raise ``RuntimeError`` if a fused-accumulation weight has tensor hooks: its gradient is
    accumulated into ``main_grad`` inside the GEMM, so no hook could see or replace it."""
    hooks = _user_tensor_hooks(leaf)
    if hooks:
        names = ", ".join(repr(_hook_name(h)) for h in hooks)
        raise RuntimeError(
            f"{where} has tensor hooks ({names}), but fuse_wgrad_accumulation=True accumulates "
            "its gradient into main_grad inside the GEMM: no gradient tensor exists for a hook "
            "to see or replace. Remove the hooks or build the module with "
            "fuse_wgrad_accumulation=False"
        )
