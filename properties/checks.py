"""Compatibility index: the property checks used to live in this one file.

They are now split by property group (see :mod:`.registry` for the table): P1-P3
:mod:`.accuracy`, P4-P8 :mod:`.split`, P9-P10 :mod:`.misuse`, P11 :mod:`.memory`, P12
:mod:`.grouped`, P13 :mod:`.fp8`, P17 :mod:`.input_only`; results in :mod:`.results`. This
module only re-exports their public names for code written against the old layout.
"""

from __future__ import annotations

from .accuracy import check_p1, check_p2, check_p3
from .fp8 import P13_VALUES, check_p13
from .grouped import check_p12
from .input_only import check_p17
from .memory import check_p11
from .misuse import MISUSES, check_p9, check_p10, misuses
from .registry import CHECKS, PROPERTIES, applicable, case_strategy, example_case, run_check
from .results import CheckResult, PropertyViolation, Tracker
from .split import InterleavingModel, check_p4, check_p5, check_p6, check_p7, check_p8

__all__ = [
    "PROPERTIES",
    "CHECKS",
    "PropertyViolation",
    "CheckResult",
    "Tracker",
    "case_strategy",
    "applicable",
    "run_check",
    "example_case",
    "InterleavingModel",
    "MISUSES",
    "misuses",
    "P13_VALUES",
    "check_p1",
    "check_p2",
    "check_p3",
    "check_p4",
    "check_p5",
    "check_p6",
    "check_p7",
    "check_p8",
    "check_p9",
    "check_p10",
    "check_p11",
    "check_p12",
    "check_p13",
    "check_p17",
]
