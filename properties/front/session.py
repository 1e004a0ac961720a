"""One conformance session, built from options: what ``splitgrad verify`` and the pytest plugin
(:mod:`.pytest_plugin`, :mod:`.test_conformance`) both run.

:class:`Options` is what a user chose (each front-end reads its own flags into it through
:meth:`Options.chosen`); :meth:`Session.open` loads the backend, sets the thread count and
hypothesis profile, plans the cells (:func:`.plan.plan_cells`), wraps the forced-path backends and
leaves out the cells whose forced path the backend cannot take. Both front-ends then run the same
cells with the same ids (:attr:`.plan.PlannedCell.test_id`) through :meth:`Session.run`, and report
the same gaps in the backend's API (:attr:`Session.gaps`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

from ..backends import Backend, get_backend
from ..cases.case import LOW_PRECISION_DTYPES
from ..checks.paths import ForcedPathBackend
from .campaign import NA, CellResult, api_gaps, run_cell
from .plan import PlannedCell, plan_cells

__all__ = ["Options", "OptionError", "Session", "choose", "load_backend", "DEFAULT_DTYPES"]

#: The dtypes a session checks when none are chosen.
DEFAULT_DTYPES = ("float32", "bfloat16")


class OptionError(ValueError):
    """An option names nothing the harness knows (the message says what, and what would do);
    ``option`` is the option's name as a flag (``impl-path``)."""

    def __init__(self, message: str, option: str = "") -> None:
        super().__init__(message)
        self.option = option


def choose(values: Sequence[str] | None, allowed: Sequence[str], what: str) -> list[str]:
    """The items of ``values`` (each may be comma-separated; repeats dropped, order kept), each
    one of ``allowed`` (property ids in any case); raises :class:`OptionError` naming one that
    is not, or when ``values`` were given but name nothing (``--module ""``)."""
    if values and not any(item.strip() for v in values for item in v.split(",")):
        raise OptionError(f"no {what} in {values[-1]!r}; expected one of {', '.join(allowed)}")
    out: list[str] = []
    for value in values or ():
        for item in value.split(","):
            item = item.strip()
            if what == "property":
                item = item.upper()
            if not item or item in out:
                continue
            if item not in allowed:
                raise OptionError(f"unknown {what} {item!r}; expected one of {', '.join(allowed)}")
            out.append(item)
    return out


def _list_options() -> dict[str, tuple[Sequence[str], str, str]]:
    """The options that choose from a list: field of :class:`Options` -> (what it may name,
    what one item is called, the option's name as a flag)."""
    from ..cases.case import DTYPES, KINDS
    from ..checks.registry import PROPERTIES
    from .plan import AUTOCAST_CHOICES, PATH_CHOICES, RECIPE_CHOICES

    return {
        "modules": (KINDS, "module", "module"),
        "dtypes": (DTYPES, "dtype", "dtype"),
        "properties": (list(PROPERTIES), "property", "property"),
        "recipes": (RECIPE_CHOICES, "recipe", "recipe"),
        "impl_paths": (PATH_CHOICES, "impl path", "impl-path"),
        "autocasts": (AUTOCAST_CHOICES, "autocast dtype", "autocast"),
    }


def load_backend(name: str) -> Backend:
    """:func:`~.backends.get_backend`, its ``ValueError`` for a name that is no backend an
    :class:`OptionError`."""
    try:
        return get_backend(name)
    except ValueError as exc:
        raise OptionError(str(exc)) from None


@dataclasses.dataclass(frozen=True)
class Options:
    """What a session checks. Empty choices mean the default (every module kind and property,
    :data:`DEFAULT_DTYPES`, the default slices of :mod:`.plan`); ``examples`` is the drawn count
    per cell (``None``: the profile's); ``profile`` ``None``: the active one
    (:func:`.profiles.active_profile_name`); ``device`` ``None``: cpu, cuda for
    transformer_engine."""

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
        """Options whose list fields come from raw values (``lists["modules"] = ["Linear,
        GroupedLinear"]``; :func:`choose`); an :class:`OptionError` names the option."""
        fields = {}
        for field, (allowed, what, flag) in _list_options().items():
            try:
                fields[field] = tuple(choose(lists.get(field), allowed, what))
            except OptionError as exc:
                raise OptionError(str(exc), flag) from None
        return cls(**fields, **scalars)

    @property
    def device_name(self) -> str:
        return self.device or ("cuda" if self.backend == "transformer_engine" else "cpu")


@dataclasses.dataclass
class Session:
    """The backend, the planned ``cells`` and how each runs. ``forced``: the backend with each
    forced path; ``unforceable``: forced paths the backend has no knob for, and why (their cells
    are left out of ``cells``); ``fp8_asked``: FP8 counts as asked for (a recipe chosen, or a
    planned cell on a forced FP8 path), so missing FP8 API is a gap rather than n/a."""

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
        """Load the backend (unless given), set torch's intra-op threads, load the hypothesis
        profiles, and plan the cells."""
        import torch

        from ..cases.case import KINDS
        from ..cases.profiles import active_profile_name, load_profile
        from ..checks.registry import PROPERTIES

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
            # Forced paths need the implementation's knob: a backend without it has no such path.
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
        """The parts of SPEC's API the backend lacks that the chosen properties use
        (:func:`.campaign.api_gaps`)."""
        return api_gaps(self.backend, self.properties, self.fp8_asked)

    def backend_for(self, cell: PlannedCell) -> Backend:
        return self.forced[cell.path] if cell.path != "default" else self.backend

    def run(self, cell: PlannedCell) -> CellResult:
        """Run one cell's campaign (:func:`.campaign.run_cell`)."""
        if cell.property_id in ("P1", "P2", "P3") and cell.dtype not in LOW_PRECISION_DTYPES:
            return CellResult(
                cell.property_id,
                cell.kind,
                cell.dtype,
                cell.recipe_label,
                status=NA,
                message="no wider dtype to measure error against",
                path=cell.path,
            )
        return run_cell(
            self.backend_for(cell),
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
