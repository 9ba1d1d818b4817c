"""AdamOffloadOptimizer on CUDA parameters: same numbers as on the CPU, and the pipeline's effect.

    python tests/gpu/offload_on_gpu.py

Checks that bf16 CUDA parameters (a host master each) and fp32 ones (their own masters, staged through
pinned buffers) updated through the chunked device->host->device pipeline end bit-identical to the
same update done on CPU parameters, then times one step of each with the pipeline (default chunks)
against one chunk (no overlap of copies and CPU compute).
"""

import statistics
import time

import torch

from fbmt.optim import AdamOffloadOptimizer


def same_as_on_cpu(dtype: torch.dtype, n: int) -> bool:
    """10 steps of two CUDA parameters (one of 5 chunks and a tail, one smaller than a chunk) against the
    same on the CPU: a bf16 one through its host master, an fp32 one (its own master) staged."""
    torch.manual_seed(0)
    starts = [torch.randn(n).to(dtype), torch.randn(1000).to(dtype)]
    gpu = [torch.nn.Parameter(s.cuda()) for s in starts]
    cpu = [torch.nn.Parameter(s.clone()) for s in starts]
    opt_gpu = AdamOffloadOptimizer(gpu, lr=1e-2, weight_decay=0.1, chunk_numel=1 << 20)
    opt_cpu = AdamOffloadOptimizer(cpu, lr=1e-2, weight_decay=0.1)
    for _ in range(10):
        for a, b in zip(gpu, cpu):
            g = torch.randn(b.numel()).to(dtype)
            a.grad, b.grad = g.cuda(), g.clone()
        opt_gpu.step()
        opt_cpu.step()
    torch.cuda.synchronize()
    same = all(torch.equal(a.detach().cpu(), b.detach()) for a, b in zip(gpu, cpu))
    host = {k: v.numel() for k, v in opt_gpu.state[gpu[0]].items() if isinstance(v, torch.Tensor)}
    print(f"{dtype}: offload on CUDA == offload on CPU after 10 steps: {same}; host state {host}", flush=True)
    return same and ("master" in host) == (dtype != torch.float32)


def main() -> None:
    same = same_as_on_cpu(torch.bfloat16, (5 << 20) + 123) & same_as_on_cpu(torch.float32, (5 << 20) + 123)

    n = 200_000_000
    for dtype in (torch.bfloat16, torch.float32):
        p = torch.nn.Parameter(torch.randn(n, device="cuda").to(dtype))
        p.grad = torch.randn(n, device="cuda").to(dtype)
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
                f"200M {str(dtype).removeprefix('torch.')} params, chunk {chunk:>11,d}: {t * 1e3:7.1f} ms/step "
                f"({'no pipelining' if chunk == n else 'pipelined'}, {torch.get_num_threads()} torch threads)",
                flush=True,
            )
        del p, opt
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
