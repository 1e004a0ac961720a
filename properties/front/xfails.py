"""Expected failures an outside team keeps in its own repository: ``--splitgrad-xfails FILE``
for the pytest plugin, and ``--xfails FILE`` for ``splitgrad verify`` (:func:`add_option`,
:func:`apply_to_cells`).

In the spirit of array-api-tests' ``--xfails-file`` and scikit-learn's
``expected_failed_checks``. One cell per line, by its id (:func:`cell_id`: the same in
``splitgrad verify``'s output and JUnit and in the pytest plugin's), bare or as pytest shows it;
``#`` starts a comment, and the comment on the line (else the comment lines just above it) is
the reason shown with the result::

    # our backward_dw() overwrites .grad (tracked in mypkg#12)
    P4-Linear-bfloat16-none
    test_conformance.py::test_property[P6-Linear-bfloat16-none]
    P3-GroupedLinear-float32-none               # bias of empty groups, mypkg#15
    P1-Linear-bfloat16-all-path=scaled_mm
    test_api_complete                           # no hooks yet

Strict: a listed cell that fails is an expected failure (XFAIL); one that passes is a failure
(pytest's ``XPASS(strict)``), so a fixed deviation shows and its line gets removed. A listed cell
that this run does not select (narrowed by ``--splitgrad-module`` and the like) is ignored; a line
that names no cell of any run (a typo, a property that does not apply to that module) is an
error naming it and its line, before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

__all__ = [
    "ExpectedFailure",
    "XfailsFileError",
    "XFAIL",
    "API_COMPLETE",
    "parse_xfails",
    "load_xfails",
    "canonical_id",
    "cell_id",
    "result_id",
    "apply_to_cells",
    "add_option",
]

#: The status :func:`apply_to_cells` gives a listed cell that failed.
XFAIL = "xfail"
#: The plugin's test of the backend's API, listable like a cell.
API_COMPLETE = "test_api_complete"


class XfailsFileError(ValueError):
    """The expected-failures file cannot be read, or a line in it names no cell."""


@dataclasses.dataclass(frozen=True)
class ExpectedFailure:
    """One line of the file: the cell (canonical test id), why, and where it is written."""

    test_id: str
    reason: str
    source: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}"

    def describe(self) -> str:
        """``expected failure (FILE:LINE): reason``."""
        return f"expected failure ({self.where})" + (f": {self.reason}" if self.reason else "")


def cell_id(
    property_id: str,
    kind: str,
    dtype: str,
    recipe: str = "none",
    path: str = "default",
    autocast: str | None = None,
):
    """The canonical id of a cell: the plugin's ``test_property[...]`` parameter,
    ``P4-Linear-bfloat16-none`` (``-path=NAME`` appended for a forced path, ``-autocast=DTYPE``
    for a cell under torch.autocast)."""
    base = f"{property_id}-{kind}-{dtype}-{recipe}"
    if path != "default":
        base += f"-path={path}"
    return base if autocast is None else f"{base}-autocast={autocast}"


def result_id(cell: Any) -> str:
    """The id of a finished cell (:class:`~.campaign.CellResult`): its planned cell's
    :attr:`~.plan.PlannedCell.test_id`."""
    return cell_id(cell.property_id, cell.kind, cell.dtype, cell.recipe, cell.path, cell.autocast)


def _names() -> dict[str, Any]:
    from ..cases.case import AUTOCAST_DTYPES, DTYPES, KINDS
    from ..checks.paths import IMPL_PATHS
    from ..checks.registry import PROPERTIES
    from .plan import RECIPE_CHOICES

    return {
        "property": tuple(PROPERTIES),
        "kind": tuple(KINDS),
        "dtype": tuple(DTYPES),
        "recipe": tuple(RECIPE_CHOICES),
        "forced path": tuple(IMPL_PATHS),
        "autocast dtype": AUTOCAST_DTYPES,
    }


_GRAMMAR = "PROPERTY-KIND-DTYPE-RECIPE[-path=NAME][-autocast=DTYPE]"


def canonical_id(text: str) -> str:
    """The id of the cell ``text`` names: the id itself (``P4-Linear-bfloat16-none``), or as
    pytest shows it (``test_property[P4-Linear-bfloat16-none]``, with the file's node id in
    front or not), or ``test_api_complete``; raises :class:`XfailsFileError` saying what is
    wrong with it."""
    raw = text.strip()
    item = raw.rsplit("::", 1)[-1]
    if item == API_COMPLETE:
        return API_COMPLETE
    if item.startswith("test_property[") and item.endswith("]"):
        item = item[len("test_property[") : -1]
    parts = item.split("-")
    named = {}
    while len(parts) > 4 and "=" in parts[-1]:
        key, _, value = parts.pop().partition("=")
        named[key] = value
    path, autocast = named.pop("path", "default"), named.pop("autocast", None)
    if len(parts) != 4 or named or cell_id(*parts, path, autocast) != item:
        raise XfailsFileError(
            f"{raw!r} is not a cell id: expected {_GRAMMAR} (as splitgrad verify and pytest "
            "print it), or test_api_complete"
        )
    _check_names(raw, *parts, path, autocast)
    return item


def _check_names(raw, property_id, kind, dtype, recipe, path, autocast) -> None:
    from ..checks.paths import IMPL_PATHS
    from ..checks.registry import applicable

    names = _names()
    given = (
        ("property", property_id),
        ("kind", kind),
        ("dtype", dtype),
        ("recipe", recipe),
        ("forced path", None if path == "default" else path),
        ("autocast dtype", autocast),
    )
    for what, value in given:
        if value is not None and value not in names[what]:
            raise XfailsFileError(
                f"{raw!r}: unknown {what} {value!r}; expected one of {', '.join(names[what])}"
            )
    if not applicable(property_id, kind):
        raise XfailsFileError(f"{raw!r}: {property_id} does not apply to {kind}, no such cell")
    if path != "default" and not IMPL_PATHS[path].applies(kind):
        raise XfailsFileError(f"{raw!r}: forced path {path} does not apply to {kind}")


def parse_xfails(text: str, source: str = "<xfails>") -> dict[str, ExpectedFailure]:
    """The entries of an expected-failures file's ``text`` by canonical id; raises
    :class:`XfailsFileError` naming ``source``, the line and the id that names no cell, or a
    cell listed twice."""
    out: dict[str, ExpectedFailure] = {}
    pending: list[str] = []  # the comment block just above the next entry
    for number, line in enumerate(text.splitlines(), start=1):
        entry, _, comment = line.partition("#")
        entry, comment = entry.strip(), comment.strip()
        if not entry:
            pending = [*pending, comment] if comment else ([] if not line.strip() else pending)
            continue
        try:
            test_id = canonical_id(entry)
        except XfailsFileError as exc:
            raise XfailsFileError(f"{source}:{number}: {exc}") from None
        if test_id in out:
            raise XfailsFileError(
                f"{source}:{number}: {entry!r} is listed already at line {out[test_id].line}"
            )
        reason = comment or " ".join(pending)
        out[test_id] = ExpectedFailure(test_id, reason, source, number)
    return out


def load_xfails(path: str | Path) -> dict[str, ExpectedFailure]:
    """:func:`parse_xfails` of the file at ``path``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise XfailsFileError(f"cannot read the expected-failures file {path}: {exc}") from None
    return parse_xfails(text, str(path))


def apply_to_cells(cells: list[Any], expected: dict[str, ExpectedFailure]) -> list[str]:
    """Judge ``splitgrad verify``'s finished cells (:class:`~.campaign.CellResult`) against the
    expected failures, in place: a listed cell that failed, errored or deviated becomes
    :data:`XFAIL` (its message says why it was expected); a listed cell that passed becomes a
    ``FAIL`` saying ``XPASS(strict)``. n/a and blocked cells are left as they are. Returns one
    line per changed cell, for the run's summary."""
    from .campaign import DEVIATION, ERROR, FAIL, PASS

    notes = []
    for cell in cells:
        entry = expected.get(result_id(cell))
        if entry is None:
            continue
        if cell.status in (FAIL, ERROR, DEVIATION):
            cell.message = f"{entry.describe()} | {cell.status}: {cell.message}"
            cell.status = XFAIL
            notes.append(f"XFAIL {result_id(cell)}: {entry.describe()}")
        elif cell.status == PASS:
            cell.status = FAIL
            cell.message = (
                f"XPASS(strict): listed as an {entry.describe()}, but it passed; remove the line"
            )
            notes.append(f"XPASS(strict) {result_id(cell)}: {entry.where}")
    return notes


def _entries_of(path: str) -> dict[str, ExpectedFailure]:
    try:
        return load_xfails(path)
    except XfailsFileError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_option(parser: argparse.ArgumentParser, flag: str = "--xfails") -> None:
    """Add ``flag FILE`` to a command line (``splitgrad verify``): the file is read and checked
    while parsing, so a line that names no cell is a usage error (exit status 2) before anything
    runs, and the parsed value is the entries for :func:`apply_to_cells` (empty without it)."""
    parser.add_argument(
        flag,
        metavar="FILE",
        type=_entries_of,
        default={},
        help="cells expected to fail, one id per line (such as P4-Linear-bfloat16-none, as "
        "this command and pytest print it), '#' comments giving the reason; strict: a listed "
        "cell that passes fails as XPASS(strict)",
    )
