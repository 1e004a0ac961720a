"""``splitgrad distributed``: P14-P16 against a package, each check on its own gloo ranks."""

from __future__ import annotations

import argparse
import sys
import time

from . import conformance

_CHECKS = ("p14", "p15", "p16", "p16-pp")


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
        "(data parallel), p16-pp (2 stages x 2 replicas) (default: all)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="pipeline ranks for p15 (default: 2); p14 and p16 run on 2 ranks and p16-pp on 4",
    )
    p.add_argument(
        "--schedules",
        default=",".join(conformance.SCHEDULES),
        help="comma-separated torch.distributed.pipelining schedules for p15 (default: all six)",
    )
    p.add_argument(
        "--recipes",
        default="none",
        help="comma-separated FP8 recipes for p15: none, delayed, current, mxfp8, block "
        "(default: none)",
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per check before it fails (600)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    checks = [c.strip() for c in args.check.split(",") if c.strip()]
    unknown = [c for c in checks if c not in _CHECKS]
    if unknown:
        print(
            f"splitgrad distributed: unknown checks {unknown}; choose from {_CHECKS}",
            file=sys.stderr,
        )
        return 2
    recipes = tuple(None if r == "none" else r for r in args.recipes.split(","))
    bad = [r for r in recipes if r is not None and r not in conformance.RECIPES]
    if bad:
        print(f"splitgrad distributed: unknown recipes {bad}", file=sys.stderr)
        return 2
    schedules = tuple(s for s in args.schedules.split(",") if s)
    wrong = [s for s in schedules if s not in conformance.SCHEDULES]
    if wrong or not schedules:
        print(
            f"splitgrad distributed: unknown schedules {wrong or [args.schedules]}; choose from "
            f"{', '.join(conformance.SCHEDULES)}",
            file=sys.stderr,
        )
        return 2
    if args.world_size is not None:
        if args.world_size < 1:
            print(
                f"splitgrad distributed: --world-size must be >= 1, got {args.world_size}",
                file=sys.stderr,
            )
            return 2
        fixed = [c for c in checks if c != "p15"]
        if fixed:
            print(
                f"splitgrad distributed: --world-size {args.world_size} sets p15's pipeline "
                f"ranks only, but {fixed} run on fixed worlds (p14 and p16: 2 ranks, p16-pp: "
                "4); use --check p15 with it",
                file=sys.stderr,
            )
            return 2
    runs = {
        "p14": lambda: conformance.check_expert_parallel(args.backend, timeout_s=args.timeout),
        "p15": lambda: conformance.check_pipeline(
            args.backend,
            world_size=args.world_size or 2,
            schedules=schedules,
            recipes=recipes,
            timeout_s=args.timeout,
        ),
        "p16": lambda: conformance.merge_reports(
            f"P16 {args.backend} alone and under fully_shard",
            conformance.check_data_parallel(args.backend, timeout_s=args.timeout),
            conformance.check_fully_sharded(args.backend, timeout_s=args.timeout),
        ),
        "p16-pp": lambda: conformance.merge_reports(
            f"P16 x P15 {args.backend}: replicated and under fully_shard",
            conformance.check_pipeline_data_parallel(args.backend, timeout_s=args.timeout),
            conformance.check_pipeline_data_parallel(
                args.backend, timeout_s=args.timeout, fully_shard=True
            ),
        ),
    }
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
        status = "pass" if report.ok else "FAIL"
        failed |= not report.ok
        print(
            f"{name:7s} {status:5s}  {report.name}: {report.compared} comparisons, "
            f"{len(report.failures)} failures, {took:.1f} s"
        )
        for line in report.failures[:20]:
            print(f"        {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
