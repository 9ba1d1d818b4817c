"""What merging the matrix products that share an input would save on this GPU, before building it.

    python benchmarks/gemm_merge.py [--out merge.json]

A Llama block's q, k and v projections read the same normalized input, and so do the feed-forward's
gate and up projections; their weights lie side by side in the block's gathered buffer, so one
product with the weights as one matrix could replace each group, in the forward (Y = X W^T), in the
backward's input gradient (dX = sum_i G_i W_i, which one product with K = sum of the outputs computes
without the adds) and in its weight gradient (dW_i = G_i^T X). For each model of the GPU benchmark
this times the separate products (and, apart, the adds) against the merged ones, in alternation,
and prints what a step would save: per layer times layers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_sweep import timed  # noqa: E402
from llama import CONFIGS  # noqa: E402

TOKENS = {"1.36b": 8 * 2048, "6.7b": 4 * 2048, "13b": 16 * 512}  # per GPU, as gpu_train.py's rows


def group(tokens: int, d_in: int, outs: list[int], reps: int, rounds: int) -> dict[str, float]:
    """ms of one group's products, separate and merged, median over rounds that alternate them."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, d_in, device=dev, dtype=dt)
    w = torch.randn(sum(outs), d_in, device=dev, dtype=dt) * 0.02  # the gathered buffer's rows, side by side
    g = torch.randn(tokens, sum(outs), device=dev, dtype=dt)
    ws = list(w.split(outs))
    gs = [gi.contiguous() for gi in g.split(outs, dim=1)]  # the separate gradients, each its own tensor
    dxs = [torch.empty(tokens, d_in, device=dev, dtype=dt) for _ in outs]
    dx = torch.empty(tokens, d_in, device=dev, dtype=dt)
    dws = [torch.empty(o, d_in, device=dev, dtype=dt) for o in outs]
    dw = torch.empty(sum(outs), d_in, device=dev, dtype=dt)
    ys = [torch.empty(tokens, o, device=dev, dtype=dt) for o in outs]
    y = torch.empty(tokens, sum(outs), device=dev, dtype=dt)
    cases = {
        "fwd_separate": lambda: [torch.mm(x, wi.t(), out=yi) for wi, yi in zip(ws, ys)],
        "fwd_merged": lambda: torch.mm(x, w.t(), out=y),
        "dx_separate": lambda: [torch.mm(gi, wi, out=di) for gi, wi, di in zip(gs, ws, dxs)],
        "dx_adds": lambda: torch.stack(dxs).sum(0),  # what summing them costs when nothing fuses it
        "dx_merged": lambda: torch.mm(g, w, out=dx),
        "dw_separate": lambda: [torch.mm(gi.t(), x, out=di) for gi, di in zip(gs, dws)],
        "dw_merged": lambda: torch.mm(g.t(), x, out=dw),
    }
    for fn in cases.values():
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(rounds):
        for k, fn in cases.items():
            times[k].append(timed(fn, reps))
    out = {k: statistics.median(v) for k, v in times.items()}
    flops = 2 * tokens * d_in * sum(outs)
    out["tflops_fwd_separate"] = flops / out["fwd_separate"] / 1e9
    out["tflops_fwd_merged"] = flops / out["fwd_merged"] / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="1.36b,6.7b,13b")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    report: dict[str, dict] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.configs.split(","):
        cfg = CONFIGS[name]
        tokens = TOKENS[name]
        per_layer = {}
        for label, outs in (("qkv", [cfg.dim] * 3), ("gate_up", [cfg.ffn_dim] * 2)):
            r = group(tokens, cfg.dim, outs, args.reps, args.rounds)
            per_layer[label] = r
            saved = {p: r[f"{p}_separate"] - r[f"{p}_merged"] for p in ("fwd", "dx", "dw")}
            print(
                f"{name} {label}: "
                + ", ".join(f"{p} {r[f'{p}_separate']:.3f} -> {r[f'{p}_merged']:.3f} ms" for p in ("fwd", "dx", "dw"))
                + f" (adds {r['dx_adds']:.3f} ms); fwd {r['tflops_fwd_separate']:.0f} -> "
                f"{r['tflops_fwd_merged']:.0f} TFLOP/s",
                flush=True,
            )
            r["saved_ms"] = sum(saved.values())
        step = sum(r["saved_ms"] for r in per_layer.values()) * cfg.n_layers
        adds = sum(r["dx_adds"] for r in per_layer.values()) * cfg.n_layers
        print(
            f"{name}: merged products save {step:.2f} ms per step without recompute "
            f"(+ up to {adds:.2f} ms of adds), {cfg.n_layers} layers",
            flush=True,
        )
        report[name] = dict(per_layer=per_layer, step_saved_ms=step, adds_ms=adds)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
