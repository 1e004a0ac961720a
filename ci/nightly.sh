#!/usr/bin/env bash
# The long run: every test including `slow` ones (mutation check, benchmark smoke run) under the
# `nightly` hypothesis profile, then the full verify campaign and the mutant table.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# A CPU build of torch, explicitly, unless a usable torch (>= 2.8, e.g. your CUDA build) is
# already there: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PYTHON" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 8))' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet --retries 1 "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
fi
"$PYTHON" -m pip install --quiet -e ".[test]"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-nightly}
"$PYTHON" -m pytest -n auto -p no:cacheprovider "$@"
splitgrad verify --profile nightly --json verify-nightly.json
"$PYTHON" ci/mutants.py --full --markdown
# The distributed checks with FP8 on 4 ranks, and what the split buys across ranks (figures).
splitgrad distributed --check p15 --world-size 4 --recipe none,delayed
splitgrad distributed --check p19 --profile nightly
splitgrad pipeline --steps 5 --json pipeline-nightly.json --timeline pipeline-timeline.json
splitgrad moe
