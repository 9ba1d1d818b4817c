#!/usr/bin/env bash
# The tests that lean most on torch's internals (tracing, stamped blocks, symbolic sizes, a model's own
# checkpoints, Hugging Face's gradient checkpointing) on a newer torch than test.sh installs, in a venv that
# holds only that torch: a private function a new release renames fails here, not in a user's trace.
#   bash scripts/newer_torch.sh [PYTEST_ARGS...]      TORCH=2.14.1 (default) VENV=/tmp/fbmt-torch-$TORCH
# CI runs it after test.sh. The default is the newest release this machine keeps on disk, so pip installs
# it without a download; where pip cannot install it at all, the script says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.14.1}
VENV=${VENV:-/tmp/fbmt-torch-$TORCH}
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  echo "newer_torch: torch $TORCH into a venv at $VENV"
  # beside this Python's packages (transformers, numba-cuda, fbmt's editable install and its built
  # extension, which links no libtorch): only torch is installed again, not every test requirement
  python3 -m venv --system-site-packages "$VENV"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH" > "$VENV/torch.log" 2>&1; then
    tail -3 "$VENV/torch.log"
    echo "newer_torch: pip could not install torch $TORCH here; skipped"
    exit 0
  fi
fi
# the passes whose graphs come from torch's autograd and decompositions (recompute, the loss, linear, FP8);
# scheduling and merging rework fbmt's own graph, and the suite runs them on torch 2.13
tests=(tests/test_torch_modules.py tests/test_stamp.py tests/test_dynamic.py
  tests/test_habits.py::test_hugging_faces_gradient_checkpointing_trains_as_eager_and_says_remat_decides
  tests/passes/test_remat.py tests/passes/test_loss.py tests/passes/test_linear.py tests/passes/test_fp8.py
  tests/passes/test_shard.py tests/passes/test_blocks.py tests/passes/test_verify.py tests/passes/test_runner.py)
[ $# -gt 0 ] && tests=("$@")
PYTHON="$VENV/bin/python" exec bash test.sh "${tests[@]}"
