#!/usr/bin/env bash
# The torch-version matrix: each torch in its own venv, the tests that version is
# promised to pass. Not part of .ci/run: every torch but the CPU 2.13 wheel is a CUDA build of
# several GB from the package index (it runs on the CPU).
#
#   bash ci/torch_matrix.sh [VERSION ...]      default: 2.14.1 2.11.0 2.8.0
#
#   newest installable here  2.14.1  the whole suite but the slow marks
#   torch.compile minimum    2.11    eager modules, the harness, torch.compile support
#   eager minimum            2.8     eager modules and the harness (compile raises TorchTooOld)
#
# Pipelines (P15, ZBV/DualPipeV on gloo) are checked on 2.13+ only: on 2.8 and 2.10 torch's own
# gloo pipelines fail ("Pair is not connected", plain nn.Linear too). MATRIX_DIR (default
# .torch-matrix, git-ignored) keeps the venvs between runs; a summary line per version ends the
# log, and the exit status is 1 if any version failed.
set -uo pipefail
cd "$(dirname "$0")/.."

MATRIX_DIR=${MATRIX_DIR:-.torch-matrix}
VERSIONS=("$@")
[ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.14.1 2.11.0 2.8.0)
mkdir -p "$MATRIX_DIR"

# Eager modules and the harness: what every supported torch must pass.
EAGER=(
  tests/test_reference_gradcheck.py tests/test_reference_fp8.py
  tests/test_contract_errors.py tests/test_contract_split.py tests/test_contract_input_only.py
  tests/test_impl_vs_reference.py tests/test_impl_bitwise.py tests/test_impl_empty.py
  tests/test_impl_fp8.py tests/test_impl_grouped.py tests/test_impl_store.py
  tests/test_autocast_modules.py tests/test_autocast_axis.py tests/test_dtype_moves.py
  tests/test_convert.py tests/test_properties_pinned.py tests/test_determinism.py
  tests/test_module_protocol.py
)
version_at_least() { # version_at_least 2.11.0 2.11 -> true
  python3 - "$1" "$2" <<'EOF'
import sys
def mm(v): return tuple(int(p) for p in v.split("+")[0].split(".")[:2])
sys.exit(0 if mm(sys.argv[1]) >= mm(sys.argv[2]) else 1)
EOF
}

status=0
summary=()
for v in "${VERSIONS[@]}"; do
  venv="$MATRIX_DIR/torch-$v"
  log="$MATRIX_DIR/torch-$v.log"
  echo "=== torch $v ($venv, log $log)"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv" || { summary+=("$v: venv failed"); status=1; continue; }
  fi
  py="$venv/bin/python"
  if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$v')" 2>/dev/null; then
    "$py" -m pip install --quiet "torch==$v" || { summary+=("$v: torch install failed"); status=1; continue; }
  fi
  "$py" -m pip install --quiet -e ".[test]" || { summary+=("$v: install failed"); status=1; continue; }
  tests=("${EAGER[@]}")
  version_at_least "$v" 2.11 && tests+=(tests/test_compile.py)
  version_at_least "$v" 2.13 && tests=(tests)  # newest: everything CI runs
  start=$(date +%s)
  HYPOTHESIS_PROFILE=ci "$py" -m pytest -n auto -p no:cacheprovider -q -m "not slow" \
    "${tests[@]}" >"$log" 2>&1
  rc=$?
  {
    # The eager minimum also says what it refuses: torch.compile naming both versions.
    "$py" -c "
import torch, splitgrad.impl as impl
m = impl.Linear(8, 4, delay_wgrad_compute=True)
x = torch.randn(2, 8, requires_grad=True)
m(x).sum().backward(); m.backward_dw()
assert m.weight.grad is not None
print('eager Linear with backward_dw: ok on torch', torch.__version__)
"
  } >>"$log" 2>&1 || rc=1
  tail_line=$(grep -E "passed|failed|error" "$log" | tail -1)
  summary+=("$v: rc=$rc, $(( $(date +%s) - start )) s, ${tail_line}")
  [ $rc -ne 0 ] && status=1
done
echo
printf '%s\n' "${summary[@]}"
exit $status
