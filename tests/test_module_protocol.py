"""Every module of both packages is a well-behaved ``torch.nn.Module`` to autograd and to what is
built on ``nn.Module`` (SPEC §2's module-protocol bullets, §3 "to the tensor the forward used",
"hooks on a parameter"): the checks PyTorch's ``test/test_modules.py`` runs on
``torch.nn.Linear`` that apply to a CPU module, written here for splitgrad, plus the autograd
tools a training loop uses (``functional_call``, ``parametrize``, tensor and post-accumulate
hooks, double backward, ``torch.func``).

Values are float64 so that ``gradcheck`` (finite differences) is meaningful; comparisons
between two runs of the same package on the same operations are bitwise."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import splitgrad.impl as impl
import splitgrad.reference as reference
import torch
import torch.nn.functional as F
from cases import GROUP_SPLITS, KINDS, build, fill, gemm_param_names, gemm_weight_names
from splitgrad.impl.twin import forward_of
from torch.func import functional_call
from torch.nn.utils import parametrize

LIBS = [pytest.param(reference, id="reference"), pytest.param(impl, id="impl")]
F64 = torch.float64


def _module(lib, kind, *, delay=False, fused=False, seed=0, **extra):
    m = build(lib, kind, dtype=F64, delay=delay, fused=fused, **extra)
    fill(m, seed)
    return m


def _x(m, seed=1, rows=None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = sum(GROUP_SPLITS) if rows is None else rows
    k = m.hidden_size if hasattr(m, "hidden_size") else m.in_features
    return torch.randn(n, k, generator=gen, dtype=F64, requires_grad=True)


def _args(m, x):
    return (x, GROUP_SPLITS) if hasattr(m, "num_gemms") else (x,)


def _drain(m) -> None:
    while m.pending_wgrad_count:
        m.backward_dw()


def _params(m) -> dict[str, torch.Tensor]:
    return dict(m.named_parameters())


def _leaf_copies(m) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_() for n, p in m.named_parameters()}


def _grads(tensors: dict) -> dict[str, torch.Tensor | None]:
    return {n: None if t.grad is None else t.grad.clone() for n, t in tensors.items()}


def _assert_bitwise(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _plain_run(lib, kind, *, seed=0, **extra) -> dict[str, torch.Tensor | None]:
    """Gradients of the module's own parameters after one ordinary backward (no delay)."""
    m = _module(lib, kind, seed=seed, **extra)
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    return _grads(_params(m))


def _dy(y: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(y.shape, generator=gen, dtype=y.dtype)


# ---- gradcheck / gradgradcheck, also through functional_call ---------------------------------

_VARIANTS = [
    ("Linear", {}),
    ("LayerNormLinear", {}),
    ("LayerNormLinear", {"normalization": "RMSNorm", "zero_centered_gamma": True}),
    ("LayerNormMLP", {}),
    ("LayerNormMLP", {"activation": "swiglu", "normalization": "RMSNorm"}),
    ("GroupedLinear", {}),
]
_VARIANT_IDS = ["Linear", "LayerNormLinear", "RMSNorm-zc", "LayerNormMLP", "swiglu", "Grouped"]


def _functional(m):
    names = list(_params(m))

    def f(x, *params):
        return functional_call(m, dict(zip(names, params)), _args(m, x))

    return f, [p.detach().clone().requires_grad_() for p in _params(m).values()]


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("kind", "extra"), _VARIANTS, ids=_VARIANT_IDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_gradcheck_input_and_every_parameter(lib, kind, extra, delay) -> None:
    """Gradients returned through autograd (``torch.autograd.grad`` asks for every parameter:
    returned, never deferred) match finite differences."""
    m = _module(lib, kind, delay=delay, **extra)
    f, params = _functional(m)
    assert torch.autograd.gradcheck(f, (_x(m), *params))
    assert m.pending_wgrad_count == 0


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("kind", "extra"), _VARIANTS, ids=_VARIANT_IDS)
def test_gradgradcheck_input_and_every_parameter(lib, kind, extra) -> None:
    m = _module(lib, kind, **extra)
    f, params = _functional(m)
    assert torch.autograd.gradgradcheck(f, (_x(m), *params))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize(("kind", "extra"), _VARIANTS, ids=_VARIANT_IDS)
def test_gradgradcheck_module_call(lib, kind, extra) -> None:
    """The module called as it is (its own parameters as leaves)."""
    m = _module(lib, kind, **extra)
    assert torch.autograd.gradgradcheck(lambda x: m(*_args(m, x)), (_x(m),))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_backward_create_graph_keeps_the_graph_of_written_gradients(lib, kind) -> None:
    """``loss.backward(create_graph=True)`` leaves differentiable ``.grad`` tensors, as torch.nn
    does: a second backward through them matches the same computation in torch functions."""
    m = _module(lib, kind)
    x = _x(m)
    m(*_args(m, x)).pow(2).sum().backward(create_graph=True)
    params = _params(m)
    assert all(p.grad is not None and p.grad.requires_grad for p in params.values())
    penalty = sum(p.grad.pow(2).sum() for p in params.values())
    second = torch.autograd.grad(penalty, [x, *params.values()])

    twins = {n: p.detach().clone().requires_grad_() for n, p in params.items()}
    xt = x.detach().clone().requires_grad_()
    splits = GROUP_SPLITS if kind == "GroupedLinear" else None
    y = forward_of(m, xt, list(twins.values()), None, splits)
    first = torch.autograd.grad(y.pow(2).sum(), list(twins.values()), create_graph=True)
    want = torch.autograd.grad(sum(g.pow(2).sum() for g in first), [xt, *twins.values()])
    for name, got, exp in zip(["x", *params], second, want):
        torch.testing.assert_close(got, exp, rtol=1e-10, atol=1e-10, msg=name)


# ---- what cannot be differentiated says so -----------------------------------------------------


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["delay", "fused"])
def test_create_graph_with_delay_or_fusion_is_a_clear_error(lib, kind, mode) -> None:
    m = _module(lib, kind, delay=mode == "delay", fused=mode == "fused")
    for name in gemm_weight_names(m):
        getattr(m, name).main_grad = torch.zeros_like(getattr(m, name))
    y = m(*_args(m, _x(m)))
    option = "delay_wgrad_compute" if mode == "delay" else "fuse_wgrad_accumulation"
    with pytest.raises(RuntimeError, match=rf"{kind} with {option}=True cannot"):
        y.sum().backward(create_graph=True)
    assert m.pending_wgrad_count == 0


@pytest.mark.parametrize("lib", LIBS)
def test_create_graph_under_fp8_is_a_clear_error(lib) -> None:
    m = build(lib, "Linear", dtype=torch.float32)
    x = torch.randn(8, m.in_features, requires_grad=True)
    with lib.fp8_autocast(enabled=True, fp8_recipe=lib.DelayedScaling()):
        y = m(x)
    with pytest.raises(RuntimeError, match="Linear under FP8 cannot be differentiated twice"):
        torch.autograd.grad(y.sum(), x, create_graph=True)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_forward_mode_ad_is_a_clear_error(lib, kind) -> None:
    m = _module(lib, kind)
    x = _x(m).detach()
    with pytest.raises(RuntimeError, match=rf"{kind} does not support forward-mode AD"):
        torch.func.jvp(lambda t: m(*_args(m, t)), (x,), (torch.ones_like(x),))


# ---- torch.func ------------------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_func_grad_and_vjp_match_backward(lib, kind, delay) -> None:
    m = _module(lib, kind, delay=delay)
    x = _x(m).detach()
    params = {n: p.detach() for n, p in m.named_parameters()}
    want = _plain_run(lib, kind)

    def loss(p):
        y = functional_call(m, p, _args(m, x))
        return (y * _dy(y)).sum()

    got = torch.func.grad(loss)(params)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    y, vjp = torch.func.vjp(lambda p: functional_call(m, p, _args(m, x)), params)
    (by_vjp,) = vjp(_dy(y))
    for name in want:
        torch.testing.assert_close(by_vjp[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    assert m.pending_wgrad_count == 0
    assert all(p.grad is None for p in m.parameters())


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_func_jacrev_matches_torch_functions(lib, kind) -> None:
    m = _module(lib, kind)
    x = _x(m, rows=sum(GROUP_SPLITS)).detach()
    params = {n: p.detach() for n, p in m.named_parameters()}
    splits = GROUP_SPLITS if kind == "GroupedLinear" else None
    got = torch.func.jacrev(lambda p: functional_call(m, p, _args(m, x)))(params)
    want = torch.func.jacrev(lambda p: forward_of(m, x, list(p.values()), None, splits))(params)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_func_vmap_forward_and_backward(lib, kind) -> None:
    """``vmap`` over a batch of inputs, then an ordinary backward: the gradients of a plain
    loop over the batch."""
    m, ref = _module(lib, kind), _module(lib, kind)
    gen = torch.Generator().manual_seed(3)
    xb = torch.randn(
        3, 5, m.in_features if kind != "LayerNormMLP" else m.hidden_size, generator=gen, dtype=F64
    )
    y = torch.func.vmap(m)(xb)
    y.pow(2).sum().backward()
    loop = torch.stack([ref(xi) for xi in xb])
    torch.testing.assert_close(y, loop, rtol=1e-12, atol=1e-12)
    loop.pow(2).sum().backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("mode", ["delay", "fused"])
def test_func_vmap_backward_into_a_deferred_or_fused_weight_is_a_clear_error(lib, mode) -> None:
    m = _module(lib, "Linear", delay=mode == "delay", fused=mode == "fused")
    m.weight.main_grad = torch.zeros_like(m.weight)
    y = torch.func.vmap(m)(torch.randn(2, 3, m.in_features, dtype=F64))
    with pytest.raises(RuntimeError, match="Linear with .*=True cannot .* under a torch.func"):
        y.sum().backward()


@pytest.mark.parametrize("lib", LIBS)
def test_fp8_under_torch_func_is_a_clear_error(lib) -> None:
    m = build(lib, "Linear", dtype=torch.float32)
    params = {n: p.detach() for n, p in m.named_parameters()}
    x = torch.randn(8, m.in_features)
    with lib.fp8_autocast(enabled=True, fp8_recipe=lib.DelayedScaling()):
        with pytest.raises(RuntimeError, match="Linear under FP8 does not support torch.func"):
            torch.func.grad(lambda p: functional_call(m, p, (x,)).sum())(params)


# ---- functional_call: the gradient goes to the tensors the forward used ------------------------


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_functional_call_gradients_reach_the_substituted_leaves(lib, kind, delay) -> None:
    m = _module(lib, kind, delay=delay)
    subs = _leaf_copies(m)
    y = functional_call(m, subs, _args(m, _x(m)))
    y.backward(_dy(y))
    if delay:
        gemm = set(gemm_param_names(m))
        assert all(subs[n].grad is None for n in gemm)  # deferred, not lost
        assert m.pending_wgrad_count == 1
        _drain(m)
    _assert_bitwise(_grads(subs), _plain_run(lib, kind))
    assert all(p.grad is None for p in m.parameters())  # nothing misdirected


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_functional_call_fused_writes_the_substituted_main_grad(lib, kind) -> None:
    m = _module(lib, kind, fused=True, delay=True)
    subs = _leaf_copies(m)
    for name in gemm_weight_names(m):
        subs[name].main_grad = torch.zeros_like(subs[name])
        getattr(m, name).main_grad = torch.zeros_like(subs[name])
    y = functional_call(m, subs, _args(m, _x(m)))
    y.backward(_dy(y))
    _drain(m)
    plain = _plain_run(lib, kind)
    for name in gemm_weight_names(m):
        assert subs[name].grad is None
        torch.testing.assert_close(subs[name].main_grad, plain[name], rtol=0, atol=0)
        assert not getattr(m, name).main_grad.any()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_functional_call_fused_leaf_without_main_grad_is_a_clear_error(lib, kind) -> None:
    m = _module(lib, kind, fused=True)
    subs = _leaf_copies(m)
    names = gemm_weight_names(m)
    for n in names:
        getattr(m, n).main_grad = torch.zeros_like(getattr(m, n))  # the originals have one
    y = functional_call(m, subs, _args(m, _x(m)))
    with pytest.raises(RuntimeError, match=rf"{kind}\.({'|'.join(names)}) has no main_grad"):
        y.sum().backward()
    assert all(t.grad is None for n, t in subs.items() if n in gemm_param_names(m))


# ---- parametrize: a weight that is not a leaf ------------------------------------------------


class _Scale(torch.nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return 2 * w  # exact in floating point: the chain rule is checked bitwise


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_parametrized_weight_gets_its_gradient_through_autograd(lib, kind, delay) -> None:
    m = _module(lib, kind, delay=delay)
    name = gemm_weight_names(m)[0]
    with torch.no_grad():
        getattr(m, name).mul_(0.5)  # so that the parametrized weight equals the plain run's
    parametrize.register_parametrization(m, name, _Scale())
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    original = m.parametrizations[name].original
    assert original.grad is not None  # in backward(), not deferred: it is not a leaf
    plain = _plain_run(lib, kind)
    torch.testing.assert_close(original.grad, 2 * plain[name], rtol=0, atol=0)
    _drain(m)
    for other, p in m.named_parameters():
        if other != f"parametrizations.{name}.original":
            torch.testing.assert_close(p.grad, plain[other], rtol=0, atol=0, msg=other)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", ["Linear", "GroupedLinear"])
def test_module_whose_every_parameter_is_parametrized(lib, kind) -> None:
    """Without a bias (and one group), the module keeps no parameter of its own: its dtype and
    device come from the parametrization's original."""
    if kind == "GroupedLinear":
        m = lib.GroupedLinear(1, 8, 6, bias=False, params_dtype=F64)
    else:
        m = lib.Linear(8, 6, bias=False, params_dtype=F64)
    name = gemm_weight_names(m)[0]
    parametrize.register_parametrization(m, name, _Scale())
    x = _x(m)
    y = m(x, [x.shape[0]]) if kind == "GroupedLinear" else m(x)
    y.sum().backward()
    assert m.parametrizations[name].original.grad is not None


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_parametrized_weight_under_fused_accumulation_is_refused(lib, kind) -> None:
    m = _module(lib, kind, fused=True)
    name = gemm_weight_names(m)[0]
    parametrize.register_parametrization(m, name, _Scale())
    with pytest.raises(RuntimeError, match=rf"{kind}\.{name} is not a leaf tensor"):
        m(*_args(m, _x(m)))


# ---- hooks on parameters -------------------------------------------------------------------


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_tensor_hooks_see_and_replace_the_gradient(lib, kind, delay) -> None:
    m = _module(lib, kind, delay=delay)
    seen: dict[str, list] = {n: [] for n in gemm_param_names(m)}
    for name in seen:
        p = getattr(m, name)
        p.register_hook(lambda g, name=name: seen[name].append(g) or g * 3)
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    if delay:
        assert all(not calls for calls in seen.values())  # nothing in backward()
        assert all(getattr(m, n).grad is None for n in seen)
        _drain(m)
    plain = _plain_run(lib, kind)
    for name, calls in seen.items():
        assert len(calls) == 1 and calls[0] is not None, name
        torch.testing.assert_close(calls[0], plain[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(getattr(m, name).grad, 3 * plain[name], rtol=0, atol=0)
        assert getattr(m, name).grad.data_ptr() != calls[0].data_ptr()  # the hook's is its own


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_post_accumulate_hooks_fire_once_after_the_gradient_is_written(lib, kind, delay) -> None:
    m = _module(lib, kind, delay=delay)
    log = []
    for name in gemm_param_names(m):
        getattr(m, name).register_post_accumulate_grad_hook(
            lambda p, name=name: log.append((name, None if p.grad is None else p.grad.clone()))
        )
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    assert (log == []) == delay
    _drain(m)
    plain = _plain_run(lib, kind)
    assert sorted(n for n, _ in log) == sorted(gemm_param_names(m))
    for name, grad in log:
        torch.testing.assert_close(grad, plain[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_hook_of_the_wrong_shape_is_a_clear_error_and_loses_nothing(lib, kind) -> None:
    m = _module(lib, kind, delay=True)
    name = gemm_weight_names(m)[0]
    handle = getattr(m, name).register_hook(lambda g: g[:1])
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    with pytest.raises(
        RuntimeError,
        match=rf"{kind}\.{name}: hook '<lambda>' has changed the "
        r"size of value",
    ):
        m.backward_dw()
    assert m.pending_wgrad_count == 1  # the entry stays, nothing written
    assert all(p.grad is None for n, p in m.named_parameters() if n in gemm_param_names(m))
    handle.remove()
    m.backward_dw()
    _assert_bitwise(_grads(_params(m)), _plain_run(lib, kind))


@pytest.mark.parametrize("lib", LIBS)
def test_hook_of_the_wrong_dtype_is_a_clear_error(lib) -> None:
    m = _module(lib, "Linear")
    m.bias.register_hook(lambda g: g.float())
    y = m(_x(m))
    with pytest.raises(RuntimeError, match=r"Linear\.bias: hook '<lambda>' has changed the type"):
        y.sum().backward()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_tensor_hook_on_a_fused_weight_is_refused_before_anything_is_written(lib, kind) -> None:
    m = _module(lib, kind, fused=True, delay=True)
    for n in gemm_weight_names(m):
        getattr(m, n).main_grad = torch.zeros_like(getattr(m, n))
    name = gemm_weight_names(m)[0]
    getattr(m, name).register_hook(lambda g: g)
    y = m(*_args(m, _x(m)))
    with pytest.raises(RuntimeError, match=rf"{kind}\.{name} has tensor hooks"):
        y.sum().backward()
    assert m.pending_wgrad_count == 0
    assert all(not getattr(m, n).main_grad.any() for n in gemm_weight_names(m))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_fused_post_accumulate_hook_fires_after_main_grad_is_written(lib, delay) -> None:
    m = _module(lib, "Linear", fused=True, delay=delay)
    m.weight.main_grad = torch.zeros_like(m.weight)
    log = []
    m.weight.register_post_accumulate_grad_hook(lambda p: log.append((p.grad, p.main_grad.clone())))
    y = m(_x(m))
    y.backward(_dy(y))
    assert (log == []) == delay
    _drain(m)
    ((grad, main_grad),) = log
    assert grad is None
    torch.testing.assert_close(main_grad, _plain_run(lib, "Linear")["weight"], rtol=0, atol=0)


@pytest.mark.parametrize("lib", LIBS)
def test_weight_tied_to_a_torch_op_gets_both_contributions(lib) -> None:
    """A weight used by the module (deferred) and by a torch operation (through autograd): the
    hook sees each contribution when it is written, and the sum is the non-delayed result."""
    grads = {}
    for delay in (False, True):
        m = _module(lib, "Linear", delay=delay)
        seen = []
        m.weight.register_hook(lambda g, seen=seen: seen.append(g))
        x = _x(m)
        (m(x) + F.linear(x, m.weight)).pow(2).sum().backward()
        assert len(seen) == (1 if delay else 2)  # under delay: the torch op's share only
        _drain(m)
        assert len(seen) == 2 and all(g is not None for g in seen)
        grads[delay] = m.weight.grad
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("delay", [False, True], ids=["plain", "delay"])
def test_an_existing_grad_is_accumulated_in_place(lib, kind, delay) -> None:
    """As autograd's accumulator: a second micro-batch adds into the very ``.grad`` tensor (an
    optimizer or a bucket view holding it sees the sum), whatever the caller's grad mode."""
    m = _module(lib, kind, delay=delay)
    for seed in (1, 2):
        y = m(*_args(m, _x(m, seed=seed)))
        y.backward(_dy(y))
        _drain(m)
        if seed == 1:
            first = {n: p.grad for n, p in m.named_parameters()}
    for n, p in m.named_parameters():
        assert p.grad is first[n], n


# ---- the rest of test_modules.py's checks ------------------------------------------------


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_non_contiguous_input_gives_the_result_of_its_contiguous_copy(lib, kind) -> None:
    """As for torch.nn.Linear, up to the GEMM's summation order: a strided operand may take
    another BLAS path (torch.nn.Linear differs in the last bit of float64 here too)."""
    m = _module(lib, kind)
    x = _x(m)
    strided = x.detach().t().contiguous().t().requires_grad_()  # column-major storage
    assert not strided.is_contiguous()
    y, ys = m(*_args(m, x)), m(*_args(m, strided))
    torch.testing.assert_close(ys, y, rtol=1e-13, atol=1e-13)
    dy = _dy(y)
    torch.autograd.backward([y, ys], [dy, dy])
    torch.testing.assert_close(strided.grad, x.grad, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_input_without_a_batch_dimension(lib, kind) -> None:
    m = _module(lib, kind)
    x = _x(m, rows=1)
    args = (x[0], [1, 0, 0]) if kind == "GroupedLinear" else (x[0],)
    y1 = m(*args)
    y2 = m(*((x, [1, 0, 0]) if kind == "GroupedLinear" else (x,)))
    assert y1.shape == y2.shape[1:]
    torch.testing.assert_close(y1, y2[0], rtol=0, atol=0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_two_dimensional_output_is_not_a_view(lib, kind) -> None:
    m = _module(lib, kind)
    assert not m(*_args(m, _x(m)))._is_view()


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_compute_what_the_original_computes(lib, kind, how) -> None:
    m = _module(lib, kind, delay=True)
    if how == "deepcopy":
        c = copy.deepcopy(m)
    elif how == "pickle":
        c = pickle.loads(pickle.dumps(m))
    else:
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        c = torch.load(buf, weights_only=False)
    assert type(c) is type(m) and c.delay_wgrad_compute
    for (n, p), q in zip(m.named_parameters(), c.parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr()
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=n)
    grads = []
    for module in (m, c):
        y = module(*_args(module, _x(module)))
        y.backward(_dy(y))
        _drain(module)
        grads.append(_grads(_params(module)))
    _assert_bitwise(grads[1], grads[0])


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_train_and_eval_change_nothing_but_the_flag(lib, kind) -> None:
    m = _module(lib, kind)
    x = _x(m)
    y_train = m(*_args(m, x))
    assert m.eval() is m and not m.training
    torch.testing.assert_close(m(*_args(m, x)), y_train, rtol=0, atol=0)
    assert m.train() is m and m.training


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_module_forward_and_full_backward_hooks(lib, kind) -> None:
    m = _module(lib, kind, delay=True)
    seen = {}

    def forward_hook(mod, args, out) -> None:
        seen["out"] = out.shape

    m.register_forward_hook(forward_hook)
    m.register_full_backward_hook(
        lambda mod, gin, gout: seen.update(gin=gin[0].clone(), gout=gout[0].clone())
    )
    x = _x(m)
    y = m(*_args(m, x))
    dy = _dy(y)
    y.backward(dy)
    assert seen["out"] == y.shape
    torch.testing.assert_close(seen["gout"], dy, rtol=0, atol=0)
    torch.testing.assert_close(seen["gin"], x.grad, rtol=0, atol=0)
    assert m.pending_wgrad_count == 1


# ---- where parameters are created; reset_parameters; repr (SPEC §2) ------------------------------

_SIZES = {"Linear": (16, 24), "LayerNormLinear": (16, 24), "LayerNormMLP": (16, 32)}
_SIZES["GroupedLinear"] = (3, 16, 24)


def _new(lib, kind, **options):
    return getattr(lib, kind)(*_SIZES[kind], **options)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_meta_device_context_then_to_empty_and_reset_is_the_eager_module(lib, kind) -> None:
    torch.manual_seed(0)
    eager = _new(lib, kind, delay_wgrad_compute=True)
    with torch.device("meta"):
        m = _new(lib, kind, delay_wgrad_compute=True)
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    torch.manual_seed(0)
    m.reset_parameters()
    for (name, p), q in zip(eager.named_parameters(), m.parameters()):
        assert q.device.type == "cpu"
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_default_device_and_dtype_decide_unless_given(lib, kind) -> None:
    previous = torch.get_default_dtype()
    torch.set_default_device("meta")
    try:
        torch.set_default_dtype(torch.float64)
        m = _new(lib, kind)
        assert all(p.is_meta and p.dtype == torch.float64 for p in m.parameters())
        given = _new(lib, kind, device="cpu", params_dtype=torch.bfloat16)
        assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in given.parameters())
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(previous)
    assert all(p.device.type == "cpu" and p.dtype == previous for p in _new(lib, kind).parameters())


@pytest.mark.parametrize("lib", LIBS)
def test_reset_parameters_restores_fp8_scaling_state(lib) -> None:
    """A module that ran under FP8 and is reset computes as a freshly built one: its delayed
    scaling histories start afresh, bitwise."""
    recipe = lib.DelayedScaling(amax_history_len=4)
    x = torch.randn(16, 16)
    torch.manual_seed(0)
    fresh = lib.Linear(16, 16)
    torch.manual_seed(0)
    used = lib.Linear(16, 16)
    with lib.fp8_autocast(enabled=True, fp8_recipe=recipe):
        used(x * 100).sum().backward()
    torch.manual_seed(0)
    used.reset_parameters()
    used.weight.grad = used.bias.grad = None
    outs = []
    for m in (fresh, used):
        with lib.fp8_autocast(enabled=True, fp8_recipe=recipe):
            outs.append(m(x))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_reset_parameters_with_queued_entries_is_refused(lib, kind) -> None:
    m = _module(lib, kind, delay=True)
    y = m(*_args(m, _x(m)))
    y.backward(_dy(y))
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(RuntimeError, match=rf"{kind}\.reset_parameters\(\) with 1 weight-gradient"):
        m.reset_parameters()
    for n, p in m.named_parameters():
        torch.testing.assert_close(p, before[n], rtol=0, atol=0, msg=n)
    assert m.pending_wgrad_count == 1


@pytest.mark.parametrize("lib", LIBS)
def test_repr_shows_sizes_and_the_options_that_differ(lib) -> None:
    assert repr(lib.Linear(16, 24)) == "Linear(in_features=16, out_features=24, bias=True)"
    assert (
        repr(lib.Linear(16, 24, delay_wgrad_compute=True))
        == "Linear(in_features=16, out_features=24, bias=True, delay_wgrad_compute=True)"
    )
    assert repr(
        lib.LayerNormMLP(
            8,
            16,
            bias=False,
            params_dtype=torch.bfloat16,
            activation="swiglu",
            normalization="RMSNorm",
            eps=1e-6,
            fuse_wgrad_accumulation=True,
        )
    ) == (
        "LayerNormMLP(hidden_size=8, ffn_hidden_size=16, bias=False, params_dtype=torch.bfloat16, "
        "eps=1e-06, normalization='RMSNorm', activation='swiglu', fuse_wgrad_accumulation=True)"
    )
    assert repr(lib.GroupedLinear(4, 8, 8)) == (
        "GroupedLinear(num_gemms=4, in_features=8, out_features=8, bias=True)"
    )


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("kind", KINDS)
def test_to_empty_keeps_the_deferred_marks_and_a_meta_forward_runs(lib, kind) -> None:
    """``to_empty`` from meta creates new Parameter objects: the deferred ones keep
    ``skip_backward_post_hook`` (a reducer reads it). A forward on meta (shape tracing) runs."""
    with torch.device("meta"):
        m = _new(lib, kind, delay_wgrad_compute=True)
        x = torch.randn(5, m.hidden_size if kind == "LayerNormMLP" else m.in_features)
        y = m(x, [2, 0, 3]) if kind == "GroupedLinear" else m(x)
    assert y.is_meta and y.shape[0] == 5
    m.to_empty(device="cpu")
    marked = {n for n, p in m.named_parameters() if getattr(p, "skip_backward_post_hook", False)}
    assert marked == set(gemm_param_names(m))


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("option", ["bias", "delay_wgrad_compute", "fuse_wgrad_accumulation"])
@pytest.mark.parametrize("value", [None, "yes", 2, 1.0])
def test_an_on_off_option_that_is_not_a_bool_is_refused(lib, option, value) -> None:
    with pytest.raises(TypeError, match=rf"{option} must be True or False, got {value!r}"):
        lib.Linear(4, 4, **{option: value})


@pytest.mark.parametrize("lib", LIBS)
def test_fp8_state_started_under_inference_mode_trains_afterwards(lib) -> None:
    """Delayed-scaling state first created in an inference_mode forward (an evaluation before
    training) is ordinary state: the training forward after it updates it in place."""
    m, recipe, x = lib.Linear(16, 16), lib.DelayedScaling(), torch.randn(4, 16)
    with torch.inference_mode(), lib.fp8_autocast(enabled=True, fp8_recipe=recipe):
        m(x)
    with lib.fp8_autocast(enabled=True, fp8_recipe=recipe):
        m(x).sum().backward()
    assert m.weight.grad is not None
