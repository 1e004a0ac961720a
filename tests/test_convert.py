"""``convert_linears`` (SPEC §2), in both packages: every ``torch.nn.Linear`` swapped in place
for the package's ``Linear``, the very same ``Parameter`` objects kept (optimizer, tied weights,
state dict unchanged), the filter, every refusal (nothing changed when it raises), the warning
on nothing to convert, and training after conversion: delayed + ``backward_dw()`` gives
gradients and optimizer steps bitwise equal to the unconverted model in float32.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _Block(torch.nn.Module):
    """A pre-norm transformer block written with torch.nn only: RMSNorm, causal attention on
    q/k/v/o projections, a SiLU-gated MLP."""

    def __init__(self, dim: int, heads: int, *, bias: bool) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = torch.nn.RMSNorm(dim)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=bias) for _ in range(4))
        self.mlp_norm = torch.nn.RMSNorm(dim)
        self.gate = torch.nn.Linear(dim, 2 * dim, bias=bias)
        self.up = torch.nn.Linear(dim, 2 * dim, bias=bias)
        self.down = torch.nn.Linear(2 * dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (
            p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class _TinyLM(torch.nn.Module):
    """Embedding, two blocks, a final norm and an lm_head tied to the embedding."""

    def __init__(self, vocab: int = 19, dim: int = 16, heads: int = 2, *, bias: bool) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(_Block(dim, heads, bias=bias) for _ in range(2))
        self.norm = torch.nn.RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _mlp(bias: bool = True) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(8, 12, bias=bias),
        torch.nn.GELU(),
        torch.nn.Linear(12, 6, bias=bias),
    )


def _model(kind: str, bias: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return _mlp(bias) if kind == "mlp" else _TinyLM(bias=bias)


def _loss(kind: str, model: torch.nn.Module, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        x = torch.randn(2, 5, 8, generator=gen)
        return (model(x) ** 2).mean()
    return model(torch.randint(0, 19, (2, 7), generator=gen))


def _drain(model: torch.nn.Module) -> int:
    """Run every queued weight-gradient entry; returns how many ran."""
    ran = 0
    for m in model.modules():
        while getattr(m, "pending_wgrad_count", 0):
            m.backward_dw()
            ran += 1
    return ran


def _linear_fqns(model: torch.nn.Module, cls: type) -> list[str]:
    return [n for n, m in model.named_modules() if type(m) is cls]


# ---- what is kept ------------------------------------------------------------------------


def test_swaps_every_linear_in_place_and_keeps_the_parameters(lib):
    model = _TinyLM(bias=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fqns = _linear_fqns(model, torch.nn.Linear)
    assert len(fqns) == 15
    out = lib.convert_linears(model, delay_wgrad_compute=True)
    assert out is model
    assert _linear_fqns(model, torch.nn.Linear) == []
    assert _linear_fqns(model, lib.Linear) == fqns
    after = dict(model.named_parameters(remove_duplicate=False))
    assert after.keys() == params.keys()
    for name, p in params.items():
        assert after[name] is p, name
    new_state = model.state_dict()
    assert list(new_state) == list(state)
    for k, v in state.items():
        torch.testing.assert_close(new_state[k], v, rtol=0, atol=0, msg=k)
    for fqn in fqns:
        layer = model.get_submodule(fqn)
        assert layer.delay_wgrad_compute and layer.params_dtype == torch.float32
        assert layer.weight.skip_backward_post_hook is True


def test_tied_weights_stay_tied(lib):
    model = _TinyLM(bias=False)
    lib.convert_linears(model, delay_wgrad_compute=True)
    assert model.lm_head.weight is model.embed.weight
    assert isinstance(model.lm_head, lib.Linear)


def test_a_layer_in_two_places_becomes_one_module(lib):
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    seen = []
    lib.convert_linears(model, module_filter_fn=lambda m, fqn: seen.append(fqn) or True)
    assert seen == ["0"]
    assert model[0] is model[2] and isinstance(model[0], lib.Linear)
    assert model[0].weight is shared.weight


def test_bias_false_dtype_and_training_mode_come_from_the_layer(lib):
    model = torch.nn.Sequential(torch.nn.Linear(4, 3, bias=False, dtype=torch.float64)).eval()
    lib.convert_linears(model)
    layer = model[0]
    assert layer.bias is None and layer.params_dtype == torch.float64
    assert not layer.training and not layer.delay_wgrad_compute
    assert layer(torch.randn(2, 4, dtype=torch.float64)).dtype == torch.float64


def test_subclass_without_its_own_forward_is_converted(lib):
    class Tagged(torch.nn.Linear):
        def extra_repr(self) -> str:
            return "tagged"

    model = torch.nn.Sequential(Tagged(4, 3))
    lib.convert_linears(model)
    assert type(model[0]) is lib.Linear


def test_package_linears_are_left_alone_and_a_second_conversion_warns(lib):
    # torch.nn.Linear subclasses (for torch's DTensor TP styles), yet never converted again
    assert issubclass(lib.Linear, torch.nn.Linear)
    model = _mlp()
    lib.convert_linears(model, delay_wgrad_compute=True)
    layers = list(model)
    with pytest.warns(UserWarning, match="Sequential: it has no torch.nn.Linear"):
        assert lib.convert_linears(model) is model
    assert list(model) == layers and model[0].delay_wgrad_compute


def test_multihead_attention_out_proj_is_left_alone(lib):
    model = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True)
    lib.convert_linears(model)
    assert type(model.self_attn.out_proj) is torch.nn.modules.linear.NonDynamicallyQuantizableLinear
    assert isinstance(model.linear1, lib.Linear) and isinstance(model.linear2, lib.Linear)


def test_filter_picks_layers_by_module_and_fqn(lib):
    model = _TinyLM(bias=False)
    calls = []

    def only_mlp(module, fqn):
        calls.append((type(module), fqn))
        return fqn.endswith(("gate", "up", "down"))

    lib.convert_linears(model, module_filter_fn=only_mlp, delay_wgrad_compute=True)
    assert {t for t, _ in calls} == {torch.nn.Linear}
    assert [f for _, f in calls] == _linear_fqns(_TinyLM(bias=False), torch.nn.Linear)
    converted = _linear_fqns(model, lib.Linear)
    assert converted == [f"blocks.{i}.{n}" for i in range(2) for n in ("gate", "up", "down")]
    assert type(model.blocks[0].q) is torch.nn.Linear and type(model.lm_head) is torch.nn.Linear


# ---- what is refused ---------------------------------------------------------------------


class _OwnForward(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def _with_bad(bad: torch.nn.Module) -> torch.nn.Module:
    """A good layer first, so that a refusal must leave it unconverted too."""
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(bad))


def _instance_forward() -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    original = layer.forward
    layer.forward = lambda x: original(x) + 1  # how a wrapping library patches a layer
    return layer


def _parametrized() -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    torch.nn.utils.parametrizations.weight_norm(layer)
    return layer


def _hooked() -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    layer.register_forward_hook(lambda m, i, o: None)
    return layer


def _mixed_bias() -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    layer.bias = torch.nn.Parameter(layer.bias.detach().double())
    return layer


@pytest.mark.parametrize(
    ("make_bad", "error", "match"),
    [
        (lambda: _OwnForward(4, 4), TypeError, r"1\.0 \(.*_OwnForward\) defines its own forward"),
        (_instance_forward, TypeError, r"1\.0 \(torch.nn.modules.linear.Linear\) defines its own"),
        (_parametrized, TypeError, r"1\.0 .*weight is a .*not a plain torch.nn.Parameter"),
        (lambda: torch.nn.LazyLinear(4), TypeError, r"1\.0 .*UninitializedParameter"),
        (_hooked, ValueError, r"1\.0 .*hooks registered \(forward_hooks\)"),
        (_mixed_bias, ValueError, r"1\.0 .*bias \(torch.float64 on cpu\) differs"),
        pytest.param(
            lambda: torch.nn.Linear(0, 4),
            ValueError,
            r"1\.0: in_features must be a positive",
            marks=pytest.mark.filterwarnings("ignore:Initializing zero-element tensors"),
        ),
    ],
    ids=[
        "own-forward",
        "instance-forward",
        "parametrized",
        "lazy",
        "hooks",
        "bias",
        "zero-features",
    ],
)
def test_refusals_name_the_layer_and_change_nothing(lib, make_bad, error, match):
    model = _with_bad(make_bad())
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=match):
        lib.convert_linears(model, delay_wgrad_compute=True)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not hasattr(model[0].weight, "skip_backward_post_hook")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (
            {"delay_wgrad_compute": True, "delay_wgrad": True},
            r"unknown option\(s\) \['delay_wgrad'\]",
        ),
        ({"params_dtype": torch.bfloat16}, r"\['params_dtype'\] cannot be given"),
        ({"bias": False}, r"\['bias'\] cannot be given"),
        ({"device": "cpu"}, r"\['device'\] cannot be given"),
    ],
)
def test_bad_options_are_named(lib, options, match):
    model = _mlp()
    with pytest.raises(TypeError, match=match):
        lib.convert_linears(model, **options)
    assert _linear_fqns(model, torch.nn.Linear) == ["0", "2"]


def test_an_invalid_option_combination_names_the_layer(lib):
    model = _mlp()
    with pytest.raises(ValueError, match="^convert_linears: 0: ub_bulk_wgrad is not supported"):
        lib.convert_linears(model, delay_wgrad_compute=True, ub_bulk_wgrad=True)
    assert _linear_fqns(model, torch.nn.Linear) == ["0", "2"]


def test_a_bare_linear_is_refused(lib):
    with pytest.raises(TypeError, match="model is itself a Linear, which cannot be replaced"):
        lib.convert_linears(torch.nn.Linear(4, 4))


def test_not_a_module_and_not_a_callable_filter(lib):
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got 3"):
        lib.convert_linears(3)
    with pytest.raises(TypeError, match="module_filter_fn must be callable, got 'q'"):
        lib.convert_linears(_mlp(), module_filter_fn="q")


def test_nothing_to_convert_warns_and_returns_the_model(lib):
    model = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Embedding(3, 2))
    with pytest.warns(UserWarning, match="nothing converted in Sequential: it has no torch.nn"):
        assert lib.convert_linears(model) is model
    model = _mlp()
    with pytest.warns(UserWarning, match="module_filter_fn accepted none of its 2"):
        lib.convert_linears(model, module_filter_fn=lambda m, fqn: False)
    assert _linear_fqns(model, torch.nn.Linear) == ["0", "2"]


# ---- training after conversion -----------------------------------------------------------


def _bitwise_cases():
    # The reference rounds the GEMM and then adds the bias (SPEC's naive baseline), where
    # torch.nn.Linear adds it inside one addmm: bitwise equal to torch only without biases.
    for name in ("impl", "reference"):
        for kind in ("mlp", "lm"):
            for bias in (True, False) if name == "impl" else (False,):
                yield pytest.param(
                    name, kind, bias, id=f"{name}-{kind}-{'bias' if bias else 'nobias'}"
                )


@pytest.mark.parametrize(("lib_name", "kind", "bias"), list(_bitwise_cases()))
def test_delayed_training_is_bitwise_equal_to_the_unconverted_model(lib_name, kind, bias):
    """Two optimizer steps (SGD with momentum, built before the conversion) of a converted copy
    with delay + ``backward_dw()``: every gradient and parameter bitwise equal to torch.nn."""
    import importlib

    lib = importlib.import_module(f"splitgrad.{lib_name}")
    torch_model = _model(kind, bias)
    model = copy.deepcopy(torch_model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    lib.convert_linears(model, delay_wgrad_compute=True)
    torch_opt = torch.optim.SGD(torch_model.parameters(), lr=0.1, momentum=0.9)
    kept = [p for g in opt.param_groups for p in g["params"]]
    assert all(a is b for a, b in zip(kept, model.parameters(), strict=True))
    for step in range(2):
        for m, o in ((torch_model, torch_opt), (model, opt)):
            o.zero_grad()
            loss = _loss(kind, m, step)
            loss.backward()
        assert _drain(model) > 0
        assert _drain(torch_model) == 0
        torch.testing.assert_close(loss, _loss(kind, torch_model, step), rtol=0, atol=0)
        for (name, p), q in zip(model.named_parameters(), torch_model.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=f"step {step} {name}")
        opt.step()
        torch_opt.step()
    for (name, p), q in zip(model.named_parameters(), torch_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_reference_with_biases_delayed_equals_not_delayed(kind):
    """Where the reference is not torch's bitwise twin (biases), delayed ≡ non-delayed still."""
    import splitgrad.reference as R

    delayed, plain = _model(kind, True), _model(kind, True)
    R.convert_linears(delayed, delay_wgrad_compute=True)
    R.convert_linears(plain)
    for m in (delayed, plain):
        _loss(kind, m, 0).backward()
    assert _drain(delayed) > 0 and _drain(plain) == 0
    for (name, p), q in zip(delayed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("how", ["load_state_dict", "reset_parameters"])
def test_a_meta_model_converts_then_materializes_as_the_eager_one(lib, how):
    """Trainers build on the meta device, convert, (shard,) then ``to_empty`` and load a
    checkpoint or re-initialise: the result trains as the model converted eagerly, bitwise."""

    def build():
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))

    torch.manual_seed(0)
    eager = lib.convert_linears(build(), delay_wgrad_compute=True)
    with torch.device("meta"):
        lazy = lib.convert_linears(build(), delay_wgrad_compute=True)
    assert all(p.is_meta for p in lazy.parameters())
    assert all(type(m) is lib.Linear for m in (lazy[0], lazy[2]))
    lazy.to_empty(device="cpu")
    if how == "load_state_dict":
        lazy.load_state_dict(eager.state_dict())
    else:  # torch.nn.Linear's reset_parameters draws otherwise: the package's own values
        torch.manual_seed(0)
        for m in (eager[0], eager[2]):
            m.reset_parameters()
        torch.manual_seed(0)
        for m in (lazy[0], lazy[2]):
            m.reset_parameters()
    x = torch.randn(5, 8)
    for model in (eager, lazy):
        model(x).square().sum().backward()
        for m in (model[0], model[2]):
            m.backward_dw()
    for (name, p), q in zip(eager.named_parameters(), lazy.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)


# ---- no throw-away weight, no draw from the global RNG ------------------------------------------

# Operations that draw random numbers.
_RANDOM_OPS = ("normal", "uniform", "bernoulli", "random", "rand", "randn", "randint", "randperm")


class _Allocations(TorchDispatchMode):
    """Records every operation that runs: its name and the bytes of the tensors it returns, by
    device type."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, dict[str, int]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes: dict[str, int] = {}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                sizes[t.device.type] = sizes.get(t.device.type, 0) + t.nbytes
        self.ops.append((func.overloadpacket.__name__, sizes))
        return out

    def random(self) -> list[str]:
        """The random operations that ran off the meta device (one on meta draws nothing)."""
        return [
            f"{name} on {', '.join(sizes)}"
            for name, sizes in self.ops
            if name.rstrip("_") in _RANDOM_OPS and set(sizes) - {"meta"}
        ]

    def bytes_on(self, device_type: str) -> int:
        return sum(sizes.get(device_type, 0) for _, sizes in self.ops)


def _rng_states() -> list[torch.Tensor]:
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states += torch.cuda.get_rng_state_all()
    return states


def _reference_copy_with(tmp_path, mutant_name: str):
    """A copy of the reference with ``ci/mutants.py``'s contract mutant ``mutant_name``,
    imported as a package of its own."""
    from cases import ci_mutants
    from splitgrad.properties.backends.library import load_library_from_path

    mutants = ci_mutants()
    mutant = next(m for m in mutants.CONTRACT_MUTANTS if m.name == mutant_name)
    dest = tmp_path / mutant_name.replace("-", "_")
    assert mutants.apply(mutant, dest) is None
    return load_library_from_path(dest, f"mutated_{dest.name}")


def _conversion_leaves_the_rng_alone(convert) -> None:
    model = _model("lm", True)
    before = _rng_states()
    convert(model, delay_wgrad_compute=True)
    after = _rng_states()
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), (
        "the conversion moved the global RNG"
    )


def _conversion_allocates_nothing(convert, device: str = "cpu") -> None:
    """A layer of 2048 x 2048 (16 MiB in float32): the conversion may create a few small
    tensors of its own (constants), never one of the weight's size, and draws nothing."""
    with torch.device(device):
        model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 8))
    weight_bytes = model[0].weight.nbytes
    with _Allocations() as seen:
        convert(model, delay_wgrad_compute=True)
    assert not seen.random(), f"random numbers drawn: {seen.random()}"
    for where in ("cpu", "cuda"):
        made = seen.bytes_on(where)
        assert made < weight_bytes // 1024, (
            f"{made} bytes of tensors created on {where} (the large weight: {weight_bytes})"
        )


def test_conversion_leaves_the_global_rng_alone(lib):
    _conversion_leaves_the_rng_alone(lib.convert_linears)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_conversion_allocates_and_draws_nothing(lib, device):
    _conversion_allocates_nothing(lib.convert_linears, device)


def test_a_meta_model_stays_on_meta(lib):
    with torch.device("meta"):
        model = _TinyLM(bias=True)
    lib.convert_linears(model, delay_wgrad_compute=True)
    assert type(model.blocks[0].q) is lib.Linear
    off = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if not t.is_meta]
    assert not off, off


def _seeded_run(convert, kind: str, bias: bool) -> list[torch.Tensor]:
    """A seeded run drawing from the global RNG after the model is built (data, dropout): the
    model built, ``convert`` applied (or not), two SGD steps; the loss and every parameter
    after each step."""
    torch.manual_seed(0)
    model = _mlp(bias) if kind == "mlp" else _TinyLM(bias=bias)
    if convert is not None:
        convert(model, delay_wgrad_compute=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(2):
        opt.zero_grad()
        if kind == "mlp":
            x = F.dropout(torch.randn(2, 5, 8), p=0.25)
            loss = (model(x) ** 2).mean()
        else:
            loss = model(torch.randint(0, 19, (2, 7)))
        loss.backward()
        _drain(model)
        opt.step()
        out += [loss.detach().clone(), *(p.detach().clone() for p in model.parameters())]
    return out


@pytest.mark.parametrize("kind", ["mlp", "lm"])
def test_a_seeded_run_is_unchanged_by_the_conversion(lib, kind):
    """The same seeded run with and without conversion, bitwise (no biases: the reference adds
    its bias after rounding the GEMM, torch.nn.Linear inside one addmm)."""
    want = _seeded_run(None, kind, bias=False)
    got = _seeded_run(lib.convert_linears, kind, bias=False)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"tensor {i} of the run")


def test_a_conversion_that_builds_on_the_device_is_caught(tmp_path):
    """ci/mutants.py's convert-builds-on-the-device, planted in a copy of the reference: each
    check above fails on it."""
    lib = _reference_copy_with(tmp_path, "convert-builds-on-the-device")
    with pytest.raises(AssertionError, match="the conversion moved the global RNG"):
        _conversion_leaves_the_rng_alone(lib.convert_linears)
    with pytest.raises(AssertionError, match="random numbers drawn: "):
        _conversion_allocates_nothing(lib.convert_linears)
    with pytest.raises(AssertionError, match="not equal|Mismatched elements"):
        torch.testing.assert_close(
            _seeded_run(lib.convert_linears, "mlp", False)[0],
            _seeded_run(None, "mlp", False)[0],
            rtol=0,
            atol=0,
        )
    # Its meta conversion is harmless: building on meta is what the right code does.
    _conversion_allocates_nothing(lib.convert_linears, "meta")
