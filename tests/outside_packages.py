"""Toy outside packages for the harness's backend and plugin tests, written into a directory.

* ``renamed_ref``: ``splitgrad.reference`` under another name, whose modules refuse splitgrad's
  private ``gemm_weight_names()`` / ``gemm_bias_names()`` to any caller in
  ``splitgrad.properties`` (the harness must derive roles from SPEC's parameter names).
* ``no_split_api``: only ``Linear`` and ``GroupedLinear``, without ``delay_wgrad_compute``,
  ``backward_dw``, ``pending_wgrad_count`` or ``fp8_autocast`` (a package with part of SPEC's
  API).
* ``biased_bias``: ``renamed_ref`` whose ``Linear`` bias gradient is off by 2 % in both modes.
* ``gappy_buggy``: ``no_split_api`` whose ``Linear`` bias gradient is off by 2 % (missing API
  and a planted bug in one package).
* ``declares``: a ``Backend`` subclass (``class:declares:Backend``) over ``biased_bias`` that
  declares the bias deviation it has (P3) and a P1 deviation it does not have.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

RENAMED = '''
"""splitgrad.reference under another name; splitgrad's private helpers refused to the harness."""
import sys

from splitgrad import reference as _ref
from splitgrad.reference import fp8_autocast  # noqa: F401
from splitgrad.reference.fp8 import (  # noqa: F401
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
)

_PRIVATE = ("gemm_weight_names", "gemm_bias_names")


def _guarded(cls):
    class Guarded(cls):
        def __getattribute__(self, name):
            if name in _PRIVATE:
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if caller.startswith("splitgrad.properties"):
                    raise AttributeError(f"{name} is private to splitgrad (called from {caller})")
            return super().__getattribute__(name)

    Guarded.__name__ = Guarded.__qualname__ = cls.__name__
    return Guarded


Linear = _guarded(_ref.Linear)
LayerNormLinear = _guarded(_ref.LayerNormLinear)
LayerNormMLP = _guarded(_ref.LayerNormMLP)
GroupedLinear = _guarded(_ref.GroupedLinear)
'''

NO_SPLIT_API = '''
"""Linear and GroupedLinear without the split API: no delay option, no backward_dw, no queue, no
fp8_autocast. Gradients are those of the reference built without delay."""
from splitgrad import reference as _ref

_HIDDEN = ("backward_dw", "pending_wgrad_count", "need_backward_dw")


class _NoSplit:
    def __getattribute__(self, name):
        if name in _HIDDEN:
            raise AttributeError(f"{type(self).__name__} has no {name}")
        return super().__getattribute__(name)


class Linear(_NoSplit, _ref.Linear):
    def __init__(self, in_features, out_features, *, bias=True, params_dtype=None,
                 device=None, fuse_wgrad_accumulation=False, ub_bulk_wgrad=False):
        super().__init__(in_features, out_features, bias=bias, params_dtype=params_dtype,
                         device=device, fuse_wgrad_accumulation=fuse_wgrad_accumulation,
                         ub_bulk_wgrad=ub_bulk_wgrad)


class GroupedLinear(_NoSplit, _ref.GroupedLinear):
    def __init__(self, num_gemms, in_features, out_features, *, bias=True,
                 params_dtype=None, device=None, fuse_wgrad_accumulation=False):
        super().__init__(num_gemms, in_features, out_features, bias=bias,
                         params_dtype=params_dtype, device=device,
                         fuse_wgrad_accumulation=fuse_wgrad_accumulation)
'''

BIASED_BIAS = '''
"""renamed_ref with one bug in both modes: Linear's bias gradient contribution is 2 % large."""
import torch

from renamed_ref import *  # noqa: F403
from renamed_ref import Linear as _Linear


class Linear(_Linear):
    def forward(self, inp, is_first_microbatch=None):
        y = super().forward(inp, is_first_microbatch)
        if self.bias is not None and y.requires_grad:
            # Adds 0.02 * sum(dy) to the bias gradient, as if the wgrad closure scaled it.
            y = _Skew.apply(y, self.bias)
        return y


class _Skew(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        return dy, 0.02 * dy.reshape(-1, dy.shape[-1]).sum(0)
'''

GAPPY_BUGGY = '''
"""no_split_api with biased_bias's bug: Linear's bias gradient is 2 % large."""
from biased_bias import _Skew
from no_split_api import *  # noqa: F403
from no_split_api import Linear as _Linear


class Linear(_Linear):
    def forward(self, inp, is_first_microbatch=None):
        y = super().forward(inp, is_first_microbatch)
        return _Skew.apply(y, self.bias) if self.bias is not None and y.requires_grad else y
'''

DECLARES = '''
"""A Backend over biased_bias that declares the deviation it has (P3: the bias gradient) and
one it does not have (P1)."""
from splitgrad.properties.backends import Deviation, LibraryBackend


class Backend(LibraryBackend):
    deviations = (
        Deviation("P3", "bias gradient 2 % too large", matches="bias.grad"),
        Deviation("P1", "made up: outputs off by a bias (not true)"),
    )

    def __init__(self):
        super().__init__("declares", "biased_bias")
'''


def write_packages(root: Path) -> Path:
    """Write every toy package under ``root``; returns ``root`` (put it on ``sys.path``)."""
    for name, text in (
        ("renamed_ref", RENAMED),
        ("no_split_api", NO_SPLIT_API),
        ("biased_bias", BIASED_BIAS),
        ("gappy_buggy", GAPPY_BUGGY),
    ):
        pkg = root / name
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").write_text(textwrap.dedent(text))
    (root / "declares.py").write_text(textwrap.dedent(DECLARES))
    return root
