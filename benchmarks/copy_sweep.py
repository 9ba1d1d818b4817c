"""Tune the copy stream's bounded copy kernel (fbmt/compiler/collectives/copies.py) on this GPU.

    python benchmarks/copy_sweep.py [--out sweep.json]

Times the two copies a 6.7B block makes around its collectives (its fp32 shard, 101M elements, cast
to bf16 before the gather; its 202M bf16 gradients copied into the fp32 reduce-scatter buffer) for
each tile (elements per program and iteration, warps per program) and grid (programs), against
torch's copy on the whole GPU. What matters is the SM time (programs x time): the SMs a copy holds
are taken from the matrix products running beside it; so each tile is also timed beside a chain of a
6.7B block's products, and how much longer they take is printed. The last line is the fastest tile at the
default grid, as the environment variables that select it.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from fbmt.compiler.collectives import copies

TILES = [(8192, 8), (16384, 8), (16384, 16), (32768, 16), (32768, 32), (65536, 32), (65536, 16)]


def timed(fn, reps: int = 10) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def beside(products, side_fn, reps: int = 5) -> float:
    """ms of `products` on the current stream while `side_fn` runs on another stream."""
    side = torch.cuda.Stream()
    products()
    side_fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    total = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            side_fn()
        start.record()
        products()
        end.record()
        torch.cuda.synchronize()
        total += start.elapsed_time(end)
    return total / reps


def setup(doc: str) -> tuple[argparse.Namespace, torch.device, int]:
    """A sweep's command line (`--out`), its GPU and that GPU's SM count."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--out", default=None)
    dev = torch.device("cuda")
    return parser.parse_args(), dev, torch.cuda.get_device_properties(dev).multi_processor_count


def main() -> None:
    args, dev, sms = setup(__doc__)
    shard = torch.randn(101_000_000, device=dev)
    cast = torch.empty(shard.numel(), device=dev, dtype=torch.bfloat16)
    grads = torch.randn(202_000_000, device=dev, dtype=torch.bfloat16)
    flat = torch.empty(grads.numel(), device=dev)
    gbytes = (shard.numel() * 6 + grads.numel() * 6) / 1e9
    x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(4096, 11008, device=dev, dtype=torch.bfloat16)
    prod = torch.empty(8192, 11008, device=dev, dtype=torch.bfloat16)

    def products() -> None:  # about 3 ms of a 6.7B block's products, as the copies run beside them in a step
        for _ in range(6):
            torch.mm(x, w, out=prod)

    alone = timed(products)
    rows = [dict(tile="torch", programs=sms, ms=timed(lambda: cast.copy_(shard)) + timed(lambda: flat.copy_(grads)))]
    for block, warps in TILES:
        for grid in (sms // 4, sms // 8):
            os.environ.update(FBMT_COPY_BLOCK=str(block), FBMT_COPY_WARPS=str(warps), FBMT_COPY_PROGRAMS=str(grid))
            copies.tiling.cache_clear()
            copies.programs.cache_clear()
            ms = timed(lambda: copies.copy_(cast, shard)) + timed(lambda: copies.copy_(flat, grads))
            assert torch.equal(cast, shard.to(torch.bfloat16)) and torch.equal(flat, grads.float())
            both = beside(products, lambda: (copies.copy_(cast, shard), copies.copy_(flat, grads)))
            rows.append(
                dict(
                    tile=f"{block}x{warps}",
                    block=block,
                    warps=warps,
                    programs=grid,
                    ms=ms,
                    products_alone_ms=alone,
                    products_beside_ms=both,
                )
            )
    for r in rows:
        r["gb_s"] = gbytes / r["ms"] * 1e3
        r["sm_ms"] = r["ms"] * r["programs"] / sms  # SM time, in whole-GPU milliseconds
        extra = (
            f", products {r['products_beside_ms']:.3f} ms beside them (alone {r['products_alone_ms']:.3f})"
            if "block" in r
            else ""
        )
        print(
            f"{r['tile']:>10} on {r['programs']:3d} programs: {r['ms']:6.2f} ms, {r['gb_s']:6.0f} GB/s, "
            f"{r['sm_ms']:5.2f} whole-GPU ms{extra}"
        )
    best = min((r for r in rows if r.get("programs") == sms // 4 and "block" in r), key=lambda r: r["ms"])
    report(args.out, sms, rows, best, "COPY")


def report(out: str | None, sms: int, rows: list[dict], best: dict, kernel: str) -> None:
    """Write the rows to `out` as JSON, if given, and print the best tile as the environment
    variables that select it (FBMT_{kernel}_BLOCK, FBMT_{kernel}_WARPS)."""
    if out:
        with open(out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), sms=sms, rows=rows, best=best), f, indent=1)
    print(f"FBMT_{kernel}_BLOCK={best['block']} FBMT_{kernel}_WARPS={best['warps']}")


if __name__ == "__main__":
    main()
