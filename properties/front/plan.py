"""Which cells a campaign runs (property x module x dtype x FP8 recipe family x forced path x
autocast dtype), for ``splitgrad verify`` and the pytest plugin alike: the high-precision
campaign plus, at fewer examples per cell, an FP8 slice, a forced-path slice and an autocast one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from ..cases.case import AUTOCAST_DTYPES, LOW_PRECISION_DTYPES, RECIPE_FAMILIES, RECIPES
from ..checks.paths import IMPL_PATHS
from ..checks.registry import SPECS, applicable

# Drawn examples per cell, on top of its explicit cases; every differential example also runs
# the reference as its yardstick and truth (docs/figures.md has what the default run costs).
DEFAULT_EXAMPLES = 36
RECIPE_CHOICES = ("none", *RECIPE_FAMILIES, "all")
PATH_CHOICES = ("none", *IMPL_PATHS, "all")
# Drawn on top of the explicit case per recipe (10): 15 examples per FP8 cell.
FP8_SLICE_EXAMPLES = 5
# Properties whose explicit cases enumerate their finite dimensions draw at most this many more
# (P10: ~70 misuse x fused x delay x is_first_microbatch; P18: 25 substitutions x delay x fused).
ENUMERATED_DRAWN = {"P10": 10, "P18": 10}
FP8_SLICE_PROPERTIES = ("P1", "P2", "P3", "P4", "P6", "P10", "P12", "P13", "P17")
FP8_SLICE_DTYPES = ("bfloat16",)
PATH_SLICE_EXAMPLES = 15
PATH_SLICE_PROPERTIES = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P11", "P12", "P17")
PATH_SLICE_DTYPES = {"grouped": ("float32", "bfloat16"), "recompute": ("float32", "bfloat16")}
_PATH_SLICE_FP8 = ("P1", "P2", "P3", "P4", "P6", "P12", "P13", "P17")
AUTOCAST_CHOICES = ("none", *AUTOCAST_DTYPES, "all")
# The properties that run modules forward and backward in a training loop's way; the others
# (misuse, memory, grouped-vs-linear, FP8 quantizers) do not change under autocast.
AUTOCAST_PROPERTIES = ("P1", "P2", "P3", "P4", "P5", "P6", "P7", "P8", "P17")
AUTOCAST_SLICE_EXAMPLES = 5
# Reference and impl follow torch.autocast (SPEC §2); a package that does not fails the slice.
AUTOCAST_IN_DEFAULT_RUN = True
AUTOCAST_SLICE_DTYPES = ("bfloat16",)


def cell_id(
    property_id: str, kind: str, dtype: str, recipe: str, path: str, autocast: str | None
) -> str:
    """A cell's id in verify's output, JUnit and pytest: ``P4-Linear-bfloat16-none``, then
    ``-path=NAME`` for a forced path and ``-autocast=DTYPE`` under torch.autocast."""
    base = f"{property_id}-{kind}-{dtype}-{recipe}" + (f"-path={path}" if path != "default" else "")
    return base if autocast is None else f"{base}-autocast={autocast}"


@dataclasses.dataclass(frozen=True)
class PlannedCell:
    """One cell: ``recipes`` are the FP8 recipes drawn (``(None,)``: high precision), named
    ``recipe_label``; ``examples`` ``None``: the profile's count."""

    property_id: str
    kind: str
    dtype: str
    recipe_label: str
    recipes: tuple[str | None, ...]
    examples: int | None
    path: str = "default"
    autocast: str | None = None

    @property
    def test_id(self) -> str:
        """:func:`cell_id` of this cell."""
        return cell_id(
            self.property_id, self.kind, self.dtype, self.recipe_label, self.path, self.autocast
        )


class _Slice(NamedTuple):
    """Cells planned alike: every applicable (property, kind, dtype) of these."""

    label: str
    recipes: tuple[str | None, ...]
    properties: Sequence[str]
    dtypes: Sequence[str]
    examples: int | None
    path: str = "default"
    autocast: str | None = None


def _fewer(examples: int | None, most: int | None) -> int | None:
    """At most ``most`` drawn examples (``None``, the profile's count, stays ``None``)."""
    return examples if examples is None or most is None else min(examples, most)


def _among(items: Sequence[str], allowed, otherwise: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The ``items`` in ``allowed``, in order; ``otherwise`` when there are none."""
    return tuple(i for i in items if i in allowed) or otherwise


def plan_cells(
    kinds: Sequence[str],
    dtypes: Sequence[str],
    properties: Sequence[str],
    recipes: Sequence[str] = (),
    impl_paths: Sequence[str] | None = None,
    examples: int | None = DEFAULT_EXAMPLES,
    autocasts: Sequence[str] | None = None,
) -> list[PlannedCell]:
    """The cells of a campaign. ``recipes``, ``impl_paths`` and ``autocasts`` each replace the
    default run by full cells of what they name (``["none"]``: without that slice); empty or
    ``None``: the default run, whose forced-path and autocast slices need no ``recipes``."""
    only_autocast = autocasts and "none" not in autocasts
    slices = [] if only_autocast else _slices(dtypes, properties, recipes, impl_paths, examples)
    slices += _autocast_slices(properties, recipes, impl_paths, examples, autocasts)
    cells: list[PlannedCell] = []
    for s in slices:
        path = IMPL_PATHS.get(s.path)
        for pid in s.properties:
            fp8_only = SPECS[pid].fp8_only and s.label == "none"
            if fp8_only and (len(properties) > 1 or s.path != "default"):
                continue  # P13 needs FP8: only listed when asked for alone
            for kind in kinds:
                if not applicable(pid, kind) or (path is not None and not path.applies(kind)):
                    continue
                for dtype in s.dtypes:
                    high = pid in ("P1", "P2", "P3") and dtype not in LOW_PRECISION_DTYPES
                    if high and s.path != "default":
                        continue
                    drawn = _fewer(s.examples, ENUMERATED_DRAWN.get(pid))
                    cell = (pid, kind, dtype, s.label, s.recipes, drawn, s.path, s.autocast)
                    cells.append(PlannedCell(*cell))
    return cells


def _slices(dtypes, properties, recipes, impl_paths, examples) -> list[_Slice]:
    families = [r for r in recipes if r != "all"]
    if "all" in recipes:
        families += [f for f in RECIPE_FAMILIES if f not in families]
    paths = list(IMPL_PATHS) if impl_paths and "all" in impl_paths else list(impl_paths or ())
    paths = [p for p in paths if p != "none"]
    slices: list[_Slice] = []
    if not paths:
        for family in sorted(families or ["none"], key=lambda f: f != "none"):
            rs = (None,) if family == "none" else RECIPE_FAMILIES[family]
            slices.append(_Slice(family, rs, properties, dtypes, examples))
    fp8_dtypes = _among(dtypes, FP8_SLICE_DTYPES, FP8_SLICE_DTYPES)
    if not paths and not families:
        fp8_props = _among(properties, FP8_SLICE_PROPERTIES)
        n = _fewer(examples, FP8_SLICE_EXAMPLES)
        slices.append(_Slice("all", tuple(RECIPES), fp8_props, fp8_dtypes, n))
    if impl_paths is None and not families:
        n = _fewer(examples, PATH_SLICE_EXAMPLES)
        for name, path in IMPL_PATHS.items():
            if path.recipes is None:
                wanted = PATH_SLICE_DTYPES.get(name, ("bfloat16",))
                ds = _among(dtypes, set(wanted) & set(path.dtypes), wanted)
                props = _among(properties, PATH_SLICE_PROPERTIES)
                slices.append(_Slice("none", (None,), props, ds, n, name))
            else:
                props = _among(properties, _PATH_SLICE_FP8)
                slices.append(_Slice("all", path.recipes, props, fp8_dtypes, n, name))
    for name in paths:
        path = IMPL_PATHS[name]
        ds = _among(dtypes, path.dtypes, path.dtypes[:1])
        if path.recipes is None:
            slices.append(_Slice("none", (None,), properties, ds, examples, name))
            continue
        own = [f for f, rs in RECIPE_FAMILIES.items() if set(rs) & set(path.recipes)]
        for family in [f for f in families if f != "none"] or own:
            rs = tuple(r for r in RECIPE_FAMILIES[family] if r in path.recipes)
            if rs:
                slices.append(_Slice(family, rs, properties, ds, examples, name))
    return slices


def _autocast_slices(properties, recipes, impl_paths, examples, autocasts) -> list[_Slice]:
    if autocasts is None:
        if recipes or impl_paths is not None or not AUTOCAST_IN_DEFAULT_RUN:
            return []
        chosen, examples = AUTOCAST_SLICE_DTYPES, _fewer(examples, AUTOCAST_SLICE_EXAMPLES)
    else:
        chosen = AUTOCAST_DTYPES if "all" in autocasts else [a for a in autocasts if a != "none"]
    props = _among(properties, AUTOCAST_PROPERTIES)
    return [_Slice("none", (None,), props, ("float32",), examples, autocast=a) for a in chosen]
