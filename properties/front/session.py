"""One conformance session, what ``splitgrad verify`` and the pytest plugin both run:
:class:`Options` chosen, :meth:`Session.open` loads the backend and plans the cells.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from ..backends import Backend, get_backend
from ..cases.case import DTYPES, KINDS, LOW_PRECISION_DTYPES
from ..cases.profiles import active_profile_name, load_profile
from ..checks.paths import ForcedPathBackend
from ..checks.registry import DISTRIBUTED_PROPERTIES, PROPERTIES
from .campaign import NA, CellResult, api_gaps, run_cell
from .plan import AUTOCAST_CHOICES, PATH_CHOICES, RECIPE_CHOICES, PlannedCell, plan_cells

DEFAULT_DTYPES = ("float32", "bfloat16")

#: The list options by flag: (field of :class:`Options`, what it may name, what one is called).
LIST_OPTIONS = {
    "module": ("modules", KINDS, "module"),
    "dtype": ("dtypes", DTYPES, "dtype"),
    "property": ("properties", list(PROPERTIES), "property"),
    "recipe": ("recipes", RECIPE_CHOICES, "recipe"),
    "impl-path": ("impl_paths", PATH_CHOICES, "impl path"),
    "autocast": ("autocasts", AUTOCAST_CHOICES, "autocast dtype"),
}


class OptionError(ValueError):
    """An option names nothing the harness knows; ``option`` is its flag (``impl-path``)."""

    def __init__(self, message: str, option: str = "") -> None:
        super().__init__(message)
        self.option = option


def load_backend(name: str) -> Backend:
    """:func:`~.backends.get_backend`; a name that is no backend is an :class:`OptionError`."""
    try:
        return get_backend(name)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Options:
    """What a session checks; empty choices and ``None`` mean the default (the default slices of
    :mod:`.plan`, the active profile, cpu but for transformer_engine)."""

    backend: str = "impl"
    modules: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    properties: tuple[str, ...] = ()
    recipes: tuple[str, ...] = ()
    impl_paths: tuple[str, ...] = ()
    autocasts: tuple[str, ...] = ()
    examples: int | None = None
    profile: str | None = None
    seed: int | None = None
    device: str | None = None
    threads: int = 1

    @classmethod
    def chosen(cls, lists: dict[str, Sequence[str] | None], **scalars) -> Options:
        """Options with list fields from raw values by flag (``{"module": ["Linear,Linear"]}``):
        comma-separated, repeats dropped, property ids in any case; an unknown name, or a value
        that names nothing, is an :class:`OptionError`."""
        fields = {}
        for flag, (field, allowed, what) in LIST_OPTIONS.items():
            values = lists.get(flag)
            items = [i.strip() for v in values or () for i in v.split(",")]
            items = [i.upper() if what == "property" else i for i in items if i]
            expected = f"expected one of {', '.join(allowed)}"
            if values and not items:
                raise OptionError(f"no {what} in {values[-1]!r}; {expected}", flag)
            for item in items:
                if what == "property" and item in DISTRIBUTED_PROPERTIES:
                    checks = DISTRIBUTED_PROPERTIES[item]
                    raise OptionError(
                        f"{item} runs on spawned ranks: splitgrad distributed --check {checks}",
                        flag,
                    )
                if item not in allowed:
                    raise OptionError(f"unknown {what} {item!r}; {expected}", flag)
            fields[field] = tuple(dict.fromkeys(items))
        return cls(**fields, **scalars)

    @property
    def device_name(self) -> str:
        return self.device or ("cuda" if self.backend == "transformer_engine" else "cpu")


@dataclasses.dataclass
class Session:
    """The backend and its planned ``cells``. ``unforceable``: forced paths the backend has no
    knob for, and why (their cells left out); ``fp8_asked``: missing FP8 API is a gap, not n/a."""

    options: Options
    backend: Backend
    profile: str
    properties: list[str]
    cells: list[PlannedCell]
    forced: dict[str, ForcedPathBackend]
    unforceable: dict[str, str]
    fp8_asked: bool

    @classmethod
    def open(cls, options: Options, backend: Backend | None = None) -> Session:
        """Load the backend (unless given), set torch's threads and hypothesis' profiles, plan."""
        backend = backend or load_backend(options.backend)
        torch.set_num_threads(options.threads)
        load_profile()
        properties = list(options.properties) or list(PROPERTIES)
        planned = plan_cells(
            list(options.modules) or list(KINDS),
            list(options.dtypes) or list(DEFAULT_DTYPES),
            properties,
            list(options.recipes),
            list(options.impl_paths) or None,
            options.examples,
            list(options.autocasts) or None,
        )
        forced = {
            c.path: ForcedPathBackend(backend, c.path) for c in planned if c.path != "default"
        }
        unforceable: dict[str, str] = {}
        cells = []
        for cell in planned:
            why_not = forced[cell.path].knob_missing(cell.kind) if cell.path != "default" else None
            if why_not:
                unforceable.setdefault(cell.path, why_not)
            else:
                cells.append(cell)
        fp8_asked = any(f != "none" for f in options.recipes) or any(
            c.recipe_label != "none" for c in cells if c.path != "default"
        )
        profile = options.profile or active_profile_name()
        return cls(options, backend, profile, properties, cells, forced, unforceable, fp8_asked)

    @property
    def device(self) -> str:
        return self.options.device_name

    @functools.cached_property
    def gaps(self) -> dict[str, tuple[str, list[str]]]:
        """The parts of SPEC's API the backend lacks that the chosen properties use."""
        return api_gaps(self.backend, self.properties, self.fp8_asked)

    def run(self, cell: PlannedCell) -> CellResult:
        """Run one cell's campaign (:func:`.campaign.run_cell`)."""
        if cell.property_id in ("P1", "P2", "P3") and cell.dtype not in LOW_PRECISION_DTYPES:
            fields = (cell.property_id, cell.kind, cell.dtype, cell.recipe_label)
            why = "no wider dtype to measure error against"
            return CellResult(*fields, status=NA, message=why, path=cell.path)
        return run_cell(
            self.forced[cell.path] if cell.path != "default" else self.backend,
            cell.property_id,
            cell.kind,
            cell.dtype,
            device=self.device,
            examples=cell.examples,
            profile=self.profile,
            recipes=cell.recipes,
            recipe_label=cell.recipe_label,
            seed=self.options.seed,
            fp8_asked=self.fp8_asked,
            autocast=cell.autocast,
        )
