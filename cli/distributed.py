"""``splitgrad distributed``: the harness's P14-P16 and P19 (:mod:`splitgrad.properties.checks.
distributed`) against a package, each check on its own gloo ranks."""

from __future__ import annotations

import argparse
import time

from splitgrad.bench.options import SCHEDULES, TORCH_SCHEDULE_NAMES, positive_float
from splitgrad.properties.checks import distributed as harness
from splitgrad.properties.front.command_line import (
    BACKEND_HELP,
    USAGE_ERROR,
    backend_spec,
    pick,
    run_error,
    usage_error,
)

_CHECKS = ("p14", "p15", "p16", "p16-pp", "p19")
_RECIPES = ("none", *harness.RECIPES)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitgrad distributed",
        description=(
            "Run the distributed properties of SPEC §7 against a package with SPEC §2's API, "
            "each on its own spawned gloo ranks (a timeout on every collective), and print "
            "what each compared. Exit status 1 when a check fails."
        ),
    )
    p.add_argument("--backend", type=backend_spec, default="impl", help=BACKEND_HELP)
    p.add_argument(
        "--check",
        default=",".join(_CHECKS),
        help="comma-separated subset of p14 (expert parallel), p15 (pipeline schedules), p16 "
        "(data parallel), p16-pp (2 stages x 2 replicas), p19 (tensor and sequence parallel, "
        "on 2 and 4 ranks) (default: all)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="pipeline ranks for p15 (default: 2); p14 runs on 2 ranks, p16 on 2 (and, under "
        "fully_shard, 3), p16-pp on 4, p19 on 2 and 4",
    )
    p.add_argument(
        "--schedule",
        default="all",
        help=f"p15's pipeline schedules, comma-separated, of {', '.join(SCHEDULES)} or all "
        "(default: all)",
    )
    p.add_argument(
        "--recipe",
        default="none",
        help=f"p15's FP8 recipes, comma-separated, of {', '.join(_RECIPES)} (default: none)",
    )
    # The older spellings, still read (with the torch class names as schedule names).
    for old, new in (("--schedules", "schedule"), ("--recipes", "recipe")):
        p.add_argument(old, dest=new, default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    p.add_argument(
        "--profile",
        choices=harness.TP_PROFILES,
        default="ci",
        help="p19's matrix: ci (every module, SP, fused, bias and dtype; FP8 recipes with fused "
        "and bias alternating, Float8BlockScaling on 2 ranks) or nightly (every combination, two "
        "seeds) (default: ci)",
    )
    p.add_argument(
        "--reducer",
        default=None,
        help="the reducer class p16 builds, as MODULE:CLASS (an importable module; default: "
        "splitgrad.distributed:GradientReducer)",
    )
    p.add_argument(
        "--timeout",
        type=positive_float,
        default=600.0,
        help="seconds per check before it fails (600)",
    )
    return p


def _plan(args: argparse.Namespace) -> tuple[list[str], tuple[str, ...], tuple]:
    """(checks, schedules, recipes) the command line asks for; ``ValueError`` naming a bad
    option, raised before anything loads."""
    checks = list(pick("check", args.check, "check", _CHECKS))
    picked = pick("recipe", args.recipe, "recipe", _RECIPES, everything=None)
    recipes = tuple(None if r == "none" else r for r in picked)
    names = pick("schedule", args.schedule, "schedule", SCHEDULES, TORCH_SCHEDULE_NAMES)
    schedules = tuple(SCHEDULES[name] for name in names)
    if args.world_size is not None:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        fixed = [c for c in checks if c != "p15"]
        if fixed:
            raise ValueError(
                f"--world-size {args.world_size} sets p15's pipeline ranks only, but {fixed} "
                "run on fixed worlds (p14: 2 ranks, p16: 2 and 3, p16-pp: 4, p19: 2 and 4); use "
                "--check p15 with it"
            )
    if args.reducer is not None:
        if "p16" not in checks:
            raise ValueError(f"--reducer {args.reducer} applies to p16 only; use --check p16")
        try:
            harness.load_library(args.reducer)
        except Exception as exc:  # an import error, a missing attribute
            raise ValueError(
                f"--reducer {args.reducer}: cannot load it ({type(exc).__name__}: {exc})"
            ) from None
    return checks, schedules, recipes


def _load(backend: str, checks: list[str]) -> None:
    """Load the package here, before any rank does: ``ValueError`` saying why it cannot."""
    try:
        harness.preload_library(backend)
    except ValueError:
        # p19 alone on a backend that is no package (torch-split): it reports "not supported"
        if checks != ["p19"] or not harness.not_a_package(backend):
            raise


def _runs(args: argparse.Namespace, schedules: tuple[str, ...], recipes: tuple) -> dict:
    """Each check's run, by name."""
    backend, timeout = args.backend, args.timeout
    reducer = {"reducer": args.reducer} if args.reducer else {}
    return {
        "p14": lambda: harness.check_expert_parallel(backend, timeout_s=timeout),
        "p15": lambda: harness.check_pipeline(
            backend,
            world_size=args.world_size or 2,
            schedules=schedules,
            recipes=recipes,
            timeout_s=timeout,
        ),
        "p16": lambda: harness.merge_reports(
            f"P16 {backend} alone and under fully_shard",
            harness.check_data_parallel(backend, timeout_s=timeout, **reducer),
            harness.check_fully_sharded(backend, timeout_s=timeout, **reducer),
        ),
        "p16-pp": lambda: harness.merge_reports(
            f"P16 x P15 {backend}: replicated and under fully_shard",
            harness.check_pipeline_data_parallel(backend, timeout_s=timeout),
            harness.check_pipeline_data_parallel(backend, timeout_s=timeout, fully_shard=True),
        ),
        "p19": lambda: harness.check_tensor_parallel(
            backend, profile=args.profile, timeout_s=timeout
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``splitgrad distributed``."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        checks, schedules, recipes = _plan(args)
    except ValueError as exc:
        return usage_error(parser, str(exc))
    try:
        _load(args.backend, checks)
    except ValueError as exc:
        return run_error(parser.prog, str(exc), USAGE_ERROR)
    runs = _runs(args, schedules, recipes)
    failed = False
    print(f"splitgrad distributed — backend {args.backend}")
    for name in checks:
        start = time.perf_counter()
        try:
            report = runs[name]()
        except Exception as exc:  # a rank failed or timed out: report it, go on
            failed = True
            print(f"{name:7s} ERROR  {type(exc).__name__}: {exc}")
            continue
        took = time.perf_counter() - start
        if report.not_supported:
            print(f"{name:7s} n/a    {report.name}: not supported: {report.not_supported}")
            continue
        status = "pass" if report.ok else "FAIL"
        failed |= not report.ok
        print(
            f"{name:7s} {status:5s}  {report.name}: {report.compared} comparisons, "
            f"{len(report.failures)} failures, {took:.1f} s"
        )
        for line in report.failures[:20]:
            print(f"        {line}")
    return 1 if failed else 0
