"""The loss's kernels on a GPU: Hugging Face's LlamaForCausalLM of one layer (width 2048, vocabulary
32000), the loss inside (`labels=`), compiled by fbmt with Inductor, in variants, interleaved.

    python benchmarks/loss_kernels.py --out DIR      # one GPU

Variants: `chunked` (the loss pass, NOTE: [Chunked cross-entropy]), `whole` (`disable=("loss",)`),
and `chunked-noguard` (the chunked program compiled without the cat guard, NOTE: [Cats of shared
reads]). Printed: the median step (forward and backward) over interleaved rounds, and one profiled
step's kernels by total time. The Triton kernels of the loss (`log_softmax` in their name) are copied
from Inductor's cache to DIR, to read what was generated.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="loss_kernels_"))

import torch  # noqa: E402
import torch._inductor.config  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import fbmt  # noqa: E402
from fbmt.compiler.runtime import regions  # noqa: E402


def build(variant: str, layers: int, vocab: int) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    disable = ("loss",) if variant == "whole" else ()
    return fbmt.compile(
        model, backend="inductor", remat="mincut", param_dtype=torch.bfloat16, cache_dir=False, disable=disable
    )


def kernels(step) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            r = rows.setdefault(e.name, [0.0, 0])
            r[0] += e.device_time / 1e3
            r[1] += 1
    return sorted(((n, ms, c) for n, (ms, c) in rows.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--variants", default="chunked,whole,chunked-noguard")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29534", rank=0, world_size=1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    models = {v: build(v, args.layers, args.vocab) for v in args.variants.split(",")}

    def step(v: str) -> None:
        noguard = v.endswith("noguard")
        saved = regions.cat_guard
        if noguard:  # Inductor's caches would return the guarded program's kernels
            regions.cat_guard = contextlib.nullcontext
        try:
            with torch._inductor.config.patch(force_disable_caches=noguard):
                models[v](input_ids=x, labels=x).loss.backward()
        finally:
            regions.cat_guard = saved
        for p in models[v].parameters():
            p.grad = None

    times: dict[str, list[float]] = {v: [] for v in models}
    for r in range(args.rounds + 2):  # the first two rounds compile and warm up
        for v in models:
            torch.cuda.synchronize()
            started = time.perf_counter()
            step(v)
            torch.cuda.synchronize()
            if r >= 2:
                times[v].append((time.perf_counter() - started) * 1e3)
    for v in models:
        print(f"== {v}: median step {statistics.median(times[v]):.2f} ms ({len(times[v])} rounds)")
        for name, ms, count in kernels(lambda: step(v))[:14]:
            print(f"   {ms:7.3f} ms {count:4d}  {name[:120]}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        root = os.environ["TORCHINDUCTOR_CACHE_DIR"]
        for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
            with open(path) as f:
                text = f.read()
            if "log_softmax" in text and "@triton.jit" in text:
                shutil.copy(path, os.path.join(args.out, os.path.basename(path)))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
