"""P6 as a stateful test: random interleavings of forward+backward, backward_dw and zeroing."""

from __future__ import annotations

import pytest
from cases import available_backend
from hypothesis import Phase, settings
from splitgrad.properties.backends import get_backend
from splitgrad.properties.checks.state_machine import make_p6_machine


def _machine_test(
    backend_name: str, kinds=("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
):
    backend = available_backend(backend_name)
    machine = make_p6_machine(backend, kinds=kinds, dtypes=("float32", "bfloat16", "float64"))
    # Short runs: each step already checks every gradient against two twins.
    return machine, settings(settings.default, stateful_step_count=12)


def _run(machine, cfg) -> None:
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(machine, settings=cfg)


def test_p6_state_machine_reference() -> None:
    _run(*_machine_test("reference"))


def test_p6_state_machine_impl() -> None:
    _run(*_machine_test("impl"))


def test_p6_state_machine_torch_split_without_norm() -> None:
    # With a norm in front, torch's split defers the norm gradients too (a declared deviation,
    # reported by test_properties_campaign); the queue semantics are checked on the rest.
    _run(*_machine_test("torch-split", kinds=("Linear", "GroupedLinear")))


def test_p6_machine_catches_lifo() -> None:
    """Meta: the machine fails on a backend whose backward_dw runs the newest entry."""
    from splitgrad.properties.backends import LibraryBackend

    class LifoBackend(LibraryBackend):
        def backward_dw(self, module) -> None:
            q = module._wgrad_queue
            if len(q) > 1:
                q.rotate(1)  # newest to the front
            module.backward_dw()

    backend = LifoBackend("reference-lifo", "splitgrad.reference")
    machine = make_p6_machine(backend, kinds=("Linear",), dtypes=("float32",))
    with pytest.raises(AssertionError, match="not bitwise identical|pending"):
        _run(
            machine,
            settings(
                settings.default,
                stateful_step_count=10,
                max_examples=100,
                derandomize=True,
                database=None,
                print_blob=False,
                report_multiple_bugs=False,
                phases=[Phase.generate],
            ),
        )


def _fp8_machine(backend_name: str, recipes: tuple[str, ...]):
    backend = get_backend(backend_name)
    why = backend.unavailable_reason() or backend.fp8_unavailable_reason()
    if why:
        pytest.skip(why)
    machine = make_p6_machine(backend, dtypes=("float32", "bfloat16"), recipes=recipes)
    # Aligned FP8 shapes cost more per step: fewer runs, as many steps.
    return machine, settings(settings.default, stateful_step_count=12, max_examples=8)


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
def test_p6_state_machine_fp8_delayed_histories_move(backend_name: str) -> None:
    """Every forward runs inside fp8_autocast(DelayedScaling): the delayed module's amax
    histories and scales equal the eager twin's after every step, and they do move (some
    history holds several steps)."""
    from splitgrad.properties.cases.strategies import RECIPE_FAMILIES

    machine, cfg = _fp8_machine(backend_name, RECIPE_FAMILIES["delayed"])
    _run(machine, cfg)
    assert machine.history_steps_seen >= 2


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
def test_p6_state_machine_fp8_block_recipes(backend_name: str) -> None:
    from splitgrad.properties.cases.strategies import RECIPE_FAMILIES

    machine, cfg = _fp8_machine(
        backend_name,
        RECIPE_FAMILIES["mxfp8"] + RECIPE_FAMILIES["block"] + RECIPE_FAMILIES["current"],
    )
    _run(machine, cfg)
