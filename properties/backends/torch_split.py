"""``torch-split``: PyTorch's generic split backward (``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``) on plain ``torch.nn`` twins of the
splitgrad modules, and what it does differently from SPEC.md."""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib
from collections.abc import Callable, Sequence

import torch

from ..cases.case import GATED, Case, ModuleConfig
from ..cases.data import param_specs
from ..cases.variants import PartialBackward
from .protocol import Backend, BackendUnavailable, Deviation, delayed_p18


def _twin_norm(
    config: ModuleConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """LayerNorm/RMSNorm forward with TE's parameterisation, in torch.nn.functional."""
    if config.zero_centered_gamma:
        if x.dtype in (torch.bfloat16, torch.float16):
            # gamma = 1 + stored in fp32 (as TE and the reference), not rounded to bf16; torch's
            # CPU norms accept fp32 affine parameters next to a bf16/fp16 input.
            weight, bias = weight.float(), None if bias is None else bias.float()
        weight = weight + 1
    k = (config.in_features,)
    if config.normalization == "LayerNorm":
        return torch.nn.functional.layer_norm(x, k, weight, bias, eps=1e-5)
    return torch.nn.functional.rms_norm(x, k, weight, eps=1e-5)


def _activation(name: str, h: torch.Tensor) -> torch.Tensor:
    fn = {
        "gelu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "geglu": lambda a: torch.nn.functional.gelu(a, approximate="tanh"),
        "relu": torch.nn.functional.relu,
        "swiglu": torch.nn.functional.silu,
    }[name]
    if name in GATED:
        a, b = h.chunk(2, dim=-1)
        return fn(a) * b
    return fn(h)


class TorchTwin(torch.nn.Module):
    """A plain ``torch.nn`` module equal to ``config``'s splitgrad module, parameters under the
    TransformerEngine names, built from ``torch.nn.functional`` only."""

    def __init__(self, config: ModuleConfig) -> None:
        super().__init__()
        self.config = config
        for spec in param_specs(config):
            p = torch.zeros(spec.shape, dtype=config.torch_dtype, device=config.device)
            self.register_parameter(spec.name, torch.nn.Parameter(p))

    def forward(self, x: torch.Tensor, m_splits: Sequence[int] | None = None) -> torch.Tensor:
        c = self.config
        lin = torch.nn.functional.linear
        if c.kind == "GroupedLinear":
            rows = x.reshape(-1, c.in_features)
            parts = [
                lin(xi, getattr(self, f"weight{i}"), getattr(self, f"bias{i}", None))
                for i, xi in enumerate(rows.split(list(m_splits or ())))
            ]
            return torch.cat(parts, dim=0) if parts else rows.new_zeros(0, c.out_features)
        if c.has_norm:
            x = _twin_norm(c, x, self.layer_norm_weight, getattr(self, "layer_norm_bias", None))
        if c.kind == "LayerNormMLP":
            h = lin(x, self.fc1_weight, getattr(self, "fc1_bias", None))
            y = lin(_activation(c.activation, h), self.fc2_weight, getattr(self, "fc2_bias", None))
        else:
            y = lin(x, self.weight, getattr(self, "bias", None))
        # stage_backward_input detach_()es the stage outputs, which torch refuses for views
        # (F.linear on a 3-D input returns one); a pipeline stage would hand over a copy too.
        return y.clone() if y._is_view() else y


@dataclasses.dataclass
class TorchSplitHandle:
    """A twin plus what the adapter keeps for the split: inputs seen since the last backward,
    the FIFO of ``param_groups`` from ``stage_backward_input``, and the hooks."""

    twin: TorchTwin
    delay: bool
    inputs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    hooks: list[Callable[[], None]] = dataclasses.field(default_factory=list)
    routes: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


_NORM_KINDS = ("LayerNormLinear", "LayerNormMLP")
_PIPELINING = "torch.distributed.pipelining._backward"

# P18 under delay: what stage_backward_input / stage_backward_weight do with substituted,
# parametrized and hooked parameters and with a second backward. They come first: a delayed
# substitution's failure may also be over a budget, which a budget deviation would claim.
_P18 = (
    delayed_p18(
        "functional_call",
        "leaves substituted by torch.func.functional_call never get their gradient under "
        "delay: stage_backward_input / stage_backward_weight are handed the stage module's "
        "own parameters() (as a PipelineStage hands them), and the substituted leaves are "
        "not among them",
        _PIPELINING,
        strict=True,
    ),
    delayed_p18(
        "parametrize",
        "under delay a parametrized weight's original waits for stage_backward_weight like "
        "every parameter: original.grad is not there after backward() and an entry is "
        "queued for it (SPEC §3: a weight that is not a leaf gets its gradient during "
        "backward, nothing queued)",
        _PIPELINING,
    ),
    Deviation(
        "P18",
        "norm-parameter gradients are deferred too, so their tensor hooks run in "
        "backward_dw() (stage_backward_weight) rather than in backward()",
        _PIPELINING,
        applies=lambda case: (
            case.delay
            and case.variant == "tensor_hook"
            and any(n.startswith("layer_norm_") for n in case.asked)
        ),
        matches="P18 tensor_hook (delay",
        strict=False,
    ),
    delayed_p18(
        "tensor_hook_wrong_size",
        "a W step that raises (a tensor hook returning a tensor of another size) has "
        "consumed its entry: the parameter groups are popped before stage_backward_weight "
        "runs them, as PipelineStage's backward_weight_one_chunk pops them",
        _PIPELINING,
    ),
    delayed_p18(
        "post_accumulate_hook",
        "post-accumulate hooks of deferred parameters never fire: stage_backward_weight "
        "takes their gradients with torch.autograd.grad and adds them into .grad itself, "
        "past autograd's accumulator (norm parameters, deferred too, never fire either)",
        _PIPELINING,
    ),
    delayed_p18(
        "grad_of_grad",
        "the backward of a penalty on gradients taken with create_graph=True goes through "
        "stage_backward_input / stage_backward_weight like any backward under delay: no "
        "stage input of that pass is left, and the second-order gradients are lost",
        _PIPELINING,
    ),
    Deviation(
        "P18",
        "torch.func.vmap and jacrev of the twin's LayerNorm fail inside torch ('expected "
        "scalar type BFloat16 but found Float'): with a zero-centred gamma the twin keeps "
        "gamma + 1 and beta in float32 next to a bf16/fp16 input, as TE does, which "
        "torch.nn.functional.layer_norm accepts on the CPU but its batching rule does not",
        "torch.nn.functional.layer_norm",
        applies=lambda case: (
            case.config.zero_centered_gamma
            and case.config.normalization == "LayerNorm"
            and case.config.dtype in ("bfloat16", "float16")
            and case.variant in ("func.vmap", "func.jacrev")
        ),
        matches="expected scalar type",
        kinds=_NORM_KINDS,
        strict=False,
    ),
    delayed_p18(
        "backward_create_graph",
        "stage_backward_input has no create_graph: under delay the gradients it writes carry "
        "no graph, so a second backward through them fails (no clear error naming the "
        "module)",
        _PIPELINING,
    ),
    delayed_p18(
        "tensor_hook_chain",
        "norm-parameter gradients are deferred too, so the tensor hooks chained on a norm "
        "parameter run in backward_dw() (stage_backward_weight) rather than in backward()",
        _PIPELINING,
    ),
    delayed_p18(
        "tensor_hook_kept",
        "stage_backward_weight stores the gradient torch.autograd.grad returned as .grad "
        "without a copy (weight.grad = dw): the tensor a weight's tensor hook was shown and "
        "kept becomes .grad, and the next micro-batch's weight.grad += dw changes it",
        _PIPELINING,
    ),
    delayed_p18(
        "post_accumulate_reduce",
        "post-accumulate hooks of deferred parameters never fire (stage_backward_weight adds "
        "into .grad past autograd's accumulator), so none runs before the module hooks",
        _PIPELINING,
    ),
    delayed_p18(
        "gradient_penalty",
        "the backward of a penalty on x's gradient goes through stage_backward_input / "
        "stage_backward_weight like any backward under delay: the second-order gradients "
        "of the parameters are lost",
        _PIPELINING,
    ),
)


def _delayed_norm(case: Case) -> bool:
    return case.config.has_norm and case.delay


#: A deviation of torch's split shown by the kinds with a norm in front.
_on_norms = functools.partial(Deviation, reference=_PIPELINING, kinds=_NORM_KINDS)

_NORMS = (
    *(
        _on_norms(
            pid,
            "norm-parameter gradients are deferred too: stage_backward_input computes input "
            "gradients only, every parameter (norm gamma/beta included) waits for "
            "stage_backward_weight",
            applies=_delayed_norm,
            matches="layer_norm_",
            strict=pid != "P17",
        )
        for pid in ("P2", "P5", "P6", "P17")
    ),
    *(
        Deviation(
            pid,
            "torch's CPU LayerNorm backward in bf16/fp16 (gamma and beta in the same low "
            "precision, zero-centred gamma + 1 rounded to it) has several times the "
            "reference's error on dx and dgamma (e.g. dx -0.115 vs truth -0.036 at "
            "in_features=3)",
            "torch.nn.functional.layer_norm",
            applies=lambda case: (
                case.config.has_norm and case.config.dtype in ("bfloat16", "float16")
            ),
            matches=tag,
            kinds=_NORM_KINDS,
            dtypes=("bfloat16", "float16"),
            strict=pid == "P2" and tag == "[dgrad budget]",
        )
        for pid in ("P2", "P4", "P5", "P6", "P7", "P8", "P17", "P18")
        for tag in ("[dgrad budget]", "[norm_grad budget]")
        + (("[second_order budget]",) if pid == "P18" else ())
    ),
    *(
        _on_norms(
            pid,
            "with every GEMM parameter frozen, the norm parameters' gradients still wait for "
            "stage_backward_weight: one entry is queued per backward (SPEC §4: none)",
            applies=lambda case: case.config.has_norm and bool(case.frozen),
            matches="pending_wgrad_count after ",
            strict=False,
        )
        for pid in ("P4", "P7")
    ),
)

_OTHERS = (
    Deviation(
        "P7",
        "one stage_backward_input call covers every use of the module in the graph: a "
        "weight used twice queues one entry, not two (the gradients themselves are checked "
        "first)",
        _PIPELINING,
        matches="pending_wgrad_count after one backward through two uses",
    ),
    _on_norms(
        "P7",
        "a module chained on itself (y = m(m(x))) with a norm in front cannot be split: "
        "stage_backward_weight fails with 'Trying to backward through the graph a second "
        "time'",
        applies=lambda case: case.variant == "tied-chain",
        matches="backward through the graph a second time",
        strict=False,
    ),
    _on_norms(
        "P11",
        "with a norm in front (torch.nn.functional.layer_norm / rms_norm), the input and "
        "saved activations of a micro-batch are still alive after stage_backward_weight",
        applies=_delayed_norm,
        matches="still alive",
        strict=False,
    ),
    Deviation(
        "P17",
        "backward(inputs=[parameters]) without a stage input, under delay: "
        "stage_backward_input builds its parameter groups from the stage inputs' "
        "gradients, so with none asked stage_backward_weight writes nothing and the asked "
        "parameters never get their gradient",
        _PIPELINING,
        applies=lambda case: (
            case.delay
            and isinstance(case.variant, PartialBackward)
            and case.variant.mode == "inputs"
            and "inp" not in case.asked
        ),
        matches="P17 inputs: ",
        strict=False,
    ),
    Deviation(
        "P10",
        "no input validation: a wrong last dimension, dtype, device or m_splits fails "
        "inside torch.nn.functional with RuntimeError, or not at all, instead of "
        "ValueError/TypeError naming expected and actual",
    ),
)

_PROTOCOL = (
    "the module is the adapter's own torch.nn twin (built with an explicit device and dtype, "
    "filled by load_state, views cloned), not torch's: where its parameters are created, "
    "reset_parameters, repr, output views and copies would check the adapter, not "
    "torch.distributed.pipelining's split"
)


class TorchSplitBackend(Backend):
    """``stage_backward_input`` / ``stage_backward_weight`` on :class:`TorchTwin` modules:
    ``backward()`` runs the first over every parameter of the twin (as a ``PipelineStage``
    does) and queues its ``param_groups``; ``backward_dw()`` runs the second on the oldest."""

    name = "torch-split"
    supports_fused = False
    notes = (
        "outputs that are views are cloned by the twin: stage_backward_input detach_()es stage "
        "outputs and fails on views",
        "the FIFO queue, pending_wgrad_count, the empty-queue RuntimeError and the hooks are "
        "supplied by the adapter (torch's split has none of them)",
        "fused wgrad accumulation (main_grad, is_first_microbatch) does not exist in torch.nn: "
        "fused configs and P8 are reported n/a",
        "P18's module-protocol kinds are n/a: " + _PROTOCOL,
    )
    deviations = (*_P18, *_NORMS, *_OTHERS)

    def module_protocol_reason(self) -> str | None:
        return _PROTOCOL

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module(_PIPELINING)
        except ImportError as exc:
            return f"torch {torch.__version__} has no {_PIPELINING} ({exc})"
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if config.recipe is not None or property_id == "P13":
            return "torch.nn modules have no FP8 recipes"
        if config.fuse_wgrad_accumulation or property_id == "P8":
            return "torch.nn has no fused wgrad accumulation into main_grad"
        if property_id == "P9":
            return "torch.nn has no ub_bulk_wgrad option"
        return super().unsupported_reason(property_id, config)

    def build(
        self, config: ModuleConfig, *, delay: bool, ub_bulk_wgrad: bool = False
    ) -> TorchSplitHandle:
        if config.fuse_wgrad_accumulation:
            raise BackendUnavailable("torch-split: fuse_wgrad_accumulation is not supported")
        return TorchSplitHandle(TorchTwin(config), delay)

    def parameters(self, module: TorchSplitHandle) -> dict[str, torch.nn.Parameter]:
        return dict(module.twin.named_parameters())

    def torch_module(self, module: TorchSplitHandle) -> torch.nn.Module:
        return module.twin

    def forward(self, module: TorchSplitHandle, x, m_splits, is_first_microbatch):
        # Stage inputs are leaves (a pipeline stage receives detached activations); an input
        # produced by this module itself (a chained, tied use) is part of the stage's graph.
        if x.grad_fn is None:
            module.inputs.append(x)
        elif x._base is not None and x._base.is_leaf and x.requires_grad:
            # A view of a leaf (P12 feeds the Linears torch.split views): the stage gets a
            # detached copy, and its input gradient is sent back through the view.
            leaf = x.detach().requires_grad_(True)
            module.inputs.append(leaf)
            module.routes.append((leaf, x))
            x = leaf
        return module.twin(x, m_splits)

    def backward(
        self, module: TorchSplitHandle, outputs, grads, inputs=None, create_graph=False
    ) -> None:
        stage_inputs, module.inputs = module.inputs, []
        routes, module.routes = module.routes, []
        weights = [p for p in module.twin.parameters() if p.requires_grad]
        if inputs is not None:
            # backward(inputs=...): only what is asked (a stage input, some parameters).
            asked = {id(t) for t in inputs}
            stage_inputs = [x for x in stage_inputs if id(x) in asked]
            weights = [p for p in weights if id(p) in asked]
        if not module.delay:
            torch.autograd.backward(
                list(outputs), list(grads), inputs=inputs, create_graph=create_graph
            )
            self._send_back(routes)
            params = self.parameters(module)
            gemm = self.gemm_weight_names(module) + self.gemm_bias_names(module)
            if any(id(params[n]) in {id(w) for w in weights} for n in gemm):
                self._run_hooks(module)
            return
        from torch.distributed.pipelining._backward import stage_backward_input

        # stage_backward_input has no create_graph: its gradients never carry a graph.
        _, param_groups = stage_backward_input(
            list(outputs), list(grads), stage_inputs, iter(weights)
        )
        self._send_back(routes)
        # Norm parameters wait for stage_backward_weight too: queue whenever any weight trains.
        if weights:
            module.queue.append((weights, param_groups))

    @staticmethod
    def _send_back(routes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for leaf, view in routes:
            if leaf.grad is not None:
                torch.autograd.backward([view], [leaf.grad])

    def grad(self, module: TorchSplitHandle, outputs, grads, inputs, create_graph=False):
        module.inputs, module.routes = [], []  # a partial backward consumes the stage inputs
        return super().grad(module, outputs, grads, inputs, create_graph)

    def backward_dw(self, module: TorchSplitHandle) -> None:
        if not module.delay:
            return
        if not module.queue:
            raise RuntimeError(
                "torch-split backward_dw(): nothing is pending (pending_wgrad_count=0)"
            )
        from torch.distributed.pipelining._backward import stage_backward_weight

        weights, param_groups = module.queue.popleft()
        stage_backward_weight(iter(weights), param_groups)
        del param_groups, weights
        self._run_hooks(module)

    @staticmethod
    def _run_hooks(module: TorchSplitHandle) -> None:
        for hook in list(module.hooks):
            hook()

    def pending_wgrad_count(self, module: TorchSplitHandle) -> int:
        return len(module.queue)

    def register_hook(self, module: TorchSplitHandle, fn: Callable[[], None]) -> None:
        module.hooks.append(fn)
