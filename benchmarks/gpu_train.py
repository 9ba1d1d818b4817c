"""fbmt vs PyTorch FSDP2 (eager, and with torch.compile per block), same model, same GPUs, one run.

    torchrun --nproc_per_node=2 benchmarks/gpu_train.py --config 1.36b --batch 8 --seq 2048 --remat none
    torchrun --nproc_per_node=2 benchmarks/gpu_train.py --config 6.7b --batch 4 --seq 2048 --remat block
    torchrun --nproc_per_node=1 benchmarks/gpu_train.py --config 0.89b --hf --batch 4 --remat mincut --zero 2

Every method trains the same Llama-style model (benchmarks/llama.py) from the same initial weights
(each parameter drawn from a generator seeded by its name) on the same tokens, with bf16 compute,
fp32 parameters and gradient reduction, and fused AdamW. Printed per method: tokens/s per GPU, MFU
against 989 TFLOP/s dense bf16 (H200), peak allocated memory, the time to set up and to run the first
step, the first losses (fbmt's must agree with FSDP2's), and the fbmt/peer ratios. `--out` writes
JSON; `--profile` adds one profiled step per method: each CUDA stream's busy time by kernel kind, and
where the compute stream idles (which kernels around each gap, which other stream ran meanwhile).
`--interleave` builds the methods side by side and times their steps in turn, and prints the ratio
of each round's step times (paired: the GPUs' clocks drift within a run, BENCHMARKS.md).
CPU ranks work too (gloo), for checking the script, not for speed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import itertools
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from typing import Any

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
    std = 0.02 if "embed" in name else 0.02 / 2**0.5
    return torch.empty(shape, device=device).normal_(0.0, std, generator=g)


def batch(step: int, args: argparse.Namespace, cfg: LlamaConfig, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 1009 + dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


# ---- methods: each returns (model, optimizer) ready to train ----


def init_buffers(model: nn.Module, m: nn.Module) -> None:
    """HF's buffers of a module built on meta (the rotary frequencies), as HF's own init computes them."""
    if hasattr(model, "_init_weights") and any(True for _ in m.buffers(recurse=False)):
        model._init_weights(m)


def build_model(cfg: LlamaConfig, args: argparse.Namespace) -> nn.Module:
    """This file's Llama, or with --hf transformers' LlamaForCausalLM of the same shape, unmodified (called
    as HF documents: `model(input_ids=x, labels=x).loss`, the labels shifted inside)."""
    if not args.hf:
        return (LlamaWithLoss if args.loss_in_model else Llama)(cfg)
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads or cfg.n_heads,
        max_position_embeddings=cfg.max_seq,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def build_fbmt(
    cfg: LlamaConfig,
    args: argparse.Namespace,
    device: torch.device,
    backend: str = "eager",
    remat: str | None = None,
    zero: int | None = None,
    graph: bool = False,
    schedule: str = "prefetch",
    adam: str = "torch",
    disable: tuple[str, ...] = (),
    package: str = "fbmt",
    call: dict[str, Any] | None = None,
    lora: int = 0,
    fp8: str | None = None,
    background_compile: bool | None = None,
) -> tuple[nn.Module, Any]:
    """`package`: "fbmt", or "fbmt_base", an earlier commit's fbmt renamed (`--base`), to time against.
    `call`: keyword arguments every --hf call adds (use_cache=False, as the peer is called). `lora`: with
    --hf, a `peft` LoRA adapter of this rank on every projection, the base model frozen."""
    fbmt = importlib.import_module(package)

    with torch.device("meta"):
        model = build_model(cfg, args)
        if lora:
            import peft

            projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            adapter = peft.LoraConfig(r=lora, lora_alpha=2 * lora, lora_dropout=0.0, target_modules=projections)
            model = peft.get_peft_model(model, adapter)
    paths = {id(m): name for name, m in model.named_modules()}

    def init(m: nn.Module) -> None:
        init_buffers(model, m)
        for pname, p in m.named_parameters(recurse=False):
            full = f"{paths[id(m)]}.{pname}" if paths[id(m)] else pname
            with torch.no_grad():
                p.copy_(param_value(full, p.shape, p.device))

    model = fbmt.compile(
        model,
        zero=zero or args.zero,
        remat=remat or args.remat,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        backend=backend,
        schedule=schedule,
        prefetch=args.prefetch,
        cuda_graph=graph,
        disable=disable,
        init_fn=init,
        **({"fp8": fp8} if fp8 else {}),  # an earlier commit's fbmt (--base) has no such option
        **({"background_compile": background_compile} if background_compile is not None else {}),
        device=device,
    )
    if call:
        model.__dict__["peer_call"] = call
    if adam == "fbmt":  # fbmt's fused numba Adam(W): the same update as torch's AdamW, one kernel per shard
        return model, fbmt.optim.AdamOptimizer(model.parameters(), lr=args.lr, weight_decay=0.1)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=device.type == "cuda")


def build_fsdp2(
    cfg: LlamaConfig,
    args: argparse.Namespace,
    device: torch.device,
    compile_blocks: bool = False,
    dynamic: bool | None = None,
) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import distribute_tensor

    with torch.device("meta"):
        model = build_model(cfg, args)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers if args.hf else model.layers
    for i, layer in enumerate(layers):
        if args.remat == "block":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layer = checkpoint_wrapper(layer)
        if compile_blocks:
            layer = torch.compile(layer, dynamic=dynamic)
        fully_shard(layer, mp_policy=mp)
        layers[i] = layer
    fully_shard(model, mp_policy=mp)
    if args.hf:  # the peer at its best: HF's default call passes a cache through the layers, and torch.compile
        # recompiles each layer for it until its recompile limit sends the rest to eager
        model.__dict__["peer_call"] = {"use_cache": False}
    model.to_empty(device=device)
    for m in model.modules():
        init_buffers(model, m)
    with torch.no_grad():
        for name, p in model.named_parameters():
            clean = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
            p.copy_(distribute_tensor(param_value(clean, p.shape, device), p.device_mesh, p.placements))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=device.type == "cuda")


FBMT_VARIANTS: dict[str, dict[str, Any]] = {
    "fbmt": {},
    "fbmt-inductor": {"backend": "inductor"},
    "fbmt-inductor-selective": {"backend": "inductor", "remat": "selective"},
    "fbmt-inductor-selective-zero2": {"backend": "inductor", "remat": "selective", "zero": 2},
    "fbmt-inductor-mincut": {"backend": "inductor", "remat": "mincut"},
    "fbmt-inductor-mincut-zero2": {"backend": "inductor", "remat": "mincut", "zero": 2},
    # --hf called with use_cache=False: transformers builds the causal mask as a tensor (NOTE: [Causal masks])
    "fbmt-inductor-mincut-nocache": {"backend": "inductor", "remat": "mincut", "call": {"use_cache": False}},
    # --hf fine-tuned through a LoRA adapter of rank 16 (peft), against the full fine-tune above
    "fbmt-inductor-mincut-lora": {"backend": "inductor", "remat": "mincut", "lora": 16},
    "fbmt-inductor-mincut-zero2-nocache": {
        "backend": "inductor",
        "remat": "mincut",
        "zero": 2,
        "call": {"use_cache": False},
    },
    # without the merged products (NOTE: [Merged products])
    "fbmt-inductor-nomerge": {"backend": "inductor", "disable": ("merge",)},
    "fbmt-inductor-mincut-zero2-nomerge": {"backend": "inductor", "remat": "mincut", "zero": 2, "disable": ("merge",)},
    # the cross-entropy as traced, not in chunks of tokens (NOTE: [Chunked cross-entropy])
    "fbmt-inductor-noloss": {"backend": "inductor", "disable": ("loss",)},
    # the layers' products in FP8 (NOTE: [FP8 products])
    "fbmt-inductor-fp8": {"backend": "inductor", "fp8": "tensorwise"},
    "fbmt-inductor-fp8-rowwise": {"backend": "inductor", "fp8": "rowwise"},
    "fbmt-inductor-mincut-zero2-fp8": {"backend": "inductor", "remat": "mincut", "zero": 2, "fp8": "tensorwise"},
    # fbmt's own fused Adam (fbmt.optim.AdamOptimizer) instead of torch.optim.AdamW(fused=True)
    "fbmt-inductor-adam": {"backend": "inductor", "adam": "fbmt"},
    "fbmt-inductor-mincut-zero2-adam": {"backend": "inductor", "remat": "mincut", "zero": 2, "adam": "fbmt"},
}
# variants that differ only in a tuning knob fbmt reads from the environment when it launches a kernel
# (NOTE: [Bounded copies]): that environment is set around each of the method's steps, so that
# interleaved methods can differ in it
KNOB_VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "fbmt-inductor-mincut-zero2-sum64k": (
        "fbmt-inductor-mincut-zero2",
        {"FBMT_SUM_BLOCK": "65536", "FBMT_SUM_WARPS": "32"},
    ),
}
METHODS: dict[str, Callable[..., tuple[nn.Module, Any]]] = {
    "fsdp2": build_fsdp2,
    "fsdp2-compile": lambda cfg, args, device: build_fsdp2(cfg, args, device, compile_blocks=True),
    # for batches of many lengths (benchmarks/lengths.py): one symbolic compile per layer
    "fsdp2-compile-dynamic": lambda cfg, args, device: build_fsdp2(
        cfg, args, device, compile_blocks=True, dynamic=True
    ),
}
for _name, _kw in FBMT_VARIANTS.items():  # each fbmt variant, with "-graph" its step as CUDA graphs, and with
    for _graph in (False, True):  # "base-" the same on the earlier commit of --base
        _suffix = "-graph" if _graph else ""
        METHODS[_name + _suffix] = functools.partial(build_fbmt, **_kw, graph=_graph)
        METHODS[f"base-{_name}{_suffix}"] = functools.partial(build_fbmt, **_kw, graph=_graph, package="fbmt_base")
for _name, (_base, _) in KNOB_VARIANTS.items():
    METHODS[_name] = METHODS[_base]


@contextlib.contextmanager
def knobs(method: str):
    """The environment of `method`'s KNOB_VARIANTS entry, if any, while the block runs."""
    env = KNOB_VARIANTS.get(method, ("", {}))[1]
    saved = {k: os.environ.get(k) for k in env}

    def apply(values: dict[str, str | None]) -> None:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        from fbmt.compiler.collectives import copies  # the knobs are read once and cached: read them again

        for cached in (copies.tiling, copies.sum_tiling, copies.programs):
            cached.cache_clear()

    apply(env)
    try:
        yield
    finally:
        apply(saved)


def is_fbmt(method: str) -> bool:
    return method.startswith(("fbmt", "base-fbmt"))


def traced_runs(model: Any) -> int:
    """How many region calls of an fbmt model ran as traced while their compile was in the workers."""
    return getattr(getattr(model, "regions", None), "eager_runs", 0)


# what these passes decided about the model's ends; "trace": the attention masks it proved causal, where it says
PASSES_SHOWN = ("trace", "remat", "merge", "shard", "schedule")


def passes_shown(program: Any) -> dict[str, str]:
    """The last clause of each PASSES_SHOWN line of the program's summary (a quiet trace has no line)."""
    ran = {r.name for r in program.history}
    return {name: program.summary(name).split("; ")[-1] for name in PASSES_SHOWN if name in ran}


def train_step(
    model: nn.Module,
    opt: Any,
    args: argparse.Namespace,
    cfg: LlamaConfig,
    device: torch.device,
    step: int = 0,
    inputs: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    x, y = inputs or batch(step, args, cfg, device)
    if args.hf:
        loss = model(input_ids=x, labels=x, **model.__dict__.get("peer_call", {})).loss
    else:
        loss = model(x, y) if args.loss_in_model else loss_fn(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


KERNEL_KINDS = (
    ("nccl", ("nccl",)),
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_", "cublas")),
    ("attention", ("flash", "fmha", "cudnn", "attention")),
    ("triton", ("triton",)),
    ("copy/cast", ("copy", "cat", "elementwise_kernel", "vectorized", "fill")),
    ("optimizer", ("adam", "foreach", "multi_tensor")),
)


def kernel_profile(step: Callable[[], Any]) -> dict[str, Any]:
    """One step under the CUDA profiler: wall time, and per stream the busy time by kernel kind."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        host = time.perf_counter() - t0  # the host's time to issue the step
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    cpu = sorted(((e.key, e.self_cpu_time_total / 1e3, e.count) for e in prof.key_averages()), key=lambda x: -x[1])[:12]
    kernels = cuda_kernels(prof)
    streams: dict[int, dict[str, float]] = {}
    for sid, ks in kernels.items():
        for a, b, name in ks:
            kind = next((k for k, keys in KERNEL_KINDS if any(w in name.lower() for w in keys)), "other")
            streams.setdefault(sid, {}).setdefault(kind, 0.0)
            streams[sid][kind] += b - a
    compute = busiest(kernels)
    # what the host did before the compute stream's first kernel (the step starts after a synchronization,
    # so the GPU idles meanwhile): CPU ops of 50 us or more, from the first thing the profiler saw
    first_kernel = min(
        (a for a, _, name in compute if not name.startswith(("Memcpy", "Memset"))), default=compute[0][0]
    )
    began = min(e.time_range.start for e in prof.events()) / 1e3
    before = sorted(
        (e.time_range.start / 1e3 - began, (e.time_range.end - e.time_range.start) / 1e3, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CPU
        and e.time_range.start / 1e3 < first_kernel
        and e.time_range.elapsed_us() >= 50
    )
    by_name: dict[str, list[float]] = {}  # the compute stream's kernels by name: which ones take the time
    for a, b, name in compute:
        by_name.setdefault(name[:90], []).append(b - a)
    out: dict[str, Any] = {
        "wall_ms": wall * 1e3,
        "host_ms": host * 1e3,
        "streams": {},
        "gaps": gaps(kernels),
        "host_ops": [dict(op=k[:60], self_ms=round(t, 2), count=c) for k, t, c in cpu],
        "before_first_kernel": dict(
            ms=round(first_kernel - began, 3),
            host_ops=[dict(at_ms=round(a, 3), ms=round(d, 3), op=n[:60]) for a, d, n in before[:40]],
        ),
        "compute_kernels": [
            dict(name=n, ms=round(sum(v), 2), count=len(v))
            for n, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:60]
        ],
        "edges": edges(kernels),
    }
    for sid, kinds in streams.items():
        busy, end = 0.0, float("-inf")
        for a, b, _ in sorted(kernels[sid]):  # union of the kernels' intervals
            busy += max(0.0, b - max(a, end))
            end = max(end, b)
        out["streams"][str(sid)] = {"busy_ms": busy, **{k: round(v, 2) for k, v in sorted(kinds.items())}}
    return out


def cuda_kernels(prof: Any) -> dict[int, list[tuple[float, float, str]]]:
    """Per CUDA stream, its kernels as (start ms, end ms, name)."""
    kernels: dict[int, list[tuple[float, float, str]]] = {}
    for e in prof.events():
        # ranges the profiler draws on a stream around kernels ("nccl:_all_gather_base",
        # "Optimizer.step#AdamW.step") are not kernels: counted, they would count those kernels twice
        if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            kernels.setdefault(e.device_resource_id, []).append(
                (e.time_range.start / 1e3, e.time_range.end / 1e3, e.name)
            )
    return kernels


def edges(
    kernels: dict[int, list[tuple[float, float, str]]], head_ms: float = 3.0, tail_ms: float = 4.0
) -> dict[str, list[list[Any]]]:
    """Every stream's kernels in the step's first `head_ms` and in the `tail_ms` before the
    optimizer's first kernel, as [stream, start ms, duration ms, name] from the step's first kernel:
    how the step starts (the first gathers) and how its backward ends (the last reduce-scatters)."""
    every = sorted((a, b, name, sid) for sid, ks in kernels.items() for a, b, name in ks)
    first = every[0][0]
    optimizer = min(
        (a for a, _, name, _ in every if "multi_tensor" in name or "adam" in name.lower()), default=every[-1][1]
    )

    def rows(lo: float, hi: float) -> list[list[Any]]:
        return [
            [sid, round(a - first, 3), round(b - a, 3), name[:60]] for a, b, name, sid in every if b > lo and a < hi
        ]

    return {"head": rows(first, first + head_ms), "tail": rows(optimizer - tail_ms, optimizer + 0.05)}


def busiest(kernels: dict[int, list[tuple[float, float, str]]]) -> list[tuple[float, float, str]]:
    """The compute stream: the one whose kernels run longest."""
    return max(kernels.values(), key=lambda ks: sum(b - a for a, b, _ in ks))


def gaps(kernels: dict[int, list[tuple[float, float, str]]], top: int = 12) -> dict[str, Any]:
    """Where the busiest (compute) stream idles: the largest gaps between its kernels, with the
    kernels around them and when (ms from the step's first kernel), the idle time by the pair of
    kernels around it, and how much of it each other stream (copies, NCCL) was busy."""
    first = min(k[0] for ks in kernels.values() for k in ks)
    compute = busiest(kernels)
    compute.sort()
    found, end, prev = [], compute[0][1], compute[0][2]
    for a, b, name in compute[1:]:
        if a > end:
            found.append((a - end, end - first, prev[:48], name[:48]))
        if b > end:
            end, prev = b, name
    small = sum(g for g, *_ in found if g < 0.05)
    overlap: dict[str, float] = {}  # how much of the compute stream's idle time each other stream was busy
    for sid, ks in kernels.items():
        if ks is compute:
            continue
        ks.sort()
        total, j = 0.0, 0
        for g, t, *_ in sorted(found, key=lambda x: x[1]):
            a, b = first + t, first + t + g
            while j < len(ks) and ks[j][1] <= a:
                j += 1
            k = j
            while k < len(ks) and ks[k][0] < b:
                total += max(0.0, min(b, ks[k][1]) - max(a, ks[k][0]))
                k += 1
        overlap[f"{sid} ({ks[0][2][:12]})"] = round(total, 2)
    pairs: dict[tuple[str, str], list[float]] = {}
    for g, _, p, n in found:
        if g >= 0.05:
            pairs.setdefault((p[:40], n[:40]), []).append(g)
    return {
        "idle_ms": round(sum(g for g, *_ in found), 2),
        "idle_overlapped_by": overlap,
        "idle_in_gaps_under_50us_ms": round(small, 2),
        "span_ms": round(end - first, 2),
        "by_transition": [
            dict(ms=round(sum(v), 2), count=len(v), after=p, before=n)
            for (p, n), v in sorted(pairs.items(), key=lambda kv: -sum(kv[1]))[:8]
        ],
        "largest": [
            dict(ms=round(g, 3), at_ms=round(t, 1), after=p, before=n) for g, t, p, n in sorted(found)[::-1][:top]
        ],
    }


def allocator_counts() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {
        k: stats.get(k, 0) for k in ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
    }


class GcTimer:
    """Time spent in Python's garbage collector during the timed steps, per generation collected."""

    def __init__(self) -> None:
        self.ms, self.runs, self._on, self._t0 = 0.0, {0: 0, 1: 0, 2: 0}, False, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if not self._on:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.runs[info["generation"]] += 1

    @contextlib.contextmanager
    def counting(self, on: bool):
        self._on = on
        gc.callbacks.append(self)
        try:
            yield
        finally:
            gc.callbacks.remove(self)


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
    collections = GcTimer()
    allocator: dict[str, int] = {}
    traced_steps = 0  # fbmt's steps that ran a region as traced, its compile still in the workers
    for step in range(args.warmup + args.steps):
        sync()
        if step == compiled_from(args.warmup) and hasattr(model, "wait_compiled"):
            model.wait_compiled()  # timed steps run every region compiled, however fast the workers were
        if step == args.warmup and cuda:
            allocator = allocator_counts()
        traced = traced_runs(model)
        t0 = time.perf_counter()  # a step includes making its batch (a small host-to-device copy), for every method
        with collections.counting(step >= args.warmup):
            loss = train_step(model, opt, args, cfg, device, step)
            sync()
        step_times.append(time.perf_counter() - t0)
        losses.append(loss.detach())
        traced_steps += traced_runs(model) != traced
    if cuda:  # what the caching allocator did during the timed steps (cudaMalloc/cudaFree, and the
        # device-wide synchronizations it makes to free cached memory for a retry)
        allocator = {k: v - allocator.get(k, 0) for k, v in allocator_counts().items()}
    profile = (
        kernel_profile(functools.partial(train_step, model, opt, args, cfg, device)) if cuda and args.profile else None
    )
    sync_ok = None
    if cuda and is_fbmt(method):  # no host synchronization inside an fbmt step
        x, y = batch(0, args, cfg, device)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = train_step(model, opt, args, cfg, device, inputs=(x, y))
            sync_ok = True
        except RuntimeError as e:
            sync_ok = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode(0)
    timed = sum(step_times[args.warmup :])
    world = dist.get_world_size()
    tokens = args.batch * args.seq * args.steps
    # the median step too: one slow step (a full garbage collection, a straggling rank) moves the mean
    median = statistics.median(step_times[args.warmup :])
    result = dict(
        method=method,
        tok_s_gpu=tokens / timed,
        tok_s_gpu_median=args.batch * args.seq / median,
        setup_s=setup_s,
        first_step_s=step_times[0],
        step_s=timed / args.steps,
        step_ms=[round(t * 1e3, 2) for t in step_times],
        gc_ms_per_step=collections.ms / args.steps,
        gc_runs=collections.runs,
        allocator=allocator,
        losses=[float(v) for v in losses[:4]],
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        world=world,
        no_host_sync=sync_ok,
    )
    if profile is not None:
        result["profile"] = profile
    result["mfu"] = result["tok_s_gpu"] * cfg.flops_per_token(args.seq) / PEAK_FLOPS if cuda else None
    if is_fbmt(method):
        result["compile_s"] = model.compile_seconds  # trace + passes + partition of the training program
        result["inductor_s"] = model.regions.seconds  # compiling regions (backend="inductor"), in the first step
        result["capture_s"] = model.capture_seconds  # CUDA graphs (-graph methods)
        result["regions"] = repr(model.regions)
        result["traced_steps"] = traced_steps
        result["origin"] = model.program.origin  # compiled, or loaded from the compile cache (and why not kept)
        # what the passes decided about the model's ends: the last block saved or not, the group kept
        result["passes"] = passes_shown(model.program)
        model.release_graphs()  # before destroy_process_group, which waits for graphs that captured NCCL
    del model, opt, loss
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    torch._dynamo.reset()
    return result


def balanced_orders(methods: list[str]) -> list[list[str]]:
    """The orders of successive rounds, each with every method once, such that over the cycle of
    rounds (the next cycle's first step included) every method is timed right after every other
    exactly once: each step's predecessor, whose heat and power state it inherits, is balanced.
    Reversing a fixed order every round (A B C, C B A) kept B in the middle, always after A or C
    while they ran after themselves at the round boundaries, so B's ratio to the peer came out above
    A's when A and B ran the same code."""
    n = len(methods)
    if n < 3:
        return [list(methods)]  # A B A B ...: each runs right after the other
    pairs_needed = n * (n - 1)

    def extend(rounds: list[tuple[int, ...]], used: set[tuple[int, int]]) -> list[tuple[int, ...]] | None:
        if len(rounds) == n - 1:  # the cycle closes on the first round's first method
            closing = (rounds[-1][-1], rounds[0][0])
            return rounds if closing[0] != closing[1] and closing not in used else None
        for order in itertools.permutations(range(n)):
            steps = [(rounds[-1][-1], order[0])] + list(zip(order, order[1:]))
            if len(set(steps)) == n and not used & set(steps) and all(a != b for a, b in steps):
                found = extend(rounds + [order], used | set(steps))
                if found:
                    return found
        return None

    first = tuple(range(n))
    rounds = extend([first], set(zip(first, first[1:]))) if pairs_needed <= 20 else None
    if rounds is None:  # more methods than a quick search covers: rotations, in both directions
        rounds = [tuple((i + j) % n for j in range(n)) for i in range(n)]
        rounds += [r[::-1] for r in rounds]
    return [[methods[i] for i in r] for r in rounds]


def compiled_from(warmup: int) -> int:
    """The step before which fbmt's background compiles are waited for: the last warmup step, where
    there are two or more, so that the first step running the compiled regions, which pays for loading
    their kernels (seconds with Inductor's caches off, `--base`), is not timed."""
    return warmup - 1 if warmup >= 2 else warmup


def interleaved(
    methods: list[str], cfg: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """`--interleave`: build every method side by side, warm each up, then time their steps in turn,
    in the orders of `balanced_orders` (two methods: A B A B ...). The GPUs' clocks follow their
    power draw and temperature (an H200 runs at its power cap under these products), so methods
    timed one after the other see different clocks; taken in turn, each round's steps see the same,
    and the ratio of a round's two steps is a paired measurement. A method's peak is what it
    allocated beyond the others' resident state."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    built: dict[str, dict[str, Any]] = {}
    for method in methods:
        base = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        with knobs(method):
            model, opt = METHODS[method](cfg, args, device)
            sync()
            r = built[method] = dict(
                method=method, model=model, opt=opt, setup_s=time.perf_counter() - started, step_ms=[], losses=[]
            )
            for step in range(args.warmup):
                if step == compiled_from(args.warmup) and hasattr(model, "wait_compiled"):
                    model.wait_compiled()  # timed steps run every region compiled, however fast the workers were
                t0 = time.perf_counter()
                r["losses"].append(train_step(model, opt, args, cfg, device, step).detach())
                sync()
                r["step_ms"].append((time.perf_counter() - t0) * 1e3)
            if compiled_from(args.warmup) == args.warmup and hasattr(model, "wait_compiled"):
                model.wait_compiled()  # fewer than two warmup steps: before the first timed one
        r["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    orders = balanced_orders(methods)
    for step in range(args.warmup, args.warmup + args.steps):
        for method in orders[step % len(orders)]:
            r = built[method]
            with knobs(method):
                sync()
                t0 = time.perf_counter()
                loss = train_step(r["model"], r["opt"], args, cfg, device, step)
                sync()
            r["step_ms"].append((time.perf_counter() - t0) * 1e3)
            r["losses"].append(loss.detach())
    for method in methods if cuda and args.profile else []:  # one profiled step each, after the timed rounds
        r = built[method]
        with knobs(method):
            r["profile"] = kernel_profile(functools.partial(train_step, r["model"], r["opt"], args, cfg, device))
    results = []
    for method in methods:
        r = built.pop(method)
        timed = r["step_ms"][args.warmup :]
        tokens = args.batch * args.seq
        out = dict(
            method=method,
            interleaved=True,
            tok_s_gpu=tokens * len(timed) / (sum(timed) / 1e3),
            tok_s_gpu_median=tokens / (statistics.median(timed) / 1e3),
            setup_s=r["setup_s"],
            first_step_s=r["step_ms"][0] / 1e3,
            step_s=sum(timed) / len(timed) / 1e3,
            step_ms=[round(t, 2) for t in r["step_ms"]],
            gc_ms_per_step=0.0,
            gc_runs={},
            allocator={},
            losses=[float(v) for v in r["losses"][:4]],
            peak_gib=r["peak_gib"],
            world=dist.get_world_size(),
            no_host_sync=None,
        )
        out["mfu"] = out["tok_s_gpu"] * cfg.flops_per_token(args.seq) / PEAK_FLOPS if cuda else None
        if "profile" in r:
            out["profile"] = r["profile"]
        if is_fbmt(method):
            out["compile_s"], out["inductor_s"] = r["model"].compile_seconds, r["model"].regions.seconds
            out["capture_s"] = r["model"].capture_seconds
            r["model"].release_graphs()  # before destroy_process_group, which waits for graphs that captured NCCL
            out["regions"] = repr(r["model"].regions)
            out["passes"] = passes_shown(r["model"].program)
        results.append(out)
    return results


def paired(ours: dict[str, Any], peer: dict[str, Any], warmup: int) -> str:
    """Round by round, the peer's step time over ours (interleaved runs): median and quartiles."""
    ratios = sorted(p / o for o, p in zip(ours["step_ms"][warmup:], peer["step_ms"][warmup:]))
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return f"paired by round: {statistics.median(ratios):.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f}, {len(ratios)} rounds)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="1.36b")
    ap.add_argument(
        "--hf", action="store_true", help="train transformers' LlamaForCausalLM of this shape (loss inside, labels=)"
    )
    ap.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument(
        "--remat",
        choices=["none", "mincut", "selective", "block"],
        default="none",
        help='recompute setting for every method (FSDP2 has no "selective" or "mincut": use them for fbmt only)',
    )
    ap.add_argument("--methods", default="fbmt,fbmt-inductor,fsdp2,fsdp2-compile")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument(
        "--loss-in-model",
        action="store_true",
        help="every method trains a module that returns the loss (logits never leave the model)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="after the timed steps, profile one step: busy time per CUDA stream by kernel kind",
    )
    ap.add_argument("--prefetch", type=int, default=1, help="fbmt: blocks gathered ahead")
    ap.add_argument(
        "--zero",
        type=int,
        choices=[2, 3],
        default=3,
        help="fbmt: 3 gathers each block again for its backward, 2 keeps its forward gather",
    )
    ap.add_argument(
        "--interleave",
        action="store_true",
        help="build every method side by side and time their steps in turn (paired ratios; "
        "no --profile, garbage-collector or allocator counts)",
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here (rank 0)")
    ap.add_argument(
        "--base",
        default=None,
        help="a folder holding fbmt_base, an earlier commit's fbmt renamed by benchmarks/base_package.sh: "
        "the base-* methods run it",
    )
    args = ap.parse_args()
    if args.base:
        sys.path.insert(0, os.path.abspath(args.base))
        # Inductor's caches key a region by its graph and options; of the lowering fbmt patches in while it
        # compiles (NOTE: [Cats of shared reads]) only by a tag a change may forget to bump: a second version
        # that loaded the first one's kernels would time the same code
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config

        inductor_config.fx_graph_cache = False
        functorch_config.enable_autograd_cache = False

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
    say(
        f"gpu_train: {args.config} ({cfg.n_params() / 1e9:.2f}B), seq {args.seq}, batch {args.batch}/GPU, remat "
        f"{args.remat}, {dist.get_world_size()} x {torch.cuda.get_device_name() if cuda else 'CPU'}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    methods = args.methods.split(",")
    from fbmt.compiler.runtime.graphs import WARMUP

    if any(m.endswith("-graph") for m in methods) and args.warmup <= WARMUP:
        ap.error(f"--warmup {args.warmup}: a -graph method warms up for {WARMUP} steps and captures in the next")
    results = interleaved(methods, cfg, args, device) if args.interleave else []
    for method in methods if not args.interleave else []:
        try:
            with knobs(method):
                r = run(method, cfg, args, device)
        except torch.OutOfMemoryError as e:
            r = dict(method=method, error=f"out of memory: {str(e).splitlines()[0]}")
            gc.collect()
            torch.cuda.empty_cache()
        results.append(r)
    for r in results:
        method = r["method"]
        if "error" in r:
            say(f"  {method:14s} {r['error']}", flush=True)
            continue
        mfu = f"{100 * r['mfu']:.1f}% MFU" if r["mfu"] is not None else ""
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else ""
        say(
            f"  {method:14s} {r['tok_s_gpu']:9.0f} tok/s/GPU  {mfu:10s} {peak:9s} setup {r['setup_s']:.1f}s  "
            f"first step {r['first_step_s']:.1f}s  losses {[round(v, 4) for v in r['losses']]}"
            + (
                f"  compile {r['compile_s']:.1f}s (+{r['inductor_s']:.1f}s inductor)  no host sync: {r['no_host_sync']}"
                if is_fbmt(method)
                else ""
            ),
            flush=True,
        )
        say(
            f"    step times (ms, warmup first): {r['step_ms']}"
            + (
                ""
                if args.interleave
                else f"; Python's garbage collector {r['gc_ms_per_step']:.2f} ms per timed step, collections by "
                f"generation {r['gc_runs']}"
            )
            + (f"; CUDA caching allocator over the timed steps: {r['allocator']}" if r["allocator"] else ""),
            flush=True,
        )
        for name, summary in r.get("passes", {}).items():
            say(f"    {name}: {summary}", flush=True)
        if "profile" in r:
            gp = r["profile"]["gaps"]
            say(
                f"    compute stream idle {gp['idle_ms']:.1f} ms between its kernels over a {gp['span_ms']:.1f} ms "
                f"span ({gp['idle_in_gaps_under_50us_ms']:.1f} ms in gaps under 50 us); largest gaps:",
                flush=True,
            )
            for x in gp["largest"][:6]:
                say(
                    f"      {x['ms']:7.3f} ms at {x['at_ms']:7.1f} ms  after {x['after']}  before {x['before']}",
                    flush=True,
                )
            say(f"    compute idle time during other streams' kernels (ms): {gp['idle_overlapped_by']}", flush=True)
            say("    gaps over 50 us by transition:", flush=True)
            for x in gp["by_transition"]:
                say(f"      {x['ms']:7.2f} ms in {x['count']:4d}  after {x['after']}  before {x['before']}", flush=True)
            say(
                f"    host issued the step in {r['profile']['host_ms']:.1f} ms; host ops by self time: "
                + ", ".join(f"{x['op']} {x['self_ms']:.1f} ms/{x['count']}" for x in r["profile"]["host_ops"]),
                flush=True,
            )
        if "profile" in r:
            for part in ("head", "tail"):
                say(f"    the step's {part} (stream, start ms, ms, kernel):", flush=True)
                for sid, a, d, name in r["profile"]["edges"][part]:
                    say(f"      {sid:>3} {a:8.3f} {d:7.3f}  {name}", flush=True)
            say(
                "    compute stream's kernels by total time: "
                + "; ".join(
                    f"{x['name'][:60]} {x['ms']:.1f} ms/{x['count']}" for x in r["profile"]["compute_kernels"][:12]
                ),
                flush=True,
            )
        for sid, st in r.get("profile", {}).get("streams", {}).items():
            say(
                f"    profiled step {r['profile']['wall_ms']:.1f} ms, stream {sid}: "
                + ", ".join(f"{k} {v:.1f}" for k, v in st.items()),
                flush=True,
            )
    done = {r["method"]: r for r in results if "error" not in r}
    for ours in (m for m in METHODS if m.startswith("fbmt") and m in done and f"base-{m}" in done):
        ratio = done[f"base-{ours}"]["step_s"] / done[ours]["step_s"]  # > 1: this commit's step is faster
        mem = done[ours]["peak_gib"] / done[f"base-{ours}"]["peak_gib"] if done[ours]["peak_gib"] else float("nan")
        say(
            f"  {ours} / base-{ours} (--base {args.base}): {ratio:.3f}x by mean step time"
            + (f"; {paired(done[ours], done[f'base-{ours}'], args.warmup)}" if args.interleave else "")
            + f", {mem:.2f}x peak memory",
            flush=True,
        )
    for ours in (m for m in METHODS if m.startswith("fbmt")):
        if ours not in done:
            continue
        for peer in ("fsdp2", "fsdp2-compile"):
            if peer in done:
                ratio = done[ours]["tok_s_gpu"] / done[peer]["tok_s_gpu"]
                by_median = done[ours]["tok_s_gpu_median"] / done[peer]["tok_s_gpu_median"]
                mem = done[ours]["peak_gib"] / done[peer]["peak_gib"] if done[peer]["peak_gib"] else float("nan")
                say(
                    f"  {ours} / {peer}: {ratio:.3f}x tokens/s ({by_median:.3f}x by median step"
                    + (f"; {paired(done[ours], done[peer], args.warmup)}" if args.interleave else "")
                    + f"), {mem:.2f}x peak memory",
                    flush=True,
                )
        peer = "fsdp2" if "fsdp2" in done else "fsdp2-compile" if "fsdp2-compile" in done else None
        if peer:
            gap = max(abs(a - b) for a, b in zip(done[ours]["losses"], done[peer]["losses"]))
            say(
                f"  {ours}: first losses agree with {peer} to {gap:.2e}" + ("" if gap < 2e-2 else "  <-- MISMATCH"),
                flush=True,
            )
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump(dict(config=args.config, args=vars(args), torch=torch.__version__, results=results), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
