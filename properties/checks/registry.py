"""The registry of SPEC §7's properties: for each id its summary, its check (one file per
group, imported below), the cases it is checked on, the module kinds it applies to and the parts
of SPEC §2-§6's API it needs. ``splitgrad verify``, the pytest plugin and ``tests/`` reach every
property through :func:`case_strategy`, :func:`explicit_cases` and :func:`run_check`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from hypothesis import strategies as st

from ..backends import Backend
from ..cases.data import param_specs
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
from .input_only import INPUT, MODES, check_p17, p17_cases
from .memory import check_p11
from .misuse import P9_KINDS, check_p9, check_p10, p10_cases, p10_explicit
from .protocol import PROTOCOL_VARIANTS
from .results import CheckResult
from .split import (
    chain_splits,
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
    "PropertySpec",
    "SPECS",
    "CellOptions",
    "case_strategy",
    "explicit_cases",
    "applicable",
    "run_check",
    "example_case",
    "restrict_case",
    "aligned_case",
    "case_na_reason",
    "MODULE_PROTOCOL",
    "DISTRIBUTED_PROPERTIES",
]

Strategy = Callable[..., st.SearchStrategy[Case]]
Explicit = Callable[..., list[Case]]

#: What ``without`` names when P18's module-protocol kinds do not apply to a backend
#: (:meth:`~.backends.Backend.module_protocol_reason`): its explicit cases leave them out.
MODULE_PROTOCOL = "module_protocol"


def _plain(narrow=lambda kinds, dtypes: (kinds, dtypes), **options) -> tuple[Strategy, Explicit]:
    """The drawn and the explicit cases of a property without structure of its own: a cell's
    (kinds, dtypes) narrowed by ``narrow``, and ``options`` for :func:`~.strategies.cases`."""

    @st.composite
    def drawn(draw, kinds, dtypes, devices, recipes):
        kinds, dtypes = narrow(kinds, dtypes)
        return draw(cases(kinds, dtypes, devices, recipes=recipes, **options))

    def explicit(kinds, dtypes, devices, recipes) -> list[Case]:
        kinds, dtypes = narrow(kinds, dtypes)
        return boundary_cases(kinds, dtypes, devices, recipes=recipes, **options)

    return drawn, explicit


def _low_precision(kinds: tuple[str, ...], dtypes: tuple[str, ...]) -> tuple[tuple, tuple]:
    # P1-P3 only run dtypes below float64 (there is no wider truth).
    return kinds, tuple(d for d in dtypes if d in LOW_PRECISION_DTYPES) or ("float32",)


def _non_grouped(kinds: tuple[str, ...], dtypes: tuple[str, ...]) -> tuple[tuple, tuple]:
    return tuple(k for k in kinds if k != "GroupedLinear") or ("Linear",), dtypes


_PLAIN = _plain()
_ACCURACY = _plain(_low_precision)
_P9 = _plain(_non_grouped, n_micro_batches=(1, 2))
_P12 = _plain(lambda kinds, dtypes: (("GroupedLinear",), dtypes))

# Explicit cases of the properties with structure of their own: the boundary patterns of
# boundary_cases() (every recipe, every layout) completed with it, enumerated where finite.


def _explicit_p4(kinds, dtypes, devices, recipes) -> list[Case]:
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
    out = []
    base = boundary_cases(
        kinds, dtypes, devices, n_micro_batches=(2, 2), square=True, recipes=recipes
    )
    variants = ("tied", "tied-chain", "frozen")
    for i, c in enumerate(base + base[: max(0, len(variants) - len(base))]):
        variant = variants[i % len(variants)]
        mbs = chain_splits(c.micro_batches, variant, c.config.kind)
        names = [s.name for s in param_specs(c.config)]
        frozen = (names[i % len(names)],) if variant == "frozen" else ()
        out.append(
            dataclasses.replace(c, micro_batches=mbs, variant=variant, frozen=frozen, delay=True)
        )
    return out


def _explicit_p13(kinds, dtypes, devices, recipes) -> list[Case]:
    fp8 = tuple(r for r in recipes if r is not None) or tuple(RECIPES)
    base = boundary_cases(kinds, dtypes, devices, n_micro_batches=(2, 3), recipes=fp8)
    return [
        dataclasses.replace(c, variant=P13_VALUES[i % len(P13_VALUES)]) for i, c in enumerate(base)
    ]


def _explicit_p17(kinds, dtypes, devices, recipes) -> list[Case]:
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


@dataclasses.dataclass(frozen=True)
class PropertySpec:
    """One property of SPEC §7. ``needs``: API parts (:data:`~.backends.API_PARTS`) without
    which it cannot be checked at all; ``uses``: parts it exercises when present and drops from
    its cases when absent (:func:`restrict_case`); ``explicit``: its :func:`explicit_cases`."""

    id: str
    summary: str
    check: Callable[[Backend, Case], CheckResult]
    cases: Strategy
    kinds: tuple[str, ...] = KINDS
    needs: frozenset[str] = frozenset()
    uses: frozenset[str] = frozenset({"delay", "fused", "first_microbatch", "hooks"})
    fp8_only: bool = False
    explicit: Explicit = _PLAIN[1]


PROPERTIES: dict[str, str] = {
    "P1": "forward output within budget of the reference",
    "P2": "input and norm gradients within budget",
    "P3": "weight/bias gradients (or main_grad) within budget after backward_dw()",
    "P4": "delayed == non-delayed, bitwise (random .grad and main_grad prefill, frozen "
    "subsets); both within budget of the float64 truth",
    "P5": "between backward() and backward_dw(): input grads final, GEMM grads untouched, no hooks",
    "P6": "any legal interleaving of forward/backward/backward_dw/zero == non-delayed run",
    "P7": "tied weights (module used twice) and frozen weights",
    "P8": "is_first_microbatch overwrites main_grad under fused accumulation only",
    "P9": "ub_bulk_wgrad + delay raises ValueError, also under python -O",
    "P10": "bad input and misuse raise the errors of SPEC §4/§5 and change nothing",
    "P11": "after backward_dw() the entry's tensors are freed",
    "P12": "GroupedLinear == a list of Linears on torch.split(x, m_splits)",
    "P13": "FP8 quantizers == the reference's bit for bit; amax histories delayed == not",
    "P17": "a backward that is not asked for a parameter's gradient writes and queues nothing "
    "for it (torch.autograd.grad, backward(inputs=...))",
    "P18": "autograd fidelity: gradients reach the tensors the forward used (functional_call, "
    "parametrize), parameter hooks see and replace them, post-accumulate hooks fire "
    "after the write, double backward and torch.func right or a clear error; the "
    "module protocol: torch's default device and dtype followed, reset_parameters, "
    "repr, no view for a 2-D input, copies compute as the original",
}


#: SPEC §7's properties that run on spawned gloo ranks, not in a cell of ``splitgrad verify``: the
#: ``splitgrad distributed --check`` names of each (:mod:`.distributed`).
DISTRIBUTED_PROPERTIES: dict[str, str] = {
    "P14": "p14",
    "P15": "p15",
    "P16": "p16,p16-pp",
    "P19": "p19",
}


def _spec(pid: str, check, cases: Strategy, explicit: Explicit, needs=(), **more) -> PropertySpec:
    needs = frozenset(needs)
    return PropertySpec(pid, PROPERTIES[pid], check, cases, needs=needs, explicit=explicit, **more)


_SPLIT = ("delay", "hooks")
_FP8 = ("delay", "fp8", "fp8_quantizer")
SPECS: dict[str, PropertySpec] = {
    s.id: s
    for s in (
        _spec("P1", check_p1, *_ACCURACY),
        _spec("P2", check_p2, *_ACCURACY),
        _spec("P3", check_p3, *_ACCURACY),
        _spec("P4", check_p4, p4_cases, _explicit_p4, _SPLIT),
        _spec("P5", check_p5, p5_cases, _explicit_p5, _SPLIT),
        _spec("P6", check_p6, p6_cases, _explicit_p6, _SPLIT),
        _spec("P7", check_p7, p7_cases, _explicit_p7, _SPLIT),
        _spec("P8", check_p8, *_PLAIN, ("first_microbatch",)),
        _spec("P9", check_p9, *_P9, ("delay", "ub_bulk_wgrad", "constructors"), kinds=P9_KINDS),
        _spec("P10", check_p10, p10_cases, p10_explicit, ("delay", "hooks", "constructors")),
        _spec("P11", check_p11, *_PLAIN),
        _spec("P12", check_p12, *_P12, kinds=("GroupedLinear",)),
        _spec("P13", check_p13, p13_cases, _explicit_p13, _FP8, fp8_only=True),
        _spec("P17", check_p17, p17_cases, _explicit_p17),
        _spec("P18", check_p18, p18_cases, _explicit_p18),
    )
}
CHECKS: dict[str, Callable[[Backend, Case], CheckResult]] = {
    pid: s.check for pid, s in SPECS.items()
}


def _spec_of(property_id: str) -> PropertySpec:
    try:
        return SPECS[property_id]
    except KeyError:
        raise ValueError(
            f"unknown property {property_id!r}; expected one of {', '.join(SPECS)}"
        ) from None


@dataclasses.dataclass(frozen=True)
class CellOptions:
    """What a cell draws its cases from. ``fused=False``: no ``main_grad`` (a backend without
    it); ``recipes``: FP8 recipe names (``None``: high precision); ``without``: API parts the
    backend lacks (:func:`restrict_case`); ``size_multiple``: feature sizes aligned for a forced
    fast path; ``autocast``: modules in float32 under ``torch.autocast`` to that dtype."""

    kinds: Sequence[str] = KINDS
    dtypes: Sequence[str] = ("float32", "bfloat16")
    devices: Sequence[str] = ("cpu",)
    fused: bool | None = None
    recipes: Sequence[str | None] = (None,)
    without: frozenset[str] = frozenset()
    size_multiple: int = 1
    autocast: str | None = None

    def axes(self) -> tuple[tuple, tuple, tuple, tuple]:
        """(kinds, dtypes, devices, recipes) as tuples: what a property's cases take."""
        return tuple(self.kinds), tuple(self.dtypes), tuple(self.devices), tuple(self.recipes)


def case_strategy(property_id: str, *args: Any, **options: Any) -> st.SearchStrategy[Case]:
    """The cases ``property_id`` is checked on, for the :class:`CellOptions` ``args`` and
    ``options``. P1–P3 only draw dtypes below float64; P12 only ``GroupedLinear``; P8 draws
    fused and plain; P13 only FP8 recipes (all of them when ``recipes`` has none)."""
    o = CellOptions(*args, **options)
    strategy = _spec_of(property_id).cases(*o.axes())
    if o.size_multiple > 1:
        strategy = strategy.map(lambda c: aligned_case(c, o.size_multiple))
    if o.autocast is not None:
        strategy = strategy.map(lambda c: with_autocast(c, o.autocast))
    if o.fused is None and not o.without:
        return strategy
    return strategy.map(lambda c: restrict_case(c, o.without, o.fused))


def explicit_cases(property_id: str, *args: Any, **options: Any) -> list[Case]:
    """The cases a cell of ``property_id`` always runs before its drawn ones (SPEC §7: finite
    dimensions enumerated, boundary sizes always among the examples), for the same arguments as
    :func:`case_strategy`, restricted the same way (:attr:`PropertySpec.explicit`). ``without``
    may also name :data:`MODULE_PROTOCOL`: P18's module-protocol kinds are then left out."""
    spec = _spec_of(property_id)
    o = CellOptions(*args, **options)
    out = [c for c in spec.explicit(*o.axes()) if c.config.kind in spec.kinds]
    if MODULE_PROTOCOL in o.without:
        out = [c for c in out if c.variant not in PROTOCOL_VARIANTS]
    if o.size_multiple > 1:
        out = [aligned_case(c, o.size_multiple) for c in out]
    out = [with_autocast(c, o.autocast) for c in out]
    if o.fused is not None or o.without:
        out = [restrict_case(c, o.without, o.fused) for c in out]
    return out


def aligned_case(case: Case, multiple: int) -> Case:
    """``case`` with every feature size rounded up to a multiple of ``multiple`` (a square
    module stays square; token counts are unchanged)."""
    c = case.config
    k, n = (-(-size // multiple) * multiple for size in (c.in_features, c.out_features))
    return dataclasses.replace(case, config=dataclasses.replace(c, in_features=k, out_features=n))


def restrict_case(case: Case, without: frozenset[str], fused: bool | None = None) -> Case:
    """``case`` without the API parts in ``without`` (``delay``: built without delay; ``fused``:
    plain accumulation; ``first_microbatch``: no flags); ``fused`` pins fused accumulation."""
    if "fused" in without:
        fused = False
    if fused is not None and case.config.fuse_wgrad_accumulation != fused:
        variant = case.variant
        if isinstance(variant, Misuse) and variant.breaks_main_grad:
            variant = Misuse("bad_last_dim")
        config = dataclasses.replace(case.config, fuse_wgrad_accumulation=fused)
        case = dataclasses.replace(case, config=config, variant=variant)
    if "delay" in without and case.delay:
        case = dataclasses.replace(case, delay=False)
    if "first_microbatch" in without:
        mbs = tuple(dataclasses.replace(mb, is_first_microbatch=None) for mb in case.micro_batches)
        case = dataclasses.replace(case, micro_batches=mbs)
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
    config = {"in_features": 5, "out_features": 3, **config}
    cfg = ModuleConfig(kind=kind, **config)
    if kind == "GroupedLinear":
        # All rows in the first group, the others empty.
        mb = MicroBatch((3,), (3,) + (0,) * (cfg.num_gemms - 1))
        return Case(cfg, (mb, mb), 0)
    return Case(cfg, (MicroBatch((3,)), MicroBatch((1, 3))), 0)
