"""P14-P16 (SPEC §7) as checks that spawn their own gloo ranks, for any conforming package.

Each check takes the import name of a package with SPEC §2's API (``"splitgrad.impl"``,
``"splitgrad.reference"``, ``"mypkg"``), runs the scenario on ``world_size`` local processes
(:func:`~splitgrad.distributed.run_ranks`: a timeout on every collective, a failed or stuck rank
fails the check with its traceback), computes the single-process truth in a process of its own
with the same thread count (CPU kernels may reduce in another order with more threads), and
returns a :class:`DistributedReport`; ``report.raise_if_failed()`` raises ``AssertionError``
listing every mismatch.

* :func:`check_pipeline` (P15): stages of split-backward modules under
  ``torch.distributed.pipelining`` schedules with :func:`~splitgrad.distributed.dw_builder`;
  loss and every gradient bitwise equal to running the same stages on the same micro-batches in
  one process *without delay* (SPEC §7), then dividing by the micro-batch count as the schedule
  does. Bitwise holds because each parameter's micro-batch contributions are added in
  micro-batch order (W steps run FIFO) by the same kernels on the same shapes (delayed ≡
  non-delayed, P4), and the stage boundaries only copy tensors. Without FP8, every gradient is
  also judged against ``splitgrad.reference``'s float64 truth, within the data-parallel budget
  scaled by the reference's own same-dtype error (not the package's: a bug its delayed and
  non-delayed paths share must still show).
* :func:`check_data_parallel` (P16): :class:`~splitgrad.distributed.GradientReducer` over 2
  replicas, alone, under a zero-bubble pipeline (2 stages x 2 replicas) and next to the
  expert-parallel layer; every reduction launched before ``finish()`` (and some before the last
  ``backward_dw()``); gradients bitwise equal to ``(replica0 + replica1) / 2`` computed in one
  process by the package without delay (a sum of two is exact in either order), and within the
  data-parallel budget of the float64 global-batch truth of ``splitgrad.reference``.
* :func:`check_fully_sharded` (P16 under FSDP2): 2 Blocks, each and the root wrapped with
  ``fully_shard``, 2 gloo ranks, 2 micro-batches (``no_sync()`` and ``num_microbatches``): the
  reducer reduce-scatters each delayed module's gradients into the sharded gradients, the first
  before the last ``backward_dw()`` starts; every full (all-gathered) gradient bitwise equal to
  FSDP2 alone without delay and within the data-parallel budget of the float64 global batch,
  in fp32 and under FSDP2 mixed precision (:data:`FSDP_PRECISIONS`: bf16 and fp16
  ``reduce_dtype``, bf16 parameters reduced in fp32 or fp16, forced sum reduction); in fp32
  compute also bitwise ``(replica0 + replica1) / 2`` computed in one process.
  ``check_pipeline_data_parallel(fully_shard=True)`` does the same under a zero-bubble pipeline
  of 2 stages, each stage fully_shard-ed over 2 replicas.
* :func:`check_expert_parallel` (P14): :class:`~splitgrad.distributed.ExpertParallelMoE` (or
  the layer named by ``moe=``) over 2 ranks; experts bitwise the single-process
  ``GroupedLinear`` over all experts, and their ``backward_dw()`` run while the dispatch
  all-to-all of the backward was in flight: from the order of events the harness records itself
  (each ``all_to_all_single`` launched, its work handle's ``wait()`` called and returned, the
  experts' ``backward_dw()`` start and end), never from the layer's own account.

A rank that raises or a harness step that meets an unexpected value (a gradient that is
``None``) becomes a failure of the report naming what went wrong, never a crash of the check.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys

import torch
import torch.distributed as dist

from .data_parallel import GradientReducer
from .launch import RankFailure, run_ranks
from .modules import split_modules
from .pipeline import dw_builder, in_shape_inference

__all__ = [
    "SCHEDULES",
    "RECIPES",
    "DistributedReport",
    "check_pipeline",
    "check_data_parallel",
    "check_expert_parallel",
    "check_fully_sharded",
    "FSDP_PRECISIONS",
    "merge_reports",
]

#: The torch.distributed.pipelining schedules P15 runs (by class name).
SCHEDULES = (
    "ScheduleGPipe",
    "Schedule1F1B",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleZBVZeroBubble",
    "ScheduleDualPipeV",
)
#: FP8 recipes by short name (the classes are looked up in the package under test).
RECIPES = {
    "delayed": "DelayedScaling",
    "current": "Float8CurrentScaling",
    "mxfp8": "MXFP8BlockScaling",
    "block": "Float8BlockScaling",
}
_WEIGHT_NAMES = ("weight", "fc1_weight", "fc2_weight")
_REDUCER = "splitgrad.distributed:GradientReducer"


@dataclasses.dataclass
class DistributedReport:
    """What a distributed check compared: ``compared`` tensors (and losses), ``failures``."""

    name: str
    compared: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_if_failed(self) -> None:
        if self.failures:
            shown = "\n  ".join(self.failures[:40])
            more = len(self.failures) - 40
            tail = f"\n  ... and {more} more" if more > 0 else ""
            raise AssertionError(f"{self.name}: {len(self.failures)} failure(s)\n  {shown}{tail}")

    def bitwise(self, what: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
        self.compared += 1
        if got is None or want is None:
            if got is not want:
                self.failures.append(f"{what}: got {_desc(got)}, expected {_desc(want)}")
            return
        if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
            self.failures.append(f"{what}: not bitwise equal ({_diff(got, want)})")

    def within(
        self, what: str, got: torch.Tensor | None, want: torch.Tensor | None, tol: float
    ) -> None:
        self.compared += 1
        if got is None or want is None:
            if got is not want:
                self.failures.append(f"{what}: got {_desc(got)}, expected {_desc(want)}")
            return
        err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
        if not err <= tol:
            self.failures.append(f"{what}: max error {err:.3g} > budget {tol:.3g}")


def merge_reports(name: str, *reports: DistributedReport) -> DistributedReport:
    """One report of several checks (``splitgrad distributed --check p16`` runs P16 alone and
    under fully_shard)."""
    out = DistributedReport(name)
    for r in reports:
        out.compared += r.compared
        out.failures += [f"[{r.name}] {f}" for f in r.failures]
        out.notes += r.notes
    return out


def _desc(t: torch.Tensor | None) -> str:
    return "None (no gradient)" if t is None else f"tensor {tuple(t.shape)} {t.dtype}"


def _ranks(report: DistributedReport, what: str, fn, world: int, *args, timeout_s: float):
    """:func:`run_ranks`, a failed or stuck rank (the package raised, or a harness step met
    what it did not expect) turned into a failure of ``report`` with its traceback's end."""
    try:
        return run_ranks(fn, world, *args, timeout_s=timeout_s)
    except RankFailure as exc:
        tails = {r: tb.strip().splitlines()[-1:] for r, tb in exc.tracebacks.items()}
        report.failures.append(f"{what}: {str(exc).splitlines()[0]}: {tails}")
        report.notes.append(str(exc))
        return None


def _mean(grads: list, divisor: float):
    """``sum(grads) / divisor``, or ``None`` if a gradient is missing (reported by name where it
    is compared)."""
    if any(g is None for g in grads):
        return None
    total = grads[0].clone()
    for g in grads[1:]:
        total += g
    return total.div_(divisor)


def _judge_truth(
    report, where: str, got: dict, naive: dict, truth: dict, dtype: torch.dtype | None = None
) -> None:
    """Every gradient in ``got`` within the data-parallel budget of the float64 truth, the
    budget scaled by the naive same-dtype run's own error (both from ``splitgrad.reference``,
    not the package under test, so a bug the package's delayed and non-delayed paths share is
    still measured). ``dtype``: the dtype the gradients were computed in, for the budget's
    floor, when it is not theirs (FSDP2 mixed precision computes in bf16, returns fp32)."""
    from splitgrad.properties.budgets import data_parallel_tolerance

    for name, g in got.items():
        want, yard = truth.get(name), naive.get(name)
        if want is None or yard is None or g is None:
            report.within(f"{where} {name} vs the float64 truth", g, want, 0.0)
            continue
        naive_err = float((yard.double() - want.double()).abs().max()) if want.numel() else 0.0
        scale = float(want.abs().max()) if want.numel() else 0.0
        tol = data_parallel_tolerance(dtype or g.dtype, naive_err, scale)
        report.within(f"{where} {name} vs the float64 truth", g, want, tol)


def _diff(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{_desc(got)} vs {_desc(want)}"
    d = (got.double() - want.double()).abs()
    i = int(d.argmax())
    a, b = got.flatten()[i].item(), want.flatten()[i].item()
    return f"max |diff| {float(d.max()):.3g} at flat index {i}: {a!r} vs {b!r}"


def load_package(name: str):
    """The package under test (imported again by each rank):

    * ``"impl"``, ``"reference"``: splitgrad's own;
    * an import name (``"splitgrad.impl"``, ``"mypkg"``), also written ``"module:mypkg"``;
    * ``"module:attribute"`` for a namespace object inside a module (``"mymod:package"``);
    * ``"path:/dir/mypkg"``: the package directory ``mypkg`` imported from ``/dir``.
    """
    if name in ("impl", "reference"):
        name = f"splitgrad.{name}"
    if name.startswith("path:"):
        directory = os.path.abspath(name[len("path:") :])
        parent, package = os.path.split(directory.rstrip(os.sep))
        if parent not in sys.path:
            sys.path.insert(0, parent)
        return importlib.import_module(package)
    if name.startswith("module:"):
        name = name[len("module:") :]
    module, _, attribute = name.partition(":")
    loaded = importlib.import_module(module)
    return getattr(loaded, attribute) if attribute else loaded


# ---- the model the checks build ------------------------------------------------------------


class Block(torch.nn.Module):
    """``x + proj(tanh(gate(mlp(x))))``: a ``LayerNormMLP`` and a ``Linear`` of the package under
    test (delayed, plain or fused) around a ``torch.nn.Linear`` (reduced from autograd's hooks).

    ``delay=False`` builds the same block without delay (the single-process baselines).
    ``microbatches_per_step``: pass ``is_first_microbatch=True`` to the first forward of every
    step (counting forwards, pipelining's shape-inference pass excluded), as a training loop with
    fused accumulation does; ``main_grad`` then starts from ``prefill_seed``'s random values,
    which the first micro-batch must overwrite. ``proj_twice``: ``proj`` is applied twice in
    every forward, ``x + proj(tanh(proj(tanh(gate(mlp(x))))))``, so each backward queues two of
    its entries (SPEC §4: a weight used twice in one graph); its first use passes
    ``is_first_microbatch=False`` (its entry runs second and must add to what the second use's
    overwrite left). ``tied``: a further delayed ``Linear`` ``out`` shares ``proj``'s weight
    (neither has a bias), ``x + out(tanh(proj(...)))``: one weight written by two modules'
    entries (drained ``out`` first, so ``out`` overwrites and every ``proj`` entry adds)."""

    def __init__(
        self,
        lib,
        hidden: int,
        ffn: int,
        seed: int,
        *,
        fused: bool,
        dtype,
        value_dtype=None,
        microbatches_per_step: int | None = None,
        prefill_seed: int = 0,
        delay: bool = True,
        proj_twice: bool = False,
        tied: bool = False,
    ) -> None:
        super().__init__()
        kw = dict(params_dtype=dtype, delay_wgrad_compute=delay, fuse_wgrad_accumulation=fused)
        self.mlp = lib.LayerNormMLP(hidden, ffn, **kw)
        self.gate = torch.nn.Linear(hidden, hidden, dtype=dtype)
        # tied: no bias on proj either, so the reducer can launch the shared weight alone
        self.proj = lib.Linear(hidden, hidden, bias=not tied, **kw)
        if tied:
            self.out = lib.Linear(hidden, hidden, bias=False, **kw)
            self.out.weight = self.proj.weight
        gen = torch.Generator().manual_seed(1000 + seed)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters(), key=lambda item: item[0]):
                # by name (any package's registration order draws the same values), rounded
                # to value_dtype first, so a float64 twin holds the same numbers
                value = (torch.randn(p.shape, generator=gen) * 0.3).to(value_dtype or dtype)
                p.copy_(value.to(dtype))
        self.microbatches_per_step = microbatches_per_step
        self.proj_twice, self.tied = proj_twice, tied
        self._forwards = 0
        if fused:
            noise = torch.Generator().manual_seed(2000 + prefill_seed)
            for sm in split_modules(self):
                for name, p in sm.gemm_params:
                    if name in _WEIGHT_NAMES:
                        p.main_grad = (
                            torch.randn(p.shape, generator=noise)
                            if microbatches_per_step
                            else torch.zeros(p.shape)
                        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = None
        if self.microbatches_per_step and not in_shape_inference():
            first = self._forwards % self.microbatches_per_step == 0
            self._forwards += 1
        later = None if first is None else False  # an entry that runs after the overwrite
        h = torch.tanh(self.gate(self.mlp(x, is_first_microbatch=first)))
        if self.proj_twice:
            h = torch.tanh(self.proj(h, is_first_microbatch=later))
        if self.tied:
            h = torch.tanh(self.proj(h, is_first_microbatch=later))
            return x + self.out(h, is_first_microbatch=first)
        return x + self.proj(h, is_first_microbatch=first)


def _gradients(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient by name: ``main_grad`` for fused GEMM weights, else ``.grad``."""
    fused = {
        id(p)
        for sm in split_modules(module)
        for name, p in sm.gemm_params
        if sm.uses_main_grad(name)
    }
    return {
        name: (p.main_grad if id(p) in fused else p.grad) for name, p in module.named_parameters()
    }


def _clone(grads: dict) -> dict:
    return {k: None if v is None else v.detach().clone() for k, v in grads.items()}


def _drain(module: torch.nn.Module, passes: int = 1) -> None:
    """Every entry of ``module``'s split modules, last module first. With ``passes`` > 1, one
    pass's entries of each module in turn, as the non-delayed backwards wrote them (a weight
    tied between two modules then accumulates in the non-delayed order, bitwise)."""
    modules = [sm.module for sm in reversed(split_modules(module))]
    per_pass = [m.pending_wgrad_count // passes for m in modules]
    for _ in range(passes):
        for m, k in zip(modules, per_pass):
            for _ in range(k):
                m.backward_dw()
    for m in modules:
        while m.pending_wgrad_count:
            m.backward_dw()


def _scale(module: torch.nn.Module, factor: int) -> None:
    with torch.no_grad():
        for g in _gradients(module).values():
            if g is not None:
                g.div_(factor)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    wide = torch.promote_types(out.dtype, torch.float32)  # float64 truth stays float64
    return ((out.to(wide) - target.to(wide)) ** 2).mean()


def _autocast(lib, recipe):
    """``fp8_autocast`` with ``recipe`` (one object per run: delayed scaling keeps its amax
    histories per recipe), or nothing."""
    import contextlib

    if recipe is None:
        return contextlib.nullcontext()
    return lib.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _make_recipe(lib, name: str | None):
    return None if name is None else getattr(lib, RECIPES[name])()


def _data(seed: int, rows: int, hidden: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    target = torch.randn(rows, hidden, generator=gen).to(dtype)
    return x, target


# ---- P15: pipeline parallel ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    schedule: str
    fused: bool = False
    recipe: str | None = None
    dtype: torch.dtype = torch.float32
    n_microbatches: int = 4

    @property
    def label(self) -> str:
        parts = [self.schedule, "fused" if self.fused else "plain", str(self.dtype)[6:]]
        if self.recipe:
            parts.append(f"fp8:{self.recipe}")
        return " ".join(parts) + f" n_mb={self.n_microbatches}"


def stage_layout(schedule: str, rank: int, pp: int) -> tuple[list[int], int]:
    """The stage indices rank ``rank`` holds under ``schedule`` with ``pp`` ranks, and the number
    of stages: one per rank (GPipe, 1F1B), two looped (interleaved), two in a V (ZBV,
    DualPipeV)."""
    if schedule in ("ScheduleGPipe", "Schedule1F1B"):
        return [rank], pp
    if schedule in ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble"):
        return [rank, rank + pp], 2 * pp
    if schedule in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV"):
        return [rank, 2 * pp - 1 - rank], 2 * pp
    raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")


def _sizes(recipe: str | None) -> tuple[int, int, int]:
    """(hidden, ffn, rows per micro-batch): multiples of 32 or 128 where the recipe needs them."""
    if recipe == "block":
        return 128, 128, 128
    if recipe == "mxfp8":
        return 32, 64, 32
    return 16, 32, 8


def _run_pipeline(
    lib,
    cfg: PipelineConfig,
    rank: int,
    pp: int,
    group=None,
    reducer_group=None,
    data_seed=0,
    fsdp_mesh=None,
) -> dict:
    """One ``schedule.step`` on this rank; returns its stages' gradients, losses and what was
    left pending. ``fsdp_mesh``: each stage module is wrapped with ``fully_shard`` over it (its
    reducer then reduce-scatters over FSDP2's group, and the gradients returned are the
    all-gathered full ones)."""
    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    hidden, ffn, rows = _sizes(cfg.recipe)
    indices, num_stages = stage_layout(cfg.schedule, rank, pp)
    blocks = {
        i: Block(
            lib,
            hidden,
            ffn,
            i,
            fused=cfg.fused,
            dtype=cfg.dtype,
            microbatches_per_step=cfg.n_microbatches if cfg.fused else None,
            prefill_seed=rank + 1,
        )
        for i in indices
    }
    reducers = {}
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for i, b in blocks.items():
            fully_shard(b, mesh=fsdp_mesh)
            reducers[i] = GradientReducer(b, num_microbatches=cfg.n_microbatches)
    elif reducer_group is not None:
        for i, b in blocks.items():
            reducers[i] = GradientReducer(b, reducer_group, num_microbatches=cfg.n_microbatches)
    builders = {i: dw_builder(b) for i, b in blocks.items()}
    stages = [
        PipelineStage(
            blocks[i], i, num_stages, torch.device("cpu"), group=group, dw_builder=builders[i]
        )
        for i in indices
    ]
    schedule_cls = getattr(schedules, cfg.schedule)
    schedule = schedule_cls(
        stages if len(stages) > 1 else stages[0], cfg.n_microbatches, loss_fn=_loss
    )
    x, target = _data(data_seed, cfg.n_microbatches * rows, hidden, cfg.dtype)
    first, last = 0 in indices, num_stages - 1 in indices
    losses: list[torch.Tensor] = []
    with _autocast(lib, _make_recipe(lib, cfg.recipe)):
        schedule.step(
            *((x,) if first else ()),
            target=target if last else None,
            losses=losses if last else None,
        )
    errors = []
    for i, r in reducers.items():
        try:
            r.finish()  # a no-op where the schedule's gradient scaling finished it already
        except RuntimeError as exc:
            errors.append(f"stage {i}: {exc}")
    grads = {i: _clone(_gradients(b)) for i, b in blocks.items()}
    if fsdp_mesh is not None:
        grads = {
            i: {n: None if g is None else g.detach().full_tensor() for n, g in per.items()}
            for i, per in grads.items()
        }
    return {
        "errors": errors,
        "grads": grads,
        "losses": [loss.detach().clone() for loss in losses],
        "pending": {
            i: {sm.name: sm.module.pending_wgrad_count for sm in split_modules(b)}
            for i, b in blocks.items()
        },
        "runners_left": {i: builders[i].pending_runners for i in indices},
        "launches": {
            i: [(e["bucket"], e["time"]) for e in r.launch_log] for i, r in reducers.items()
        },
        "finish": {i: r.finish_time for i, r in reducers.items()},
    }


def _single_pipeline(
    lib,
    cfg: PipelineConfig,
    num_stages: int,
    data_seeds=(0,),
    *,
    dtype: torch.dtype | None = None,
    fused: bool | None = None,
) -> dict:
    """The same stages run one after the other on every micro-batch in one process, without
    delay (SPEC §7: the baseline of P15 and P16), gradients divided by the micro-batch count by
    the caller. ``dtype``/``fused`` override the config's (the float64 truth runs plain in
    float64 on values rounded to the config's dtype)."""
    hidden, ffn, rows = _sizes(cfg.recipe)
    dtype = cfg.dtype if dtype is None else dtype
    fused = cfg.fused if fused is None else fused
    blocks = [
        Block(
            lib,
            hidden,
            ffn,
            i,
            fused=fused,
            dtype=dtype,
            value_dtype=cfg.dtype,
            # one step over every seed's micro-batches: only the very first overwrites
            microbatches_per_step=cfg.n_microbatches * len(data_seeds) if fused else None,
            prefill_seed=99,
            delay=False,
        )
        for i in range(num_stages)
    ]
    losses = []
    recipe = _make_recipe(lib, cfg.recipe)
    for seed in data_seeds:
        x, target = _data(seed, cfg.n_microbatches * rows, hidden, cfg.dtype)
        for xb, tb in zip(x.to(dtype).split(rows), target.to(dtype).split(rows)):
            h = xb
            with _autocast(lib, recipe):
                for b in blocks:
                    h = b(h)
            loss = _loss(h, tb)
            losses.append(loss.detach().clone())
            loss.backward()
            for b in reversed(blocks):
                _drain(b)
    return {"blocks": blocks, "losses": losses}


def _pipeline_rank(rank: int, world: int, lib_name: str, configs: list[PipelineConfig]) -> list:
    lib = load_package(lib_name)
    return [_run_pipeline(lib, cfg, rank, world) for cfg in configs]


def _scaled_grads(run: dict, divisor: int) -> list[dict]:
    for b in run["blocks"]:
        _scale(b, divisor)
    return [_clone(_gradients(b)) for b in run["blocks"]]


def _reference_runs(cfg: PipelineConfig, num_stages: int, data_seeds=(0,)) -> dict:
    """``splitgrad.reference`` without delay on the same stages and micro-batches: in the
    config's dtype and accumulation (the naive yardstick) and plain in float64 (the truth);
    ``None`` under FP8, whose truth is the same-recipe one that P3 and P13 judge."""
    if cfg.recipe is not None:
        return {"naive": None, "truth": None}
    ref = load_package("splitgrad.reference")
    divisor = cfg.n_microbatches * len(data_seeds)
    naive = _single_pipeline(ref, cfg, num_stages, data_seeds)
    truth = _single_pipeline(ref, cfg, num_stages, data_seeds, dtype=torch.float64, fused=False)
    return {"naive": _scaled_grads(naive, divisor), "truth": _scaled_grads(truth, divisor)}


def _pipeline_truth(rank: int, world: int, lib_name: str, configs, pp: int) -> list:
    lib = load_package(lib_name)
    out = []
    for cfg in configs:
        _, num_stages = stage_layout(cfg.schedule, 0, pp)
        run = _single_pipeline(lib, cfg, num_stages)
        out.append(
            {
                "grads": _scaled_grads(run, cfg.n_microbatches),
                "losses": run["losses"],
                **_reference_runs(cfg, num_stages),
            }
        )
    return out


def check_pipeline(
    lib_name: str = "splitgrad.impl",
    *,
    world_size: int = 2,
    schedules: tuple[str, ...] = SCHEDULES,
    fused: tuple[bool, ...] = (False, True),
    recipes: tuple[str | None, ...] = (None,),
    dtype: torch.dtype = torch.float32,
    n_microbatches: int | None = None,
    timeout_s: float = 600.0,
) -> DistributedReport:
    """P15 on ``world_size`` gloo ranks for every schedule x accumulation x recipe."""
    n_mb = n_microbatches or 2 * world_size
    configs = [
        PipelineConfig(s, f, r, dtype, n_mb) for s in schedules for f in fused for r in recipes
    ]
    report = DistributedReport(f"P15 {lib_name} on {world_size} ranks")
    results = _ranks(
        report,
        "pipeline ranks",
        _pipeline_rank,
        world_size,
        lib_name,
        configs,
        timeout_s=timeout_s,
    )
    truths = _ranks(
        report,
        "single-process baseline",
        _pipeline_truth,
        1,
        lib_name,
        configs,
        world_size,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        want = truth[k]
        for rank, per_rank in enumerate(results):
            got = per_rank[k]
            where = f"{cfg.label} rank {rank}"
            for i, grads in got["grads"].items():
                for name, g in grads.items():
                    report.bitwise(
                        f"{where} stage {i} {name} vs the package without delay",
                        g,
                        want["grads"][i][name],
                    )
                if want["truth"] is not None:
                    _judge_truth(
                        report, f"{where} stage {i}", grads, want["naive"][i], want["truth"][i]
                    )
                left = {n: c for n, c in got["pending"][i].items() if c}
                if left or got["runners_left"][i]:
                    report.failures.append(
                        f"{where} stage {i}: after step(), entries pending {left}, "
                        f"{got['runners_left'][i]} W steps not run"
                    )
            if got["losses"]:
                for j, (a, b) in enumerate(zip(got["losses"], want["losses"])):
                    report.bitwise(f"{where} loss of micro-batch {j}", a, b)
                if len(got["losses"]) != len(want["losses"]):
                    report.failures.append(f"{where}: {len(got['losses'])} losses returned")
    return report


# ---- P16: data parallel ----------------------------------------------------------------------


def _dp_step(
    lib,
    rank: int,
    *,
    fused: bool,
    mode: str,
    n_mb: int,
    dtype,
    proj_twice: bool,
    reducer_cls,
    tied: bool = False,
    skip_dw=False,
):
    """One step of 2 Blocks on one replica, micro-batches marked by ``mode`` ("no_sync" or
    "count"), every backward_dw() deferred until after the last backward and run block by block
    (so the first block's reductions overlap the second block's wgrad GEMMs). ``proj_twice``:
    each Block applies ``proj`` twice (two entries per backward, the step's last pass too).
    Fused, ``main_grad`` starts random and the first micro-batch passes
    ``is_first_microbatch=True``."""
    hidden, ffn, rows = _sizes(None)
    blocks = torch.nn.Sequential(
        *(
            Block(
                lib,
                hidden,
                ffn,
                i,
                fused=fused,
                dtype=dtype,
                microbatches_per_step=n_mb if fused else None,
                prefill_seed=rank + 1,
                proj_twice=proj_twice,
                tied=tied,
            )
            for i in range(2)
        )
    )
    # about one GEMM weight per bucket; tied, the shared (hidden, hidden) weight in one alone,
    # the first delayed bucket to launch: final too early, it would launch too early
    cap = hidden * (hidden if tied else ffn) * 4
    reducer = reducer_cls(
        blocks, num_microbatches=n_mb if mode == "count" else None, bucket_cap_mb=cap / 2**20
    )
    x, target = _data(100 + rank, n_mb * rows, hidden, dtype)
    dw_times = []
    for j, (xb, tb) in enumerate(zip(x.split(rows), target.split(rows))):
        last = j == n_mb - 1
        ctx = reducer.no_sync() if (mode == "no_sync" and not last) else _nullcontext()
        with ctx:
            _loss(blocks(xb), tb).backward()
    import time

    for b in reversed(list(blocks)):
        if skip_dw:
            break
        _drain(b, passes=n_mb if tied else 1)
        dw_times.append(time.perf_counter())
    error = None
    try:
        reducer.finish()
    except RuntimeError as exc:
        error = str(exc)
    _scale(blocks, n_mb)
    return {
        "grads": _clone(_gradients(blocks)),
        "launches": [(e["bucket"], e["params"], e["time"]) for e in reducer.launch_log],
        "finish": reducer.finish_time,
        "dw_times": dw_times,
        "buckets": reducer.bucket_names,
        "error": error,
    }


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def _dp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = _REDUCER
) -> list:
    lib = load_package(lib_name)
    reducer_cls = load_package(reducer_name)
    return [_dp_step(lib, rank, reducer_cls=reducer_cls, **cfg) for cfg in configs]


def _dp_truth(rank: int, _: int, lib_name: str, configs: list[dict], world: int) -> list:
    """Per config: the replicas emulated in one process by the package without delay (their
    sum, then the two divisions the distributed run does), and the global batch through
    ``splitgrad.reference`` in the same dtype (the naive yardstick) and plain in float64 (the
    truth)."""
    lib = load_package(lib_name)
    ref = load_package("splitgrad.reference")
    hidden, ffn, rows = _sizes(None)

    def run(package, dtype, seeds, value_dtype, fused, proj_twice, tied):
        blocks = torch.nn.Sequential(
            *(
                Block(
                    package,
                    hidden,
                    ffn,
                    i,
                    fused=fused,
                    dtype=dtype,
                    value_dtype=value_dtype,
                    # one step over every seed's micro-batches: only the very first overwrites
                    microbatches_per_step=n_mb * len(seeds) if fused else None,
                    prefill_seed=99,
                    delay=False,
                    proj_twice=proj_twice,
                    tied=tied,
                )
                for i in range(2)
            )
        )
        for seed in seeds:
            x, target = _data(seed, n_mb * rows, hidden, value_dtype)
            for xb, tb in zip(x.split(rows), target.split(rows)):
                _loss(blocks(xb.to(dtype)), tb.to(dtype)).backward()
        return _clone(_gradients(blocks))

    out = []
    for cfg in configs:
        n_mb, fused, dtype = cfg["n_mb"], cfg["fused"], cfg["dtype"]
        # the values' dtype: FSDP2 mixed precision computes in dtype from fp32 values
        values = cfg.get("value_dtype", dtype)
        twice, tied = cfg.get("proj_twice", False), cfg.get("tied", False)
        replicas = [run(lib, dtype, (100 + r,), values, fused, twice, tied) for r in range(world)]
        emulated = {name: _mean([rep[name] for rep in replicas], world) for name in replicas[0]}
        emulated = {n: None if g is None else g.div_(n_mb) for n, g in emulated.items()}
        seeds = tuple(100 + r for r in range(world))
        divisor = world * n_mb
        naive = run(ref, dtype, seeds, values, fused, twice, tied)
        naive = {n: g.div(divisor) for n, g in naive.items()}
        truth = run(ref, torch.float64, seeds, values, False, twice, tied)
        truth = {n: g.div(divisor) for n, g in truth.items()}
        out.append({"emulated": emulated, "naive": naive, "truth": truth})
    return out


def check_data_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 3,
    dtypes: tuple[torch.dtype, ...] = (torch.float32,),
    timeout_s: float = 600.0,
    reducer: str = _REDUCER,
) -> DistributedReport:
    """P16 alone, on 2 gloo replicas: fused and plain, no_sync() and num_microbatches; a
    delayed module applied twice per micro-batch and a weight tied between two delayed modules
    (both queue two entries in the step's last pass); fused ``main_grad`` prefilled with random
    values that the first micro-batch (``is_first_microbatch=True``) overwrites. ``reducer``
    names the reducer class (``"module:Class"``, built as ``GradientReducer`` is)."""
    configs = [
        {"fused": f, "mode": m, "n_mb": n_microbatches, "dtype": d, "proj_twice": True, "tied": t}
        for f in (False, True)
        for m in ("no_sync", "count")
        for d in dtypes
        for t in (False, True)
    ]
    world = 2
    report = DistributedReport(f"P16 {lib_name} on {world} replicas")
    results = _ranks(
        report, "replicas", _dp_rank, world, lib_name, configs, reducer, timeout_s=timeout_s
    )
    truths = _ranks(
        report,
        "single-process baseline",
        _dp_truth,
        1,
        lib_name,
        configs,
        world,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        label = f"{'fused' if cfg['fused'] else 'plain'} {cfg['mode']} {cfg['dtype']}"
        label += " tied" if cfg["tied"] else ""
        for rank, per_rank in enumerate(results):
            got = per_rank[k]
            where = f"{label} rank {rank}"
            if got["error"]:
                report.failures.append(f"{where}: finish() raised: {got['error']}")
            _check_launches(report, where, got)
            for name, g in got["grads"].items():
                report.bitwise(
                    f"{where} {name} vs (replica0 + replica1) / 2 without delay",
                    g,
                    truth[k]["emulated"][name],
                )
            _judge_truth(
                report,
                f"{where} (global batch)",
                got["grads"],
                truth[k]["naive"],
                truth[k]["truth"],
            )
    return report


def _check_launches(report: DistributedReport, where: str, got: dict) -> None:
    """Every bucket launched once, all before finish(), and (where backward_dw ran late) the
    first block's buckets before the second block's wgrad finished: overlap."""
    launched = [b for b, *_ in got["launches"]]
    report.compared += 1
    if sorted(launched) != list(range(len(got["buckets"]))):
        report.failures.append(
            f"{where}: buckets launched {launched}, expected each of {len(got['buckets'])} once"
        )
    if got["launches"] and got["finish"] is not None:
        late = [b for b, *rest in got["launches"] if rest[-1] > got["finish"]]
        if late:
            report.failures.append(f"{where}: buckets {late} launched after finish() was called")
    if len(got.get("dw_times", ())) >= 2:
        # the last block's entries run first; the first launch must precede the last drain
        if not got["launches"] or got["launches"][0][-1] >= got["dw_times"][-1]:
            report.failures.append(f"{where}: no reduction started before the last backward_dw()")


# ---- P16 under fully_shard (FSDP2) -----------------------------------------------------------


#: FSDP2 mixed precision the fully_shard cells run, by name: ``MixedPrecisionPolicy``'s
#: ``param_dtype`` and ``reduce_dtype`` and ``set_force_sum_reduction_for_comms``. They reach
#: every branch of FSDP2's averaging: AVG inside the collective (fp32, bf16), a pre-divide
#: before a SUM (an fp16 ``reduce_dtype``: ``sqrt``-ish split of the world size against
#: overflow) and a post-divide after it (forced sum); bf16 parameters with an fp32
#: ``reduce_dtype`` also accumulate the micro-batches' gradients in fp32 between passes.
FSDP_PRECISIONS: dict[str, tuple[torch.dtype | None, torch.dtype | None, bool]] = {
    "fp32": (None, None, False),
    "bf16": (torch.bfloat16, None, False),
    "bf16/fp32": (torch.bfloat16, torch.float32, False),
    "fp16": (torch.float16, None, False),
    "bf16/fp16": (torch.bfloat16, torch.float16, False),
    "fp32 sum": (None, None, True),
    "bf16/fp32 sum": (torch.bfloat16, torch.float32, True),
}


def _fsdp_step(
    lib,
    rank: int,
    *,
    mode: str,
    n_mb: int,
    delay: bool,
    precision: str = "fp32",
    drain: str = "late",
    reducer_cls=GradientReducer,
) -> dict:
    """One step of 2 Blocks, each and the root wrapped with ``fully_shard``, on one rank.
    Delayed: a GradientReducer, micro-batches marked by ``mode`` ("no_sync": the reducer's
    context, which turns FSDP2's gradient sync off too; "count": ``num_microbatches`` and
    ``set_requires_gradient_sync`` set by hand), every ``backward_dw()`` deferred until after
    the last backward and run block by block (``drain="late"``) or each micro-batch's run
    right after its backward (``"each"``). Not delayed: FSDP2 alone. ``precision`` names an
    entry of :data:`FSDP_PRECISIONS`; ``reducer_cls`` is built as ``GradientReducer`` is.
    Returns the full (all-gathered) gradients divided by the micro-batch count, and the launch
    log."""
    import contextlib
    import time

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    param_dtype, reduce_dtype, force_sum = FSDP_PRECISIONS[precision]
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    hidden, ffn, rows = _sizes(None)
    blocks = torch.nn.Sequential(
        *(Block(lib, hidden, ffn, i, fused=False, dtype=torch.float32, delay=delay) for i in (0, 1))
    )
    for b in blocks:
        fully_shard(b, mp_policy=policy)
    fully_shard(blocks, mp_policy=policy)
    if force_sum:
        for m in (*blocks, blocks):
            m.set_force_sum_reduction_for_comms(True)
    reducer = None
    if delay:
        reducer = reducer_cls(blocks, num_microbatches=n_mb if mode == "count" else None)
    x, target = _data(100 + rank, n_mb * rows, hidden, torch.float32)
    pass_times = []
    for j, (xb, tb) in enumerate(zip(x.split(rows), target.split(rows))):
        last = j == n_mb - 1
        ctx = contextlib.nullcontext()
        if reducer is not None and mode == "no_sync":
            ctx = contextlib.nullcontext() if last else reducer.no_sync()
        else:
            blocks.set_requires_gradient_sync(last)
        with ctx:
            _loss(blocks(xb), tb).backward()
        pass_times.append(time.perf_counter())
        if drain == "each" and not last:
            for b in reversed(list(blocks)):
                _drain(b)
    dw_starts, dw_ends = [], []
    for b in reversed(list(blocks)):
        dw_starts.append(time.perf_counter())
        _drain(b)
        dw_ends.append(time.perf_counter())
    error = None
    if reducer is not None:
        try:
            reducer.finish()
        except RuntimeError as exc:
            error = str(exc)
    grads = {}
    for name, p in blocks.named_parameters():
        if p.grad is None:
            grads[name] = None
            continue
        with torch.no_grad():  # a gradient that requires grad (some packages') stays outside
            grads[name] = p.grad.detach().full_tensor().div(n_mb)
    return {
        "grads": grads,
        "launches": [] if reducer is None else [dict(e) for e in reducer.launch_log],
        "buckets": [] if reducer is None else reducer.bucket_names,
        "finish": None if reducer is None else reducer.finish_time,
        "dw_starts": dw_starts,
        "dw_ends": dw_ends,
        "pass_times": pass_times,
        "error": error,
    }


def _fsdp_rank(
    rank: int, world: int, lib_name: str, configs: list[dict], reducer_name: str = _REDUCER
) -> dict:
    """Every config, delayed with the reducer and (the baseline) FSDP2 alone without delay; on
    rank 0 also the single-process baselines of :func:`_dp_truth` (same thread count): the
    global batch in FSDP2's compute dtype (the naive yardstick) from the fp32 values FSDP2
    casts, and the float64 truth of those fp32 values."""
    lib = load_package(lib_name)
    reducer_cls = load_package(reducer_name)
    out = {"runs": [], "baseline": [], "truth": None}
    for cfg in configs:
        out["runs"].append(_fsdp_step(lib, rank, delay=True, reducer_cls=reducer_cls, **cfg))
        out["baseline"].append(_fsdp_step(lib, rank, delay=False, **cfg))
    if rank == 0:
        truth_configs = [
            {
                "n_mb": c["n_mb"],
                "fused": False,
                "dtype": FSDP_PRECISIONS[c.get("precision", "fp32")][0] or torch.float32,
                "value_dtype": torch.float32,
            }
            for c in configs
        ]
        out["truth"] = _dp_truth(0, 1, lib_name, truth_configs, world)
    return out


def check_fully_sharded(
    lib_name: str = "splitgrad.impl",
    *,
    n_microbatches: int = 2,
    precisions: tuple[str, ...] = tuple(FSDP_PRECISIONS),
    timeout_s: float = 600.0,
    reducer: str = _REDUCER,
) -> DistributedReport:
    """P16 under ``fully_shard`` (FSDP2) on 2 gloo ranks: the reducer's reduce-scatters of the
    delayed modules launched from the module hooks, before the last ``backward_dw()``;
    gradients bitwise equal to FSDP2 alone without delay, and within the data-parallel budget
    of the float64 global batch (the yardstick: the reference in FSDP2's compute dtype). Each
    of ``precisions`` (:data:`FSDP_PRECISIONS`) runs ``no_sync()`` and ``num_microbatches``
    with every ``backward_dw()`` after the last backward, and ``no_sync()`` with each
    micro-batch's right after its backward (label suffix "each").
    In float32 compute (plain and forced sum) also bitwise ``(replica0 + replica1) / 2``
    computed in one process: a sum of two, halved, is exact in either order, whichever side
    divides; in bf16 or fp16 FSDP2's casts and accumulation dtype have no one-process twin.
    ``reducer`` names the reducer class (``"module:Class"``, built as ``GradientReducer`` is)."""
    unknown = sorted(set(precisions) - set(FSDP_PRECISIONS))
    if unknown:
        raise ValueError(f"unknown precisions {unknown}; expected some of {list(FSDP_PRECISIONS)}")
    # the entries run after the last backward, and (no_sync) each micro-batch's after its own
    configs = [
        {"mode": m, "n_mb": n_microbatches, "precision": p, "drain": d}
        for p in precisions
        for m, d in (("no_sync", "late"), ("count", "late"), ("no_sync", "each"))
    ]
    world = 2
    report = DistributedReport(f"P16 fully_shard {lib_name} on {world} ranks")
    results = _ranks(
        report, "FSDP2 ranks", _fsdp_rank, world, lib_name, configs, reducer, timeout_s=timeout_s
    )
    if results is None:
        return report
    truth = results[0]["truth"]
    for k, cfg in enumerate(configs):
        label = f"fully_shard {cfg['precision']} {cfg['mode']}"
        label += " each" if cfg["drain"] == "each" else ""
        compute = FSDP_PRECISIONS[cfg["precision"]][0] or torch.float32
        for rank, per_rank in enumerate(results):
            got, base = per_rank["runs"][k], per_rank["baseline"][k]
            where = f"{label} rank {rank}"
            if got["error"]:
                report.failures.append(f"{where}: finish() raised: {got['error']}")
            _check_fsdp_launches(report, where, got)
            for name, g in got["grads"].items():
                report.bitwise(f"{where} {name} vs FSDP2 without delay", g, base["grads"][name])
                if compute == torch.float32:
                    report.bitwise(
                        f"{where} {name} vs (replica0 + replica1) / 2 without delay",
                        g,
                        truth[k]["emulated"][name],
                    )
            _judge_truth(
                report,
                f"{where} (global batch)",
                got["grads"],
                truth[k]["naive"],
                truth[k]["truth"],
                dtype=compute,
            )
    report.notes.append(
        "launch log (rank 0, no_sync): " + fsdp_launch_summary(results[0]["runs"][0])
    )
    return report


def fsdp_launch_summary(run: dict) -> str:
    """The launches of one :func:`_fsdp_step` run, in ms after the last backward pass ended,
    next to when each block's ``backward_dw()`` started and ended."""
    t0 = run["pass_times"][-1]
    ms = lambda t: f"{1e3 * (t - t0):.2f} ms"  # noqa: E731
    parts = [f"{e['collective']} {e['params']} at {ms(e['time'])}" for e in run["launches"]]
    drains = [
        f"backward_dw of block {len(run['dw_starts']) - 1 - i} {ms(a)}-{ms(b)}"
        for i, (a, b) in enumerate(zip(run["dw_starts"], run["dw_ends"]))
    ]
    return "; ".join(drains + parts) + f"; finish() at {ms(run['finish'])}"


def _check_fsdp_launches(report: DistributedReport, where: str, got: dict) -> None:
    """Each bucket reduce-scattered once, before finish(), and the first before the last
    block's ``backward_dw()`` started."""
    launched = [e["bucket"] for e in got["launches"]]
    report.compared += 1
    if sorted(launched) != list(range(len(got["buckets"]))):
        report.failures.append(
            f"{where}: buckets launched {launched}, expected each of {len(got['buckets'])} once"
        )
    kinds = {e.get("collective") for e in got["launches"]}
    if got["launches"] and kinds != {"reduce_scatter"}:
        report.failures.append(f"{where}: launches were {kinds}, expected reduce_scatter")
    if got["launches"] and got["finish"] is not None:
        late = [e["bucket"] for e in got["launches"] if e["time"] > got["finish"]]
        if late:
            report.failures.append(f"{where}: buckets {late} launched after finish() was called")
    if not got["launches"] or got["launches"][0]["time"] >= got["dw_starts"][-1]:
        report.failures.append(
            f"{where}: no reduce-scatter started before the last backward_dw() began"
        )


# ---- P14 (and P16 next to it): expert parallel --------------------------------------------


def _moe_data(seed: int, world: int, tokens: int, hidden: int, experts: int):
    gen = torch.Generator().manual_seed(seed)
    proj_w = torch.randn(hidden, hidden, generator=gen) * 0.3
    proj_b = torch.randn(hidden, generator=gen) * 0.1
    expert_w = [torch.randn(hidden, hidden, generator=gen) * 0.3 for _ in range(experts)]
    expert_b = [torch.randn(hidden, generator=gen) * 0.1 for _ in range(experts)]
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(world)]
    # rank 0 never routes to the last expert: an empty group on purpose
    assign = [torch.arange(tokens) % (experts - 1)] + [
        torch.randint(0, experts, (tokens,), generator=gen) for _ in range(world - 1)
    ]
    dys = [torch.randn(tokens, hidden, generator=gen) for _ in range(world)]
    return proj_w, proj_b, expert_w, expert_b, xs, assign, dys


def _load(module, values: dict) -> None:
    with torch.no_grad():
        for name, value in values.items():
            getattr(module, name).copy_(value)


_MOE = {"tokens": 12, "hidden": 16, "experts": 4}


def _traced_backward_dw(module, events: list) -> None:
    """Bracket ``module.backward_dw()`` with events in ``events`` (on the instance, so the
    layer under test cannot leave them out)."""
    original = module.backward_dw

    def backward_dw(*args, **kwargs):
        events.append(("experts backward_dw start", None))
        result = original(*args, **kwargs)
        events.append(("experts backward_dw end", None))
        return result

    module.backward_dw = backward_dw


class _TracedWork:
    """A collective's work handle that records in ``events`` when ``wait()`` is called and
    returns, and the first ``is_completed()`` that says ``True``."""

    def __init__(self, work, index: int, events: list) -> None:
        self._work, self._index, self._events = work, index, events
        self._completed = False

    def wait(self, *args, **kwargs):
        self._events.append(("wait() called", self._index))
        result = self._work.wait(*args, **kwargs)
        self._events.append(("wait() returned", self._index))
        return result

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done and not self._completed:
            self._completed = True
            self._events.append(("seen completed", self._index))
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class _AllToAllTrace:
    """While active, every ``torch.distributed.all_to_all_single`` of this process is numbered
    and recorded in ``events`` (launched, or run synchronously) and its work handle traced: P14
    reads what ran while the dispatch all-to-all was in flight from this record, kept by the
    harness, never from the layer's own account of itself."""

    def __init__(self, events: list) -> None:
        self.events = events
        self.launched = 0

    def __enter__(self) -> _AllToAllTrace:
        import torch.distributed.distributed_c10d as c10d

        original = c10d.all_to_all_single
        self._saved = [(m, m.all_to_all_single) for m in (dist, c10d)]

        def all_to_all_single(*args, **kwargs):
            index = self.launched
            self.launched += 1
            work = original(*args, **kwargs)
            if work is None:
                self.events.append(("ran synchronously", index))
                return None
            self.events.append(("launched", index))
            return _TracedWork(work, index, self.events)

        for m, _ in self._saved:
            m.all_to_all_single = all_to_all_single
        return self

    def __exit__(self, *exc) -> None:
        for m, fn in self._saved:
            m.all_to_all_single = fn


def _render(events: list) -> list[str]:
    return [what if index is None else f"all-to-all {index} {what}" for what, index in events]


def _moe_rank(rank: int, world: int, lib_name: str, moe_name: str) -> dict:
    lib = load_package(lib_name)
    moe_cls = load_package(moe_name)
    tokens, hidden, experts = _MOE["tokens"], _MOE["hidden"], _MOE["experts"]
    local = experts // world
    proj_w, proj_b, expert_w, expert_b, xs, assign, dys = _moe_data(
        0, world, tokens, hidden, experts
    )
    proj = lib.Linear(hidden, hidden, delay_wgrad_compute=True)
    _load(proj, {"weight": proj_w, "bias": proj_b})
    mine = range(rank * local, (rank + 1) * local)
    grouped = lib.GroupedLinear(local, hidden, hidden, delay_wgrad_compute=True)
    _load(grouped, {f"weight{i}": expert_w[e] for i, e in enumerate(mine)})
    _load(grouped, {f"bias{i}": expert_b[e] for i, e in enumerate(mine)})
    moe = moe_cls(grouped)
    events: list = []
    _traced_backward_dw(grouped, events)
    model = torch.nn.ModuleDict({"proj": proj, "moe": moe})
    # data parallel for the replicated projection, the experts left to expert parallelism
    reducer = GradientReducer(
        model, ignore=[n for n, _ in model.named_parameters() if n.startswith("moe.")]
    )
    x = xs[rank].clone().requires_grad_()
    with _AllToAllTrace(events):
        y = moe(proj(x), assign[rank])
        events.append(("backward() called", None))
        y.backward(dys[rank])
        events.append(("backward() returned", None))
    import time

    dw_start = time.perf_counter()
    proj.backward_dw()
    reducer.finish()
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "proj": {"weight": proj.weight.grad, "bias": proj.bias.grad},
        "experts": {
            e: (getattr(grouped, f"weight{i}").grad, getattr(grouped, f"bias{i}").grad)
            for i, e in enumerate(mine)
        },
        "events": events,
        "pending": (proj.pending_wgrad_count, grouped.pending_wgrad_count),
        "launches": [t for *_, t in ((e["bucket"], e["time"]) for e in reducer.launch_log)],
        "dw_start": dw_start,
        "finish": reducer.finish_time,
    }


def _moe_truth(rank: int, world: int, lib_name: str, nranks: int) -> dict:
    lib = load_package(lib_name)
    tokens, hidden, experts = _MOE["tokens"], _MOE["hidden"], _MOE["experts"]
    proj_w, proj_b, expert_w, expert_b, xs, assign, dys = _moe_data(
        0, nranks, tokens, hidden, experts
    )
    proj = lib.Linear(hidden, hidden)
    _load(proj, {"weight": proj_w, "bias": proj_b})
    grouped = lib.GroupedLinear(experts, hidden, hidden)
    _load(grouped, {f"weight{e}": expert_w[e] for e in range(experts)})
    _load(grouped, {f"bias{e}": expert_b[e] for e in range(experts)})
    x = torch.cat(xs).requires_grad_()
    a = torch.cat(assign)
    order = torch.argsort(a, stable=True)  # rank 0's tokens before rank 1's within an expert
    # the projection per rank's tokens: its gradient is then replica 0's + replica 1's, the sum
    # the all-reduce forms (exact in either order for two)
    h = torch.cat([proj(part) for part in x.split(tokens)])
    y_sorted = grouped(h[order], torch.bincount(a, minlength=experts).tolist())
    y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)
    y.backward(torch.cat(dys))
    # the projection's data-parallel mean over the ranks
    return {
        "y": y.detach(),
        "x.grad": x.grad,
        "proj": {"weight": proj.weight.grad / nranks, "bias": proj.bias.grad / nranks},
        "experts": {
            e: (getattr(grouped, f"weight{e}").grad, getattr(grouped, f"bias{e}").grad)
            for e in range(experts)
        },
    }


def _overlap_failure(events: list) -> str | None:
    """Why ``events`` (see :class:`_AllToAllTrace`) do not show the experts' backward_dw() run
    once, start and end, while the dispatch all-to-all of the backward (the last all-to-all the
    backward launched) was in flight: after its launch, before its ``wait()`` was called (or an
    ``is_completed()`` said ``True``); ``None`` if they do."""
    lo = events.index(("backward() called", None))
    hi = events.index(("backward() returned", None))
    runs = [i for i, (what, _) in enumerate(events) if what == "experts backward_dw start"]
    if len(runs) != 1:
        return f"the experts' backward_dw() ran {len(runs)} times, expected 1"
    (start,) = runs
    ends = [j for j, (what, _) in enumerate(events) if what == "experts backward_dw end"]
    ends = [j for j in ends if j > start]
    issued = [(i, k) for i, (what, k) in enumerate(events[lo:hi], lo) if k is not None]
    issued = [(i, k) for i, k in issued if events[i][0] in ("launched", "ran synchronously")]
    if not issued:
        return "the backward issued no all_to_all_single (traced at torch.distributed)"
    launch, dispatch = issued[-1]
    if events[launch][0] == "ran synchronously":
        return f"the dispatch all-to-all (all-to-all {dispatch}) ran synchronously: never in flight"
    done = [
        i
        for i, (what, k) in enumerate(events)
        if k == dispatch and what in ("wait() called", "seen completed")
    ]
    if not done:
        return f"the dispatch all-to-all (all-to-all {dispatch}) was never waited on"
    if not (ends and launch < start < ends[0] < done[0]):
        return (
            f"the experts' backward_dw() did not run while the dispatch all-to-all (all-to-all "
            f"{dispatch}) was in flight (after its launch, before its wait())"
        )
    return None


def check_expert_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    moe: str = "splitgrad.distributed:ExpertParallelMoE",
    timeout_s: float = 300.0,
) -> DistributedReport:
    """P14 (and P16 beside it) on 2 gloo ranks; ``moe`` names the expert-parallel layer
    (``"module:Class"``, built as ``Class(grouped_linear)``)."""
    world = 2
    report = DistributedReport(f"P14 {lib_name} on {world} ranks")
    results = _ranks(
        report, "expert-parallel ranks", _moe_rank, world, lib_name, moe, timeout_s=timeout_s
    )
    truths = _ranks(
        report, "single-process baseline", _moe_truth, 1, lib_name, world, timeout_s=timeout_s
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    tokens = _MOE["tokens"]
    for rank, got in enumerate(results):
        rows = slice(rank * tokens, (rank + 1) * tokens)
        report.bitwise(f"rank {rank} output", got["y"], truth["y"][rows])
        report.bitwise(f"rank {rank} x.grad", got["x.grad"], truth["x.grad"][rows])
        for e, (w, b) in got["experts"].items():
            tw, tb = truth["experts"][e]
            report.bitwise(f"rank {rank} expert {e} weight.grad", w, tw)
            report.bitwise(f"rank {rank} expert {e} bias.grad", b, tb)
        report.compared += 1
        why = _overlap_failure(got["events"])
        if why:
            shown = _render(got["events"])
            report.failures.append(f"rank {rank}: {why}; events in order: {shown}")
        if got["pending"] != (0, 0):
            report.failures.append(f"rank {rank}: entries left pending {got['pending']}")
        for name, g in got["proj"].items():
            report.bitwise(
                f"rank {rank} proj.{name}.grad (replica0 + replica1) / 2", g, truth["proj"][name]
            )
        if not got["launches"] or max(got["launches"]) > got["finish"]:
            report.failures.append(
                f"rank {rank}: the projection's reduction was not launched before finish()"
            )
    report.bitwise(
        "proj.weight.grad rank 0 vs rank 1",
        results[0]["proj"]["weight"],
        results[1]["proj"]["weight"],
    )
    return report


# ---- P16 composed with P15: 2 pipeline stages x 2 data-parallel replicas ------------------


def _pp_dp_rank(
    rank: int, world: int, lib_name: str, configs: list[PipelineConfig], sharded: bool = False
) -> list:
    """Ranks (0, 1) and (2, 3) are two pipelines; (0, 2) and (1, 3) reduce over replicas
    (``sharded``: each stage module is fully_shard-ed over them)."""
    lib = load_package(lib_name)
    pp = 2
    replica, pp_rank = divmod(rank, pp)
    if sharded:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, pp), mesh_dim_names=("dp", "pp"))
        return [
            _run_pipeline(
                lib,
                cfg,
                pp_rank,
                pp,
                group=mesh["pp"].get_group(),
                data_seed=replica,
                fsdp_mesh=mesh["dp"],
            )
            for cfg in configs
        ]
    pp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return [
        _run_pipeline(
            lib,
            cfg,
            pp_rank,
            pp,
            group=pp_groups[replica],
            reducer_group=dp_groups[pp_rank],
            data_seed=replica,
        )
        for cfg in configs
    ]


def _pp_dp_truth(rank: int, world: int, lib_name: str, configs: list[PipelineConfig]) -> list:
    lib = load_package(lib_name)
    out = []
    for cfg in configs:
        _, num_stages = stage_layout(cfg.schedule, 0, 2)
        reps = [_single_pipeline(lib, cfg, num_stages, data_seeds=(r,)) for r in range(2)]
        emulated = []
        for i in range(num_stages):
            g0, g1 = _gradients(reps[0]["blocks"][i]), _gradients(reps[1]["blocks"][i])
            means = {n: _mean([g0[n], g1[n]], 2) for n in g0}
            emulated.append(
                {n: None if g is None else g.div_(cfg.n_microbatches) for n, g in means.items()}
            )
        out.append(
            {
                "grads": _clone_list(emulated),
                "losses": [r["losses"] for r in reps],
                **_reference_runs(cfg, num_stages, data_seeds=(0, 1)),
            }
        )
    return out


def _clone_list(items: list[dict]) -> list[dict]:
    return [_clone(d) for d in items]


def check_pipeline_data_parallel(
    lib_name: str = "splitgrad.impl",
    *,
    schedules: tuple[str, ...] = ("ScheduleZBVZeroBubble",),
    fused: tuple[bool, ...] = (False, True),
    timeout_s: float = 600.0,
    fully_shard: bool = False,
) -> DistributedReport:
    """P16 with P15 on 4 gloo ranks: 2 pipeline stages x 2 data-parallel replicas
    (``fully_shard``: each stage module fully_shard-ed over its 2 replicas, plain only; the
    ``PipelineStage`` drives FSDP2 and the reducer reduce-scatters the delayed modules)."""
    if fully_shard:
        fused = (False,)
    configs = [PipelineConfig(s, f, None, torch.float32, 4) for s in schedules for f in fused]
    kind = "fully_shard " if fully_shard else ""
    report = DistributedReport(f"P16 x P15 {kind}{lib_name}: 2 stages x 2 replicas")
    results = _ranks(
        report, "ranks", _pp_dp_rank, 4, lib_name, configs, fully_shard, timeout_s=timeout_s
    )
    truths = _ranks(
        report,
        "single-process baseline",
        _pp_dp_truth,
        1,
        lib_name,
        configs,
        timeout_s=timeout_s,
    )
    if results is None or truths is None:
        return report
    (truth,) = truths
    for k, cfg in enumerate(configs):
        for rank, per_rank in enumerate(results):
            got = per_rank[k]
            replica = rank // 2
            where = f"{cfg.label} rank {rank} (replica {replica})"
            for error in got["errors"]:
                report.failures.append(f"{where}: finish() raised: {error}")
            for i, grads in got["grads"].items():
                for name, g in grads.items():
                    report.bitwise(
                        f"{where} stage {i} {name} vs (replica0 + replica1) / 2 without delay",
                        g,
                        truth[k]["grads"][i][name],
                    )
                if truth[k]["truth"] is not None:
                    _judge_truth(
                        report,
                        f"{where} stage {i} (global batch)",
                        grads,
                        truth[k]["naive"][i],
                        truth[k]["truth"][i],
                    )
                launches = got["launches"][i]
                report.compared += 1
                if not launches:
                    report.failures.append(f"{where} stage {i}: no reduction launched")
                elif max(t for _, t in launches) > got["finish"][i]:
                    report.failures.append(
                        f"{where} stage {i}: a reduction launched after finish()"
                    )
                left = {n: c for n, c in got["pending"][i].items() if c}
                if left:
                    report.failures.append(f"{where} stage {i}: entries pending {left}")
            for j, loss in enumerate(got["losses"]):
                report.bitwise(f"{where} loss {j}", loss, truth[k]["losses"][replica][j])
    return report


def run_all(lib_name: str = "splitgrad.impl") -> list[DistributedReport]:
    """Every distributed check with its default configuration (what ``ci`` runs)."""
    return [
        check_expert_parallel(lib_name),
        check_data_parallel(lib_name),
        check_pipeline(lib_name, world_size=2),
        check_pipeline_data_parallel(lib_name),
        check_fully_sharded(lib_name),
        check_pipeline_data_parallel(lib_name, fully_shard=True),
    ]
