#!/usr/bin/env bash
# Write an earlier commit's fbmt package as `fbmt_base` under a folder, for benchmarks/gpu_train.py's
# base-* methods (--base FOLDER): both versions then run in one process, their steps interleaved.
#     bash benchmarks/base_package.sh COMMIT FOLDER
# Every `fbmt` token becomes `fbmt_base` (imports, sys.modules lookups, the fbmt:: custom ops), so the
# two packages share nothing; names like `fbmt_phase` are one token and stay as they are.
set -euo pipefail
commit=$1 folder=$2
cd "$(dirname "$0")/.."
mkdir -p "$folder"
tmp=$(mktemp -d)
git archive "$commit" fbmt | tar -x -C "$tmp"
rm -rf "$folder/fbmt_base"
mv "$tmp/fbmt" "$folder/fbmt_base"
rmdir "$tmp"
find "$folder/fbmt_base" -name '*.py' -exec sed -i -E 's/\bfbmt\b/fbmt_base/g' {} +
echo "base_package: fbmt at $(git rev-parse --short "$commit") as $folder/fbmt_base"
