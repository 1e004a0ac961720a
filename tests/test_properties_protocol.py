"""P18's module-protocol kinds have teeth: every case a cell enumerates passes on reference and
impl (and compares something), each check fails on a planted bug naming what went wrong — the
mutants of ``ci/mutants.py`` and the toy packages of ``tests/outside_protocol.py`` — and the
kinds are n/a on torch-split, said once, never run there."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path

import outside_protocol
import pytest
import torch
from cases import ci_mutants
from splitgrad.properties.backends import (
    Backend,
    BackendUnavailable,
    LibraryBackend,
    TransformerEngineBackend,
    get_backend,
)
from splitgrad.properties.cases.strategies import KINDS, Case, MicroBatch, ModuleConfig
from splitgrad.properties.checks.paths import ForcedPathBackend
from splitgrad.properties.checks.protocol import NORM_ONLY_VARIANTS, PROTOCOL_VARIANTS
from splitgrad.properties.checks.registry import MODULE_PROTOCOL, explicit_cases
from splitgrad.properties.front.campaign import PASS, run_case, run_cell
from splitgrad.properties.front.verify import main as verify


def _ci_mutant(tmp_path: Path, name: str) -> Backend:
    mutants = ci_mutants()
    mutant = next(m for m in mutants.PROTOCOL_MUTANTS if m.name == name)
    dest = tmp_path / name.replace("-", "_")
    assert mutants.apply(mutant, dest) is None
    return get_backend(f"path:{dest}")


def _case(
    variant: str,
    kind: str = "Linear",
    *,
    delay: bool = True,
    fused: bool = False,
    dtype: str = "float32",
    recipe: str | None = None,
) -> Case:
    """Two micro-batches of 3 and 2 rows (GroupedLinear: both groups busy), seed 3."""
    grouped = kind == "GroupedLinear"
    config = ModuleConfig(
        kind,
        6,
        5,
        num_gemms=2 if grouped else 1,
        fuse_wgrad_accumulation=fused,
        dtype=dtype,
        recipe=recipe,
    )
    mbs = (
        MicroBatch((3,), (2, 1) if grouped else None),
        MicroBatch((2,), (1, 1) if grouped else None),
    )
    return Case(config, mbs, seed=3, variant=variant, delay=delay)


def _fails(backend: Backend, case: Case, *fragments: str) -> str:
    with pytest.raises(AssertionError) as info:
        run_case(backend, "P18", case)
    message = str(info.value)
    assert message.startswith(f"P18 {case.variant} ("), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _protocol_cases(kind: str, dtype: str, **kw) -> list[Case]:
    cases = explicit_cases("P18", (kind,), (dtype,), **kw)
    return [c for c in cases if c.variant in PROTOCOL_VARIANTS]


# ---- reference and impl pass every enumerated case ----------------------------------------------


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_enumerated_case_passes_on_the_packages(backend_name: str, kind: str) -> None:
    backend = get_backend(backend_name)
    for dtype in ("float32", "bfloat16"):
        for case in _protocol_cases(kind, dtype):
            result = run_case(backend, "P18", case)
            # These check what they see (devices, dtypes, text, views), not tensor values.
            counted = case.variant not in (
                "module.placement",
                "module.repr",
                "module.output_not_view",
            )
            assert (result.comparisons > 0) == counted, (case.variant, result)


@pytest.mark.parametrize("backend_name", ["reference", "impl"])
def test_fp8_cases_pass_on_the_packages(backend_name: str) -> None:
    """Delayed scaling moves state a copy must carry and a reset must clear."""
    backend = get_backend(backend_name)
    for case in _protocol_cases("Linear", "bfloat16", recipes=("delayed-max-hybrid",)):
        assert case.config.recipe == "delayed-max-hybrid"
        run_case(backend, "P18", case)


def test_a_forced_path_backend_builds_every_way() -> None:
    backend = ForcedPathBackend(get_backend("impl"), "grouped")
    for case in _protocol_cases("GroupedLinear", "float32"):
        run_case(backend, "P18", case)


def test_torch_defaults_are_restored() -> None:
    dtype, device = torch.get_default_dtype(), torch.get_default_device()
    run_case(get_backend("impl"), "P18", _case("module.placement", dtype="bfloat16"))
    assert torch.get_default_dtype() == dtype and torch.get_default_device() == device
    assert torch.empty(1).device == device


def test_the_global_rng_is_left_alone() -> None:
    """The checks seed torch's RNG, and the backend's probes build modules: all on forks."""
    state = torch.get_rng_state()
    backend = get_backend("impl")  # a fresh one: its API probe runs in this case
    run_case(backend, "P18", _case("module.reset_parameters", "LayerNormMLP"))
    run_case(backend, "P18", _case("module.reset_parameters", recipe="delayed-max-hybrid"))
    assert torch.equal(torch.get_rng_state(), state)


# ---- the enumeration ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_runs_on_every_boundary_case_with_both_delays(kind: str) -> None:
    cases = _protocol_cases(kind, "float32")
    norm = kind in ("LayerNormLinear", "LayerNormMLP")
    applying = [v for v in PROTOCOL_VARIANTS if norm or v not in NORM_ONLY_VARIANTS]
    assert [c.variant for c in cases[::4]] == applying
    for variant in applying:
        mine = [c for c in cases if c.variant == variant]
        assert len(mine) == 4
        if norm and variant in ("module.initial_values", *NORM_ONLY_VARIANTS):
            assert {c.config.normalization for c in mine} == {"LayerNorm", "RMSNorm"}
            centred = {c.config.zero_centered_gamma for c in mine}
            assert centred == ({True} if variant in NORM_ONLY_VARIANTS else {True, False})
        assert {c.config.fuse_wgrad_accumulation for c in mine} == {True, False}
        assert {c.config.bias for c in mine} == {True, False}
        delays = {c.delay for c in mine}
        assert delays == ({True} if variant == "module.reset_queued" else {True, False}), variant
        rows = {mb.rows for c in mine for mb in c.micro_batches}
        assert 0 in rows and 1 in rows


# ---- the mutants of ci/mutants.py ---------------------------------------------------------------


def test_the_meta_device_ignored_is_caught(tmp_path: Path) -> None:
    backend = _ci_mutant(tmp_path, "meta-device-ignored")
    _fails(
        backend,
        _case("module.placement"),
        'built inside `with torch.device("meta")` without device=',
        "'weight': 'cpu, torch.float32'",
    )
    _fails(backend, _case("module.reset_parameters"), "parameters are not on meta")


@pytest.mark.parametrize("kind", ["LayerNormMLP", "GroupedLinear"])
def test_a_reset_drawing_in_another_order_is_caught(tmp_path: Path, kind: str) -> None:
    backend = _ci_mutant(tmp_path, "reset-weights-reversed")
    name = "fc1_weight" if kind == "LayerNormMLP" else "weight0"
    _fails(
        backend,
        _case("module.reset_parameters", kind),
        "built on meta, to_empty(), reset_parameters() vs built eagerly, same seed: "
        f"{name}: not bitwise identical",
    )


def test_a_view_for_a_two_dimensional_input_is_caught(tmp_path: Path) -> None:
    backend = _ci_mutant(tmp_path, "output-view")
    _fails(
        backend,
        _case("module.output_not_view"),
        "micro-batch 0: the output for a 2-D input of shape (3, 6) (contiguous) with grad is a "
        "view of a tensor of shape (3, 5)",
    )
    run_case(backend, "P18", _case("module.output_not_view", "LayerNormLinear"))


def _centred(case: Case, normalization: str = "LayerNorm") -> Case:
    """``case`` with ``zero_centered_gamma=True`` and ``normalization``."""
    config = dataclasses.replace(case.config, zero_centered_gamma=True, normalization=normalization)
    return dataclasses.replace(case, config=config)


def _contract_mutant(tmp_path: Path, name: str) -> Backend:
    """The copy of the reference with ``ci/mutants.py``'s contract mutant ``name``; verify runs
    such a copy as the backend, whose modules import the copy's contract."""
    mutants = ci_mutants()
    mutant = next(m for m in mutants.CONTRACT_MUTANTS if m.name == name)
    assert mutant.package == "reference"
    dest = tmp_path / name.replace("-", "_")
    assert mutants.apply(mutant, dest) is None
    return get_backend(f"path:{dest}")


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_a_zero_centred_gamma_reset_to_one_is_caught(
    tmp_path: Path, kind: str, normalization: str
) -> None:
    backend = _contract_mutant(tmp_path, "zero-centred-gamma-reset-to-one")
    for delay in (True, False):
        _fails(
            backend,
            _centred(_case("module.zero_centered_gamma", kind, delay=delay), normalization),
            "built with zero_centered_gamma=True vs the module without it given "
            f"torch.nn.{normalization}'s initial parameters",
            "output[micro-batch 0]: not bitwise identical",
        )
        _fails(
            backend,
            _centred(_case("module.initial_values", kind, delay=delay), normalization),
            "built: layer_norm_weight (all 0): not bitwise identical",
        )
    run_case(backend, "P18", _case("module.initial_values", kind))  # gamma stored as is: right


@pytest.mark.parametrize("kind", KINDS)
def test_a_bias_drawn_at_reset_is_caught(tmp_path: Path, kind: str) -> None:
    backend = _contract_mutant(tmp_path, "bias-reset-drawn")
    name = {"LayerNormMLP": "fc1_bias", "GroupedLinear": "bias0"}.get(kind, "bias")
    _fails(backend, _case("module.initial_values", kind), f"built: {name} (all 0): not bitwise")


@pytest.mark.parametrize("kind", KINDS)
def test_a_weight_std_other_than_te_is_caught(tmp_path: Path, kind: str) -> None:
    backend = _contract_mutant(tmp_path, "init-std-not-te")
    _fails(
        backend,
        _case("module.initial_values", kind),
        "(128, 128) built: ",
        "initial values as a sample of N(0, 0.023²) (false-alarm rate 1e-09): root mean square",
    )


def test_skip_hook_on_a_norm_parameter_is_caught(tmp_path: Path) -> None:
    backend = _contract_mutant(tmp_path, "skip-hook-on-every-parameter")
    _fails(
        backend,
        _case("module.initial_values", "LayerNormLinear"),
        "built on meta, to_empty(), reset_parameters(): layer_norm_bias.skip_backward_post_hook "
        "is True",
    )
    run_case(backend, "P18", _case("module.initial_values", "LayerNormLinear", delay=False))


def test_every_contract_mutant_but_the_conversion_is_for_p18(tmp_path: Path) -> None:
    """The conversion mutant is planted by tests/test_convert.py (verify builds no torch.nn
    model to convert); every other one is caught above."""
    names = [m.name for m in ci_mutants().CONTRACT_MUTANTS]
    assert names == [
        "zero-centred-gamma-reset-to-one",
        "bias-reset-drawn",
        "init-std-not-te",
        "skip-hook-on-every-parameter",
        "convert-builds-on-the-device",
    ]


# ---- the toy packages of tests/outside_protocol.py ----------------------------------------------

_COPIES = ("module.pickle", "module.torch_save", "module.deepcopy")
_FP8 = {"dtype": "bfloat16", "recipe": "delayed-max-hybrid"}
_COPY_PENDING = "pending_wgrad_count after each backward"

#: Each toy package's bug (its name in outside_protocol.py): a case that meets it, what the
#: failure message says, and a case the package passes (where there is one: the bug is the cause).
_OUTSIDE_BUGS = [
    # (a) where parameters are created
    (
        "dtype_ignored",
        _case("module.placement", dtype="bfloat16"),
        ("set_default_dtype(torch.bfloat16)", "not on meta in torch.bfloat16"),
        None,
    ),
    (
        "explicit_device_loses",
        _case("module.placement"),
        ("(the explicit ones must win)", "'weight': 'meta, torch.float32'"),
        None,
    ),
    # (b) reset_parameters; (c) with entries queued
    (
        "reset_keeps_bias",
        _case("module.reset_parameters"),
        ("given the case's values, run, then reset_parameters() vs built eagerly: bias",),
        None,
    ),
    (
        "reset_keeps_fp8_state",
        _case("module.reset_parameters", **_FP8),
        ("then reset_parameters() vs built eagerly: fp8_states[",),
        _case("module.reset_parameters"),  # without FP8 nothing to keep
    ),
    (
        "reset_ignores_queue",
        _case("module.reset_queued"),
        ("reset_parameters() with 2 weight-gradient entries queued: no error raised",),
        None,
    ),
    (
        "reset_then_refuses",
        _case("module.reset_queued"),
        ("changed by the refused reset_parameters(): weight (value)",),
        None,
    ),
    # (d) repr
    (
        "repr_hides_delay",
        _case("module.repr"),
        ("does not show delay_wgrad_compute=True",),
        _case("module.repr", delay=False),
    ),
    (
        "repr_claims_fused",
        _case("module.repr"),
        ("shows fuse_wgrad_accumulation=True, but the module has fuse_wgrad_accumulation=False",),
        None,
    ),
    # (f) copies
    *[
        (
            "copy_loses_delay",
            _case(v),
            (f"the copy vs the original: {_COPY_PENDING}: got [0], expected [1]",),
            None,
        )
        for v in _COPIES
    ],
    (
        "deepcopy_shares",
        _case("module.deepcopy"),
        ("weight shares its tensor or storage with the original's",),
        None,
    ),
    *[
        ("copy_loses_fp8_state", _case(v, **_FP8), ("the copy vs the original: fp8_states[",), None)
        for v in _COPIES
    ],
    (
        "to_empty_drops_delay",
        _case("module.to_empty"),
        (f"to_empty() and given its state_dict, vs it: {_COPY_PENDING}",),
        None,
    ),
    # (g) initial values, against TransformerEngine's documented ones
    (
        "reset_like_torch_linear",
        _case("module.initial_values"),
        ("Linear(6, 5) built: bias (all 0): not bitwise identical",),
        None,
    ),
    (
        "reset_replaces_parameters",
        _case("module.initial_values"),
        ("reset_parameters() #1 under the seed it was built with: options and parameter",),
        None,
    ),
    (
        "zero_centered_gamma_ignored",
        _centred(_case("module.initial_values", "LayerNormLinear"), "RMSNorm"),
        ("LayerNormLinear(6, 5) built: layer_norm_weight (all 0): not bitwise identical",),
        _case("module.initial_values", "LayerNormLinear"),
    ),
]


@pytest.mark.parametrize(
    ("package", "case", "fragments", "passing"),
    _OUTSIDE_BUGS,
    ids=[f"{package}-{case.variant}" for package, case, *_ in _OUTSIDE_BUGS],
)
def test_each_bug_of_an_outside_package_is_caught(
    package: str, case: Case, fragments: tuple[str, ...], passing: Case | None
) -> None:
    backend = outside_protocol.backend(package)
    _fails(backend, case, *fragments)
    if passing is not None:
        run_case(backend, "P18", passing)


# ---- the pieces ---------------------------------------------------------------------------------


def test_a_module_without_reset_parameters_is_caught() -> None:
    import outside_fidelity

    lib = types.ModuleType("no_reset")
    lib.Linear = outside_fidelity.Linear
    assert not hasattr(lib.Linear, "reset_parameters")
    _fails(
        LibraryBackend("no-reset", lib=lib),
        _case("module.reset_parameters", delay=False),
        "Linear has no reset_parameters() (SPEC §2)",
    )


def test_without_delay_the_reset_goes_through() -> None:
    result = run_case(get_backend("impl"), "P18", _case("module.reset_queued", delay=False))
    assert result.comparisons > 0


def test_repr_values_may_be_quoted_or_not() -> None:
    from splitgrad.properties.checks.protocol import _shown, _unquoted

    text = "LayerNormMLP(hidden_size=8, ffn_hidden_size=16, bias=True, normalization=RMSNorm)"
    assert _shown(text, "hidden_size") == ["8"]  # not ffn_hidden_size
    assert [_unquoted(v) for v in _shown(text.replace("RMSNorm", "'RMSNorm'"), "normalization")]
    assert _unquoted("'RMSNorm'") == _unquoted('"RMSNorm"') == _unquoted("RMSNorm") == "RMSNorm"


# ---- n/a on torch-split, declared on TransformerEngine ------------------------------------------


def test_torch_split_leaves_them_out_and_says_why(capsys) -> None:
    backend = get_backend("torch-split")
    why = backend.module_protocol_reason()
    assert why and any(why in note for note in backend.notes)
    kept = explicit_cases("P18", ("Linear",), ("float32",), without=frozenset({MODULE_PROTOCOL}))
    assert kept and not any(c.variant in PROTOCOL_VARIANTS for c in kept)
    with pytest.raises(BackendUnavailable, match="n/a on torch-split"):
        run_case(backend, "P18", _case("module.repr"))
    status = verify(
        ["--backend", "torch-split", "--property", "P18", "--case", _case("module.repr").to_json()]
    )
    out = capsys.readouterr().out
    assert status == 0 and out.startswith("P18 n/a on torch-split: the module is the adapter's")


def test_a_cell_leaves_them_out_where_they_do_not_apply() -> None:
    class Adapter(LibraryBackend):
        def module_protocol_reason(self) -> str | None:
            return "the modules are the adapter's own"

    full = run_cell(get_backend("impl"), "P18", "Linear", "float32", examples=1)
    cell = run_cell(Adapter("adapter", "splitgrad.impl"), "P18", "Linear", "float32", examples=1)
    assert cell.status == PASS and full.status == PASS
    assert full.examples - cell.examples == len(_protocol_cases("Linear", "float32")) == 40


def test_transformer_engine_declares_what_its_source_shows(tmp_path: Path) -> None:
    te = TransformerEngineBackend()
    meta = _ci_mutant(tmp_path, "meta-device-ignored")
    view = _ci_mutant(tmp_path, "output-view")
    for backend, variant in (
        (meta, "module.placement"),
        (meta, "module.reset_parameters"),
        (view, "module.output_not_view"),
    ):
        case = _case(variant)
        message = _fails(backend, case)
        dev = te.deviation_for("P18", case, message)
        assert dev is not None and not dev.strict, message
    assert te.deviation_for("P18", _case("module.repr"), "P18 module.repr (delay): ...") is None
