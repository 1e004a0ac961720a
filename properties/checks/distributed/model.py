"""The model every distributed check builds, and the steps they share: :class:`Block` of the
package under test, its gradients by name, draining its entries, the loss and the data."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from splitgrad.distributed import in_shape_inference, split_modules

__all__ = [
    "RECIPES",
    "Block",
    "gradients",
    "clone",
    "drain_entries",
    "scale",
    "loss_of",
    "autocast",
    "make_recipe",
    "data",
    "sizes",
    "two_blocks",
]

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
    test (delayed, plain or fused) around a ``torch.nn.Linear`` (reduced from autograd's hooks).

    ``delay=False`` builds the same block without delay (the single-process baselines).
    ``microbatches_per_step``: pass ``is_first_microbatch=True`` to the first forward of every
    step (counting forwards, pipelining's shape-inference pass excluded), as a training loop with
    fused accumulation does; ``main_grad`` then starts from ``prefill_seed``'s random values,
    which the first micro-batch must overwrite. ``proj_twice``: ``proj`` is applied twice in
    every forward, ``x + proj(tanh(proj(tanh(gate(mlp(x))))))``, so each backward queues two of
    its entries (SPEC §4: a weight used twice in one graph); its first use passes
    ``is_first_microbatch=False`` (its entry runs second and must add to what the second use's
    overwrite left). ``tied``: a further delayed ``Linear`` ``out`` shares ``proj``'s weight
    (neither has a bias), ``x + out(tanh(proj(...)))``: one weight written by two modules'
    entries (drained ``out`` first, so ``out`` overwrites and every ``proj`` entry adds)."""

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
        self.microbatches_per_step = microbatches_per_step
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


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name: ``main_grad`` for fused GEMM weights, else ``.grad``."""
    fused = {
        id(p)
        for sm in split_modules(module)
        for name, p in sm.gemm_params
        if sm.uses_main_grad(name)
    }
    return {
        name: (p.main_grad if id(p) in fused else p.grad) for name, p in module.named_parameters()
    }


def clone(grads: dict) -> dict:
    return {k: None if v is None else v.detach().clone() for k, v in grads.items()}


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


def two_blocks(lib: Any, **options: Any) -> torch.nn.Sequential:
    """Blocks 0 and 1 of ``lib`` in sequence, at the high-precision sizes, built with
    ``options`` (:class:`Block`'s keywords)."""
    hidden, ffn, _ = sizes(None)
    return torch.nn.Sequential(*(Block(lib, hidden, ffn, i, **options) for i in range(2)))
