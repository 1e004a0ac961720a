"""The structured choices a case carries for its property (``Case.variant``).

Most properties pick a variant by name from a closed set (P5 ``"prefill"``, P7 ``"tied"``, P13 a
value pattern, P18 a substitution): those stay strings. :class:`Misuse` (P10: which misuse, and
the GEMM weight a ``main_grad_*`` or ``wgrad_fails`` one breaks) and :class:`PartialBackward`
(P17: how the partial backward asks and on which micro-batch) carry more. Each has one string
form, used in case JSON, printed cases and hypothesis' output (``"main_grad_shape:fc2_weight"``,
``"bad_dtype"``, ``"grad@1"``), which :func:`parse_variant` turns back into the typed object.
"""

from __future__ import annotations

import dataclasses

#: P10's misuses (:func:`~.misuse.misuses` says which apply to a module).
MISUSES = (
    "bad_last_dim",
    "bad_dtype",
    "bad_device",
    "dw_empty",
    "dw_no_delay",
    "bad_ctor",
    "hook_raises",
    "tensor_hook_raises",
    "post_hook_raises",
    "backward_hook_raises",
    "backward_pre_hook_raises",
    "forward_hook_raises",
    "m_splits_len",
    "m_splits_negative",
    "m_splits_sum",
    "main_grad_missing",
    "main_grad_shape",
    "main_grad_dtype",
    "main_grad_device",
    "wgrad_fails",
    "fp8_tokens",
    "fp8_features",
)
#: How P17's partial backward asks for gradients.
INPUT_ONLY_MODES = ("grad", "inputs")


@dataclasses.dataclass(frozen=True)
class Misuse:
    """P10: the misuse ``name`` (from :data:`MISUSES`); ``weight`` is the GEMM weight whose
    ``main_grad`` a ``main_grad_*`` or ``wgrad_fails`` misuse breaks (``None``: the first), or
    where a ``*hook_raises`` one's hook sits (``"weight#1mb0"``: :class:`~.misuse.HookPosition`)."""

    name: str
    weight: str | None = None

    def __post_init__(self) -> None:
        if self.name not in MISUSES:
            raise ValueError(f"unknown P10 misuse {self.name!r}; expected one of {MISUSES}")

    @property
    def breaks_main_grad(self) -> bool:
        """Whether the misuse breaks a weight's ``main_grad`` (fused accumulation only)."""
        return self.name.startswith("main_grad") or self.name == "wgrad_fails"

    def __str__(self) -> str:
        return self.name if self.weight is None else f"{self.name}:{self.weight}"

    @classmethod
    def parse(cls, text: str) -> Misuse:
        """``"main_grad_shape:fc2_weight"`` or ``"bad_dtype"``."""
        name, _, weight = text.partition(":")
        return cls(name, weight or None)


@dataclasses.dataclass(frozen=True)
class PartialBackward:
    """P17: micro-batch ``micro_batch`` gets a backward in ``mode`` (from
    :data:`INPUT_ONLY_MODES`) that asks only for ``Case.asked``."""

    mode: str
    micro_batch: int

    def __post_init__(self) -> None:
        if self.mode not in INPUT_ONLY_MODES or self.micro_batch < 0:
            raise _not_partial(str(self))

    def __str__(self) -> str:
        return f"{self.mode}@{self.micro_batch}"

    @classmethod
    def parse(cls, text: str) -> PartialBackward:
        """``"grad@1"``."""
        mode, _, index = text.partition("@")
        if not index.isdigit():
            raise _not_partial(text)
        return cls(mode, int(index))


def _not_partial(text: str) -> ValueError:
    return ValueError(
        f"P17 variant must be '<mode>@<micro-batch>' with mode in {INPUT_ONLY_MODES}, got {text!r}"
    )


Variant = str | Misuse | PartialBackward


def parse_variant(text: str | Variant) -> Variant:
    """The typed variant of a string form (a typed one is returned as it is; a name that is
    neither a misuse nor ``mode@index`` stays a string)."""
    if not isinstance(text, str):
        return text
    if "@" in text:
        return PartialBackward.parse(text)
    if text.partition(":")[0] in MISUSES:
        return Misuse.parse(text)
    return text
