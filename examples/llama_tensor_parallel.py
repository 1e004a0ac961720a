"""Tensor and sequence parallelism on a model we did not write: a Hugging Face Llama, converted
with ``splitgrad.impl.convert_linears(..., delay_wgrad_compute=True)``, parallelized with
torch's own DTensor styles the way torchtitan's Llama plan does, and trained on 2 gloo ranks.

The plan (torchtitan's, with Hugging Face's module names): the embedding row-parallel with its
output sharded along the sequence; per layer the norms ``SequenceParallel``, ``q/k/v_proj`` and
``gate/up_proj`` ``ColwiseParallel``, ``o_proj`` and ``down_proj`` ``RowwiseParallel`` with
sequence-sharded outputs, ``PrepareModuleInput`` gathering the sequence in front of the attention
and the MLP; the final norm ``SequenceParallel``; ``lm_head`` column-parallel with a replicated
output. The same plan goes on the unconverted ``torch.nn`` model. Both train the same AdamW
steps; after each backward the converted model runs ``backward_dw()`` on every delayed module.

Checked on every rank, at every step:

* the converted model's loss and every gradient (gathered to a full tensor) bitwise equal to
  the ``torch.nn`` model's under the same plan (``rtol=0, atol=0``);
* at the first step, each gradient within the ``tp-model`` budget of the float64 truth (one
  process, no parallelism), relative to the error of the float32 model in one process.

Run it (needs the optional extra, ``pip install "splitgrad[model]"``)::

    python examples/llama_tensor_parallel.py           # sequence parallel on
    python examples/llama_tensor_parallel.py --no-sp   # tensor parallel only

It prints one line per step and the verdict, and exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import copy
import sys

import splitgrad.impl as impl
import torch
from splitgrad.distributed import run_ranks
from splitgrad.properties.budgets import ErrorBudget, check_bitwise, check_error_budget
from transformers import LlamaConfig, LlamaForCausalLM

#: A tensor-parallel model's gradient against the float64 truth of one process.
TP_MODEL = ErrorBudget(
    kind="tp-model",
    multiplier=2.0,
    floor_steps=2.0,
    why=(
        "the parallel model sums each row-parallel output and each column-parallel input "
        "gradient as per-rank partial sums added by the collective, and the sequence-parallel "
        "norms' weight gradients as per-rank partial sums added by DTensor's reduction: each "
        "such sum rounds in an order of its own, on top of the same GEMM roundings the model "
        "in one process makes, hence up to twice that model's error; the floor (two float32 "
        "steps at the gradient's size) covers a gradient whose one-process error is near zero"
    ),
)

SEQ, BATCH, VOCAB = 8, 2, 64


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )


def apply_plan(model: LlamaForCausalLM, mesh, sequence_parallel: bool) -> LlamaForCausalLM:
    """torchtitan's Llama TP plan, with Hugging Face's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    sp = sequence_parallel
    if sp:
        parallelize_module(
            model,
            mesh,
            {
                "model.embed_tokens": RowwiseParallel(
                    input_layouts=Replicate(), output_layouts=Shard(1)
                ),
                "model.norm": SequenceParallel(),
                "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
            },
        )
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
        }
        if sp:
            plan.update(
                {
                    "input_layernorm": SequenceParallel(),
                    "post_attention_layernorm": SequenceParallel(),
                    # Hugging Face calls the attention with keyword arguments.
                    "self_attn": PrepareModuleInput(
                        input_kwarg_layouts={"hidden_states": Shard(1)},
                        desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    ),
                    "mlp": PrepareModuleInput(
                        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                    ),
                }
            )
        parallelize_module(layer, mesh, plan)
    return model


def _full(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad


def _step(model, ids, optimizer=None) -> tuple[torch.Tensor, dict]:
    """One training step: loss, backward, every queued W step, the gradients (full tensors)."""
    # Positions given explicitly: under SP the embedding's output holds a slice of the sequence,
    # from which Hugging Face would derive positions for that slice only.
    loss = model(ids, labels=ids, position_ids=torch.arange(ids.shape[1])[None]).loss
    loss.backward()
    for module in model.modules():
        while getattr(module, "pending_wgrad_count", 0):
            module.backward_dw()
    grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _rank(rank: int, world: int, sequence_parallel: bool, steps: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    base = LlamaForCausalLM(_config())
    one_process = copy.deepcopy(base)  # float32, no parallelism: the naive error
    truth = copy.deepcopy(base).double()  # float64, no parallelism: the truth
    converted = copy.deepcopy(base)
    impl.convert_linears(converted, delay_wgrad_compute=True)
    n = sum(isinstance(m, impl.Linear) for m in converted.modules())
    mesh = init_device_mesh("cpu", (world,))
    apply_plan(base, mesh, sequence_parallel)
    apply_plan(converted, mesh, sequence_parallel)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (base, converted)]
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    lines = [f"{n} linears converted, plan on {world} ranks, sequence_parallel={sequence_parallel}"]
    worst = 0.0
    for step in range(steps):
        if step == 0:
            _, naive = _step(one_process, ids)
            _, exact = _step(truth, ids)
        (loss_a, grads_a), (loss_b, grads_b) = (
            _step(m, ids, o) for m, o in zip((base, converted), opts)
        )
        check_bitwise(f"step {step} loss", loss_b, loss_a)
        for name in grads_a:
            check_bitwise(f"step {step} {name}.grad", grads_b[name], grads_a[name])
            if step == 0:
                worst = max(
                    worst,
                    check_error_budget(
                        f"{name}.grad", grads_b[name], exact[name], naive[name], TP_MODEL
                    ),
                )
        lines.append(f"step {step}: loss {loss_b.item():.6f}, {len(grads_a)} gradients bitwise")
    lines.append(f"worst gradient error / tp-model budget against one process: {worst:.3f}")
    return lines


def run(sequence_parallel: bool = True, steps: int = 2, world: int = 2) -> list[str]:
    """Every rank's lines (the checks raise on failure)."""
    return run_ranks(_rank, world, sequence_parallel, steps, timeout_s=300)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-sp", action="store_true", help="tensor parallel only")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        lines = run(not args.no_sp, args.steps)
    except Exception as e:  # a failed check on a rank arrives as RankFailure
        print(f"FAILED: {e}")
        return 1
    print("\n".join(lines))
    print("converted and delayed: bitwise the torch.nn model under the same plan: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
