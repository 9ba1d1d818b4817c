"""The gradients' copy into a flat fp32 buffer on one GPU, three ways.

    python benchmarks/grad_copy.py [--out r.json]

On one rank a reduce-scatter is a copy: a flat group's bf16 gradient pieces are cast into the fp32
buffer the optimizer steps on, on the compute stream (runtime/collectives/torch_impl.py). Times that
copy for a layer of the 6.7B (202M parameters in 9 pieces) and of the 1.36B, each way: a
`Tensor.copy_` per piece (torch's kernel that casts while it copies, what fbmt did), one
`torch._foreach_copy_` over the pieces (what it does), and fbmt's Triton copy (copies.py) on its
bounded grid, as the copy stream runs it beside compute. Prints ms and GB/s per layer.
"""

from __future__ import annotations

import argparse
import json

import torch
from copy_sweep import timed  # benchmarks/copy_sweep.py: the same CUDA-event timer

from fbmt.compiler.collectives import copies

LAYERS = {  # a Llama layer's parameter shapes: q, k, v, o, gate, up, down, two norms
    "6.7b": [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008), (4096,), (4096,)],
    "1.36b": [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632), (2048,), (2048,)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, shapes in LAYERS.items():
        pieces = [torch.randn(s, device=dev, dtype=torch.bfloat16).view(-1) for s in shapes]
        numel = sum(p.numel() for p in pieces)
        flat = torch.empty(numel, device=dev)
        slices, at = [], 0
        for p in pieces:
            slices.append(flat[at : at + p.numel()])
            at += p.numel()
        want = torch.cat([p.float() for p in pieces])
        ways = {
            "Tensor.copy_ per piece": lambda: [d.copy_(p) for d, p in zip(slices, pieces)],
            "torch._foreach_copy_": lambda: torch._foreach_copy_(slices, pieces),
            "fbmt's bounded copy": lambda: [copies.copy_(d, p) for d, p in zip(slices, pieces)],
        }
        for way, fn in ways.items():
            flat.zero_()
            ms = timed(fn, reps=20)
            assert torch.equal(flat, want), way
            gbs = numel * 6 / ms / 1e6
            rows.append(dict(layer=name, way=way, ms=ms, gb_s=gbs))
            print(f"{name:6s} {way:23s} {ms:7.3f} ms  {gbs:6.0f} GB/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
