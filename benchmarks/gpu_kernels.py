"""fbmt's numba-CUDA kernels against torch's own fused paths, same GPU, same run.

    python benchmarks/gpu_kernels.py [--numel 1000000000]

- fused Adam over one flat buffer (fp32 parameter, gradient, moments) vs torch.optim.AdamW(fused=True)
  on a parameter of the same size; and the mixed-precision case (bf16 gradient and parameter, fp32
  master and moments) for information;
- inf/nan check over 300 tensors of mixed sizes vs `torch.isfinite(t).all()` per tensor (and, for
  information, torch's multi-tensor `_amp_foreach_non_finite_check_and_unscale_`);
- sum of squares over the same tensors vs `torch._foreach_norm` (information);
- fp32 -> bf16 cast vs `Tensor.copy_`.
Times are CUDA-event medians after warm-up, on random data, of the whole call (host enqueue work
included: the GPU idles meanwhile); "GPU time" queues a long sleep kernel first, so only the GPU's
own work is timed. GB/s counts the bytes each method must move, against a device-to-device copy
measured here (bytes read + written).
"""

from __future__ import annotations

import argparse
import statistics

import torch

import fbmt.kernels as K


def cuda_time(fn, reps: int = 10, warmup: int = 3, busy_gpu: bool = False) -> float:
    """Median CUDA-event time of fn. With `busy_gpu`, a long sleep kernel is queued first, so the host's
    enqueue work (Python, argument marshalling) happens while the GPU is busy: the GPU's own time."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if busy_gpu:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU cycles
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def gpu_time(fn) -> float:
    return cuda_time(fn, warmup=1, busy_gpu=True)


def row(
    name: str, t_fbmt: float, t_peer: float | None, nbytes: float, peer: str, bw: float, t_gpu: float | None = None
) -> None:
    ratio = f"{t_peer / t_fbmt:5.2f}x vs {peer}" if t_peer else f"      ({peer})"
    gpu = "" if t_gpu is None else f"; GPU time {t_gpu * 1e3:.3f} ms = {nbytes / t_gpu / 1e9 / bw:4.0%} of copy"
    print(
        f"{name:<46} {t_fbmt * 1e3:9.3f} ms {'' if t_peer is None else f'{t_peer * 1e3:9.3f} ms':>12} "
        f"{ratio:<40} {nbytes / t_fbmt / 1e9:7.0f} GB/s = {nbytes / t_fbmt / 1e9 / bw:4.0%} of copy{gpu}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_000_000_000)
    args = ap.parse_args()
    n = args.numel
    dev = torch.device("cuda")
    torch.manual_seed(0)
    src, dst = torch.randn(n // 2, device=dev), torch.empty(n // 2, device=dev)
    bw = 2 * src.numel() * 4 / cuda_time(lambda: dst.copy_(src)) / 1e9
    src = dst = None
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; device-to-device copy {bw:.0f} GB/s")
    print(f"{'kernel':<46} {'fbmt':>12} {'peer':>12} {'peer time / fbmt time':<40} achieved bandwidth")

    # fused Adam, fp32: both read p, g, m, v and write p, m, v (28 bytes per element)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=10)
    p, g = torch.randn(n, device=dev), torch.randn(n, device=dev)
    m, v = torch.randn(n, device=dev).abs(), torch.randn(n, device=dev).abs()
    t_f = cuda_time(lambda: K.fused_adam_(p, m, v, g, **hp))
    t_f_gpu = gpu_time(lambda: K.fused_adam_(p, m, v, g, **hp))
    m = v = None
    q = torch.nn.Parameter(p)
    q.grad = g
    opt = torch.optim.AdamW([q], lr=1e-3, weight_decay=0.01, fused=True)
    opt.step()
    t_t = cuda_time(opt.step)
    row(f"fused Adam fp32, {n / 1e9:.0f}G elements", t_f, t_t, 28 * n, "AdamW(fused=True)", bw, t_f_gpu)
    q = opt = p = g = None
    torch.cuda.empty_cache()

    # fused Adam, bf16 gradient in, bf16 parameter out, fp32 master and moments: 28 bytes per element
    master = torch.randn(n, device=dev)
    m, v = torch.randn(n, device=dev).abs(), torch.randn(n, device=dev).abs()
    g16, p16 = torch.randn(n, device=dev).bfloat16(), torch.empty(n, device=dev, dtype=torch.bfloat16)
    t_f = cuda_time(lambda: K.fused_adam_(master, m, v, g16, p16, **hp))
    row("fused Adam bf16 grad/param, fp32 master", t_f, None, 28 * n, "one pass, no peer", bw)
    master = m = v = g16 = p16 = None
    torch.cuda.empty_cache()

    # 300 tensors of mixed sizes, bf16 (gradients of a mid-size model)
    gen = torch.Generator().manual_seed(0)
    sizes = [int(s) for s in torch.randint(1_000, 4_000_000, (300,), generator=gen)]
    ts = [torch.randn(s, device=dev).bfloat16() for s in sizes]
    nbytes = 2 * sum(sizes)
    t_f = cuda_time(lambda: K.multi_tensor_nonfinite(ts))
    t_t = cuda_time(lambda: torch.stack([torch.isfinite(t).all() for t in ts]).all())
    row(
        f"inf/nan check, 300 tensors, {sum(sizes) / 1e6:.0f}M bf16",
        t_f,
        t_t,
        nbytes,
        "torch.isfinite(t).all()",
        bw,
        gpu_time(lambda: K.multi_tensor_nonfinite(ts)),
    )
    found, inv = torch.zeros(1, device=dev), torch.ones(1, device=dev)
    ts32 = [t.float() for t in ts]
    t_amp = cuda_time(lambda: torch._amp_foreach_non_finite_check_and_unscale_(ts32, found, inv))
    t_f32 = cuda_time(lambda: K.multi_tensor_nonfinite(ts32))
    row("inf/nan check, same tensors in fp32", t_f32, t_amp, 2 * nbytes, "_amp_foreach_..._unscale_ (r+w)", bw)
    t_f = cuda_time(lambda: K.multi_tensor_sum_of_squares(ts))
    t_t = cuda_time(lambda: torch.stack(torch._foreach_norm(ts)).float().square().sum())
    row(
        "sum of squares, same 300 bf16 tensors",
        t_f,
        t_t,
        nbytes,
        "torch._foreach_norm",
        bw,
        gpu_time(lambda: K.multi_tensor_sum_of_squares(ts)),
    )
    ts = ts32 = None
    torch.cuda.empty_cache()

    x, y = torch.randn(n, device=dev), torch.empty(n, device=dev, dtype=torch.bfloat16)
    t_f = cuda_time(lambda: K.cast_(x, y))
    t_t = cuda_time(lambda: y.copy_(x))
    row(f"cast fp32 -> bf16, {n / 1e9:.0f}G elements", t_f, t_t, 6 * n, "Tensor.copy_", bw)


if __name__ == "__main__":
    main()
