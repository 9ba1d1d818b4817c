#!/usr/bin/env bash
# The main job on a fresh machine: install, then train a small GPT with fbmt.compile on 2 CPU ranks
# (or every GPU). Extra arguments go to `python -m fbmt.train` (see --help).
set -euo pipefail
cd "$(dirname "$0")"
bash scripts/install.sh
exec "${PYTHON:-python3}" -m fbmt.train "$@"
