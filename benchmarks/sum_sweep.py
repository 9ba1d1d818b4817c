"""Tune the reduce stream's bounded sum kernel (fbmt/compiler/collectives/copies.py, NOTE: [Narrow wire]) on this GPU.

    python benchmarks/sum_sweep.py [--out sweep.json]

Two ranks' gradients are summed in fp32 from two bf16 halves: for a 1.36B block's shard (25.2M
elements) and a 6.7B block's (101M), each tile (elements per program and iteration, warps per
program) on the default grid (a quarter of the SMs) is timed alone, and beside a chain of matrix
products of a 1.36B block's backward shape on the compute stream, as the reduce stream runs it in a
step: what counts is how much longer the products take beside it. The tile that costs the products
least (over both sizes) is printed last, as the environment variables that select it.
"""

from __future__ import annotations

import os

import torch
from copy_sweep import beside, report, setup, timed  # benchmarks/copy_sweep.py: the same timers and report

from fbmt.compiler.collectives import copies

TILES = [(4096, 4), (8192, 8), (16384, 8), (16384, 16), (32768, 16), (32768, 32), (65536, 16), (65536, 32)]


def main() -> None:
    args, dev, sms = setup(__doc__)
    x = torch.randn(16384, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 5632, device=dev, dtype=torch.bfloat16)
    out = torch.empty(16384, 5632, device=dev, dtype=torch.bfloat16)

    def products() -> None:  # about 1.5 ms of a 1.36B block's backward products
        for _ in range(3):
            torch.mm(x, w, out=out)

    alone = timed(products)
    rows = []
    for n in (25_200_000, 101_000_000):
        a = torch.randn(n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, device=dev, dtype=torch.bfloat16)
        dst = torch.empty(n, device=dev)
        want = (a.float() + b.float()) * 0.5
        gbytes = n * 8 / 1e9
        ref = timed(lambda: torch.add(a, b, alpha=1, out=dst))  # torch on the whole GPU (unscaled): bandwidth only
        rows.append(dict(n=n, tile="torch add", programs=sms, ms=ref, gb_s=gbytes / ref * 1e3))
        for block, warps in TILES:
            os.environ.update(FBMT_SUM_BLOCK=str(block), FBMT_SUM_WARPS=str(warps))
            copies.sum_tiling.cache_clear()
            fn = lambda: copies.sum_(dst, a, b, 0.5)  # noqa: E731
            ms = timed(fn)
            assert torch.equal(dst, want)
            with_sum = beside(products, fn)
            rows.append(
                dict(
                    n=n,
                    tile=f"{block}x{warps}",
                    block=block,
                    warps=warps,
                    programs=sms // 4,
                    ms=ms,
                    gb_s=gbytes / ms * 1e3,
                    products_alone_ms=alone,
                    products_beside_ms=with_sum,
                )
            )
    for r in rows:
        extra = (
            f", products {r['products_beside_ms']:.3f} ms beside it (alone {r['products_alone_ms']:.3f})"
            if "block" in r
            else ""
        )
        print(
            f"{r['n'] / 1e6:5.1f}M {r['tile']:>10} on {r['programs']:3d} programs: {r['ms']:6.3f} ms, "
            f"{r['gb_s']:6.0f} GB/s{extra}"
        )
    beside_both: dict[str, float] = {}  # the products' time beside the tile, summed over both sizes
    for r in rows:
        if "block" in r:
            beside_both[r["tile"]] = beside_both.get(r["tile"], 0.0) + r["products_beside_ms"]
    best = min((r for r in rows if "block" in r), key=lambda r: beside_both[r["tile"]])
    report(args.out, sms, rows, best, "SUM")


if __name__ == "__main__":
    main()
