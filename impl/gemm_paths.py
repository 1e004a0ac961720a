"""Which GEMM path impl takes, and why: the probes' verdicts, the expected support per device
capability, and a recorder of every path decision.

impl has CUDA fast paths next to a portable path (:mod:`.gemm`, :mod:`.fp8_gemm`): fp32
``main_grad`` accumulation inside the GEMM (``out_dtype=``), ``torch._grouped_mm``, FP8
``torch._scaled_mm`` and the block-scaled ``torch.nn.functional.scaled_mm``. Whether a fast path
serves a call depends on three things, each answered here or next to the call:

* **what the device should support** (:func:`expected`): a table by compute capability and
  dtype, written from torch's own checks (``aten/src/ATen/native/cuda/ScaledBlas.cpp``,
  ``GroupMM``): per-tensor FP8 on sm89+, DeepSeek-style 1x128/128x128 blocks on sm90 only,
  MXFP8 (1x32 E8M0 blocks) on sm100, ``_grouped_mm`` in bf16 on sm90/sm100, a bf16/fp16 GEMM
  with an fp32 output wherever the running torch has ``addmm(out_dtype=)``;
* **what the device does support** (the probes: :func:`.gemm.cuda_out_dtype_supported`,
  :func:`.gemm._grouped_mm_available`, :func:`.fp8_gemm.scaled_mm_works`): one tiny kernel per
  (device, dtype or scaling kind), cached. Under :func:`capability_probes` (the fake-tensor trace
  tier, where no kernel can run) the probes answer from :func:`expected` instead;
* **whether the call's shape fits** (alignment), checked per call next to the GEMM.

A probe that fails on a real GPU where :func:`expected` says the path should run is a loud
:class:`FastPathMissed` warning naming the GEMM, the layout and the shape (an error when the
environment sets ``SPLITGRAD_REQUIRE_FAST_PATHS=1``, as ``ci/device.sh`` does).

Recording costs nothing unless asked for: a decision site checks :data:`RECORDERS` (an empty
list unless a :func:`recording` block is open) before building a :class:`Decision`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from collections.abc import Iterator

import torch

from . import _torch_compat

__all__ = [
    "Decision",
    "PathLog",
    "FastPathMissed",
    "RECORDERS",
    "recording",
    "note",
    "expected",
    "capability_of",
    "capability_probes",
    "probe_mode",
    "probe_verdict",
    "fast_path_missed",
    "gemm_role",
    "path_label",
    "missed_fast_paths",
]

#: Open :class:`PathLog` recorders (innermost last); empty unless :func:`recording` is active.
RECORDERS: list[PathLog] = []

_KERNEL, _CAPABILITY = "kernel", "capability"


@dataclasses.dataclass
class _ProbeState:
    mode: str = _KERNEL
    capability: tuple[int, int] | None = None


_STATE = _ProbeState()
#: (feature, device, dtype-or-kind) -> (runs, why): what each probe found, for the reports.
_VERDICTS: dict[tuple[str, str, str], tuple[bool, str]] = {}
#: Fast paths a real GPU refused where :func:`expected` said they run (one line each).
_MISSED: dict[tuple[str, str, str], str] = {}


class FastPathMissed(UserWarning):
    """A CUDA fast path that the device's capability says should run fell back."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """One path decision: which GEMM (``forward``, ``dgrad``, ``wgrad``, ``wgrad->main_grad``,
    ``grouped forward+dgrad``), the torch call chosen, its label (:func:`path_label`:
    ``"fast"``, ``"fallback"`` where a CUDA fast path exists but this call cannot take it,
    ``"forced"``, ``"portable"`` off CUDA, or ``"only"`` where there is one path), why, and
    where: device (with capability), operand dtype, the problem's ``(M, N, K)`` and the
    operand layouts the call hands over."""

    gemm: str
    call: str
    path: str
    reason: str
    device: str
    dtype: str
    shape: tuple[int, ...] = ()
    layout: str = ""

    def line(self) -> str:
        """One line for a report: ``gemm dtype device: call [path] (reason)``."""
        where = f" {self.layout}" if self.layout else ""
        shape = "x".join(map(str, self.shape))
        return (
            f"{self.gemm:<22}{self.dtype:<14}{self.device:<14}{self.path:<9}{self.call}"
            f"{where} {shape} ({self.reason})"
        )


class PathLog:
    """The distinct decisions seen while it was recording, with how often each was taken."""

    def __init__(self) -> None:
        self.counts: dict[Decision, int] = {}

    def add(self, decision: Decision) -> None:
        self.counts[decision] = self.counts.get(decision, 0) + 1

    @property
    def decisions(self) -> list[Decision]:
        return list(self.counts)

    def summary(self) -> list[dict]:
        """One dict per (gemm, call, path, reason, device, dtype, layout), shapes merged."""
        merged: dict[tuple, dict] = {}
        for d, n in self.counts.items():
            key = (d.gemm, d.call, d.path, d.reason, d.device, d.dtype, d.layout)
            row = merged.setdefault(
                key,
                {
                    "gemm": d.gemm,
                    "call": d.call,
                    "path": d.path,
                    "reason": d.reason,
                    "device": d.device,
                    "dtype": d.dtype,
                    "layout": d.layout,
                    "calls": 0,
                    "shapes": [],
                },
            )
            row["calls"] += n
            if d.shape and list(d.shape) not in row["shapes"]:
                row["shapes"].append(list(d.shape))
        return list(merged.values())

    def lines(self) -> list[str]:
        """The summary as aligned text lines (shapes: up to three, then a count)."""
        out = []
        for r in self.summary():
            shapes = ["x".join(map(str, s)) for s in r["shapes"]]
            more = f" +{len(shapes) - 3} more" if len(shapes) > 3 else ""
            where = f" {r['layout']}" if r["layout"] else ""
            out.append(
                f"{r['gemm']:<22}{r['dtype']:<14}{r['device']:<14}{r['path']:<9}{r['call']}{where}"
                f" [{', '.join(shapes[:3])}{more}] x{r['calls']} ({r['reason']})"
            )
        return out


@contextlib.contextmanager
def recording() -> Iterator[PathLog]:
    """Collect every path decision made inside the block into the yielded :class:`PathLog`."""
    log = PathLog()
    RECORDERS.append(log)
    try:
        yield log
    finally:
        RECORDERS.remove(log)


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return device.type
    cap = capability_of(device)
    return f"cuda sm{cap[0]}{cap[1]}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def note(
    gemm: str,
    call: str,
    path: str,
    reason: str,
    device: torch.device,
    dtype: torch.dtype,
    shape: tuple[int, ...] = (),
    layout: str = "",
) -> None:
    """Record one decision in every open recorder (call only when :data:`RECORDERS` is
    non-empty: building the record is the cost this module keeps off the hot path)."""
    decision = Decision(
        gemm, call, path, reason, _device_name(device), _dtype_name(dtype), tuple(shape), layout
    )
    for log in RECORDERS:
        log.add(decision)


def path_label(fast: bool, device: torch.device, forced: bool = False) -> str:
    """``"fast"``; else ``"portable"`` off CUDA (the portable path is the plan there),
    ``"forced"`` where the module asked for the portable path, ``"fallback"`` otherwise."""
    if fast:
        return "fast"
    if device.type != "cuda":
        return "portable"
    return "forced" if forced else "fallback"


def gemm_role(a_transposed: bool, b_transposed: bool) -> str:
    """Which GEMM of a linear layer ``op(a) @ op(b)`` is, from its operand orientation:
    ``x @ W^T`` forward, ``dy @ W`` dgrad, ``dy^T @ x`` wgrad."""
    if a_transposed:
        return "wgrad"
    return "forward" if b_transposed else "dgrad"


# ---- capability: what the device should support ----------------------------------------------


def capability_of(device: torch.device) -> tuple[int, int]:
    """The compute capability impl decides by: the capability :func:`capability_probes` set
    (trace tier), else the device's own."""
    if _STATE.capability is not None:
        return _STATE.capability
    return torch.cuda.get_device_capability(device)


def probe_mode() -> str:
    """``"kernel"`` (probes run a tiny kernel: every real run) or ``"capability"`` (probes
    answer from :func:`expected`: inside :func:`capability_probes` only)."""
    return _STATE.mode


def _has_out_dtype() -> bool:
    return "dtype_out" in torch.ops.aten.addmm.overloads()


def expected(feature: str, device: torch.device, what: object) -> tuple[bool, str]:
    """``(should run, why)`` for a fast path on ``device`` by its compute capability.

    ``feature``: ``"out_dtype"`` (``what``: the operand dtype), ``"grouped_mm"`` (the dtype),
    or ``"scaled_mm"`` (the scaling kind: ``"tensor"``, ``"mx"``, ``"block"``)."""
    if device.type != "cuda":
        return False, f"{device.type} has no such CUDA path"
    cap = capability_of(device)
    sm = f"sm{cap[0]}{cap[1]}"
    if feature == "out_dtype":
        if not _has_out_dtype():
            return False, f"torch {torch.__version__} has no addmm(out_dtype=)"
        if what == torch.float16 or (what == torch.bfloat16 and cap >= (8, 0)):
            return True, f"{_dtype_name(what)} operands, fp32 output: cuBLAS on {sm}"
        return False, f"{_dtype_name(what)} operands on {sm}: no fp32-output GEMM"
    if feature == "grouped_mm":
        if not _torch_compat.has_grouped_mm():
            return False, f"torch {torch.__version__} has no _grouped_mm"
        if what != torch.bfloat16:
            return False, f"{_dtype_name(what)}: the grouped GEMM serves bf16 only"
        if cap == (9, 0) or cap[0] == 10:
            return True, f"bf16 CUTLASS grouped GEMM on {sm}"
        return False, f"{sm}: torch's grouped GEMM kernels are for sm90 and sm100"
    if feature == "scaled_mm":
        if what == "tensor":
            if cap >= (8, 9):
                return True, f"per-tensor FP8 cuBLAS GEMM on {sm}"
            return False, f"{sm}: FP8 tensor cores need sm89+"
        if not hasattr(torch.nn.functional, "scaled_mm"):
            return False, f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
        if what == "mx":
            if cap[0] == 10:
                return True, f"MXFP8 block-scaled cuBLAS GEMM on {sm}"
            return False, f"{sm}: MXFP8 block scaling runs on sm100 only"
        if what == "block":
            if cap[0] == 9:
                return True, f"1x128/128x128 block-scaled cuBLASLt GEMM on {sm}"
            return False, f"{sm}: torch runs 1x128/128x128 block scaling on sm90 only"
    raise ValueError(f"unknown fast path {feature!r} / {what!r}")


@contextlib.contextmanager
def capability_probes(capability: tuple[int, int]) -> Iterator[None]:
    """Inside the block, CUDA probes answer from :func:`expected` at ``capability`` without
    running a kernel, and :func:`capability_of` reports ``capability``. Probe caches are
    emptied on entry and on exit, so no verdict crosses the block's edge either way."""
    if _STATE.mode != _KERNEL:
        raise RuntimeError("capability_probes blocks do not nest")
    _clear_probe_caches()
    _STATE.mode, _STATE.capability = _CAPABILITY, tuple(capability)
    try:
        yield
    finally:
        _STATE.mode, _STATE.capability = _KERNEL, None
        _clear_probe_caches()


def _clear_probe_caches() -> None:
    from . import fp8_gemm, gemm

    gemm.cuda_out_dtype_supported.cache_clear()
    gemm._grouped_mm_available.cache_clear()
    gemm.grouped_mm_choice.cache_clear()
    fp8_gemm.scaled_mm_works.cache_clear()
    _VERDICTS.clear()


def probe_verdict(feature: str, device: torch.device, what: object, runs: bool, why: str) -> bool:
    """Keep what a probe found (for :func:`fast_path_missed` and the reports); returns
    ``runs``."""
    _VERDICTS[(feature, str(device), str(what))] = (runs, why)
    return runs


def verdict(feature: str, device: torch.device, what: object) -> str:
    """Why the probe of ``feature`` said what it said (empty before it ran)."""
    return _VERDICTS.get((feature, str(device), str(what)), (True, ""))[1]


def fast_path_missed(feature: str, device: torch.device, what: object, call: str) -> None:
    """A call fell back because the probe refused a fast path: a :class:`FastPathMissed`
    warning (once per feature and device) if the capability says it should run, or the
    ``RuntimeError`` of the same text under ``SPLITGRAD_REQUIRE_FAST_PATHS=1``. ``call`` names
    the GEMM, its layout and shape."""
    if device.type != "cuda" or _STATE.mode != _KERNEL:
        return
    should, why_expected = expected(feature, device, what)
    if not should:
        return
    key = (feature, str(device), str(what))
    message = (
        f"splitgrad: {call} fell back to the portable path on {_device_name(device)}: the "
        f"{feature} ({what}) probe failed ({verdict(feature, device, what) or 'no verdict'}), "
        f"but the capability says it should run ({why_expected})"
    )
    if os.environ.get("SPLITGRAD_REQUIRE_FAST_PATHS") == "1":
        raise RuntimeError(message)
    if key not in _MISSED:
        _MISSED[key] = message
        warnings.warn(message, FastPathMissed, stacklevel=3)


def missed_fast_paths() -> list[str]:
    """Every :class:`FastPathMissed` message of this process so far (bench and verify print
    them; ``ci/device.sh`` fails on any)."""
    return list(_MISSED.values())
