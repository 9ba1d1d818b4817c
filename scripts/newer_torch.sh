#!/usr/bin/env bash
# The tests that lean most on torch's internals (tracing, stamped blocks, symbolic sizes, a model's own
# checkpoints, Hugging Face's gradient checkpointing) on a newer torch than test.sh installs, in a venv of
# their own: a private function a new release renames fails here, not in a user's trace.
#   bash scripts/newer_torch.sh [PYTEST_ARGS...]      TORCH=2.14.1 (default) VENV=/tmp/fbmt-torch-$TORCH
# CI runs it after test.sh. The default is the newest release this machine keeps on disk, so pip installs
# it without a download; where pip cannot install it at all, the script says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.14.1}
VENV=${VENV:-/tmp/fbmt-torch-$TORCH}
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  echo "newer_torch: torch $TORCH into a venv at $VENV"
  python3 -m venv "$VENV"
  if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$TORCH" > "$VENV/torch.log" 2>&1; then
    tail -3 "$VENV/torch.log"
    echo "newer_torch: pip could not install torch $TORCH here; skipped"
    exit 0
  fi
fi
tests=(tests/test_torch_modules.py tests/test_stamp.py tests/test_dynamic.py tests/test_habits.py tests/passes)
[ $# -gt 0 ] && tests=("$@")
PYTHON="$VENV/bin/python" exec bash test.sh "${tests[@]}"
