"""A Hugging Face Llama, converted to splitgrad, as 2 pipeline ranks under ScheduleZBVZeroBubble.

The tiny ``LlamaForCausalLM`` of :mod:`llama_convert` (4 decoder layers, ``lm_head`` tied to the
embedding) is cut into the 4 stages of a zero-bubble V on 2 gloo ranks:

    rank 0: stage 0 = embedding + layer 0     stage 3 = layer 3 + norm + lm_head (tied weight)
    rank 1: stage 1 = layer 1                 stage 2 = layer 2

It is trained twice in the same run, each step a ``schedule.step`` and an SGD step:

* **splitgrad**: every ``torch.nn.Linear`` converted with
  ``splitgrad.impl.convert_linears(model, delay_wgrad_compute=True)``; each stage is a
  ``PipelineStage(..., dw_builder=splitgrad.distributed.dw_builder(stage))``, so B runs the
  full backward (the linears queue their weight gradients) and W runs ``backward_dw()``;
* **torch**: the unconverted model (plain ``torch.nn.Linear``) on ``PipelineStage`` without a
  ``dw_builder``: torch's own split, ``stage_backward_input`` at B, ``stage_backward_weight``
  at W.

It prints, per variant, the loss of every step (and whether the two variants' losses and final
parameters are bitwise equal), the step time (median over the timed steps, slowest rank) and the
peak memory held between B and W (measured as ``splitgrad pipeline`` measures it:
:mod:`splitgrad.bench.actions`). Both stages of the tied weight live on rank 0, so the
embedding and ``lm_head`` share one ``Parameter`` there; the schedule is built with
``scale_grads=False`` (torch would divide that shared gradient once per stage) and the loss
divides by the number of micro-batches instead.

Run it (needs the optional extra, ``pip install "splitgrad[model]"``)::

    python examples/llama_pipeline.py [--steps 3] [--microbatches 4] [--timeout 300]

Ranks are spawned with :func:`splitgrad.distributed.run_ranks` (every collective has a timeout,
the whole run too): it fails, never hangs. Exit status 1 when the losses differ.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from splitgrad.bench.actions import ActionRecorder, held_between_b_and_w
from splitgrad.distributed import dw_builder, run_ranks

VARIANTS = ("splitgrad", "torch")
NUM_STAGES = 4  # a V on 2 ranks


class _Stage(torch.nn.Module):
    """One pipeline stage of a ``LlamaForCausalLM``: (embedding,) decoder layers, (norm,
    lm_head). Holds the model's own submodules, so tied weights stay tied."""

    def __init__(self, model, index: int, layers_per_stage: int) -> None:
        super().__init__()
        body = model.model
        first, last = index == 0, index == NUM_STAGES - 1
        start = index * layers_per_stage
        self.embed_tokens = body.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(body.layers[start : start + layers_per_stage])
        self.rotary_emb = body.rotary_emb
        self.norm = body.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.rotary_emb(h, positions)
        for layer in self.layers:
            # No mask: sdpa then runs causal (is_causal), as the whole model does without padding.
            out = layer(h, attention_mask=None, position_embeddings=rope, position_ids=positions)
            h = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def _stage_indices(rank: int) -> list[int]:
    return [rank, NUM_STAGES - 1 - rank]


def _variant(rank: int, variant: str, steps: int, n_mb: int, batch: int, seq: int) -> dict:
    """Train one variant on this rank; the per-step losses (rank 0: the last stage's), step
    times, the held B->W peak and the final parameters of this rank's stages."""
    import splitgrad.impl as impl
    from llama_convert import tiny_llama
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    model = tiny_llama(layers=NUM_STAGES, seed=0)
    if variant == "splitgrad":
        impl.convert_linears(model, delay_wgrad_compute=True)
    device = torch.device("cpu")
    stages, modules = [], {}
    recorder = ActionRecorder(device)
    for i in _stage_indices(rank):
        modules[i] = _Stage(model, i, model.config.num_hidden_layers // NUM_STAGES)
        extra = {"dw_builder": dw_builder(modules[i])} if variant == "splitgrad" else {}
        stage = PipelineStage(modules[i], i, NUM_STAGES, device, **extra)
        recorder.wrap(stage, i)
        stages.append(stage)

    def loss_fn(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        flat = logits[:, :-1].flatten(0, 1).float()
        return F.cross_entropy(flat, ids[:, 1:].flatten()) / n_mb

    schedule = ScheduleZBVZeroBubble(stages, n_mb, loss_fn=loss_fn, scale_grads=False)
    params = list({id(p): p for m in modules.values() for p in m.parameters()}.values())
    opt = torch.optim.SGD(params, lr=0.5)
    gen = torch.Generator().manual_seed(99)
    vocab = model.config.vocab_size
    data = [torch.randint(0, vocab, (n_mb * batch, seq), generator=gen) for _ in range(steps + 1)]

    def one_step(ids: torch.Tensor, memory: bool) -> tuple[list[float], float, list[dict]]:
        opt.zero_grad(set_to_none=True)
        dist.barrier()
        # next-token loss: the target is the input (rank 0 holds the first and the last stage)
        spans, wall, losses = recorder.step(schedule, ids, ids, memory=memory)
        opt.step()
        return [float(v.detach()) for v in losses], wall, spans

    losses, walls = [], []
    for k in range(steps):
        step_losses, wall, _ = one_step(data[k], memory=False)
        losses.append(step_losses)
        walls.append(wall)
    _, _, mem_spans = one_step(data[steps], memory=True)
    return {
        "losses": losses,
        "walls": walls[1:] or walls,  # the first step also infers shapes
        "held": held_between_b_and_w(mem_spans),
        "actions": "".join(k for k in "FBIW" if any(s["kind"] == k for s in mem_spans)),
        "params": {
            f"stage{i}.{name}": p.detach().clone()
            for i, m in modules.items()
            for name, p in m.named_parameters()
        },
    }


def _rank(rank: int, world: int, steps: int, n_mb: int, batch: int, seq: int) -> dict:
    if world != 2:
        raise ValueError(f"the V of this example needs 2 ranks, got {world}")
    torch.manual_seed(0)
    return {v: _variant(rank, v, steps, n_mb, batch, seq) for v in VARIANTS}


def run(
    steps: int = 3,
    microbatches: int = 4,
    batch: int = 1,
    seq: int = 12,
    timeout_s: float = 300.0,
) -> dict:
    """Both variants on 2 spawned gloo ranks; a summary per variant and the comparison."""
    if microbatches < NUM_STAGES:
        raise ValueError(
            f"microbatches must be at least the {NUM_STAGES} stages of the V, got {microbatches}"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    per_rank = run_ranks(
        _rank,
        2,
        steps,
        microbatches,
        batch,
        seq,
        timeout_s=timeout_s,
        collective_timeout_s=min(60.0, timeout_s),
    )
    summary = {}
    for v in VARIANTS:
        ranks = [r[v] for r in per_rank]
        walls = [max(r["walls"][k] for r in ranks) for k in range(len(ranks[0]["walls"]))]
        helds = [r["held"] for r in ranks if r["held"] is not None]
        summary[v] = {
            "losses": ranks[0]["losses"],
            "step_s": statistics.median(walls),
            "held_bytes": max(helds) if helds else None,
            "actions": ranks[0]["actions"],
        }
    a, b = (summary[v]["losses"] for v in VARIANTS)
    params = [per_rank[r]["splitgrad"]["params"] for r in range(2)]
    torch_params = [per_rank[r]["torch"]["params"] for r in range(2)]
    differing = [
        f"rank{r}.{name}"
        for r in range(2)
        for name, p in params[r].items()
        if not torch.equal(p, torch_params[r][name])
    ]
    summary["losses_bitwise"] = a == b
    summary["params_bitwise"] = not differing
    summary["params_differing"] = differing
    return summary


def _print(summary: dict, microbatches: int) -> None:
    print(
        f"tiny Llama ({NUM_STAGES} layers, tied lm_head) in {NUM_STAGES} stages on 2 gloo ranks, "
        f"ScheduleZBVZeroBubble, {microbatches} micro-batches, 1 thread per rank"
    )
    print(f"  {'variant':<11}{'actions':<9}{'step ms':>9}{'held B->W KiB':>15}  loss per step")
    for v in VARIANTS:
        s = summary[v]
        held = "-" if s["held_bytes"] is None else f"{s['held_bytes'] / 1024:.1f}"
        losses = " ".join(f"{sum(step):.8f}" for step in s["losses"])
        print(f"  {v:<11}{s['actions']:<9}{s['step_s'] * 1e3:>9.1f}{held:>15}  {losses}")
    print(
        f"  losses bitwise equal: {summary['losses_bitwise']}; final parameters bitwise equal: "
        f"{summary['params_bitwise']}"
        + (
            f" (differ: {', '.join(summary['params_differing'])})"
            if not summary["params_bitwise"]
            else ""
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    args = parser.parse_args(argv)
    summary = run(args.steps, args.microbatches, seq=args.seq, timeout_s=args.timeout)
    _print(summary, args.microbatches)
    return 0 if summary["losses_bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
