"""``transformer_engine``: TransformerEngine's modules (same API names as splitgrad's), its FP8
recipes mapped from splitgrad's by name, and what it does differently from SPEC.md."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
from collections.abc import Callable
from typing import Any

import torch

from ..cases.case import Case, ModuleConfig, make_recipe
from .library import LibraryBackend, keywords
from .protocol import Backend, BackendUnavailable, Deviation, delayed_p18


class RecipeMappingError(ValueError):
    """A splitgrad recipe (or one of its fields or values) has no counterpart in
    TransformerEngine's recipe module: the harness cannot say what to run, so it refuses."""


def to_transformer_engine_recipe(recipe: Any, te_recipe: Any) -> Any:
    """TransformerEngine's recipe for splitgrad's ``recipe`` (a dataclass of
    :mod:`splitgrad.reference.fp8`), built from ``te_recipe`` (the module
    ``transformer_engine.common.recipe``, passed in so the mapping runs without TE): the class
    of the same name, every field under its own name, enum values by member name
    (``Format.HYBRID`` -> ``te_recipe.Format.HYBRID``); TE's other fields keep TE's defaults.
    Raises :class:`RecipeMappingError` naming the class, field or value without a counterpart."""
    if not dataclasses.is_dataclass(recipe) or isinstance(recipe, type):
        raise RecipeMappingError(f"expected a splitgrad recipe instance, got {recipe!r}")
    name = type(recipe).__name__
    where = getattr(te_recipe, "__name__", "transformer_engine.common.recipe")
    te_cls = getattr(te_recipe, name, None)
    if te_cls is None:
        raise RecipeMappingError(f"{where} has no {name}: cannot run splitgrad's {recipe!r}")
    if dataclasses.is_dataclass(te_cls):
        accepted = frozenset(f.name for f in dataclasses.fields(te_cls) if f.init)
    else:
        accepted = keywords(te_cls)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(recipe):
        value = getattr(recipe, field.name)
        if accepted is not None and field.name not in accepted:
            raise RecipeMappingError(
                f"{name}.{field.name} (= {value!r}) has no counterpart in {where}.{name}, whose "
                f"fields are {', '.join(sorted(accepted))}"
            )
        if isinstance(value, enum.Enum):
            te_enum = getattr(te_recipe, type(value).__name__, None)
            members = getattr(te_enum, "__members__", {})
            if value.name not in members:
                raise RecipeMappingError(
                    f"{name}.{field.name} = {value!r}: {where} has no "
                    f"{type(value).__name__}.{value.name}"
                )
            value = members[value.name]
        kwargs[field.name] = value
    return te_cls(**kwargs)


_BACKWARD_DW = (
    "TransformerEngine transformer_engine/pytorch/module/base.py, "
    "TransformerEngineBaseModule.backward_dw"
)
_LINEAR_BACKWARD = "TransformerEngine transformer_engine/pytorch/module/linear.py, _Linear.backward"
_LINEAR_MODULE = (
    "TransformerEngine transformer_engine/pytorch/module/linear.py, Linear.__init__ and "
    "_Linear.forward"
)
_UNRUN = (
    "; read from TE's source, not yet run against TE (no GPU lent), so only the cases that show "
    "it are reported as a deviation"
)


def _unrun(
    summary: str, reference: str, applies: Callable[[Case], bool], matches: str
) -> Deviation:
    """A P18 deviation read from TE's source and never run against TE: non-strict."""
    return Deviation(
        "P18", summary + _UNRUN, reference, applies=applies, matches=matches, strict=False
    )


# P18 as TE's 2025 module/base.py and module/linear.py read: backward_dw() pops the queued
# wgrad and assigns it to the weight attribute's .grad; under delay _Linear.backward returns
# None for the weight (get_dummy_wgrad() when fused); its Functions have no setup_context.
_P18 = (
    delayed_p18(
        "functional_call",
        "under delay backward_dw() sets .grad on the module's own weight attribute as it is "
        "when backward_dw() runs (weight_tensor = noop_cat(self._get_weight_tensors()); "
        "weight_tensor.grad = wgrad), not on the tensor the forward used: a leaf substituted "
        "by torch.func.functional_call gets nothing, the module's own parameter gets its "
        "gradient (and .grad is overwritten, issue #3437)" + _UNRUN,
        _BACKWARD_DW,
    ),
    delayed_p18(
        "parametrize",
        "under delay a parametrized weight is queued like a Parameter (_Linear.backward "
        "returns None for it) and backward_dw() assigns .grad to the parametrization's output "
        "recomputed at that moment, a non-leaf: original.grad stays None" + _UNRUN,
        _BACKWARD_DW,
    ),
    _unrun(
        "under delay _Linear.backward returns None for the weight, so autograd's accumulator "
        "calls the weight's tensor hooks with None in backward() (a hook that computes with "
        "the gradient raises there), and backward_dw() writes .grad past the hooks: they "
        "never see or replace the gradient, and a hook returning a wrong size raises "
        "nothing",
        f"{_LINEAR_BACKWARD}; {_BACKWARD_DW}",
        lambda case: (
            case.delay
            and case.variant
            in ("tensor_hook", "tensor_hook_wrong_size", "tensor_hook_chain", "tensor_hook_kept")
        ),
        "P18 tensor_hook",
    ),
    delayed_p18(
        "post_accumulate_hook",
        "under delay a weight's post-accumulate hooks fire in backward() (autograd's "
        "accumulator runs on the None gradient _Linear.backward returns), before the "
        "deferred gradient exists, and not in backward_dw(), which sets .grad itself" + _UNRUN,
        f"{_LINEAR_BACKWARD}; {_BACKWARD_DW}",
    ),
    delayed_p18(
        "post_accumulate_reduce",
        "under delay a weight's post-accumulate hooks fire in backward(), not in "
        "backward_dw() before the module's wgrad-accumulation-and-reduce hooks: a reducer "
        "hook never sees what a post-accumulate hook made of the deferred gradient" + _UNRUN,
        f"{_LINEAR_BACKWARD}; {_BACKWARD_DW}",
    ),
    _unrun(
        "with fuse_wgrad_accumulation and a weight carrying grad_added_to_main_grad, "
        "_Linear.backward returns a placeholder from get_dummy_wgrad(): a tensor hook on the "
        "weight sees that placeholder instead of being refused, and its post-accumulate "
        "hooks fire on it in backward(), before a delayed main_grad write",
        _LINEAR_BACKWARD,
        lambda case: (
            case.config.fuse_wgrad_accumulation
            and case.variant in ("tensor_hook", "post_accumulate_hook")
        ),
        "P18 ",
    ),
    _unrun(
        "torch.func transforms fail inside torch ('In order to use an autograd.Function with "
        "functorch transforms ... it must override the setup_context staticmethod'), "
        "without naming the module: TE's autograd Functions (_Linear, _LayerNormLinear, "
        "_LayerNormMLP, _GroupedLinear) define forward(ctx, ...) and no setup_context",
        _LINEAR_BACKWARD,
        lambda case: case.variant.startswith("func."),
        "P18 func.",
    ),
    _unrun(
        "a double backward (create_graph=True) differentiates nothing of TE's backward: it "
        "runs TE's own GEMM and norm kernels, which autograd does not record, so the "
        "second-order terms are missing or the second backward fails inside torch, without "
        "naming the module (not confirmed: which of the two happens was not seen in the "
        "source)",
        _LINEAR_BACKWARD,
        lambda case: case.variant in ("grad_of_grad", "backward_create_graph", "gradient_penalty"),
        "P18 ",
    ),
    # Linear.__init__ takes device="cuda" and calls reset_parameters(defer_init=device ==
    # "meta"); _Linear.forward returns out.view(-1, *inp_shape[1:-1], out_features).
    _unrun(
        "the constructors default to device='cuda' rather than None: inside "
        '`with torch.device("meta")` or after torch.set_default_device(...), a module '
        "built without device= is created on CUDA (TE's own deferred initialization is "
        "device='meta', then reset_parameters())",
        _LINEAR_MODULE,
        lambda case: case.variant in ("module.placement", "module.reset_parameters"),
        "P18 module.",
    ),
    _unrun(
        "_Linear.forward returns out.view(-1, *inp_shape[1:-1], out_features): the output "
        "for a 2-D input is a view (DualPipe frees stage outputs in place and refuses "
        "views)",
        _LINEAR_MODULE,
        lambda case: case.variant == "module.output_not_view",
        "P18 module.output_not_view",
    ),
)


_RUN_NUMERICS = "TransformerEngine tests/pytorch/distributed/run_numerics.py"

#: P19's cases whose gradients TransformerEngine's own distributed tests never compare with the
#: single-process module ("gradients in other cases need additional synchronization"): its
#: outputs are checked there, its gradients are not checked by TE; P19 checks them.
#: (module, parallel mode, sequence parallel, where TE skips the gradient check)
TP_NOT_CHECKED_BY_TE = (
    (
        "Linear",
        "row",
        True,
        f"{_RUN_NUMERICS}, _test_linear: _check_gradients only if parallel_mode == 'column' "
        "or not sequence_parallel",
    ),
    (
        "LayerNormLinear",
        "column",
        True,
        f"{_RUN_NUMERICS}, _test_layernorm_linear: _check_gradients only if parallel_mode == "
        "'column' and not sequence_parallel",
    ),
    (
        "LayerNormMLP",
        "set_parallel_mode",
        True,
        f"{_RUN_NUMERICS}, _test_layernorm_mlp: _check_gradients only if not sequence_parallel",
    ),
)


def _plain_case(case: Case) -> bool:
    return not case.config.fuse_wgrad_accumulation


class TransformerEngineBackend(LibraryBackend):
    """``transformer_engine.pytorch`` (needs TE and a CUDA GPU); the pending count is read from
    TE's ``wgrad_store`` when it has no ``pending_wgrad_count``."""

    notes = (
        "pending_wgrad_count is read from TE's internal wgrad_store when TE lacks it",
        *(
            f"P19 {kind} {mode} with sequence parallel: gradients not checked by TE ({where})"
            for kind, mode, _, where in TP_NOT_CHECKED_BY_TE
        ),
    )
    deviations = (
        Deviation(
            "P4",
            "non-fused backward_dw() overwrites weight.grad instead of accumulating (a random "
            ".grad prefill or a second micro-batch is lost)",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P6",
            "non-fused backward_dw() overwrites weight.grad, so interleaved micro-batches lose "
            "all but the last contribution",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P7",
            "a weight used twice queues two entries whose non-fused backward_dw() overwrite "
            "each other",
            "TransformerEngine issue #3437",
            applies=_plain_case,
        ),
        Deviation(
            "P3",
            "the bias gradient is filled in backward_dw() only when bias.grad is still None",
            "TransformerEngine issue #3400",
            applies=lambda case: case.config.bias,
        ),
        Deviation(
            "P10",
            "backward_dw() on an empty GroupedLinear queue returns silently instead of raising",
            "SPEC.md §4",
            applies=lambda case: case.config.kind == "GroupedLinear",
        ),
        *_P18,
    )

    #: TE's own probe of the GPU for each recipe class (``transformer_engine.pytorch.fp8``),
    #: each returning ``(supported, reason)``.
    _SUPPORT_PROBES = {
        "DelayedScaling": "check_fp8_support",
        "Float8CurrentScaling": "check_fp8_support",
        "MXFP8BlockScaling": "check_mxfp8_support",
        "Float8BlockScaling": "check_fp8_block_scaling_support",
    }

    def __init__(self) -> None:
        super().__init__("transformer_engine", "transformer_engine.pytorch")

    def unavailable_reason(self) -> str | None:
        try:
            importlib.import_module("transformer_engine.pytorch")
        except Exception as exc:  # TE raises assorted errors when its CUDA libs are missing
            return f"TransformerEngine is not importable here ({type(exc).__name__}: {exc})"
        if not torch.cuda.is_available():
            return "TransformerEngine needs a CUDA GPU; torch.cuda.is_available() is False"
        return None

    def unsupported_reason(self, property_id: str, config: ModuleConfig) -> str | None:
        if config.device != "cuda":
            return "TransformerEngine modules run on CUDA only"
        if property_id == "P13":
            try:
                self.fp8_quantizer()
            except BackendUnavailable as exc:
                return str(exc)
        if config.recipe is not None:
            why = self._fp8_support(config.recipe)
            if why:
                return why
        return Backend.unsupported_reason(self, property_id, config)

    def fp8_autocast(self, config: ModuleConfig) -> contextlib.AbstractContextManager:
        """TE's ``fp8_autocast`` with TE's own recipe, mapped by name from splitgrad's
        (:func:`to_transformer_engine_recipe`)."""
        if config.recipe is None:
            return contextlib.nullcontext()
        te_recipe = importlib.import_module("transformer_engine.common.recipe")
        recipe = to_transformer_engine_recipe(make_recipe(config.recipe), te_recipe)
        return self.lib.fp8_autocast(enabled=True, fp8_recipe=recipe)

    def _fp8_support(self, recipe_name: str) -> str | None:
        """Why TE cannot run ``recipe_name`` on this GPU (``None``: it can, or TE has no probe
        for it, in which case the cells run and show)."""
        cls = type(make_recipe(recipe_name)).__name__
        try:
            fp8 = importlib.import_module("transformer_engine.pytorch.fp8")
        except ImportError:
            return None
        probe = getattr(fp8, self._SUPPORT_PROBES.get(cls, ""), None)
        if probe is None:
            return None
        supported, reason = probe()
        return None if supported else f"TransformerEngine cannot run {cls} here: {reason}"

    def pending_wgrad_count(self, module: Any) -> int:
        if hasattr(module, "pending_wgrad_count"):
            return int(module.pending_wgrad_count)
        store = getattr(module, "wgrad_store", None)
        ctx = getattr(store, "context", None)
        queue = getattr(ctx, "queue", None) if ctx is not None else None
        if queue is None:
            raise BackendUnavailable("cannot read the pending wgrad count from this TE version")
        return len(queue) if not hasattr(queue, "qsize") else int(queue.qsize())
