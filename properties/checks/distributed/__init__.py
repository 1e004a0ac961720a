"""P14-P16 (SPEC §7): checks that spawn their own gloo ranks, for any conforming package.

Each check takes the ``--backend`` string of the package under test (``"impl"``,
``"reference"``, ``"path:DIR"``, ``"module:mypkg"``, or an import name ``"mypkg"`` /
``"mod:attr"``: :mod:`.library`), runs the scenario on local processes
(:func:`~splitgrad.distributed.run_ranks`: a timeout on every collective, a failed or stuck rank
fails the check with its traceback), computes the single-process truth in a process of its own
with the same thread count (CPU kernels may reduce in another order with more threads), and
returns a :class:`DistributedReport`; ``report.raise_if_failed()`` raises ``AssertionError``
listing every mismatch.

* :func:`check_pipeline` (P15, :mod:`.pipeline`): the pipelining schedules with ``dw_builder``;
* :func:`check_data_parallel` (P16, :mod:`.data_parallel`): ``GradientReducer`` over 2 replicas;
* :func:`check_fully_sharded` (P16 under FSDP2, :mod:`.fsdp`), in fp32 and mixed precision;
* :func:`check_pipeline_data_parallel` (P16 with P15, :mod:`.pipeline_data_parallel`): 2 stages x
  2 replicas, reduced or fully_shard-ed;
* :func:`check_expert_parallel` (P14 with P16 beside it, :mod:`.expert_parallel`).

The model they build is :mod:`.model`'s; the report and the float64 truth's judgement are
:mod:`.report`'s. A rank that raises or a harness step that meets an unexpected value (a
gradient that is ``None``) becomes a failure of the report naming what went wrong, never a
crash of the check.
"""

from .data_parallel import check_data_parallel
from .expert_parallel import check_expert_parallel
from .fsdp import FSDP_PRECISIONS, check_fully_sharded
from .library import load_library, preload_library
from .model import RECIPES
from .pipeline import SCHEDULES, check_pipeline, stage_layout
from .pipeline_data_parallel import check_pipeline_data_parallel
from .report import DistributedReport, merge_reports

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
    "load_library",
    "preload_library",
    "stage_layout",
]
