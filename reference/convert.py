"""``convert_linears``: swap every ``torch.nn.Linear`` of an existing model for a package's
``Linear``, in place, keeping the very same ``Parameter`` objects (SPEC §2).

Written once, here, as part of the contract; each package binds it to its own ``Linear``
(``splitgrad.reference.convert_linears``, ``splitgrad.impl.convert_linears``), following the
convention of torchao's ``convert_to_float8_training``: ``module_filter_fn(module, fqn)`` picks
the layers, the model is changed in place and returned.

Keeping the parameters (rather than copying their values into fresh ones) is what makes the swap
invisible to the rest of a training stack: an optimizer built before the conversion still steps
the same tensors (its state is keyed by them), tied weights (``lm_head.weight is
embed_tokens.weight``) stay tied, ``requires_grad`` flags and state-dict keys (``weight``,
``bias``) are unchanged, and no weight is copied or allocated.

What it refuses (nothing is changed when it raises; every check runs before the first swap):

* a model that is itself a bare ``torch.nn.Linear``: it has no parent to swap it in, and
  returning a new module would leave the caller's reference on the old one -> ``TypeError``
  (build the package's ``Linear`` directly, or wrap the layer, e.g. ``torch.nn.Sequential``);
* a subclass of ``torch.nn.Linear`` that defines its own ``forward`` (on the class or on the
  instance, as a wrapper does), whose behaviour the package's ``Linear`` would silently drop ->
  ``TypeError`` naming the layer's fqn and class; subclasses that only add methods are converted;
* a layer whose ``weight`` or ``bias`` is not a plain ``torch.nn.Parameter`` (parametrized,
  lazy, a ``DTensor`` after ``fully_shard``, a quantized tensor subclass): convert first, then
  shard or quantize -> ``TypeError`` naming the fqn and the type;
* a layer on a device the package does not run on (it runs on ``cpu`` and ``cuda``; a model
  still on ``meta`` is converted: build on meta, convert, shard, then ``to_empty`` and load or
  ``reset_parameters()``, torchao's and torchtitan's order), or whose bias differs from its
  weight in dtype or device -> ``ValueError``;
* a layer with forward or backward hooks registered on it, which would be lost -> ``ValueError``;
* an option the package's ``Linear`` does not take, or one that the existing layer decides
  (``bias``, ``params_dtype``, ``device``) -> ``TypeError`` naming the option; an invalid
  combination (``ub_bulk_wgrad`` with ``delay_wgrad_compute``) -> the constructor's
  ``ValueError``, with the layer's fqn.

A model with no ``torch.nn.Linear`` (or none that ``module_filter_fn`` accepts) is returned
unchanged with a ``UserWarning`` naming its type. Layers that already are a splitgrad
``Linear`` (of either package) are ``torch.nn.Linear`` subclasses, so that torch's DTensor
tensor-parallel styles take them, but they are not converted again: they are left as they are,
so converting twice changes nothing the second time. ``torch.nn.MultiheadAttention``'s
``out_proj`` is left as it is: the attention reads its weight and bias without calling it, so a
converted one would never run (and would mark its weight as deferred). A layer registered under
several parents is swapped everywhere for one new module; the filter sees it once, at its first
fqn in ``named_modules()`` order.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch

from ._torch_private import module_hooks_registered
from .contract import ModuleContract

__all__ = ["make_convert_linears"]

#: Devices the packages' modules run on, and ``meta``: a model not yet materialized.
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "meta")
#: Constructor options that come from the layer being replaced, never from the caller.
_FROM_THE_LAYER = ("bias", "params_dtype", "device")

ModuleFilter = Callable[[torch.nn.Module, str], bool]


def _allowed_options(linear_cls: type) -> set[str] | None:
    """Keyword-only options of ``linear_cls``'s constructor, or ``None`` if it takes
    ``**kwargs`` (then the constructor itself judges them)."""
    params = inspect.signature(linear_cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _is_torch_linear(module: torch.nn.Module) -> bool:
    """A ``torch.nn.Linear`` to convert: not one that already is a splitgrad module."""
    return isinstance(module, torch.nn.Linear) and not isinstance(module, ModuleContract)


def _check_options(linear_cls: type, options: dict) -> None:
    taken = [name for name in _FROM_THE_LAYER if name in options]
    if taken:
        raise TypeError(
            f"convert_linears: option(s) {taken} cannot be given: each new {linear_cls.__name__} "
            "takes bias, params_dtype and device from the torch.nn.Linear it replaces"
        )
    allowed = _allowed_options(linear_cls)
    if allowed is None:
        return
    unknown = sorted(set(options) - allowed)
    if unknown:
        accepted = sorted(allowed - set(_FROM_THE_LAYER))
        raise TypeError(
            f"convert_linears: unknown option(s) {unknown} for {linear_cls.__module__}."
            f"{linear_cls.__name__}; it takes {accepted}"
        )


def _check_layer(fqn: str, layer: torch.nn.Linear) -> None:
    """Raise if ``layer`` cannot be swapped without changing what the model computes."""
    where = f"convert_linears: {fqn or '<model>'} ({type(layer).__module__}.{type(layer).__name__})"
    if type(layer).forward is not torch.nn.Linear.forward or "forward" in vars(layer):
        raise TypeError(
            f"{where} defines its own forward, which the converted layer would drop; leave it "
            "out with module_filter_fn, or convert the layers inside it"
        )
    for name in ("weight", "bias"):
        value = getattr(layer, name, None)
        if value is None and name == "bias":
            continue
        if name not in layer._parameters or type(value) is not torch.nn.Parameter:
            raise TypeError(
                f"{where}: its {name} is a {type(value).__module__}.{type(value).__name__}, not a "
                "plain torch.nn.Parameter (parametrized, lazy, sharded or quantized); convert "
                "before sharding (fully_shard) or quantizing"
            )
    weight, bias = layer.weight, layer.bias
    if weight.device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"{where}: its weight is on device {weight.device}; the package runs on cpu and "
            "cuda (and converts a model still on meta)"
        )
    if bias is not None and (bias.dtype, bias.device) != (weight.dtype, weight.device):
        raise ValueError(
            f"{where}: its bias ({bias.dtype} on {bias.device}) differs from its weight "
            f"({weight.dtype} on {weight.device}); one Linear holds both in one dtype and device"
        )
    hooks = module_hooks_registered(layer)
    if hooks:
        raise ValueError(
            f"{where} has hooks registered ({', '.join(hooks)}), which "
            "would be lost; convert before registering them"
        )


def _replacement(fqn: str, layer: torch.nn.Linear, linear_cls: type, options: dict):
    """The package's ``Linear`` for ``layer``, still holding parameters of its own on the meta
    device: building it allocates and initialises no weight, and a bad option raises (with the
    layer's fqn) before anything of the model has changed."""
    try:
        return linear_cls(
            layer.in_features,
            layer.out_features,
            bias=layer.bias is not None,
            params_dtype=layer.weight.dtype,
            device="meta",
            **options,
        )
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"convert_linears: {fqn or '<model>'}: {exc}") from exc


def _take_parameters(new: torch.nn.Module, layer: torch.nn.Linear) -> None:
    """Give ``new`` the very ``weight`` and ``bias`` of ``layer`` in place of its own."""
    for name in ("weight", "bias"):
        param = layer._parameters[name]
        if param is None:
            continue
        # Attributes the package sets on the parameters it creates (skip_backward_post_hook
        # under delay) belong on the parameters it now holds.
        for attr, value in vars(new._parameters[name]).items():
            setattr(param, attr, value)
        new.register_parameter(name, param)
    new._device = layer.weight.device  # where the module creates any tensor of its own
    new.train(layer.training)


def _convert(
    model: torch.nn.Module,
    linear_cls: type,
    module_filter_fn: ModuleFilter | None,
    options: dict,
) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_linears: model must be a torch.nn.Module, got {model!r}")
    if _is_torch_linear(model):
        raise TypeError(
            f"convert_linears: model is itself a {type(model).__name__}, which cannot be replaced "
            f"in place; build {linear_cls.__module__}.{linear_cls.__name__} directly, or pass a "
            "module that contains it (e.g. torch.nn.Sequential(linear))"
        )
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise TypeError(
            f"convert_linears: module_filter_fn must be callable, got {module_filter_fn!r}"
        )
    _check_options(linear_cls, options)
    # Every (parent, attribute name) that holds a torch.nn.Linear; the same layer may sit in
    # several places, and is replaced by one new module in all of them.
    slots: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    chosen: dict[int, torch.nn.Module | None] = {}
    seen_slots: set[tuple[int, str]] = set()
    found = 0
    # Pre-order, every occurrence: named_modules() order for the filter, all slots for the swap.
    for fqn, child in model.named_modules(remove_duplicate=False):
        if not fqn or not _is_torch_linear(child):
            continue
        parent_fqn, _, name = fqn.rpartition(".")
        parent = model.get_submodule(parent_fqn)
        if (id(parent), name) in seen_slots or isinstance(parent, torch.nn.MultiheadAttention):
            continue  # MultiheadAttention never calls its out_proj: it reads only its parameters
        seen_slots.add((id(parent), name))
        if id(child) not in chosen:
            found += 1
            keep = module_filter_fn is None or bool(module_filter_fn(child, fqn))
            if keep:
                _check_layer(fqn, child)
            chosen[id(child)] = _replacement(fqn, child, linear_cls, options) if keep else None
        if chosen[id(child)] is not None:
            slots.append((parent, name, child))
    if not slots:
        reason = (
            f"module_filter_fn accepted none of its {found} torch.nn.Linear layers"
            if found
            else "it has no torch.nn.Linear layers"
        )
        warnings.warn(
            f"convert_linears: nothing converted in {type(model).__name__}: {reason}",
            UserWarning,
            stacklevel=3,
        )
        return model
    taken: set[int] = set()
    for parent, name, child in slots:
        new = chosen[id(child)]
        if id(new) not in taken:
            _take_parameters(new, child)
            taken.add(id(new))
        setattr(parent, name, new)
    return model


def make_convert_linears(linear_cls: type) -> Callable[..., torch.nn.Module]:
    """``convert_linears`` bound to a package's ``Linear`` (how each package exports it)."""

    def convert_linears(
        model: torch.nn.Module,
        *,
        module_filter_fn: ModuleFilter | None = None,
        **options,
    ) -> torch.nn.Module:
        """Replace every ``torch.nn.Linear`` inside ``model`` (those ``module_filter_fn(module,
        fqn)`` accepts, when given) by this package's ``Linear`` built with ``options`` (for
        example ``delay_wgrad_compute=True``), in place, keeping the very same ``weight`` and
        ``bias`` ``Parameter`` objects; dtype and device come from each layer's weight. Returns
        ``model``. Raises, changing nothing, on what it cannot convert; warns when there is
        nothing to convert (see :mod:`splitgrad.reference.convert`)."""
        return _convert(model, linear_cls, module_filter_fn, options)

    convert_linears.__module__ = linear_cls.__module__.rsplit(".", 1)[0]
    convert_linears.__qualname__ = "convert_linears"
    return convert_linears
