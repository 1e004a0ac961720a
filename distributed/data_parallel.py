"""Data parallel: reduce every gradient once per step, as soon as it is final (SPEC §8, P16).

torch's ``DistributedDataParallel`` reduces a parameter from a hook on autograd's
``AccumulateGrad``, which fires during ``backward()``. A delayed GEMM parameter gets its gradient
later, in ``backward_dw()``, and a fused one accumulates into ``main_grad``, which DDP never
reads: under DDP both would stay unreduced (the modules refuse to run inside DDP's forward for
that reason). :class:`GradientReducer` takes DDP's place:

* **When a gradient is final.** A step is several micro-batches; a gradient is final after the
  step's *last* backward pass that produces it (``no_sync()`` marks the earlier ones, as DDP's
  ``no_sync`` does, or ``num_microbatches=n`` counts them: the n-th pass is the last). A
  non-delayed parameter is produced when autograd accumulates into it (its
  ``register_post_accumulate_grad_hook``). A delayed GEMM parameter (``skip_backward_post_hook``,
  SPEC §4) is followed from its module's own API only, never from autograd reaching it (a
  conforming module may hand its Function detached copies; TransformerEngine returns no
  gradient for a delayed weight): a forward hook puts a gradient hook on the module's output, so
  the reducer learns each backward pass that reaches the module; ``pending_wgrad_count`` read
  there and again when that pass ends tells how many entries the pass queued (none for
  input-only backwards such as ``torch.autograd.grad(y, x)`` or pipelining's shape inference,
  P17), and the module hook of §4 says when each entry has run (FIFO). The gradient is final
  once the last entry of the step's last producing pass has run.
* **What is reduced.** ``.grad``, or ``main_grad`` for the GEMM weights of a module built with
  ``fuse_wgrad_accumulation=True``; the average over the process group.
* **How.** Parameters are packed into buckets (``bucket_cap_mb``, one dtype each) in the order
  they are expected to become final: parameters reduced from autograd's hooks first, then the
  delayed ones, each group last-registered first. A bucket is flattened and all-reduced
  asynchronously as soon as all its parameters are final *and* every earlier bucket has been
  launched, so every rank issues the same collectives in the same order. Launches overlap the
  rest of the backward and the remaining ``backward_dw()`` work; :attr:`launch_log` records
  when each launch happened.
* **finish()** waits for every reduction (with a timeout), writes the averages back, and raises
  ``RuntimeError`` if a gradient was never produced, was produced again after its reduction had
  started (a micro-batch not marked as non-final, or a ``backward_dw()`` after the last one), or
  was changed while it was being reduced. Call it before the optimizer step; it is a no-op when
  the step is already finished (a pipeline stage's gradient scaling finishes it, see
  :mod:`.pipeline`).
* **Under fully_shard (FSDP2).** Built on a model wrapped with ``fully_shard`` (build it
  *after* ``fully_shard``; built before, the model's first forward raises), the reducer leaves
  every non-delayed parameter to FSDP2's own reduce-scatter and takes over the delayed modules'
  GEMM parameters (see :mod:`.fsdp`): their gradients, written by ``backward_dw()`` to FSDP2's
  unsharded parameters, are kept out of FSDP2's post-backward, and once a module's last entry
  of the step has run they are reduce-scattered asynchronously (one collective per module, in
  the fixed bucket order, averaged as FSDP2 averages) into the sharded ``param.grad`` DTensors,
  which :meth:`finish` writes (or adds to). Under a ``MixedPrecisionPolicy`` whose
  ``reduce_dtype`` differs from the gradients' dtype, a step's micro-batches are summed in
  ``reduce_dtype`` once each pass's entries have run, as FSDP2 sums its own between passes.
  ``backward_dw()`` runs with the unsharded ``Parameter`` objects registered, as the backward
  saw them (FSDP2 has resharded by then; no data is gathered: a wgrad entry needs no weight
  values). The reducer may be built on a model still on meta: its parameters are marked again
  after ``to_empty()`` (see :func:`.fsdp.mark_reduced_from_module_hooks`). :meth:`no_sync` also
  turns FSDP2's gradient sync off (its ``set_requires_gradient_sync``) for its passes; with
  ``num_microbatches`` the caller sets it. Either way a disagreement is reported by
  :meth:`finish`: FSDP2 syncing in a pass the reducer counts as non-final, or not syncing in the
  last one, unless told the reduction is deferred (``set_is_last_backward(False)``, as
  ``PipelineStage`` does before calling FSDP2's post-backward at its REDUCE_GRAD step); and a
  gradient FSDP2 left unreduced on an unsharded parameter. Refused (``ValueError``): fused
  accumulation, HSDP and replicate meshes, CPU offload, tensor-parallel DTensor parameters,
  parameters no ``fully_shard`` manages, and a model with no delayed module (FSDP2 alone
  suffices). ``bucket_cap_mb`` does not apply.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import functools
import time
import weakref
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

from . import _autograd, fsdp
from .modules import SplitModule, gradient_tensor, split_modules

__all__ = ["GradientReducer", "reducer_of"]

_REDUCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reducer_of(module: torch.nn.Module) -> GradientReducer | None:
    """The :class:`GradientReducer` built on ``module`` itself, if any."""
    return _REDUCERS.get(module)


@dataclasses.dataclass(eq=False)
class _Param:
    name: str
    param: torch.nn.Parameter
    main_grad: bool
    owner: SplitModule | None  # set for delayed GEMM parameters (reduced from module hooks)
    local: str = ""  # its name inside the owner
    fsdp: object = None  # its FSDPParam under fully_shard
    bucket: int = -1
    passes: int = 0  # producing backward passes seen this step (non-delayed parameters)
    last_task: int = -1
    ready: bool = False
    # every delayed module holding it (a weight tied between two of them has two); it is
    # final once each has run the last entry of its step's last pass
    owners: tuple = ()
    owners_final: int = 0
    # under fully_shard with a reduce_dtype other than the gradient's: the step's earlier
    # passes' gradients, summed in reduce_dtype as FSDP2 sums its own
    accumulated: torch.Tensor | None = None

    @property
    def delayed(self) -> bool:
        return self.owner is not None


@dataclasses.dataclass(eq=False)
class _Pass:
    """The entries one backward pass queued on one delayed module, not yet run."""

    entries: int
    final: bool


@dataclasses.dataclass(eq=False)
class _Owner:
    """What the reducer follows of one delayed module through a step."""

    sm: SplitModule
    params: list[_Param]
    passes: int = 0  # backward passes of this step that queued entries on it
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    # backward passes under way that reached the module: id -> [pending at the start, entries
    # run by backward_dw() during the pass that the pass itself queued]
    running: dict = dataclasses.field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.sm.name or type(self.sm.module).__name__

    def reset(self) -> None:
        self.passes = 0
        self.queue.clear()
        self.running.clear()


@dataclasses.dataclass(eq=False)
class _Bucket:
    index: int
    params: list[_Param]
    work: object = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)


class GradientReducer:
    """Average-reduce every trainable parameter's gradient of ``module`` across
    ``process_group`` once per step, each bucket launched as soon as its gradients are final.

    Args:
        module: the model replica (plain ``torch.nn`` modules and split-backward modules alike).
        process_group: the data-parallel group (default: the world).
        num_microbatches: backward passes per step; ``None`` (default): every backward pass
            outside :meth:`no_sync` is a step's last.
        bucket_cap_mb: bucket size, as DDP's.
        ignore: parameters (or their names in ``module``) that this reducer leaves alone, e.g.
            the experts of an expert-parallel layer.
        timeout: how long :meth:`finish` waits for one bucket before raising.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        process_group: dist.ProcessGroup | None = None,
        *,
        num_microbatches: int | None = None,
        bucket_cap_mb: float = 25.0,
        ignore: Iterable[str | torch.nn.Parameter] = (),
        timeout: datetime.timedelta = datetime.timedelta(minutes=5),
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GradientReducer needs torch.distributed to be initialized")
        _autograd.check_available()
        if num_microbatches is not None and (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be a positive int, got {num_microbatches!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        if module in _REDUCERS:
            raise RuntimeError(
                "this module already has a GradientReducer (hooks cannot be removed): reuse it"
            )
        self._fsdp = fsdp.describe(module) if fsdp.is_fully_sharded(module) else None
        if self._fsdp is not None:
            if process_group is not None and process_group is not self._fsdp.process_group:
                raise ValueError(
                    "process_group differs from the group fully_shard shards over: under FSDP2 "
                    "the reducer reduce-scatters over FSDP2's own group (pass None)"
                )
            process_group = self._fsdp.process_group
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.num_microbatches = num_microbatches
        self.timeout = timeout
        ignored = {id(p) for p in ignore if isinstance(p, torch.Tensor)}
        ignored_names = {p for p in ignore if isinstance(p, str)}
        names = dict(module.named_parameters())
        unknown = sorted(ignored_names - set(names))
        if unknown:
            raise ValueError(f"ignore names parameters {unknown} that module does not have")

        owner: dict[int, tuple[SplitModule, str]] = {}
        holders: dict[int, list[SplitModule]] = collections.defaultdict(list)
        for sm in split_modules(module):
            for local, p in sm.gemm_params:
                owner[id(p)] = (sm, local)
                holders[id(p)].append(sm)
        self._params: list[_Param] = []
        # FSDP2 reduces these itself (non-delayed parameters under fully_shard)
        self._fsdp_own: list[tuple[str, object]] = []
        unmanaged: list[str] = []
        for name, p in names.items():
            if not p.requires_grad or id(p) in ignored or name in ignored_names:
                continue
            sm, local = owner.get(id(p), (None, None))
            deferred = bool(getattr(p, "skip_backward_post_hook", False))
            if deferred and (sm is None or not sm.delayed):
                raise ValueError(
                    f"{name} has skip_backward_post_hook=True but no delayed split-backward "
                    "module owns it: no module hook would report its gradient"
                )
            main_grad = sm is not None and sm.uses_main_grad(local)
            fp = None
            if self._fsdp is not None:
                fp = self._fsdp.params.get(id(p))
                if fp is None:
                    unmanaged.append(name)
                    continue
                # fully_shard's new sharded Parameters do not carry skip_backward_post_hook
                deferred = sm is not None and sm.delayed
                if main_grad:
                    raise ValueError(
                        f"{name}: fuse_wgrad_accumulation=True under fully_shard is not supported "
                        "(FSDP2 owns the gradient storage and never reads main_grad)"
                    )
                if not deferred:
                    self._fsdp_own.append((name, fp))
                    continue
                p = fp.sharded_param
            held_by = tuple(holders[id(names[name])]) if deferred else ()
            if len(held_by) > 1 and (self._fsdp is not None or any(not h.delayed for h in held_by)):
                raise ValueError(
                    f"{name} is shared by {len(held_by)} split-backward modules, "
                    + (
                        "which GradientReducer does not follow under fully_shard"
                        if self._fsdp is not None
                        else "some of them without delay_wgrad_compute: tie it between "
                        "modules that all defer it, or none"
                    )
                )
            self._params.append(
                _Param(
                    name, p, main_grad, sm if deferred else None, local or "", fp, owners=held_by
                )
            )
        if unmanaged:
            raise ValueError(
                f"under fully_shard every trainable parameter must be managed by FSDP2, but "
                f"{unmanaged} are not: apply fully_shard to the root module too"
            )
        if not self._params:
            if self._fsdp is not None:
                raise ValueError(
                    "nothing for GradientReducer to reduce: the fully_shard-ed module has no "
                    "delayed split-backward module, and FSDP2 reduces every other gradient itself"
                )
            raise ValueError("module has no trainable parameter to reduce")
        by_device: dict[str, str] = {}
        for st in self._params:
            by_device.setdefault(str(st.param.device), st.name)
        if len(by_device) > 1:
            raise ValueError(
                "GradientReducer needs the module's trainable parameters on one device (its "
                f"buckets are flat tensors), got {len(by_device)}: "
                + ", ".join(f"{dev} (e.g. {name})" for dev, name in by_device.items())
            )
        self._by_id = {id(st.param): st for st in self._params}
        self._buckets = self._make_buckets(bucket_cap_mb)
        self._next_bucket = 0
        self._no_sync = False
        self._errors: list[str] = []
        self._finished = True
        self._finished_by_schedule = False
        self._step = 0
        #: One record per bucket launch of the current step (cleared when the next step starts):
        #: ``{"bucket", "params", "time", "step"}``, ``time`` from ``time.perf_counter()``.
        self.launch_log: list[dict] = []
        #: ``time.perf_counter()`` when :meth:`finish` was last called.
        self.finish_time: float | None = None

        for st in self._params:
            if not st.delayed:
                st.param.register_post_accumulate_grad_hook(self._on_accumulate)
        self._owners: list[_Owner] = []
        for st in self._params:
            for sm in st.owners:
                owner = next((o for o in self._owners if o.sm.module is sm.module), None)
                if owner is None:
                    owner = _Owner(sm, [])
                    self._owners.append(owner)
                owner.params.append(st)
        for owner in self._owners:
            hook = _ModuleHook(weakref.ref(self), owner)
            owner.sm.module.register_wgrad_accumulation_and_reduce_hooks(hook)
            owner.sm.module.register_forward_hook(hook.after_forward)
        # FSDP2 post-backward passes per group this step: id(group) -> [last task, count]
        self._fsdp_passes: dict[int, list[int]] = {}
        if self._fsdp is not None:
            self._attach_to_fsdp()
        else:
            module.register_forward_pre_hook(
                functools.partial(_call_weakly_hook, weakref.ref(self), "_check_not_sharded_later")
            )
        _REDUCERS[module] = self

    # ---- buckets -----------------------------------------------------------------------------

    def _make_buckets(self, cap_mb: float) -> list[_Bucket]:
        cap = cap_mb * 2**20
        ordered = [st for st in reversed(self._params) if not st.delayed] + [
            st for st in reversed(self._params) if st.delayed
        ]
        buckets: list[_Bucket] = []
        current: list[_Param] = []
        size, kind = 0.0, None
        for st in ordered:
            this_kind = (st.main_grad, st.param.dtype, st.param.device, st.delayed)
            if st.fsdp is not None:  # one reduce-scatter per delayed module
                this_kind += (id(st.owner.module),)
            nbytes = st.param.numel() * (4 if st.main_grad else st.param.element_size())
            if current and (this_kind != kind or (st.fsdp is None and size + nbytes > cap)):
                buckets.append(_Bucket(len(buckets), current))
                current, size = [], 0.0
            current.append(st)
            size += nbytes
            kind = this_kind
        if current:
            buckets.append(_Bucket(len(buckets), current))
        for b in buckets:
            for st in b.params:
                st.bucket = b.index
        return buckets

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names per bucket, in launch order."""
        return [[st.name for st in b.params] for b in self._buckets]

    # ---- micro-batches -----------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside this context are not a step's last (as DDP's ``no_sync``)."""
        if self.num_microbatches is not None:
            raise RuntimeError(
                f"no_sync() with num_microbatches={self.num_microbatches}: use one or the other"
            )
        previous, self._no_sync = self._no_sync, True
        groups = self._fsdp.groups if self._fsdp is not None else []
        # FSDP2's own gradient sync is off for the same passes (its set_requires_gradient_sync)
        flags = [(g, g.reduce_grads, g.all_reduce_grads) for g in groups]
        for g in groups:
            g.reduce_grads = g.all_reduce_grads = False
        try:
            yield
        finally:
            self._no_sync = previous
            for g, reduce_grads, all_reduce_grads in flags:
                g.reduce_grads, g.all_reduce_grads = reduce_grads, all_reduce_grads

    def _begin_step_if_needed(self) -> None:
        if self._finished:
            self._finished = False
            self._finished_by_schedule = False
            self._step += 1
            self.launch_log = []

    def _final_pass(self, name: str, passes: int) -> bool:
        """Whether the backward pass that just produced ``name`` (its ``passes``-th of the step)
        is the step's last."""
        if self.num_microbatches is None:
            return not self._no_sync
        if passes > self.num_microbatches:
            self._errors.append(
                f"{name}: produced by {passes} backward passes in one step, more than "
                f"num_microbatches={self.num_microbatches}"
            )
        return passes == self.num_microbatches

    # ---- hooks -------------------------------------------------------------------------------

    def _on_accumulate(self, param: torch.Tensor) -> None:
        """autograd accumulated into the non-delayed parameter ``param``."""
        st = self._by_id.get(id(param))
        if st is None or st.delayed:
            return
        self._begin_step_if_needed()
        task = _autograd.current_backward_pass()
        if task != st.last_task:
            st.last_task = task
            st.passes += 1
        final = self._final_pass(st.name, st.passes)
        if st.ready:
            self._errors.append(
                f"{st.name}: a backward pass produced it again after its reduction had started "
                "(mark the non-final micro-batches with no_sync() or set num_microbatches)"
            )
            return
        if final:
            self._mark_ready(st)

    def _on_output_grad(self, owner: _Owner) -> None:
        """A backward pass reached the output of ``owner``'s module; the module's backward for
        it has not run yet."""
        task = _autograd.current_backward_pass()
        if task in owner.running:
            return  # a second use of the module in the same pass (tied)
        owner.running[task] = [owner.sm.module.pending_wgrad_count, 0]
        _autograd.at_end_of_backward_pass(
            functools.partial(_call_weakly, weakref.ref(self), "_end_of_pass", owner, task)
        )

    def _end_of_pass(self, owner: _Owner, task: int) -> None:
        """The backward pass ``task`` that reached ``owner``'s module has ended: count what it
        queued there."""
        before, ran_inside = owner.running.pop(task)
        queued = owner.sm.module.pending_wgrad_count - before + ran_inside
        if queued <= 0:
            return  # input-only backward: nothing queued, nothing produced (SPEC §3)
        self._begin_step_if_needed()
        owner.passes += 1
        final = self._final_pass(owner.label, owner.passes)
        again = [st.name for st in owner.params if st.ready]
        if again:
            self._errors.append(
                f"{', '.join(again)}: a backward pass produced it again after its reduction had "
                "started (it queued entries on its module; mark the non-final micro-batches "
                "with no_sync() or set num_microbatches)"
            )
            return
        if queued > ran_inside:
            owner.queue.append(_Pass(queued - ran_inside, final))
        elif final:
            self._owner_final(owner)
        else:
            self._between_passes(owner)

    def _on_entry_done(self, owner: _Owner) -> None:
        """A ``backward_dw()`` of ``owner``'s module wrote its oldest entry's gradients (SPEC
        §4's module hook)."""
        self._begin_step_if_needed()
        again = [st.name for st in owner.params if st.ready]
        if again:
            self._errors.append(
                f"{', '.join(again)}: backward_dw() wrote it again after its reduction had started"
            )
            return
        if owner.queue:
            head = owner.queue[0]
            head.entries -= 1
            if head.entries == 0:
                owner.queue.popleft()
                if head.final:
                    self._owner_final(owner)
                else:
                    self._between_passes(owner)
            return
        task = _autograd.current_backward_pass()
        if task in owner.running:
            owner.running[task][1] += 1  # an entry of the pass under way, run inside it
            return
        self._errors.append(
            f"{owner.label}: backward_dw() ran an entry that no backward pass of this step "
            f"was seen to queue (parameters {[st.name for st in owner.params]})"
        )

    def _between_passes(self, owner: _Owner) -> None:
        """Every entry of a non-final backward pass of ``owner``'s module has run: under
        fully_shard, what FSDP2 does to its own gradients after such a pass."""
        if self._fsdp is None:
            return
        for st in owner.params:
            st.accumulated = fsdp.accumulate_between_passes(st.fsdp, st.accumulated)

    def _owner_final(self, owner: _Owner) -> None:
        if owner.queue:
            self._errors.append(
                f"{owner.label}: entries of a later backward pass were queued before the step's "
                "last one had run"
            )
        for st in owner.params:
            st.owners_final += 1
            if st.owners_final == len(st.owners):
                self._mark_ready(st)

    def _mark_ready(self, st: _Param) -> None:
        st.ready = True
        while self._next_bucket < len(self._buckets) and all(
            q.ready for q in self._buckets[self._next_bucket].params
        ):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: _Bucket) -> None:
        if self._fsdp is not None:
            self._launch_reduce_scatter(bucket)
            return
        grads = []
        for st in bucket.params:
            g = gradient_tensor(st.param, st.main_grad)
            if g is None:
                self._errors.append(f"{st.name}: final but no gradient was written")
                g = torch.zeros_like(st.param)
                st.param.grad = g
            grads.append(g)
        bucket.grads = grads
        bucket.versions = [g._version for g in grads]
        bucket.flat = torch.cat([g.detach().reshape(-1) for g in grads])
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)
        self.launch_log.append(
            {
                "bucket": bucket.index,
                "params": [st.name for st in bucket.params],
                "time": time.perf_counter(),
                "step": self._step,
            }
        )

    # ---- fully_shard (FSDP2) ---------------------------------------------------------------

    def _attach_to_fsdp(self) -> None:
        """Route the delayed gradients past FSDP2 (see :mod:`.fsdp`): mark their sharded
        parameters for the modules' guard, keep them out of FSDP2's post-backward, and let
        ``backward_dw()`` see the unsharded parameters it writes."""
        delayed_by_group: dict[int, list] = {id(g): [] for g in self._fsdp.groups}
        self._fsdp_own_by_group: dict[int, list] = {id(g): [] for g in self._fsdp.groups}
        for _, fp in self._fsdp_own:
            self._fsdp_own_by_group[id(self._fsdp.group_of[id(fp.sharded_param)])].append(fp)
        for st in self._params:
            fsdp.mark_reduced_from_module_hooks(st.fsdp)
            delayed_by_group[id(self._fsdp.group_of[id(st.param)])].append(st.fsdp)
        for group in self._fsdp.groups:
            fsdp.wrap_post_backward(
                group,
                functools.partial(
                    _call_weakly_around,
                    weakref.ref(self),
                    group,
                    delayed_by_group[id(group)],
                ),
            )
        for owner in self._owners:
            fsdp.unshard_during_backward_dw(
                owner.sm.module, [(st.local, st.fsdp) for st in owner.params]
            )

    def _around_post_backward(self, group, delayed: list, run) -> None:
        """FSDP2's post-backward of ``group``: its sync flag checked against this pass, the
        delayed gradients hidden from it."""
        task = _autograd.current_backward_pass()
        if task >= 0:
            self._check_fsdp_sync(group, task)
        hidden = [(fp, fsdp.take_unsharded_grad(fp)) for fp in delayed]
        try:
            run()
        finally:
            for fp, g in hidden:
                if g is not None:
                    fp._unsharded_param.grad = g

    def _check_fsdp_sync(self, group, task: int) -> None:
        """FSDP2 must reduce a group's own gradients in the step's last backward pass and in no
        other: its ``set_requires_gradient_sync`` agrees with :meth:`no_sync` or
        ``num_microbatches``. A final pass whose reduction FSDP2 was told to defer
        (``set_is_last_backward(False)``, as ``PipelineStage`` does before calling
        ``post_backward`` itself) is accepted; :meth:`finish` checks nothing was left."""
        own = self._fsdp_own_by_group.get(id(group), ())
        if not any(fsdp.unreduced_grad(fp) for fp in own):
            return  # nothing for FSDP2 to reduce (all delayed, or an input-only backward)
        self._begin_step_if_needed()
        label = getattr(group, "_module_fqn", None) or "a fully_shard group"
        seen = self._fsdp_passes.setdefault(id(group), [-1, 0])
        if seen[0] != task:
            seen[0] = task
            seen[1] += 1
        final = self._final_pass(label, seen[1])
        sync = bool(group.reduce_grads)
        deferred = not self._fsdp.is_last_backward(group)
        if final and not sync and not deferred:
            self._errors.append(
                f"{label}: FSDP2's gradient sync is off (set_requires_gradient_sync(False)) in "
                "the backward pass the reducer counts as the step's last, so FSDP2 never reduces "
                "its own gradients"
            )
        elif sync and not final:
            self._errors.append(
                f"{label}: FSDP2 reduce-scattered its gradients in backward pass {seen[1]}, which "
                "the reducer was told is not the step's last (run the non-final micro-batches "
                "inside reducer.no_sync(), which turns FSDP2's gradient sync off for them)"
            )

    def _launch_reduce_scatter(self, bucket: _Bucket) -> None:
        fps, grads = [], []
        for st in bucket.params:
            g = fsdp.take_final_grad(st.fsdp, st.accumulated)
            st.accumulated = None
            if g is None:
                self._errors.append(f"{st.name}: final but no gradient was written")
                continue
            fps.append(st.fsdp)
            grads.append(g)
        group = self._fsdp.group_of[id(bucket.params[0].param)]
        bucket.work = fsdp.ReduceScatter(fps, grads, group) if fps else None
        self.launch_log.append(
            {
                "bucket": bucket.index,
                "params": [st.name for st in bucket.params],
                "time": time.perf_counter(),
                "step": self._step,
                "collective": "reduce_scatter",
            }
        )

    def _check_not_sharded_later(self) -> None:
        # The root and the delayed modules only (cheap, every forward): a plain parameter under
        # a fully_shard applied later keeps its stale hook, and finish() reports it never
        # produced.
        if fsdp.any_fully_sharded([self.module] + [o.sm.module for o in self._owners]):
            raise RuntimeError(
                "fully_shard was applied after GradientReducer was built on this module: the "
                "reducer holds the replaced, unsharded parameters and would reduce nothing. "
                "Build GradientReducer(model) after fully_shard(...)"
            )

    # ---- the end of a step -------------------------------------------------------------------

    @property
    def step_finished(self) -> bool:
        """``True`` between :meth:`finish` and the next gradient of the next step."""
        return self._finished

    def finish(self) -> None:
        """Wait for every reduction of this step and write the averages back; raise
        ``RuntimeError`` naming every gradient that was never produced, produced twice, or
        changed while being reduced. Called when no gradient was produced since the reducer was
        built or last finished, it raises too (a step's backward ran on another model, or
        ``finish()`` was called twice), except once after a pipeline schedule's gradient scaling
        finished the step itself (see :func:`~splitgrad.distributed.dw_builder`)."""
        self.finish_time = time.perf_counter()
        if self._finished:
            if self._finished_by_schedule:
                self._finished_by_schedule = False
                return
            since = "it was built" if self._step == 0 else f"step {self._step} was finished"
            names = [st.name for st in self._params]
            shown = ", ".join(names[:4])
            if len(names) > 4:
                shown += f", ... ({len(names)} in all)"
            raise RuntimeError(
                f"GradientReducer.finish() without a step: none of its parameters ({shown}) got "
                f"a gradient since {since}; run the step's backward passes (and backward_dw()) "
                "on this reducer's module first"
            )
        errors = list(self._errors)
        missing = [st.name for st in self._params if not st.ready]
        try:
            with torch.no_grad():
                for bucket in self._buckets[: self._next_bucket]:
                    self._complete(bucket, errors)
        finally:
            self._reset()
        left = [name for name, fp in self._fsdp_own if fsdp.unreduced_grad(fp)]
        if left:
            errors.append(
                f"FSDP2 left the gradients of {left} unreduced on the unsharded parameters: "
                "its gradient sync was off in the step's last backward pass (use the reducer's "
                "no_sync() for the non-final micro-batches, which sets FSDP2's "
                "set_requires_gradient_sync for them, or set it True for the last one)"
            )
        if missing:
            errors.append(
                f"never produced in this step, so never reduced: {missing} (a parameter no "
                "backward reached, a delayed module whose queue was not drained with "
                "backward_dw(), or a step with fewer backward passes than num_microbatches)"
            )
        if errors:
            raise RuntimeError("GradientReducer.finish(): " + "; ".join(errors))

    def finish_for_schedule(self) -> None:
        """:meth:`finish`, called by a pipeline stage's gradient scaling; one more ``finish()``
        by the training loop in the same step is then a no-op."""
        self.finish()
        self._finished_by_schedule = True

    def _complete(self, bucket: _Bucket, errors: list[str]) -> None:
        names = [st.name for st in bucket.params]
        if self._fsdp is not None:
            if bucket.work is None:
                return
            try:
                bucket.work.complete(self.timeout)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"GradientReducer: the reduce-scatter of bucket {bucket.index} {names} did "
                    f"not complete within {self.timeout} (a rank failed or issued other "
                    "collectives)"
                ) from exc
            return
        try:
            bucket.work.wait(self.timeout)
        except RuntimeError as exc:
            raise RuntimeError(
                f"GradientReducer: the all-reduce of bucket {bucket.index} {names} did not "
                f"complete within {self.timeout} (a rank failed or issued other collectives)"
            ) from exc
        bucket.flat.div_(self.world_size)
        offset = 0
        for st, g, version in zip(bucket.params, bucket.grads, bucket.versions):
            now = gradient_tensor(st.param, st.main_grad)
            if now is not g or g._version != version:
                errors.append(f"{st.name}: changed while its reduction was in flight")
            n = g.numel()
            g.copy_(bucket.flat[offset : offset + n].view_as(g))
            offset += n

    def _reset(self) -> None:
        self._finished = True
        self._next_bucket = 0
        self._errors = []
        for st in self._params:
            st.passes, st.last_task, st.ready, st.owners_final = 0, -1, False, 0
            st.accumulated = None
        for owner in self._owners:
            owner.reset()
        self._fsdp_passes.clear()
        for bucket in self._buckets:
            bucket.work, bucket.flat, bucket.grads, bucket.versions = None, None, [], []


def _call_weakly(reducer: weakref.ref, method: str, *args) -> None:
    target = reducer()
    if target is not None:
        getattr(target, method)(*args)


def _call_weakly_hook(reducer: weakref.ref, method: str, module, args) -> None:
    _call_weakly(reducer, method)


def _call_weakly_around(reducer: weakref.ref, group, delayed: list, run) -> None:
    target = reducer()
    if target is None:
        run()
    else:
        target._around_post_backward(group, delayed, run)


class _ModuleHook:
    """The hooks the reducer puts on one delayed module (holding the reducer weakly): the module
    hook of SPEC §4, and a forward hook that hooks the output's gradient."""

    def __init__(self, reducer: weakref.ref, owner: _Owner) -> None:
        self._reducer = reducer
        self._owner = owner

    def __call__(self) -> None:
        _call_weakly(self._reducer, "_on_entry_done", self._owner)

    def after_forward(self, module: torch.nn.Module, args, output) -> None:
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(self._output_grad)

    def _output_grad(self, grad: torch.Tensor) -> None:
        _call_weakly(self._reducer, "_on_output_grad", self._owner)


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors(item)]
    return []
