"""One live module under test (:class:`ModuleRun`: the case's weights, ``main_grad`` and
``.grad`` prefills, recording hooks) and what the checks observe about it. A check describes what
it did as :class:`Step`\\ s; :func:`play` runs them, so the truth can replay the same steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import torch

from ..backends import Backend
from ..cases.case import Case, ModuleConfig
from ..cases.data import (
    MicroBatchData,
    gemm_bias_names,
    gemm_weight_names,
    make_grad_prefill,
    make_main_grads,
    make_state,
)

__all__ = [
    "ModuleRun",
    "Snapshot",
    "torch_autocast",
    "AccuracyRun",
    "Step",
    "fb_steps",
    "tied_fb",
    "play",
    "clone_of",
]


def torch_autocast(config: ModuleConfig) -> contextlib.AbstractContextManager:
    """``torch.autocast(device, dtype)`` for a config with an autocast dtype, else nothing."""
    if config.autocast is None:
        return contextlib.nullcontext()
    device = torch.device(config.device).type
    return torch.autocast(device, dtype=config.compute_dtype)


Snapshot = dict[str, torch.Tensor | None]


@dataclasses.dataclass
class HookCall:
    """One hook invocation: which hook, and the GEMM gradients it could see at that moment."""

    hook: int
    seen: Snapshot


class ModuleRun:
    """A module built by ``backend`` for ``case.config`` with the case's weights."""

    def __init__(
        self,
        backend: Backend,
        case: Case,
        *,
        delay: bool,
        prefill_grads: bool = False,
        frozen: Sequence[str] = (),
        state: dict[str, torch.Tensor] | None = None,
        main_grads: dict[str, torch.Tensor] | None | bool = None,
        config: ModuleConfig | None = None,
        ub_bulk_wgrad: bool = False,
        hooks: int = 2,
        module: object = None,
    ) -> None:
        self.backend = backend
        self.config = config or case.config
        self.delay = delay
        if module is None:
            module = backend.build(self.config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)
            backend.load_state(
                module, state if state is not None else make_state(self.config, case.seed)
            )
        self.module = module
        #: Whether the backend has SPEC §4's queue at all (a module built without delay needs
        #: none: nothing is ever pending).
        self.split_api = "delay" not in backend.missing_api()
        self.params = backend.parameters(self.module)
        # Roles come from SPEC §2's parameter names, never from the implementation.
        self.weight_names = [n for n in gemm_weight_names(self.config) if n in self.params]
        self.bias_names = [n for n in gemm_bias_names(self.config) if n in self.params]
        self.gemm_names = self.weight_names + self.bias_names
        self.norm_names = [n for n in self.params if n not in self.gemm_names]
        for name in frozen:
            self.params[name].requires_grad_(False)
        if self.config.fuse_wgrad_accumulation and main_grads is not False:
            if main_grads is None:
                main_grads = make_main_grads(self.config, case.seed)
            for name in self.weight_names:
                p = self.params[name]
                p.main_grad = main_grads[name].clone()
                p.grad_added_to_main_grad = False
        if prefill_grads:
            values = make_grad_prefill(self.config, case.seed)
            for name, p in self.params.items():
                if p.requires_grad and not self.uses_main_grad(name):
                    p.grad = values[name].clone()
        self.hook_calls: list[HookCall] = []
        #: Recording hooks registered (none when the backend has no hooks, SPEC §4).
        self.hook_count = hooks if backend.has_hooks() else 0
        for i in range(self.hook_count):
            backend.register_hook(self.module, self._make_hook(i))

    def _make_hook(self, index: int):
        def hook() -> None:
            self.hook_calls.append(HookCall(index, self.gemm_snapshot()))

        return hook

    def forward(self, x: torch.Tensor, m_splits, is_first_microbatch) -> torch.Tensor:
        """One forward, inside ``fp8_autocast(enabled=True, fp8_recipe=...)`` under FP8 and
        inside ``torch.autocast`` when the config has an autocast dtype (the backward and
        ``backward_dw()`` run outside it, as in a training loop)."""
        with self.backend.fp8_autocast(self.config), torch_autocast(self.config):
            return self.backend.forward(self.module, x, m_splits, is_first_microbatch)

    def functional_forward(
        self, tensors: dict[str, torch.Tensor], x: torch.Tensor, m_splits, is_first_microbatch
    ) -> torch.Tensor:
        """:meth:`forward` with the parameters named in ``tensors`` replaced by them for this
        call (``torch.func.functional_call``, :meth:`~.backends.Backend.functional_forward`)."""
        with self.backend.fp8_autocast(self.config), torch_autocast(self.config):
            return self.backend.functional_forward(
                self.module, tensors, x, m_splits, is_first_microbatch
            )

    def fb(
        self, data: MicroBatchData, *, first: bool | None = ...
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward of one micro-batch on a fresh leaf input; returns ``(x, y)``."""
        x = data.fresh_input()
        flag = data.spec.is_first_microbatch if first is ... else first
        y = self.forward(x, data.spec.m_splits, flag)
        self.backend.backward(self.module, [y], [data.dy])
        return x, y.detach()

    def backward_outputs(
        self, outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]
    ) -> None:
        self.backend.backward(self.module, outputs, grads)

    def dw(self) -> None:
        if self.split_api or self.delay:
            self.backend.backward_dw(self.module)

    def drain(self) -> None:
        """``backward_dw()`` until nothing is pending (at most 64 times)."""
        for _ in range(64):
            if not self.pending():
                return
            self.dw()

    def pending(self) -> int:
        if not self.split_api and not self.delay:
            return 0
        return self.backend.pending_wgrad_count(self.module)

    def zero_grads(self) -> None:
        """What an optimizer step's ``zero_grad(set_to_none=True)`` plus a main_grad reset do."""
        for p in self.params.values():
            p.grad = None
        if self.config.fuse_wgrad_accumulation:
            for name in self.weight_names:
                self.params[name].main_grad.zero_()

    def uses_main_grad(self, name: str) -> bool:
        return self.config.fuse_wgrad_accumulation and name in self.weight_names

    def grad_of(self, name: str) -> torch.Tensor | None:
        """The tensor where ``name``'s gradient lives: ``main_grad`` for fused weights."""
        p = self.params[name]
        return p.main_grad if self.uses_main_grad(name) else p.grad

    def snapshot(self, names: Sequence[str]) -> Snapshot:
        """Clones of the gradients of ``names``, keyed ``"fc1_weight.main_grad"`` etc. Fused
        weights also report ``.grad`` (which must stay ``None``)."""
        out: Snapshot = {}
        for name in names:
            fused = self.uses_main_grad(name)
            out[f"{name}.main_grad" if fused else f"{name}.grad"] = clone_of(self.grad_of(name))
            if fused:
                out[f"{name}.grad"] = clone_of(self.params[name].grad)
        return out

    def gemm_snapshot(self) -> Snapshot:
        return self.snapshot(self.gemm_names)

    def norm_snapshot(self) -> Snapshot:
        return self.snapshot(self.norm_names)

    def all_snapshot(self) -> Snapshot:
        return self.snapshot(list(self.params))

    def fp8_snapshot(self) -> Snapshot:
        """Clones of the delayed-scaling amax histories and scales (empty without them)."""
        return dict(self.backend.fp8_state(self.module))

    def added_flags(self) -> dict[str, bool]:
        return {
            n: bool(getattr(self.params[n], "grad_added_to_main_grad", False))
            for n in self.weight_names
        }


@dataclasses.dataclass
class AccuracyRun:
    """What one run produced (for a candidate truth, what it should have): each micro-batch's
    output and input gradient (its last forward; ``None`` where it did not run), the norm and
    GEMM gradient snapshots; ``switched`` (candidate truths under FP8): per tensor, the summed
    magnitude of the ``relu'`` switches the candidate made (:func:`~.judge.kink_candidates`)."""

    outputs: list[torch.Tensor | None]
    xgrads: list[torch.Tensor | None]
    norm: Snapshot
    gemm: Snapshot
    switched: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Step:
    """One step of a differential check: ``"fb"`` (micro-batch ``index`` forward + backward),
    ``"zero"`` (:meth:`ModuleRun.zero_grads`), ``"tied"`` / ``"chain"`` (:func:`tied_fb` from
    micro-batch ``index``: two side by side, or one through the module twice)."""

    op: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.op not in ("fb", "zero", "tied", "chain"):
            raise ValueError(f"unknown step {self.op!r}; expected fb, zero, tied or chain")


def fb_steps(n: int) -> tuple[Step, ...]:
    """Forward + backward of micro-batches ``0 .. n-1`` in order."""
    return tuple(Step("fb", i) for i in range(n))


def tied_fb(run: ModuleRun, data: Sequence[MicroBatchData], chain: bool, index: int = 0):
    """One backward through two uses of the module, only the first with its
    ``is_first_microbatch`` flag: micro-batches ``index`` and ``index + 1``, or micro-batch
    ``index`` chained (``y = m(m(x))``); returns the leaf inputs."""
    d0 = data[index]
    x0 = d0.fresh_input()
    y0 = run.forward(x0, d0.spec.m_splits, d0.spec.is_first_microbatch)
    if chain:
        y1 = run.forward(y0, d0.spec.m_splits, None)
        run.backward_outputs([y1], [d0.dy])
        return [x0]
    d1 = data[index + 1]
    x1 = d1.fresh_input()
    y1 = run.forward(x1, d1.spec.m_splits, None)
    run.backward_outputs([y0, y1], [d0.dy, d1.dy])
    return [x0, x1]


def clone_of(t: torch.Tensor | None) -> torch.Tensor | None:
    """A detached clone of ``t`` (``None`` stays ``None``)."""
    return None if t is None else t.detach().clone()


def play(
    run: ModuleRun,
    data: Sequence[MicroBatchData],
    steps: Sequence[Step],
    dtype: torch.dtype | None = None,
) -> AccuracyRun:
    """Run ``steps`` on ``run`` (its inputs cast to ``dtype`` when given), drain the queue, and
    return what they produced (norm gradients taken before draining)."""
    if dtype is not None:
        data = [dataclasses.replace(d, x=d.x.to(dtype), dy=d.dy.to(dtype)) for d in data]
    outputs: list[torch.Tensor | None] = [None] * len(data)
    xgrads: list[torch.Tensor | None] = [None] * len(data)
    for step in steps:
        if step.op == "fb":
            x, outputs[step.index] = run.fb(data[step.index])
            xgrads[step.index] = clone_of(x.grad)
        elif step.op == "zero":
            run.zero_grads()
        else:
            xs = tied_fb(run, data, step.op == "chain", step.index)
            for k, x in enumerate(xs):
                xgrads[step.index + k] = clone_of(x.grad)
    norm = run.norm_snapshot()
    run.drain()
    return AccuracyRun(outputs, xgrads, norm, run.gemm_snapshot())
