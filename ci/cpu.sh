#!/usr/bin/env bash
# The whole test suite on a fresh CPU-only Linux machine: install, then pytest under the `ci`
# hypothesis profile. This is the README's test command and what .ci/run calls.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
# A CPU build of torch, explicitly, unless a usable torch (>= 2.8, e.g. your CUDA build) is
# already there: a bare `torch` requirement would pull a multi-GB CUDA build.
if ! "$PYTHON" -c 'import sys, torch; sys.exit(tuple(map(int, torch.__version__.split("+")[0].split(".")[:2])) < (2, 8))' 2>/dev/null; then
  "$PYTHON" -m pip install --quiet --retries 1 "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
fi
# [model]: transformers, for the real-model example's test (tests/test_real_model.py).
# [dualpipe]: DeepSeek's DualPipe, for tests/test_distributed_dualpipe.py and its example in
# docs/distributed.md; installed from the copy of PyPI's sdist kept in ci/wheels/, so it needs no index of its own.
"$PYTHON" -m pip install --quiet ci/wheels/dualpipe-1.0.0.tar.gz
"$PYTHON" -m pip install --quiet -e ".[test,model,dualpipe]"

export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-ci}
# `slow` tests (the mutation check, the benchmark smoke run) are left to `ci/nightly.sh`.
start=$(date +%s)
"$PYTHON" -m pytest -n auto -p no:cacheprovider -m "not slow" "$@"
echo "test suite took $(( $(date +%s) - start )) s (HYPOTHESIS_PROFILE=$HYPOTHESIS_PROFILE)"
