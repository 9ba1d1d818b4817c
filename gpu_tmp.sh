#!/usr/bin/env bash
# One device call: the HF 0.89B's default call against use_cache=False and the peer, then tests/gpu's HF and GPT checks.
set -uo pipefail
out=$1
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/install.txt 2>&1 || { cat /tmp/install.txt; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
git log --oneline -1 2>/dev/null
timeout 330 torchrun --nproc_per_node=1 --master_port=29611 benchmarks/gpu_train.py --config 0.89b --hf --batch 4 --seq 2048 \
  --remat mincut --warmup 3 --steps 20 --interleave \
  --methods fbmt-inductor-mincut,fbmt-inductor-mincut-nocache,fsdp2-compile --out "$out/hf_0.89b.json" > "$out/hf_0.89b.txt" 2>&1
echo "hf rc=$?"; grep -v "^W[0-9]" "$out/hf_0.89b.txt" | tail -14
timeout 130 torchrun --nproc_per_node=1 --master_port=29612 tests/gpu/hf_on_gpu.py > "$out/hf_on_gpu.txt" 2>&1
echo "hf_on_gpu rc=$?"; tail -4 "$out/hf_on_gpu.txt"
timeout 90 torchrun --nproc_per_node=1 --master_port=29613 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu.txt" 2>&1
echo "gpt_on_gpu rc=$?"; tail -4 "$out/gpt_on_gpu.txt"
