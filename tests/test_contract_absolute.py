"""The shared contract code checked absolutely, in both packages (STYLE.md: construction and
``reset_parameters`` are written once, in the reference, so a bug there is in both packages and
no differential check sees it).

Against TransformerEngine's documented initial values (GEMM weights ``normal_(mean=0.0,
std=0.023)``, drawn here by torch's own ``torch.nn.init.normal_`` in registration order under
the same seed, as the contract says; biases zero; gamma one, zero when zero-centred; beta zero),
and against torch.nn's own norms: a zero-centred module, built or reset, normalizes as
``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` as built. P18's ``module.initial_values`` and
``module.zero_centered_gamma`` check the same for any backend (``splitgrad verify``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from splitgrad.properties import budgets as B
from splitgrad.properties.checks.protocol import TE_WEIGHT_STD

_ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")


def _builders(lib) -> Iterator[tuple[str, Callable[..., torch.nn.Module]]]:
    """``(label, build(**options))`` for every module kind and the options that change which
    parameters it has and their shapes."""
    for bias in (True, False):
        yield f"Linear bias={bias}", lambda bias=bias, **kw: lib.Linear(6, 5, bias=bias, **kw)
        yield (
            f"GroupedLinear bias={bias}",
            lambda bias=bias, **kw: lib.GroupedLinear(3, 6, 5, bias=bias, **kw),
        )
        for norm in ("LayerNorm", "RMSNorm"):
            for zc in (False, True):
                opts = {"bias": bias, "normalization": norm, "zero_centered_gamma": zc}
                yield (
                    f"LayerNormLinear {opts}",
                    lambda opts=opts, **kw: lib.LayerNormLinear(6, 5, **opts, **kw),
                )
                for act in _ACTIVATIONS:
                    mlp = {**opts, "activation": act}
                    yield (
                        f"LayerNormMLP {mlp}",
                        lambda mlp=mlp, **kw: lib.LayerNormMLP(6, 4, **mlp, **kw),
                    )


def _initialized(build: Callable[..., torch.nn.Module], delay: bool) -> Iterator:
    """``(how, module)``: built under seed 7; given other values then reset under seed 7;
    built on meta, ``to_empty()``, reset under seed 7."""
    torch.manual_seed(7)
    yield "built", build(delay_wgrad_compute=delay)
    used = build(delay_wgrad_compute=delay)
    with torch.no_grad():
        for p in used.parameters():
            p.uniform_(-3.0, 3.0)
    torch.manual_seed(7)
    used.reset_parameters()
    yield "given other values, then reset", used
    lazy = build(delay_wgrad_compute=delay, device="meta")
    lazy.to_empty(device="cpu")
    torch.manual_seed(7)
    lazy.reset_parameters()
    yield "built on meta, to_empty(), reset", lazy


def _expected_initial(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's initial value by TransformerEngine's documentation, GEMM weights drawn
    by ``torch.nn.init.normal_`` in registration order under seed 7."""
    torch.manual_seed(7)
    want = {}
    for name, p in module.named_parameters():
        if name == "layer_norm_weight":
            want[name] = torch.full_like(p, 0.0 if module.zero_centered_gamma else 1.0)
        elif "weight" in name:
            want[name] = torch.nn.init.normal_(torch.empty_like(p), std=TE_WEIGHT_STD)
        else:  # GEMM biases, layer_norm_bias
            want[name] = torch.zeros_like(p)
    return want


@pytest.mark.parametrize("delay", [False, True])
def test_every_parameter_starts_as_transformer_engine_documents(lib, delay):
    for label, build in _builders(lib):
        for how, module in _initialized(build, delay):
            want = _expected_initial(module)
            got = dict(module.named_parameters())
            assert sorted(got) == sorted(want), label
            for name, p in got.items():
                B.check_bitwise(f"{label} {how}: {name}", p.detach(), want[name])


def test_a_reset_changes_no_option_and_keeps_the_parameter_objects(lib):
    plain = (bool, int, float, str, torch.dtype, type(None))
    for label, build in _builders(lib):
        module = build(delay_wgrad_compute=True)
        options = {k: v for k, v in vars(module).items() if isinstance(v, plain)}
        params = {n: (p, dict(vars(p))) for n, p in module.named_parameters()}
        module.reset_parameters()
        assert {k: v for k, v in vars(module).items() if isinstance(v, plain)} == options, label
        for name, p in module.named_parameters():
            assert p is params[name][0], f"{label}: {name} is a new Parameter after the reset"
            assert dict(vars(p)) == params[name][1], f"{label}: {name}'s attributes changed"


def _rows(seed: int, features: int) -> torch.Tensor:
    return torch.randn(9, features, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def _torch_norm(normalization: str, features: int) -> torch.nn.Module:
    """torch.nn's own norm, as built (weight one, bias zero)."""
    if normalization == "LayerNorm":
        return torch.nn.LayerNorm(features)
    return torch.nn.RMSNorm(features, eps=1e-5)


@pytest.mark.parametrize("kind", ["LayerNormLinear", "LayerNormMLP"])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_a_zero_centred_module_normalizes_as_torch_nn(lib, kind, normalization):
    """Zero-centred, built or reset: with identity GEMMs (and ReLU, exact, between LayerNormMLP's
    two) the module returns its norm's output, which must be torch.nn's norm as built (ReLU'd),
    within the output budget against float64 torch.nn, torch.nn's own float32 error the
    yardstick. Neither package runs torch.nn's kernel here (impl's float32 LayerNorm differs
    from it by an ulp or two with gamma stored either way), so no bitwise claim; P18's
    ``module.zero_centered_gamma`` compares bitwise within a package."""
    k = 8
    opts = {"normalization": normalization, "zero_centered_gamma": True, "bias": False}
    if kind == "LayerNormLinear":

        def build(**kw):
            return lib.LayerNormLinear(k, k, **opts, **kw)

        gemms = ("weight",)
        after = torch.nn.Identity()
    else:

        def build(**kw):
            return lib.LayerNormMLP(k, k, activation="relu", **opts, **kw)

        gemms = ("fc1_weight", "fc2_weight")
        after = torch.nn.ReLU()
    x = _rows(0, k)
    twin = after(_torch_norm(normalization, k)(x)).detach()
    truth = after(_torch_norm(normalization, k).double()(x.double())).detach()
    for how, module in _initialized(build, delay=False):
        with torch.no_grad():
            for name in gemms:
                getattr(module, name).copy_(torch.eye(k))
        got = module(x).detach()
        name = f"{lib.__name__} {kind} {normalization} zero-centred, {how}: output"
        B.check_error_budget(name, got, truth, twin, B.OUTPUT)


# ---- the checks above catch bugs planted in the shared code -------------------------------------


def _after_reset(monkeypatch, change: Callable[[torch.nn.Module], None]) -> None:
    """Plant ``change`` at the end of the shared ``reset_parameters`` (both packages use it)."""
    from splitgrad.reference.contract import ModuleContract

    original = ModuleContract.reset_parameters

    def reset_parameters(self) -> None:
        original(self)
        with torch.no_grad():
            change(self)

    monkeypatch.setattr(ModuleContract, "reset_parameters", reset_parameters)


def test_a_zero_centred_gamma_reset_to_one_is_caught(lib, monkeypatch):
    def gamma_one(m):
        if hasattr(m, "normalization"):
            m.layer_norm_weight.fill_(1.0)

    _after_reset(monkeypatch, gamma_one)
    with pytest.raises(B.BudgetViolation, match="RMSNorm zero-centred, built: output"):
        test_a_zero_centred_module_normalizes_as_torch_nn(lib, "LayerNormMLP", "RMSNorm")
    with pytest.raises(B.BudgetViolation, match="built: layer_norm_weight: not bitwise"):
        test_every_parameter_starts_as_transformer_engine_documents(lib, False)


def test_a_drawn_bias_and_another_std_are_caught(lib, monkeypatch):
    def drawn_bias(m):
        for name in m.gemm_bias_names():
            torch.nn.init.normal_(getattr(m, name), std=TE_WEIGHT_STD)

    _after_reset(monkeypatch, drawn_bias)
    with pytest.raises(B.BudgetViolation, match=r"Linear bias=True built: bias: not bitwise"):
        test_every_parameter_starts_as_transformer_engine_documents(lib, True)
    monkeypatch.undo()

    def torch_default_std(m):
        torch.manual_seed(7)
        for name in m.gemm_weight_names():
            torch.nn.init.normal_(getattr(m, name), std=0.02)

    _after_reset(monkeypatch, torch_default_std)
    with pytest.raises(B.BudgetViolation, match=r"Linear bias=True built: weight: not bitwise"):
        test_every_parameter_starts_as_transformer_engine_documents(lib, False)
