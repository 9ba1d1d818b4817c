"""The simulator's prediction error: predicted against measured step time and peak memory, after
`fbmt.calibrate()`, for several strategy/recompute settings on local gloo ranks (or the GPUs).

    python benchmarks/predict.py --ranks 2        # and --ranks 4
    python benchmarks/predict.py --ranks 1 --config 1.36b   # on GPUs: the benchmark Llama, bf16, eager

Every setting's model is compiled once. Then, in each of `--rounds` rounds, every rank calibrates
(all ranks at once, as they train) and every setting is measured with `fbmt.profile` (median of
plain steps; peak allocation of one step) and its program replayed with `fbmt.simulate` on the
profile just measured. Rank 0 prints one markdown row per setting (BENCHMARKS.md, "Prediction
error"): the medians over rounds, and the median of the rounds' paired errors with their range.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
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


def run(rank: int, world: int, port: int, config: str, steps: int, rounds: int, only: str | None = None) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # as torchrun runs several ranks
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    log = print if rank == 0 else (lambda *a, **k: None)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    settings = [s for s in SETTINGS if only is None or s[2] == only]
    models = {}  # kept across rounds on a CPU; a GPU holds one billion-parameter model at a time

    def build(setting: tuple) -> tuple:
        if setting in models:
            return models[setting]
        zero, remat, schedule = setting
        base, inputs, loss_fn, options = model_and_inputs(config, device)
        built = fbmt.compile(base, zero=zero, remat=remat, schedule=schedule, **options), inputs, loss_fn
        if not cuda:
            models[setting] = built
        return built

    # per setting, per round: (predicted step, measured step, predicted peak, measured peak)
    results: dict[tuple, list[tuple[float, float, int, int]]] = {s: [] for s in settings}
    for r in range(rounds):
        # a calibration per round, and the settings measured right after it in a rotated order: a
        # shared machine's speed drifts by tens of percent over seconds, so each prediction is paired
        # with the machine as it was measured just before
        machine = fbmt.calibrate(save=False, log=log)
        for setting in settings[r % len(settings) :] + settings[: r % len(settings)]:
            model, inputs, loss_fn = build(setting)
            prof = fbmt.profile(model, *inputs, steps=steps, loss_fn=loss_fn)
            sim = fbmt.simulate(model.program, machine)
            results[setting].append((sim.step_s, prof.step_s, sim.peak_activation_bytes, prof.peak_bytes))
            del model
    log(
        "| ranks | zero | remat | schedule | step predicted (ms) | measured (ms) | error (rounds' range) "
        "| peak predicted | measured | error |"
    )
    log("|---|---|---|---|---|---|---|---|---|---|")
    for (zero, remat, schedule), rows in results.items():
        med = [statistics.median(x) for x in zip(*rows)]
        errors = sorted((p - m) / m for p, m, _, _ in rows)
        mem_err = (med[2] - med[3]) / med[3]
        log(
            f"| {world} | {zero} | {remat} | {schedule} | {med[0] * 1e3:.1f} | {med[1] * 1e3:.1f} | "
            f"{statistics.median(errors):+.1%} ({errors[0]:+.0%}…{errors[-1]:+.0%}) | "
            f"{fbmt.sim.size(int(med[2]))} | {fbmt.sim.size(int(med[3]))} | {mem_err:+.1%} |",
            flush=True,
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--config", default="gpt", help="gpt (CPU-sized), or a benchmarks/llama.py config on GPUs")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5, help="calibrations, each followed by every setting")
    ap.add_argument("--only", help="only the settings of this schedule strategy")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        run, args=(args.ranks, port, args.config, args.steps, args.rounds, args.only), nprocs=args.ranks, join=True
    )


if __name__ == "__main__":
    main()
