"""P14-P16 and P19 (SPEC §7): checks that spawn their own gloo ranks, for any conforming package.

Each check takes the ``--backend`` string of the package under test (:mod:`.library`), runs the
scenario on local processes (:func:`~splitgrad.distributed.run_ranks`: a timeout on every
collective), compares it with single-process baselines and returns a :class:`DistributedReport`
(:mod:`.report`) naming every mismatch; a rank that raises, or a harness step that meets an
unexpected value (a gradient that is ``None``), becomes a failure of the report, never a crash.
P15: :mod:`.pipeline`; P16: :mod:`.data_parallel`, under FSDP2 :mod:`.fsdp`, composed with P15
:mod:`.pipeline_data_parallel`; P14 (with P16 beside it): :mod:`.expert_parallel`; P19 (tensor and
sequence parallel): :mod:`.tensor_parallel`.
"""

from .data_parallel import check_data_parallel
from .expert_parallel import check_expert_parallel
from .fsdp import FSDP_PRECISIONS, check_fully_sharded
from .library import load_library, preload_library
from .model import RECIPES
from .pipeline import SCHEDULES, check_pipeline, stage_layout
from .pipeline_data_parallel import check_pipeline_data_parallel
from .report import DistributedReport, merge_reports
from .tensor_parallel import (
    TP_KINDS,
    TP_PROFILES,
    check_tensor_parallel,
    not_a_package,
    tp_support,
)

__all__ = [
    "SCHEDULES",
    "RECIPES",
    "FSDP_PRECISIONS",
    "DistributedReport",
    "merge_reports",
    "check_pipeline",
    "check_data_parallel",
    "check_fully_sharded",
    "check_pipeline_data_parallel",
    "check_expert_parallel",
    "check_tensor_parallel",
    "tp_support",
    "not_a_package",
    "TP_KINDS",
    "TP_PROFILES",
    "load_library",
    "preload_library",
    "stage_layout",
]
