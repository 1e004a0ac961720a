"""The memory one queued wgrad entry holds at real scale, computed exactly on fake tensors.

``python -m splitgrad.bench.entry_memory [--json PATH] [--markdown] [--device fake|cuda]``

A queued entry is what a zero-bubble schedule keeps alive between a micro-batch's B step
(``backward()``) and its W step (``backward_dw()``). Its size depends only on shapes, dtypes and
recipes, so fake tensors (sizes, no storage: :mod:`splitgrad.impl.fake_cuda`) give it exactly
at shapes no CPU could hold: hidden 8192, ffn 28672, 4096 tokens, for ``Linear`` (hidden -> ffn),
``LayerNormMLP`` and ``GroupedLinear`` with 64 experts, in bf16 and under each FP8 recipe.

Each row is measured, not derived: the module is stepped on fake CUDA tensors at sm90 (sm100
for MXFP8, whose scaled GEMM only runs there) with ``delay_wgrad_compute=True``, then every
reference the caller held (input, output, both gradients) is dropped, and what is still alive
among the storages created since the forward began is **held between B and W** (a dispatch
mode tracks each one by a weak reference). That must equal the bytes of the queued entry's own
tensors (checked), and is set against

* the **floor**: the wgrad operands themselves, x and dy per GEMM (LayerNormMLP: ln_out and
  d_fc1_out for fc1, act_out and dy for fc2), or under FP8 their FP8 copies plus the scales in
  their own format (one fp32 per tensor, one E8M0 byte per 32 values, one fp32 per 1x128
  tile); the bias gradient and scale-storage choices are what an entry adds on top;
* **torch's generic split** (``stage_backward_input`` / ``stage_backward_weight`` of
  ``torch.distributed.pipelining`` on the ``torch.nn`` twin), measured the same way on fake CPU
  tensors (the autograd engine runs there); FP8 has no ``torch.nn`` twin.

With ``--device cuda`` the same protocol runs on a real GPU with the autograd engine and real
allocations, which confirms the fake figures byte for byte (``ci/device.sh``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import torch
from splitgrad.impl._torch_compat import (
    dispatch_mode_base,
    fake_tensor_mode,
    pipelining_split,
    returns_alias,
    storage_key,
    tree_leaves,
)
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["Scale", "SCALE", "measure", "rows", "main", "markdown"]


@dataclasses.dataclass(frozen=True)
class Scale:
    """The shapes of the table: hidden and ffn sizes, tokens per micro-batch, and the experts of
    ``GroupedLinear``."""

    hidden: int = 8192
    ffn: int = 28672
    tokens: int = 4096
    experts: int = 64


SCALE = Scale()
KINDS = ("Linear", "LayerNormMLP", "GroupedLinear")
PRECISIONS = ("bf16", "delayed", "current", "mxfp8", "block")


class _LiveStorages(dispatch_mode_base()):
    """Every storage an operator creates inside the block, by weak reference."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not returns_alias(func):
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage_key(storage)
        if key not in self.refs:
            self.refs[key] = (StorageWeakRef(storage), storage.nbytes())

    def alive_bytes(self, leave_out: tuple[torch.Tensor, ...] = ()) -> int:
        """Bytes of the tracked storages still alive, but for those of ``leave_out``."""
        skip = {storage_key(t.untyped_storage()) for t in leave_out}
        return sum(n for k, (ref, n) in self.refs.items() if not ref.expired() and k not in skip)


def _module_state(module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """What B leaves that is not held for W: the ``.grad`` it wrote (norm parameters, results
    handed on) and the module's own FP8 state (amax histories and scales, created on first
    use and kept across steps)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    states = [t for st in module.fp8_states.values() for t in (st.amax_history, st.scale)]
    return (*grads, *states)


def _entry_bytes(module: torch.nn.Module) -> int:
    """Bytes of the distinct storages the module's queued entries hold."""
    seen: dict[int, int] = {}
    for entry in module._wgrad_store:
        for t in entry.saved:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage_key(storage)] = storage.nbytes()
    return sum(seen.values())


def splits(kind: str, precision: str, s: Scale) -> list[int] | None:
    """Tokens per expert: even (64 each), or for Float8BlockScaling, whose 1x128 tiles run
    along the tokens of each expert's wgrad, 128 tokens on each of the first 32 experts."""
    if kind != "GroupedLinear":
        return None
    if precision == "block":
        per, used = 128, s.tokens // 128
        return [per] * used + [0] * (s.experts - used)
    return [s.tokens // s.experts] * s.experts


def _recipe(precision: str):
    from splitgrad.reference import fp8

    return {
        "bf16": None,
        "delayed": fp8.DelayedScaling(),
        "current": fp8.Float8CurrentScaling(),
        "mxfp8": fp8.MXFP8BlockScaling(),
        "block": fp8.Float8BlockScaling(),
    }[precision]


def _build(kind: str, s: Scale, device: str, delay: bool = True) -> torch.nn.Module:
    import splitgrad.impl as impl

    kw = dict(params_dtype=torch.bfloat16, device=device, delay_wgrad_compute=delay)
    if kind == "Linear":
        return impl.Linear(s.hidden, s.ffn, **kw)
    if kind == "LayerNormMLP":
        return impl.LayerNormMLP(s.hidden, s.ffn, **kw)
    return impl.GroupedLinear(s.experts, s.hidden, s.ffn, **kw)


def _gemm_operands(kind: str, s: Scale, m_splits: list[int] | None) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every GEMM's wgrad operands x (rows, in) and dy (rows, out)."""
    t, h, f = s.tokens, s.hidden, s.ffn
    if kind == "Linear":
        return [(t, h, f)]
    if kind == "LayerNormMLP":
        return [(t, h, f), (t, f, h)]  # fc1: ln_out, d_fc1_out; fc2: act_out, dy
    return [(rows, h, f) for rows in m_splits]


def floor_bytes(kind: str, precision: str, s: Scale) -> int:
    """The wgrad operands alone (see the module docstring)."""
    total = 0
    for rows, k, n in _gemm_operands(kind, s, splits(kind, precision, s)):
        values = rows * (k + n)
        if precision == "bf16":
            total += 2 * values
        elif precision in ("delayed", "current"):
            total += values + 2 * 4  # FP8 bytes, one fp32 scale per tensor
        elif precision == "mxfp8":
            total += values + values // 32  # one E8M0 byte per 32 values along the tokens
        else:
            total += values + 4 * (values // 128)  # one fp32 per 1x128 tile
    return total


def _capability(precision: str) -> tuple[int, int]:
    return (10, 0) if precision == "mxfp8" else (9, 0)


def measure(kind: str, precision: str, s: Scale = SCALE, device: str = "fake") -> dict:
    """One row: bytes one entry holds, bytes alive between B and W, the floor."""
    from splitgrad.impl.fake_cuda import fake_cuda, module_step

    recipe = _recipe(precision)
    m_splits = splits(kind, precision, s)
    out_features = s.hidden if kind == "LayerNormMLP" else s.ffn
    if device == "fake":
        block = fake_cuda(_capability(precision))
    else:
        block = contextlib.nullcontext()
    with block:
        module = _build(kind, s, "cuda")
        if device != "fake":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        with _LiveStorages() as live:
            x = torch.empty(s.tokens, s.hidden, dtype=torch.bfloat16, device="cuda")
            dy = torch.empty(s.tokens, out_features, dtype=torch.bfloat16, device="cuda")
            if device == "fake":
                step = module_step(module, x, dy, m_splits, recipe)
                del step
            else:
                import splitgrad.impl as impl

                x.normal_()
                dy.normal_()
                leaf = x.requires_grad_(True)
                with impl.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                    y = module(leaf, m_splits) if m_splits is not None else module(leaf)
                y.backward(dy)
                del y, leaf
            del x, dy
            held = live.alive_bytes(leave_out=_module_state(module))
        entry = _entry_bytes(module)
        row = {
            "module": kind,
            "precision": precision,
            "entry_bytes": entry,
            "held_bytes": held,
            "floor_bytes": floor_bytes(kind, precision, s),
            "pending": module.pending_wgrad_count,
        }
        if device != "fake":
            torch.cuda.synchronize()
            # Weights' .grad are not written yet (delayed): what is allocated beyond the
            # module is what B left for W.
            row["allocated_bytes"] = torch.cuda.memory_allocated() - before
        del module
    return row


def generic_split_held(kind: str, s: Scale = SCALE) -> int:
    """Bytes torch's generic split keeps alive between its B and W steps on the ``torch.nn``
    twin (bf16), measured like :func:`measure` on fake CPU tensors."""
    stage_backward_input, _ = pipelining_split()
    nn = torch.nn
    kw = {"dtype": torch.bfloat16}
    with fake_tensor_mode():
        if kind == "Linear":
            twin = nn.Linear(s.hidden, s.ffn, **kw)
        elif kind == "LayerNormMLP":
            twin = nn.Sequential(
                nn.LayerNorm(s.hidden, **kw),
                nn.Linear(s.hidden, s.ffn, **kw),
                nn.GELU(approximate="tanh"),
                nn.Linear(s.ffn, s.hidden, **kw),
            )
        else:
            twin = nn.ModuleList(nn.Linear(s.hidden, s.ffn, **kw) for _ in range(s.experts))
        m_splits = splits(kind, "bf16", s)
        with _LiveStorages() as live:
            x = torch.empty(s.tokens, s.hidden, dtype=torch.bfloat16, requires_grad=True)
            if kind == "GroupedLinear":
                y = torch.cat([lin(xg) for lin, xg in zip(twin, x.split(m_splits))])
            else:
                y = twin(x)
            dy = torch.empty_like(y)
            dx, groups = stage_backward_input([y], [dy], [x], twin.parameters())
            del x, y, dy, dx
            held = live.alive_bytes()
        del groups, twin
    return held


def rows(
    s: Scale = SCALE,
    kinds: tuple[str, ...] = KINDS,
    precisions: tuple[str, ...] = PRECISIONS,
    device: str = "fake",
) -> list[dict]:
    """Every (module, precision) row, with the generic split's figure on the bf16 rows."""
    out = []
    for kind in kinds:
        generic = generic_split_held(kind, s) if device == "fake" and "bf16" in precisions else 0
        for precision in precisions:
            row = measure(kind, precision, s, device)
            if precision == "bf16" and generic:
                row["generic_held_bytes"] = generic
            out.append(row)
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def markdown(table: list[dict], s: Scale = SCALE) -> str:
    """The table as Markdown (docs/figures.md's)."""
    lines = [
        f"hidden {s.hidden}, ffn {s.ffn}, {s.tokens} tokens, GroupedLinear {s.experts} experts; "
        "MiB; one delayed backward() of bf16 parameters",
        "",
        "| module | precision | one entry (impl) | held B->W | floor | entry / floor "
        "| generic split held | generic / impl |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        generic = r.get("generic_held_bytes")
        g_text = _mib(generic) if generic else "n/a"
        ratio = f"{generic / r['held_bytes']:.2f}" if generic else "n/a"
        lines.append(
            f"| {r['module']} | {r['precision']} | {_mib(r['entry_bytes'])} | "
            f"{_mib(r['held_bytes'])} | {_mib(r['floor_bytes'])} | "
            f"{r['entry_bytes'] / r['floor_bytes']:.3f} | {g_text} | {ratio} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the table (``--markdown``: as Markdown); ``--json PATH`` also writes the rows."""
    parser = argparse.ArgumentParser(
        prog="python -m splitgrad.bench.entry_memory",
        description="Bytes one queued wgrad entry holds at real scale (fake tensors, or a GPU).",
    )
    parser.add_argument("--device", choices=("fake", "cuda"), default="fake")
    parser.add_argument("--modules", default=",".join(KINDS))
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in args.modules.split(",") if k)
    precisions = tuple(p for p in args.precisions.split(",") if p)
    bad = [k for k in kinds if k not in KINDS] + [p for p in precisions if p not in PRECISIONS]
    if bad:
        parser.error(f"unknown {', '.join(bad)}; modules: {KINDS}, precisions: {PRECISIONS}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "entry_memory: --device cuda, but torch.cuda.is_available() is False", file=sys.stderr
        )
        return 2
    table = rows(SCALE, kinds, precisions, args.device)
    bad_rows = [r for r in table if r["held_bytes"] != r["entry_bytes"] or r["pending"] != 1]
    print(markdown(table) if args.markdown else json.dumps(table, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"scale": dataclasses.asdict(SCALE), "device": args.device, "rows": table},
                f,
                indent=2,
            )
    for r in bad_rows:
        print(
            f"entry_memory: {r['module']} {r['precision']}: held between B and W "
            f"{r['held_bytes']} bytes != the entry's {r['entry_bytes']} (pending {r['pending']})",
            file=sys.stderr,
        )
    return 1 if bad_rows else 0


if __name__ == "__main__":
    sys.exit(main())
