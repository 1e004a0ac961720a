#!/usr/bin/env bash
# The whole suite on a CUDA machine, `cuda`-marked tests and the cuda_trace tier included, under
# the `gpu` hypothesis profile. Bring your own CUDA build of torch (this script never installs
# torch). For a short borrowed, offline GPU session use ci/device.sh instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"ci/gpu.sh: torch {torch.__version__} sees no CUDA device; install a CUDA build of torch")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}")
PY
"$PYTHON" -m pip install --quiet -e ".[test]"

export HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu}
# A fast path this GPU refuses where its compute capability says it runs fails the run, naming
# the GEMM, layout and shape (splitgrad.impl.gemm_paths), instead of a silent fallback.
export SPLITGRAD_REQUIRE_FAST_PATHS=${SPLITGRAD_REQUIRE_FAST_PATHS:-1}
"$PYTHON" -m pytest -n "${PYTEST_WORKERS:-4}" -p no:cacheprovider "$@"
# The CUDA paths once more, alone and verbose, so their result is easy to find in the log.
"$PYTHON" -m pytest -m cuda -v -p no:cacheprovider
