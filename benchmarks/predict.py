"""The simulator's prediction error: predicted against measured step time and peak memory, after
`fbmt.calibrate()`, for several strategy/recompute settings on local gloo ranks (or the GPUs).

    python benchmarks/predict.py --ranks 2        # and --ranks 4
    python benchmarks/predict.py --ranks 1 --config 1.36b   # on GPUs: the benchmark Llama, bf16, eager

Each rank first calibrates (all ranks at once, as they train), then for every setting compiles the
model, measures it with `fbmt.profile` (median of plain steps; peak allocation of one step) and
replays the same program with `fbmt.simulate` on the profile just measured. Rank 0 prints one
markdown row per setting (BENCHMARKS.md, "Prediction error").
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fbmt

SETTINGS = [  # (zero, remat, schedule)
    (3, "block", "prefetch"),
    (3, "none", "none"),
    (2, "mincut", "fsdp2"),
    (3, "selective", "greedy"),
    (3, "block", "bmtrain"),
    (3, "block", "bucket"),
]


def model_and_inputs(config: str, device: torch.device):
    if config == "gpt":
        from fbmt.models import GPT, GPTConfig

        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256))
        idx = torch.randint(0, 256, (8, 128), device=device)
        return model, (idx, idx), lambda out: out[1], {}
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from llama import CONFIGS, LlamaWithLoss, init_weights

    with torch.device("meta"):
        model = LlamaWithLoss(CONFIGS[config])
    idx = torch.randint(0, CONFIGS[config].vocab_size, (4, 2048), device=device)
    # eager: the simulator prices ops one by one, as the eager backend runs them (it models no fusion)
    options = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, init_fn=init_weights)
    return model, (idx, idx), lambda out: out, options


def run(rank: int, world: int, port: int, config: str, steps: int, only: str | None = None) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # as torchrun runs several ranks
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    log = print if rank == 0 else (lambda *a, **k: None)
    machine = fbmt.calibrate(save=False, log=log)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    log(
        "| ranks | zero | remat | schedule | step predicted (ms) | measured (ms) | error "
        "| peak predicted | measured | error |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|")
    for zero, remat, schedule in SETTINGS:
        if only is not None and schedule != only:
            continue
        base, inputs, loss_fn, options = model_and_inputs(config, device)
        model = fbmt.compile(base, zero=zero, remat=remat, schedule=schedule, **options)
        prof = fbmt.profile(model, *inputs, steps=steps, loss_fn=loss_fn)
        sim = fbmt.simulate(model.program, machine)
        step_err = (sim.step_s - prof.step_s) / prof.step_s
        mem_err = (sim.peak_activation_bytes - prof.peak_bytes) / prof.peak_bytes
        log(
            f"| {world} | {zero} | {remat} | {schedule} | {sim.step_s * 1e3:.1f} | {prof.step_s * 1e3:.1f} | "
            f"{step_err:+.1%} | {fbmt.sim.size(sim.peak_activation_bytes)} | {fbmt.sim.size(prof.peak_bytes)} | "
            f"{mem_err:+.1%} |",
            flush=True,
        )
        del model
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--config", default="gpt", help="gpt (CPU-sized), or a benchmarks/llama.py config on GPUs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", help="only the settings of this schedule strategy")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(args.ranks, port, args.config, args.steps, args.only), nprocs=args.ranks, join=True)


if __name__ == "__main__":
    main()
