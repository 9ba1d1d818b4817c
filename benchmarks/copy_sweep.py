"""Tune the copy stream's bounded copy kernel (fbmt/runtime/copies.py) on this GPU.

    python benchmarks/copy_sweep.py [--out sweep.json]

Times the two copies a 6.7B block makes around its collectives (its fp32 shard, 101M elements, cast
to bf16 before the gather; its 202M bf16 gradients copied into the fp32 reduce-scatter buffer) for
each tile (elements per program and iteration, warps per program) and grid (programs), against
torch's copy on the whole GPU. What matters is the SM time (programs x time): the SMs a copy holds
are taken from the matrix products running beside it. The last line is the fastest tile at the
default grid, as the environment variables that select it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fbmt.runtime import copies

TILES = [(8192, 8), (16384, 8), (16384, 16), (32768, 16), (32768, 32), (65536, 32)]


def timed(fn, reps: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    shard = torch.randn(101_000_000, device=dev)
    cast = torch.empty(shard.numel(), device=dev, dtype=torch.bfloat16)
    grads = torch.randn(202_000_000, device=dev, dtype=torch.bfloat16)
    flat = torch.empty(grads.numel(), device=dev)
    gbytes = (shard.numel() * 6 + grads.numel() * 6) / 1e9
    rows = [dict(tile="torch", programs=sms, ms=timed(lambda: cast.copy_(shard)) + timed(lambda: flat.copy_(grads)))]
    for block, warps in TILES:
        for grid in (sms // 4, sms // 8):
            os.environ.update(FBMT_COPY_BLOCK=str(block), FBMT_COPY_WARPS=str(warps), FBMT_COPY_PROGRAMS=str(grid))
            copies.tiling.cache_clear()
            copies.programs.cache_clear()
            ms = timed(lambda: copies.copy_(cast, shard)) + timed(lambda: copies.copy_(flat, grads))
            assert torch.equal(cast, shard.to(torch.bfloat16)) and torch.equal(flat, grads.float())
            rows.append(dict(tile=f"{block}x{warps}", block=block, warps=warps, programs=grid, ms=ms))
    for r in rows:
        r["gb_s"] = gbytes / r["ms"] * 1e3
        r["sm_ms"] = r["ms"] * r["programs"] / sms  # SM time, in whole-GPU milliseconds
        print(f"{r['tile']:>10} on {r['programs']:3d} programs: {r['ms']:6.2f} ms, {r['gb_s']:6.0f} GB/s, "
              f"{r['sm_ms']:5.2f} whole-GPU ms")
    best = min((r for r in rows if r.get("programs") == sms // 4 and "block" in r), key=lambda r: r["ms"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), sms=sms, rows=rows, best=best), f, indent=1)
    print(f"FBMT_COPY_BLOCK={best['block']} FBMT_COPY_WARPS={best['warps']}")


if __name__ == "__main__":
    main()
