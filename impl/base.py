"""What every impl module shares: options, validation (SPEC §5), gradient routing (§3), the
queue and its hooks (§4), and ``backward_dw(stream=None)``.

Each autograd Function builds one :class:`~.store.WgradEntry` per backward whose closure writes
every GEMM-parameter gradient itself (the Function returns ``None`` for them, in both modes).
Without delay the entry runs inside backward; with delay it is queued. The closure is the same
object either way, so delayed and non-delayed execute the same instructions and their gradients
are bitwise identical on any device (tied weights included: autograd never sums two uses).
Hooks fire after each entry's gradients are written: in :meth:`backward_dw` under delay, at the
end of the module's backward otherwise (GEMM gradients never reach autograd's AccumulateGrad, so
these hooks are the only signal a data-parallel wrapper gets).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable, Sequence

import torch
from splitgrad.reference.base import check_not_under_ddp
from splitgrad.reference.fp8 import Recipe, fp8_active_recipe

from . import gemm
from .fp8 import Float8Tensor
from .fp8_gemm import fp8_wgrad_write, pack, unpack
from .store import WeightGradStore, WgradEntry

__all__ = ["SplitBackwardModule", "FP8WgradPart", "check_positive"]


@dataclasses.dataclass
class FP8WgradPart:
    """One FP8 GEMM's share of a wgrad entry: ``weight`` gets ``q(dy)^T q(x)`` (None: frozen),
    ``bias`` gets ``db`` (None: no bias or frozen), summed from the unquantized dy in backward."""

    weight: torch.nn.Parameter | None
    bias: torch.nn.Parameter | None
    dy: Float8Tensor | None
    x: Float8Tensor | None
    db: torch.Tensor | None


def check_positive(name: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


class SplitBackwardModule(torch.nn.Module):
    """Base of the four impl modules."""

    #: How FP8 GEMMs run: ``"auto"``, ``"scaled_mm"`` or ``"dequantize"`` (see :mod:`.fp8_gemm`).
    fp8_gemm: str = "auto"

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
        # An exception, not an assert: it must hold under `python -O`.
        if ub_bulk_wgrad and delay_wgrad_compute:
            raise ValueError(
                "ub_bulk_wgrad is not supported when enabling delay_wgrad_compute "
                f"(got ub_bulk_wgrad={ub_bulk_wgrad!r}, "
                f"delay_wgrad_compute={delay_wgrad_compute!r})"
            )
        self.use_bias = bool(bias)
        self.params_dtype = params_dtype
        self._device = torch.device(device)
        self.fuse_wgrad_accumulation = bool(fuse_wgrad_accumulation)
        self.delay_wgrad_compute = bool(delay_wgrad_compute)
        # Userbuffers bulk overlap only matters across GPUs; in one process it changes nothing.
        self.ub_bulk_wgrad = bool(ub_bulk_wgrad)
        # FP8 delayed-scaling state (amax history and scale) by tensor role, e.g. "input" or
        # "fc1.grad_output" (same keys and layout as the reference's).
        self.fp8_states: dict = {}
        self._wgrad_store = WeightGradStore()
        self._wgrad_hooks: list[Callable[[], None]] = []

    # ---- parameters ---------------------------------------------------------------------

    def gemm_weight_names(self) -> list[str]:
        """Names of the GEMM weights (the parameters that use ``main_grad`` when fused)."""
        raise NotImplementedError

    def gemm_bias_names(self) -> list[str]:
        """Names of the GEMM biases (empty when built with ``bias=False``)."""
        raise NotImplementedError

    def _init_gemm_parameter_flags(self) -> None:
        if self.delay_wgrad_compute:
            for name in self.gemm_weight_names() + self.gemm_bias_names():
                getattr(self, name).skip_backward_post_hook = True

    # ---- validation (§5) ----------------------------------------------------------------

    def _check_input(self, inp: object, in_features: int) -> tuple[torch.Tensor, Recipe | None]:
        """Validate ``inp``; return it flattened to (rows, in_features) and the active FP8
        recipe (``None`` outside an enabled ``fp8_autocast``)."""
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

    def _check_main_grads(self, named_weights: Sequence[tuple[str, torch.nn.Parameter]]) -> None:
        """Fused accumulation needs a usable ``main_grad`` on each weight; raise before writing.

        Called at the start of backward and again at the start of every wgrad closure.
        """
        if not self.fuse_wgrad_accumulation:
            return
        for name, w in named_weights:
            mg = getattr(w, "main_grad", None)
            if not isinstance(mg, torch.Tensor):
                raise RuntimeError(
                    f"fuse_wgrad_accumulation=True but {name} has no main_grad tensor "
                    f"(got {type(mg).__name__}); attach an fp32 tensor of shape {tuple(w.shape)}"
                )
            if mg.shape != w.shape:
                raise RuntimeError(
                    f"{name}.main_grad has shape {tuple(mg.shape)}, expected {tuple(w.shape)}"
                )
            wide = w.dtype == torch.float64
            allowed = (torch.float32, torch.float64) if wide else (torch.float32,)
            if mg.dtype not in allowed:
                raise RuntimeError(f"{name}.main_grad has dtype {mg.dtype}, expected torch.float32")
            if mg.device != w.device:
                raise RuntimeError(f"{name}.main_grad is on {mg.device}, expected {w.device}")

    @staticmethod
    def _check_m_splits(m_splits: object, num_gemms: int, rows: int) -> list[int]:
        if not isinstance(m_splits, Sequence) or isinstance(m_splits, (str, bytes)):
            raise ValueError(f"m_splits must be a list of {num_gemms} ints, got {m_splits!r}")
        try:
            splits = [operator.index(s) for s in m_splits]
        except TypeError:
            raise ValueError(f"m_splits entries must be ints, got {list(m_splits)!r}") from None
        if len(splits) != num_gemms:
            raise ValueError(
                f"m_splits must have num_gemms={num_gemms} entries, got {len(splits)}: {splits}"
            )
        if any(isinstance(s, bool) for s in m_splits) or min(splits) < 0:
            raise ValueError(f"m_splits entries must be non-negative ints, got {splits}")
        if sum(splits) != rows:
            raise ValueError(f"m_splits {splits} sum to {sum(splits)}, but inp has {rows} rows")
        return splits

    # ---- gradient routing (§3) ------------------------------------------------------------

    def _write_weight_grad(
        self, param: torch.nn.Parameter, dy: torch.Tensor, x: torch.Tensor, overwrite: bool
    ) -> None:
        """Write ``dy^T x`` to ``param.main_grad`` (fused) or ``param.grad`` (plain)."""
        if self.fuse_wgrad_accumulation:
            gemm.wgrad_into_main_grad_(param.main_grad, dy, x, overwrite)
            if hasattr(param, "grad_added_to_main_grad"):
                param.grad_added_to_main_grad = True
        elif param.grad is None:
            param.grad = gemm.wgrad(dy, x)
        else:
            gemm.wgrad_accumulate_(param.grad, dy, x)

    @classmethod
    def _write_bias_grad(cls, param: torch.nn.Parameter, dy: torch.Tensor) -> None:
        """Write ``sum over rows of dy`` to ``param.grad`` (biases never use ``main_grad``)."""
        cls._write_bias_value(param, dy.sum(dim=0))

    @staticmethod
    def _write_bias_value(param: torch.nn.Parameter, db: torch.Tensor) -> None:
        """Set or accumulate an already reduced bias gradient into ``param.grad``."""
        if param.grad is None:
            param.grad = db
        else:
            param.grad.add_(db)

    def _submit_fp8_wgrad(
        self,
        parts: Sequence[FP8WgradPart],
        named_weights: Sequence[tuple[str, torch.nn.Parameter]],
        overwrite: bool,
    ) -> None:
        """Queue (or run) one entry that writes every part's weight and bias gradient, in order.

        The entry holds each part's two column-wise FP8 copies with their ``scale_inv`` and its
        reduced bias gradient; the closure captures layouts and parameters, no tensor."""
        quantized = []
        for part in parts:
            keep = part.weight is not None
            quantized += [part.dy if keep else None, part.x if keep else None]
        tensors, layouts = pack(*quantized)
        dbs = tuple(part.db if part.bias is not None else None for part in parts)
        targets = [(part.weight, part.bias) for part in parts]
        n = len(tensors)

        def wgrad_closure(*saved):
            self._check_main_grads(named_weights)
            operands = unpack(saved[:n], layouts)
            for i, (weight, bias) in enumerate(targets):
                if weight is not None:
                    dy_q, x_q = operands[2 * i], operands[2 * i + 1]
                    fp8_wgrad_write(self, weight, dy_q, x_q, overwrite)
                if bias is not None:
                    self._write_bias_value(bias, saved[n + i])

        params = tuple(p for pair in targets for p in pair if p is not None)
        self._submit_wgrad(WgradEntry(wgrad_closure, tensors + dbs, params))

    # ---- the queue (§4) -----------------------------------------------------------------

    @property
    def pending_wgrad_count(self) -> int:
        """How many weight-gradient entries wait for :meth:`backward_dw`."""
        return len(self._wgrad_store)

    def need_backward_dw(self) -> bool:
        """``True`` iff this module defers weight gradients (``delay_wgrad_compute=True``)."""
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, fn: Callable[[], None]) -> None:
        """Register ``fn()``, called with no arguments after each entry's gradients are written,
        in registration order."""
        if not callable(fn):
            raise TypeError(f"hook must be callable, got {fn!r}")
        self._wgrad_hooks.append(fn)

    def backward_dw(self, stream: torch.cuda.Stream | None = None) -> None:
        """Run the oldest queued weight-gradient entry (FIFO), then the hooks.

        No-op on a module built without delay; ``RuntimeError`` when nothing is pending. If the
        wgrad raises, nothing is written and the entry stays at the head of the queue; if a hook
        raises, the gradients are written, the entry is consumed and the error propagates.

        ``stream`` (CUDA only; ignored on CPU): run the wgrad GEMMs on this side stream so they
        overlap work already queued on the current stream (e.g. an all-to-all). The side stream
        first waits for the current stream (the operands are produced there); afterwards the
        current stream waits for the side stream, so whatever is queued *after* this call
        (hooks, optimizer) sees the gradients while work queued *before* it still overlaps.
        The entry's tensors are ``record_stream``-ed so the caching allocator does not hand
        their memory to the current stream while the side stream may still read them.
        """
        if not self.delay_wgrad_compute:
            return
        if not len(self._wgrad_store):
            raise RuntimeError(
                f"{type(self).__name__}.backward_dw(): nothing is pending "
                "(pending_wgrad_count=0); call it once per backward() of this module"
            )
        entry = self._wgrad_store.head()
        if stream is not None and _on_cuda(entry):
            _run_on_side_stream(entry, stream)
        else:
            entry.run()  # raises -> the entry stays at the head, nothing written
        self._wgrad_store.pop_and_release()
        del entry
        self._run_hooks()

    def _submit_wgrad(self, entry: WgradEntry) -> None:
        """Called at the end of the autograd backward: queue the entry, or run it now."""
        if self.delay_wgrad_compute:
            self._wgrad_store.push(entry)
            return
        entry.run()
        entry.release()
        self._run_hooks()

    def _run_hooks(self) -> None:
        for hook in list(self._wgrad_hooks):
            hook()


def _on_cuda(entry: WgradEntry) -> bool:
    return any(t is not None and t.is_cuda for t in entry.saved)


def _run_on_side_stream(entry: WgradEntry, stream: torch.cuda.Stream) -> None:
    """Run ``entry`` on ``stream`` with the event waits and allocator bookkeeping it needs."""
    main = torch.cuda.current_stream(stream.device)
    stream.wait_stream(main)
    with torch.cuda.stream(stream):
        entry.run()
    for t in entry.saved:
        if t is not None and t.is_cuda:
            t.record_stream(stream)
    for p in entry.params:
        # A .grad first created inside the side-stream block belongs to that stream's pool;
        # it is read on the current stream from now on.
        if p.grad is not None and p.grad.is_cuda:
            p.grad.record_stream(main)
    main.wait_stream(stream)
