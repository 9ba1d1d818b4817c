"""What the chunked cross-entropy saves (NOTE: [Chunked cross-entropy]): peak memory and step time
of a Llama of width 2048 with its loss inside, at vocabularies of 32k and 128k, fbmt with the loss
pass against the same program without it (`disable=("loss",)`), in one process.

    python benchmarks/loss_memory.py                          # the simulator's peak (on meta, any machine)
    python benchmarks/loss_memory.py --run --backend inductor  # and measured on this GPU, interleaved rounds

Each row is one program: `fbmt.tools.sim.memory_curve`'s peak of the step (what the step holds beyond
its persistent state), and with `--run`, on CUDA, the measured peak of a step
(`torch.cuda.max_memory_allocated` less the memory before it) and the median step time of
interleaved rounds. The model has `--layers` blocks so that the loss's share of the peak shows; the
savings do not depend on the depth.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, LlamaWithLoss  # noqa: E402

import fbmt  # noqa: E402
from fbmt.tools import sim  # noqa: E402

GIB = 2**30


def build(vocab: int, args: argparse.Namespace, device: str, chunked: bool) -> torch.nn.Module:
    cfg = dataclasses.replace(CONFIGS["1.36b"], n_layers=args.layers, vocab_size=vocab, max_seq=args.seq)
    torch.manual_seed(0)
    with torch.device("meta" if device == "meta" else device):
        model = LlamaWithLoss(cfg).to(torch.bfloat16)
    disable = () if chunked else ("loss",)
    kw = dict(world_size=1, device="meta") if device == "meta" else dict(backend=args.backend)
    return fbmt.compile(model, remat=args.remat, cache_dir=False, disable=disable, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", default="32000,128256")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="block")
    ap.add_argument("--backend", default="eager")
    ap.add_argument("--run", action="store_true", help="also run the steps on this GPU")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.run:
        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    rows = []
    for vocab in (int(v) for v in args.vocab.split(",")):
        x = torch.randint(0, vocab, (args.batch, args.seq))
        models, times, peaks = {}, {}, {}
        for chunked in (True, False):
            program = build(vocab, args, "meta", chunked).trace(x, x, device="cpu")
            curve = sim.memory_curve(program)
            row = dict(vocab=vocab, tokens=x.numel(), chunked=chunked, loss=program.summary("loss"))
            row.update(simulated_gib=curve.peak / GIB, at=curve.peak_node)
            rows.append(row)
            if args.run:
                models[chunked] = build(vocab, args, "cuda", chunked)
                times[chunked], peaks[chunked] = [], []
        if args.run:
            xc = x.cuda()
            for r in range(args.rounds + 1):  # interleaved; round 0 compiles and warms up
                for chunked, model in models.items():
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    before = torch.cuda.memory_allocated()
                    started = time.perf_counter()
                    model(xc, xc).backward()
                    torch.cuda.synchronize()
                    if r:
                        times[chunked].append(time.perf_counter() - started)
                        peaks[chunked].append(torch.cuda.max_memory_allocated() - before)
                    for p in model.parameters():
                        p.grad = None
            for row in rows[-2:]:
                row.update(
                    step_s=statistics.median(times[row["chunked"]]), measured_gib=max(peaks[row["chunked"]]) / GIB
                )
            models.clear()
            torch.cuda.empty_cache()
        for row in rows[-2:]:
            print(json.dumps(row), flush=True)
    print(f"\nLlama width 2048, {args.layers} blocks, {args.batch}x{args.seq} tokens, bf16, remat {args.remat}")
    print("| vocab | loss | simulated peak (GiB) | measured peak (GiB) | step (ms) |")
    print("|---|---|---|---|---|")
    for r in rows:
        measured = f"{r['measured_gib']:.2f} | {r['step_s'] * 1e3:.1f}" if "step_s" in r else "– | –"
        print(f"| {r['vocab']} | {'chunked' if r['chunked'] else 'whole'} | {r['simulated_gib']:.2f} | {measured} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)
    if args.run:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
