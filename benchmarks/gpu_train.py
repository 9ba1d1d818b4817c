"""fbmt vs PyTorch FSDP2 (eager, and with torch.compile per block), same model, same GPUs, one run.

    torchrun --nproc_per_node=2 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none
    torchrun --nproc_per_node=2 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block

Every method trains the same Llama-style model (benchmarks/llama.py) from the same initial weights
(each parameter drawn from a generator seeded by its name) on the same tokens, with bf16 compute,
fp32 parameters and gradient reduction, and fused AdamW. Printed per method: tokens/s per GPU, MFU
against 989 TFLOP/s dense bf16 (H200), peak allocated memory, the time to set up and to run the first
step, the first losses (fbmt's must agree with FSDP2's), and the fbmt/peer ratios. `--out` writes
JSON. CPU ranks work too (gloo), for checking the script, not for speed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import zlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, Llama, LlamaConfig, LlamaWithLoss

PEAK_FLOPS = 989e12  # H200 dense bf16


def param_value(name: str, shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The initial value of parameter `name`: the same for every method and any sharding."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
    std = 0.02 if "embed" in name else 0.02 / 2 ** 0.5
    return torch.empty(shape, device=device).normal_(0.0, std, generator=g)


def batch(step: int, args: argparse.Namespace, cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 1009 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# ---- methods: each returns (model, optimizer) ready to train ----

def build_fbmt(cfg: LlamaConfig, args: argparse.Namespace, device: torch.device,
               backend: str = "eager", remat: str | None = None) -> tuple[nn.Module, Any]:
    import fbmt

    with torch.device("meta"):
        model = (LlamaWithLoss if args.loss_in_model else Llama)(cfg)
    paths = {id(m): name for name, m in model.named_modules()}

    def init(m: nn.Module) -> None:
        for pname, p in m.named_parameters(recurse=False):
            full = f"{paths[id(m)]}.{pname}" if paths[id(m)] else pname
            with torch.no_grad():
                p.copy_(param_value(full, p.shape, p.device))

    model = fbmt.compile(model, remat=remat or args.remat, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         backend=backend, init_fn=init, device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=device.type == "cuda")


def build_fsdp2(cfg: LlamaConfig, args: argparse.Namespace, device: torch.device,
                compile_blocks: bool = False) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = (LlamaWithLoss if args.loss_in_model else Llama)(cfg)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, layer in enumerate(model.layers):
        if args.remat == "block":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layer = checkpoint_wrapper(layer)
        if compile_blocks:
            layer = torch.compile(layer)
        fully_shard(layer, mp_policy=mp)
        model.layers[i] = layer
    fully_shard(model, mp_policy=mp)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            p.copy_(distribute_tensor(param_value(clean, p.shape, device), p.device_mesh, p.placements))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=device.type == "cuda")


METHODS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {
    "fbmt": build_fbmt,
    "fbmt-inductor": lambda cfg, args, device: build_fbmt(cfg, args, device, backend="inductor"),
    "fbmt-inductor-selective": lambda cfg, args, device: build_fbmt(cfg, args, device, backend="inductor",
                                                                    remat="selective"),
    "fsdp2": build_fsdp2,
    "fsdp2-compile": lambda cfg, args, device: build_fsdp2(cfg, args, device, compile_blocks=True),
}


def run(method: str, cfg: LlamaConfig, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    started = time.perf_counter()
    model, opt = METHODS[method](cfg, args, device)
    sync()
    setup_s = time.perf_counter() - started
    losses, step_times = [], []
    for step in range(args.warmup + args.steps):
        x, y = batch(step, args, cfg, device)
        sync()
        t0 = time.perf_counter()
        loss = model(x, y) if args.loss_in_model else loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
    sync_ok = None
    if cuda and method.startswith("fbmt"):  # no host synchronization inside an fbmt step
        x, y = batch(0, args, cfg, device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = model(x, y) if args.loss_in_model else loss_fn(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync_ok = True
        except RuntimeError as e:
            sync_ok = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    timed = sum(step_times[args.warmup:])
    world = dist.get_world_size()
    tokens = args.batch * args.seq * args.steps
    result = dict(method=method, tok_s_gpu=tokens / timed, setup_s=setup_s, first_step_s=step_times[0],
                  step_s=timed / args.steps, losses=[float(v) for v in losses[:4]],
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, world=world,
                  no_host_sync=sync_ok)
    result["mfu"] = result["tok_s_gpu"] * cfg.flops_per_token(args.seq) / PEAK_FLOPS if cuda else None
    if method.startswith("fbmt"):
        result["compile_s"] = model.compile_seconds  # trace + passes + partition of the training program
        result["inductor_s"] = model.regions.seconds  # compiling regions (backend="inductor"), in the first step
        result["regions"] = repr(model.regions)
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="1.36b")
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", choices=["none", "selective", "block"], default="none",
                    help="recompute setting for every method (FSDP2 has no \"selective\": use it for fbmt only)")
    ap.add_argument("--methods", default="fbmt,fbmt-inductor,fsdp2,fsdp2-compile")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--loss-in-model", action="store_true",
                    help="every method trains a module that returns the loss (logits never leave the model)")
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = CONFIGS[args.config]
    if args.seq > cfg.max_seq:
        cfg = LlamaConfig(**{**cfg.__dict__, "max_seq": args.seq})
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"gpu_train: {args.config} ({cfg.n_params() / 1e9:.2f}B), seq {args.seq}, batch {args.batch}/GPU, remat "
        f"{args.remat}, {dist.get_world_size()} x {torch.cuda.get_device_name() if cuda else 'CPU'}, "
        f"torch {torch.__version__}", flush=True)
    results = []
    for method in args.methods.split(","):
        try:
            r = run(method, cfg, args, device)
        except torch.OutOfMemoryError as e:
            r = dict(method=method, error=f"out of memory: {str(e).splitlines()[0]}")
            gc.collect()
            torch.cuda.empty_cache()
        results.append(r)
        if "error" in r:
            say(f"  {method:14s} {r['error']}", flush=True)
            continue
        mfu = f"{100 * r['mfu']:.1f}% MFU" if r["mfu"] is not None else ""
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        say(f"  {method:14s} {r['tok_s_gpu']:9.0f} tok/s/GPU  {mfu:10s} {peak:9s} setup {r['setup_s']:.1f}s  "
            f"first step {r['first_step_s']:.1f}s  losses {[round(v, 4) for v in r['losses']]}"
            + (f"  compile {r['compile_s']:.1f}s (+{r['inductor_s']:.1f}s inductor)  no host sync: "
               f"{r['no_host_sync']}" if method.startswith("fbmt") else ""),
            flush=True)
    done = {r["method"]: r for r in results if "error" not in r}
    for ours in ("fbmt", "fbmt-inductor", "fbmt-inductor-selective"):
        if ours not in done:
            continue
        for peer in ("fsdp2", "fsdp2-compile"):
            if peer in done:
                ratio = done[ours]["tok_s_gpu"] / done[peer]["tok_s_gpu"]
                mem = done[ours]["peak_gib"] / done[peer]["peak_gib"] if done[peer]["peak_gib"] else float("nan")
                say(f"  {ours} / {peer}: {ratio:.3f}x tokens/s, {mem:.2f}x peak memory", flush=True)
        peer = "fsdp2" if "fsdp2" in done else "fsdp2-compile" if "fsdp2-compile" in done else None
        if peer:
            gap = max(abs(a - b) for a, b in zip(done[ours]["losses"], done[peer]["losses"]))
            say(f"  {ours}: first losses agree with {peer} to {gap:.2e}" + ("" if gap < 2e-2 else "  <-- MISMATCH"),
                flush=True)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(config=args.config, args=vars(args), torch=torch.__version__, results=results), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
