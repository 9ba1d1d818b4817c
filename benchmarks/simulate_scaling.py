"""Simulated weak scaling of the GPU benchmark's model (no GPU needed): fbmt.simulate per GPU count.

    python benchmarks/simulate_scaling.py --config 6.7b --gpus 1,2,4,8

For each GPU count, compiles the Llama-style model of benchmarks/llama.py on `meta` for that world
size (bf16 compute, fp32 reduction, the configuration's recompute setting), traces one step on fake
CPU tensors and replays it on the H200 cost model (fbmt/tools/sim.py): step time, tokens/s per GPU,
efficiency vs 2 GPUs, exposed communication, communication busy time, peak program memory. The
model prices ops one by one (as backend="eager" runs them) and does not model NCCL slowing compute.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, Llama  # noqa: E402
from scaling import SETTINGS  # noqa: E402

import fbmt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(SETTINGS), default="6.7b")
    ap.add_argument("--gpus", default="1,2,4,8")
    args = ap.parse_args()
    s = SETTINGS[args.config]
    print(
        "| config | GPUs | step (ms) | tok/s/GPU | efficiency vs 2 GPUs | exposed comm (ms) | comm busy (ms) "
        "| program peak (GiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for world in (int(g) for g in args.gpus.split(",")):
        with torch.device("meta"):
            model = Llama(CONFIGS[args.config])
        started = time.perf_counter()
        model = fbmt.compile(
            model,
            world_size=world,
            device="meta",
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            remat=s["remat"],
        )
        program = model.trace(torch.zeros(s["batch"], s["seq"], dtype=torch.long), device="cpu")
        sim = fbmt.simulate(program, fbmt.sim.H200)
        tok = s["batch"] * s["seq"] / sim.step_s
        base = tok if world == 2 else base
        eff = f"{tok / base:.1%}" if base and world >= 2 else "-"
        print(
            f"| {args.config} | {world} | {sim.step_s * 1e3:.1f} | {tok:.0f} | {eff} | {sim.exposed_comm_s * 1e3:.1f} "
            f"| {sim.comm_s * 1e3:.1f} | {sim.peak_activation_bytes / 2**30:.2f} |",
            flush=True,
        )
        print(f"  ({time.perf_counter() - started:.1f} s to compile, trace and simulate)", file=sys.stderr)


if __name__ == "__main__":
    main()
