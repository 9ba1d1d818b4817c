"""Weak scaling: the same per-GPU batch on 1, 2, 4, 8 GPUs, fbmt and FSDP2 side by side.

    python benchmarks/scaling.py run --config 6.7b --gpus 1,2,4,8 --out results/scaling   # one gpu_train.py per count
    python benchmarks/scaling.py report results/scaling/*.json                           # the table

`run` launches `benchmarks/gpu_train.py` once per GPU count (torchrun on the first N GPUs), with the
configuration's per-GPU batch and recompute setting from the GPU performance issue, and keeps each
invocation's JSON. `report` prints, per configuration and method: tokens/s per GPU, weak-scaling
efficiency relative to 2 GPUs (per-GPU throughput at N over that at 2; 1 GPU has no communication
at all, so 2 is the baseline), measured exposed communication per step (step time at N minus step
time at 1 GPU, where the per-GPU work is identical and there is nothing to communicate; `-` where the
1-GPU run does not fit), and peak memory per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
# Per-GPU batch, sequence and recompute of each configuration (the GPU performance issue's table).
SETTINGS = {
    "1.36b": dict(batch=8, seq=2048, remat="block"),
    "6.7b": dict(batch=4, seq=2048, remat="block"),
    "13b": dict(batch=16, seq=512, remat="block"),
    "30b": dict(batch=4, seq=2048, remat="block"),
}


def run(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    s = SETTINGS[args.config]
    for n in (int(g) for g in args.gpus.split(",")):
        out = os.path.join(args.out, f"{args.config}_{n}gpu.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={n}",
            "--master_port",
            str(29400 + n),
            os.path.join(HERE, "gpu_train.py"),
            "--config",
            args.config,
            "--batch",
            str(s["batch"]),
            "--seq",
            str(s["seq"]),
            "--remat",
            s["remat"],
            "--methods",
            args.methods,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--out",
            out,
        ]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(str(i) for i in range(n)))
        print(f"scaling: {args.config} on {n} GPU(s)", flush=True)
        code = subprocess.call(cmd, env=env)
        if code:
            print(f"scaling: {n} GPU(s) exited with {code}", flush=True)


def report(files: list[str]) -> str:
    rows: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for f in files:
        with open(f) as fh:
            data = json.load(fh)
        for r in data["results"]:
            if "error" not in r:
                rows[(data["config"], r["method"])][r["world"]] = r
    lines = [
        "| config | method | GPUs | tok/s/GPU | efficiency vs 2 GPUs | exposed comm / step | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for (config, method), by_world in sorted(rows.items()):
        base, one = by_world.get(2), by_world.get(1)
        for world in sorted(by_world):
            r = by_world[world]
            eff = f"{r['tok_s_gpu'] / base['tok_s_gpu']:.1%}" if base and world >= 2 else "-"
            exposed = f"{1000 * (r['step_s'] - one['step_s']):.0f} ms" if one and world > 1 else "-"
            peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") else "-"
            lines.append(f"| {config} | {method} | {world} | {r['tok_s_gpu']:.0f} | {eff} | {exposed} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", choices=sorted(SETTINGS), required=True)
    r.add_argument("--gpus", default="1,2,4,8")
    r.add_argument("--methods", default="fbmt-inductor,fsdp2")
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--out", default="benchmarks/results/scaling")
    p = sub.add_parser("report")
    p.add_argument("files", nargs="+")
    args = ap.parse_args()
    if args.cmd == "run":
        run(args)
    else:
        print(report(args.files))


if __name__ == "__main__":
    main()
