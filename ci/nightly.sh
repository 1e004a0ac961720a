#!/usr/bin/env bash
# The long run: every test including `slow` ones (mutation check, benchmark smoke run) under the
# `nightly` hypothesis profile, then the full verify campaign and the mutant table.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip install --quiet "torch==2.13.0" --extra-index-url https://download.pytorch.org/whl/cpu
"$PYTHON" -m pip install --quiet -e ".[test]"
export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-nightly}
"$PYTHON" -m pytest -n auto -p no:cacheprovider "$@"
splitgrad verify --profile nightly --json verify-nightly.json
"$PYTHON" ci/mutants.py --full --markdown
