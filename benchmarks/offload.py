"""Big models on one GPU and its host: the largest Llama of width 4096 (by layers) that trains, with and
without offload, fbmt against FSDP2 (with `CPUOffloadPolicy` for offload); tokens/s where both fit.

    python benchmarks/offload.py --sweep 2,4 --out DIR       # every method at each size, one process each
    python benchmarks/offload.py --method fbmt-offload --layers 36 --out r.json     # one attempt

Methods: "fbmt" (shards, gradients and AdamW state on the device), "fbmt-offload" (`offload=True`: all
three in pinned host memory, fbmt's C++ Adam steps on the host), "fbmt-adam-offload" (shards and
gradients on the device, Adam's moments on the host: `AdamOffloadOptimizer` stages the fp32 shards
through the host in chunks), "fsdp2" and "fsdp2-offload" (FSDP2 with `CPUOffloadPolicy`, torch's AdamW
on the host). Every method trains benchmarks/llama.py's Llama with the
loss inside (vocabulary 32000, FFN 11008, 32 heads), bf16 compute, fp32 parameters and gradient
reduction, block recompute, a batch of `--batch` x `--seq` tokens, on one GPU. An attempt runs in its own
process, so that running out of device memory (an exception) or host memory (the kernel's OOM killer)
ends only it. Each writes JSON: whether it trained, its step times after the first, tokens/s, the
device's peak allocated memory and the process's peak resident host memory (pinned memory included).
A sweep at two sizes gives each method's memory per layer; the largest size is where that line meets
the device's or the host's memory, which an attempt at that size and one layer more confirms.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time

# every method alike: memory is allocated in segments that grow, so that what one size frees fits the next
# (the allocator's fragmentation would otherwise decide the largest model as much as the method)
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, LlamaWithLoss

METHODS = ("fbmt", "fbmt-offload", "fbmt-adam-offload", "fsdp2", "fsdp2-offload")


def _init_(p: torch.Tensor) -> None:
    """Weights of a trained model's scale, drawn on the GPU (fast at any size) and copied where `p` lives."""
    with torch.no_grad():
        if p.device.type == "cuda":
            p.normal_(0.0, 0.02)
        else:
            for lo in range(0, p.numel(), 1 << 26):  # through the GPU in slices: no whole-size temporary
                part = p.view(-1)[lo : lo + (1 << 26)]
                part.copy_(torch.empty(part.numel(), device="cuda").normal_(0.0, 0.02))


def build(method: str, layers: int, device: torch.device, backend: str) -> tuple[nn.Module, object]:
    cfg = dataclasses.replace(CONFIGS["6.7b"], n_layers=layers)
    with torch.device("meta"):
        model = LlamaWithLoss(cfg)
    offload = method in ("fbmt-offload", "fsdp2-offload")
    if method.startswith("fbmt"):
        import fbmt

        def init(m: nn.Module) -> None:
            for p in m.parameters(recurse=False):
                _init_(p)

        model = fbmt.compile(
            model,
            remat="block",
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float32,
            backend=backend,
            init_fn=init,
            device=device,
            offload=offload,
            cache_dir=False,
        )
        if method != "fbmt":
            return model, fbmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-4, weight_decay=0.1)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for i, layer in enumerate(model.layers):
        layer = checkpoint_wrapper(layer)
        if backend == "inductor":
            layer = torch.compile(layer)
        fully_shard(layer, mp_policy=mp, **policy)
        model.layers[i] = layer
    fully_shard(model, mp_policy=mp, **policy)
    model.to_empty(device="cpu" if offload else device)
    for p in model.parameters():
        _init_(p.to_local())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=not offload)


def attempt(args: argparse.Namespace) -> dict:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=0, world_size=1)
    out = {"method": args.method, "layers": args.layers, "batch": args.batch, "seq": args.seq}
    t0 = time.perf_counter()
    try:
        model, opt = build(args.method, args.layers, device, args.backend)
        out["params"] = sum(p.numel() for p in model.parameters())
        out["build_s"] = time.perf_counter() - t0
        times = []
        for step in range(args.steps):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 32000, (args.batch, args.seq + 1), generator=g).to(device)
            torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out["loss"] = loss.item()
            times.append(time.perf_counter() - t)
            print(f"{args.method} L={args.layers} step {step}: {times[-1]:.2f} s loss {out['loss']:.4f}", flush=True)
        out.update(trained=True, step_s=times, tokens_per_s=args.batch * args.seq / statistics.median(times[1:]))
    except torch.OutOfMemoryError as e:
        out.update(trained=False, error=f"device memory: {str(e).splitlines()[0][:200]}")
    out["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    out["host_peak_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    dist.destroy_process_group()
    return out


def sweep(args: argparse.Namespace) -> None:
    os.makedirs(args.out, exist_ok=True)
    methods = args.methods.split(",")
    for layers in [int(x) for x in args.sweep.split(",")]:
        for method in methods:
            path = os.path.join(args.out, f"{method}-{layers}.json")
            cmd = [sys.executable, __file__, "--method", method, "--layers", str(layers), "--out", path]
            cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
            cmd += ["--backend", args.backend, "--port", str(args.port + layers)]
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, timeout=args.timeout).returncode
            if not os.path.exists(path):  # killed (host memory: the OOM killer's SIGKILL) before writing
                with open(path, "w") as f:
                    json.dump({"method": method, "layers": layers, "trained": False, "error": f"exit {rc}"}, f)
            with open(path) as f:
                r = json.load(f)
            print(
                f"== {method:14s} L={layers:3d}: {'trained' if r.get('trained') else 'FAILED ' + r.get('error', '')}"
                f"  {r.get('tokens_per_s', 0):8.0f} tok/s  device {r.get('device_peak_gib', 0):6.1f} GiB  host "
                f"{r.get('host_peak_gib', 0):6.1f} GiB  ({time.perf_counter() - t0:.0f} s)",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--method", choices=METHODS)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sweep", help="sizes (layers), comma-separated: every method of --methods at each")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="inductor", choices=("eager", "inductor"))
    ap.add_argument("--port", type=int, default=29700)
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    result = attempt(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
