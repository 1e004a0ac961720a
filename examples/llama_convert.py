"""Convert a Hugging Face Llama to splitgrad and train it: the same model, bit for bit.

A tiny ``transformers.LlamaForCausalLM`` (attention, RMSNorm, SiLU-gated MLP, ``lm_head`` tied to
the embedding, ``torch.nn.Linear`` everywhere) is copied; the copy goes through
``splitgrad.impl.convert_linears(copy, delay_wgrad_compute=True)``, so each of its linears
computes only the input gradient in ``backward()`` and queues the weight gradient for
``backward_dw()``. Both models then train the same steps with AdamW, the copy running
``backward_dw()`` on every delayed module after each backward. In float32 every parameter of the
two must end bitwise equal.

Three mixed-precision modes judge "close" instead, by the harness' tier-2 rule: at every step,
each parameter's gradient is compared with the float64 gradient at the same parameters and batch
(a float64 ``torch.nn`` copy loaded with the model's current state dict), and the converted
model's error may be at most :data:`MODEL_TRAINING`'s multiple of torch.nn's own error in the same
precision, plus a floor. (Parameters after AdamW steps would be a poor yardstick: AdamW turns a
gradient's rounding noise into whole ``lr``-sized steps.) The modes:

* ``autocast``: float32 parameters, forward under ``torch.autocast("cpu", torch.bfloat16)``;
* ``bf16``: converted in float32, then the whole model moved with ``.to(torch.bfloat16)``;
* ``bf16-first``: moved to bfloat16 first, then converted (the new linears take their dtype from
  the weights they keep).

Run it (needs the optional extra, ``pip install "splitgrad[model]"``)::

    python examples/llama_convert.py                 # float32, bitwise
    python examples/llama_convert.py --mode autocast
    python examples/llama_convert.py --mode bf16

It prints one line per step and the verdict, and exits non-zero when the check fails.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import sys

import splitgrad.impl as impl
import torch
from splitgrad.properties.budgets import ErrorBudget, check_bitwise, check_error_budget
from transformers import LlamaConfig, LlamaForCausalLM

MODES = ("fp32", "autocast", "bf16", "bf16-first")

#: Mixed-precision training of a whole model, judged per parameter after the last step.
MODEL_TRAINING = ErrorBudget(
    kind="model-training",
    multiplier=2.0,
    floor_steps=2.0,
    why=(
        "both models run every GEMM in bfloat16 and round its operands at the same points (the "
        "autocast policy, or bf16 parameters); a GEMM whose reduction runs in another order, or a "
        "gradient accumulated in another order (tied weights: the embedding's and lm_head's "
        "contributions), changes the error by about its own size, hence twice torch.nn's error; "
        "the floor of two bf16 rounding steps at the gradient's size covers a tensor whose "
        "torch.nn error happens to be near zero"
    ),
)


def tiny_llama(layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A small ``LlamaForCausalLM`` with tied embeddings, in float32, seeded."""
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def token_batches(model: LlamaForCausalLM, steps: int, batch: int = 2, seq: int = 12):
    """``steps`` seeded batches of token ids."""
    gen = torch.Generator().manual_seed(1234)
    vocab = model.config.vocab_size
    return [torch.randint(0, vocab, (batch, seq), generator=gen) for _ in range(steps)]


def delayed_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that queue their weight gradients for ``backward_dw()``."""
    return [m for m in model.modules() if isinstance(m, impl.Linear) and m.need_backward_dw()]


def train(model: torch.nn.Module, batches, *, autocast: bool = False, on_grads=None) -> list[float]:
    """AdamW steps on ``batches``; after each backward, ``backward_dw()`` on every delayed
    module, then ``on_grads(ids)`` if given (the gradients are final there). Returns the
    losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    delayed = delayed_modules(model)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for module in delayed:
            module.backward_dw()
        left = {type(m).__name__: m.pending_wgrad_count for m in delayed if m.pending_wgrad_count}
        if left:
            raise RuntimeError(f"weight-gradient entries left after backward_dw(): {left}")
        if on_grads is not None:
            on_grads(ids)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


@dataclasses.dataclass
class Result:
    """What :func:`run` found: per-step losses of both models and the verdict."""

    mode: str
    steps: int
    converted: int
    torch_losses: list[float]
    splitgrad_losses: list[float]
    bitwise: bool
    #: worst error / budget over the parameters (``None`` in float32: the check is bitwise)
    budget_ratio: float | None

    def lines(self) -> list[str]:
        out = [
            f"tiny Llama, {self.converted} linears converted to splitgrad.impl.Linear"
            f"(delay_wgrad_compute=True), mode {self.mode}, {self.steps} AdamW steps"
        ]
        for i, (a, b) in enumerate(zip(self.torch_losses, self.splitgrad_losses)):
            out.append(f"  step {i}: loss torch.nn {a:.8f}  splitgrad {b:.8f}")
        if self.budget_ratio is not None:
            out.append(
                f"every step's gradients against float64: within the {MODEL_TRAINING.kind} "
                f"budget (worst error / budget {self.budget_ratio:.3f}): OK"
            )
        if self.bitwise:
            out.append("every parameter bitwise equal to the unconverted model: OK")
        else:
            out.append("parameters differ from the unconverted model's (not bitwise)")
        return out


def _bitwise(model: torch.nn.Module, other: torch.nn.Module) -> bool:
    try:
        for (name, p), q in zip(model.named_parameters(), other.parameters(), strict=True):
            check_bitwise(name, p, q)
    except AssertionError:
        return False
    return True


class _GradientRecorder:
    """Each step's gradients of ``model`` and the float64 gradients at the same parameters."""

    def __init__(self, model: torch.nn.Module, truth: torch.nn.Module) -> None:
        self.model, self.truth = model, truth
        self.steps: list[dict[str, tuple[torch.Tensor | None, torch.Tensor | None]]] = []

    def __call__(self, ids: torch.Tensor) -> None:
        state = {k: v.double() for k, v in self.model.state_dict().items()}
        self.truth.load_state_dict(state)
        self.truth.zero_grad(set_to_none=True)
        self.truth(input_ids=ids, labels=ids).loss.backward()
        exact = dict(self.truth.named_parameters())
        self.steps.append(
            {
                name: (None if p.grad is None else p.grad.detach().clone(), exact[name].grad)
                for name, p in self.model.named_parameters()
            }
        )


def run(mode: str = "fp32", steps: int = 3, layers: int = 2) -> Result:
    """Build, copy, convert and train both; raise ``AssertionError`` (naming the parameter)
    when the converted model is not bitwise equal (fp32) or a gradient is not within budget."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    reference = tiny_llama(layers)
    model = copy.deepcopy(reference)
    truth = copy.deepcopy(reference).double()
    if mode == "bf16-first":
        reference.to(torch.bfloat16)
        model.to(torch.bfloat16)
    impl.convert_linears(model, delay_wgrad_compute=True)
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        raise AssertionError("convert_linears untied lm_head from the embedding")
    if mode == "bf16":
        reference.to(torch.bfloat16)
        model.to(torch.bfloat16)
    batches = token_batches(reference, steps)
    autocast = mode == "autocast"
    mixed = mode != "fp32"
    ours, theirs = _GradientRecorder(model, truth), _GradientRecorder(reference, truth)
    torch_losses = train(reference, batches, autocast=autocast, on_grads=theirs if mixed else None)
    splitgrad_losses = train(model, batches, autocast=autocast, on_grads=ours if mixed else None)
    converted = len(delayed_modules(model))
    if not mixed:
        pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
        for (name, p), q in pairs:
            check_bitwise(name, p, q)
        return Result(mode, steps, converted, torch_losses, splitgrad_losses, True, None)
    worst = 0.0
    for step, (mine, naive) in enumerate(zip(ours.steps, theirs.steps, strict=True)):
        for name, (grad, exact) in mine.items():
            naive_grad, naive_exact = naive[name]
            naive_error = float((naive_grad.double() - naive_exact).abs().max())
            ratio = check_error_budget(
                f"step {step} {name}.grad",
                grad,
                exact,
                naive_grad,
                MODEL_TRAINING,
                dtype=torch.bfloat16,
                module_dtype=torch.bfloat16,
                naive_error=naive_error,
            )
            worst = max(worst, ratio)
    bitwise = _bitwise(model, reference)
    return Result(mode, steps, converted, torch_losses, splitgrad_losses, bitwise, worst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=MODES, default="fp32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        result = run(args.mode, args.steps, args.layers)
    except AssertionError as exc:
        print(f"FAILED ({args.mode}): {exc}")
        return 1
    print("\n".join(result.lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
