"""P18 (autograd fidelity) has teeth: every sub-check passes on reference and impl and fails,
naming what went wrong, on a planted bug — the mutants of ``ci/mutants.py``, a few edits of a
copy of impl made here, and an outside package that splits its backward the way
TransformerEngine's source does (``tests/outside_fidelity.py``)."""

from __future__ import annotations

from pathlib import Path

import outside_fidelity
import pytest
import torch
from cases import ci_mutants
from splitgrad.properties import budgets as B
from splitgrad.properties.backends import Backend, LibraryBackend, get_backend
from splitgrad.properties.cases.strategies import Case, MicroBatch, ModuleConfig
from splitgrad.properties.checks.fidelity import (
    DIFFERENTIATING_VARIANTS,
    EXPLICIT,
    VARIANTS,
    names_module,
)
from splitgrad.properties.checks.protocol import PROTOCOL_VARIANTS
from splitgrad.properties.checks.registry import case_strategy, explicit_cases
from splitgrad.properties.front.campaign import run_case


def _case(
    variant: str,
    kind: str = "LayerNormLinear",
    *,
    delay: bool = True,
    fused: bool = False,
    asked: tuple[str, ...] = (),
    dtype: str = "float32",
    bias: bool = True,
) -> Case:
    """Two micro-batches of 3 and 2 rows (GroupedLinear: both groups busy), seed 3."""
    splits = (2, 1) if kind == "GroupedLinear" else None
    config = ModuleConfig(
        kind,
        6,
        5,
        num_gemms=2 if kind == "GroupedLinear" else 1,
        bias=bias,
        fuse_wgrad_accumulation=fused,
        dtype=dtype,
    )
    second = (1, 1) if kind == "GroupedLinear" else None
    mbs = (MicroBatch((3,), splits), MicroBatch((2,), second))
    return Case(config, mbs, seed=3, variant=variant, delay=delay, asked=asked)


_TARGETS = {
    "functional_call": ("weight", "bias", "layer_norm_weight"),
    "parametrize": ("weight",),
    "tensor_hook": ("weight", "layer_norm_bias"),
    "tensor_hook_wrong_size": ("weight",),
    "post_accumulate_hook": ("weight", "bias", "layer_norm_weight"),
    "tensor_hook_chain": ("weight", "layer_norm_bias"),
    "tensor_hook_kept": ("weight", "bias"),
    "post_accumulate_reduce": ("weight", "bias"),
}
#: The kinds that act on some parameters (at least one target drawn).
_TARGETED_KINDS = tuple(_TARGETS)


def _variant_case(variant: str, kind: str = "LayerNormLinear", **kw) -> Case:
    asked = _TARGETS.get(variant, ())
    if kind == "Linear":
        asked = tuple(n for n in asked if not n.startswith("layer_norm"))
    return _case(variant, kind, asked=asked, **kw)


def _fails(backend: Backend, case: Case, *fragments: str) -> str:
    with pytest.raises(AssertionError) as info:
        run_case(backend, "P18", case)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def _mutated(tmp_path: Path, mutant) -> Backend:
    dest = tmp_path / mutant.name.replace("-", "_")
    why = ci_mutants().apply(mutant, dest)
    assert why is None, why
    return get_backend(f"path:{dest}")


def _ci_mutant(tmp_path: Path, name: str) -> Backend:
    return _mutated(tmp_path, next(m for m in ci_mutants().P18_MUTANTS if m.name == name))


def _hook_mutant(tmp_path: Path, name: str) -> Backend:
    return _mutated(tmp_path, next(m for m in ci_mutants().HOOK_MUTANTS if m.name == name))


def _planted(tmp_path: Path, bug: str, *edits: tuple[str, str, str]) -> Backend:
    """A copy of impl with ``bug`` planted by ``edits`` (file, text, replacement), imported
    under a name of its own (the test's)."""
    return _mutated(tmp_path, ci_mutants().Mutant(tmp_path.name, bug, edits))


# ---- reference and impl pass every kind ----------------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("delay", [True, False], ids=["delay", "no-delay"])
def test_every_kind_passes_on_the_packages(backend_name: str, variant: str, delay: bool) -> None:
    # Refused (delay under backward(create_graph=True)) or only raising (a wrong-size hook in
    # backward()): nothing numeric is left to compare there.
    judged = not (variant == "backward_create_graph" and delay) and not (
        variant == "tensor_hook_wrong_size" and not delay
    )
    for dtype in ("float32", "bfloat16"):
        case = _variant_case(variant, delay=delay, dtype=dtype)
        result = run_case(get_backend(backend_name), "P18", case)
        assert (result.comparisons > 0) == judged, result


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
def test_refusals_name_the_module_and_are_accepted(backend_name: str) -> None:
    """Delay under backward(create_graph=True), a fused weight's tensor hook, a parametrized
    fused weight: refused with a RuntimeError naming the module or weight, which P18 accepts."""
    backend = get_backend(backend_name)
    module = backend.build(_case("backward_create_graph").config, delay=True)
    x = torch.randn(3, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="LayerNormLinear"):
        module(x).sum().backward(create_graph=True)
    for case in (
        _case("backward_create_graph", delay=True),
        _case("tensor_hook", fused=True, asked=("weight",)),
        _case("parametrize", fused=True, asked=("weight",)),
    ):
        assert run_case(backend, "P18", case).comparisons == 0


# ---- an outside package split the way TransformerEngine's source reads ---------------------


def _te_like() -> Backend:
    return LibraryBackend("te-like", lib=outside_fidelity)


_TE_LIKE_FAILURES = {
    "functional_call": "the module's own substituted parameter changed",
    "parametrize": "original.grad is None after backward()",
    "tensor_hook": "the tensor hook saw None",
    "tensor_hook_wrong_size": "tensor hook calls during backward(): got 2, expected 0",
    "post_accumulate_hook": "the phases its post-accumulate hook fired in",
    "tensor_hook_chain": "weight: its first tensor hook saw None",
    "tensor_hook_kept": "weight: its logger hook saw None",
    "post_accumulate_reduce": "weight: the phases its post-accumulate hook fired in",
}


@pytest.mark.parametrize("variant", list(_TE_LIKE_FAILURES))
def test_te_like_split_fails_each_hook_and_substitution_check(variant: str) -> None:
    backend = _te_like()
    case = _variant_case(variant, "Linear", delay=True)
    _fails(backend, case, f"P18 {variant} (delay", _TE_LIKE_FAILURES[variant])
    # Without delay it returns its gradients through autograd: the same case passes.
    run_case(backend, "P18", _variant_case(variant, "Linear", delay=False))


def test_te_like_queues_for_a_parametrized_weight() -> None:
    """Nothing may be queued for a weight that is not a leaf (SPEC §3)."""
    case = _case("parametrize", "Linear", asked=("weight",), bias=False)
    _fails(_te_like(), case, "pending_wgrad_count after the backwards: got 2, expected 0")


@pytest.mark.parametrize("variant", DIFFERENTIATING_VARIANTS)
def test_errors_from_inside_torch_fail_the_differentiating_kinds(variant: str) -> None:
    """A Function without setup_context (torch.func) or marked once_differentiable (double
    backward) fails inside torch, without naming the module: not SPEC §2's clear refusal."""
    for delay in (True, False):
        why = "does not name the module"
        if variant == "gradient_penalty" and delay:
            # Its first pass asks for x alone, but a TE-like split queues whatever is asked.
            why = "inputs=[x], create_graph=True) queued 1 entries"
        _fails(_te_like(), _case(variant, "Linear", delay=delay), why)


def test_te_like_failures_are_what_the_transformer_engine_backend_declares() -> None:
    """The TransformerEngine adapter's P18 deviations (read from TE's source, non-strict: never
    run here) explain each failure of a package split the way that source reads."""
    from splitgrad.properties.backends import TransformerEngineBackend

    te = TransformerEngineBackend()
    declared = [d for d in te.deviations if d.property_id == "P18"]
    assert declared and all(not d.strict and d.reference for d in declared)
    cases = [_variant_case(v, "Linear", delay=True) for v in _TE_LIKE_FAILURES]
    cases += [_case(v, "Linear", delay=False) for v in DIFFERENTIATING_VARIANTS]
    for case in cases:
        message = _fails(_te_like(), case, f"P18 {case.variant}")
        assert te.deviation_for("P18", case, message) is not None, message


# ---- the mutants of ci/mutants.py ---------------------------------------------------------


@pytest.mark.parametrize("delay", [True, False], ids=["delay", "no-delay"])
def test_backward_reading_the_module_weight_is_caught(tmp_path: Path, delay: bool) -> None:
    backend = _ci_mutant(tmp_path, "backward-reads-module-weight")
    case = _case("functional_call", "Linear", delay=delay, asked=("weight", "bias"))
    _fails(backend, case, "the module's own substituted parameter changed: weight.grad")
    run_case(get_backend("impl"), "P18", case)


@pytest.mark.parametrize("delay", [True, False], ids=["delay", "no-delay"])
def test_skipped_tensor_hooks_are_caught(tmp_path: Path, delay: bool) -> None:
    backend = _ci_mutant(tmp_path, "tensor-hook-skipped")
    case = _case("tensor_hook", "Linear", delay=delay, asked=("weight",))
    _fails(backend, case, "weight: the phases its tensor hook ran in: got []")
    wrong = _case("tensor_hook_wrong_size", "Linear", delay=delay, asked=("bias",))
    _fails(backend, wrong, "raised nothing")
    for c in (case, wrong):
        run_case(get_backend("impl"), "P18", c)


def test_early_post_accumulate_hooks_are_caught(tmp_path: Path) -> None:
    backend = _ci_mutant(tmp_path, "post-hook-early")
    case = _case("post_accumulate_hook", "GroupedLinear", asked=("weight0", "bias1"))
    _fails(
        backend,
        case,
        "weight0: the phases its post-accumulate hook fired in: got ['backward 0', 'backward 1', "
        "'backward_dw 0', 'backward_dw 1'], expected ['backward_dw 0', 'backward_dw 1']",
    )
    run_case(get_backend("impl"), "P18", case)


# ---- planted edits for the remaining sub-checks --------------------------------------------

_APPLY_HOOKS = 'acc.apply_tensor_hooks(leaf, value, f"{kind}.{names[id(leaf)]}")'


def test_a_dropped_hook_replacement_is_caught(tmp_path: Path) -> None:
    """The hook sees the gradient (so the truth check passes) but its return is dropped."""
    edit = ("base.py", _APPLY_HOOKS, f"({_APPLY_HOOKS}, value)[1]")
    backend = _planted(tmp_path, "a tensor hook's replacement is ignored", edit)
    case = _case("tensor_hook", "Linear", asked=("weight",))
    message = "weight.grad vs its prefill plus what its hook returned"
    _fails(backend, case, message, "not bitwise identical")


def test_a_hook_seeing_a_wrong_gradient_is_caught(tmp_path: Path) -> None:
    """The hook is handed twice the gradient; what it returns lands in .grad as it should, so
    only the judgment of what it saw against the float64 truth catches it."""
    twice = _APPLY_HOOKS.replace("value,", "value * (2 if acc.has_hooks(leaf) else 1),")
    backend = _planted(
        tmp_path, "a tensor hook is handed twice the gradient", ("base.py", _APPLY_HOOKS, twice)
    )
    for delay in (True, False):
        case = _case("tensor_hook", "Linear", delay=delay, asked=("weight",))
        _fails(backend, case, "what the hooks saw (accumulated)", "weight.grad")


def test_a_post_accumulate_hook_before_the_write_is_caught(tmp_path: Path) -> None:
    """Fired in the right backward_dw(), but before the gradient is written."""
    loop = "            for leaf, value, later in hooked:\n"
    early = (
        "            if self.delay_wgrad_compute:\n"
        "                for leaf, _, _ in hooked:\n"
        "                    acc.run_post_accumulate_hooks(leaf)\n"
    )
    after_write = "        for leaf in written:\n            acc.run_post_accumulate_hooks(leaf)\n"
    backend = _planted(
        tmp_path,
        "post-accumulate hooks run before the deferred write",
        ("base.py", loop, early + loop),
        ("base.py", after_write, ""),
    )
    case = _case("post_accumulate_hook", "Linear", asked=("weight",))
    message = "weight.grad read by its post-accumulate hook in backward_dw 0 vs after it"
    _fails(backend, case, message, "not bitwise identical")


def test_a_bypassed_parametrization_is_caught(tmp_path: Path) -> None:
    read = "params[n] if n in params else getattr(self, n)"
    original = read.replace("getattr(self, n)", "self.parametrizations[n].original")
    backend = _planted(
        tmp_path, "the forward reads a parametrized weight's original", ("base.py", read, original)
    )
    # The forward computes with half the weight (the input gradient shows it first); the
    # original is a leaf, so under delay its gradient is deferred besides.
    case = _case("parametrize", "LayerNormLinear", delay=False, asked=("weight",))
    _fails(backend, case, "parametrizations.weight.original.grad / 2 and x: inp.grad")
    case = _case("parametrize", "LayerNormLinear", delay=True, asked=("weight",))
    _fails(backend, case, "original.grad is None after backward()")


def test_a_delayed_write_that_is_only_close_is_caught_bitwise(tmp_path: Path) -> None:
    """Deferred weight gradients summed in another row order: within the float64 truth's
    budget, but not the non-delayed run's bits."""
    write = "            gemm.wgrad_accumulate_(param.grad, dy, x)\n"
    flip = (
        "            if self.delay_wgrad_compute:\n                dy, x = dy.flip(0), x.flip(0)\n"
    )
    backend = _planted(
        tmp_path,
        "a deferred weight gradient sums its rows in reverse",
        ("base.py", write, flip + write),
    )
    case = _case("functional_call", "Linear", asked=("weight",))
    mbs = (MicroBatch((64,)), MicroBatch((48,)))
    case = Case(case.config, mbs, 5, variant=case.variant, delay=True, asked=case.asked)
    _fails(backend, case, "delayed vs not: weight.grad", "not bitwise identical")


def test_a_wrong_second_order_value_is_caught(tmp_path: Path) -> None:
    """First-order gradients right, second-order ones 5 % off through the input gradient."""
    vjp = "    dx, *grads = vjp(dy)\n"
    scaled = vjp + "    dx = dx + (dx - dx.detach()) * 0.05\n"
    backend = _planted(
        tmp_path, "the input gradient's own derivative scaled by 1.05", ("twin.py", vjp, scaled)
    )
    for variant in ("grad_of_grad", "backward_create_graph"):
        case = _case(variant, "LayerNormLinear", delay=False)
        message = _fails(backend, case, f"P18 {variant}", "second order")
        assert "[second_order budget]" in message
        run_case(get_backend("impl"), "P18", case)


@pytest.mark.parametrize("variant", ["func.grad", "func.vjp", "func.jacrev", "func.vmap"])
def test_a_wrong_value_under_torch_func_is_caught(tmp_path: Path, variant: str) -> None:
    linear = "        return _linear(x, *params, autocast)"
    edit = ("twin.py", linear + "\n", linear + " * 1.01\n")
    backend = _planted(tmp_path, "impl's Linear under torch.func computes 1.01 * y", edit)
    _fails(backend, _case(variant, "Linear", delay=False), f"P18 {variant}", "budget")


# ---- the pieces -----------------------------------------------------------------------------


def test_names_module_takes_whole_words() -> None:
    assert names_module("splitgrad.impl.LayerNormMLP with delay_wgrad_compute=True", "LayerNormMLP")
    assert names_module("Linear.weight has tensor hooks", "Linear")
    assert not names_module("splitgrad.impl.LayerNormLinear cannot", "Linear")
    assert not names_module("_TELikeLinearFunction must override setup_context", "Linear")
    assert not names_module("expected scalar type BFloat16 but found Float", "Linear")


def test_second_order_budget_says_why() -> None:
    assert B.BUDGETS["second_order"] is B.SECOND_ORDER and len(B.SECOND_ORDER.why) > 40


def test_explicit_cases_enumerate_every_kind() -> None:
    assert {v for v, *_ in EXPLICIT} == set(VARIANTS)
    for kind in ("Linear", "LayerNormMLP", "GroupedLinear"):
        cases = explicit_cases("P18", (kind,), ("float32",))
        # The autograd kinds first, then the module-protocol ones (test_properties_protocol.py).
        assert [c.variant for c in cases[: len(EXPLICIT)]] == [v for v, *_ in EXPLICIT]
        protocol = {c.variant for c in cases[len(EXPLICIT) :]}
        # (Some module-protocol kinds apply to the modules with a norm only.)
        assert protocol <= set(PROTOCOL_VARIANTS)
        assert protocol == set(PROTOCOL_VARIANTS) or kind != "LayerNormMLP"
        cases = cases[: len(EXPLICIT)]
        for variant in VARIANTS[:7]:  # the kinds whose timing depends on delay
            delays = {c.delay for c in cases if c.variant == variant}
            assert delays == {True, False}, (kind, variant)
        for c in cases:
            assert set(c.asked) <= {s for s in _names(c)}
            fused = c.config.fuse_wgrad_accumulation
            if c.variant in ("tensor_hook_chain", "tensor_hook_kept") and fused:
                assert c.asked and not any("weight" in n and "norm" not in n for n in c.asked)
            if c.variant == "tensor_hook_kept":
                assert len(c.micro_batches) >= 2
            if c.variant == "post_accumulate_reduce":
                assert c.delay and not any(n.startswith("layer_norm") for n in c.asked)
            if c.variant == "gradient_penalty":
                assert not fused
            if c.variant in ("parametrize", "tensor_hook_wrong_size"):
                assert len(c.asked) == 1
            if c.variant == "tensor_hook_wrong_size":
                assert not c.config.fuse_wgrad_accumulation


def _names(case: Case) -> set[str]:
    from splitgrad.properties.cases.data import param_specs

    return {s.name for s in param_specs(case.config)}


def test_torch_split_declares_what_it_shows() -> None:
    """torch's generic split under delay: each P18 failure is a declared deviation."""
    backend = get_backend("torch-split")
    for variant in (
        "functional_call",
        "parametrize",
        "post_accumulate_hook",
        "grad_of_grad",
        "backward_create_graph",
        "tensor_hook_wrong_size",
        "tensor_hook_kept",
        "post_accumulate_reduce",
        "gradient_penalty",
    ):
        case = _variant_case(variant, "Linear", delay=True)
        message = _fails(backend, case, f"P18 {variant} (delay")
        assert backend.deviation_for("P18", case, message) is not None, message
        run_case(backend, "P18", _variant_case(variant, "Linear", delay=False))


def test_strategy_draws_every_kind_with_valid_targets() -> None:
    from hypothesis import given, settings

    seen: set[str] = set()

    @settings(max_examples=300, database=None, deadline=None, derandomize=True)
    @given(case_strategy("P18", kinds=("LayerNormMLP", "GroupedLinear")))
    def draw(case: Case) -> None:
        seen.add(case.variant)
        assert case.variant in VARIANTS and set(case.asked) <= _names(case)
        assert 1 <= len(case.micro_batches) <= 2
        if case.variant in ("parametrize", "tensor_hook_wrong_size"):
            assert len(case.asked) == 1
        elif case.variant in _TARGETED_KINDS:
            assert case.asked
        else:
            assert case.asked == ()

    draw()
    assert seen == set(VARIANTS)


# ---- hooks beyond one, kept tensors, module hooks, differentiated backwards (HOOK_MUTANTS) ---


@pytest.mark.parametrize("delay", [True, False], ids=["delay", "no-delay"])
def test_unchained_tensor_hooks_are_caught(tmp_path: Path, delay: bool) -> None:
    """Each hook run on the gradient as computed: the second hook does not see the first's."""
    backend = _hook_mutant(tmp_path, "tensor-hooks-unchained")
    case = _case("tensor_hook_chain", "Linear", delay=delay, asked=("weight",))
    message = "weight: what its second (observer) hook saw in call 0 vs the clip's result"
    _fails(backend, case, message, "not bitwise identical")
    run_case(get_backend("impl"), "P18", case)


@pytest.mark.parametrize("delay", [True, False], ids=["delay", "no-delay"])
def test_a_hook_tensor_installed_as_grad_is_caught(tmp_path: Path, delay: bool) -> None:
    backend = _hook_mutant(tmp_path, "hook-tensor-installed")
    phase = "backward_dw 0" if delay else "backward 0"
    case = _case("tensor_hook_kept", "Linear", delay=delay, asked=("weight",))
    _fails(backend, case, f"weight: the tensor shown to its logger in {phase} is weight.grad's")
    # On a bias, the running statistic's result (what the hooks pass on) is installed.
    case = _case("tensor_hook_kept", "Linear", delay=delay, asked=("bias",))
    _fails(backend, case, f"bias: the tensor returned by its running statistic in {phase} is")
    for asked in (("weight",), ("bias",)):
        run_case(get_backend("impl"), "P18", _case("tensor_hook_kept", "Linear", asked=asked))


def test_a_kept_tensor_changed_later_is_caught(tmp_path: Path) -> None:
    """A .grad that shares the first shown tensor's memory only through a view: the memory
    check and the value check both see the later accumulation."""
    edit = (
        "base.py",
        "acc.accumulate(leaf, value, own=not acc.has_hooks(leaf))",
        "acc.accumulate(leaf, value.view(value.shape), own=True)",
    )
    backend = _planted(tmp_path, "a hook's tensor installed through a view", edit)
    case = _case("tensor_hook_kept", "Linear", delay=False, asked=("weight",))
    _fails(backend, case, "weight: the tensor shown to its logger in backward 0 is weight.grad")


def test_reduce_hooks_before_post_accumulate_hooks_are_caught(tmp_path: Path) -> None:
    backend = _hook_mutant(tmp_path, "reduce-hooks-before-post-accumulate")
    for kind, asked, fused in (
        ("GroupedLinear", ("weight0", "bias1"), False),
        ("LayerNormMLP", ("fc1_weight",), True),
    ):
        case = _case("post_accumulate_reduce", kind, fused=fused, asked=asked)
        _fails(backend, case, "the hooks that ran in backward_dw 0, in order: got ['module hook'")
        run_case(get_backend("impl"), "P18", case)


def test_a_reducer_seeing_the_unclipped_gradient_is_caught(tmp_path: Path) -> None:
    """The hooks in the right order, but the module hooks are shown what the entry wrote
    before the post-accumulate hooks clipped it (a snapshot taken too early)."""
    loop = "        for leaf in written:\n            acc.run_post_accumulate_hooks(leaf)\n"
    early = (
        "        saved = {id(leaf): leaf.grad.clone() for leaf in written}\n"
        + loop
        + "        for leaf in written:\n"
        "            leaf.grad, saved[id(leaf)] = saved[id(leaf)], leaf.grad\n"
        "        self._run_hooks()\n"
        "        for leaf in written:\n"
        "            leaf.grad = saved[id(leaf)]\n"
        "        return\n"
    )
    backend = _planted(tmp_path, "module hooks see the pre-clip gradient", ("base.py", loop, early))
    case = _case("post_accumulate_reduce", "Linear", asked=("weight",))
    _fails(backend, case, "weight.grad seen by the module hook in backward_dw 0 vs what its")


@pytest.mark.parametrize("variant", ["grad_of_grad", "gradient_penalty"])
def test_create_graph_refused_under_delay_is_caught(tmp_path: Path, variant: str) -> None:
    backend = _hook_mutant(tmp_path, "create-graph-refused-under-delay")
    case = _case(variant, "LayerNormLinear", delay=True)
    _fails(backend, case, f"P18 {variant} (delay", "nothing here is deferred")
    run_case(get_backend("impl"), "P18", case)
    # Where the delay does defer a gradient, the refusal is still SPEC's clear error.
    assert run_case(backend, "P18", _case("backward_create_graph", delay=True)).comparisons == 0


def test_create_graph_refused_when_fused_is_caught(tmp_path: Path) -> None:
    backend = _hook_mutant(tmp_path, "create-graph-refused-when-fused")
    case = _case("grad_of_grad", "Linear", delay=False, fused=True)
    _fails(backend, case, "P18 grad_of_grad (no delay, fused)", "nothing here is deferred")
    run_case(get_backend("impl"), "P18", case)
    fused = _case("backward_create_graph", delay=False, fused=True)
    assert run_case(backend, "P18", fused).comparisons == 0


def test_a_refused_plain_double_backward_is_caught(tmp_path: Path) -> None:
    """backward(create_graph=True) refused on a module with neither delay nor fused
    accumulation; torch.func transforms, refused by the same edit, stay accepted."""
    route = "    targets = route_differentiable(module, param_targets(ctx, module), fp8=False)\n"
    refuse = (
        "    if torch.is_grad_enabled():\n"
        '        raise RuntimeError(f"{qualified_name(module)} cannot be differentiated twice")\n'
    )
    backend = _planted(
        tmp_path, "every differentiated backward refused", ("twin.py", route, refuse + route)
    )
    case = _case("backward_create_graph", "Linear", delay=False)
    _fails(backend, case, "P18 backward_create_graph (no delay)", "nothing here is deferred")
    assert run_case(backend, "P18", _case("func.grad", "Linear", delay=False)).comparisons == 0


def test_the_gradient_penalty_defers_only_its_second_pass() -> None:
    """The penalty's first pass (x alone) writes and queues nothing; its second queues one
    entry under delay; both packages' results are judged."""
    for name in ("reference", "impl"):
        for kind in ("Linear", "LayerNormMLP", "GroupedLinear"):
            case = _case("gradient_penalty", kind, delay=True)
            assert run_case(get_backend(name), "P18", case).comparisons > 0
