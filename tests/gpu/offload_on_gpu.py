"""AdamOffloadOptimizer on CUDA parameters: same numbers as on the CPU, and the pipeline's effect.

    python tests/gpu/offload_on_gpu.py

Checks that a bf16 CUDA parameter updated through the chunked device->host->device pipeline ends
bit-identical to the same update done on a CPU parameter, then times one step with the pipeline
(default chunks) against one chunk (no overlap of copies and CPU compute).
"""

import statistics
import time

import torch

from fbmt.optim import AdamOffloadOptimizer


def main() -> None:
    n = 1 << 22
    torch.manual_seed(0)
    start = torch.randn(n).bfloat16()
    gpu = torch.nn.Parameter(start.cuda())
    cpu = torch.nn.Parameter(start.clone())
    opt_gpu = AdamOffloadOptimizer([gpu], lr=1e-2, weight_decay=0.1, chunk_numel=1 << 20)
    opt_cpu = AdamOffloadOptimizer([cpu], lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        g = torch.randn(n).bfloat16()
        gpu.grad, cpu.grad = g.cuda(), g.clone()
        opt_gpu.step()
        opt_cpu.step()
    torch.cuda.synchronize()
    same = torch.equal(gpu.detach().cpu(), cpu.detach())
    print(f"offload on CUDA == offload on CPU after 10 steps: {same}", flush=True)

    n = 200_000_000
    p = torch.nn.Parameter(torch.randn(n, device="cuda").bfloat16())
    p.grad = torch.randn(n, device="cuda").bfloat16()
    for chunk in (n, 1 << 24, 1 << 22):
        opt = AdamOffloadOptimizer([p], lr=1e-3, chunk_numel=chunk)
        times = []
        for i in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            opt.step()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
        t = statistics.median(times)
        print(
            f"200M bf16 params, chunk {chunk:>11,d}: {t * 1e3:7.1f} ms/step "
            f"({'no pipelining' if chunk == n else 'pipelined'}, {torch.get_num_threads()} torch threads)",
            flush=True,
        )
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
