"""Toy outside packages for P18's module-protocol kinds: ``splitgrad.impl`` with one planted bug
each, in what a module does as a ``torch.nn.Module`` (where it creates its parameters,
``reset_parameters``, ``repr``, copies). Each bug is a holder class whose attributes are the
modules it changes (nested, so that ``pickle`` finds them by their qualified name);
:func:`backend` drives one as a :class:`~splitgrad.properties.backends.LibraryBackend`.

P18's meta-tests (``tests/test_properties_protocol.py``) run the module-protocol cases on each
and expect the check that the bug breaks to fail, naming what went wrong.
"""

from __future__ import annotations

import copy
import types

import splitgrad.impl as impl
import torch
from splitgrad.properties.backends import LibraryBackend

_EXPORTS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear", "fp8_autocast")


class dtype_ignored:
    class Linear(impl.Linear):
        """``params_dtype=None`` means float32, whatever ``torch.set_default_dtype`` says."""

        def __init__(self, *args, params_dtype=None, **kw):
            super().__init__(*args, params_dtype=params_dtype or torch.float32, **kw)


class explicit_device_loses:
    class Linear(impl.Linear):
        """Parameters are created on torch's default device even when ``device=`` is given."""

        def _new_tensor(self, *shape: int) -> torch.Tensor:
            return torch.empty(*shape, dtype=self.params_dtype)


class reset_keeps_bias:
    class Linear(impl.Linear):
        """``reset_parameters()`` leaves the bias as it is."""

        def reset_parameters(self) -> None:
            bias = None if self.bias is None else self.bias.detach().clone()
            super().reset_parameters()
            if bias is not None:
                with torch.no_grad():
                    self.bias.copy_(bias)


class reset_keeps_fp8_state:
    class Linear(impl.Linear):
        """``reset_parameters()`` keeps the FP8 delayed-scaling histories."""

        def reset_parameters(self) -> None:
            states = dict(self.fp8_states)
            super().reset_parameters()
            self.fp8_states.update(states)


class reset_ignores_queue:
    class Linear(impl.Linear):
        """A ``reset_parameters()`` of its own that resets whatever is queued."""

        def reset_parameters(self) -> None:
            with torch.no_grad():
                torch.nn.init.normal_(self.weight, std=0.023)
                if self.bias is not None:
                    self.bias.zero_()
            self.fp8_states.clear()


class reset_then_refuses:
    class Linear(impl.Linear):
        """With entries queued, the weight is zeroed before the refusal."""

        def reset_parameters(self) -> None:
            if getattr(self, "pending_wgrad_count", 0):
                with torch.no_grad():
                    self.weight.zero_()
            super().reset_parameters()


class repr_hides_delay:
    class Linear(impl.Linear):
        """``repr`` leaves out ``delay_wgrad_compute=True``."""

        def extra_repr(self) -> str:
            return super().extra_repr().replace(", delay_wgrad_compute=True", "")


class repr_claims_fused:
    class Linear(impl.Linear):
        """``repr`` always says ``fuse_wgrad_accumulation=True``."""

        def extra_repr(self) -> str:
            text = super().extra_repr().replace(", fuse_wgrad_accumulation=True", "")
            return text + ", fuse_wgrad_accumulation=True"


class copy_loses_delay:
    class Linear(impl.Linear):
        """A module rebuilt from its state (``pickle``, ``torch.load``, ``copy.deepcopy``) runs
        without delay."""

        def __setstate__(self, state: dict) -> None:
            super().__setstate__(state)
            self.delay_wgrad_compute = False


class deepcopy_shares:
    class Linear(impl.Linear):
        """``copy.deepcopy`` returns a shallow copy: the same parameters."""

        def __deepcopy__(self, memo):
            return copy.copy(self)


class copy_loses_fp8_state:
    class Linear(impl.Linear):
        """The FP8 delayed-scaling histories are left out of the pickled state."""

        def __getstate__(self) -> dict:
            state = self.__dict__.copy()
            state["fp8_states"] = {}
            return state


class to_empty_drops_delay:
    class Linear(impl.Linear):
        """``to_empty()`` rebuilds the module without delay."""

        def to_empty(self, *, device, recurse: bool = True):
            out = super().to_empty(device=device, recurse=recurse)
            self.delay_wgrad_compute = False
            return out


class reset_like_torch_linear:
    class Linear(impl.Linear):
        """``reset_parameters()`` is ``torch.nn.Linear``'s (a base class of the module):
        Kaiming-uniform weights and uniform biases instead of TransformerEngine's values."""

        def reset_parameters(self) -> None:
            torch.nn.Linear.reset_parameters(self)
            self.fp8_states.clear()


class reset_replaces_parameters:
    class Linear(impl.Linear):
        """``reset_parameters()`` registers new ``Parameter`` objects: an optimizer built
        before it steps the old ones."""

        def reset_parameters(self) -> None:
            if "weight" in self._parameters:
                self.weight = torch.nn.Parameter(torch.empty_like(self.weight))
            super().reset_parameters()


class zero_centered_gamma_ignored:
    class LayerNormLinear(impl.LayerNormLinear):
        """Takes ``zero_centered_gamma`` and forgets it: gamma is stored as is (one)."""

        def __init__(self, *args, zero_centered_gamma=False, **kw):
            super().__init__(*args, **kw)


BUGS = (
    "dtype_ignored",
    "explicit_device_loses",
    "reset_keeps_bias",
    "reset_keeps_fp8_state",
    "reset_ignores_queue",
    "reset_then_refuses",
    "repr_hides_delay",
    "repr_claims_fused",
    "copy_loses_delay",
    "deepcopy_shares",
    "copy_loses_fp8_state",
    "to_empty_drops_delay",
    "reset_like_torch_linear",
    "reset_replaces_parameters",
    "zero_centered_gamma_ignored",
)


def backend(bug: str) -> LibraryBackend:
    """splitgrad.impl with ``bug``'s modules in place of its own."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r}; expected one of {BUGS}")
    holder = globals()[bug]
    lib = types.ModuleType(f"planted_{bug}")
    for name in _EXPORTS:
        setattr(lib, name, getattr(holder, name, getattr(impl, name)))
    return LibraryBackend(f"planted-{bug}", lib=lib)
