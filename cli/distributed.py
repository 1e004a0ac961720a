"""``splitgrad distributed``: the harness's P14-P16 and P19 (:mod:`splitgrad.properties.checks.
distributed`) against a package, each check on its own gloo ranks."""

from __future__ import annotations

import argparse
import sys
import time

from splitgrad.bench.options import positive_float
from splitgrad.properties.checks import distributed as harness

_CHECKS = ("p14", "p15", "p16", "p16-pp", "p19")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="splitgrad distributed",
        description=(
            "Run the distributed properties of SPEC §7 against a package with SPEC §2's API, "
            "each on its own spawned gloo ranks (a timeout on every collective), and print "
            "what each compared. Exit status 1 when a check fails."
        ),
    )
    p.add_argument(
        "--backend",
        default="impl",
        help="impl, reference, module:NAME (an importable package), NAME:ATTR (a namespace "
        "object) or path:DIR (a package directory) (default: impl)",
    )
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
        help="pipeline ranks for p15 (default: 2); p14 and p16 run on 2 ranks, p16-pp on 4, p19 "
        "on 2 and 4",
    )
    p.add_argument(
        "--schedules",
        default=",".join(harness.SCHEDULES),
        help="comma-separated torch.distributed.pipelining schedules for p15 (default: all six)",
    )
    p.add_argument(
        "--recipes",
        default="none",
        help="comma-separated FP8 recipes for p15: none, delayed, current, mxfp8, block "
        "(default: none)",
    )
    p.add_argument(
        "--profile",
        choices=harness.TP_PROFILES,
        default="ci",
        help="p19's matrix: ci (every module, SP, fused, bias and dtype; FP8 recipes with fused "
        "and bias alternating, Float8BlockScaling on 2 ranks) or nightly (every combination, two "
        "seeds) (default: ci)",
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
    option, raised before any rank starts."""
    checks = [c.strip() for c in args.check.split(",") if c.strip()]
    unknown = [c for c in checks if c not in _CHECKS]
    if unknown or not checks:
        raise ValueError(
            f"unknown checks {unknown or [args.check]}; choose from {', '.join(_CHECKS)}"
        )
    recipes = tuple(None if r == "none" else r for r in args.recipes.split(","))
    bad = [r for r in recipes if r is not None and r not in harness.RECIPES]
    if bad:
        raise ValueError(f"unknown recipes {bad}; choose from none, {', '.join(harness.RECIPES)}")
    schedules = tuple(s for s in args.schedules.split(",") if s)
    wrong = [s for s in schedules if s not in harness.SCHEDULES]
    if wrong or not schedules:
        raise ValueError(
            f"unknown schedules {wrong or [args.schedules]}; choose from "
            f"{', '.join(harness.SCHEDULES)}"
        )
    if args.world_size is not None:
        if args.world_size < 1:
            raise ValueError(f"--world-size must be >= 1, got {args.world_size}")
        fixed = [c for c in checks if c != "p15"]
        if fixed:
            raise ValueError(
                f"--world-size {args.world_size} sets p15's pipeline ranks only, but {fixed} "
                "run on fixed worlds (p14 and p16: 2 ranks, p16-pp: 4, p19: 2 and 4); use --check "
                "p15 with it"
            )
    try:
        harness.preload_library(args.backend)
    except ValueError:
        # p19 alone on a backend that is no package (torch-split): it reports "not supported"
        if checks != ["p19"] or not harness.not_a_package(args.backend):
            raise
    return checks, schedules, recipes


def _runs(args: argparse.Namespace, schedules: tuple[str, ...], recipes: tuple) -> dict:
    """Each check's run, by name."""
    backend, timeout = args.backend, args.timeout
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
            harness.check_data_parallel(backend, timeout_s=timeout),
            harness.check_fully_sharded(backend, timeout_s=timeout),
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
    args = _parser().parse_args(argv)
    try:
        checks, schedules, recipes = _plan(args)
    except ValueError as exc:
        print(f"splitgrad distributed: {exc}", file=sys.stderr)
        return 2
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
