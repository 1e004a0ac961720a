"""Tensor and sequence parallelism (SPEC §9): the options, their validation, the per-rank shapes
and the parameter attributes — the contract both packages share (API, not math: each package
writes its own collectives).

Options, TransformerEngine's, on ``Linear``, ``LayerNormLinear`` and ``LayerNormMLP``:

* ``tp_group``: the process group of the tensor-parallel ranks (``None``: no communication).
* ``tp_size``: taken from ``tp_group`` when one is given (a different value is refused);
  without a group it only sets shapes (``GroupedLinear``), or must be 1 on a module that would
  communicate.
* ``parallel_mode``: ``None``, ``"column"`` (the rank holds rows ``r`` of ``weight``
  ``[out, in]`` and of ``bias``; its output is its slice of the output features) or ``"row"``
  (the rank holds columns ``r`` of ``weight``; its input is its slice of the input features;
  ``bias`` is whole and added after the output is reduced). ``LayerNormMLP`` takes
  ``set_parallel_mode=True`` instead: fc1 column, fc2 row.
* ``sequence_parallel``: the activations outside the layer are split along dim 0 (the sequence,
  in the sequence-first layout ``(seq, batch, features)``): a column layer all-gathers its
  input, a row layer reduce-scatters its output instead of all-reducing it.
* ``wgrad_gather`` (splitgrad's): where a delayed entry gets the full-sequence operand of its
  wgrad GEMM under SP (the input of a column layer, ``dy`` of a row layer): ``"backward"``
  (TransformerEngine's: gathered in ``backward()``, held by the entry) or ``"backward_dw"``
  (the entry holds the shard and gathers inside ``backward_dw()``: ``tp`` times less memory
  from B to W, at the price of a collective in W, so every rank must run its ``backward_dw()``
  calls in the same order).

With a TP size of 1 the options change nothing. ``in_features`` / ``out_features`` (and
``hidden_size`` / ``ffn_hidden_size``) are given as the global sizes. As in TransformerEngine,
after the constructor a ``Linear``'s and ``LayerNormLinear``'s ``in_features`` /
``out_features`` attributes are the rank's sizes (what its input and output hold);
``LayerNormMLP`` keeps ``ffn_hidden_size`` global and has ``size_per_partition``.
``LayerNormLinear`` with ``parallel_mode="row"`` is refused: a norm needs every feature of a
token, and a row-parallel layer's input holds a slice of them (use column, or a norm followed by
a row-parallel ``Linear``).

Parameter attributes (Megatron's): the sharded weights and column biases carry
``tensor_model_parallel=True``, ``partition_dim`` (0 column, 1 row) and ``partition_stride=1``.
Under SP the replicated parameters whose gradient is a per-rank partial sum — the row bias,
``layer_norm_weight``, ``layer_norm_bias``, ``LayerNormMLP``'s ``fc2_bias`` — carry
``sequence_parallel=True``; ``splitgrad.distributed.allreduce_sequence_parallel_grads`` sums
them over the group.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import torch.distributed as dist

__all__ = [
    "PARALLEL_MODES",
    "WGRAD_GATHERS",
    "TensorParallel",
    "resolve_tensor_parallel",
    "divide",
    "mark_parallel_parameter",
    "check_sequence_split",
    "check_tp_forward",
    "check_tp_backward",
    "output_shape",
    "serial_number",
    "check_gather_order",
]

PARALLEL_MODES = (None, "column", "row")
WGRAD_GATHERS = ("backward", "backward_dw")


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """The resolved TP options of one module; a module holds one only when it communicates
    (``size > 1`` and a parallel mode), as ``module._tp`` (``None`` otherwise)."""

    group: object
    size: int
    rank: int
    sequence_parallel: bool
    wgrad_gather: str

    @property
    def gather_in_backward_dw(self) -> bool:
        """The entry keeps the shard and gathers inside ``backward_dw()``."""
        return self.sequence_parallel and self.wgrad_gather == "backward_dw"


def divide(name: str, size: int, tp_size: int) -> int:
    """``size // tp_size``, or ``ValueError`` naming ``name`` when it does not divide."""
    if size % tp_size:
        raise ValueError(f"{name}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size


def _group_size_and_rank(tp_group: object) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"tp_group={tp_group!r} was given but torch.distributed is not initialized"
        )
    try:
        size = dist.get_world_size(tp_group)
        rank = dist.get_rank(tp_group)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"tp_group={tp_group!r} is not a usable process group: {e}") from None
    if rank < 0:
        raise ValueError(
            f"tp_group={tp_group!r} does not contain this process (global rank "
            f"{dist.get_rank()}): a TP module is built only on the ranks of its group"
        )
    return size, rank


def resolve_tensor_parallel(
    *,
    tp_group: object,
    tp_size: object,
    parallel_mode: object,
    sequence_parallel: object,
    wgrad_gather: object,
    communicates: bool = True,
) -> tuple[int, str | None, bool, TensorParallel | None]:
    """Validate the TP options (SPEC §9, before any collective): ``(tp_size, parallel_mode,
    sequence_parallel, tp)`` where ``sequence_parallel`` is in effect only at ``tp_size > 1``
    and ``tp`` is the :class:`TensorParallel` of a module that communicates (``None``
    otherwise). ``communicates=False``: ``GroupedLinear``, whose options set shapes only."""
    from .contract import check_flag

    if parallel_mode not in PARALLEL_MODES:
        raise ValueError(f"parallel_mode must be one of {PARALLEL_MODES}, got {parallel_mode!r}")
    if wgrad_gather not in WGRAD_GATHERS:
        raise ValueError(f"wgrad_gather must be one of {WGRAD_GATHERS}, got {wgrad_gather!r}")
    sp = check_flag("sequence_parallel", sequence_parallel)
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    rank = 0
    if tp_group is not None:
        size, rank = _group_size_and_rank(tp_group)
        if tp_size not in (1, size):
            raise ValueError(
                f"tp_size={tp_size} differs from the size of tp_group ({size}); leave tp_size "
                "out when a group is given"
            )
        tp_size = size
    sp = sp and tp_size > 1
    if tp_size == 1 or parallel_mode is None:
        if sp:
            raise ValueError(
                "sequence_parallel=True with parallel_mode=None at tp_size="
                f"{tp_size}: only a column or row layer gathers or scatters the sequence"
            )
        return tp_size, parallel_mode, False, None
    if not communicates:
        return tp_size, parallel_mode, sp, None
    if tp_group is None:
        raise ValueError(
            f"tp_size={tp_size} with parallel_mode={parallel_mode!r} needs a tp_group: the "
            "layer communicates over it"
        )
    return tp_size, parallel_mode, sp, TensorParallel(tp_group, tp_size, rank, sp, wgrad_gather)


def mark_parallel_parameter(param: torch.Tensor, partition_dim: int | None, sp: bool) -> None:
    """Megatron's attributes on one parameter: sharded along ``partition_dim`` (``None``: not
    sharded), and ``sequence_parallel`` when its gradient is a per-rank partial sum under SP."""
    if partition_dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = partition_dim
        param.partition_stride = 1
    if sp:
        param.sequence_parallel = True


def check_tp_forward(
    module: torch.nn.Module, inp: torch.Tensor, recipe: object, scatters: bool
) -> None:
    """What a TP module's forward checks before any collective (``module._tp`` is set): no
    ``torch.func`` transform, and :func:`check_sequence_split` under SP."""
    from ._torch_private import functorch_active

    if functorch_active():
        raise RuntimeError(_not_differentiable(module, "run under a torch.func transform"))
    tp = module._tp
    if not tp.sequence_parallel:
        return
    check_sequence_split(module, inp, scatters)


def check_tp_backward(module: torch.nn.Module) -> None:
    """At the start of a TP module's backward: a backward that is differentiated itself
    (``create_graph=True``) is refused, naming the module."""
    from .routing import differentiated

    if differentiated():
        raise RuntimeError(_not_differentiable(module, "be differentiated twice"))


def _not_differentiable(module: torch.nn.Module, what: str) -> str:
    from .contract import qualified_name

    return (
        f"{qualified_name(module)} with tensor parallelism (tp_size={module.tp_size}) cannot "
        f"{what}: its collectives are outside autograd"
    )


def output_shape(
    inp: torch.Tensor, features: int, tp: TensorParallel | None, sp_rows: str
) -> tuple:
    """The shape of a module's output with ``features`` features for input ``inp``: ``inp``'s
    leading dimensions, with dim 0 times ``tp.size`` when SP gathered the rows (``sp_rows ==
    "gather"``, a column layer) or divided by it when SP scattered them (``"scatter"``, a row
    layer); unchanged otherwise (``""``)."""
    if inp.dim() == 1:
        return (features,)
    dim0 = inp.shape[0]
    if tp is not None and tp.sequence_parallel:
        if sp_rows == "gather":
            dim0 *= tp.size
        elif sp_rows == "scatter":
            dim0 //= tp.size
    return (dim0, *inp.shape[1:-1], features)


def check_sequence_split(module: torch.nn.Module, inp: torch.Tensor, scatters: bool) -> None:
    """Under SP, before any collective: ``inp`` needs a dim 0 (the sequence) besides its
    features, and a layer that reduce-scatters its output along dim 0 (``scatters``) needs that
    size to be a multiple of ``tp_size`` (``ValueError`` naming it)."""
    tp = module._tp
    if inp.dim() < 2:
        raise ValueError(
            f"{type(module).__name__} with sequence_parallel=True needs an input with a "
            f"sequence dimension 0, got shape {tuple(inp.shape)}"
        )
    if scatters and inp.shape[0] % tp.size:
        raise ValueError(
            f"{type(module).__name__} with sequence_parallel=True reduce-scatters its output "
            f"along dim 0, whose size {inp.shape[0]} is not divisible by tp_size={tp.size}"
        )


# One counter per TP group (by its ranks): every rank builds its model's modules in the same
# order, so the n-th TP module built on a group has the same number on every rank.
_SERIALS: dict[tuple[int, ...], itertools.count] = {}


def serial_number(group: object) -> int:
    """The next TP module's number on ``group``: the same on every rank of it."""
    key = tuple(dist.get_process_group_ranks(group))
    return next(_SERIALS.setdefault(key, itertools.count()))


def check_gather_order(module: torch.nn.Module, device: torch.device, all_gather) -> None:
    """Inside ``backward_dw()`` with ``wgrad_gather="backward_dw"``, before gathering a shard:
    every rank must be gathering for the same module and the same entry, or the gather would
    pair one module's shard with another's (a wrong gradient when the shapes agree, a hang or
    an error when they do not). Each rank's (module number, gather count) is all-gathered —
    one 16-byte collective — and a difference raises ``RuntimeError`` naming both on every
    rank, before the shard's collective and before anything is written (the entry stays
    queued). ``all_gather(out, inp, group)``: the package's all-gather."""
    tp = module._tp
    done = module._w_gathers
    module._w_gathers = done + 1
    tag = torch.tensor([module._tp_serial, done], dtype=torch.int64, device=device)
    tags = torch.empty(2 * tp.size, dtype=torch.int64, device=device)
    all_gather(tags, tag, group=tp.group)
    tags = tags.view(tp.size, 2).tolist()
    if all(t == tags[tp.rank] for t in tags):
        return
    module._w_gathers = done  # this gather did not happen
    others = ", ".join(
        f"rank {r}: module #{s} gather #{n}" for r, (s, n) in enumerate(tags) if r != tp.rank
    )
    raise RuntimeError(
        f"{type(module).__name__} (TP module #{module._tp_serial} of its group) with "
        f"wgrad_gather='backward_dw': this rank (rank {tp.rank} of the group) gathers for its "
        f"gather #{done} inside backward_dw(), but the other ranks are at {others}. Every rank "
        "of the TP group must run its backward_dw() calls in the same order; nothing was "
        "written and the entry stays queued"
    )
