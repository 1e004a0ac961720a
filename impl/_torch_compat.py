"""Which torch each optional feature of splitgrad needs, in one place.

Every feature that rests on a torch API newer than the eager modules' minimum is named here with
the oldest torch it was checked on. :func:`require` raises at the point of use, naming the
feature, the torch found and the minimum, so that an older torch still imports the package and
runs the eager modules (``ci/torch_matrix.sh`` runs both minimums).
"""

from __future__ import annotations

import torch

__all__ = ["MINIMUM", "torch_version", "at_least", "require", "TorchTooOld"]

#: Oldest torch each feature was checked on (ci/torch_matrix.sh).
MINIMUM: dict[str, str] = {
    # torch.library effect registration, and AOTAutograd partitioning of effect tokens in a
    # backward graph (2.10's partitioner drops the backward token: "Node ... was invalid").
    "torch.compile support": "2.11",
}


class TorchTooOld(RuntimeError):
    """A feature was used on a torch older than the one it needs."""


def torch_version(version: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``version`` (default: the running torch), ignoring local/pre tags."""
    text = (version or torch.__version__).split("+")[0]
    parts = text.split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError) as exc:
        raise ValueError(f"cannot read a torch version from {text!r}") from exc


def at_least(minimum: str) -> bool:
    """Whether the running torch is at least ``minimum`` ("2.11")."""
    return torch_version() >= torch_version(minimum)


def require(feature: str) -> None:
    """Raise :class:`TorchTooOld` if the running torch is older than ``MINIMUM[feature]``."""
    if feature not in MINIMUM:
        raise KeyError(f"unknown feature {feature!r}; known: {sorted(MINIMUM)}")
    if not at_least(MINIMUM[feature]):
        raise TorchTooOld(
            f"{feature} needs torch>={MINIMUM[feature]}, found torch {torch.__version__}; "
            "the eager modules work on this torch"
        )
