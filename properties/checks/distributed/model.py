"""The model every distributed check builds (:class:`Block` of the package under test), the
steps they share, and the single-process runs without delay they are compared with."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch
from splitgrad.distributed import in_shape_inference, split_modules

from .library import load_library

#: FP8 recipes by short name (the classes are looked up in the package under test).
RECIPES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "block": "Float8BlockScaling",
}
_WEIGHT_NAMES = ("weight", "fc1_weight", "fc2_weight")


class Block(torch.nn.Module):
    """``x + proj(tanh(gate(mlp(x))))``: a ``LayerNormMLP`` and a ``Linear`` of the package under
    test (delayed unless ``delay=False``, plain or ``fused``) around a ``torch.nn.Linear``.

    ``microbatches_per_step`` (fused only): the first forward of every step (pipelining's
    shape-inference pass not counted) passes ``is_first_microbatch=True`` and must overwrite
    ``main_grad``'s random start (``prefill_seed``). ``proj_twice``: ``proj`` is applied twice,
    so each backward queues two of its entries (SPEC §4); its first use passes
    ``is_first_microbatch=False`` (its entry runs second and must add to the overwrite).
    ``tied``: a further ``Linear`` ``out`` shares ``proj``'s weight (neither has a bias),
    ``x + out(tanh(proj(...)))``: one weight written by two modules' entries (drained ``out``
    first, so ``out`` overwrites and every ``proj`` entry adds)."""

    def __init__(
        self,
        lib,
        hidden: int,
        ffn: int,
        seed: int,
        *,
        fused: bool,
        dtype,
        value_dtype=None,
        microbatches_per_step: int | None = None,
        prefill_seed: int = 0,
        delay: bool = True,
        proj_twice: bool = False,
        tied: bool = False,
    ) -> None:
        super().__init__()
        kw = dict(params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
        self.mlp = lib.LayerNormMLP(hidden, ffn, **kw)
        self.gate = torch.nn.Linear(hidden, hidden, dtype=dtype)
        # tied: no bias on proj either, so the reducer can launch the shared weight alone
        self.proj = lib.Linear(hidden, hidden, bias=not tied, **kw)
        if tied:
            self.out = lib.Linear(hidden, hidden, bias=False, **kw)
            self.out.weight = self.proj.weight
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters(), key=lambda item: item[0]):
                # by name (any package's registration order draws the same values), rounded
                # to value_dtype first, so a float64 twin holds the same numbers
                value = (torch.randn(p.shape, generator=gen) * 0.3).to(value_dtype or dtype)
                p.copy_(value.to(dtype))
        self.microbatches_per_step = microbatches_per_step if fused else None
        self.proj_twice, self.tied = proj_twice, tied
        self._forwards = 0
        if fused:
            noise = torch.Generator().manual_seed(2000 + prefill_seed)
            for sm in split_modules(self):
                for name, p in sm.gemm_params:
                    if name in _WEIGHT_NAMES:
                        p.main_grad = (
                            torch.randn(p.shape, generator=noise)
                            if microbatches_per_step
                            else torch.zeros(p.shape)
                        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = None
        if self.microbatches_per_step and not in_shape_inference():
            first = self._forwards % self.microbatches_per_step == 0
            self._forwards += 1
        later = None if first is None else False  # an entry that runs after the overwrite
        h = torch.tanh(self.gate(self.mlp(x, is_first_microbatch=first)))
        if self.proj_twice:
            h = torch.tanh(self.proj(h, is_first_microbatch=later))
        if self.tied:
            h = torch.tanh(self.proj(h, is_first_microbatch=later))
            return x + self.out(h, is_first_microbatch=first)
        return x + self.proj(h, is_first_microbatch=first)


def blocks(
    lib: Any, indices: Iterable[int], recipe: str | None = None, **options: Any
) -> torch.nn.Sequential:
    """The Blocks ``indices`` of ``lib`` in sequence, at ``recipe``'s sizes, built with
    ``options`` (:class:`Block`'s keywords)."""
    hidden, ffn, _ = sizes(recipe)
    return torch.nn.Sequential(*(Block(lib, hidden, ffn, i, **options) for i in indices))


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name: ``main_grad`` for fused GEMM weights, else ``.grad``."""
    fused = {
        id(p) for sm in split_modules(module) for n, p in sm.gemm_params if sm.uses_main_grad(n)
    }
    return {n: p.main_grad if id(p) in fused else p.grad for n, p in module.named_parameters()}


def gradient_copies(module: torch.nn.Module, full: bool = False) -> dict[str, torch.Tensor | None]:
    """:func:`gradients`, each detached and copied (``full``: all-gathered from FSDP2's shards)."""
    copy = (lambda g: g.full_tensor()) if full else torch.Tensor.clone
    return {k: None if v is None else copy(v.detach()) for k, v in gradients(module).items()}


def drain_entries(module: torch.nn.Module, passes: int = 1) -> None:
    """Every entry of ``module``'s split modules, last module first. With ``passes`` > 1, one
    pass's entries of each module in turn, as the non-delayed backwards wrote them (a weight
    tied between two modules then accumulates in the non-delayed order, bitwise)."""
    modules = [sm.module for sm in reversed(split_modules(module))]
    per_pass = [m.pending_wgrad_count // passes for m in modules]
    for _ in range(passes):
        for m, k in zip(modules, per_pass):
            for _ in range(k):
                m.backward_dw()
    for m in modules:
        while m.pending_wgrad_count:
            m.backward_dw()


def scale(module: torch.nn.Module, factor: int) -> None:
    with torch.no_grad():
        for g in gradients(module).values():
            if g is not None:
                g.div_(factor)


def replica_mean(replicas: list[dict], n_mb: int) -> dict:
    """Per name, the replicas' sum divided by their count, then by ``n_mb``: the two divisions
    a data-parallel step makes; ``None`` where a replica has no gradient (reported by name where
    it is compared)."""
    out = {}
    for name in replicas[0]:
        grads = [r[name] for r in replicas]
        if any(g is None for g in grads):
            out[name] = None
        else:
            out[name] = sum(grads[1:], grads[0].clone()).div_(len(grads)).div_(n_mb)
    return out


def finish_error(reducer: Any) -> str | None:
    """Run ``reducer.finish()``: what it raised (a ``RuntimeError``), or ``None``."""
    try:
        reducer.finish()
    except RuntimeError as exc:
        return str(exc)
    return None


def loss_of(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(out.dtype, torch.float32)  # float64 truth stays float64
    return ((out.to(wide) - target.to(wide)) ** 2).mean()


def autocast(lib: Any, recipe: Any) -> contextlib.AbstractContextManager:
    """``fp8_autocast`` with ``recipe`` (one object per run: delayed scaling keeps its amax
    histories per recipe), or nothing."""
    if recipe is None:
        return contextlib.nullcontext()
    return lib.fp8_autocast(enabled=True, fp8_recipe=recipe)


def make_recipe(lib: Any, name: str | None) -> Any:
    return None if name is None else getattr(lib, RECIPES[name])()


def data(seed: int, rows: int, hidden: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    target = torch.randn(rows, hidden, generator=gen).to(dtype)
    return x, target


def sizes(recipe: str | None) -> tuple[int, int, int]:
    """(hidden, ffn, rows per micro-batch): multiples of 32 or 128 where the recipe needs them."""
    if recipe == "block":
        return 128, 128, 128
    if recipe == "mxfp8":
        return 32, 64, 32
    return 16, 32, 8


def without_delay(
    lib: Any, count: int, seeds: tuple[int, ...], n_mb: int, recipe: str | None = None, **options
) -> tuple[torch.nn.Sequential, list[torch.Tensor]]:
    """SPEC §7's baseline: Blocks ``0..count-1`` of ``lib`` without delay, run one after the
    other on each seed's ``n_mb`` micro-batches in one process as one step (only the very first
    micro-batch overwrites a fused ``main_grad``), on values rounded to ``options["value_dtype"]``
    and computed in ``options["dtype"]``. Returns the blocks and every micro-batch's loss."""
    hidden, _, rows = sizes(recipe)
    dtype, steps = options["dtype"], n_mb * len(seeds)
    model = blocks(
        lib,
        range(count),
        recipe,
        microbatches_per_step=steps,
        prefill_seed=99,
        delay=False,
        **options,
    )
    losses = []
    fp8_recipe = make_recipe(lib, recipe)
    for seed in seeds:
        x, target = data(seed, n_mb * rows, hidden, options["value_dtype"])
        for xb, tb in zip(x.to(dtype).split(rows), target.to(dtype).split(rows)):
            with autocast(lib, fp8_recipe):
                out = model(xb)
            loss = loss_of(out, tb)
            losses.append(loss.detach().clone())
            loss.backward()
            for b in reversed(model):
                drain_entries(b)
    return model, losses


def reference_runs(
    count: int, seeds: tuple[int, ...], n_mb: int, **options: Any
) -> tuple[torch.nn.Sequential, torch.nn.Sequential]:
    """:func:`without_delay` through ``splitgrad.reference`` (not the package under test, so a
    bug its delayed and non-delayed paths share still shows), gradients divided by the count of
    micro-batches: as ``options`` say (the naive yardstick), and plain in float64 (the truth)."""
    ref = load_library("reference")
    naive, _ = without_delay(ref, count, seeds, n_mb, **options)
    options.update(dtype=torch.float64, fused=False)
    truth, _ = without_delay(ref, count, seeds, n_mb, **options)
    for run in (naive, truth):
        scale(run, n_mb * len(seeds))
    return naive, truth
