"""P6 as a hypothesis ``RuleBasedStateMachine``: any legal interleaving of forward+backward,
``backward_dw()`` and zeroing, checked by :class:`~.split.InterleavingModel` after every step;
micro-batch shapes are drawn per step, so shrinking finds the shortest schedule. Under FP8 a dozen
steps move the amax histories through several updates (past the harness's 4-step length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ..backends import Backend
from ..cases.data import make_micro_batch
from ..cases.strategies import KINDS, Case, micro_batches, module_configs, seeds
from .split import InterleavingModel

__all__ = ["make_p6_machine"]


def make_p6_machine(
    backend: Backend,
    kinds: Sequence[str] = KINDS,
    dtypes: Sequence[str] = ("float32", "bfloat16"),
    devices: Sequence[str] = ("cpu",),
    recipes: Sequence[str | None] = (None,),
) -> type[RuleBasedStateMachine]:
    """A state-machine class checking P6 on ``backend`` (run it with
    ``run_state_machine_as_test`` or expose ``.TestCase`` to pytest); ``recipes`` are the FP8
    recipe names the module is drawn with (``None``: high precision)."""
    fused = None if backend.supports_fused else False
    configs = module_configs(kinds, dtypes, devices, fused=fused, recipes=recipes)

    class P6Machine(RuleBasedStateMachine):
        model: InterleavingModel | None = None
        #: Most non-zero entries any amax history reached, over every run (tests read it).
        history_steps_seen = 0

        @initialize(config=configs, seed=seeds())
        def build(self, config, seed: int) -> None:
            self.case = Case(config, (), seed)
            self.model = InterleavingModel(backend, self.case)
            self.count = 0

        @rule(data=st.data(), first=st.sampled_from([None, True, False]))
        def forward_backward(self, data: st.DataObject, first: bool | None) -> None:
            (mb,) = data.draw(micro_batches(self.case.config, 1, first_flags=False))
            mb = dataclasses.replace(mb, is_first_microbatch=first)
            self.model.fb(make_micro_batch(self.case.config, mb, self.case.seed, self.count))
            self.count += 1
            cls = type(self)
            for key, value in self.model.eager.fp8_snapshot().items():
                if key.endswith(".amax_history"):
                    cls.history_steps_seen = max(cls.history_steps_seen, int(value.count_nonzero()))

        @precondition(lambda self: self.model is not None and bool(self.model.queue))
        @rule()
        def backward_dw(self) -> None:
            self.model.dw()

        @precondition(lambda self: self.model is not None)
        @rule()
        def zero_grads(self) -> None:
            self.model.zero()

        @invariant()
        def matches_non_delayed_twins(self) -> None:
            if self.model is not None and self.model.steps:
                self.model.check()

        def teardown(self) -> None:
            # Drain: once nothing is pending every gradient must match the twins, and the
            # delayed module's final gradients the float64 truth of the same steps.
            if self.model is not None:
                while self.model.queue:
                    self.model.dw()
                self.model.judge_truth()

    P6Machine.__name__ = f"P6Machine_{backend.name.replace('-', '_')}"
    return P6Machine
