"""Start time: a training process's first finished step, cold and warm, fbmt against FSDP2 + per-layer
`torch.compile`.

    python benchmarks/first_step.py --config 1.36b --remat block --fbmt fbmt-inductor
    python benchmarks/first_step.py --config 0.89b --hf --remat mincut --fbmt fbmt-inductor-mincut

Every run is a process of its own (torchrun on one GPU) of benchmarks/gpu_train.py for two steps.
Cold: fbmt's compile cache, Inductor's cache and Triton's cache start in empty folders. Warm: a
second process with the same folders, as a second run of a job on the same machine. "Entry only"
(fbmt): fbmt's folder kept, Inductor's and Triton's empty again, so all that is there is what the
compile cache's entries hold (the programs and torch's cache artifacts), as on a machine that
received the folder. Before the rounds, a run of each method on a tiny model fills a folder of
Python's bytecode that every run shares, as a normal install has it (not counted). Each round runs
fbmt (with `--also`, also fbmt with those variables set, in folders of its own), then the peer.
Printed per run: the process's wall time (Python's start to its exit, both steps and the teardown
included), building the model, the first step, the first two (to a step that runs as every later
one does), and for fbmt its compile (trace and passes, or loading) and Inductor's seconds. `--out`
writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def one(
    method: str,
    args: argparse.Namespace,
    folders: dict[str, str],
    config: str | None = None,
    label: str = "bytecode",
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One process of gpu_train.py running `method` for two steps, with the caches in `folders` and
    the variables `env`; `label` names its output file under `--logs`."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1"]
    command += [f"--master_port={29500 + random.randrange(1000)}", os.path.join(HERE, "gpu_train.py")]
    shape = ["--batch", "2", "--seq", "128"] if config else ["--batch", str(args.batch), "--seq", str(args.seq)]
    command += ["--config", config or args.config, *shape, "--remat", args.remat]
    steps = "2" if config else str(args.steps)
    command += ["--methods", method, "--steps", steps, "--warmup", "0", "--out", out] + (["--hf"] if args.hf else [])
    env = {
        **os.environ,
        "FBMT_CACHE_DIR": folders["fbmt"],
        "TORCHINDUCTOR_CACHE_DIR": folders["inductor"],
        "TRITON_CACHE_DIR": folders["triton"],
        "FBMT_LOG": "info",  # for what the compile cache did (kept in the JSON)
        "PYTHONPYCACHEPREFIX": folders["pyc"],  # Python's own bytecode (see main)
        **(env or {}),
    }
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    if args.logs:  # the whole run's output, FBMT_LOG's lines included (each region's compile time)
        os.makedirs(args.logs, exist_ok=True)
        with open(os.path.join(args.logs, f"{label}_{method}.txt"), "w") as f:
            f.write(done.stdout + done.stderr)
    if done.returncode != 0:
        return dict(method=method, error=(done.stdout + done.stderr)[-2000:])
    with open(out) as f:
        (r,) = json.load(f)["results"]
    os.unlink(out)
    said = [line[line.index("]") + 2 :] for line in done.stderr.splitlines() if "compile cache" in line]
    keep = ("setup_s", "first_step_s", "step_ms", "compile_s", "inductor_s", "losses", "peak_gib", "origin")
    keep += ("traced_steps", "regions")
    return dict(method=method, wall_s=wall, **{k: r[k] for k in keep if k in r}, cache_log=said)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="1.36b")
    ap.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM (gpu_train.py --hf)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--remat", default="block")
    ap.add_argument("--fbmt", default="fbmt-inductor", help="gpu_train.py's fbmt method")
    ap.add_argument("--peer", default="fsdp2-compile", help="gpu_train.py's peer method ('': fbmt alone)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds one process may take")
    ap.add_argument(
        "--steps", type=int, default=12, help="steps each run takes (the last columns: the time to finish them all)"
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default=None, help="write each run's output to this folder")
    ap.add_argument(
        "--also", default="", help="also run fbmt with these variables set, in folders of its own, e.g. 'FBMT_STAMP=0'"
    )
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="first-step-")
    pyc = os.path.join(root, "pyc")
    folders = {
        who: {**{kind: os.path.join(root, who, kind) for kind in ("fbmt", "inductor", "triton")}, "pyc": pyc}
        for who in ("fbmt", "fbmt0", "peer")
    }
    runs = [("fbmt", args.fbmt, None)]
    if args.also:
        runs.append(("fbmt0", args.fbmt, dict(v.split("=", 1) for v in args.also.split())))
    if args.peer:
        runs.append(("peer", args.peer, None))
    # Python's bytecode of torch, transformers and fbmt is not a compile cache of either method: on a
    # machine where they were installed normally it is there before the first run. Where the
    # packages' folders cannot be written (a read-only image), every process would compile thousands
    # of source files again, so all runs keep it in one folder, filled first by a run of each method
    # on the tiny model (its own caches, not counted).
    for method in (args.fbmt, args.peer) if args.peer else (args.fbmt,):
        scratch = {kind: os.path.join(root, "bytecode", kind) for kind in ("fbmt", "inductor", "triton")}
        warmed = one(method, args, {**scratch, "pyc": pyc}, config="tiny")
        if "error" in warmed:
            print(f"the bytecode run of {method} failed: {warmed['error'][-300:]}", flush=True)
    rows = []
    for round_ in ("cold", "warm"):
        for who, method, env in runs:
            row = one(method, args, folders[who], label=f"{round_}_{who}", env=env)
            if env:
                row["method"] += " " + " ".join(f"{k}={v}" for k, v in env.items())
            rows.append(dict(round=round_, **row))
            print(json.dumps(rows[-1]), flush=True)
    entry_only = {
        **folders["fbmt"],
        "inductor": os.path.join(root, "empty", "i"),
        "triton": os.path.join(root, "empty", "t"),
    }
    rows.append(dict(round="entry only", **one(args.fbmt, args, entry_only, label="entry-only")))
    print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.config}{' (HF)' if args.hf else ''}, remat {args.remat}, batch {args.batch} x {args.seq}")
    columns = ("process", "build", "first step", "two steps", f"{args.steps} steps", "fbmt compile", "Inductor")
    print("| method | round | " + " | ".join(f"{c} (s)" for c in columns) + " | steps run as traced |")
    print("|---|---|" + "---|" * (len(columns) + 1))
    for r in rows:
        if "error" in r:
            print(f"| {r['method']} | {r['round']} | failed: {r['error'][-300:]!r} |")
            continue
        extra = (
            f"{r['compile_s']:.1f} | {r['inductor_s']:.1f} | {r.get('traced_steps', 0)}"
            if "compile_s" in r
            else "– | – | –"
        )
        two = sum(r["step_ms"][:2]) / 1e3 if len(r.get("step_ms", [])) >= 2 else float("nan")
        every = sum(r["step_ms"]) / 1e3
        times = f"{r['wall_s']:.1f} | {r['setup_s']:.1f} | {r['first_step_s']:.1f} | {two:.1f} | {every:.1f}"
        print(f"| {r['method']} | {r['round']} | {times} | {extra} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
