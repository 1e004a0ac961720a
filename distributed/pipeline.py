"""Pipeline parallel: the W step of ``torch.distributed.pipelining``'s schedules (SPEC §8, P15).

A zero-bubble schedule splits each micro-batch's backward into B (input gradients, sent to the
previous stage at once) and W (weight gradients, run later to fill a bubble). torch's own split
(``stage_backward_input`` / ``stage_backward_weight``) re-walks the autograd graph and cannot split
a custom ``autograd.Function`` (pytorch#166577). A ``PipelineStage`` built with a ``dw_builder``
instead runs the full backward at B and calls the builder; the runner the builder returns is the
W step. With split-backward modules built with ``delay_wgrad_compute=True`` that is exactly the
split: the full backward computes input (and norm) gradients and *queues* the GEMM weight
gradients; the runner runs them with ``backward_dw()``.

:func:`dw_builder` makes that builder for one stage module:

* each call (one per backward of a micro-batch) records how many entries each delayed module of
  the stage queued in that backward; its runner runs exactly those entries;
* runners run in the order they were built (every module's queue is FIFO); a runner called out of
  that order raises ``RuntimeError`` naming both micro-batches and runs nothing; a runner that
  fails part-way (a wgrad raised) keeps what it has not run, so calling it again finishes it;
* schedules without a W step (``ScheduleGPipe``, ``Schedule1F1B``) call the runner right after
  the backward: delayed modules then behave as if not delayed;
* shape inference: on its first ``step()`` a ``PipelineStage`` without static shapes runs the
  stage once on placeholder tensors (uninitialized, except on the first stage) to infer shapes,
  forward and input-only backward. That writes no gradient and queues nothing (SPEC §3), but it
  would record the placeholders' amaxes in delayed-scaling FP8 histories. The builder snapshots
  the FP8 state of the stage's modules (splitgrad's ``fp8_states``) when that inference forward
  starts and puts it back before the first real forward. (Other packages: give the stage static
  ``input_args``/``output_args`` so that no inference runs.)
* gradient scaling: a schedule divides ``param.grad`` by the number of micro-batches
  (``PipelineStage.scale_grads``) once the stage's last W step has run. The builder attaches to
  the stage that calls it and extends that scaling to fused ``main_grad``, refuses (raises) to
  scale while any entry of the stage is still queued, and completes the stage module's
  :class:`~splitgrad.distributed.GradientReducer` first, so that averaging over replicas and
  scaling over micro-batches both apply to the final gradients, in that order.

Only the public module API of SPEC §2-§4 is used, so any conforming package works.
"""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable

import torch

from ._torch_private import (
    SHAPE_INFERENCE_METHODS,
    TorchMoved,
    calling_stage,
    in_shape_inference,
    shape_inference_method,
)
from .modules import SplitModule, gradient_tensor, split_modules

__all__ = [
    "dw_builder",
    "DWBuilder",
    "WStepRunner",
    "in_shape_inference",
    "shape_inference_method",
    "SHAPE_INFERENCE_METHODS",
]


class WStepRunner:
    """The W step of one micro-batch of one stage: ``backward_dw()`` on exactly the entries its
    backward queued. Built by :class:`DWBuilder`; call it once (with no arguments)."""

    def __init__(self, builder: DWBuilder, index: int, label: str, counts: dict) -> None:
        self._builder = builder
        self.index = index
        #: How the runner is named in errors: the micro-batch id the schedule used, when known.
        self.label = label
        # (split module, entries still to run), in the order they run
        self._todo: list[list] = [[sm, n] for sm, n in counts.items()]
        self.done = False

    @property
    def entries(self) -> dict[str, int]:
        """Entries still to run, by module name."""
        return {sm.name or "<stage>": n for sm, n in self._todo if n}

    def __call__(self) -> None:
        if self.done:
            raise RuntimeError(f"the W step of {self.label} already ran")
        head = self._builder._outstanding[0]
        if head is not self:
            raise RuntimeError(
                f"W step of {self.label} called before the W step of {head.label}, which was "
                "built earlier: each module's weight-gradient queue is FIFO, so a stage's W steps "
                "must run in the order their backwards ran; nothing was run"
            )
        for item in self._todo:
            sm, _ = item
            while item[1]:
                sm.module.backward_dw()  # raises -> its entry stays queued, this runner resumes
                item[1] -= 1
                self._builder._accounted[id(sm.module)] -= 1
        self.done = True
        self._builder._outstanding.popleft()


class DWBuilder:
    """The ``dw_builder`` of one pipeline stage module (see the module docstring)."""

    def __init__(self, stage_module: torch.nn.Module) -> None:
        if not isinstance(stage_module, torch.nn.Module):
            raise TypeError(f"stage_module must be a torch.nn.Module, got {stage_module!r}")
        self.stage_module = stage_module
        modules = split_modules(stage_module)
        # W steps run the stage's modules last-registered first, the order a backward reaches them.
        self._delayed: list[SplitModule] = [sm for sm in reversed(modules) if sm.delayed]
        self._fused: list[tuple[torch.nn.Parameter, bool]] = [
            (p, True) for sm in modules for name, p in sm.gemm_params if sm.uses_main_grad(name)
        ]
        # Entries already promised to runners that have not run yet, by id(module).
        self._accounted: dict[int, int] = {id(sm.module): 0 for sm in self._delayed}
        self._outstanding: collections.deque[WStepRunner] = collections.deque()
        self._built = 0
        self.stage = None
        self._fp8_snapshot: list[tuple[torch.nn.Module, dict]] | None = None
        self._modules = modules
        if not self._delayed:
            warnings.warn(
                f"dw_builder({type(stage_module).__name__}): nothing is split, the stage has "
                f"{len(modules)} split-backward module(s) and none with delay_wgrad_compute=True; "
                "its W steps run nothing and every gradient is computed in the backward",
                UserWarning,
                stacklevel=3,
            )
        shape_inference_method()  # refuse a torch where the inference pass cannot be told apart
        stage_module.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: torch.nn.Module, args) -> None:
        """Keep pipelining's shape-inference forward out of the FP8 amax histories."""
        if in_shape_inference():
            if self._fp8_snapshot is None:
                self._fp8_snapshot = [
                    (sm.module, copy.deepcopy(sm.module.fp8_states))
                    for sm in self._modules
                    if isinstance(getattr(sm.module, "fp8_states", None), dict)
                ]
        elif self._fp8_snapshot is not None:
            for m, states in self._fp8_snapshot:
                m.fp8_states = states
            self._fp8_snapshot = None

    @property
    def pending_runners(self) -> int:
        """Runners built and not yet run."""
        return len(self._outstanding)

    def __call__(self) -> WStepRunner:
        label = self._label_and_attach()
        counts: dict[SplitModule, int] = {}
        for sm in self._delayed:
            key = id(sm.module)
            new = sm.module.pending_wgrad_count - self._accounted[key]
            if new < 0:
                raise RuntimeError(
                    f"{sm.name or type(sm.module).__name__}: {sm.module.pending_wgrad_count} "
                    f"entries pending, but {self._accounted[key]} belong to W steps not run yet: "
                    "something else ran backward_dw() on this stage's modules"
                )
            if new:
                counts[sm] = new
                self._accounted[key] += new
        runner = WStepRunner(self, self._built, label, counts)
        self._built += 1
        self._outstanding.append(runner)
        return runner

    # ---- the stage's gradient scaling ----------------------------------------------------

    def attach(self, stage) -> None:
        """Extend ``stage.scale_grads`` (called by every schedule after the stage's last W step):
        refuse while entries are queued, finish the module's GradientReducer, scale ``.grad``
        as torch does, and fused ``main_grad`` too. Done automatically on the first build when
        the builder is called by a ``PipelineStage``; call it yourself for a custom runtime."""
        if self.stage is stage:
            return
        if getattr(stage, "submod", None) is not self.stage_module:
            raise ValueError("attach(stage): stage.submod is not this builder's stage module")
        original = stage.scale_grads

        def scale_grads(grad_scale_factor: int) -> None:
            self.check_drained("scale_grads")
            from .data_parallel import reducer_of

            reducer = reducer_of(self.stage_module)
            if reducer is not None:
                reducer.finish_for_schedule()
            original(grad_scale_factor)
            if grad_scale_factor != 1:
                with torch.no_grad():
                    for p, fused in self._fused:
                        gradient_tensor(p, fused).div_(grad_scale_factor)

        stage.scale_grads = scale_grads
        self.stage = stage

    def check_drained(self, what: str) -> None:
        """Raise ``RuntimeError`` if any delayed module of the stage still has queued entries."""
        left = {sm.name or "<stage>": sm.module.pending_wgrad_count for sm in self._delayed}
        left = {k: v for k, v in left.items() if v}
        if left:
            raise RuntimeError(
                f"{what} with weight-gradient entries still queued ({left}, "
                f"{self.pending_runners} W steps not run): those gradients are not final yet"
            )

    def _label_and_attach(self) -> str:
        """How this call's runner is named in errors: "micro-batch 3" when a pipelining stage
        is building (its ``bwd_chunk_id``), else the builder's own count of backwards. On the
        first call from a stage, attach to it (:meth:`attach`)."""
        try:
            caller = calling_stage(self)
        except TorchMoved:
            if self.stage is None:
                raise  # never run without scale_grads's drain check and main_grad scaling
            caller = None  # attached by hand, as the error asks
        if caller is None:
            return f"backward #{self._built}"
        stage, chunk = caller
        if self.stage is None:
            self.attach(stage)
        return f"micro-batch {chunk}"


def dw_builder(stage_module: torch.nn.Module) -> Callable[[], WStepRunner]:
    """The builder to pass as ``torch.distributed.pipelining.PipelineStage(stage_module, ...,
    dw_builder=dw_builder(stage_module))``: its runners are the schedule's W steps, each running
    ``backward_dw()`` on exactly the entries its micro-batch's backward queued."""
    return DWBuilder(stage_module)
