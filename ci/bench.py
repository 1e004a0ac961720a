"""CI entry point for the benchmark: ``python ci/bench.py [--quick] [--json PATH]``.

A thin wrapper around ``splitgrad bench`` (``splitgrad.bench.modules.main``); it prints the
ratio table and never fails on a missed target (a benchmark, not a test).
"""

from __future__ import annotations

import sys

from splitgrad.bench.modules import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
