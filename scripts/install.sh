#!/usr/bin/env bash
# Install what fbmt needs into the current Python: torch (the CPU build 2.13.0 where none is present;
# a machine with its own torch, such as a GPU image, keeps it), then fbmt itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# pip's own notices (running as root, index locations it skips) are not errors: keep its output to the rest,
# and its exit status (an install that failed stops here, not at a test's import)
pip_install() {
  local out status=0
  out=$("$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1) || status=$?
  printf '%s\n' "$out" | grep -v "^WARNING: Running pip as the 'root' user\|^WARNING: Location '.*' is ignored\|^$" || true
  return $status
}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "install: torch 2.13.0 (CPU build)"
  pip_install torch==2.13.0
fi
"$PY" -c "import numpy" 2>/dev/null || pip_install numpy
"$PY" -c "import setuptools" 2>/dev/null || pip_install setuptools
"$PY" -c "import pybind11" 2>/dev/null || pip_install pybind11   # builds fbmt._C (the CPU Adam); no libtorch
if [ "${1:-}" = "--test" ]; then
  "$PY" -c "import pytest, pytest_timeout" 2>/dev/null || pip_install pytest pytest-timeout
  # format + lint (pyproject.toml); pinned, since another ruff formats differently
  "$PY" -m ruff --version 2>/dev/null | grep -qx "ruff 0.17.6" || pip_install ruff==0.17.6
  # The numba-CUDA kernels are tested under numba's CUDA simulator on machines without a GPU; numba's own
  # `numba.cuda` (deprecated, without default_stream) is not enough: numba-cuda provides `numba_cuda`.
  "$PY" -c "import numba_cuda" 2>/dev/null || pip_install numba-cuda
  # Hugging Face models as users run them (tests/test_transformers.py, examples/hf_trainer.py); pinned, since
  # their modeling code changes between releases. A machine with its own (a GPU image) keeps it.
  "$PY" -c "import transformers, accelerate" 2>/dev/null || pip_install transformers==5.24.0 accelerate==1.15.0
  # LoRA adapters as users add them (tests/test_adapters.py); its own requirements are transformers' and
  # accelerate's, so without them pip cannot move either
  "$PY" -c "import peft" 2>/dev/null || pip_install --no-deps peft==0.21.2
  # fbmt.viz and the notebooks, which the tests execute headlessly in a Jupyter kernel
  "$PY" -c "import matplotlib, pydot, nbclient, nbformat, ipykernel" 2>/dev/null ||
    pip_install matplotlib pydot nbclient nbformat ipykernel
  if ! command -v dot >/dev/null; then  # Graphviz lays out fbmt.viz.graph's pictures
    echo "install: graphviz (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends graphviz >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends graphviz >/dev/null; }
  fi
fi
# fbmt itself, in editable mode: skipped where this folder is what `import fbmt` finds and the native
# extension is newer than its sources (a reinstall rebuilds the extension, which takes minutes).
ROOT=$(pwd)
if ! (cd / && "$PY" - "$ROOT" 2>/dev/null <<'EOF'
import glob, os, sys
import fbmt, fbmt._C
root = sys.argv[1]
assert os.path.dirname(os.path.abspath(fbmt.__file__)) == os.path.join(root, "fbmt")
built = os.path.getmtime(fbmt._C.__file__)
sources = glob.glob(os.path.join(root, "fbmt", "csrc", "*")) + [os.path.join(root, f) for f in ("setup.py", "pyproject.toml")]
assert all(os.path.getmtime(f) <= built for f in sources if os.path.isfile(f))
EOF
); then
  pip_install --no-build-isolation --no-deps -e .
fi
# from outside this folder, so that a failed install is not hidden by the sources beside the working directory
(cd / && "$PY" -c "import torch, fbmt, fbmt._C; print(f'install: fbmt {fbmt.__version__} on torch {torch.__version__}')")
