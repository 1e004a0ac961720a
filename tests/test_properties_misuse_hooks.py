"""P10's raising hooks have teeth: every hook kind (a parameter's tensor and post-accumulate
hooks, SPEC §4's wgrad hooks, ``torch.nn`` module backward, backward-pre and forward hooks)
raising at every position passes on reference and impl, and each planted bug of
``ci/mutants.py``'s ``RAISING_HOOK_MUTANTS`` (a copy of impl with the edit) fails it, naming what
went wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from cases import ci_mutants
from splitgrad.properties.backends import Backend, get_backend
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig
from splitgrad.properties.cases.variants import Misuse
from splitgrad.properties.checks.misuse import (
    HOOKS_AT_SITE,
    RAISING_HOOKS,
    RAISING_MICRO_BATCHES,
    HookPosition,
    raising_hook_params,
)
from splitgrad.properties.checks.registry import explicit_cases
from splitgrad.properties.front.campaign import run_case

KINDS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


def _case(variant: str, kind: str = "Linear", *, delay: bool = True, fused: bool = False) -> Case:
    """Two micro-batches of 3 and 2 rows (GroupedLinear: both groups busy), seed 5."""
    grouped = kind == "GroupedLinear"
    config = ModuleConfig(kind, 6, 5, num_gemms=2 if grouped else 1, fuse_wgrad_accumulation=fused)
    mbs = (
        MicroBatch((3,), (2, 1) if grouped else None),
        MicroBatch((2,), (1, 1) if grouped else None),
    )
    return Case(config, mbs, seed=5, variant=variant, delay=delay)


def _raising(backend: Backend, kind: str) -> list[Case]:
    cases = explicit_cases("P10", kinds=(kind,), dtypes=("float32",))
    return [c for c in cases if c.variant.name in RAISING_HOOKS]


# ---- reference and impl pass every position -------------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_explicit_raising_hook_passes_on_the_packages(backend_name: str, kind: str) -> None:
    backend = get_backend(backend_name)
    cases = _raising(backend, kind)
    assert cases
    for case in cases:
        result = run_case(backend, "P10", case)
        assert result.comparisons > 0, case


@pytest.mark.parametrize("kind", KINDS)
def test_explicit_cases_reach_every_hook_kind_and_position(kind: str) -> None:
    """Every hook kind, delay on and off (SPEC §4's wgrad hooks: on), fused and plain; on a
    parameter its first, middle and last; every hook of those registered and both micro-batches
    (entries) among each kind's cases."""
    cases = _raising(get_backend("impl"), kind)
    seen = {
        (c.variant.name, c.delay, c.config.fuse_wgrad_accumulation)
        for c in cases
        if c.variant.name != "hook_raises" or c.delay
    }
    for name in RAISING_HOOKS:
        for delay in (False, True) if name != "hook_raises" else (True,):
            for fused in (False, True):
                assert (name, delay, fused) in seen, (name, delay, fused)
    for name in RAISING_HOOKS:
        positions = [HookPosition.parse(c.variant.weight) for c in cases if c.variant.name == name]
        assert {p.hook for p in positions} == set(range(HOOKS_AT_SITE)), name
        assert {p.micro_batch for p in positions} == set(range(RAISING_MICRO_BATCHES)), name
        if name in ("tensor_hook_raises", "post_hook_raises"):
            # The first, a middle and the last parameter the hook may sit on.
            where = set()
            for c in cases:
                if c.variant.name == name:
                    params = raising_hook_params(c.config)
                    index = params.index(HookPosition.parse(c.variant.weight).param)
                    where.add(
                        "first" if index == 0 else "last" if index == len(params) - 1 else "middle"
                    )
            middle = any(len(raising_hook_params(c.config)) > 2 for c in cases)
            assert where == {"first", "last"} | ({"middle"} if middle else set()), (name, where)


def test_a_position_names_its_parts_and_refuses_bad_text() -> None:
    at = HookPosition.parse("fc2_weight#1mb0")
    assert (at.param, at.hook, at.micro_batch) == ("fc2_weight", 1, 0)
    assert str(at) == "fc2_weight#1mb0"
    assert str(HookPosition.parse("#2mb1")) == "#2mb1"
    assert str(Misuse("post_hook_raises", str(at))) == "post_hook_raises:fc2_weight#1mb0"
    for bad in ("weight", "weight#xmb0", f"#{HOOKS_AT_SITE}mb0"):
        with pytest.raises(ValueError, match=bad):
            HookPosition.parse(bad)
    case = _case("post_hook_raises:fc2_weight#1mb0", "LayerNormMLP")
    assert Case.from_json(case.to_json()).variant == Misuse("post_hook_raises", "fc2_weight#1mb0")
    impl = get_backend("impl")
    for variant in (
        "post_hook_raises:fc1_weight#0mb0",
        "hook_raises:weight#0mb0",
        "hook_raises:#0mb2",
    ):
        with pytest.raises(ValueError, match=variant.partition(":")[2]):
            run_case(impl, "P10", _case(variant))


# ---- planted bugs: RAISING_HOOK_MUTANTS -----------------------------------------------------

#: Each mutant, a case that shows it and what the failure says.
_CATCHES = {
    "post-hook-before-pop": (
        "post_hook_raises:weight#1mb0",
        True,
        "pending_wgrad_count after the failed backward_dw(): got 2, expected 1",
    ),
    "pop-after-hooks": ("hook_raises:#0mb0", True, "pending_wgrad_count after the failed"),
    "entry-taken-before-wgrad": (
        "tensor_hook_raises:weight#0mb1",
        True,
        "pending_wgrad_count after the failed backward_dw(): got 0, expected 1",
    ),
    "tensor-hooks-as-written": (
        "tensor_hook_raises:bias#1mb0",
        True,
        "written by a failed backward_dw() weight.grad",
    ),
    "tensor-hook-error-swallowed": ("tensor_hook_raises:weight#1mb0", False, "was swallowed"),
    "post-hook-error-wrapped": ("post_hook_raises:bias#2mb1", True, "instead of the hook's own"),
    "wgrad-hooks-in-finally": (
        "post_hook_raises:weight#0mb0",
        True,
        "are not those of the twin up to the raising one",
    ),
    "wgrad-hooks-stuck-after-raise": ("hook_raises:#1mb0", True, "hooks after the failure"),
}


def _mutated(tmp_path: Path, name: str) -> Backend:
    mutants = ci_mutants()
    mutant = next(m for m in mutants.RAISING_HOOK_MUTANTS if m.name == name)
    dest = tmp_path / name.replace("-", "_")
    why = mutants.apply(mutant, dest)
    assert why is None, why
    return get_backend(f"path:{dest}")


def test_every_mutant_has_a_catching_case() -> None:
    assert set(_CATCHES) == {m.name for m in ci_mutants().RAISING_HOOK_MUTANTS}


@pytest.mark.parametrize("name", sorted(_CATCHES))
def test_the_mutant_fails_p10(tmp_path: Path, name: str) -> None:
    variant, delay, fragment = _CATCHES[name]
    case = _case(variant, delay=delay)
    run_case(get_backend("impl"), "P10", case)  # the real package passes it
    with pytest.raises(AssertionError) as info:
        run_case(_mutated(tmp_path, name), "P10", case)
    assert fragment in str(info.value), str(info.value)


def test_writing_as_hooks_run_shows_only_past_the_first_parameter(tmp_path: Path) -> None:
    """Why every position: one pass of hook-then-write goes unseen when the first parameter's
    hook raises (nothing was written yet) and is caught on a later one."""
    backend = _mutated(tmp_path, "tensor-hooks-as-written")
    run_case(backend, "P10", _case("tensor_hook_raises:weight#1mb0"))
    with pytest.raises(AssertionError, match="written by a failed backward_dw"):
        run_case(backend, "P10", _case("tensor_hook_raises:bias#1mb0"))


@pytest.mark.parametrize("kind", KINDS)
def test_the_old_bug_is_caught_for_every_module(tmp_path: Path, kind: str) -> None:
    """The entry left queued after a raising post-accumulate hook (the impl bug fixed in
    5844dc9), on the last parameter and the second entry."""
    param = raising_hook_params(_case("hook_raises", kind).config)[-1]
    case = _case(f"post_hook_raises:{param}#2mb1", kind)
    run_case(get_backend("impl"), "P10", case)
    with pytest.raises(AssertionError, match="pending_wgrad_count after the failed"):
        run_case(_mutated(tmp_path, "post-hook-before-pop"), "P10", case)
