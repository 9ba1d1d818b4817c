"""The copy stream's bounded-grid copy kernel (fbmt/compiler/collectives/copies.py) against torch, on one GPU.

    python tests/gpu/copies_on_gpu.py

Exact equality with `Tensor.copy_` for every cast the collectives make, and of the reduce stream's
fp32 sum of two bf16 halves with float64's, sizes around the kernel's block size and grids larger and
smaller than the work; then the time of a 6.7B block's copy-in (202M bf16 gradients into fp32) alone,
bounded and with torch's copy.
"""

import os

import torch

from fbmt.compiler.collectives import copies


def main() -> None:
    assert copies._kernels() is not None, "Triton is missing: copy_ would fall back to Tensor.copy_"
    dev = torch.device("cuda")
    pairs = [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.float32),
        (torch.float16, torch.float32),
        (torch.bfloat16, torch.bfloat16),
    ]
    block = copies.tiling()[0]
    sizes = [1, 7, block - 1, block, block + 1, 5 * block + 3, 3_000_001]
    checked = 0
    for grid in (1, 3, copies.programs(0)):
        copies.programs.cache_clear()
        os.environ["FBMT_COPY_PROGRAMS"] = str(grid)
        for src_dtype, dst_dtype in pairs:
            for n in sizes:
                src = (torch.randn(n + 5, device=dev) * 100).to(src_dtype)[3 : 3 + n]  # an offset view
                dst = torch.full((n + 2,), float("nan"), device=dev, dtype=dst_dtype)
                copies.copy_(dst[1 : 1 + n], src)
                assert torch.equal(dst[1 : 1 + n], src.to(dst_dtype)), (grid, src_dtype, dst_dtype, n)
                assert dst[0].isnan() and dst[-1].isnan(), "wrote outside its slice"
                checked += 1
        for n in sizes:  # the reduce stream's sum (all_to_all_reduce): exact against float64
            a, b = ((torch.randn(n, device=dev) * 10.0**k).bfloat16() for k in (-3, 2))
            dst = torch.full((n + 2,), float("nan"), device=dev)
            copies.sum_(dst[1 : 1 + n], a, b, 0.5)
            assert torch.equal(dst[1 : 1 + n].double(), ((a.double() + b.double()) * 0.5).float().double()), (grid, n)
            assert dst[0].isnan() and dst[-1].isnan(), "wrote outside its slice"
            checked += 1
    os.environ.pop("FBMT_COPY_PROGRAMS")
    copies.programs.cache_clear()
    src = torch.randn(202_000_000, device=dev, dtype=torch.bfloat16)
    dst = torch.empty(src.numel(), device=dev)
    times = {}
    for name, fn in (("bounded", lambda: copies.copy_(dst, src)), ("torch", lambda: dst.copy_(src))):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        times[name] = start.elapsed_time(end) / 10
    print(
        f"copies: {checked} cases exact; "
        f"202M bf16 -> fp32 alone: bounded "
        f"({copies.programs(0)} programs) {times['bounded']:.2f} ms, torch {times['torch']:.2f} ms"
    )


if __name__ == "__main__":
    main()
