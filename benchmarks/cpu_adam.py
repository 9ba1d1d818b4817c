"""fbmt's native CPU Adam against torch's best CPU recipes, same machine, same run.

    python benchmarks/cpu_adam.py [--numel 50000000] [--steps 10]

(a) fp32 parameters and gradients: `AdamOffloadOptimizer` (updates a CPU fp32 parameter in place)
    vs `torch.optim.AdamW(fused=True)`.
(b) the offload case: bf16 gradients in, fp32 master + moments, bf16 parameters out:
    `AdamOffloadOptimizer` on a bf16 parameter (one fused pass) vs torch's recipe for the same update
    (upcast the gradient into the fp32 master's .grad, fused AdamW on the master, downcast).
Both methods update the same parameter, gradient and moments (`share_state`), and their steps are
timed in adjacent fbmt/torch pairs (ABBA order) with the ratio taken per pair, since a shared
machine's bandwidth drifts within seconds. Prints the median step times, the median per-pair
ratio (torch time / fbmt time: > 1 means fbmt is faster) with its quartiles, and the bytes each
method must move per step over its time, next to a large-copy bandwidth measured here.

"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from fbmt.integrations.optim import AdamOffloadOptimizer
from fbmt.integrations.optim.cpu_adam import native, simd_level


def median_time(fn, steps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired(fbmt_fn, torch_fn, steps: int, warmup: int = 2) -> dict[str, float]:
    """Step times of two methods measured in adjacent pairs, order alternating (ABBA).

    A shared machine's memory bandwidth drifts within seconds, so the ratio is taken within each pair
    (the two steps ran under the same conditions) and summarized by its median and quartiles.
    """
    for _ in range(warmup):
        fbmt_fn()
        torch_fn()
    pairs, fbmt_first = [], []
    for i in range(steps):
        fbmt_first.append(i % 2 == 0)
        order = ((0, fbmt_fn), (1, torch_fn)) if i % 2 == 0 else ((1, torch_fn), (0, fbmt_fn))
        t = [0.0, 0.0]
        for k, fn in order:
            t0 = time.perf_counter()
            fn()
            t[k] = time.perf_counter() - t0
        pairs.append(t)
    ratios = sorted(b / a for a, b in pairs)
    q = statistics.quantiles(ratios, n=4)
    by_order = [statistics.median(b / a for (a, b), f in zip(pairs, fbmt_first) if f == first) for first in (1, 0)]
    return dict(
        fbmt_first=by_order[0],  # the ratio of the pairs where fbmt ran first,
        fbmt_second=by_order[1],  # and where it ran right after torch's step (NOTE: [Chunks taken in turn])
        fbmt=statistics.median(a for a, _ in pairs),
        torch=statistics.median(b for _, b in pairs),
        ratio=statistics.median(ratios),
        q1=q[0],
        q3=q[2],
    )


def copy_bandwidth(numel: int) -> float:
    src, dst = torch.randn(numel), torch.empty(numel)
    t = median_time(lambda: dst.copy_(src), 5)
    return 2 * numel * 4 / t / 1e9  # bytes read + written


def share_state(fbmt_opt: AdamOffloadOptimizer, torch_opt: torch.optim.Optimizer, p, q) -> None:
    """After one step of each, point torch's moments for `q` at fbmt's for `p`: both methods then read
    and write the same memory. On a VM the pages of two allocations can differ in bandwidth by several
    percent, which, with separate arrays, measured the placement rather than the kernel."""
    fbmt_opt.step()
    torch_opt.step()
    st = fbmt_opt.state[p]
    torch_opt.state[q]["exp_avg"] = st["exp_avg"].view_as(q)
    torch_opt.state[q]["exp_avg_sq"] = st["exp_avg_sq"].view_as(q)


def case_fp32(n: int, steps: int) -> dict[str, float]:
    hp = dict(lr=1e-3, weight_decay=0.01)
    p = torch.nn.Parameter(torch.randn(n))
    p.grad = torch.randn(n)
    fbmt_opt, torch_opt = AdamOffloadOptimizer([p], **hp), torch.optim.AdamW([p], fused=True, **hp)
    share_state(fbmt_opt, torch_opt, p, p)
    return paired(fbmt_opt.step, torch_opt.step, steps)


def case_bf16(n: int, steps: int) -> dict[str, float]:
    hp = dict(lr=1e-3, weight_decay=0.01)
    p = torch.nn.Parameter(torch.randn(n).bfloat16())
    p.grad = torch.randn(n).bfloat16()
    fbmt_opt = AdamOffloadOptimizer([p], **hp)
    fbmt_opt.step()  # makes its fp32 master, which torch's recipe then updates too
    master = torch.nn.Parameter(fbmt_opt.state[p]["master"])
    master.grad = torch.empty(n)
    torch_opt = torch.optim.AdamW([master], fused=True, **hp)

    def torch_recipe() -> None:
        master.grad.copy_(p.grad)  # upcast
        torch_opt.step()
        p.data.copy_(master.detach())  # downcast, round to nearest even

    share_state(fbmt_opt, torch_opt, p, master)
    return paired(fbmt_opt.step, torch_recipe, steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=50_000_000)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    n = args.numel
    bw = copy_bandwidth(n)
    cpu = platform.processor() or platform.machine()
    print(
        f"CPU Adam, {n / 1e6:.0f}M parameters, {native().affinity_threads()} fbmt threads, "
        f"{torch.get_num_threads()} torch threads, SIMD level {simd_level()}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs ({cpu})"
    )
    print(f"large-copy bandwidth (read + write): {bw:.1f} GB/s")
    print(
        f"{'case':<44} {'fbmt ms':>8} {'torch ms':>9} {'torch/fbmt [quartiles]':>23} "
        f"{'fbmt GB/s':>10} {'torch GB/s':>10}  fbmt first / second"
    )
    # Bytes per element each method must move: (a) both read g, p, m, v and write p, m, v (28 B).
    # (b) fbmt: read g(2) master m v, write master m v, param(2) = 28 B; torch's recipe adds an upcast
    # (read 2, write 4) and a downcast (read 4, write 2): 40 B.
    for name, fn, fbmt_bytes, torch_bytes in (
        ("(a) fp32 vs AdamW(fused=True)", case_fp32, 28, 28),
        ("(b) bf16 grad/param, fp32 master vs recipe", case_bf16, 28, 40),
    ):
        r = fn(n, args.steps)
        print(
            f"{name:<44} {r['fbmt'] * 1e3:8.1f} {r['torch'] * 1e3:9.1f} "
            f"{r['ratio']:7.2f}x [{r['q1']:.2f}, {r['q3']:.2f}]x "
            f"{fbmt_bytes * n / r['fbmt'] / 1e9:10.1f} {torch_bytes * n / r['torch'] / 1e9:10.1f}"
            f"  {r['fbmt_first']:.2f}x / {r['fbmt_second']:.2f}x"
        )


if __name__ == "__main__":
    main()
