"""What every ``splitgrad`` subcommand shares on its command line, so they read alike: the
``--backend`` grammar (one parser, :func:`backend_spec`), comma-separated choices with their
accepted older spellings (:func:`pick`), and one way of refusing a command line (argparse's own:
the usage line, then ``splitgrad SUB: error: ...`` naming the value and the choices; exit
status 2), :func:`usage_error`. A command line that is fine but cannot run here (no CUDA, a
package that does not import) and a failure of the run print the one line
``splitgrad SUB: error: ...`` (exit status 2 and 1), :func:`run_error`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Mapping

from ..backends import BACKEND_NAMES

__all__ = [
    "BACKEND_FORMS",
    "BACKEND_HELP",
    "USAGE_ERROR",
    "backend_spec",
    "pick",
    "usage_error",
    "run_error",
]

#: Exit status of a refused command line (argparse's).
USAGE_ERROR = 2
#: The ``--backend`` forms beside the named backends: prefix -> (form, what the rest must be).
BACKEND_FORMS = {
    "path:": ("path:DIR", "a package directory with SPEC's API"),
    "module:": (
        "module:NAME[:ATTR]",
        "an importable package with SPEC's API, or an object in one holding its modules",
    ),
    "class:": ("class:MODULE:ATTR", "a splitgrad.properties.backends.Backend subclass"),
}
BACKEND_HELP = (
    f"what to run: {', '.join(BACKEND_NAMES)}, "
    + ", ".join(f"{form} ({what})" for form, what in BACKEND_FORMS.values())
    + " (default: impl)"
)


def _backend_choices() -> str:
    return ", ".join((*BACKEND_NAMES, *(form for form, _ in BACKEND_FORMS.values())))


def backend_spec(text: str) -> str:
    """argparse type of every subcommand's ``--backend``: ``text`` when it is one of
    :data:`BACKEND_NAMES` or a :data:`BACKEND_FORMS` form with its parts given (whether the
    package loads is checked later, once, before any work); ``ArgumentTypeError`` naming
    ``text`` and the valid forms otherwise. The rank commands' older ``NAME:ATTR`` is read as
    ``module:NAME:ATTR``."""
    if text in BACKEND_NAMES:
        return text
    module, colon, attr = text.partition(":")
    if colon and module and attr and f"{module}:" not in BACKEND_FORMS:
        return f"module:{text}"
    for prefix, (form, _) in BACKEND_FORMS.items():
        if not text.startswith(prefix):
            continue
        rest = text[len(prefix) :]
        module, _, attr = rest.rpartition(":") if prefix == "class:" else (rest, "", "x")
        if not rest or not module or not attr:
            raise argparse.ArgumentTypeError(f"{text!r} is incomplete; expected {form}")
        return text
    raise argparse.ArgumentTypeError(
        f"unknown backend {text!r}; expected one of {_backend_choices()}"
    )


def pick(
    flag: str,
    values: str | Iterable[str],
    what: str,
    allowed: Iterable[str],
    aliases: Mapping[str, str] | None = None,
    everything: str | None = "all",
) -> tuple[str, ...]:
    """The items of a comma-separated option (``values``: one string, or the strings of a
    repeated option), in order, without repeats, each an ``allowed`` name; an older spelling in
    ``aliases`` is read as the name it maps to, and ``everything`` (``all``) as every allowed
    name. ``ValueError`` naming the option, the first unknown item and the choices otherwise."""
    allowed = tuple(allowed)
    aliases = aliases or {}
    texts = [values] if isinstance(values, str) else list(values)
    items = [i.strip() for t in texts for i in t.split(",") if i.strip()]
    choices = ", ".join((*allowed, *((everything,) if everything else ())))
    if not items:
        raise ValueError(
            f"argument --{flag}: no {what} in {texts[-1]!r}; expected one of {choices}"
        )
    out: list[str] = []
    for item in items:
        if everything is not None and item == everything:
            out += allowed
            continue
        name = aliases.get(item, item)
        if name not in allowed:
            raise ValueError(
                f"argument --{flag}: unknown {what} {item!r}; expected one of {choices}"
            )
        out.append(name)
    return tuple(dict.fromkeys(out))


def usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Print a refusal as argparse prints its own (the usage line, then ``PROG: error: ...``) and
    return :data:`USAGE_ERROR`."""
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return USAGE_ERROR


def run_error(prog: str, message: str, status: int = 1) -> int:
    """Print, as the one line ``PROG: error: ...``, a run that cannot start here (``status``
    2: no CUDA, a backend that does not load) or failed (1: a rank failed); return
    ``status``."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status
