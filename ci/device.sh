#!/usr/bin/env bash
# One prepared run for a borrowed, offline GPU machine with little time on it (15 minutes of
# device time in all, 10 per command): it either passes, or fails with a message naming the
# GEMM, the layout and the shape. Bring a CUDA build of torch; nothing is fetched.
#
#   bash ci/device.sh            # on the GPU machine: under 10 minutes (BUDGET=560 s)
#
# From a session with the device tool: run(command="bash ci/device.sh", timeout_s=600); the
# tool's $OUT is where the files land.
#   bash ci/device.sh --dry-run  # anywhere: every step up to its first CUDA call
#
# Steps, each under its own timeout so one slow part cannot eat the rest:
#   env        the packages it needs importable (torch with CUDA, numpy, hypothesis, pytest,
#              pytest-xdist); optional ones from ci/wheels/ (dualpipe) when missing
#   install    pip install --no-build-isolation --no-deps -e . (else a PYTHONPATH tree)
#   cuda-tests the cuda-marked tests, verbose, JUnit XML; for tensor parallelism (one GPU, so no
#              real multi-rank NCCL): every TP module with a one-rank NCCL group is bitwise the
#              module without options (tests/test_tp_cuda.py), and the TP code paths run on CUDA
#              tensors over torch's fake process group, holding the fake-tensor bytes between B
#              and W (tests/test_bench_tensor_parallel.py); docs/tensor-parallel.md#on-a-gpu
#   trace      the cuda_trace tier (tests/test_cuda_trace.py) on this torch
#   bench      splitgrad bench --device cuda (GEMM paths printed per module)
#   memory     the queued-entry memory table on the GPU at real scale, against the fake-tensor
#              figures (python -m splitgrad.bench.entry_memory)
#   verify     splitgrad verify --device cuda (its GEMM paths printed), with what time is left
# SPLITGRAD_REQUIRE_FAST_PATHS=1 turns a fast path the GPU refuses where its capability says
# it runs into an error. Everything lands in $OUT (default ./device-out), few files, because
# the device tool brings back at most 8: device.json (the one JSON docs/gpu-without-gpu.md's
# GPU table is built from: python ci/device_report.py table device.json), gpu-table.md,
# summary.txt and logs.tar.gz. Exit status: 0 all passed, 1 a step failed or a fast path was
# missed, 2 no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-device-out}
DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash ci/device.sh [--dry-run]" >&2; exit 2 ;;
esac
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/splitgrad-device.XXXXXX")
: >"$WORK/steps.tsv"
export SPLITGRAD_REQUIRE_FAST_PATHS=1 PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}

# The whole run stays inside one device command (10 minutes at most): each step's limit is cut
# to what is left of BUDGET seconds, keeping 20 for the report; a step with no time left is
# recorded as skipped (exit 125).
BUDGET=${BUDGET:-560}
START=$(date +%s)
step() {  # step NAME SECONDS CMD...: run, keep its log and exit status, never stop the script
  local name=$1 limit=$2
  shift 2
  local start rc left
  start=$(date +%s)
  left=$((BUDGET - 20 - (start - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 5 ]; then
    rc=125
    echo "skipped: out of time" >"$WORK/$name.log"
  else
    timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
    rc=$?
  fi
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$limit" >>"$WORK/steps.tsv"
  echo "$name: exit $rc after $(($(date +%s) - start)) s (limit $limit s)"
}

# ---- env: what the steps import, and the optional packages carried in ci/wheels/ ----------
step env 30 "$PYTHON" - <<'PY'
import importlib, json, sys
need = ["torch", "numpy", "hypothesis", "pytest", "xdist", "setuptools"]
optional = ["dualpipe", "transformers"]
found = {}
for name in need + optional:
    try:
        mod = importlib.import_module(name)
        found[name] = getattr(mod, "__version__", "present")
    except Exception as exc:  # an import can fail in other ways than ImportError
        found[name] = None
        print(f"missing {name}: {type(exc).__name__}: {exc}")
print(json.dumps(found))
missing = [n for n in need if found[n] is None and n != "setuptools"]
sys.exit(f"required packages missing: {missing}" if missing else 0)
PY
if ! "$PYTHON" -c 'import dualpipe' 2>/dev/null; then
  # Optional (tests that need it skip); carried as PyPI's sdist since nothing can be fetched.
  "$PYTHON" -m pip install --quiet --no-index --no-build-isolation --no-deps \
    ci/wheels/dualpipe-1.0.0.tar.gz >"$WORK/dualpipe.log" 2>&1 || echo "dualpipe: not installed (optional)"
fi

# ---- install: editable, no network; a PYTHONPATH tree where setuptools is missing ------------
PYTEST_PLUGIN=()
if [ "$DRY" = 1 ]; then
  step install 60 "$PYTHON" -m pip install --dry-run --no-build-isolation --no-deps -e .
else
  step install 60 "$PYTHON" -m pip install --no-build-isolation --no-deps -e .
fi
if ! "$PYTHON" -c 'import splitgrad.impl, splitgrad.properties' 2>/dev/null; then
  mkdir -p "$WORK/src/splitgrad"
  for part in reference impl properties distributed bench cli; do ln -sfn "$PWD/$part" "$WORK/src/splitgrad/$part"; done
  export PYTHONPATH="$WORK/src${PYTHONPATH:+:$PYTHONPATH}"
  PYTEST_PLUGIN=(-p splitgrad.properties.pytest_plugin)
  echo "install: splitgrad importable through PYTHONPATH=$WORK/src"
fi

# ---- the device --------------------------------------------------------------------------
"$PYTHON" - >"$WORK/machine.json" <<'PY'
import json, platform, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "cuda_available": torch.cuda.is_available()}
if torch.cuda.is_available():
    info["device_name"] = torch.cuda.get_device_name()
    info["capability"] = list(torch.cuda.get_device_capability())
print(json.dumps(info))
PY
if ! "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  if [ "$DRY" = 0 ]; then
    echo "ci/device.sh: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') sees no CUDA device; run it on the GPU machine, or pass --dry-run" >&2
    exit 2
  fi
  echo "dry run: no CUDA here; each step runs up to its first CUDA call"
fi

# ---- the checks --------------------------------------------------------------------------
SG=("$PYTHON" -m splitgrad.cli)
if [ "$DRY" = 1 ]; then
  # pytest: collection is everything before the first test body (each needs the GPU).
  step cuda-tests 120 "$PYTHON" -m pytest "${PYTEST_PLUGIN[@]}" -p no:cacheprovider -m cuda --collect-only -q tests/
  step trace 120 "$PYTHON" -m pytest "${PYTEST_PLUGIN[@]}" -p no:cacheprovider --collect-only -q tests/test_cuda_trace.py
else
  step cuda-tests 120 "$PYTHON" -m pytest "${PYTEST_PLUGIN[@]}" -p no:cacheprovider -m cuda -v -n 4 \
    --junitxml="$WORK/cuda-tests.xml" tests/
  step trace 60 "$PYTHON" -m pytest "${PYTEST_PLUGIN[@]}" -p no:cacheprovider -n 8 \
    --junitxml="$WORK/trace.xml" tests/test_cuda_trace.py
fi
# bench, memory and verify stop at their CUDA check on a CPU (exit 2, one line): the dry run's
# end for them; memory-fake needs no GPU and runs everywhere (about 10 s; 90 s leaves room for a
# loaded CPU).
step bench 90 "${SG[@]}" bench --device cuda --no-compile --no-small --reps 5 --json "$WORK/bench.json"
step memory 90 "$PYTHON" -m splitgrad.bench.entry_memory --device cuda --json "$WORK/memory.json"
step memory-fake 90 "$PYTHON" -m splitgrad.bench.entry_memory --device fake --json "$WORK/memory-fake.json"
# Last: the longest, and it gets whatever the budget has left.
step verify 200 "${SG[@]}" verify --device cuda --examples 3 --quiet --json "$WORK/verify.json"

# ---- one JSON, the GPU table of docs/gpu-without-gpu.md, the logs -------------------------
dry_flag=()
[ "$DRY" = 1 ] && dry_flag=(--dry-run)
"$PYTHON" ci/device_report.py collect "$WORK" "$OUT/device.json" "${dry_flag[@]}"
status=$?
"$PYTHON" ci/device_report.py table "$OUT/device.json" >"$OUT/gpu-table.md"
"$PYTHON" ci/device_report.py summary "$OUT/device.json" | tee "$OUT/summary.txt"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" .
rm -rf "$WORK"
exit "$status"
