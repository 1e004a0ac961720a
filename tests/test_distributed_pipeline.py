"""P15 (SPEC §8): splitgrad modules under torch.distributed.pipelining schedules with
``splitgrad.distributed.dw_builder``, on 2 and 4 gloo ranks (spawned here, every collective
with a timeout), against the same stages run in one process: loss and every gradient bitwise.

Plus the builder's own rules, in one process: W steps run exactly what their backward queued, out
of order raises and runs nothing, a failed W step resumes, and the stage's gradient scaling
covers ``main_grad`` and refuses to run before the last entry.
"""

from __future__ import annotations

import re

import pytest
import torch
from cases import build, fill, forward, make_dy, make_input
from splitgrad.distributed import dw_builder
from splitgrad.properties.checks.distributed import check_pipeline

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("lib_name", ["splitgrad.impl", "splitgrad.reference"])
def test_p15_every_schedule_on_2_ranks(lib_name):
    """Six schedules x plain/fused accumulation x (no FP8, delayed-scaling FP8)."""
    recipes = (None, "delayed") if lib_name == "splitgrad.impl" else (None,)
    report = check_pipeline(lib_name, world_size=2, recipes=recipes)
    report.raise_if_failed()
    assert report.compared > 0


def test_p15_every_schedule_on_4_ranks():
    report = check_pipeline("splitgrad.impl", world_size=4)
    report.raise_if_failed()
    assert report.compared > 0


def test_p15_block_recipes_under_zero_bubble():
    report = check_pipeline(
        "splitgrad.impl",
        world_size=2,
        schedules=("ScheduleZBVZeroBubble",),
        fused=(True,),
        recipes=("mxfp8", "current"),
    )
    report.raise_if_failed()


# ---- the builder's rules, in one process -------------------------------------------------


class _Stage(torch.nn.Module):
    """Two delayed splitgrad modules and one non-delayed one."""

    def __init__(self, lib, fused=False):
        super().__init__()
        self.a = build(lib, "LayerNormLinear", delay=True, fused=fused)
        self.b = build(lib, "Linear", delay=True, fused=fused)
        self.c = build(lib, "Linear", delay=False)
        for m in (self.a, self.b, self.c):
            fill(m, 0)
        if fused:
            for m in (self.a, self.b):
                m.weight.main_grad = torch.zeros_like(m.weight, dtype=torch.float32)

    def forward(self, x):
        # a: 8 -> 6; b: 8 -> 6 on a's padded output; c: 8 -> 6
        h = torch.nn.functional.pad(self.a(x), (0, 2))
        return self.b(h) + self.c(x)


def _backward(stage, seed):
    x = make_input(stage.a, seed)
    y = stage(x)
    y.backward(make_dy(stage.b, y, seed))


def _two_runners(lib):
    """A stage, its builder, and the runners of two backward passes (not run)."""
    stage = _Stage(lib)
    builder = dw_builder(stage)
    _backward(stage, 1)
    r1 = builder()
    _backward(stage, 2)
    return stage, builder, r1, builder()


def test_runner_runs_exactly_what_its_backward_queued(lib):
    stage, builder, r1, r2 = _two_runners(lib)
    assert r1.entries == {"a": 1, "b": 1} and r2.entries == {"a": 1, "b": 1}
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (2, 2)
    r1()
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (1, 1)
    r2()
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (0, 0)
    assert builder.pending_runners == 0
    with pytest.raises(RuntimeError, match="already ran"):
        r1()


def test_runner_out_of_order_raises_and_runs_nothing(lib):
    stage, _, r1, r2 = _two_runners(lib)
    before = {n: None if p.grad is None else p.grad.clone() for n, p in stage.named_parameters()}
    with pytest.raises(RuntimeError, match=r"backward #1.*backward #0"):
        r2()
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (2, 2)
    for n, p in stage.named_parameters():
        if before[n] is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, before[n], rtol=0, atol=0, msg=n)
    r1()
    r2()


def test_a_failing_w_step_keeps_its_entries_and_resumes(lib):
    stage = _Stage(lib, fused=True)
    builder = dw_builder(stage)
    _backward(stage, 1)
    runner = builder()
    good = stage.b.weight.main_grad
    stage.b.weight.main_grad = None  # b's wgrad (run first: last registered) now fails
    with pytest.raises(RuntimeError, match="main_grad"):
        runner()
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (1, 1)
    stage.b.weight.main_grad = good
    runner()
    assert (stage.a.pending_wgrad_count, stage.b.pending_wgrad_count) == (0, 0)
    assert builder.pending_runners == 0


def test_stray_backward_dw_is_detected(lib):
    stage = _Stage(lib)
    builder = dw_builder(stage)
    _backward(stage, 1)
    builder()
    stage.a.backward_dw()  # someone else ran the entry the runner owns
    with pytest.raises(RuntimeError, match="something else ran backward_dw"):
        builder()


class _FakeStage:
    """What ``attach`` needs of a PipelineStage: ``submod`` and torch's ``scale_grads``."""

    def __init__(self, submod):
        self.submod = submod
        self.scaled = []

    def scale_grads(self, factor):
        self.scaled.append(factor)
        for p in self.submod.parameters():
            if p.grad is not None:
                p.grad.div_(factor)


def test_scaling_covers_main_grad_and_waits_for_the_last_entry(lib):
    stage = _Stage(lib, fused=True)
    builder = dw_builder(stage)
    fake = _FakeStage(stage)
    builder.attach(fake)
    _backward(stage, 1)
    runner = builder()
    with pytest.raises(RuntimeError, match="still queued"):
        fake.scale_grads(4)
    assert fake.scaled == []
    runner()
    main = {m: m.weight.main_grad.clone() for m in (stage.a, stage.b)}
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    fake.scale_grads(4)
    assert fake.scaled == [4]
    for m, before in main.items():
        torch.testing.assert_close(m.weight.main_grad, before / 4, rtol=0, atol=0)
    for n, p in stage.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n] / 4, rtol=0, atol=0, msg=n)


def test_attach_rejects_another_module(lib):
    builder = dw_builder(_Stage(lib))
    with pytest.raises(ValueError, match="submod"):
        builder.attach(_FakeStage(_Stage(lib)))


def test_a_stage_out_of_reach_fails_loudly(lib):
    """torch's pipelining calling the builder from a frame that does not hold the stage (the
    call moved in a new torch): a RuntimeError naming the torch version and ``attach``, not W
    steps without the stage's drain check and scaling. A caller outside torch (a custom runtime)
    still builds, and after ``attach`` nothing is searched."""
    stage = _Stage(lib)
    builder = dw_builder(stage)
    _backward(stage, 1)
    moved = {"__name__": "torch.distributed.pipelining.stage"}
    exec("def backward_one_chunk(build):\n    return build()\n", moved)
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}.*attach"):
        moved["backward_one_chunk"](builder)
    assert builder.pending_runners == 0
    builder()()  # a custom runtime's own call
    builder.attach(_FakeStage(stage))
    _backward(stage, 1)
    moved["backward_one_chunk"](builder)()
    assert builder.pending_runners == 0


def test_input_only_backward_is_not_a_micro_batch(lib):
    """Pipelining's shape inference (``torch.autograd.grad`` on the inputs) queues nothing, so
    the next builder call sees only the real micro-batch."""
    stage = _Stage(lib)
    builder = dw_builder(stage)
    x = make_input(stage.a, 3)
    y = stage(x)
    torch.autograd.grad(y, x, make_dy(stage.b, y, 3))
    _backward(stage, 1)
    runner = builder()
    assert runner.entries == {"a": 1, "b": 1}
    runner()


def test_dw_builder_needs_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        dw_builder(object())


def test_non_split_stage_gets_empty_runners(lib):
    m = build(lib, "Linear")
    with pytest.warns(UserWarning, match="nothing is split, the stage has 1 split-backward"):
        builder = dw_builder(m)
    y = forward(m, make_input(m, 0))
    y.sum().backward()
    runner = builder()
    assert runner.entries == {}
    runner()
    assert m.weight.grad is not None  # the backward computed it: it works, unsplit


# ---- torch versions: the shape-inference pass by every name it has had ------------------------


def test_this_torch_names_its_shape_inference_pass_by_a_known_name():
    from splitgrad.distributed import pipeline

    assert pipeline.shape_inference_method() in pipeline.SHAPE_INFERENCE_METHODS


@pytest.mark.parametrize("name", ["_forward_metadata_inference", "_shape_inference"])
def test_in_shape_inference_recognises_every_name_on_a_stage_only(name):
    """torch 2.12+ calls the pass ``_forward_metadata_inference``, 2.10/2.11 ``_shape_inference``
    (where in_shape_inference used to answer False); a function of that name elsewhere is not
    the pass."""
    from splitgrad.distributed import in_shape_inference
    from torch.distributed.pipelining import PipelineStage

    seen = []

    def probe(self):
        seen.append(in_shape_inference())

    stage = object.__new__(PipelineStage)  # only its type matters here
    method = type(name, (), {})  # a namespace to hold a function with the right __name__
    code = probe.__code__.replace(co_name=name)
    fn = type(probe)(code, probe.__globals__, name, None, probe.__closure__)
    fn(stage)
    fn(method())  # same name, not a stage
    probe(stage)  # a stage, another name
    assert seen == [True, False, False]


def test_a_torch_whose_pass_moved_is_refused_naming_the_version(monkeypatch, lib):
    from splitgrad.distributed import pipeline
    from torch.distributed.pipelining import PipelineStage

    for name in pipeline.SHAPE_INFERENCE_METHODS:
        for cls in PipelineStage.__mro__:
            if name in vars(cls):
                monkeypatch.delattr(cls, name)
    version = re.escape(torch.__version__)
    with pytest.raises(RuntimeError, match=rf"torch {version}: .*static input_args"):
        dw_builder(_Stage(lib))
