"""Batches of many lengths: fbmt against FSDP2 + per-layer `torch.compile(dynamic=True)`, one GPU.

    python benchmarks/lengths.py --config 1.36b --remat block --steps 24 --out lengths.json [--warm]

Each method trains, in a process of its own (torchrun on one GPU), on the same stream of batches whose sequence
length is drawn uniformly from [--shortest, --longest] (seeded), from a cold start (empty compile caches). Printed
per method: how many programs fbmt compiled, the whole stream's tokens/s (compiles included: what a short run
sees), the tokens/s of the steps after the third (a length that needs no new program) and of the last third (a long
run's rate, once the compiles in the background are in), and the losses of the first steps (the same model and
data). A step is `gpu_train.train_step` on a batch of `--batch` sequences of that step's length. `--warm` runs each
method a second time on the caches its first run left (a second run of the same job).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(args: argparse.Namespace) -> None:
    """One method on the stream (run by torchrun); writes its result to --out."""
    import torch
    import torch.distributed as dist

    sys.path.insert(0, HERE)
    import gpu_train

    dist.init_process_group("nccl")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    cfg = gpu_train.CONFIGS[args.config]
    cfg = gpu_train.LlamaConfig(**{**cfg.__dict__, "max_seq": max(cfg.max_seq, args.max)})
    lengths = _lengths(args)
    args.seq, args.hf, args.loss_in_model, args.lr = lengths[0], False, False, 1e-4
    model, opt = gpu_train.METHODS[args.method](cfg, args, device)
    times, losses = [], []
    for step, length in enumerate(lengths):
        args.seq = length
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = gpu_train.train_step(model, opt, args, cfg, device, step)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
        compiled = getattr(getattr(model, "regions", None), "misses", "-")
        programs = len(getattr(model, "programs", {})) or "-"
        print(
            f"step {step}: length {length}, {times[-1]:.2f}s, programs {programs}, Inductor compiles {compiled}",
            flush=True,
        )
    programs = len(getattr(model, "programs", {})) or None
    regions = getattr(model, "regions", None)
    tokens = [args.batch * n for n in lengths]
    result = dict(
        method=args.method,
        programs=programs,
        region_compiles=regions.misses if regions is not None else None,
        regions=repr(regions) if regions is not None else None,  # how many in the workers, and their seconds
        tok_s_all=sum(tokens) / sum(times),
        tok_s_steady=sum(tokens[3:]) / sum(times[3:]),
        step_s=times,
        losses=losses[:4],
        lengths=lengths,
    )
    with open(args.out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _lengths(args: argparse.Namespace) -> list[int]:
    rng = random.Random(args.seed)
    return [rng.randint(args.min, args.max) for _ in range(args.steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1.36b")
    ap.add_argument("--remat", default="block")
    ap.add_argument("--batch", type=int, default=4)
    # not --max: torchrun, which the workers' arguments pass through, reads that as its --max-restarts
    ap.add_argument("--shortest", dest="min", type=int, default=64)
    ap.add_argument("--longest", dest="max", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--methods", default="fbmt-inductor,fsdp2-compile-dynamic")
    ap.add_argument("--method", default=None, help=argparse.SUPPRESS)  # the worker's
    ap.add_argument("--prefetch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--zero", type=int, default=3, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds for each method's process")
    ap.add_argument("--warm", action="store_true", help="each method again, on the caches its first run left")
    args = ap.parse_args()
    if args.method:
        worker(args)
        return
    rows = []
    root = tempfile.mkdtemp(prefix="lengths-")
    runs = [(m, run) for m in args.methods.split(",") for run in (("", "_warm") if args.warm else ("",))]
    for method, run in runs:
        out = os.path.join(root, f"{method}{run}.json")
        env = {
            **os.environ,
            "FBMT_CACHE_DIR": os.path.join(root, method, "fbmt"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(root, method, "inductor"),
            "TRITON_CACHE_DIR": os.path.join(root, method, "triton"),
        }
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
        command += [f"--master_port={29500 + random.randrange(1000)}", os.path.abspath(__file__)]
        command += [a for a in sys.argv[1:] if a != "--warm"] + ["--method", method, "--out", out]
        log = os.path.splitext(args.out or os.path.join(root, "lengths"))[0] + f"_{method}{run}.log"
        with open(log, "w") as f:  # the worker's progress, step by step, also when it is stopped
            proc = subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                failed = proc.wait(timeout=args.timeout) != 0
            except subprocess.TimeoutExpired:  # torchrun and its worker: the whole process group
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                failed = True
        if failed:
            with open(log) as f:
                rows.append(dict(method=method, error=f.read()[-1500:]))
        else:
            with open(out) as f:
                rows.append(json.load(f))
        rows[-1]["method"] = method + (", warm" if run else "")
        print(json.dumps(rows[-1])[:600], flush=True)
    print(table(args, rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def table(args: argparse.Namespace, rows: list[dict]) -> str:
    """The methods' results as a Markdown table. The last third of the stream is the rate of a long run:
    fbmt's compiles in the workers go on for some steps after the third, while those steps run traced."""
    lines = [
        f"\n{args.config}, remat {args.remat}, batch {args.batch}, {args.steps} lengths in [{args.min}, {args.max}]",
        "| method | programs | Inductor compiles | tokens/s, whole stream | tokens/s, after step 3 "
        "| tokens/s, last third | first two steps (s) | first losses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error'][-200:]!r} |")
            continue
        losses = ", ".join(f"{v:.4f}" for v in r["losses"])
        compiles = r.get("region_compiles") or "–"
        tail = len(r["step_s"]) - len(r["step_s"]) // 3
        tail_rate = args.batch * sum(r["lengths"][tail:]) / sum(r["step_s"][tail:])
        lines.append(
            f"| {r['method']} | {r['programs'] or '–'} | {compiles} | {r['tok_s_all']:.0f} | {r['tok_s_steady']:.0f} "
            f"| {tail_rate:.0f} | {r['step_s'][0]:.1f}, {r['step_s'][1]:.1f} | {losses} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
