"""A small split-backward package written apart from splitgrad.impl, to point the distributed
checks (P14-P16) at an outside package that follows SPEC §2-§4 in its own way:

* its autograd Function never sees a delayed parameter: it takes detached copies of the GEMM
  weights and biases (legal, SPEC §8), so autograd never reaches them and no
  post-accumulate-grad hook of theirs fires; a per-module ``anchor`` (an empty tensor that
  requires grad, not a parameter) keeps the Function in the graph when its input needs no
  gradient, and tells, through ``get_gradient_edge`` and ``_will_engine_execute_node`` (SPEC §3),
  whether the running backward asks for parameter gradients at all;
* without delay it writes the GEMM gradients itself inside backward, one use at a time, and
  returns nothing for them (autograd would sum a tied weight's two uses before accumulating,
  which the delayed entries, run one by one, cannot match bitwise; SPEC §1, P7);
* every GEMM of one forward shares one entry object, queued by the first of them that runs
  backward: one entry per module per backward (``LayerNormMLP``: fc2 then fc1;
  ``GroupedLinear``: every group).

Packages (importable by name, as the checks import the package inside their spawned ranks):
``outside_distributed:correct``, and three planted bugs that a check comparing the package only
with itself would miss: ``outside_distributed:overwrites_grad`` (``backward_dw()`` assigns
``.grad`` instead of accumulating, TE #3437), ``outside_distributed:drops_bias`` (the delayed
bias gradient is never written) and ``outside_distributed:ignores_first_microbatch`` (fused
accumulation adds to ``main_grad`` even when the forward got ``is_first_microbatch=True``).
"""

from __future__ import annotations

import collections
import types

import torch
import torch.nn.functional as F

__all__ = ["make_package", "correct", "overwrites_grad", "drops_bias", "ignores_first_microbatch"]


class _Entry:
    """The queued weight-gradient work of one module for one backward: its GEMMs' parts."""

    def __init__(self, module: _SplitModule, first: bool | None) -> None:
        self.module = module
        self.first = bool(first)
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter, object]] = []
        self.queued = False


def _engine_will_accumulate(anchor: torch.Tensor) -> bool:
    edge = torch.autograd.graph.get_gradient_edge(anchor)
    return bool(torch._C._will_engine_execute_node(edge.node))


class _Gemm(torch.autograd.Function):
    """``y = x @ w^T + b`` of one GEMM; ``w``/``b`` are detached copies when delayed."""

    @staticmethod
    def forward(ctx, x, anchor, weight, bias, entry, params):
        ctx.save_for_backward(x, weight)
        ctx.entry, ctx.params = entry, params
        y = x @ weight.t()
        return y + bias if bias is not None else y

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        entry: _Entry = ctx.entry
        module = entry.module
        weight, bias = ctx.params
        dx = dy @ w if ctx.needs_input_grad[0] else None
        if module.delay_wgrad_compute:
            if _engine_will_accumulate(module.anchor) and (
                weight.requires_grad or (bias is not None and bias.requires_grad)
            ):
                entry.parts.append((dy, x, weight, bias))
                if not entry.queued:
                    entry.queued = True
                    module._entries.append(entry)
            return dx, None, None, None, None, None
        if _engine_will_accumulate(module.anchor):
            dw, db = _wgrad(dy, x, weight, bias)
            with torch.no_grad():
                if dw is not None:
                    module._write_weight(weight, dw, entry.first)
                if db is not None:
                    module._write_grad(bias, db)
        return dx, None, None, None, None, None


def _wgrad(dy, x, weight, bias):
    dw = dy.t() @ x if weight.requires_grad else None
    db = dy.sum(0) if bias is not None and bias.requires_grad else None
    return dw, db


class _SplitModule(torch.nn.Module):
    """The split-backward API shared by the modules (SPEC §4)."""

    _overwrite_grad = False
    _drop_bias = False
    _ignore_first = False

    def __init__(
        self,
        *,
        bias: bool = True,
        params_dtype: torch.dtype = torch.float32,
        device="cpu",
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        ub_bulk_wgrad: bool = False,
    ) -> None:
        super().__init__()
        if ub_bulk_wgrad and delay_wgrad_compute:
            raise ValueError("ub_bulk_wgrad is not supported when enabling delay_wgrad_compute")
        self.use_bias, self.params_dtype, self.device = bias, params_dtype, device
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.delay_wgrad_compute = delay_wgrad_compute
        self.ub_bulk_wgrad = ub_bulk_wgrad
        self.anchor = torch.empty(0, requires_grad=True)
        self._entries: collections.deque[_Entry] = collections.deque()
        self._hooks: list = []

    def _param(self, name: str, shape: tuple[int, ...], gemm: bool) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.empty(shape, dtype=self.params_dtype, device=self.device))
        with torch.no_grad():
            p.normal_(0, 0.1) if len(shape) == 2 else p.zero_()
        if gemm and self.delay_wgrad_compute:
            p.skip_backward_post_hook = True
        self.register_parameter(name, p)
        return p

    def _norm_params(self, features: int) -> None:
        """``layer_norm_weight`` (ones) and ``layer_norm_bias`` (zeros)."""
        self.layer_norm_weight = self._param("layer_norm_weight", (features,), False)
        self.layer_norm_bias = self._param("layer_norm_bias", (features,), False)
        with torch.no_grad():
            self.layer_norm_weight.fill_(1)

    def need_backward_dw(self) -> bool:
        return self.delay_wgrad_compute

    def register_wgrad_accumulation_and_reduce_hooks(self, fn) -> None:
        self._hooks.append(fn)

    @property
    def pending_wgrad_count(self) -> int:
        return len(self._entries)

    def _gemm(self, x, weight, bias, entry):
        if self.delay_wgrad_compute:
            w, b = weight.detach(), None if bias is None else bias.detach()
        else:
            w, b = weight, bias
        if self.fuse_wgrad_accumulation and weight.requires_grad:
            mg = getattr(weight, "main_grad", None)
            if not isinstance(mg, torch.Tensor) or mg.shape != weight.shape:
                raise RuntimeError(
                    f"fuse_wgrad_accumulation=True: parameter of shape {tuple(weight.shape)} "
                    "needs a main_grad of its shape"
                )
        return _Gemm.apply(x, self.anchor, w, b, entry, (weight, bias))

    def _write_weight(
        self, weight: torch.nn.Parameter, dw: torch.Tensor, first: bool, overwrite=False
    ) -> None:
        if self.fuse_wgrad_accumulation:
            if first and not self._ignore_first:
                weight.main_grad.copy_(dw)
            else:
                weight.main_grad.add_(dw)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
        else:
            self._write_grad(weight, dw, overwrite)

    def _write_grad(self, p: torch.nn.Parameter, g: torch.Tensor, overwrite=False) -> None:
        if p.grad is None or overwrite:
            p.grad = g
        else:
            p.grad += g

    def backward_dw(self) -> None:
        """Run the oldest queued entry (FIFO), then the registered hooks."""
        if not self.delay_wgrad_compute:
            return
        if not self._entries:
            raise RuntimeError("backward_dw(): nothing is pending")
        entry = self._entries[0]
        results = [(w, b, *_wgrad(dy, x, w, b)) for dy, x, w, b in entry.parts]
        self._entries.popleft()
        with torch.no_grad():
            for w, b, dw, db in results:
                if dw is not None:
                    self._write_weight(w, dw, entry.first, self._overwrite_grad)
                if db is not None and not self._drop_bias:
                    self._write_grad(b, db, self._overwrite_grad)
        entry.parts = []
        for fn in self._hooks:
            fn()

    def _rows(self, inp: torch.Tensor, features: int) -> torch.Tensor:
        if inp.shape[-1] != features:
            raise ValueError(f"expected last dimension {features}, got {inp.shape[-1]}")
        # The parameters' dtype now, not params_dtype: under FSDP2 mixed precision the
        # unsharded parameters (and the inputs FSDP2 casts) are in param_dtype.
        expected = next(self.parameters()).dtype
        if inp.dtype != expected and not torch.is_autocast_enabled():
            raise TypeError(f"expected input dtype {expected}, got {inp.dtype}")
        return inp.reshape(-1, features)


class Linear(_SplitModule):
    def __init__(self, in_features: int, out_features: int, **options) -> None:
        super().__init__(**options)
        self.in_features, self.out_features = in_features, out_features
        self.weight = self._param("weight", (out_features, in_features), True)
        self.bias = self._param("bias", (out_features,), True) if self.use_bias else None

    def forward(self, inp, is_first_microbatch=None):
        entry = _Entry(self, is_first_microbatch)
        y = self._gemm(self._rows(inp, self.in_features), self.weight, self.bias, entry)
        return y.reshape(*inp.shape[:-1], self.out_features)


class LayerNormLinear(_SplitModule):
    def __init__(self, in_features: int, out_features: int, *, eps=1e-5, **options) -> None:
        super().__init__(**options)
        self.in_features, self.out_features, self.eps = in_features, out_features, eps
        self._norm_params(in_features)
        self.weight = self._param("weight", (out_features, in_features), True)
        self.bias = self._param("bias", (out_features,), True) if self.use_bias else None

    def forward(self, inp, is_first_microbatch=None):
        x = self._rows(inp, self.in_features)
        h = F.layer_norm(
            x, (self.in_features,), self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
        y = self._gemm(h, self.weight, self.bias, _Entry(self, is_first_microbatch))
        return y.reshape(*inp.shape[:-1], self.out_features)


class LayerNormMLP(_SplitModule):
    def __init__(
        self, hidden_size: int, ffn_hidden_size: int, *, eps=1e-5, activation="gelu", **options
    ) -> None:
        super().__init__(**options)
        if activation not in ("gelu", "relu"):
            raise ValueError(f"activation must be 'gelu' or 'relu', got {activation!r}")
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.eps, self.activation = eps, activation
        self._norm_params(hidden_size)
        self.fc1_weight = self._param("fc1_weight", (ffn_hidden_size, hidden_size), True)
        self.fc1_bias = self._param("fc1_bias", (ffn_hidden_size,), True) if self.use_bias else None
        self.fc2_weight = self._param("fc2_weight", (hidden_size, ffn_hidden_size), True)
        self.fc2_bias = self._param("fc2_bias", (hidden_size,), True) if self.use_bias else None

    def forward(self, inp, is_first_microbatch=None):
        x = self._rows(inp, self.hidden_size)
        entry = _Entry(self, is_first_microbatch)
        h = F.layer_norm(
            x, (self.hidden_size,), self.layer_norm_weight, self.layer_norm_bias, self.eps
        )
        a = self._gemm(h, self.fc1_weight, self.fc1_bias, entry)
        a = F.gelu(a, approximate="tanh") if self.activation == "gelu" else F.relu(a)
        y = self._gemm(a, self.fc2_weight, self.fc2_bias, entry)
        return y.reshape(*inp.shape[:-1], self.hidden_size)


class GroupedLinear(_SplitModule):
    def __init__(self, num_gemms: int, in_features: int, out_features: int, **options) -> None:
        super().__init__(**options)
        if num_gemms < 1:
            raise ValueError(f"num_gemms must be >= 1, got {num_gemms}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        for i in range(num_gemms):
            self._param(f"weight{i}", (out_features, in_features), True)
        for i in range(num_gemms):
            if self.use_bias:
                self._param(f"bias{i}", (out_features,), True)

    def forward(self, inp, m_splits, is_first_microbatch=None):
        x = self._rows(inp, self.in_features)
        if (
            len(m_splits) != self.num_gemms
            or any(m < 0 for m in m_splits)
            or sum(m_splits) != x.shape[0]
        ):
            raise ValueError(f"m_splits {list(m_splits)} do not split {x.shape[0]} rows")
        entry = _Entry(self, is_first_microbatch)
        outs = [
            self._gemm(part, getattr(self, f"weight{i}"), getattr(self, f"bias{i}", None), entry)
            for i, part in enumerate(x.split(list(m_splits)))
        ]
        return torch.cat(outs).reshape(*inp.shape[:-1], self.out_features)


_MODULES = (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear)


def make_package(
    name: str, *, overwrite_grad: bool = False, drop_bias: bool = False, ignore_first: bool = False
):
    """A namespace with the four modules; the flags plant one bug each in the wgrad writes
    (``ignore_first``: in the non-delayed path too)."""
    pkg = types.ModuleType(f"outside_distributed.{name}")
    for cls in _MODULES:
        flags = {
            "_overwrite_grad": overwrite_grad,
            "_drop_bias": drop_bias,
            "_ignore_first": ignore_first,
        }
        variant = type(cls.__name__, (cls,), flags)
        variant.__module__ = __name__
        variant.__qualname__ = f"{name}.{cls.__name__}"
        setattr(pkg, cls.__name__, variant)
    pkg.__all__ = [cls.__name__ for cls in _MODULES]
    return pkg


correct = make_package("correct")
overwrites_grad = make_package("overwrites_grad", overwrite_grad=True)
drops_bias = make_package("drops_bias", drop_bias=True)
ignores_first_microbatch = make_package("ignores_first_microbatch", ignore_first=True)
