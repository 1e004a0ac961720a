"""Expected failures an outside team keeps in its own repository (``--xfails FILE``,
``--splitgrad-xfails FILE``; the file's format is in docs/harness.md): strict, a listed cell that
passes fails as ``XPASS(strict)``, and a line that names no cell is an error before anything runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

XFAIL = "xfail"
#: The plugin's test of the backend's API, listable like a cell.
API_COMPLETE = "test_api_complete"
_GRAMMAR = "PROPERTY-KIND-DTYPE-RECIPE[-path=NAME][-autocast=DTYPE]"


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


def canonical_id(text: str) -> str:
    """The id of the cell ``text`` names, bare or as pytest shows it (``test_property[...]``), or
    ``test_api_complete``; raises :class:`XfailsFileError` saying what is wrong with it."""
    from ..cases.case import AUTOCAST_DTYPES, DTYPES, KINDS
    from ..checks.paths import IMPL_PATHS
    from ..checks.registry import PROPERTIES, applicable
    from .plan import RECIPE_CHOICES, cell_id

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
    property_id, kind, dtype, recipe = parts
    given = (
        ("property", property_id, PROPERTIES),
        ("kind", kind, KINDS),
        ("dtype", dtype, DTYPES),
        ("recipe", recipe, RECIPE_CHOICES),
        ("forced path", None if path == "default" else path, IMPL_PATHS),
        ("autocast dtype", autocast, AUTOCAST_DTYPES),
    )
    for what, value, names in given:
        if value is not None and value not in names:
            raise XfailsFileError(
                f"{raw!r}: unknown {what} {value!r}; expected one of {', '.join(names)}"
            )
    if not applicable(property_id, kind):
        raise XfailsFileError(f"{raw!r}: {property_id} does not apply to {kind}, no such cell")
    if path != "default" and not IMPL_PATHS[path].applies(kind):
        raise XfailsFileError(f"{raw!r}: forced path {path} does not apply to {kind}")
    return item


def parse_xfails(text: str, source: str = "<xfails>") -> dict[str, ExpectedFailure]:
    """The entries of an expected-failures file's ``text`` by canonical id; raises
    :class:`XfailsFileError` naming ``source`` and the line of a bad or repeated entry."""
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
    """Judge verify's finished cells in place: a listed cell that failed, errored or deviated
    becomes :data:`XFAIL`, one that passed a ``FAIL`` (``XPASS(strict)``); a line per change."""
    from .campaign import DEVIATION, ERROR, FAIL, PASS

    notes = []
    for cell in cells:
        entry = expected.get(cell.test_id)
        if entry is None:
            continue
        why = entry.describe()
        if cell.status in (FAIL, ERROR, DEVIATION):
            cell.message = f"{why} | {cell.status}: {cell.message}"
            cell.status = XFAIL
            notes.append(f"XFAIL {cell.test_id}: {why}")
        elif cell.status == PASS:
            cell.status = FAIL
            cell.message = f"XPASS(strict): listed as an {why}, but it passed; remove the line"
            notes.append(f"XPASS(strict) {cell.test_id}: {entry.where}")
    return notes
