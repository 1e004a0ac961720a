"""P11 (SPEC §4, §7): after ``backward_dw()`` the entry's tensors are freed."""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..backends import Backend
from ..cases.case import Case
from ..cases.data import make_micro_batches
from .results import CheckResult, Tracker
from .runner import ModuleRun

__all__ = ["check_p11"]


def check_p11(backend: Backend, case: Case) -> CheckResult:
    """P11: after the ``backward_dw()`` of micro-batch *i* (or its non-delayed backward), the
    storages of its input, its output gradient and every activation autograd saved for it
    (tensors with the micro-batch's row count, not sharing a parameter's storage) are freed:
    their :class:`StorageWeakRef`\\ s have expired, without a ``gc.collect()``."""
    t = Tracker()
    data = make_micro_batches(case)
    run = ModuleRun(backend, case, delay=case.delay, hooks=0)
    param_ptrs = {p.untyped_storage().data_ptr() for p in run.params.values()}
    refs: list[list[tuple[str, StorageWeakRef]]] = []
    for i, d in enumerate(data):
        tracked: list[tuple[str, StorageWeakRef]] = []
        rows = d.spec.rows

        def pack(tensor: torch.Tensor, rows: int = rows, tracked=tracked) -> torch.Tensor:
            s = tensor.untyped_storage()
            if (
                s.nbytes() > 0
                and s.data_ptr() not in param_ptrs
                and tensor.dim() >= 1
                and tensor.shape[0] == rows
                and tensor.device.type != "meta"
            ):
                tracked.append((f"saved activation {tuple(tensor.shape)}", StorageWeakRef(s)))
            return tensor

        # Fresh copies in the micro-batch's layouts (d keeps its own alive).
        x = d.fresh_input()
        dy = d.fresh_dy()
        if x.numel():
            tracked.append(("input", StorageWeakRef(x.untyped_storage())))
        if dy.numel():
            tracked.append(("output gradient", StorageWeakRef(dy.untyped_storage())))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t_: t_):
            y = run.forward(x, d.spec.m_splits, d.spec.is_first_microbatch)
        backend.backward(run.module, [y], [dy])
        del x, y, dy
        refs.append(tracked)
        if not run.delay:
            _expect_freed(t, f"micro-batch {i} after its non-delayed backward", tracked)
    if run.delay:
        for i in range(len(data)):
            run.dw()
            _expect_freed(t, f"micro-batch {i} after its backward_dw()", refs[i])
    return t.result


def _expect_freed(t: Tracker, what: str, tracked: list[tuple[str, StorageWeakRef]]) -> None:
    alive = [name for name, ref in tracked if not ref.expired()]
    t.result.comparisons += 1
    t.expect(not alive, f"{what}: still alive: {', '.join(alive)}")
