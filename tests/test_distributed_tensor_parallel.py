"""SPEC §9 on the distributed side, on spawned gloo ranks (one spawn per test, each running its
whole matrix):

* torch's DTensor styles (``parallelize_module`` with torchtitan's Llama plan: ``ColwiseParallel``,
  ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``) on models converted by
  ``convert_linears``, delayed and not: every gradient bitwise the same plan on the ``torch.nn``
  model (the reference with biases: delayed ≡ non-delayed bitwise, torch within rounding, as
  tests/test_convert.py says why); FP8, fused accumulation and a module that communicates
  itself refused on DTensor parameters;
* :func:`~splitgrad.distributed.allreduce_sequence_parallel_grads` on the modules' own
  sequence parallelism: the single-process gradients, bitwise equal on every rank, refusals
  that change nothing;
* ``GradientReducer(..., tp_group=...)`` on a 2 x 2 (data x tensor) layout, plain and under
  ``fully_shard``: bitwise the data-parallel average followed by that sum;
* FSDP2 on a 2-D mesh over torchtitan's plan (and the reducer on the plan without FSDP2):
  bitwise the ``torch.nn`` model under the same plan without delay.

Rank functions return the failures they found (empty: all good) and what they compared.
"""

from __future__ import annotations

import copy
import functools
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from splitgrad.distributed import (
    allreduce_sequence_parallel_grads,
    run_ranks,
    sequence_parallel_parameters,
)

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]

LIBS = ("splitgrad.impl", "splitgrad.reference")

# ---- a tiny Llama with torchtitan's module names, and torchtitan's TP plan -----------------


class _Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (
            torch.nn.Linear(dim, dim, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # heads inferred from the (rank's) projection: -1
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))


class _FeedForward(torch.nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden, bias=bias)
        self.w2 = torch.nn.Linear(hidden, dim, bias=bias)
        self.w3 = torch.nn.Linear(dim, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, bias: bool) -> None:
        super().__init__()
        self.attention_norm = torch.nn.RMSNorm(dim)
        self.attention = _Attention(dim, heads)
        self.ffn_norm = torch.nn.RMSNorm(dim)
        self.feed_forward = _FeedForward(dim, 2 * dim, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class _TinyLlama(torch.nn.Module):
    """Embedding, two blocks, final norm, output head: torchtitan's names (batch-first)."""

    VOCAB = 16

    def __init__(self, bias: bool, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(self.VOCAB, dim)
        self.layers = torch.nn.ModuleDict({str(i): _Block(dim, heads, bias) for i in range(2)})
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, self.VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        for layer in self.layers.values():
            h = layer(h)
        logits = self.output(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def _titan_plan(model: _TinyLlama, tp_mesh) -> None:
    """torchtitan's ``apply_tp`` for Llama, with sequence parallelism (loss not parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in model.layers.values():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, _TinyLlama.VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


def _drain(model: torch.nn.Module) -> int:
    ran = 0
    for m in model.modules():
        while getattr(m, "pending_wgrad_count", 0):
            m.backward_dw()
            ran += 1
    return ran


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.to_local() if hasattr(t, "to_local") else t


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every gradient ``model`` holds (a DTensor's local shard), by name."""
    return {n: _local(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare(failures, where, got: dict, want: dict, rtol: float = 0.0, atol: float = 0.0) -> int:
    """Compare two {name: tensor} dicts; each mismatch goes to ``failures``; returns how many
    tensors were compared."""
    if got.keys() != want.keys():
        failures.append(f"{where}: names differ: {sorted(got)} vs {sorted(want)}")
        return 0
    for name, g in got.items():
        try:
            torch.testing.assert_close(g, want[name], rtol=rtol, atol=atol)
        except AssertionError as exc:
            failures.append(f"{where} {name}: {str(exc).splitlines()[0]} ({exc})"[:400])
    return len(got)


# ---- 1. torch's DTensor styles on converted models --------------------------------------


def _refusal(failures, where, expected: type, match: str, run, *args) -> None:
    """``run(*args)`` must raise ``expected`` with ``match`` in its message."""
    try:
        run(*args)
    except expected as exc:
        if match not in str(exc):
            failures.append(f"{where}: {type(exc).__name__} without {match!r}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001 (reported, not raised: the matrix goes on)
        failures.append(f"{where}: expected {expected.__name__}, got {exc!r}")
        return
    failures.append(f"{where}: no {expected.__name__}")


def _styles_case(lib, mesh, bias: bool, delay: bool, failures: list, grads: dict) -> int:
    from torch.distributed.tensor import DTensor

    where = f"{lib.__name__} bias={bias} delay={delay}"
    torch.manual_seed(0)
    reference = _TinyLlama(bias)
    model = lib.convert_linears(copy.deepcopy(reference), delay_wgrad_compute=delay)
    for m in (reference, model):
        _titan_plan(m, mesh)
    wq = model.layers["0"].attention.wq
    if type(wq) is not lib.Linear or not isinstance(wq.weight, DTensor):
        failures.append(f"{where}: wq is {type(wq)} holding {type(wq.weight)}")
    gemm = [p for m in model.modules() if isinstance(m, lib.Linear) for p in m.parameters()]
    marked = [bool(getattr(p, "skip_backward_post_hook", False)) for p in gemm]
    if marked != [delay] * len(gemm):
        failures.append(f"{where}: skip_backward_post_hook after parallelize_module: {marked}")
    compared = 0
    for micro in range(2):  # two micro-batches: the second accumulates into DTensor grads
        losses = [m(_ids(micro)) for m in (reference, model)]
        for loss in losses:
            loss.backward()
        compared += _compare(
            failures, f"{where} loss {micro}", {"loss": losses[1]}, {"loss": losses[0]}
        )
        if delay:
            untouched = [p.grad is None for p in gemm] if micro == 0 else [True]
            if not all(untouched):
                failures.append(f"{where}: a deferred gradient was written in backward()")
            if _drain(model) != len([m for m in model.modules() if isinstance(m, lib.Linear)]):
                failures.append(f"{where}: not one entry per converted layer")
    got = _grads(model)
    grads[(lib.__name__, bias, delay)] = got
    if lib.__name__.endswith("impl") or not bias:
        compared += _compare(failures, f"{where} vs torch.nn", got, _grads(reference))
    else:  # the reference rounds x @ W^T before adding the bias (tests/test_convert.py)
        compared += _compare(failures, f"{where} vs torch.nn", got, _grads(reference), 1e-5, 1e-6)
    return compared


def _styles_refusals(lib, mesh, failures: list) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    where = lib.__name__

    def converted(**options):
        torch.manual_seed(0)
        model = lib.convert_linears(torch.nn.Sequential(torch.nn.Linear(8, 8)), **options)
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
        return model

    def fused():
        model = converted(fuse_wgrad_accumulation=True)
        model[0].weight.main_grad = torch.zeros_like(model[0].weight)
        model(torch.randn(4, 8))

    def fp8():
        model = converted(delay_wgrad_compute=True)
        with lib.fp8_autocast(fp8_recipe=lib.DelayedScaling()):
            model(torch.randn(16, 8))

    def communicating():
        layer = lib.Linear(8, 8, tp_group=mesh.get_group(), parallel_mode="column")
        parallelize_module(torch.nn.Sequential(layer), mesh, {"0": ColwiseParallel()})

    _refusal(failures, f"{where} fused", RuntimeError, "does not run on DTensor weights", fused)
    _refusal(failures, f"{where} fp8", RuntimeError, "does not run on DTensor weights", fp8)
    _refusal(failures, f"{where} tp_group", ValueError, "communicates itself", communicating)


def _dtensor_styles(rank: int, world: int) -> tuple[list[str], int]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    failures: list[str] = []
    grads: dict = {}
    compared = 0
    for name in LIBS:
        lib = importlib.import_module(name)
        for bias in (True, False):
            for delay in (False, True):
                compared += _styles_case(lib, mesh, bias, delay, failures, grads)
            compared += _compare(
                failures,
                f"{name} bias={bias} delayed vs not",
                grads[(name, bias, True)],
                grads[(name, bias, False)],
            )
        _styles_refusals(lib, mesh, failures)
    return failures, compared


def test_torch_dtensor_styles_on_converted_models():
    """torchtitan's plan on converted models of both packages, biases on and off, delayed and
    not, two micro-batches: bitwise torch.nn under the same plan; refusals named."""
    results = run_ranks(_dtensor_styles, 2, timeout_s=180)
    for failures, _ in results:
        assert failures == []
    # per rank: 2 packages x 2 biases x (2 modes x (2 losses + 27 or 22 gradients) + 1 pair)
    assert all(compared > 200 for _, compared in results)


# ---- 2. the modules' own sequence parallelism: allreduce_sequence_parallel_grads ----------


def _sp_model(lib, group, dtype, *, delay: bool, tp: bool) -> torch.nn.Sequential:
    """LayerNormMLP (fc1 column, fc2 row), LayerNormLinear (column), Linear (row), all SP."""
    opts = dict(params_dtype=dtype, delay_wgrad_compute=delay)
    if tp:
        opts.update(tp_group=group, sequence_parallel=True)
    h = 8
    return torch.nn.Sequential(
        lib.LayerNormMLP(h, 16, set_parallel_mode=tp, **opts),
        lib.LayerNormLinear(h, h, parallel_mode="column" if tp else None, **opts),
        lib.Linear(h, h, parallel_mode="row" if tp else None, **opts),
    )


def _load_shards(tp_model, full_model, rank: int, world: int) -> None:
    with torch.no_grad():
        for p, q in zip(tp_model.parameters(), full_model.parameters(), strict=True):
            dim = getattr(p, "partition_dim", None)
            p.copy_(q if dim is None else q.chunk(world, dim)[rank])


SP_NAMES = [
    "0.layer_norm_weight",
    "0.layer_norm_bias",
    "0.fc2_bias",
    "1.layer_norm_weight",
    "1.layer_norm_bias",
    "2.bias",
]


def _sp_grads(rank: int, world: int) -> tuple[list[str], int]:
    group = dist.group.WORLD
    failures: list[str] = []
    compared = 0
    for name in LIBS:
        lib = importlib.import_module(name)
        for delay in (True, False):
            where = f"{name} delay={delay}"
            torch.manual_seed(0)
            full = _sp_model(lib, group, torch.float64, delay=False, tp=False)
            model = _sp_model(lib, group, torch.float64, delay=delay, tp=True)
            _load_shards(model, full, rank, world)
            marked = [n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", 0)]
            found = [p.name for p in sequence_parallel_parameters(model)]
            if marked != SP_NAMES or found != SP_NAMES:
                failures.append(f"{where}: marked {marked}, found {found}")
            x = torch.randn(
                8, 2, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
            )
            full(x).square().sum().backward()
            model(x.chunk(world, 0)[rank]).square().sum().backward()
            if delay:
                before = _grads(model)
                _refusal(
                    failures,
                    f"{where} pending",
                    RuntimeError,
                    "still queued on modules 0 (1), 1 (1), 2 (1)",
                    allreduce_sequence_parallel_grads,
                    model,
                    group,
                )
                compared += _compare(failures, f"{where} nothing reduced", _grads(model), before)
                _drain(model)
            missing, model[2].bias.grad = model[2].bias.grad, None
            snapshot = _grads(model)
            _refusal(
                failures,
                f"{where} missing",
                RuntimeError,
                "2.bias (sequence_parallel=True) has no",
                allreduce_sequence_parallel_grads,
                model,
                group,
            )
            compared += _compare(failures, f"{where} nothing reduced", _grads(model), snapshot)
            model[2].bias.grad = missing
            for bad in (None, "tp"):
                _refusal(
                    failures,
                    f"{where} tp_group={bad!r}",
                    ValueError,
                    "must be a torch.distributed",
                    allreduce_sequence_parallel_grads,
                    model,
                    bad,
                )
            if allreduce_sequence_parallel_grads(model, group) != SP_NAMES:
                failures.append(f"{where}: summed another list")
            got = {n: p.grad for n, p in model.named_parameters() if n in SP_NAMES}
            want = {n: p.grad for n, p in full.named_parameters() if n in SP_NAMES}
            compared += _compare(failures, f"{where} vs one process", got, want, 1e-12, 1e-12)
            gathered = [None] * world
            dist.all_gather_object(gathered, got)
            for other in gathered:
                compared += _compare(failures, f"{where} across ranks", got, other)
    return failures, compared


def test_allreduce_sequence_parallel_grads():
    """The SP gradients of LayerNormMLP, LayerNormLinear and Linear (row) summed over the group:
    the single-process gradients (float64), bitwise equal on both ranks; queued entries, a
    missing gradient and a bad group refused, changing nothing."""
    results = run_ranks(_sp_grads, 2, timeout_s=120)
    for failures, _ in results:
        assert failures == []
    assert all(compared > 50 for _, compared in results)


# ---- 3. GradientReducer(tp_group=...) on a 2 x 2 (data x tensor) layout --------------------


def _mesh_2d():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _sp_step(model, rank_tp: int, rank_dp: int) -> None:
    """One backward of the data-parallel rank's batch, split along the sequence, drained."""
    gen = torch.Generator().manual_seed(10 + rank_dp)
    x = torch.randn(8, 2, 8, dtype=torch.float64, generator=gen)
    model(x.chunk(2, 0)[rank_tp]).square().sum().backward()
    _drain(model)


def _fsdp_shard(full: torch.Tensor, dp_rank: int) -> torch.Tensor:
    return full.chunk(2, 0)[dp_rank]


def _reducer_tp_group(rank: int, world: int) -> tuple[list[str], int]:
    from splitgrad.distributed import GradientReducer
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh_2d()
    dp, tp = mesh["dp"], mesh["tp"]
    dp_group, tp_group = dp.get_group(), tp.get_group()
    dp_rank, tp_rank = dp.get_local_rank(), tp.get_local_rank()
    failures: list[str] = []
    compared = 0
    for name in LIBS:
        lib = importlib.import_module(name)

        def build(lib=lib):
            torch.manual_seed(0)  # the same shards on every rank: enough for these sums
            return _sp_model(lib, tp_group, torch.float64, delay=True, tp=True)

        # what the reducer must give: the data-parallel average, then the sum over TP
        manual = build()
        _sp_step(manual, tp_rank, dp_rank)
        for p in manual.parameters():
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(2)
        allreduce_sequence_parallel_grads(manual, tp_group)
        want = _grads(manual)

        plain = build()
        bad = functools.partial(GradientReducer, tp_group="tp")
        _refusal(failures, f"{name} tp_group='tp'", ValueError, "tp_group must be", bad, plain)
        reducer = GradientReducer(plain, dp_group, tp_group=tp_group)  # nothing was left behind
        if reducer.sequence_parallel_names != SP_NAMES:
            failures.append(f"{name}: the reducer sums {reducer.sequence_parallel_names}")
        _sp_step(plain, tp_rank, dp_rank)
        reducer.finish()
        compared += _compare(failures, f"{name} GradientReducer", _grads(plain), want)

        sharded = build()
        for layer in sharded:
            fully_shard(layer, mesh=dp)
        fully_shard(sharded, mesh=dp)
        reducer = GradientReducer(sharded, tp_group=tp_group)
        if reducer.sequence_parallel_names != SP_NAMES:  # read from the options: attributes gone
            failures.append(
                f"{name}: under fully_shard the reducer sums {reducer.sequence_parallel_names}"
            )
        _sp_step(sharded, tp_rank, dp_rank)
        reducer.finish()
        got = _grads(sharded)
        shards = {n: _fsdp_shard(g, dp_rank) for n, g in want.items()}
        compared += _compare(failures, f"{name} GradientReducer under fully_shard", got, shards)

        sp = {n: g for n, g in got.items() if n in SP_NAMES}
        gathered = [None] * world
        dist.all_gather_object(gathered, (dp_rank, sp))
        for other_dp, other in gathered:
            if other_dp == dp_rank:  # the same shard: bitwise on both TP ranks
                compared += _compare(failures, f"{name} SP shards across TP ranks", sp, other)
    return failures, compared


def test_gradient_reducer_sums_sequence_parallel_grads_over_the_tp_group():
    """2 x 2 ranks, the modules' own TP + SP, delayed: GradientReducer(..., tp_group) gives
    bitwise the data-parallel average followed by allreduce_sequence_parallel_grads, plain
    and under fully_shard (whose parameters lost the sequence_parallel attribute)."""
    results = run_ranks(_reducer_tp_group, 4, timeout_s=180)
    for failures, _ in results:
        assert failures == []
    assert all(compared > 40 for _, compared in results)


# ---- 4. torchtitan's 2-D layout: the plan on "tp", FSDP2 (or the reducer) on "dp" ---------


def _titan_2d_case(lib, mesh, bias: bool, micro_batches: int, failures: list) -> int:
    """FSDP2 over the plan: converted + delayed + GradientReducer vs torch.nn + FSDP2, two
    steps of ``micro_batches`` each (non-final ones under ``no_sync``), SGD in between."""
    from splitgrad.distributed import GradientReducer
    from torch.distributed.fsdp import fully_shard

    where = f"{lib.__name__} bias={bias} micro_batches={micro_batches} fully_shard"
    torch.manual_seed(0)
    reference = _TinyLlama(bias)
    model = lib.convert_linears(copy.deepcopy(reference), delay_wgrad_compute=True)
    for m in (reference, model):
        _titan_plan(m, mesh["tp"])
        for block in m.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    reducer = GradientReducer(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    dp_rank = mesh["dp"].get_local_rank()
    compared = 0
    for step in range(2):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            ids = _ids(100 * step + 10 * dp_rank + micro)
            reference.set_requires_gradient_sync(last)
            reference(ids).backward()
            with reducer.no_sync() if not last else _nothing():
                model(ids).backward()
                _drain(model)
        reducer.finish()
        where_step = f"{where} step {step}"
        compared += _compare(failures, where_step, _grads(model), _grads(reference))
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return compared


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _titan_2d_without_fsdp(lib, mesh, failures: list) -> int:
    """The plan on "tp", GradientReducer over "dp" (no FSDP2): bitwise each gradient of the
    torch.nn model under the same plan in the parameter's placements, averaged over "dp"."""
    from splitgrad.distributed import GradientReducer

    where = f"{lib.__name__} GradientReducer over dp, no fully_shard"
    torch.manual_seed(0)
    reference = _TinyLlama(bias=False)
    model = lib.convert_linears(copy.deepcopy(reference), delay_wgrad_compute=True)
    for m in (reference, model):
        _titan_plan(m, mesh["tp"])
    dp_group = mesh["dp"].get_group()
    reducer = GradientReducer(model, dp_group)
    ids = _ids(7 + mesh["dp"].get_local_rank())
    reference(ids).backward()
    model(ids).backward()
    _drain(model)
    reducer.finish()
    want = {}
    for name, p in reference.named_parameters():
        g = p.grad.redistribute(p.device_mesh, p.placements).to_local().clone()
        dist.all_reduce(g, group=dp_group)
        want[name] = g.div_(2)
    return _compare(failures, where, _grads(model), want)


def _titan_2d(rank: int, world: int) -> tuple[list[str], int]:
    mesh = _mesh_2d()
    failures: list[str] = []
    compared = 0
    for name in LIBS:
        lib = importlib.import_module(name)
        # the reference is torch's bitwise twin without biases (tests/test_convert.py)
        bias = name.endswith("impl")
        compared += _titan_2d_case(lib, mesh, bias, 1, failures)
        compared += _titan_2d_case(lib, mesh, bias, 2, failures)
        compared += _titan_2d_without_fsdp(lib, mesh, failures)
    return failures, compared


def test_fsdp2_on_a_2d_mesh_over_torchtitans_plan():
    """2 x 2 ranks, torchtitan's plan on "tp" and fully_shard on "dp" (the parameters are
    DTensors before sharding): converted, delayed models with GradientReducer give bitwise the
    gradients of the torch.nn model under the same layout without delay, over two SGD steps,
    with one micro-batch per step and with two (no_sync); without fully_shard, the reducer over
    "dp" gives bitwise the plan's gradients averaged over "dp"."""
    results = run_ranks(_titan_2d, 4, timeout_s=240)
    for failures, _ in results:
        assert failures == []
    assert all(compared > 100 for _, compared in results)
