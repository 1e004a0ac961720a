"""Meta-tests for tier 2 on the differential properties (properties/oracle/truth.py).

P4-P8 and P12 compare an implementation with itself. Each planted bug below sits in the writes
both modes share (it is applied right after every write of gradients: at the end of a
non-delayed backward, and after each ``backward_dw()``), one per condition a differential
property draws: a frozen subset, tied weights, prefilled gradients, ``is_first_microbatch``,
interleavings with zeroing, empty groups. For each: the property catches it, against the
float64 truth, and without that judgment (``judge_steps`` replaced by a no-op) the same cell
passes: the comparison with itself alone would have missed it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from splitgrad.properties.backends import LibraryBackend
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig
from splitgrad.properties.checks.registry import run_check
from splitgrad.properties.front.campaign import FAIL, run_cell


def _slot(p: torch.nn.Parameter, fused: bool, weight: bool) -> torch.Tensor | None:
    return p.main_grad if fused and weight else p.grad


@dataclasses.dataclass
class _State:
    written: bool = False
    forwards: list = dataclasses.field(default_factory=list)  # (flag, m_splits) since last bwd
    entries: list = dataclasses.field(default_factory=list)  # per queued entry: its forwards


class Planted(LibraryBackend):
    """``splitgrad.reference`` with a bug applied to every write of gradients (both modes)."""

    def __init__(self, bug: str) -> None:
        super().__init__(f"reference-with-{bug}", "splitgrad.reference")
        self.bug = bug

    @staticmethod
    def _st(module) -> _State:
        if not hasattr(module, "_planted"):
            module._planted = _State()
        return module._planted

    def forward(self, module, x, m_splits, is_first_microbatch):
        self._st(module).forwards.append((is_first_microbatch, m_splits, x.shape[0]))
        return super().forward(module, x, m_splits, is_first_microbatch)

    def build(self, config, *, delay, ub_bulk_wgrad=False):
        module = super().build(config, delay=delay, ub_bulk_wgrad=ub_bulk_wgrad)
        # Registered first, so it runs right after the gradients are written and before any
        # hook the harness registers: the bug is in the write itself, as the hooks see it.
        module.register_wgrad_accumulation_and_reduce_hooks(lambda m=module: self._corrupt(m))
        return module

    def _write(self, module, run, forwards) -> None:
        params = dict(module.named_parameters())
        fused = module.fuse_wgrad_accumulation
        weights = set(self.gemm_weight_names(module))
        before = {
            n: None if (s := _slot(p, fused, n in weights)) is None else s.detach().clone()
            for n, p in params.items()
        }
        had_grad = {n: p.grad is not None for n, p in params.items()}
        self._pending = (before, had_grad, forwards)
        self._hook_calls = 0
        run()
        self._pending = None
        self._st(module).written = True

    def _corrupt(self, module) -> None:
        if getattr(self, "_pending", None) is None:
            return
        before, had_grad, forwards = self._pending
        self._hook_calls += 1
        params = dict(module.named_parameters())
        fused = module.fuse_wgrad_accumulation
        weights = set(self.gemm_weight_names(module))
        after = {n: _slot(p, fused, n in weights) for n, p in params.items()}
        st = self._st(module)
        with torch.no_grad():
            if (
                self.bug == "frozen"
                and "fc1_bias" in params
                and not params["fc1_bias"].requires_grad
            ):
                # fc2's weight gradient is dropped when fc1's bias is frozen.
                if before["fc2_weight"] is not None:
                    after["fc2_weight"].copy_(before["fc2_weight"])
                else:
                    params["fc2_weight"].grad = None
            elif self.bug == "tied" and len(forwards) >= 2 and self._tied_last(module, forwards):
                for n in weights:
                    if after[n] is not None:
                        after[n].mul_(0.5)
            elif self.bug == "prefill" and not st.written:
                # The first write into a gradient that already held a value counts twice.
                for n in weights:
                    if had_grad[n] and not fused and after[n] is not None:
                        after[n].add_(after[n] - before[n])
            elif self.bug == "first_microbatch" and fused and any(f for f, _, _ in forwards):
                # is_first_microbatch=True adds instead of overwriting main_grad.
                for n in weights:
                    if before[n] is not None and params[n].requires_grad:
                        after[n].add_(before[n])
            elif self.bug == "zero" and st.written:
                # After zero_grad, a module that wrote before drops its next contribution.
                for n in weights:
                    if not had_grad[n] and not fused and params[n].grad is not None:
                        params[n].grad = None
            elif self.bug == "empty_group":
                # A group (or a Linear) that saw no rows resets a prefilled weight gradient.
                empty = set()
                for _, ms, rows in forwards:
                    if ms is None and rows == 0:
                        empty |= weights
                    for i, m in enumerate(ms or ()):
                        if m == 0:
                            empty.add(f"weight{i}")
                for n in empty & weights:
                    if had_grad[n] and not fused and params[n].grad is not None:
                        params[n].grad.zero_()

    def _tied_last(self, module, forwards) -> bool:
        """The last write of a backward through two uses (its second entry)."""
        return module.delay_wgrad_compute or self._hook_calls == len(forwards)

    def backward(self, module, outputs, grads, inputs=None):
        st = self._st(module)
        forwards, st.forwards = st.forwards, []
        if module.delay_wgrad_compute:
            pending = module.pending_wgrad_count
            super().backward(module, outputs, grads, inputs)
            # One entry per use: each remembers the forwards of its backward.
            st.entries += [forwards] * (module.pending_wgrad_count - pending)
            return
        self._write(
            module, lambda: super(Planted, self).backward(module, outputs, grads, inputs), forwards
        )

    def backward_dw(self, module) -> None:
        if not module.delay_wgrad_compute:
            return super().backward_dw(module)
        st = self._st(module)
        forwards = st.entries.pop(0) if st.entries else []
        last_of_backward = not st.entries or st.entries[0] is not forwards
        if self.bug == "tied" and not last_of_backward:
            return super().backward_dw(module)
        self._write(module, lambda: super(Planted, self).backward_dw(module), forwards)


def _case(kind, dtype="float32", mbs=((3,), (2,)), splits=None, flags=None, **kw) -> Case:
    extra = {k: kw.pop(k) for k in ("variant", "frozen", "schedule") if k in kw}
    n = len(mbs)
    batches = tuple(
        MicroBatch(
            shape,
            None if splits is None else splits[i],
            None if flags is None else flags[i],
        )
        for i, shape in enumerate(mbs)
    )
    return Case(ModuleConfig(kind, 4, 3, dtype=dtype, **kw), batches[:n], 1, **extra)


# (bug, property, a pinned case with the condition, module kind and dtype of a campaign cell)
PLANTED = [
    (
        "frozen",
        "P7",
        _case("LayerNormMLP", frozen=("fc1_bias",), variant="frozen"),
        "LayerNormMLP",
        "float32",
    ),
    (
        "frozen",
        "P4",
        _case("LayerNormMLP", "bfloat16", frozen=("fc1_bias",)),
        "LayerNormMLP",
        "float32",
    ),
    ("tied", "P7", _case("Linear", variant="tied"), "Linear", "float32"),
    ("prefill", "P4", _case("Linear", "bfloat16"), "Linear", "bfloat16"),
    (
        "first_microbatch",
        "P4",
        _case("Linear", flags=(True, None), fuse_wgrad_accumulation=True),
        "Linear",
        "float32",
    ),
    (
        "zero",
        "P6",
        _case(
            "GroupedLinear",
            splits=((3, 0), (1, 1)),
            num_gemms=2,
            schedule=("fb", "dw", "zero", "fb", "dw"),
        ),
        "Linear",
        "float32",
    ),
    (
        "empty_group",
        "P12",
        _case("GroupedLinear", "bfloat16", splits=((3, 0), (0, 2)), num_gemms=2),
        "GroupedLinear",
        "bfloat16",
    ),
]
_IDS = [f"{bug}-{pid}" for bug, pid, *_ in PLANTED]


def _blind(monkeypatch) -> None:
    """Turn the tier-2 judgment of the differential properties off."""
    import splitgrad.properties.checks.grouped as grouped
    import splitgrad.properties.checks.split as split

    for module in (split, grouped):
        monkeypatch.setattr(module, "judge_steps", lambda *args, **kwargs: None)


@pytest.mark.parametrize(("bug", "property_id", "case", "kind", "dtype"), PLANTED, ids=_IDS)
def test_a_bug_both_modes_share_is_caught_by_the_truth(
    bug: str, property_id: str, case: Case, kind: str, dtype: str, monkeypatch
) -> None:
    torch.set_num_threads(1)
    with pytest.raises(AssertionError, match="against the float64 truth|frozen=|tied, "):
        run_check(property_id, Planted(bug), case)
    # The hypothesis campaign finds it too (its cases draw the condition).
    cell = run_cell(Planted(bug), property_id, kind, dtype, examples=150, profile="ci")
    assert cell.status == FAIL, (bug, cell.status, cell.message)
    # Without the tier-2 judgment the property compares the implementation with itself only:
    # the pinned case passes.
    _blind(monkeypatch)
    result = run_check(property_id, Planted(bug), case)
    assert result.bitwise > 0 and result.budget_ratio is None


def test_judging_a_correct_reference_passes_every_condition() -> None:
    """Soundness: the same conditions on the unmodified reference pass (ratio <= 1)."""
    cfg = ModuleConfig("LayerNormMLP", 6, 4, dtype="bfloat16", fuse_wgrad_accumulation=True)
    mbs = (MicroBatch((3,), None, True), MicroBatch((2,), None, False))
    backend = Planted("none")
    for pid, case in [
        ("P4", Case(cfg, mbs, 1, frozen=("fc1_bias",))),
        ("P7", Case(cfg, mbs, 2, variant="tied")),
        ("P8", Case(cfg, mbs, 3)),
        ("P6", Case(cfg, mbs, 4, schedule=("fb", "zero", "fb", "dw", "dw"))),
    ]:
        result = run_check(pid, backend, case)
        assert result.budget_ratio is not None and result.budget_ratio <= 1.0, (pid, result)


def test_row_reversal_reverses_rows_within_each_group_and_undoes_itself():
    import torch
    from splitgrad.properties.cases.data import MicroBatchData
    from splitgrad.properties.cases.strategies import MicroBatch
    from splitgrad.properties.oracle.truth import row_reversal

    x = torch.arange(12.0).reshape(6, 2)
    dy = torch.arange(6.0).reshape(6, 1)
    d = MicroBatchData(x, dy, MicroBatch((6,), (3, 0, 1, 2)))
    (rev,), (perm,) = row_reversal([d])
    assert perm.tolist() == [2, 1, 0, 3, 5, 4]
    assert rev.dy.flatten().tolist() == [2.0, 1.0, 0.0, 3.0, 5.0, 4.0]
    torch.testing.assert_close(rev.x[perm], x, rtol=0, atol=0)
    (rev2,), _ = row_reversal(
        [MicroBatchData(x.reshape(2, 3, 2), dy.reshape(2, 3, 1), MicroBatch((2, 3)))]
    )
    assert rev2.dy.flatten().tolist() == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]


def test_worse_naive_takes_the_run_further_from_the_truth_per_tensor():
    import torch
    from splitgrad.properties.checks.runner import AccuracyRun
    from splitgrad.properties.oracle.truth import worse_naive

    truth = AccuracyRun(
        [torch.zeros(2, 1)], [None], {"g.grad": torch.zeros(3)}, {"w.grad": torch.zeros(2)}
    )
    a = AccuracyRun(
        [torch.tensor([[1e-3], [0.0]])],
        [None],
        {"g.grad": torch.full((3,), 1e-6)},
        {"w.grad": torch.full((2,), 5e-6)},
    )
    b = AccuracyRun(
        [torch.tensor([[0.0], [2e-3]])],
        [None],
        {"g.grad": torch.full((3,), 4e-6)},
        {"w.grad": torch.full((2,), 1e-6)},
    )
    got = worse_naive(a, b, [torch.tensor([1, 0])], truth)
    # b's output, un-permuted, has the larger error (2e-3, now in row 0); gamma from b; w from a
    torch.testing.assert_close(got.outputs[0], torch.tensor([[2e-3], [0.0]]), rtol=0, atol=0)
    assert got.norm["g.grad"] is b.norm["g.grad"] and got.gemm["w.grad"] is a.gemm["w.grad"]
    # a micro-batch with no rows (every group empty) has nothing to pick from
    empty = AccuracyRun([torch.zeros(0, 1)], [None], {}, {})
    assert (
        worse_naive(empty, empty, [torch.zeros(0, dtype=torch.long)], empty).outputs[0].numel() == 0
    )
