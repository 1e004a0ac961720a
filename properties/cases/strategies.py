"""Typed hypothesis strategies for the conformance campaign.

Strategies draw *structure* only (kinds, sizes with 1 and primes, flags, dtypes, devices,
``m_splits`` with empty groups, schedules, layouts, seeds); every tensor value comes from the
seed (:mod:`.data`), so hypothesis shrinks shapes and flags, never float payloads. One tunable
limit, :data:`MAX_WORK` (env ``SPLITGRAD_MAX_WORK``), caps the multiply-adds of one example.
Rows are drawn under it by construction (no ``assume``), and so are the sizes block recipes
align (:func:`recipe_alignment`); being bigger, those get one or two units per feature size,
one unit of tokens per micro-batch (two for a ``GroupedLinear``) and at most three groups.
:func:`boundary_cases` gives the explicit cases every campaign cell runs before its drawn ones.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from hypothesis import strategies as st

from .case import (  # noqa: F401 (re-exported: the campaign names them from here)
    ACTIVATIONS,
    AUTOCAST_DTYPES,
    DTYPES,
    DY_LAYOUTS,
    EXPANDED_LAYOUTS,
    KINDS,
    LOW_PRECISION_DTYPES,
    MAX_WORK,
    NORM_KINDS,
    NORMALIZATIONS,
    RECIPE_FAMILIES,
    RECIPES,
    X_LAYOUTS,
    Case,
    MicroBatch,
    ModuleConfig,
    make_recipe,
    recipe_alignment,
    torch_dtype,
)


@functools.cache
def _sampled_from(values: tuple) -> st.SearchStrategy:
    """``st.sampled_from(values)``, one strategy object per tuple: hypothesis validates each new
    strategy object on its first draw, and composites draw from these on every example."""
    return st.sampled_from(values)


@functools.cache
def sizes(max_size: int = 17) -> st.SearchStrategy[int]:
    """Feature sizes: small ones (shrinking towards 1) or primes and powers of two."""
    special = [s for s in (5, 7, 8, 11, 13, 16, 17) if s <= max_size]
    return st.one_of(st.integers(1, min(4, max_size)), st.sampled_from(special or [1]))


def seeds() -> st.SearchStrategy[int]:
    """Seeds for ``torch.Generator``; shrink towards 0."""
    return st.integers(0, 2**31 - 1)


@st.composite
def m_splits(draw: st.DrawFn, num_gemms: int, max_rows: int, multiple: int = 1) -> tuple[int, ...]:
    """``num_gemms`` non-negative multiples of ``multiple`` summing to at most ``max_rows``
    (rounded up to two multiples under FP8); empty groups are common (each group is zero with
    probability about one half)."""
    budget = max_rows // multiple if multiple == 1 else max(2, max_rows // multiple)
    out = []
    for _ in range(num_gemms):
        n = draw(_group_size(max(0, min(budget, 6))))
        out.append(n * multiple)
        budget -= n
    return tuple(out)


@functools.cache
def _group_size(most: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(0), st.integers(0, most))


@functools.cache
def _norm_sizes() -> st.SearchStrategy[int]:
    return sizes().map(lambda k: k + 2)


@st.composite
def module_configs(
    draw: st.DrawFn,
    kinds: Sequence[str] = KINDS,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    devices: Sequence[str] = ("cpu",),
    fused: bool | None = None,
    bias: bool | None = None,
    square: bool = False,
    recipes: Sequence[str | None] = (None,),
) -> ModuleConfig:
    """A module configuration. ``fused``/``bias`` pin a flag when not ``None``; ``square`` makes
    the output width equal the input width (so the module can be chained on itself);
    ``recipes`` are the FP8 recipe names to draw from (``None``: high precision)."""
    kind = draw(_sampled_from(tuple(kinds)))
    recipe = draw(_sampled_from(tuple(recipes)))
    align = recipe_alignment(recipe)
    if align > 1:
        # Block recipes: one or two alignment units (128-wide blocks: one, to keep work down).
        units = st.integers(1, 2) if align < 128 else st.just(1)
        in_features = align * draw(units)
        out_features = in_features if square and kind != "LayerNormMLP" else align * draw(units)
    else:
        # A norm over 1 or 2 features outputs beta (or +-gamma + beta) whatever x is: dx is an
        # exact cancellation whose size only eps sets, so no rounding can be judged against it.
        in_features = draw(_norm_sizes() if kind in NORM_KINDS else sizes())
        out_features = in_features if square and kind != "LayerNormMLP" else draw(sizes())
    # GroupedLinear: several groups and biases first (shrinking towards 2 groups with biases),
    # so that early examples already have a group after an empty one, each with its own bias.
    groups = [2, 3, 1] if recipe is not None else [2, 3, 5, 1]
    grouped = kind == "GroupedLinear"
    if bias is None:
        bias = draw(_sampled_from((True, False)) if grouped else st.booleans())
    return ModuleConfig(
        kind=kind,
        in_features=in_features,
        out_features=out_features,
        num_gemms=draw(_sampled_from(tuple(groups))) if grouped else 1,
        bias=bias,
        fuse_wgrad_accumulation=draw(st.booleans()) if fused is None else fused,
        normalization=draw(_sampled_from(tuple(NORMALIZATIONS))),
        activation=draw(_sampled_from(tuple(ACTIVATIONS))) if kind == "LayerNormMLP" else "gelu",
        zero_centered_gamma=draw(st.booleans()) if kind in NORM_KINDS else False,
        dtype=draw(_sampled_from(tuple(dtypes))),
        device=draw(_sampled_from(tuple(devices))),
        recipe=recipe,
    )


def with_autocast(case: Case, autocast: str | None) -> Case:
    """``case`` run under ``torch.autocast`` to ``autocast`` (``None``: unchanged), its module in
    float32 (the parameters torch.autocast is used with)."""
    if autocast is None:
        return case
    config = dataclasses.replace(case.config, dtype="float32", autocast=autocast)
    return dataclasses.replace(case, config=config)


@st.composite
def micro_batches(
    draw: st.DrawFn, config: ModuleConfig, count: int, first_flags: bool = True
) -> tuple[MicroBatch, ...]:
    """``count`` micro-batches for ``config`` under :data:`MAX_WORK`. Non-grouped inputs get 1–3
    leading dimensions; ``GroupedLinear`` gets 2-D inputs with drawn ``m_splits``. Under a block
    recipe every token count is a multiple of its alignment (at least one unit)."""
    limit = max(1, MAX_WORK // (config.work_per_row() * max(1, count)))
    align = config.alignment
    out = []
    for _ in range(count):
        first = draw(_sampled_from((None, True, False))) if first_flags else None
        layouts = draw(_layouts())
        if config.kind == "GroupedLinear":
            splits = draw(m_splits(config.num_gemms, limit, align))
            out.append(MicroBatch((sum(splits),), splits, first, *layouts))
            continue
        if align > 1:
            rows = align * draw(st.integers(1, max(1, min(limit // align, 2))))
        else:
            rows = draw(st.integers(1, min(limit, 12)))
        shape: tuple[int, ...] = (rows,)
        if rows > 1 and draw(st.booleans()):
            # Split rows into (batch, seq) to exercise the flattening of leading dimensions.
            divisors = [d for d in range(1, rows + 1) if rows % d == 0]
            d = draw(_sampled_from(tuple(divisors)))
            shape = (d, rows // d)
        out.append(MicroBatch(shape, None, first, *layouts))
    return tuple(out)


@functools.cache
def _layouts() -> st.SearchStrategy[tuple[str, str]]:
    # Half of the draws keep the contiguous layout (shrinking to it); the rest are spread over
    # the others, so that random values still dominate dy.
    def one(names: tuple[str, ...]) -> st.SearchStrategy[str]:
        return st.one_of(st.just(names[0]), st.sampled_from(names[1:]))

    return st.tuples(one(X_LAYOUTS), one(DY_LAYOUTS))


@st.composite
def schedules(draw: st.DrawFn, n_micro_batches: int) -> tuple[str, ...]:
    """A legal interleaving for P6: ``"fb"`` (forward+backward of the next micro-batch),
    ``"dw"`` (``backward_dw`` while something is pending), ``"zero"`` (zero all gradients).
    Every micro-batch is run once; trailing ``"dw"`` steps drain the queue."""
    ops: list[str] = []
    pending = done = 0
    while done < n_micro_batches:
        choices = ["fb"] + (["dw"] if pending else []) + ["zero"]
        op = draw(_sampled_from(tuple(choices)))
        if op == "zero" and ops.count("zero") >= 2:
            op = "fb"
        ops.append(op)
        if op == "fb":
            done += 1
            pending += 1
        elif op == "dw":
            pending -= 1
    ops.extend(["dw"] * pending)
    return tuple(ops)


@st.composite
def cases(
    draw: st.DrawFn,
    *args: Any,
    n_micro_batches: tuple[int, int] = (1, 3),
    first_flags: bool = True,
    **kwargs: Any,
) -> Case:
    """A :class:`Case`: a config drawn by ``module_configs(*args, **kwargs)`` (kinds, dtypes,
    devices, flags, FP8 recipes), ``lo..hi`` micro-batches (``n_micro_batches``), a seed and a
    ``delay`` flag."""
    config = draw(module_configs(*args, **kwargs))
    count = draw(st.integers(*n_micro_batches))
    mbs = draw(micro_batches(config, count, first_flags=first_flags))
    return Case(config=config, micro_batches=mbs, seed=draw(seeds()), delay=draw(st.booleans()))


# (in_features, out_features) per pattern in units: high precision at the 16-element alignment
# edge of torch._grouped_mm / _scaled_mm (16 and 16 +- 1) and the smallest sizes; block recipes
# at one and two alignment units (the next multiple), 128-wide blocks at one unit only.
_EDGE_SIZES = ((16, 17), (17, 16), (15, 16), (1, 1))
_UNIT_SIZES = ((1, 2), (2, 1), (1, 1), (2, 2))
# Row counts per pattern (in alignment units under block recipes): a 1-row and a 0-row
# micro-batch, a (batch, seq) input, 1-row groups next to empty ones, an all-empty split.
_ROWS = (((1,), (0,)), ((2, 3), (1,)), ((0,), (2,)), ((1, 1), (3,)))
# Under block recipes: one unit of rows per micro-batch at most (a leading 1 stays 1).
_UNIT_ROWS = (((1,), (0,)), ((1, 1), (1,)), ((0,), (1,)), ((1,), (1,)))
_SPLITS = (
    (3, ((1, 0, 1), (0, 0, 0))),
    (2, ((0, 1), (1, 1))),
    (1, ((1,), (0,))),
    (3, ((2, 1, 0), (0, 0, 1))),
)


def _boundary_config(a: SimpleNamespace, i: int) -> ModuleConfig:
    """Case ``i``'s config: the pattern ``i % 4``, the ``i``-th kind, dtype, device and recipe."""
    kind, recipe, pattern = a.kinds[i % len(a.kinds)], a.recipes[i % len(a.recipes)], i % len(_ROWS)
    align = recipe_alignment(recipe)
    if align == 1:
        k, m = _EDGE_SIZES[pattern]
        if kind in NORM_KINDS:
            k = max(k, 3)  # a norm over 1-2 features has no judgeable dx (see module_configs)
    else:
        k, m = (u * align for u in _UNIT_SIZES[pattern if align < 128 else 2])
    return ModuleConfig(
        kind=kind,
        in_features=k,
        out_features=k if a.square and kind != "LayerNormMLP" else m,
        num_gemms=_SPLITS[pattern][0] if kind == "GroupedLinear" else 1,
        bias=pattern != 3 if a.bias is None else a.bias,
        fuse_wgrad_accumulation=pattern in (1, 2) if a.fused is None else a.fused,
        normalization=NORMALIZATIONS[pattern % 2],
        activation=ACTIVATIONS[pattern] if kind == "LayerNormMLP" else "gelu",
        zero_centered_gamma=kind in NORM_KINDS and pattern == 3,
        dtype=a.dtypes[i % len(a.dtypes)],
        device=a.devices[i % len(a.devices)],
        recipe=recipe,
    )


def _boundary_batches(
    config: ModuleConfig, pattern: int, count: int, first_flags: bool, slot: int, offset: int = 0
) -> tuple[MicroBatch, ...]:
    align = config.alignment
    if config.kind == "GroupedLinear":
        splits = list(_SPLITS[pattern][1])
        if align > 1 and pattern == 3:
            splits = [(0, 1, 1), (1, 0, 0)]  # at most two units of rows (see the docstring)
        shapes = [((align * sum(s),), tuple(align * n for n in s)) for s in splits]
    else:
        rows = _ROWS[pattern] if align == 1 else _UNIT_ROWS[pattern]
        # The last leading dimension carries the alignment units ((1, 1) -> (1, align)).
        shapes = [((*r[:-1], r[-1] * align), None) for r in rows]
    # A later round of cases with fewer micro-batches than shapes takes the next shapes.
    shapes = shapes[offset % len(shapes) :] + shapes[: offset % len(shapes)]
    while len(shapes) < count:
        shapes.append(shapes[len(shapes) % 2])
    out = []
    for j, (lead, splits_j) in enumerate(shapes[:count]):
        first = (True, False, None)[(pattern + j) % 3] if first_flags else None
        x, dy = X_LAYOUTS[(slot + j) % len(X_LAYOUTS)], DY_LAYOUTS[(slot + j) % len(DY_LAYOUTS)]
        out.append(MicroBatch(lead, splits_j, first, x, dy))
    return tuple(out)


def boundary_cases(
    *args: Any, n_micro_batches: tuple[int, int] = (1, 3), first_flags: bool = True, **kwargs: Any
) -> list[Case]:
    """The explicit cases a cell drawing :func:`cases` with these arguments always runs: four
    boundary patterns (0- and 1-row micro-batches and groups, an all-empty split, sizes at
    alignment edges, both norms, every activation, fused and plain, delay on and off), more when
    there are more recipes, so that every recipe of ``recipes`` and every kind of ``kinds`` is
    one of them; the micro-batches run through every input and output-gradient layout."""
    bound = inspect.signature(module_configs).bind(*args, **kwargs)
    bound.apply_defaults()
    a = SimpleNamespace(**bound.arguments)
    n = max(len(_ROWS), len(a.recipes), len(a.kinds))
    lo, hi = n_micro_batches
    out, slot = [], 0
    for i in range(n):
        pattern = i % len(_ROWS)
        config = _boundary_config(a, i)
        count = min(max(2, lo), hi)
        mbs = _boundary_batches(config, pattern, count, first_flags, slot, i // len(_ROWS))
        slot += count
        out.append(Case(config=config, micro_batches=mbs, seed=i, delay=pattern in (0, 1)))
    # Too few micro-batch slots to reach every layout (one micro-batch per case): more cases.
    while slot < len(DY_LAYOUTS):
        i = len(out) % n
        base = out[i]
        mbs = _boundary_batches(
            base.config, i % len(_ROWS), len(base.micro_batches), first_flags, slot, len(out) // n
        )
        slot += len(mbs)
        out.append(dataclasses.replace(base, micro_batches=mbs, seed=len(out)))
    return out
