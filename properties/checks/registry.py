"""The registry of SPEC §7's properties: for each id its summary, its check, the cases it is
checked on, the module kinds it applies to and the parts of SPEC §2-§6's API it needs.

Where each property lives:

=========  ==============================================================  ================
id         property                                                        file
=========  ==============================================================  ================
P1-P3      output, input/norm and weight/bias gradients within budget      accuracy.py
P4-P8      delayed == non-delayed, the state between backward() and        split.py
           backward_dw(), interleavings, tied/frozen, is_first_microbatch
P9-P10     ub_bulk_wgrad + delay, bad input and misuse                     misuse.py
P11        the entry's tensors are freed after backward_dw()               memory.py
P12        GroupedLinear == a list of Linears                              grouped.py
P13        FP8 quantizers and amax histories                               fp8.py
P17        a backward writes and queues only what it is asked for          input_only.py
P18        autograd fidelity: functional_call, parametrize, parameter       fidelity.py
           hooks, double backward, torch.func; the module protocol:         protocol.py
           placement, reset_parameters, repr, no views, copies
=========  ==============================================================  ================

Shared: :mod:`.results` (what a check returns), :mod:`.runner` (one live module), :mod:`.truth`
(the float64 truth for any sequence of steps: how the differential properties P4-P8 and P12
are also judged against it). ``splitgrad verify``, the pytest plugin and ``tests/`` reach every
property through :func:`case_strategy` and :func:`run_check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from ..backends import Backend
from ..cases.strategies import (
    KINDS,
    LOW_PRECISION_DTYPES,
    RECIPES,
    Case,
    MicroBatch,
    ModuleConfig,
    boundary_cases,
    cases,
    with_autocast,
)
from ..cases.variants import Misuse, PartialBackward
from .accuracy import check_p1, check_p2, check_p3
from .fidelity import check_p18, p18_cases, p18_explicit
from .fp8 import P13_VALUES, check_p13, p13_cases
from .grouped import check_p12
from .input_only import check_p17, p17_cases
from .memory import check_p11
from .misuse import check_p9, check_p10, p10_cases, p10_explicit
from .protocol import PROTOCOL_VARIANTS
from .results import CheckResult
from .split import (
    check_p4,
    check_p5,
    check_p6,
    check_p7,
    check_p8,
    p4_cases,
    p5_cases,
    p6_cases,
    p7_cases,
)

__all__ = [
    "PROPERTIES",
    "CHECKS",
    "REQUIRES",
    "PropertySpec",
    "SPECS",
    "case_strategy",
    "explicit_cases",
    "applicable",
    "run_check",
    "example_case",
    "restrict_case",
    "aligned_case",
    "case_na_reason",
    "MODULE_PROTOCOL",
]

Strategy = Callable[..., st.SearchStrategy[Case]]

#: What ``without`` names when P18's module-protocol kinds do not apply to a backend
#: (:meth:`~.backends.Backend.module_protocol_reason`): its explicit cases leave them out.
MODULE_PROTOCOL = "module_protocol"


@st.composite
def _accuracy_cases(draw, kinds, dtypes, devices, recipes):
    # P1-P3 only draw dtypes below float64 (there is no wider truth).
    low = tuple(d for d in dtypes if d in LOW_PRECISION_DTYPES) or ("float32",)
    return draw(cases(kinds, low, devices, recipes=recipes))


@st.composite
def _p9_cases(draw, kinds, dtypes, devices, recipes):
    kinds = tuple(k for k in kinds if k != "GroupedLinear") or ("Linear",)
    return draw(cases(kinds, dtypes, devices, n_micro_batches=(1, 2), recipes=recipes))


@st.composite
def _p12_cases(draw, kinds, dtypes, devices, recipes):
    return draw(cases(("GroupedLinear",), dtypes, devices, recipes=recipes))


@st.composite
def _plain_cases(draw, kinds, dtypes, devices, recipes):
    return draw(cases(kinds, dtypes, devices, recipes=recipes))


@dataclasses.dataclass(frozen=True)
class PropertySpec:
    """One property of SPEC §7.

    ``needs``: API parts (:data:`~.backends.API_PARTS`) without which the property cannot be
    checked at all; ``uses``: parts it exercises when present and drops from its cases when
    absent (``delay``: only ``delay_wgrad_compute=False`` cases; ``fused``: no fused
    accumulation; ``first_microbatch``: no ``is_first_microbatch`` flags)."""

    id: str
    summary: str
    check: Callable[[Backend, Case], CheckResult]
    cases: Strategy
    kinds: tuple[str, ...] = KINDS
    needs: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset({"delay", "fused", "first_microbatch", "hooks"})
    fp8_only: bool = False


def _spec(pid, summary, check, strategy, needs=(), kinds=KINDS, fp8_only=False) -> PropertySpec:
    return PropertySpec(pid, summary, check, strategy, kinds, frozenset(needs), fp8_only=fp8_only)


_SPLIT = ("delay", "hooks")
SPECS: dict[str, PropertySpec] = {
    s.id: s
    for s in (
        _spec("P1", "forward output within budget of the reference", check_p1, _accuracy_cases),
        _spec("P2", "input and norm gradients within budget", check_p2, _accuracy_cases),
        _spec(
            "P3",
            "weight/bias gradients (or main_grad) within budget after backward_dw()",
            check_p3,
            _accuracy_cases,
        ),
        _spec(
            "P4",
            "delayed == non-delayed, bitwise (random .grad and main_grad prefill, frozen "
            "subsets); both within budget of the float64 truth",
            check_p4,
            p4_cases,
            _SPLIT,
        ),
        _spec(
            "P5",
            "between backward() and backward_dw(): input grads final, GEMM grads untouched, "
            "no hooks",
            check_p5,
            p5_cases,
            _SPLIT,
        ),
        _spec(
            "P6",
            "any legal interleaving of forward/backward/backward_dw/zero == non-delayed run",
            check_p6,
            p6_cases,
            _SPLIT,
        ),
        _spec(
            "P7",
            "tied weights (module used twice) and frozen weights",
            check_p7,
            p7_cases,
            _SPLIT,
        ),
        _spec(
            "P8",
            "is_first_microbatch overwrites main_grad under fused accumulation only",
            check_p8,
            _plain_cases,
            ("first_microbatch",),
        ),
        _spec(
            "P9",
            "ub_bulk_wgrad + delay raises ValueError, also under python -O",
            check_p9,
            _p9_cases,
            ("delay", "ub_bulk_wgrad", "constructors"),
            kinds=tuple(k for k in KINDS if k != "GroupedLinear"),
        ),
        _spec(
            "P10",
            "bad input and misuse raise the errors of SPEC §4/§5 and change nothing",
            check_p10,
            p10_cases,
            ("delay", "hooks", "constructors"),
        ),
        _spec("P11", "after backward_dw() the entry's tensors are freed", check_p11, _plain_cases),
        _spec(
            "P12",
            "GroupedLinear == a list of Linears on torch.split(x, m_splits)",
            check_p12,
            _p12_cases,
            kinds=("GroupedLinear",),
        ),
        _spec(
            "P13",
            "FP8 quantizers == the reference's bit for bit; amax histories delayed == not",
            check_p13,
            p13_cases,
            ("delay", "fp8", "fp8_quantizer"),
            fp8_only=True,
        ),
        _spec(
            "P17",
            "a backward that is not asked for a parameter's gradient writes and queues nothing "
            "for it (torch.autograd.grad, backward(inputs=...))",
            check_p17,
            p17_cases,
        ),
        _spec(
            "P18",
            "autograd fidelity: gradients reach the tensors the forward used (functional_call, "
            "parametrize), parameter hooks see and replace them, post-accumulate hooks fire "
            "after the write, double backward and torch.func right or a clear error; the "
            "module protocol: torch's default device and dtype followed, reset_parameters, "
            "repr, no view for a 2-D input, copies compute as the original",
            check_p18,
            p18_cases,
        ),
    )
}

PROPERTIES: dict[str, str] = {pid: s.summary for pid, s in SPECS.items()}
CHECKS: dict[str, Callable[[Backend, Case], CheckResult]] = {
    pid: s.check for pid, s in SPECS.items()
}
#: API parts each property needs (see :data:`~.backends.API_PARTS`).
REQUIRES: dict[str, frozenset[str]] = {pid: s.needs for pid, s in SPECS.items()}


def _spec_of(property_id: str) -> PropertySpec:
    try:
        return SPECS[property_id]
    except KeyError:
        raise ValueError(
            f"unknown property {property_id!r}; expected one of {', '.join(SPECS)}"
        ) from None


def case_strategy(
    property_id: str,
    kinds: tuple[str, ...] = KINDS,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    devices: tuple[str, ...] = ("cpu",),
    fused: bool | None = None,
    recipes: tuple[str | None, ...] = (None,),
    without: frozenset[str] = frozenset(),
    size_multiple: int = 1,
    autocast: str | None = None,
) -> st.SearchStrategy[Case]:
    """The cases ``property_id`` is checked on. P1–P3 only draw dtypes below float64 (there is no
    wider truth); P12 only ``GroupedLinear``; P8 draws fused and plain; P13 only FP8 recipes
    (all of them when ``recipes`` has none). ``fused=False`` keeps ``fuse_wgrad_accumulation``
    off (backends without ``main_grad``); ``recipes`` are FP8 recipe names (``None``: high
    precision); ``without``: API parts the backend lacks, left out of the cases
    (:func:`restrict_case`); ``size_multiple``: every feature size a multiple of it (a forced
    fast path that needs aligned sizes); ``autocast``: every case run under ``torch.autocast``
    to that dtype, its module in float32 (:func:`~.strategies.with_autocast`)."""
    spec = _spec_of(property_id)
    strategy = spec.cases(tuple(kinds), tuple(dtypes), tuple(devices), tuple(recipes))
    if size_multiple > 1:
        strategy = strategy.map(lambda c: aligned_case(c, size_multiple))
    if autocast is not None:
        strategy = strategy.map(lambda c: with_autocast(c, autocast))
    if fused is False:
        without = without | {"fused"}
    if fused is None and not without:
        return strategy
    return strategy.map(lambda c: restrict_case(c, without, fused))


def explicit_cases(
    property_id: str,
    kinds: tuple[str, ...] = KINDS,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    devices: tuple[str, ...] = ("cpu",),
    fused: bool | None = None,
    recipes: tuple[str | None, ...] = (None,),
    without: frozenset[str] = frozenset(),
    size_multiple: int = 1,
    autocast: str | None = None,
) -> list[Case]:
    """The cases a cell of ``property_id`` always runs before its drawn ones (SPEC §7: finite
    dimensions enumerated, boundary sizes always among the examples), for the same arguments as
    :func:`case_strategy` and passed through the same restrictions: the boundary patterns of
    :func:`~.strategies.boundary_cases` (every recipe, every layout) completed with the
    property's own structure, enumerated where it is finite (P5's prefill, P7's variants, P13's
    value patterns, P17's modes, P18's substitution kinds; P10: every misuse x fused x delay x
    ``is_first_microbatch``, :func:`~.misuse.p10_explicit`). ``without`` may also name
    :data:`MODULE_PROTOCOL`: P18's module-protocol kinds are then left out."""
    spec = _spec_of(property_id)
    kinds, dtypes, devices, recipes = tuple(kinds), tuple(dtypes), tuple(devices), tuple(recipes)
    out = _EXPLICIT.get(property_id, _explicit_plain)(kinds, dtypes, devices, recipes)
    out = [c for c in out if c.config.kind in spec.kinds]
    if MODULE_PROTOCOL in without:
        out = [c for c in out if c.variant not in PROTOCOL_VARIANTS]
    if size_multiple > 1:
        out = [aligned_case(c, size_multiple) for c in out]
    out = [with_autocast(c, autocast) for c in out]
    if fused is False:
        without = without | {"fused"}
    if fused is not None or without:
        out = [restrict_case(c, without, fused) for c in out]
    return out


def _explicit_plain(kinds, dtypes, devices, recipes) -> list[Case]:
    return boundary_cases(kinds, dtypes, devices, recipes=recipes)


def _explicit_accuracy(kinds, dtypes, devices, recipes) -> list[Case]:
    low = tuple(d for d in dtypes if d in LOW_PRECISION_DTYPES) or ("float32",)
    return boundary_cases(kinds, low, devices, recipes=recipes)


def _explicit_p4(kinds, dtypes, devices, recipes) -> list[Case]:
    from ..cases.data import param_specs

    out = []
    for i, c in enumerate(boundary_cases(kinds, dtypes, devices, recipes=recipes)):
        # Every other case freezes one parameter (a different role each time).
        names = [s.name for s in param_specs(c.config)]
        frozen = (names[(i // 2) % len(names)],) if i % 2 else ()
        out.append(dataclasses.replace(c, frozen=frozen, delay=True))
    return out


def _explicit_p5(kinds, dtypes, devices, recipes) -> list[Case]:
    base = boundary_cases(kinds, dtypes, devices, recipes=recipes)
    return [
        dataclasses.replace(c, variant=("", "prefill")[i % 2], delay=True)
        for i, c in enumerate(base)
    ]


def _explicit_p6(kinds, dtypes, devices, recipes) -> list[Case]:
    out = []
    base = boundary_cases(kinds, dtypes, devices, n_micro_batches=(3, 3), recipes=recipes)
    for i, c in enumerate(base):
        n = len(c.micro_batches)
        if i % 2:
            schedule = ("fb", "dw", "zero") * (n - 1) + ("fb", "dw")
        else:
            schedule = ("fb",) * n + ("dw",) * n
        out.append(dataclasses.replace(c, schedule=schedule, delay=True))
    return out


def _explicit_p7(kinds, dtypes, devices, recipes) -> list[Case]:
    from ..cases.data import param_specs

    out = []
    base = boundary_cases(
        kinds, dtypes, devices, n_micro_batches=(2, 2), square=True, recipes=recipes
    )
    variants = ("tied", "tied-chain", "frozen")
    for i, c in enumerate(base + base[: max(0, len(variants) - len(base))]):
        variant = variants[i % len(variants)]
        mbs = c.micro_batches
        if variant == "tied-chain" and c.config.kind == "GroupedLinear":
            mbs = (
                mbs[0],
                dataclasses.replace(mbs[1], lead_shape=mbs[0].lead_shape, m_splits=mbs[0].m_splits),
            )
        names = [s.name for s in param_specs(c.config)]
        frozen = (names[i % len(names)],) if variant == "frozen" else ()
        out.append(
            dataclasses.replace(c, micro_batches=mbs, variant=variant, frozen=frozen, delay=True)
        )
    return out


def _explicit_p9(kinds, dtypes, devices, recipes) -> list[Case]:
    kinds = tuple(k for k in kinds if k != "GroupedLinear") or ("Linear",)
    return boundary_cases(kinds, dtypes, devices, n_micro_batches=(1, 2), recipes=recipes)


def _explicit_p12(kinds, dtypes, devices, recipes) -> list[Case]:
    return boundary_cases(("GroupedLinear",), dtypes, devices, recipes=recipes)


def _explicit_p13(kinds, dtypes, devices, recipes) -> list[Case]:
    fp8 = tuple(r for r in recipes if r is not None) or tuple(RECIPES)
    base = boundary_cases(kinds, dtypes, devices, n_micro_batches=(2, 3), recipes=fp8)
    return [
        dataclasses.replace(c, variant=P13_VALUES[i % len(P13_VALUES)]) for i, c in enumerate(base)
    ]


def _explicit_p17(kinds, dtypes, devices, recipes) -> list[Case]:
    from ..cases.data import param_specs
    from .input_only import INPUT, MODES

    out = []
    for i, c in enumerate(boundary_cases(kinds, dtypes, devices, recipes=recipes)):
        n = len(c.micro_batches)
        recipe = c.config.recipe or ""
        index = n - 1 if recipe.startswith("delayed") else i % n
        names = [s.name for s in param_specs(c.config)]
        # The input alone, one parameter alone, the input and a parameter, all parameters.
        asked = ((INPUT,), (names[i % len(names)],), (INPUT, names[0]), tuple(names))[i % 4]
        mode = MODES[(i // 2) % len(MODES)]
        out.append(dataclasses.replace(c, variant=PartialBackward(mode, index), asked=asked))
    return out


def _explicit_p18(kinds, dtypes, devices, recipes) -> list[Case]:
    return p18_explicit(
        boundary_cases(kinds, dtypes, devices, n_micro_batches=(1, 2), recipes=recipes)
    )


_EXPLICIT = {
    "P1": _explicit_accuracy,
    "P2": _explicit_accuracy,
    "P3": _explicit_accuracy,
    "P4": _explicit_p4,
    "P5": _explicit_p5,
    "P6": _explicit_p6,
    "P7": _explicit_p7,
    "P9": _explicit_p9,
    "P10": p10_explicit,
    "P12": _explicit_p12,
    "P13": _explicit_p13,
    "P17": _explicit_p17,
    "P18": _explicit_p18,
}


def aligned_case(case: Case, multiple: int) -> Case:
    """``case`` with every feature size rounded up to a multiple of ``multiple`` (a square
    module stays square; token counts are unchanged)."""

    def up(n: int) -> int:
        return -(-n // multiple) * multiple

    c = case.config
    config = dataclasses.replace(c, in_features=up(c.in_features), out_features=up(c.out_features))
    return dataclasses.replace(case, config=config)


def restrict_case(case: Case, without: frozenset[str], fused: bool | None = None) -> Case:
    """``case`` without the API parts in ``without`` (``delay``: built without delay; ``fused``:
    plain accumulation; ``first_microbatch``: no flags); ``fused`` pins fused accumulation."""
    if "fused" in without:
        fused = False
    if fused is not None and case.config.fuse_wgrad_accumulation != fused:
        variant = case.variant
        if isinstance(variant, Misuse) and variant.breaks_main_grad:
            variant = Misuse("bad_last_dim")
        case = dataclasses.replace(
            case,
            config=dataclasses.replace(case.config, fuse_wgrad_accumulation=fused),
            variant=variant,
        )
    if "delay" in without and case.delay:
        case = dataclasses.replace(case, delay=False)
    if "first_microbatch" in without:
        case = dataclasses.replace(
            case,
            micro_batches=tuple(
                dataclasses.replace(mb, is_first_microbatch=None) for mb in case.micro_batches
            ),
        )
    return case


def applicable(property_id: str, kind: str) -> bool:
    """Whether ``property_id`` has anything to check for module ``kind``."""
    return kind in _spec_of(property_id).kinds


def case_na_reason(property_id: str, backend: Backend, case: Case) -> str | None:
    """Why ``case`` of ``property_id`` cannot run on ``backend`` though its cell can (``None``:
    it can): P18's module-protocol kinds on a backend whose modules are the adapter's own."""
    if property_id == "P18" and case.variant in PROTOCOL_VARIANTS:
        return backend.module_protocol_reason()
    return None


def run_check(property_id: str, backend: Backend, case: Case) -> CheckResult:
    """Run one example of ``property_id``."""
    return _spec_of(property_id).check(backend, case)


def example_case(kind: str = "Linear", **config: Any) -> Case:
    """A small fixed case (tests and docs): 2 micro-batches of 3 rows, seed 0."""
    cfg = ModuleConfig(
        kind=kind,
        in_features=config.pop("in_features", 5),
        out_features=config.pop("out_features", 3),
        **config,
    )
    if kind == "GroupedLinear":
        mbs = tuple(
            MicroBatch((3,), tuple([3] + [0] * (cfg.num_gemms - 1)) if cfg.num_gemms > 1 else (3,))
            for _ in range(2)
        )
    else:
        mbs = (MicroBatch((3,)), MicroBatch((1, 3)))
    return Case(cfg, mbs, 0)
