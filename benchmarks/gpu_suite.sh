#!/usr/bin/env bash
# The GPU measurements behind BENCHMARKS.md, in stages that each fit one 10-minute device call:
#   bash benchmarks/gpu_suite.sh STAGE OUT_DIR
# STAGE: example | 1.36b | 6.7b | 13b | final (earlier sessions' stages) | a | b | best (session 3's
# table: every method trains the model with the loss inside; a also runs the GPU checks) | direct
# (compile(direct_grads=True)) | c (session 4: the copy kernel's tile sweep, GPU checks, 6.7B and 1.36B
# without recompute, default vs direct_grads vs the peer) | d (session 4: every row again, after the changes
# c measured and the last block saved) | e (session 4's table: every row after the last block's memory
# guard, fbmt's best 6.7B setting, and 6.7B with the peer run first; logs in one tarball, as the device
# tool brings back at most 8 files) | f (session 5: the trailing blocks saved, 6.7B and 13B, with the
# GPUs' clocks and power sampled) | g (session 5: GPU checks; 1.36B rows with the compute stream's kernels
# by name, and with ZeRO-2 blocks) | h1, h2 (session 5's table, in two calls) | i (session 5:
# remat="mincut" at 1.36B without recompute, and the GPU checks) | j (the same over 16 steps) | k (session 6:
# the GPU checks, then interleaved comparisons at 1.36B without recompute and at 6.7B) | l (the same after the
# narrow wire) | m, n (session 6's table, in two calls) | o (the 1.36B rows after two ranks' exchange became an
# all-gather) | p (6.7B after it) | q (session 7: late recompute, 6.7B and 1.36B with block recompute) | r, s (session 7's
# table, in two calls) | t (1.36B over more rounds, the step's start, fbmt's best 6.7B setting) | u (1.36B
# with block recompute over more rounds) | v (session 8: the GPU checks with cuda_graph=True; 1.36B with block
# recompute, fbmt with and without CUDA graphs against FSDP2 + compile; the main job with --cuda-graph) | w (the
# 1.36B step with block recompute as CUDA graphs, profiled: where it still idles) | x (that row over 24 rounds
# against both peers, then one after the other for each method's reserved memory) | y (CUDA graphs on the other
# rows: 1.36B without recompute, 6.7B with block recompute) | z (the main job with and without --cuda-graph; 1.36B without recompute
# over 20 rounds) | s9a, s9b (session 9: the first block's weight products moved after the embedding's
# reduce-scatter start, NOTE: [Tail], against the backward in trace order: 1.36B without recompute, profiled;
# 6.7B and 1.36B with block recompute) | s9c (the copy kernel's tiles beside products, the GPU checks, the sum
# kernel's new tile against the old at 1.36B without recompute) | s9d (rounds in balanced orders: the 1.36B rows
# against FSDP2 + compile over 40-60 rounds, and the sum kernel's two tiles side by side) | s9e (6.7B on the final
# code) | s9f (13B on the final code) | s10a (session 10: what merging the products that share an input would
# save, benchmarks/gemm_merge.py; fbmt's fused Adam against torch's; 1.36B without recompute with fbmt's Adam) |
# s10b (the merge pass, NOTE: [Merged products]: the GPU checks with the Llama leg; 1.36B with and without it
# against FSDP2 + compile, without recompute and with block recompute as CUDA graphs) | s10c (6.7B and 13B) |
# s10d (the merged products' cost: 1.36B without recompute profiled with and without; 6.7B with and without) |
# s10e (after NOTE: [Cats of shared reads]: the GPU checks; 1.36B without recompute with and without, profiled too) |
# s10f (6.7B and 1.36B with block recompute, merged, against the peer) | s10g (13B, merged, against the peer).
# Every stage installs fbmt into the machine's own python3 first.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=$1 out=$2
mkdir -p "$out"
python3 -m pip install -q --no-build-isolation --no-deps -e . > /tmp/install.txt 2>&1 || { cat /tmp/install.txt; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
logs=$out
run() {  # run NAME SECONDS ARGS...: one torchrun on every GPU, output to $logs/NAME.txt
  local name=$1 limit=$2; shift 2
  echo "== $name"
  timeout "$limit" torchrun --nproc_per_node="$(nvidia-smi -L | wc -l)" --master_port=$((29500 + RANDOM % 1000)) "$@" \
    > "$logs/$name.txt" 2>&1
  echo "rc=$?" >> "$logs/$name.txt"
  grep -v "^W[0-9]" "$logs/$name.txt" | tail -8
}
gpu_checks() {  # gpu_checks SUFFIX: tests/gpu/gpt_on_gpu.py on 2 GPUs, its log to $out/gpt_on_gpu_SUFFIX.txt
  echo "== gpt_on_gpu"
  timeout 280 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu_$1.txt" 2>&1
  echo "rc=$?" >> "$out/gpt_on_gpu_$1.txt"; grep -v "^W[0-9]" "$out/gpt_on_gpu_$1.txt" | tail -4
}
case $stage in
  example)
    run bmtrain_example 90 examples/bmtrain_gpt.py --steps 60 --save /tmp/bmtrain_gpt.pt ;;
  1.36b)
    run b1.36_none 290 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 8 --warmup 2 --out "$out/b1.36_none.json"
    run b1.36_block 270 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 8 --warmup 2 --out "$out/b1.36_block.json" ;;
  6.7b)
    run b6.7_block 380 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 6 --warmup 2 --out "$out/b6.7_block.json"
    run b6.7_best 180 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat none --steps 6 --warmup 2 --methods fbmt-inductor --out "$out/b6.7_best.json" ;;
  13b)
    run b13_block 560 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --out "$out/b13_block.json" ;;
  final)  # after the memory fixes: the peers again, remat="selective", and fbmt's best 6.7B setting
    m=fbmt-inductor,fbmt-inductor-selective,fsdp2,fsdp2-compile
    run f1.36_none 210 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 6 --warmup 2 --methods $m --out "$out/f1.36_none.json"
    run f1.36_block 130 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 6 --warmup 2 --methods fbmt-inductor,fsdp2,fsdp2-compile --out "$out/f1.36_block.json"
    run f6.7_block 170 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 5 --warmup 2 --methods fbmt-inductor,fsdp2,fsdp2-compile --out "$out/f6.7_block.json"
    run f6.7_best 70 benchmarks/gpu_train.py --config 6.7b --batch 8 --seq 2048 --remat selective --steps 5 --warmup 2 --methods fbmt-inductor --out "$out/f6.7_best.json" ;;
  a)  # correctness on GPU, the 6.7B row, and the copy kernel's grid: bounded (default), torch's, 16 blocks
    echo "== copies_on_gpu"; timeout 60 python3 tests/gpu/copies_on_gpu.py 2>&1 | tail -3
    echo "== gpt_on_gpu"
    timeout 150 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu.txt" 2>&1
    echo "rc=$?" >> "$out/gpt_on_gpu.txt"; grep -v "^W[0-9]" "$out/gpt_on_gpu.txt" | tail -3
    a67="--config 6.7b --batch 4 --seq 2048 --remat block --warmup 2 --loss-in-model --profile"
    run l6.7_block 180 benchmarks/gpu_train.py $a67 --steps 5 --methods fbmt-inductor,fsdp2,fsdp2-compile --out "$out/l6.7_block.json"
    FBMT_COPY_PROGRAMS=0 run l6.7_torchcopy 90 benchmarks/gpu_train.py $a67 --steps 3 --methods fbmt-inductor --out "$out/l6.7_torchcopy.json"
    FBMT_COPY_PROGRAMS=16 run l6.7_copy16 90 benchmarks/gpu_train.py $a67 --steps 3 --methods fbmt-inductor --out "$out/l6.7_copy16.json" ;;
  b)  # the other rows, and fbmt's best 6.7B setting
    m=fbmt-inductor,fsdp2,fsdp2-compile
    run l1.36_block 120 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 6 --warmup 2 --loss-in-model --methods $m --out "$out/l1.36_block.json"
    run l1.36_none 150 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fbmt-inductor-selective,fsdp2,fsdp2-compile --out "$out/l1.36_none.json"
    run l13_block 220 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 5 --warmup 2 --loss-in-model --methods $m --out "$out/l13_block.json"
    run l6.7_best 100 benchmarks/gpu_train.py --config 6.7b --batch 8 --seq 2048 --remat selective --steps 5 --warmup 2 --loss-in-model --methods fbmt-inductor --out "$out/l6.7_best.json" ;;
  direct)  # compile(direct_grads=True) against the default and the peer, with profiles
    run d6.7_block 200 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 5 --warmup 2 --loss-in-model --profile --methods fbmt-inductor,fbmt-inductor-direct,fsdp2-compile --out "$out/d6.7_block.json"
    run d13_block 220 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 5 --warmup 2 --loss-in-model --methods fbmt-inductor,fbmt-inductor-direct,fsdp2-compile --out "$out/d13_block.json" ;;
  c)  # tune the copy tile, then the changed default (turnaround, prefetch) and direct_grads against the peer
    echo "== copy_sweep"; timeout 100 python3 benchmarks/copy_sweep.py > "$out/copy_sweep.txt" 2>&1
    cat "$out/copy_sweep.txt"
    tile=$(tail -1 "$out/copy_sweep.txt"); [[ $tile =~ ^FBMT_COPY_BLOCK=[0-9]+\ FBMT_COPY_WARPS=[0-9]+$ ]] && export $tile
    echo "== gpt_on_gpu"
    timeout 150 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu.txt" 2>&1
    echo "rc=$?" >> "$out/gpt_on_gpu.txt"; grep -v "^W[0-9]" "$out/gpt_on_gpu.txt" | tail -4
    c67="--config 6.7b --batch 4 --seq 2048 --remat block --warmup 2 --loss-in-model"
    run c6.7_block 230 benchmarks/gpu_train.py $c67 --steps 5 --profile --methods fbmt-inductor,fbmt-inductor-direct,fsdp2-compile --out "$out/c6.7_block.json"
    FBMT_COPY_BLOCK=8192 FBMT_COPY_WARPS=8 run c6.7_oldtile 100 benchmarks/gpu_train.py $c67 --steps 4 --methods fbmt-inductor-direct --out "$out/c6.7_oldtile.json"
    run c1.36_none 130 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fbmt-inductor-direct,fsdp2-compile --out "$out/c1.36_none.json" ;;
  d)  # every row with the session's defaults: copy tile, turnaround, prefetch at phase start, last block saved
    echo "== gpt_on_gpu"
    timeout 100 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > /tmp/gpt_on_gpu.txt 2>&1
    echo "rc=$?"; grep -v "^W[0-9]" /tmp/gpt_on_gpu.txt | tail -4
    m=fbmt-inductor,fsdp2,fsdp2-compile
    run d6.7_block 170 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 5 --warmup 2 --loss-in-model --profile --methods $m --out "$out/d6.7_block.json"
    run d13_block 200 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 5 --warmup 2 --loss-in-model --methods $m --out "$out/d13_block.json"
    run d1.36_none 130 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 6 --warmup 2 --loss-in-model --profile --methods fbmt-inductor,fbmt-inductor-selective,fsdp2,fsdp2-compile --out "$out/d1.36_none.json"
    run d1.36_block 90 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 6 --warmup 2 --loss-in-model --methods $m --out "$out/d1.36_block.json" ;;
  e)
    logs=/tmp/logs; mkdir -p $logs
    m=fbmt-inductor,fsdp2,fsdp2-compile
    run e6.7_block 150 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --profile --methods $m --out "$out/e6.7_block.json"
    run e13_block 170 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 5 --warmup 2 --loss-in-model --methods $m --out "$out/e13_block.json"
    run e1.36_none 110 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 8 --warmup 2 --loss-in-model --methods fbmt-inductor,fbmt-inductor-selective,fsdp2,fsdp2-compile --out "$out/e1.36_none.json"
    run e1.36_block 70 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --methods $m --out "$out/e1.36_block.json"
    (cd $logs && tar czf "$out/e_logs.tgz" *.txt)
    run e6.7_best 70 benchmarks/gpu_train.py --config 6.7b --batch 12 --seq 2048 --remat selective --steps 4 --warmup 2 --loss-in-model --methods fbmt-inductor --out "$out/e6.7_best.json"
    run e6.7_peerfirst 90 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --methods fsdp2-compile,fbmt-inductor --out "$out/e6.7_peerfirst.json"
    (cd $logs && tar czf "$out/e_logs.tgz" *.txt) ;;
  f)  # session 5: the trailing blocks saved (6.7B, 13B); allocator counts, clocks and power meanwhile
    nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
      --format=csv -lms 500 > "$out/smi.csv" & smi=$!
    m=fbmt-inductor,fsdp2-compile
    run f6.7_block 170 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 2 --loss-in-model --profile --methods $m --out "$out/f6.7_block.json"
    run f13_block 170 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods $m --out "$out/f13_block.json"
    kill $smi ;;
  g)  # session 5: GPU checks; 1.36B rows with the compute stream's kernels by name; ZeRO-2 for the blocks
    echo "== gpt_on_gpu"
    timeout 100 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu.txt" 2>&1
    echo "rc=$?" >> "$out/gpt_on_gpu.txt"; grep -v "^W[0-9]" "$out/gpt_on_gpu.txt" | tail -4
    a136="--config 1.36b --batch 8 --seq 2048 --steps 8 --warmup 2 --loss-in-model"
    run g1.36_none 140 benchmarks/gpu_train.py $a136 --remat none --profile --methods fbmt-inductor,fbmt-inductor-selective,fsdp2-compile --out "$out/g1.36_none.json"
    run g1.36_zero2 100 benchmarks/gpu_train.py $a136 --remat none --zero 2 --profile --methods fbmt-inductor,fbmt-inductor-selective --out "$out/g1.36_zero2.json"
    run g1.36_block 90 benchmarks/gpu_train.py $a136 --remat block --methods fbmt-inductor,fsdp2-compile --out "$out/g1.36_block.json" ;;
  h1|h2)  # session 5's table (two calls): every row with the trailing blocks saved; ratios by mean and median step
    m=fbmt-inductor,fsdp2,fsdp2-compile
    if [ "$stage" = h1 ]; then
      run h6.7_block 200 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --profile --methods $m --out "$out/h6.7_block.json"
      run h13_block 220 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods $m --out "$out/h13_block.json"
    else
      run h1.36_none 170 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 8 --warmup 2 --loss-in-model --methods fbmt-inductor,fbmt-inductor-selective,fbmt-inductor-selective-zero2,fsdp2,fsdp2-compile --out "$out/h1.36_none.json"
      run h1.36_block 100 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --methods $m --out "$out/h1.36_block.json"
      run h6.7_best 80 benchmarks/gpu_train.py --config 6.7b --batch 12 --seq 2048 --remat selective --steps 4 --warmup 2 --loss-in-model --methods fbmt-inductor --out "$out/h6.7_best.json"
    fi ;;
  i)  # session 5: remat="mincut" at 1.36B without recompute, and the GPU checks
    echo "== gpt_on_gpu"
    timeout 200 torchrun --nproc_per_node=2 --master_port=29411 tests/gpu/gpt_on_gpu.py > "$out/gpt_on_gpu_i.txt" 2>&1
    echo "rc=$?" >> "$out/gpt_on_gpu_i.txt"; grep -v "^W[0-9]" "$out/gpt_on_gpu_i.txt" | tail -4
    run i1.36_none 200 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 8 --warmup 2 --loss-in-model --profile --methods fbmt-inductor,fbmt-inductor-mincut,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/i1.36_none.json" ;;
  j)  # session 5: the same, 16 timed steps, no profile
    run j1.36_none 200 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 16 --warmup 2 --loss-in-model --methods fbmt-inductor-mincut,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/j1.36_none.json" ;;
  k)  # session 6: mincut saves the products' operands, the trailing blocks save as mincut does; every
      # comparison interleaved (--interleave: the methods' steps in turn, paired ratios), the GPU checks first
    gpu_checks k
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run k1.36_none 230 benchmarks/gpu_train.py $n136 --steps 16 --interleave --methods fbmt-inductor-mincut,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/k1.36_none.json"
    run k1.36_profile 90 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2 --out "$out/k1.36_profile.json"
    run k6.7_block 200 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/k6.7_block.json" ;;
  l)  # session 6, after the narrow wire and the small groups' reduce-scatters: stage k again
    gpu_checks l
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run l1.36_none 230 benchmarks/gpu_train.py $n136 --steps 16 --interleave --methods fbmt-inductor-mincut,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/l1.36_none.json"
    run l1.36_profile 90 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2 --out "$out/l1.36_profile.json"
    run l6.7_block 200 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/l6.7_block.json" ;;
  m)  # session 6's table, part 1: 13B (too large to interleave two methods) and 1.36B with block recompute
    run m13_block 330 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fsdp2-compile,fsdp2 --out "$out/m13_block.json"
    run m1.36_block 200 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 16 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile,fsdp2 --out "$out/m1.36_block.json" ;;
  n)  # session 6's table, part 2: 1.36B without recompute; 6.7B against FSDP2 eager (with + compile: stage l)
    run n1.36_none 250 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 16 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut,fsdp2-compile,fsdp2 --out "$out/n1.36_none.json"
    run n6.7_block 250 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2 --out "$out/n6.7_block.json" ;;
  o)  # session 6: two ranks exchange gradients through an all-gather (NOTE: [Narrow wire]); the 1.36B rows again
    echo "== copies_on_gpu"; timeout 60 python3 tests/gpu/copies_on_gpu.py 2>&1 | tail -2
    gpu_checks o
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run o1.36_none 200 benchmarks/gpu_train.py $n136 --steps 16 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut,fsdp2-compile --out "$out/o1.36_none.json"
    run o1.36_profile 80 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2 --out "$out/o1.36_profile.json"
    run o1.36_block 150 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 12 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/o1.36_block.json" ;;
  p)  # session 6: 6.7B after two ranks' exchange became an all-gather
    run p6.7_block 200 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/p6.7_block.json" ;;
  q)  # session 7: a recomputed block's cheap values recomputed late (NOTE: [Late recompute]); 6.7B and 1.36B with block
      # recompute against the peer, interleaved
    gpu_checks q
    run q6.7_block 240 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/q6.7_block.json"
    run q1.36_block 150 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 12 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/q1.36_block.json" ;;
  r)  # session 7's table, part 1: the GPU checks; 13B (sequential: two 13B states do not fit); 1.36B with block recompute
    gpu_checks r
    run r13_block 330 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fsdp2-compile --out "$out/r13_block.json"
    run r1.36_block 150 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 12 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/r1.36_block.json" ;;
  s)  # session 7's table, part 2: 1.36B without recompute, 6.7B with block recompute
    run s1.36_none 230 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 16 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut,fsdp2-compile --out "$out/s1.36_none.json"
    run s6.7_block 240 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/s6.7_block.json" ;;
  t)  # session 7: 1.36B without recompute over more rounds; where the step's start goes (--profile); fbmt's best 6.7B setting
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run t1.36_none 260 benchmarks/gpu_train.py $n136 --steps 24 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut,fsdp2-compile --out "$out/t1.36_none.json"
    run t1.36_profile 80 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/t1.36_profile.json"
    run t6.7_best 100 benchmarks/gpu_train.py --config 6.7b --batch 12 --seq 2048 --remat selective --steps 4 --warmup 2 --loss-in-model --methods fbmt-inductor --out "$out/t6.7_best.json" ;;
  u)  # session 7: 1.36B with block recompute over more rounds, against FSDP2 eager too
    run u1.36_block 280 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 24 --warmup 2 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile,fsdp2 --out "$out/u1.36_block.json" ;;
  v)  # session 8: the step as CUDA graphs (NOTE: [CUDA graphs]): GPU checks, then 1.36B with block recompute
    gpu_checks v
    echo "== fbmt.train --cuda-graph"
    timeout 150 python3 -m fbmt.train --cuda-graph --steps 40 --out /tmp/gpt.pt > "$out/train_graph.txt" 2>&1
    echo "rc=$?" >> "$out/train_graph.txt"; grep -v "^W[0-9]" "$out/train_graph.txt" | tail -4
    run v1.36_block 300 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 12 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor,fbmt-inductor-graph,fsdp2-compile --out "$out/v1.36_block.json" ;;
  w)  # session 8: the graphed 1.36B step with block recompute, profiled
    run w1.36_block_profile 200 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 4 --warmup 3 --loss-in-model --profile --methods fbmt-inductor-graph --out "$out/w1.36_block_profile.json" ;;
  x)  # session 8: 1.36B with block recompute, fbmt's step as CUDA graphs, over more rounds; then sequential runs,
    # which also report the allocator's reserved peak (the graphs keep their pool reserved)
    run x1.36_block 300 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 24 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-graph,fsdp2-compile,fsdp2 --out "$out/x1.36_block.json"
    run x1.36_block_seq 240 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 4 --warmup 3 --loss-in-model --methods fbmt-inductor-graph,fbmt-inductor,fsdp2-compile --out "$out/x1.36_block_seq.json" ;;
  y)  # session 8: the step as CUDA graphs on 1.36B without recompute and 6.7B with block recompute
    run y1.36_none 250 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 14 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-mincut-zero2-graph,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/y1.36_none.json"
    run y6.7_block 260 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-graph,fsdp2-compile --out "$out/y6.7_block.json" ;;
  z)  # session 8: the main job (85.65M GPT, eager backend) without and with CUDA graphs, one after the other
    for g in "" --cuda-graph; do
      echo "== fbmt.train $g"
      timeout 150 python3 -m fbmt.train $g --steps 100 --out /tmp/gpt.pt > "$out/train${g:+_graph}_z.txt" 2>&1
      echo "rc=$?" >> "$out/train${g:+_graph}_z.txt"; grep -v "^W[0-9]" "$out/train${g:+_graph}_z.txt" | grep "step  100\|loss .* ->\|compile"
    done
    run z1.36_none 240 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none --steps 20 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-mincut-zero2-graph,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/z1.36_none.json" ;;
  s9a)  # session 9: the first block's weight products moved after the embedding's reduce-scatter start (NOTE: [Tail],
    # schedule="prefetch-tail") against the backward in trace order, at 1.36B without recompute; then both profiled,
    # for how the step ends. (As run, the move was the default and the in-order methods were named "-in-order":
    # the results' method names are those; these are today's names for the same settings.)
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s9a1.36_none 280 benchmarks/gpu_train.py $n136 --steps 24 --interleave --methods fbmt-inductor-mincut-zero2-tail,fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/s9a1.36_none.json"
    run s9a1.36_profile 150 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2-tail,fbmt-inductor-mincut-zero2 --out "$out/s9a1.36_profile.json" ;;
  s9b)  # session 9: the same A/B with block recompute: 6.7B (where only the last 5 of 7 products move) and 1.36B
    # (all 7, with the step as CUDA graphs, fbmt's setting for that row)
    run s9b6.7_block 280 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-tail,fbmt-inductor --out "$out/s9b6.7_block.json"
    run s9b1.36_block 260 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 16 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-tail-graph,fbmt-inductor-graph,fsdp2-compile --out "$out/s9b1.36_block.json" ;;
  s9c)  # session 9: the copy kernel's tiles beside matrix products; the GPU checks; the sum kernel's new tile
    # (32768 x 16, benchmarks/sum_sweep.py) against the old one (65536 x 32) at 1.36B without recompute
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/copy_sweep.py --out "$out/copy_sweep.json" | tail -16
    gpu_checks s9c
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s9c1.36_none 280 benchmarks/gpu_train.py $n136 --steps 24 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-sum64k,fsdp2-compile --out "$out/s9c1.36_none.json" ;;
  s9d)  # session 9: rounds in balanced orders (every method timed right after every other equally often): 1.36B
    # without recompute against the peer alone over 60 rounds; the same with the sum kernel's two tiles side by side
    # (equal code but for one kernel's tile: their ratios to the peer should now agree); 1.36B with block recompute
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s9d1.36_none 200 benchmarks/gpu_train.py $n136 --steps 60 --interleave --methods fbmt-inductor-mincut-zero2,fsdp2-compile --out "$out/s9d1.36_none.json"
    run s9d1.36_none3 200 benchmarks/gpu_train.py $n136 --steps 30 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-sum64k,fsdp2-compile --out "$out/s9d1.36_none3.json"
    run s9d1.36_block 200 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 40 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-graph,fsdp2-compile --out "$out/s9d1.36_block.json" ;;
  s9e)  # session 9: 6.7B with block recompute on the final code (the sum kernel's new tile), rounds in balanced orders
    run s9e6.7_block 400 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/s9e6.7_block.json" ;;
  s9f)  # session 9: 13B on the final code (sequential: two 13B states do not fit)
    run s9f13_block 330 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fsdp2-compile --out "$out/s9f13_block.json" ;;
  s10a)  # session 10: merged products (one GPU), the Adam kernels, then 1.36B without recompute with fbmt's Adam
    CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/gemm_merge.py --out "$out/gemm_merge.json"
    CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/gpu_kernels.py --numel 680000000 > "$out/gpu_kernels.txt" 2>&1
    tail -12 "$out/gpu_kernels.txt"
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s10a1.36_none 230 benchmarks/gpu_train.py $n136 --steps 30 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-adam,fsdp2-compile --out "$out/s10a1.36_none.json" ;;
  s10b)  # session 10: merged products (NOTE: [Merged products]): GPU checks, then the 1.36B rows with and without
    gpu_checks s10b
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s10b1.36_none 200 benchmarks/gpu_train.py $n136 --steps 30 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-nomerge,fsdp2-compile --out "$out/s10b1.36_none.json"
    run s10b1.36_block 150 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 24 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-graph,fsdp2-compile --out "$out/s10b1.36_block.json" ;;
  s10c)  # session 10: 6.7B (merged against the peer) and 13B (sequential) on the final code
    run s10c6.7_block 330 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 10 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/s10c6.7_block.json"
    run s10c13_block 250 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fsdp2-compile --out "$out/s10c13_block.json" ;;
  s10d)  # session 10: where the merged products lose at 1.36B without recompute (profiles), and 6.7B with and without
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s10d1.36_profile 200 benchmarks/gpu_train.py $n136 --steps 3 --profile --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-nomerge --out "$out/s10d1.36_profile.json"
    run s10d6.7_block 300 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor,fbmt-inductor-nomerge --out "$out/s10d6.7_block.json" ;;
  s10e)  # session 10: the merged products with their gradients' cat as a ConcatKernel (NOTE: [Cats of shared reads])
    gpu_checks s10e
    n136="--config 1.36b --batch 8 --seq 2048 --remat none --warmup 2 --loss-in-model"
    run s10e1.36_none 200 benchmarks/gpu_train.py $n136 --steps 30 --interleave --methods fbmt-inductor-mincut-zero2,fbmt-inductor-mincut-zero2-nomerge,fsdp2-compile --out "$out/s10e1.36_none.json"
    run s10e1.36_profile 120 benchmarks/gpu_train.py $n136 --steps 2 --profile --methods fbmt-inductor-mincut-zero2 --out "$out/s10e1.36_profile.json" ;;
  s10f)  # session 10: the block-recompute rows with the merged products (q, k, v merged whole), against the peer
    run s10f6.7_block 300 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block --steps 8 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor,fsdp2-compile --out "$out/s10f6.7_block.json"
    run s10f1.36_block 130 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat block --steps 20 --warmup 3 --loss-in-model --interleave --methods fbmt-inductor-graph,fsdp2-compile --out "$out/s10f1.36_block.json" ;;
  s10g)  # session 10: 13B with the merged products (sequential: two 13B states do not fit)
    run s10g13_block 330 benchmarks/gpu_train.py --config 13b --batch 16 --seq 512 --remat block --steps 6 --warmup 2 --loss-in-model --methods fbmt-inductor,fsdp2-compile --out "$out/s10g13_block.json" ;;
  best)  # fbmt's best 6.7B setting at larger batches (batch 12 is the largest that fits)
    for b in 12 10; do
      run l6.7_best_b$b 125 benchmarks/gpu_train.py --config 6.7b --batch $b --seq 2048 --remat selective --steps 4 --warmup 2 --loss-in-model --methods fbmt-inductor --out "$out/l6.7_best_b$b.json"
    done ;;
esac
