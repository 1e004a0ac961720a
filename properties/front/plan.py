"""Which cells a campaign runs: property x module x dtype x FP8 recipe family x forced path.

``splitgrad verify`` and the pytest plugin both take their cells from :func:`plan_cells`, so a
CI job running the plugin sees the same cells (and test ids) as a ``verify`` run with the same
options.

The default run is the high-precision campaign plus two small slices:

* FP8: bf16, the recipe drawn from all of them per example, :data:`FP8_SLICE_EXAMPLES`
  examples per cell, the properties FP8 changes most (:data:`FP8_SLICE_PROPERTIES`);
* forced fast paths (:mod:`.paths`): each path that runs on the CPU, for every module it
  applies to, :data:`PATH_SLICE_EXAMPLES` examples per cell, every property that runs modules
  (:data:`PATH_SLICE_PROPERTIES`), in the dtypes of :data:`PATH_SLICE_DTYPES`.

* torch.autocast (SPEC §2): float32 modules with every forward under
  ``torch.autocast(device, dtype=torch.bfloat16)``, :data:`AUTOCAST_SLICE_EXAMPLES` examples
  per cell, the properties of :data:`AUTOCAST_PROPERTIES` (where users' mixed-precision runs
  are); in the default run only when :data:`AUTOCAST_IN_DEFAULT_RUN`.

``recipes`` (families), ``impl_paths`` and ``autocasts`` replace the slices by full cells:
``["delayed"]`` runs every property under delayed scaling, ``["grouped"]`` every property on
the forced grouped GEMM, ``["bfloat16"]`` every autocast property under a bf16 autocast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..cases.case import AUTOCAST_DTYPES, LOW_PRECISION_DTYPES, RECIPE_FAMILIES, RECIPES
from ..checks.paths import IMPL_PATHS
from ..checks.registry import SPECS, applicable

__all__ = [
    "PlannedCell",
    "plan_cells",
    "DEFAULT_EXAMPLES",
    "FP8_SLICE_EXAMPLES",
    "FP8_SLICE_PROPERTIES",
    "FP8_SLICE_DTYPES",
    "PATH_SLICE_EXAMPLES",
    "ENUMERATED_DRAWN",
    "PATH_SLICE_PROPERTIES",
    "PATH_SLICE_DTYPES",
    "RECIPE_CHOICES",
    "PATH_CHOICES",
    "AUTOCAST_CHOICES",
    "AUTOCAST_PROPERTIES",
    "AUTOCAST_SLICE_EXAMPLES",
    "AUTOCAST_SLICE_DTYPES",
]

# Drawn examples per cell, on top of its explicit cases (registry.explicit_cases: 4 boundary
# cases, one per recipe, P10's enumeration): every differential example also runs the
# reference as its yardstick and truth, and the default run stays near a minute on 2 cores.
DEFAULT_EXAMPLES = 36
RECIPE_CHOICES = ("none", *RECIPE_FAMILIES, "all")
PATH_CHOICES = ("none", *IMPL_PATHS, "all")
# Drawn on top of the explicit case per recipe (10): 15 examples per FP8 cell.
FP8_SLICE_EXAMPLES = 5
# Properties whose finite dimensions are enumerated in full by their explicit cases draw at
# most this many more (P10: ~70 enumerated misuse x fused x delay x is_first_microbatch; P18:
# 25 enumerated substitution kinds x delay x fused, several runs and truths each).
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
# The default run's slice: bf16 (the CPU's autocast dtype), drawn on top of the explicit cases.
AUTOCAST_SLICE_EXAMPLES = 5
# In the default run: reference and impl follow torch.autocast (SPEC §2); a package that does
# not fails it (or lists the cells in its expected-failures file).
AUTOCAST_IN_DEFAULT_RUN = True
AUTOCAST_SLICE_DTYPES = ("bfloat16",)


@dataclasses.dataclass(frozen=True)
class PlannedCell:
    """One cell: ``recipes`` are the FP8 recipe names drawn (``(None,)``: high precision),
    ``recipe_label`` names them in the table, ``examples`` is ``None`` for the profile's
    count, ``path`` the forced fast path (``"default"``: the implementation's own choice)."""

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
        """``P4-Linear-bfloat16-none`` (``-path=grouped`` appended for a forced path,
        ``-autocast=bfloat16`` for a float32 cell under torch.autocast)."""
        base = f"{self.property_id}-{self.kind}-{self.dtype}-{self.recipe_label}"
        if self.path != "default":
            base += f"-path={self.path}"
        return base if self.autocast is None else f"{base}-autocast={self.autocast}"


def _families(recipes: Sequence[str]) -> list[str]:
    out = [r for r in recipes if r != "all"]
    if "all" in recipes:
        out += [f for f in RECIPE_FAMILIES if f not in out]
    return out


def plan_cells(
    kinds: Sequence[str],
    dtypes: Sequence[str],
    properties: Sequence[str],
    recipes: Sequence[str] = (),
    impl_paths: Sequence[str] | None = None,
    examples: int | None = DEFAULT_EXAMPLES,
    autocasts: Sequence[str] | None = None,
) -> list[PlannedCell]:
    """The cells of a campaign (see the module docstring). ``recipes``: FP8 families from
    :data:`RECIPE_CHOICES` (empty: the default high precision + FP8 slice); ``impl_paths``:
    forced paths from :data:`PATH_CHOICES` (``None``: the default forced-path slices, unless
    ``recipes`` are given; ``["none"]``: none); ``autocasts``: autocast dtypes from
    :data:`AUTOCAST_CHOICES` (``None``: the default autocast slice unless ``recipes`` or
    ``impl_paths`` are given; ``["none"]``: none; otherwise only autocast cells, every
    :data:`AUTOCAST_PROPERTIES` property at the full count)."""
    cells = (
        _plan(kinds, dtypes, properties, recipes, impl_paths, examples)
        if not (autocasts and "none" not in autocasts)
        else []
    )
    cells += _plan_autocast(kinds, properties, recipes, impl_paths, examples, autocasts)
    return cells


def _plan_autocast(kinds, properties, recipes, impl_paths, examples, autocasts):
    if autocasts is None:
        if recipes or impl_paths is not None or not AUTOCAST_IN_DEFAULT_RUN:
            return []
        chosen: tuple[str, ...] = AUTOCAST_SLICE_DTYPES
        n = min(examples, AUTOCAST_SLICE_EXAMPLES) if examples is not None else None
    else:
        chosen = (
            AUTOCAST_DTYPES if "all" in autocasts else tuple(a for a in autocasts if a != "none")
        )
        n = examples
    cells = []
    for dtype in chosen:
        for pid in properties:
            if pid not in AUTOCAST_PROPERTIES:
                continue
            for kind in kinds:
                if applicable(pid, kind):
                    cells.append(
                        PlannedCell(pid, kind, "float32", "none", (None,), n, "default", dtype)
                    )
    return cells


def _plan(kinds, dtypes, properties, recipes, impl_paths, examples) -> list[PlannedCell]:
    families = _families(recipes)
    paths = list(IMPL_PATHS) if impl_paths and "all" in impl_paths else list(impl_paths or ())
    paths = [p for p in paths if p != "none"]
    only_paths = bool(paths)
    slices: list[tuple[str, tuple, tuple[str, ...], tuple[str, ...], int | None, str]] = []
    if not only_paths:
        if not families or "none" in families:
            slices.append(("none", (None,), tuple(properties), tuple(dtypes), examples, "default"))
        for family in families:
            if family != "none":
                slices.append(
                    (
                        family,
                        RECIPE_FAMILIES[family],
                        tuple(properties),
                        tuple(dtypes),
                        examples,
                        "default",
                    )
                )
        if not families:
            props = tuple(p for p in properties if p in FP8_SLICE_PROPERTIES)
            slice_dtypes = tuple(d for d in dtypes if d in FP8_SLICE_DTYPES) or FP8_SLICE_DTYPES
            n = min(examples, FP8_SLICE_EXAMPLES) if examples is not None else None
            slices.append(("all", tuple(RECIPES), props, slice_dtypes, n, "default"))
        if impl_paths is None and not families:
            n = min(examples, PATH_SLICE_EXAMPLES) if examples is not None else None
            for name, path in IMPL_PATHS.items():
                if path.recipes is None:
                    wanted = PATH_SLICE_DTYPES.get(name, ("bfloat16",))
                    ds = tuple(d for d in dtypes if d in wanted and d in path.dtypes) or wanted
                    props = tuple(p for p in properties if p in PATH_SLICE_PROPERTIES)
                    slices.append(("none", (None,), props, ds, n, name))
                else:
                    ds = tuple(d for d in dtypes if d in FP8_SLICE_DTYPES) or FP8_SLICE_DTYPES
                    props = tuple(p for p in properties if p in _PATH_SLICE_FP8)
                    slices.append(("all", path.recipes, props, ds, n, name))
    for name in paths:
        path = IMPL_PATHS[name]
        ds = tuple(d for d in dtypes if d in path.dtypes) or path.dtypes[:1]
        if path.recipes is None:
            slices.append(("none", (None,), tuple(properties), ds, examples, name))
        else:
            chosen = [f for f in families if f != "none"] or ["delayed", "current"]
            for family in chosen:
                rs = tuple(r for r in RECIPE_FAMILIES[family] if r in path.recipes)
                if rs:
                    slices.append((family, rs, tuple(properties), ds, examples, name))
    cells: list[PlannedCell] = []
    for label, rs, props, cell_dtypes, n, path_name in slices:
        path = IMPL_PATHS.get(path_name)
        for pid in props:
            spec = SPECS[pid]
            if spec.fp8_only and label == "none":
                if len(properties) > 1 or path_name != "default":
                    continue  # P13 needs FP8: only listed when asked for alone
            for kind in kinds:
                if not applicable(pid, kind) or (path is not None and not path.applies(kind)):
                    continue
                for dtype in cell_dtypes:
                    if pid in ("P1", "P2", "P3") and dtype not in LOW_PRECISION_DTYPES:
                        if path_name != "default":
                            continue
                    drawn = n if n is None else min(n, ENUMERATED_DRAWN.get(pid, n))
                    cells.append(PlannedCell(pid, kind, dtype, label, rs, drawn, path_name))
    return cells
