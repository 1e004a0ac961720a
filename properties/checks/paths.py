"""Fast paths that are the default only on a GPU, forced on the CPU (docs/harness.md, "forced
fast paths"): :class:`ForcedPathBackend` sets the implementation's own knob on every module it
builds and counts the aten operator only the path calls, and :func:`forced_path_error` makes a
cell in which it never ran an error, not a pass. Each path's limits are its kernel's:
``torch._grouped_mm`` takes no float64 and wants 16-byte rows (drawn so by construction), the
CPU's ``torch._scaled_mm`` refuses the block-scaled recipes.

A path whose kernel exists only on a GPU runs on a CPU stand-in that the harness writes from the
kernel's documentation, never from the implementation: ``mxfp8_scaled`` hands MXFP8 GEMMs to
``torch.nn.functional.scaled_mm`` with scales in cuBLAS's swizzled layout, and
:func:`mx_scaled_mm_stand_in` decodes them by that layout (:func:`mx_scale_offset`), so a scale
in the wrong place changes the GEMM's values and the properties see it, where the fake-CUDA
trace (shapes and torch's meta checks only) cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any

import torch

from ..backends import Backend, BackendUnavailable
from ..cases.case import KINDS, RECIPE_FAMILIES, Case, MicroBatch, ModuleConfig
from ..cases.data import make_micro_batches, make_state


@dataclasses.dataclass(frozen=True)
class ImplPath:
    """One forced fast path: the module attribute that selects it and its value, the module
    kinds it applies to, the FP8 recipe names it runs under (``None``: high precision only),
    the dtypes, the feature-size multiple it needs and the aten operator only it calls.
    ``stand_in``: a context in which the CPU runs the path's GPU-only kernel, calling its
    argument once per kernel call (``operator`` then only names the kernel)."""

    name: str
    summary: str
    attribute: str
    value: Any
    kinds: tuple[str, ...]
    recipes: tuple[str, ...] | None = None
    dtypes: tuple[str, ...] = ("float32", "bfloat16", "float16", "float64")
    size_multiple: int = 1
    operator: str | None = None
    stand_in: Callable[[Callable[[], None]], contextlib.AbstractContextManager] | None = None

    def applies(self, kind: str) -> bool:
        return kind in self.kinds


IMPL_PATHS: dict[str, ImplPath] = {
    p.name: p
    for p in (
        ImplPath(
            "grouped",
            "GroupedLinear forward and dgrad as one torch._grouped_mm",
            "grouped_gemm",
            "grouped",
            ("GroupedLinear",),
            dtypes=("float32", "bfloat16", "float16"),
            size_multiple=8,
            operator="aten::_grouped_mm",
        ),
        ImplPath(
            "scaled_mm",
            "FP8 GEMMs through torch._scaled_mm (per-tensor recipes)",
            "fp8_gemm",
            "scaled_mm",
            KINDS,
            recipes=RECIPE_FAMILIES["delayed"] + RECIPE_FAMILIES["current"],
            dtypes=("float32", "bfloat16", "float16"),
            operator="aten::_scaled_mm",
        ),
        ImplPath(
            "recompute",
            "LayerNormMLP recomputes its activation in backward",
            "recompute_activation",
            True,
            ("LayerNormMLP",),
        ),
        ImplPath(
            "norm_cuda",
            "LayerNorm as CUDA's kernels take it: gamma/beta in the input's dtype, a zero-centred "
            "gamma shifted in fp32 copies of x",
            "norm_kernel",
            "cuda",
            ("LayerNormLinear", "LayerNormMLP"),
            dtypes=("bfloat16", "float16"),
            # With the knob set, every LayerNorm of a bf16/fp16 module takes the branch.
            operator="aten::native_layer_norm",
        ),
        ImplPath(
            "mxfp8_scaled",
            "MXFP8 GEMMs through F.scaled_mm (BlockWise1x32, SWIZZLE_32_4_4 scales), run by a "
            "CPU stand-in that reads the scales by cuBLAS's documented layout",
            "fp8_gemm",
            "scaled_mm",
            KINDS,
            recipes=RECIPE_FAMILIES["mxfp8"],
            dtypes=("float32", "bfloat16", "float16"),
            operator="F.scaled_mm BlockWise1x32 (CPU stand-in)",
            stand_in=lambda on_call: mx_scaled_mm_stand_in(on_call),
        ),
    )
}


# ---- MXFP8 scales in cuBLAS's layout, and a CPU stand-in for the block-scaled GEMM ----------
#
# cuBLAS documentation, "1D Block Scaling Factors Layout"
# (https://docs.nvidia.com/cuda/cublas/#d-block-scaling-factors-layout; the same layout is drawn
# in https://nvidia.github.io/cudnn-frontend/mxfp8-scale-factor-128x4-layout/ and indexed by
# nvmath-python's ``matmul.get_block_scale_offset``). An operand's scales, one per 32
# consecutive values along K, form an (outer, K/32) matrix. It is cut into blocks of 128 outer
# indices by 4 scales (padded to whole blocks), stored one after another in row-major block
# order (the K/32 direction fastest), 512 bytes each; inside a block the 128 outer indices are
# split as 4 groups of 32, and the block is stored as 32 lines of 16 bytes: line ``r % 32``
# holds, for each group ``r // 32`` in order, that row's 4 scales. torch calls this
# ``SwizzleType.SWIZZLE_32_4_4``.

MX_BLOCK = 32
_TILE_ROWS, _TILE_COLS = 128, 4


def mx_scales_size(rows: int, cols: int) -> int:
    """Bytes of the swizzled scales of ``rows`` outer indices by ``cols`` scales (padded)."""
    return -(-rows // _TILE_ROWS) * _TILE_ROWS * (-(-cols // _TILE_COLS) * _TILE_COLS)


def mx_scale_offset(row: int, col: int, cols: int) -> int:
    """Where the scale of outer index ``row``, K block ``col`` (of ``cols``) sits in the flat
    swizzled buffer, by the layout above: one index at a time, as the documentation states it."""
    tiles_per_row = -(-cols // _TILE_COLS)
    tile = (row // _TILE_ROWS) * tiles_per_row + col // _TILE_COLS
    inside = (row % 32) * 16 + (row % _TILE_ROWS // 32) * 4 + col % _TILE_COLS
    return tile * (_TILE_ROWS * _TILE_COLS) + inside


@functools.cache
def _mx_offsets(rows: int, cols: int) -> torch.Tensor:
    offsets = [mx_scale_offset(r, c, cols) for r in range(rows) for c in range(cols)]
    return torch.tensor(offsets, dtype=torch.long).reshape(rows, cols)


def mx_unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The (rows, cols) scales held by a swizzled buffer, as float32; a buffer of another size
    or dtype raises ``RuntimeError`` naming it (cuBLAS would read past it or misread it)."""
    if flat.dtype != torch.float8_e8m0fnu:
        raise RuntimeError(f"MXFP8 scales must be float8_e8m0fnu, got {flat.dtype}")
    want = mx_scales_size(rows, cols)
    if flat.numel() != want:
        raise RuntimeError(
            f"MXFP8 scales for ({rows}, {cols}) need {want} swizzled bytes, got {flat.numel()}"
        )
    return flat.reshape(-1)[_mx_offsets(rows, cols)].float()


def mx_scaled_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """``mat_a @ mat_b`` (A (M, K) row-major, B (K, N) column-major, FP8) with one E8M0 scale
    per 32 values along K, scales in the swizzled layout: fp32 products and sums, the bias added
    in fp32, one rounding to ``output_dtype`` (a block-scaled cuBLAS GEMM's arithmetic)."""
    (m, k), n = mat_a.shape, mat_b.shape[1]
    if mat_b.shape[0] != k or k % MX_BLOCK:
        raise RuntimeError(f"MXFP8 GEMM of A {tuple(mat_a.shape)} and B {tuple(mat_b.shape)}")
    if mat_a.stride(1) != 1 or mat_b.stride(0) != 1:
        raise RuntimeError("MXFP8 GEMM wants A row-major and B column-major")
    sa = mx_unswizzle(scale_a, m, k // MX_BLOCK).repeat_interleave(MX_BLOCK, dim=1)
    sb = mx_unswizzle(scale_b, n, k // MX_BLOCK).repeat_interleave(MX_BLOCK, dim=1)
    a = mat_a.float() * sa
    b_t = mat_b.t().float() * sb
    y = a @ b_t.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(output_dtype)


@contextlib.contextmanager
def mx_scaled_mm_stand_in(on_call: Callable[[], None]) -> Iterator[None]:
    """While open, ``torch.nn.functional.scaled_mm`` of CPU ``BlockWise1x32`` operands with
    ``SWIZZLE_32_4_4`` scales runs :func:`mx_scaled_mm` (``on_call`` first); every other call
    goes to torch. Restores torch's function on exit. A call made by a loaded
    ``scaled_mm_works`` (impl's probe of the kernel, on first use) runs without ``on_call``: a
    probe's own GEMMs are not the path running (a wrong scale layout fails the probe, the
    module keeps the dequantize path, and the cell must see that the forced path never ran)."""
    F = torch.nn.functional
    original = F.scaled_mm

    def scaled_mm(mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kw):
        mx = getattr(F.ScalingType, "BlockWise1x32", None)
        if mat_a.device.type != "cpu" or scale_recipe_a != mx:
            return original(
                mat_a, mat_b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, *args, **kw
            )
        names = ("swizzle_a", "swizzle_b", "bias", "output_dtype")
        opts = {**dict(zip(names, args)), **kw}
        swizzle = F.SwizzleType.SWIZZLE_32_4_4
        if scale_recipe_b != mx or opts.get("swizzle_a") != swizzle:
            raise RuntimeError("MXFP8 GEMM: both operands BlockWise1x32 with SWIZZLE_32_4_4")
        if opts.get("swizzle_b") != swizzle:
            raise RuntimeError("MXFP8 GEMM: both operands BlockWise1x32 with SWIZZLE_32_4_4")
        if not _called_by_a_probe():
            on_call()
        out_dtype = opts.get("output_dtype", torch.bfloat16)
        return mx_scaled_mm(mat_a, mat_b, scale_a, scale_b, opts.get("bias"), out_dtype)

    F.scaled_mm = scaled_mm
    _forget_scaled_mm_probes()
    try:
        yield
    finally:
        F.scaled_mm = original
        _forget_scaled_mm_probes()


def _called_by_a_probe() -> bool:
    """Whether a loaded ``fp8_gemm.scaled_mm_works`` is on the call stack."""
    probes = {probe.__wrapped__.__code__ for probe in _scaled_mm_probes()}
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in probes:
            return True
        frame = frame.f_back
    return False


def _scaled_mm_probes() -> list[Callable]:
    """Every loaded ``fp8_gemm.scaled_mm_works`` (impl's, and a copy's loaded as a ``path:``
    backend): a cached function."""
    probes = []
    for name, module in list(sys.modules.items()):
        if name == "fp8_gemm" or name.endswith(".fp8_gemm"):
            probe = getattr(module, "scaled_mm_works", None)
            if probe is not None and hasattr(probe, "cache_clear"):
                probes.append(probe)
    return probes


def _forget_scaled_mm_probes() -> None:
    """Clear the cached verdicts of every loaded probe (:func:`_scaled_mm_probes`): a verdict
    probed without the stand-in ("no MXFP8 GEMM on the CPU") must not keep the forced path from
    running under it, and one probed under it must not outlive it. Without this the cells'
    outcome depended on which test of the process probed first."""
    for probe in _scaled_mm_probes():
        probe.cache_clear()


def stand_in_missing() -> str | None:
    """Why this torch cannot host the MXFP8 stand-in (no ``F.scaled_mm`` / E8M0 dtype)."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm") or not hasattr(torch, "float8_e8m0fnu"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if not hasattr(F.ScalingType, "BlockWise1x32") or not hasattr(F, "SwizzleType"):
        return f"torch {torch.__version__} has no BlockWise1x32 / SwizzleType"
    return None


class _OperatorCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts calls of one aten operator; changes nothing else."""

    def __init__(self, owner: ForcedPathBackend) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == self.owner.path.operator:
            self.owner.operator_calls += 1
        return func(*args, **(kwargs or {}))


def _inner(name: str, counted: bool = False) -> Callable[..., Any]:
    """A :class:`ForcedPathBackend` method that calls the inner backend's ``name`` (counting
    the path's operator while it runs when ``counted``)."""

    def method(self: ForcedPathBackend, *args: Any, **kwargs: Any) -> Any:
        with self._running(counted):
            return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


class ForcedPathBackend(Backend):
    """``inner`` (a library backend with impl's knobs) with ``path`` forced on every module it
    builds. Everything else is delegated; :attr:`operator_calls` counts the path's operator."""

    def __init__(self, inner: Backend, path: str) -> None:
        if path not in IMPL_PATHS:
            raise ValueError(f"unknown impl path {path!r}; expected one of {', '.join(IMPL_PATHS)}")
        self.inner = inner
        self.path = IMPL_PATHS[path]
        self.name = inner.name
        self.supports_fused = inner.supports_fused
        self.deviations = inner.deviations
        self.notes = (*inner.notes, f"forced path {path}: {self.path.summary}")
        self.operator_calls = 0
        self._warmed: set[tuple[str, str | None, str]] = set()

    def _running(self, counted: bool) -> contextlib.AbstractContextManager:
        """The context a call to the inner backend runs in: the path's CPU stand-in (counting
        its calls when ``counted``), else the operator counter when ``counted``."""
        if self.path.stand_in is not None:
            return self.path.stand_in(self._count if counted else _nothing)
        counting = counted and self.path.operator is not None
        return _OperatorCounter(self) if counting else contextlib.nullcontext()

    def _count(self) -> None:
        self.operator_calls += 1

    def knob_missing(self, kind: str) -> str | None:
        """Why ``kind``'s modules cannot be forced onto the path (no such attribute)."""
        try:
            lib = getattr(self.inner, "lib", None)
        except BackendUnavailable:
            lib = None
        if lib is None:
            return (
                f"{self.inner.name} is an adapter, not a module library with a "
                f"{self.path.attribute} knob"
            )
        cls = getattr(lib, kind, None)
        if cls is None:
            return f"{self.inner.name} has no {kind}"
        try:
            sizes = (2, 8, 8) if kind == "GroupedLinear" else (8, 8)
            probe = cls(*sizes, delay_wgrad_compute=False)
        except Exception as exc:
            return f"cannot build a {kind} to look for its {self.path.attribute}: {exc!r}"
        if not hasattr(probe, self.path.attribute):
            return (
                f"{kind} has no {self.path.attribute} attribute: the {self.path.name} path "
                "cannot be forced"
            )
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if not self.path.applies(config.kind):
            return f"the {self.path.name} path does not apply to {config.kind}"
        if config.dtype not in self.path.dtypes:
            return f"the {self.path.name} path does not run in {config.dtype}"
        if self.path.recipes is not None and config.recipe is None:
            return f"the {self.path.name} path runs under FP8 recipes only"
        if self.path.recipes is None and config.recipe is not None:
            return f"the {self.path.name} path runs in high precision only"
        why = self.knob_missing(config.kind)
        if why is None and self.path.stand_in is not None:
            why = stand_in_missing()
        return why or self.inner.unsupported_reason(property_id, config)

    def cli_args(self) -> list[str]:
        return [*self.inner.cli_args(), "--impl-path", self.path.name]

    def p12_bitwise(self, config: ModuleConfig) -> bool:
        # Linears never take the grouped kernel: P12 is then a budget, not bitwise.
        return self.path.name != "grouped" and self.inner.p12_bitwise(config)

    def _warm_up(self, config: ModuleConfig) -> None:
        """One forward and backward on the path outside the counter, once per recipe kind: an
        implementation may probe the fast kernel on first use (impl's ``scaled_mm_works``), and
        the probe's own calls must not count as the path having run."""
        key = (config.kind, config.recipe, config.dtype)
        if key in self._warmed or self.path.operator is None:
            return
        self._warmed.add(key)
        module = self.inner.build(config, delay=False)
        setattr(module, self.path.attribute, self.path.value)
        self.inner.load_state(module, make_state(config, 0))
        rows = max(config.alignment, 2)
        grouped = config.kind == "GroupedLinear"
        splits = (rows,) + (0,) * (config.num_gemms - 1) if grouped else None
        (d,) = make_micro_batches(Case(config, (MicroBatch((rows,), splits),), 0))
        x = d.fresh_input()
        try:
            with self._running(False), self.inner.fp8_autocast(config):
                y = self.inner.forward(module, x, splits, None)
            with self._running(False):
                self.inner.backward(module, [y], [d.dy])
        except Exception:
            self._warmed.discard(key)  # a real failure shows in the checks themselves

    def build(self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False) -> Any:
        # The warm-up runs real tensors: not while torch's default device is meta (P18 builds
        # a module there with an explicit device, and runs nothing). Its module's initial
        # values come from torch's global RNG, which the caller may have just seeded (P18's
        # reset_parameters check): drawn on a fork of it.
        if self.path.applies(config.kind) and torch.get_default_device().type != "meta":
            device = torch.device(config.device)
            cuda = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=cuda):
                self._warm_up(config)
        module = self.inner.build(config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)
        if self.path.applies(config.kind):
            if not hasattr(module, self.path.attribute):
                raise BackendUnavailable(self.knob_missing(config.kind) or "no knob")
            setattr(module, self.path.attribute, self.path.value)
        return module

    def build_with_torch_defaults(
        self, config: ModuleConfig, *, delay: bool, omit: Collection[str]
    ) -> Any:
        module = self.inner.build_with_torch_defaults(config, delay=delay, omit=omit)
        if self.path.applies(config.kind) and hasattr(module, self.path.attribute):
            setattr(module, self.path.attribute, self.path.value)
        return module

    # Everything else is the inner backend's; the calls that run the module count the operator.
    unavailable_reason = _inner("unavailable_reason")
    missing_api = _inner("missing_api")
    deviation_for = _inner("deviation_for")
    module_protocol_reason = _inner("module_protocol_reason")
    reset_parameters = _inner("reset_parameters")
    to_empty = _inner("to_empty")
    parameters = _inner("parameters")
    load_state = _inner("load_state")
    torch_module = _inner("torch_module")
    parametrize = _inner("parametrize")
    pending_wgrad_count = _inner("pending_wgrad_count")
    register_hook = _inner("register_hook")
    has_hooks = _inner("has_hooks")
    fp8_autocast = _inner("fp8_autocast")
    fp8_state = _inner("fp8_state")
    fp8_quantizer = _inner("fp8_quantizer")
    constructor = _inner("constructor")
    forward = _inner("forward", counted=True)
    backward = _inner("backward", counted=True)
    grad = _inner("grad", counted=True)
    backward_dw = _inner("backward_dw", counted=True)

    @property
    def lib(self) -> Any:
        return getattr(self.inner, "lib", None)


def _nothing() -> None:
    pass


def forced_path_error(backend: Backend, calls_before: int, examples: int) -> str | None:
    """The message for a cell of ``examples`` examples in which ``backend``'s forced path never
    called its operator (``None``: it ran, or nothing to check)."""
    forced = isinstance(backend, ForcedPathBackend) and backend.path.operator is not None
    if not forced or examples == 0 or backend.operator_calls > calls_before:
        return None
    return (
        f"forced path {backend.path.name!r} never ran: {examples} example(s) and no call of "
        f"{backend.path.operator} (the implementation fell back to another path; the cell "
        "checked nothing of the path it was meant to)"
    )
