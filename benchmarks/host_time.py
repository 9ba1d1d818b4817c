"""Where the host's time goes in a step of transformers' LlamaForCausalLM (0.89B), one process, one GPU.

    torchrun --nproc_per_node=1 benchmarks/host_time.py                    # as HF documents the call
    torchrun --nproc_per_node=1 benchmarks/host_time.py --call no-cache    # use_cache=False

For each setting (regions compiled in the background, the default on CUDA, and in the process): the
median step, the host's time to launch the forward and the backward, the region cache's counts (calls
that still ran as traced), then cProfile's top functions of one step and the profiler's count of kernels.
A step the host launches slower than the GPU runs it shows here and not in `gpu_train.py`'s ratios.
Written for the default call's regression against 13a1be5 (BENCHMARKS.md, Hugging Face Llama): the same
program as CUDA graphs ran at the GPU's speed. On a machine without CUDA it runs the "tiny" config on
gloo with the eager backend (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import gpu_train
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile


def measure(name: str, args: argparse.Namespace, device: torch.device, **options) -> None:
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cfg = gpu_train.CONFIGS[args.config]
    call = {"use_cache": False} if args.call == "no-cache" else None
    backend = "inductor" if cuda else "eager"
    model, opt = gpu_train.build_fbmt(cfg, args, device, backend=backend, remat="mincut", call=call, **options)
    x, _ = gpu_train.batch(0, args, cfg, device)
    extra = model.__dict__.get("peer_call", {})

    def step() -> tuple[float, float]:
        started = time.perf_counter()
        loss = model(input_ids=x, labels=x, **extra).loss
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (forward - started) * 1e3, (backward - forward) * 1e3

    for i in range(args.warmup):
        step()
        print(f"{name}: warm-up step {i}: {model.regions!r}, {len(model.regions.pending)} compiling", flush=True)
    sync()
    model.regions.poll(wait=True)
    steps, hosts = [], []
    for _ in range(args.steps):
        sync()
        started = time.perf_counter()
        hosts.append(step())
        sync()
        steps.append((time.perf_counter() - started) * 1e3)
    before = model.regions.eager_runs
    step()
    print(
        f"{name}: median step {statistics.median(steps):.1f} ms, host forward "
        f"{statistics.median(h[0] for h in hosts):.1f} ms, backward {statistics.median(h[1] for h in hosts):.1f} ms; "
        f"{model.regions!r}, region calls run as traced in a step: {model.regions.eager_runs - before}",
        flush=True,
    )
    sync()
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    profiler.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(args.top)
    print(f"{name}: one step's host time by function\n" + text.getvalue().strip())
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        step()
        sync()
    events = prof.key_averages()
    kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    ops = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    print(f"{name}: {kernels} kernels, {ops} host ops in one step", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--call", choices=["default", "no-cache"], default="default")
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=18, help="functions cProfile lists")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # what gpu_train.build_fbmt reads of its arguments
    args.config = "0.89b" if cuda else "tiny"
    args.hf, args.zero, args.remat, args.prefetch, args.lr = True, 3, "mincut", 1, 1e-4
    args.batch, args.seq = (4, 2048) if cuda else (2, 64)
    measure("background compiles", args, device)
    if cuda:
        torch.cuda.empty_cache()  # the first model's memory, freed as measure returned
    measure("compiles in the process", args, device, background_compile=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
