"""splitgrad.cli — the ``splitgrad`` command: ``splitgrad verify`` (the property campaign,
:mod:`splitgrad.properties.front.verify`), ``splitgrad bench`` (speed and memory ratios,
:mod:`splitgrad.bench.modules`), ``splitgrad distributed`` (P14-P16, P19, :mod:`.distributed`),
``splitgrad pipeline`` and ``splitgrad moe`` (what the split buys across ranks,
:mod:`splitgrad.bench.pipeline`, :mod:`splitgrad.bench.moe`), ``splitgrad launch`` (per-call
cost against the thinnest split, :mod:`splitgrad.bench.launch`).

It sits above every other package: it may import any of them, and none imports it. Each command
is imported only when run, so ``splitgrad --help`` stays cheap."""

from __future__ import annotations

import sys

USAGE = """usage: splitgrad [--version] {verify,bench,distributed,pipeline,moe,launch} [options]

Split backward (deferred weight gradients) for PyTorch linear layers: check an implementation
against the contract in SPEC.md, or measure splitgrad.impl.

commands:
  verify   check an implementation against the reference and SPEC.md (splitgrad verify --help)
  bench    print speed and memory ratios of splitgrad.impl (splitgrad bench --help)
  distributed
           run P14-P16 and P19 on spawned gloo ranks (splitgrad distributed --help)
  pipeline step time, bubble fraction and memory held between B and W under the pipeline
           schedules, splitgrad's dw_builder next to torch's own split (splitgrad pipeline --help)
  moe      the share of the expert-parallel dispatch all-to-all hidden behind backward_dw()
           (splitgrad moe --help)
  launch   per-call CPU cost of splitgrad.impl's modules at small shapes against the thinnest
           Python split and torch.nn, and Python calls per step (splitgrad launch --help)

options:
  -h, --help  show this message and exit
  --version   print the installed splitgrad version and exit
"""


def version() -> str:
    """The installed distribution's version (``unknown`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("splitgrad")
    except PackageNotFoundError:
        return "unknown"


COMMANDS = ("verify", "bench", "distributed", "pipeline", "moe", "launch")


def _usage_error(message: str) -> int:
    """A refused command line, as every subcommand reports one (argparse's way): exit status 2."""
    print(USAGE.splitlines()[0], file=sys.stderr)
    print(f"splitgrad: error: {message}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0
    if not argv:
        return _usage_error("a command is required (splitgrad --help lists them)")
    if argv[0] in ("--version", "-V"):
        print(f"splitgrad {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command == "verify":
        from splitgrad.properties.front.verify import main as verify_main

        return verify_main(rest)
    if command == "bench":
        from splitgrad.bench.modules import main as bench_main

        return bench_main(rest)
    if command == "distributed":
        from .distributed import main as distributed_main

        return distributed_main(rest)
    if command == "pipeline":
        from splitgrad.bench.pipeline import pipeline_main

        return pipeline_main(rest)
    if command == "moe":
        from splitgrad.bench.moe import moe_main

        return moe_main(rest)
    if command == "launch":
        from splitgrad.bench.launch import main as launch_main

        return launch_main(rest)
    return _usage_error(f"unknown command {command!r}")
