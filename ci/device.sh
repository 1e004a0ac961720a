#!/usr/bin/env bash
# One short, prepared run for a borrowed GPU machine with little time on it (e.g. 15 minutes in
# all): the CUDA paths first, then the benchmark figures the README asks for, each step under its
# own timeout so one slow part cannot eat the rest. Everything is written to $OUT (default:
# ./device-out) for the README and the issue note. Bring a CUDA build of torch.
#
#   bash ci/device.sh            # about 8 minutes on one H200
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-device-out}
mkdir -p "$OUT"

step() {  # step NAME SECONDS CMD...: run, keep its log and exit status, never stop the script
  local name=$1 limit=$2
  shift 2
  local start
  start=$(date +%s)
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
}

"$PYTHON" -c 'import torch, sys; print(torch.__version__, torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name()); sys.exit(not torch.cuda.is_available())' \
  | tee "$OUT/summary.txt" || { echo "no CUDA device: nothing to do here"; exit 2; }
"$PYTHON" -m pip install --quiet -e ".[test]" >"$OUT/install.log" 2>&1

# 1. The CUDA-marked tests (fused main_grad in the GEMM, grouped GEMM, FP8 scaled GEMM, the side
#    stream), verbose, then the CUDA cells of the property campaign.
step cuda-tests 240 "$PYTHON" -m pytest -m cuda -v -p no:cacheprovider -x
step verify-cuda 150 splitgrad verify --device cuda --examples 10 --json "$OUT/verify.json"
# 2. The benchmark: main table at the default shapes, small-shape per-call rows, FP8.
step bench 180 splitgrad bench --no-compile --reps 5 --small-reps 101 --json "$OUT/bench.json"
cat "$OUT/summary.txt"
