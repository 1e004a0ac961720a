"""What the measuring commands (and ``splitgrad distributed``) share on their command lines:
argparse types that refuse a bad value while the command line is parsed (exit status 2, one line
naming it), before anything runs; and the one set of pipeline schedule names."""

from __future__ import annotations

import argparse
import math
import os

__all__ = ["SCHEDULES", "TORCH_SCHEDULE_NAMES", "positive_int", "positive_float", "output_file"]

#: The pipeline schedules by the name every command prints and takes (``splitgrad pipeline
#: --schedule``, ``splitgrad distributed --schedule``), with the ``torch.distributed.pipelining``
#: class each runs.
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
#: The class names are accepted too, as older spellings (``--schedules ScheduleGPipe``).
TORCH_SCHEDULE_NAMES = {cls: name for name, cls in SCHEDULES.items()}


def positive_int(text: str) -> int:
    """An integer of at least 1 (a size or a count)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return value


def output_file(text: str) -> str:
    """A file the run can write at its end: not a directory, in a directory that exists (none is
    created)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file path")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.exists(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} does not exist")
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {text}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text}: permission denied")
    return text
