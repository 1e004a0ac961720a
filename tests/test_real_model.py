"""A transformer we did not write, end to end: Hugging Face
``LlamaForCausalLM`` (attention, RMSNorm, tied embeddings, ``torch.nn.Linear`` everywhere),
converted with ``splitgrad.impl.convert_linears(..., delay_wgrad_compute=True)``.

Runs the two examples in ``examples/``: ``llama_convert.py`` (3 AdamW steps, bitwise equal to
the unconverted model in float32; within the ``model-training`` budget against a float64 copy
under autocast and in bfloat16) and ``llama_pipeline.py`` (4 stages on 2 gloo ranks under
``ScheduleZBVZeroBubble``, splitgrad's ``dw_builder`` next to torch's own split: equal losses).
``transformers`` is an optional extra (``splitgrad[model]``): without it this file is skipped.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Imported by name (not by file path) so that the pipeline's spawned ranks can import them too.
sys.path.insert(0, str(EXAMPLES))

import llama_convert  # noqa: E402
import llama_pipeline  # noqa: E402


def test_fp32_training_is_bitwise_equal(capsys):
    assert llama_convert.main(["--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "15 linears converted" in out
    assert "every parameter bitwise equal to the unconverted model: OK" in out


def test_bf16_model_converted_after_the_move_is_close():
    """``.to(torch.bfloat16)`` first, then convert: the new linears take bf16 from the weights."""
    result = llama_convert.run("bf16-first", steps=3)
    assert result.budget_ratio is not None and result.budget_ratio <= 1.0


def test_the_budget_catches_a_dropped_weight_gradient(monkeypatch):
    """With one layer's ``backward_dw()`` never run, the optimizer guard refuses the step, naming
    the layer and its weight; with the guard off (this test steps with the entry queued on
    purpose), the budget finds its gradient missing: named."""
    from splitgrad.reference.pending import optimizer_guard

    real = llama_convert.delayed_modules
    monkeypatch.setattr(llama_convert, "delayed_modules", lambda model: real(model)[1:])
    refused = r"splitgrad\.impl\.Linear \(pending_wgrad_count=1\): weight \(1 pending entry\)"
    with pytest.raises(RuntimeError, match=refused):
        llama_convert.run("bf16-first", steps=1)
    with optimizer_guard(False):
        with pytest.raises(AssertionError, match=r"step 0 model\.layers\.0\.self_attn\.q_proj\."):
            llama_convert.run("bf16-first", steps=1)


def test_the_budget_catches_a_gradient_five_percent_off(monkeypatch):
    """The ``model-training`` budget can fail on values: one layer's weight gradient scaled by
    1.05 (a dozen bf16 rounding steps) after its ``backward_dw()`` is outside it."""
    real = llama_convert.delayed_modules

    def with_a_wrong_layer(model):
        modules = real(model)
        down = model.get_submodule("model.layers.0.mlp.down_proj")
        if down in modules and not down._wgrad_hooks:  # the converted model, once
            down.register_wgrad_accumulation_and_reduce_hooks(lambda: down.weight.grad.mul_(1.05))
        return modules

    monkeypatch.setattr(llama_convert, "delayed_modules", with_a_wrong_layer)
    with pytest.raises(AssertionError, match=r"step 0 model\.layers\.0\.mlp\.down_proj\.weight"):
        llama_convert.run("bf16-first", steps=1)


@pytest.mark.parametrize(
    "mode",
    ["autocast", "bf16"],
)
def test_mixed_precision_training_is_close(mode):
    """Under ``torch.autocast`` (fp32 parameters) and after converting then moving the model to
    bfloat16: within the ``model-training`` budget against a float64 copy."""
    result = llama_convert.run(mode, steps=3)
    assert result.budget_ratio is not None and result.budget_ratio <= 1.0


def test_run_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="mode must be one of .* got 'fp16'"):
        llama_convert.run("fp16")


@pytest.mark.distributed
def test_zero_bubble_pipeline_losses_match_torchs_own_split():
    summary = llama_pipeline.run(steps=2, microbatches=4, timeout_s=180.0)
    assert summary["losses_bitwise"], (summary["splitgrad"]["losses"], summary["torch"]["losses"])
    assert summary["params_bitwise"], summary["params_differing"]
    for variant in llama_pipeline.VARIANTS:
        assert summary[variant]["actions"] == "FIW"
        assert summary[variant]["held_bytes"] > 0
    # The queued entries hold dy and x of each linear; torch's split keeps its whole graph.
    assert summary["splitgrad"]["held_bytes"] < summary["torch"]["held_bytes"]


def test_pipeline_rejects_too_few_micro_batches():
    with pytest.raises(ValueError, match="at least the 4 stages of the V, got 2"):
        llama_pipeline.run(microbatches=2)


def test_tensor_parallel_plan_on_converted_llama_is_bitwise():
    """examples/llama_tensor_parallel.py (SPEC §9): torchtitan's TP + SP plan of torch's DTensor
    styles on the converted, delayed Llama and on the torch.nn one: losses and every gradient
    bitwise equal for 2 AdamW steps on 2 gloo ranks, and within the tp-model budget of the
    float64 truth in one process."""
    import llama_tensor_parallel

    lines = llama_tensor_parallel.run(sequence_parallel=True, steps=2)
    assert lines[0].startswith("15 linears converted, plan on 2 ranks, sequence_parallel=True")
    assert lines[1].startswith("step 0:") and lines[1].endswith("21 gradients bitwise")
    assert float(lines[-1].rsplit(" ", 1)[1]) <= 1.0
