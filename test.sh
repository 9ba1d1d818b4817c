#!/usr/bin/env bash
# The test suite on a fresh machine: install, then pytest (multi-rank tests spawn gloo ranks on CPU).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh --test
exec "${PYTHON:-python3}" -m pytest -q "$@"
