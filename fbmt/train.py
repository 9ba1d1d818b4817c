"""The main job: train a small byte-level GPT with `fbmt.compile` on Python's own source code.

    python -m fbmt.train                 # 2 CPU ranks (gloo), or every GPU (NCCL, bf16) if there are any
    python -m fbmt.train --steps 50 --ranks 4 --zero 2 --remat none

Without a launcher it starts itself under torchrun (`torch.distributed.run`) with one rank per GPU,
or `--ranks` CPU ranks; one rank is this process. A `--resume` that cannot go on is refused before
any rank starts. The corpus is the standard library's .py files, read as bytes, so every
machine has it and nothing is downloaded. Rank 0 prints loss, tokens/s and every rank's peak memory
each step, and appends them to `<checkpoints>/metrics.csv`. Every `--save-every` steps and at the
end it writes a sharded checkpoint (`fbmt.checkpoint`); run it again, or let `torchrun
--max-restarts` restart it, and it resumes from the newest complete one, drawing the same batches
and dropout masks as an uninterrupted run. At the end it evaluates on held-out files, samples some
text, and exports the model as one plain `torch.save` file.
"""

from __future__ import annotations

import argparse
import ast
import csv
import dataclasses
import glob
import logging
import math
import os
import resource
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fbmt
from fbmt import flags
from fbmt.compiler.passes import POLICIES, STRATEGIES, strategy_options
from fbmt.files import save_atomic
from fbmt.models import GPT, GPTConfig, init_weights


def schedule_arg(text: str) -> str | tuple[str, dict] | fbmt.Schedule:
    """`--schedule`: NAME, NAME:key=value,... (values read as Python literals), or a saved schedule."""
    if text.endswith(".json"):
        try:
            return fbmt.Schedule.load(text)
        except (OSError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    name, _, rest = text.partition(":")
    if name not in STRATEGIES:
        raise argparse.ArgumentTypeError(f"no strategy {name!r}; the registered ones are {sorted(STRATEGIES)}")
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{item!r}: expected key=value")
        try:
            options[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            options[key.strip()] = value.strip()
    for key, value in options.items():  # 2e8 bytes reads as a float
        if isinstance(value, float) and value.is_integer():
            options[key] = int(value)
    try:
        strategy_options(name, options)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return (name, options) if options else name


def schedule_name(schedule: str | tuple[str, dict] | fbmt.Schedule) -> str:
    if isinstance(schedule, fbmt.Schedule):
        return "a saved schedule"
    if isinstance(schedule, tuple):
        return f"{schedule[0]}:" + ",".join(f"{k}={v!r}" for k, v in schedule[1].items())
    return schedule


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m fbmt.train",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=torch.cuda.device_count() if gpu else 2,
        help="ranks to launch (every GPU, else 2 CPU ranks)",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all (a resumed run continues to it)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=512 if gpu else 128, help="tokens (bytes) per sequence")
    p.add_argument("--layers", type=int, default=12 if gpu else 4, help="transformer blocks")
    p.add_argument("--d-model", type=int, default=768 if gpu else 128, help="model width")
    p.add_argument("--heads", type=int, default=12 if gpu else 4, help="attention heads (must divide --d-model)")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout probability")
    p.add_argument("--lr", type=float, default=1e-3 if gpu else 2e-3, help="AdamW's peak learning rate")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16" if gpu else "float32", help="parameter dtype"
    )
    p.add_argument("--zero", type=int, default=3, choices=[2, 3], help="ZeRO stage (fbmt.compile(zero=...))")
    p.add_argument("--remat", default="block", choices=POLICIES, help="what the backward recomputes")
    p.add_argument(
        "--backend",
        default="eager",
        choices=["eager", "inductor"],
        help="inductor: compile the compute between collectives (see README)",
    )
    p.add_argument(
        "--schedule",
        default="prefetch",
        type=schedule_arg,
        help=f"a strategy ({', '.join(sorted(STRATEGIES))}), with options as NAME:key=value,key=value "
        "(e.g. greedy:memory_bound=2e8), or a schedule saved with Schedule.to_json (a .json file) to replay",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="GPU only: replay each step's forward and backward as CUDA graphs after 2 warm-up steps",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="keep the shards, gradients and AdamW's state in host memory; step with fbmt's C++ Adam "
        "(fbmt.compile(offload=True), fbmt.optim.AdamOffloadOptimizer)",
    )
    p.add_argument(
        "--fp8",
        default=None,
        choices=["tensorwise", "rowwise"],
        help="the blocks' matrix products in FP8 with dynamic scales (fbmt.compile(fp8=...); a GPU of compute "
        "capability 8.9 or later, or slowly on the CPU)",
    )
    p.add_argument("--corpus-mb", type=float, default=16.0, help="how much of the stdlib to read")
    p.add_argument(
        "--checkpoints",
        default="checkpoints/gpt-stdlib",
        help="folder of this run's sharded checkpoints, its metrics.csv and the exported model",
    )
    p.add_argument("--save-every", type=int, default=50, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints kept, the newest")
    p.add_argument(
        "--resume",
        default="auto",
        help="auto: continue from the newest complete checkpoint in --checkpoints if there is one; "
        "no: start afresh (refused where --checkpoints holds an earlier run's); or a checkpoint folder",
    )
    p.add_argument(
        "--export",
        default=None,
        help="the final model as one torch.save file for fbmt.models.GPT (default: <checkpoints>/model.pt)",
    )
    p.add_argument("--seed", type=int, default=0, help="seeds the weights, the batches and dropout")
    args = p.parse_args(argv)
    if args.cuda_graph and not gpu:
        p.error("--cuda-graph needs GPUs (CUDA graphs), and this machine has none")
    if args.cuda_graph and args.offload:
        p.error("--cuda-graph and --offload: a CUDA graph replays device memory, offloaded shards live on the host")
    if args.ranks < 1:
        p.error(f"--ranks {args.ranks}: at least one rank is needed")
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least one step is needed")
    if args.d_model % args.heads:
        p.error(f"--heads {args.heads} does not divide --d-model {args.d_model}: pick heads that divide the width")
    if min(args.batch_size, args.seq_len, args.layers) < 1 or args.save_every < 0 or args.keep < 1:
        p.error("--batch-size, --seq-len, --layers and --keep must be at least 1, --save-every at least 0")
    args.export = args.export or os.path.join(args.checkpoints, "model.pt")
    return args


# torchrun as the launcher runs it, less its traceback: a rank that fails has said why (fbmt's errors name
# what to do), and torchrun's ChildFailedError would print 25 lines of its own after that, burying it
_AGENT = """import sys
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main
try:
    main()
except ChildFailedError as e:
    for rank, f in sorted(e.failures.items()):
        how = f"was stopped by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode} (why: above)"
        print(f"fbmt.train: rank {rank} {how}", file=sys.stderr)
    sys.exit(1)
"""


def launch(args: argparse.Namespace) -> int:
    """Re-run this module under torchrun with `--ranks` ranks on this machine."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-c",
        _AGENT,
        f"--nproc_per_node={args.ranks}",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        "-m",
        "fbmt.train",
        *sys.argv[1:],
    ]
    threads = max(1, (os.cpu_count() or 2) // args.ranks)  # CPU ranks share the cores instead of oversubscribing
    env = dict(os.environ, OMP_NUM_THREADS=str(flags.OMP_NUM_THREADS.get() or threads))
    print(f"fbmt.train: launching {args.ranks} ranks: torchrun {' '.join(cmd[3:])}", flush=True)
    return subprocess.call(cmd, env=env)


def load_corpus(megabytes: float) -> torch.Tensor:
    """The standard library's Python sources as one byte tensor (sorted: the same on every rank)."""
    root = os.path.dirname(os.__file__)
    files = sorted(f for f in glob.glob(os.path.join(root, "**", "*.py"), recursive=True) if "site-packages" not in f)
    chunks, size = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        chunks.append(data)
        size += len(data)
        if size >= megabytes * 2**20:
            break
    if size == 0:
        raise RuntimeError(f"fbmt.train: found no .py files under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()


def batch_at(data: torch.Tensor, step: int, batch: int, seq: int, seed: int, device: torch.device):
    """Step `step`'s sequences: a function of (seed, step) only, so a resumed run draws what an
    uninterrupted one would."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
    window = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
    return window[:, :-1].to(device), window[:, 1:].to(device)


def peak_memory_mb(device: torch.device) -> float:
    """The CUDA allocator's peak on GPU; on CPU, the process's peak resident set (RSS)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def progress(step: int, total: int, width: int = 24) -> str:
    done = int(width * step / total)
    return "[" + "#" * done + "." * (width - done) + "]"


def main(args: argparse.Namespace) -> None:
    fbmt.init_distributed(seed=args.seed)
    rank, world = fbmt.rank(), fbmt.world_size()
    if rank == 0 and not flags.is_set(flags.LOG):
        fbmt.logs.show("info")  # the compile's stages as they happen (FBMT_LOG chooses otherwise)
    device = fbmt.job.local_device()
    cfg = GPTConfig(
        vocab_size=256,
        seq_len=args.seq_len,
        n_layer=args.layers,
        n_head=args.heads,
        d_model=args.d_model,
        dropout=args.dropout,
    )
    dtype = getattr(torch, args.dtype)
    with torch.device("meta"):  # built without memory; fbmt.compile materializes it block by block
        model = GPT(cfg).to(dtype)
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    model = fbmt.compile(
        model,
        zero=args.zero,
        remat=args.remat,
        schedule=args.schedule,
        backend=args.backend,
        cuda_graph=args.cuda_graph,
        offload=args.offload,
        fp8=args.fp8,
        init_fn=init_weights,
    )
    if args.offload:  # the same update as torch's AdamW, in place on the host shards
        opt = fbmt.optim.AdamOffloadOptimizer(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    corpus = load_corpus(args.corpus_mb)
    split = int(0.95 * len(corpus))
    log = print if rank == 0 else (lambda *a, **k: None)
    done = resume(args, model, opt, log)
    ranks = f"{world} rank{'s' if world > 1 else ''}"
    log(
        f"fbmt.train: GPT {n_params / 1e6:.2f}M params ({args.dtype}), {ranks} on {device.type}, "
        f"zero={args.zero} remat={args.remat} schedule={schedule_name(args.schedule)} backend={args.backend}"
        f"{', offload' if args.offload else ''}{f', fp8 {args.fp8}' if args.fp8 else ''}, "
        f"corpus {len(corpus) / 2**20:.1f} MB of stdlib source, "
        f"{args.batch_size}x{args.seq_len} tokens per rank per step",
        flush=True,
    )
    metrics = Metrics(os.path.join(args.checkpoints, "metrics.csv"), done) if rank == 0 else None
    tty = sys.stdout.isatty()
    first_loss = last_loss = float("nan")
    tokens = args.batch_size * args.seq_len * world
    memory = "peak mem" if device.type == "cuda" else "peak RSS"
    for step in range(done + 1, args.steps + 1):
        start = time.perf_counter()
        # each rank its own sequences of the step's global batch
        x, y = batch_at(corpus[:split], step * world + rank, args.batch_size, args.seq_len, args.seed + 1, device)
        lr = args.lr * min(1.0, step / 20)  # short warm-up
        for group in opt.param_groups:
            group["lr"] = lr
        logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = torch.tensor([loss.item(), peak_memory_mb(device)], device=device)
        gathered = [torch.zeros_like(stats) for _ in range(world)]
        dist.all_gather(gathered, stats)
        elapsed = time.perf_counter() - start
        last_loss = sum(float(s[0]) for s in gathered) / world
        if not math.isfinite(last_loss):  # every rank sees the same mean: all stop together
            raise SystemExit(
                f"fbmt.train: the loss is {last_loss} at step {step}: training diverged. The newest complete "
                f"checkpoint ({fbmt.checkpoint.latest(args.checkpoints) or 'none yet'}) is intact; run again "
                f"with a lower --lr (now {args.lr:g}) to resume from it"
            )
        if step == done + 1:
            first_loss = last_loss
            log(
                f"fbmt.train: compile + first step {time.perf_counter() - t0:.1f}s "
                f"({len(model.program.graph.nodes)} nodes in the joint program)",
                flush=True,
            )
        mems = " ".join(f"r{r}:{float(s[1]):.0f}MB" for r, s in enumerate(gathered))
        line = (
            f"step {step:4d}/{args.steps} {progress(step, args.steps)} loss {last_loss:.4f} | "
            f"{tokens / elapsed / 1e3:7.1f}k tok/s | {memory} {mems}"
        )
        if tty:
            log("\r" + line, end="\n" if step % 10 == 0 or step == args.steps else "", flush=True)
        else:
            log(line, flush=True)
        if metrics is not None:
            metrics.write(step, last_loss, tokens / elapsed, max(float(s[1]) for s in gathered), lr)
        if step == args.steps or (args.save_every and step % args.save_every == 0):
            path = fbmt.checkpoint.save(args.checkpoints, step, model=model, optimizer=opt, keep=args.keep)
            log(f"fbmt.train: checkpoint {path}", flush=True)
    val = evaluate(model, corpus[split:], args, device)
    if done < args.steps:
        log(f"fbmt.train: loss {first_loss:.3f} -> {last_loss:.3f} (train), {val:.3f} (held-out)", flush=True)
    else:
        log(f"fbmt.train: {val:.3f} held-out loss", flush=True)
    sample = generate(model, b"def ", 80, cfg.seq_len, device)
    log("fbmt.train: sample: " + repr(sample.decode("utf-8", errors="replace")), flush=True)
    state = model.state_dict()
    if rank == 0:
        save_atomic(
            {"model": state, "config": dataclasses.asdict(cfg), "dtype": args.dtype, "steps": args.steps},
            args.export,
        )
        log(f"fbmt.train: exported {args.export} (loads into fbmt.models.GPT with load_state_dict)", flush=True)
    dist.barrier()  # nobody leaves while a peer may still be mid-collective
    model.release_graphs()  # NCCL waits for CUDA graphs that captured its collectives
    dist.destroy_process_group()


def _nothing_at(where: str, what: str, args: argparse.Namespace) -> str:
    return (
        f"fbmt.train: --resume {where} {what}; nothing was trained or overwritten. Pass a checkpoint (a "
        f"step-NNNNNNNN folder) or a folder of them, or --resume auto to continue from {args.checkpoints}"
    )


def refuse_what_cannot_resume(args: argparse.Namespace) -> None:
    """Exit saying why where `--resume` cannot go on as asked: a path given that holds no checkpoint (a
    typo, not a fresh start), or `--resume no` over an earlier run's checkpoints. The launcher asks before
    it starts any rank; a rank asks again (launched by torchrun directly)."""
    if args.resume == "no":
        found = fbmt.checkpoint.latest(args.checkpoints)
        if found is not None:
            raise SystemExit(
                f"fbmt.train: {args.checkpoints} holds an earlier run's checkpoints (newest: {found}); "
                "continue it with --resume auto (the default), or pass another --checkpoints folder"
            )
    elif args.resume != "auto":
        if not os.path.exists(args.resume):
            raise SystemExit(_nothing_at(args.resume, "does not exist", args))
        complete = os.path.isfile(os.path.join(args.resume, fbmt.checkpoint.MARKER))
        if not complete and not fbmt.checkpoint.checkpoints(args.resume):
            raise SystemExit(_nothing_at(args.resume, "holds no complete checkpoint", args))


def resume(args: argparse.Namespace, model: torch.nn.Module, opt: torch.optim.Optimizer, log) -> int:
    """The step the run continues after (0: a fresh start), having loaded the checkpoint if any."""
    refuse_what_cannot_resume(args)
    if args.resume == "no":
        return 0
    where = args.checkpoints if args.resume == "auto" else args.resume
    given = args.resume != "auto"
    try:
        resumed = fbmt.checkpoint.load(where, model=model, optimizer=opt)
    except fbmt.checkpoint.CheckpointError as e:  # it says what to do: no traceback on top of that
        raise SystemExit(str(e)) from None
    if resumed is None and given:
        raise SystemExit(_nothing_at(where, "holds no complete checkpoint", args))
    if resumed is None:
        return 0
    log(f"fbmt.train: resumed from {resumed.path} (step {resumed.step} of {args.steps})", flush=True)
    if resumed.step >= args.steps:
        log(f"fbmt.train: already trained to step {resumed.step}; pass a larger --steps to go on", flush=True)
    return resumed.step


class Metrics:
    """Rank 0's per-step metrics as CSV; a resumed run first drops the rows after its checkpoint."""

    FIELDS = ("step", "loss", "tokens_per_s", "peak_memory_mb", "lr", "time")

    def __init__(self, path: str, resumed_step: int):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        rows = []
        if os.path.exists(path):
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= resumed_step]
        self.file = open(path, "w", newline="")  # noqa: SIM115 (kept open for the whole run)
        self.writer = csv.DictWriter(self.file, fieldnames=self.FIELDS)
        self.writer.writeheader()
        self.writer.writerows(rows)

    def write(self, step: int, loss: float, tokens_per_s: float, memory: float, lr: float) -> None:
        self.writer.writerow(
            dict(
                step=step,
                loss=f"{loss:.6f}",
                tokens_per_s=f"{tokens_per_s:.1f}",
                peak_memory_mb=f"{memory:.1f}",
                lr=f"{lr:.6g}",
                time=f"{time.time():.3f}",
            )
        )
        self.file.flush()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: torch.Tensor, args: argparse.Namespace, device: torch.device, n: int = 4
) -> float:
    model.eval()
    losses = []
    for i in range(n):
        x, y = batch_at(data, i, args.batch_size, args.seq_len, 12345, device)
        losses.append(F.cross_entropy(model(x).float().reshape(-1, 256), y.reshape(-1)))
    model.train()
    mean = torch.stack(losses).mean()
    dist.all_reduce(mean)
    return mean.item() / dist.get_world_size()


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: bytes, n: int, seq: int, device: torch.device) -> bytes:
    """Sample `n` bytes; every rank draws the same ones (same logits, same seed)."""
    model.eval()
    out = list(prompt)
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(n):
        window = ([32] * seq + out)[-seq:]  # left-padded with spaces: one input shape, one program
        logits = model(torch.tensor([window], device=device))[0, -1].float()
        out.append(int(torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=g)))
    model.train()
    return bytes(out)


if __name__ == "__main__":
    arguments = parse_args()
    if not flags.is_set(flags.RANK):
        refuse_what_cannot_resume(arguments)  # in a second, not after the ranks have started
        if arguments.ranks > 1:
            sys.exit(launch(arguments))
        # one rank: this process is it (a group of one, as without a launcher), not a torchrun of one
    main(arguments)
    # The run is saved and the group is gone: skip interpreter finalization, where gloo's worker
    # threads can still hold work objects and abort a rank that finished ("terminate called without
    # an active exception", pytorch/pytorch#179291; seen in the resume test under load), as
    # fbmt.calibrate's ranks and the tests' ranks do.
    fbmt.checkpoint.wait_for_pending()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
