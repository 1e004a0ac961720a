"""Test doubles for the FP8 budgets: the reference, perturbed in legal or in wrong ways.

* :class:`LegalFP8` — what a correct implementation may do differently: its norm and activation
  outputs land one rounding step away on a quarter of the elements (another kernel), and its
  FP8 GEMMs multiply exactly and round once (a scaled FP8 GEMM's accumulation). The FP8 budgets
  must pass it.
* :class:`WrongFP8` — one quantization bug (a scale a few percent off, saturation missing, the
  column-wise copy quantized along the wrong axis, wgrad fed the row-wise copy). The budgets
  (or P13) must catch it.

Both patch the reference's module-level functions only while their own forward, backward or
``backward_dw`` runs, so the naive reference and the truths of the same check stay untouched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from splitgrad.properties.backends import LibraryBackend
from splitgrad.reference import fp8_gemm, fp8_quant
from splitgrad.reference import functional as F

FRACTION = 0.25  # of the elements nudged (calibration scripts raise it)
_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def nudge(y: torch.Tensor) -> torch.Tensor:
    """``y`` with a seeded :data:`FRACTION` of its non-zero elements moved one step (ulp) away from
    zero or towards it (the seed is taken from the values, so equal inputs nudge equally)."""
    if y.dtype not in _INT or y.numel() == 0:
        return y
    seed = int(torch.nan_to_num(y.double()).abs().sum().item() * 1e6) % (2**31)
    g = torch.Generator().manual_seed(seed)
    pick = (torch.rand(y.shape, generator=g) < FRACTION) & (y != 0) & torch.isfinite(y)
    step = torch.where(torch.rand(y.shape, generator=g) < 0.5, 1, -1).to(_INT[y.dtype])
    bits = y.contiguous().view(_INT[y.dtype])
    return torch.where(pick, bits + step, bits).view(y.dtype)


class _Patched(LibraryBackend):
    """The reference with some patches active during its own forward/backward/backward_dw."""

    def __init__(self, name: str) -> None:
        super().__init__(name, "splitgrad.reference")

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        yield

    def forward(self, module, x, m_splits, is_first_microbatch):
        with self.patched():
            return super().forward(module, x, m_splits, is_first_microbatch)

    def backward(self, module, outputs, grads) -> None:
        with self.patched():
            super().backward(module, outputs, grads)

    def backward_dw(self, module) -> None:
        with self.patched():
            super().backward_dw(module)


@contextlib.contextmanager
def _setattr(obj, name: str, value) -> Iterator[None]:
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class LegalFP8(_Patched):
    """Norm/activation outputs a step off on 25% of the elements; exact-product FP8 GEMMs."""

    def __init__(self) -> None:
        super().__init__("reference-legal-fp8")

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        ln, rms, act = F.layer_norm_fwd, F.rms_norm_fwd, F.activation_fwd
        init = fp8_gemm.FP8Gemm.__init__

        def layer_norm_fwd(*args, **kw):
            y, *stats = ln(*args, **kw)
            return (nudge(y), *stats)

        def rms_norm_fwd(*args, **kw):
            y, *stats = rms(*args, **kw)
            return (nudge(y), *stats)

        def activation_fwd(h, activation):
            return nudge(act(h, activation))

        def exact_init(self, module, recipe, gemm=""):
            init(self, module, recipe, gemm)
            self.compute_dtype = torch.float64  # exact products, one rounding to the output

        with contextlib.ExitStack() as stack:
            stack.enter_context(_setattr(F, "layer_norm_fwd", layer_norm_fwd))
            stack.enter_context(_setattr(F, "rms_norm_fwd", rms_norm_fwd))
            stack.enter_context(_setattr(F, "activation_fwd", activation_fwd))
            stack.enter_context(_setattr(fp8_gemm.FP8Gemm, "__init__", exact_init))
            yield


WRONG = ("scale", "saturation", "axis", "wgrad-rowwise")


class WrongFP8(_Patched):
    """One quantization bug, ``bug`` in :data:`WRONG`:

    * ``scale``: every ``scale_inv`` 3% too large (dequantized values 3% off);
    * ``saturation``: values beyond the format's maximum are not clamped (they become NaN);
    * ``axis``: the column-wise copy (``axis=0``) is quantized along rows instead;
    * ``wgrad-rowwise``: wgrad multiplies the row-wise copies of dy and x (dgrad and forward
      are right).
    """

    def __init__(self, bug: str) -> None:
        if bug not in WRONG:
            raise ValueError(f"unknown bug {bug!r}; expected one of {WRONG}")
        super().__init__(f"reference-wrong-{bug}")
        self.bug = bug

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        quantize = fp8_gemm.quantize
        with contextlib.ExitStack() as stack:
            if self.bug == "scale":

                def off_scale(*args, **kw):
                    q = quantize(*args, **kw)
                    q.scale_inv = q.scale_inv * 1.03
                    return q

                stack.enter_context(_setattr(fp8_gemm, "quantize", off_scale))
            elif self.bug == "saturation":

                def unclamped(x, fmt):
                    return x.to(fp8_quant.FP8_DTYPES[fmt])

                stack.enter_context(_setattr(fp8_quant, "cast_to_fp8", unclamped))
            elif self.bug == "axis":

                def row_axis(x, recipe, role, axis, state=None):
                    if axis == 0 and isinstance(
                        recipe, (fp8_quant.MXFP8BlockScaling, fp8_quant.Float8BlockScaling)
                    ):
                        # Quantize along rows, but hand back a copy laid out like the original.
                        return quantize(x, recipe, role, 1, state)
                    return quantize(x, recipe, role, axis, state)

                stack.enter_context(_setattr(fp8_gemm, "quantize", row_axis))
            else:
                both = fp8_gemm.FP8Gemm._quantize_both

                def rowwise_for_wgrad(self, t, role):
                    row, col = both(self, t, role)
                    return row, (row if role in ("input", "grad_output") else col)

                stack.enter_context(_setattr(fp8_gemm.FP8Gemm, "_quantize_both", rowwise_for_wgrad))
            yield
