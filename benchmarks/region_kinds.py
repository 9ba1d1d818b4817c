"""Inductor's cold compile of a model's regions: how many kinds of region, and the seconds they take.

    python benchmarks/region_kinds.py                                   # this tree, 2 rounds
    PYTHONPATH=.base python benchmarks/region_kinds.py --package fbmt,fbmt_base   # alternated with a base

Each run is a process of its own, first with an empty Inductor cache folder (cold), then a second
process with the folder the first one filled (warm); each compiles
benchmarks/llama.py's Llama (the 1.36B's shape at a width the CPU compiles quickly, bf16, block
recompute, one rank) with backend="inductor" and running one training step, so every region
compiles (or loads). Printed per run: the kinds of region compiled (NOTE: [Regions]: identical blocks share a
kind), the regions the step ran, and Inductor's seconds. `--package fbmt_base` runs the tree
`base_package.sh` wrote; packages alternate, round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(package: str, layers: int, width: int, device: str) -> dict:
    """One compile and training step in this process (called in a child process)."""
    import importlib

    import torch

    sys.path.insert(0, HERE)
    from llama import Llama, LlamaConfig

    fbmt = importlib.import_module(package)
    cfg = LlamaConfig(dim=width, n_layers=layers, n_heads=max(1, width // 64), ffn_dim=width * 8 // 3 // 16 * 16)
    cfg = LlamaConfig(**{**cfg.__dict__, "vocab_size": 8192, "max_seq": 256})
    torch.manual_seed(0)
    model = fbmt.compile(
        Llama(cfg),
        backend="inductor",
        remat="block",
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        cache_dir=False,
        device=device,
    )
    x = torch.randint(0, cfg.vocab_size, (2, 256), device=device)
    started = time.perf_counter()
    logits = model(x)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x.flatten()).backward()
    step = time.perf_counter() - started
    cache = model.regions
    return dict(package=package, kinds=cache.misses, reused=cache.hits, inductor_s=cache.seconds, step_s=step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--package", default="fbmt", help="comma-separated packages, alternated (fbmt_base: a base)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one(args.child, args.layers, args.width, args.device)))
        return
    rows = []
    for round_ in range(args.rounds):
        for package in args.package.split(","):
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": os.path.join(cache, "t")}
                command = [sys.executable, __file__, "--child", package, "--layers", str(args.layers)]
                command += ["--width", str(args.width), "--device", args.device]
                for cold in ("cold", "warm"):  # the second process finds the first one's cache
                    done = subprocess.run(command, env=env, capture_output=True, text=True)
                    if done.returncode != 0:
                        print(f"{package}: failed\n{done.stderr[-2000:]}")
                        break
                    r = json.loads(done.stdout.strip().splitlines()[-1])
                    rows.append(dict(round=round_, cache=cold, **r))
                    print(json.dumps(rows[-1]), flush=True)
    print(f"\nLlama, {args.layers} layers, width {args.width}, {args.device}")
    print("| package | round | Inductor's cache | kinds | regions reused | Inductor (s) | first step (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        cells = f"{r['kinds']} | {r['reused']} | {r['inductor_s']:.2f} | {r['step_s']:.2f}"
        print(f"| {r['package']} | {r['round']} | {r['cache']} | {cells} |")


if __name__ == "__main__":
    main()
