#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md, in stages that each fit one 10-minute device call:
#   bash benchmarks/gpu_suite.sh STAGE OUT_DIR
# Stages:
#   checks       tests/gpu/: the GPT and Llama equivalence on CUDA (every GPU), the copy kernels, the offload Adam,
#                a model compiled with offload=True against the same without, wav2vec2's CTC head and Whisper
#   offload      one GPU: Llama of width 4096 at two sizes (benchmarks/offload.py --sweep), fbmt and FSDP2, each with
#                and without offload (CPUOffloadPolicy): memory per layer; SIZES="L1,L2" and BACKEND override
#   kernels      one GPU: what merging products saves (gemm_merge.py), fbmt's kernels against torch's
#   1.36b-none   1.36B without recompute: fbmt (mincut, ZeRO-2), unmerged, FSDP2 + compile, interleaved
#   host-time    the HF 0.89B's step as the host sees it (benchmarks/host_time.py): launch time, regions still run
#                as traced, cProfile of one step, with regions compiled in the background and in the process
#   lora         transformers' LlamaForCausalLM of 0.89B fine-tuned through a peft LoRA adapter (rank 16, every
#                projection) against the full fine-tune, fbmt (mincut), interleaved: tokens/s and peak memory
#   1.36b-block  1.36B with block recompute: fbmt as CUDA graphs against FSDP2 + compile, interleaved
#   6.7b         6.7B with block recompute against FSDP2 + compile, interleaved
#   13b          13B with block recompute against FSDP2 + compile, one after the other (two do not fit)
#   hf-0.89b     transformers' LlamaForCausalLM of 0.89B, unmodified: fbmt (mincut, each called as HF documents and
#                with use_cache=False, with and without CUDA graphs; without on a card of 80 GiB) against FSDP2 +
#                compile (use_cache=False, its best), interleaved
#   first-step   start time: process start to the first finished step, cold and warm (the compile cache),
#                the 1.36B (block recompute) and transformers' 0.89B, against FSDP2 + per-layer compile, one GPU
#   lengths      tests/gpu/lengths_on_gpu.py (five lengths against eager, at most two programs, fbmt's warnings),
#                what a new length costs SDPA's kernels (attention_plans.py), then a stream of batches of lengths
#                64-2048: fbmt (one program of symbolic sizes) against FSDP2 + per-layer torch.compile(dynamic=True),
#                the 1.36B with block recompute, one GPU, cold caches
#   predict      the simulator against measurement after fbmt.calibrate(): the 1.36B (bf16, eager) on every
#                GPU for five strategy/recompute settings (benchmarks/predict.py)
#   fp8          FP8 products against bf16: the 1.36B (block recompute) tensorwise and rowwise, interleaved; the
#                6.7B (batch 2) tensorwise, one after the other (two do not fit one H200)
#   6.7b-one     one GPU: the 6.7B (batch 2, block recompute) against FSDP2 + compile, one after the other
#   fp8-loss     the main job's GPT at 24 layers of width 2048 (1.2B) on its corpus for 300 steps at learning
#                rate 3e-4, in bf16 and with --fp8 tensorwise: the held-out losses
#   fp8-base     FP8 (tensorwise) of this tree against the commit in .base (base_package.sh COMMIT .base) and bf16,
#                the 1.36B with block recompute, interleaved, one profiled step each; Inductor's caches off (--base)
#   restructure  1.36B with block recompute: this commit against the one before the move into compiler/,
#                integrations/ and tools/ (c27dbcd, written as fbmt_base by base_package.sh; carry .base where
#                the machine has no git history), interleaved
# Every stage installs fbmt into the machine's own python3 first.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=$1 out=$2
mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/install.txt 2>&1 || { cat /tmp/install.txt; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
gpus=$(nvidia-smi -L | wc -l)
run() {  # run NAME SECONDS ARGS...: one torchrun on every GPU, output to $out/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" torchrun --nproc_per_node="$gpus" --master_port=$((29500 + RANDOM % 1000)) "$@" \
    > "$out/$name.txt" 2>&1
  echo "rc=$?" >> "$out/$name.txt"
  grep -v "^W[0-9]" "$out/$name.txt" | tail -8
}
checks() {
  run gpt_on_gpu 300 tests/gpu/gpt_on_gpu.py
  timeout 120 python3 tests/gpu/copies_on_gpu.py 2>&1 | tail -2
  timeout 120 python3 tests/gpu/offload_on_gpu.py 2>&1 | tail -2
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 tests/gpu/writes_on_gpu.py 2>&1 | tail -4
  run offload_model_on_gpu 240 tests/gpu/offload_model_on_gpu.py
  run hf_on_gpu 300 tests/gpu/hf_on_gpu.py
  CUDA_VISIBLE_DEVICES=0 timeout 240 python3 tests/gpu/speech_on_gpu.py 2>&1 | grep -v Warn | tail -5
}
b136="--config 1.36b --batch 8 --seq 2048 --loss-in-model"
case $stage in
  checks) checks ;;
  offload)
    CUDA_VISIBLE_DEVICES=0 timeout 590 python3 benchmarks/offload.py --sweep "${SIZES:-2,4}" \
      --backend "${BACKEND:-eager}" --out "$out/offload" 2>&1 | grep "^==" ;;
  kernels)
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/gemm_merge.py --out "$out/gemm_merge.json"
    CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/gpu_kernels.py --numel 680000000 > "$out/gpu_kernels.txt" 2>&1
    tail -12 "$out/gpu_kernels.txt" ;;
  1.36b-none)
    run 1.36_none 230 benchmarks/gpu_train.py $b136 --remat none --warmup 2 --steps 30 --interleave \
      --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-nomerge,fsdp2-compile --out "$out/1.36_none.json" ;;
  first-step)
    CUDA_VISIBLE_DEVICES=0 timeout 290 python3 benchmarks/first_step.py --config 1.36b --remat block \
      --fbmt fbmt-inductor --out "$out/first_step_1.36b.json" > "$out/first_step_1.36b.txt" 2>&1
    tail -10 "$out/first_step_1.36b.txt"
    CUDA_VISIBLE_DEVICES=0 timeout 290 python3 benchmarks/first_step.py --config 0.89b --hf --batch 4 --remat mincut \
      --fbmt fbmt-inductor-mincut --out "$out/first_step_hf.json" > "$out/first_step_hf.txt" 2>&1
    tail -10 "$out/first_step_hf.txt" ;;
  lengths)
    CUDA_VISIBLE_DEVICES=0 timeout 240 python3 tests/gpu/lengths_on_gpu.py > "$out/lengths_on_gpu.txt" 2>&1
    grep -v "Warning\|warn" "$out/lengths_on_gpu.txt" | tail -14
    CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/attention_plans.py > "$out/attention_plans.txt" 2>&1
    tail -2 "$out/attention_plans.txt"
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/lengths.py --config 1.36b --remat block --steps 24 --timeout 160 \
      --out "$out/lengths.json" > "$out/lengths.txt" 2>&1
    tail -8 "$out/lengths.txt" ;;
  predict)
    timeout 560 python3 benchmarks/predict.py --ranks "$gpus" --config 1.36b --rounds 1 > "$out/predict.txt" 2>&1
    echo "rc=$?" >> "$out/predict.txt"
    grep -v "^W[0-9]\|USDT" "$out/predict.txt" | tail -12 ;;
  hf-0.89b)  # five methods need an H200's memory; an 80 GiB card runs the three without CUDA graphs
    methods=fbmt-inductor-mincut,fbmt-inductor-mincut-graph,fbmt-inductor-mincut-nocache,fbmt-inductor-mincut-nocache-graph
    steps=20
    if [ "$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)" -lt 100000 ]; then
      methods=fbmt-inductor-mincut,fbmt-inductor-mincut-nocache steps=30
    fi
    run hf_0.89b 420 benchmarks/gpu_train.py --config 0.89b --hf --batch 4 --seq 2048 --remat mincut --warmup 3 \
      --steps $steps --interleave --methods $methods,fsdp2-compile --out "$out/hf_0.89b.json" ;;
  host-time)
    run host_time 300 benchmarks/host_time.py ;;
  lora)
    run lora_0.89b 400 benchmarks/gpu_train.py --config 0.89b --hf --batch 4 --seq 2048 --remat mincut --warmup 3 \
      --steps 15 --interleave --methods fbmt-inductor-mincut,fbmt-inductor-mincut-lora --out "$out/lora_0.89b.json" ;;
  1.36b-block)
    run 1.36_block 150 benchmarks/gpu_train.py $b136 --remat block --warmup 3 --steps 20 --interleave \
      --methods fbmt-inductor-graph,fsdp2-compile --out "$out/1.36_block.json" ;;
  6.7b)
    run 6.7_block 330 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 3 \
      --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/6.7_block.json" ;;
  fp8)
    run fp8_1.36 260 benchmarks/gpu_train.py $b136 --remat block --warmup 3 --steps 12 --interleave \
      --methods fbmt-inductor,fbmt-inductor-fp8,fbmt-inductor-fp8-rowwise --out "$out/fp8_1.36.json"
    run fp8_6.7 320 benchmarks/gpu_train.py --config 6.7b --batch 2 --seq 2048 --remat block --steps 12 --warmup 3 \
      --loss-in-model --methods fbmt-inductor-fp8,fbmt-inductor --out "$out/fp8_6.7.json" ;;
  fp8-loss)
    for fp8 in "" "--fp8 tensorwise"; do
      timeout 280 python3 -m fbmt.train --steps 300 --layers 24 --d-model 2048 --heads 16 --backend inductor --lr 3e-4 \
        --save-every 0 --resume no --checkpoints "/tmp/fp8-loss${fp8// /}" $fp8 > "$out/fp8_loss${fp8// /}.txt" 2>&1
      grep "fbmt.train: loss" "$out/fp8_loss${fp8// /}.txt"
    done ;;
  6.7b-one)
    CUDA_VISIBLE_DEVICES=0 timeout 330 torchrun --nproc_per_node=1 --master_port=$((29500 + RANDOM % 1000)) \
      benchmarks/gpu_train.py --config 6.7b --batch 2 --seq 2048 --remat block --steps 12 --warmup 3 --loss-in-model \
      --methods fbmt-inductor,fsdp2-compile --out "$out/6.7_one_gpu.json" > "$out/6.7_one_gpu.txt" 2>&1
    grep -v "^W[0-9]" "$out/6.7_one_gpu.txt" | tail -4 ;;
  13b)
    run 13_block 330 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 \
      --loss-in-model --methods fbmt-inductor,fsdp2-compile --out "$out/13_block.json" ;;
  restructure)
    [ -d .base/fbmt_base ] || bash benchmarks/base_package.sh c27dbcd .base > /dev/null || { echo "carry .base"; exit 1; }
    run restructure_1.36_block 300 benchmarks/gpu_train.py $b136 --remat block --warmup 3 --steps 30 --interleave \
      --base .base --methods base-fbmt-inductor,fbmt-inductor --out "$out/restructure_1.36_block.json" ;;
  fp8-base)
    [ -d .base/fbmt_base ] || { echo "write the commit to compare with first: bash benchmarks/base_package.sh COMMIT .base"; exit 1; }
    run fp8_base_1.36 300 benchmarks/gpu_train.py $b136 --remat block --warmup 4 --steps 12 --interleave --base .base \
      --profile --methods fbmt-inductor,fbmt-inductor-fp8,base-fbmt-inductor-fp8 --out "$out/fp8_base_1.36.json" ;;
  *) echo "unknown stage $stage (see the head of $0)"; exit 2 ;;
esac
