"""What the per-call rank agreement costs (fbmt.job.agree: a host all-gather of the program's
digest on a gloo group, after noting the call count in the job's store), on this machine's CPU.

    python benchmarks/agreement.py [--ranks 2] [--calls 2000]

Prints the mean and median microseconds of one agreement on each rank: the absolute host cost added
to every call of a compiled model, to set against a training step's time.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _rank(rank: int, world: int, port: int, calls: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    import fbmt

    fbmt.init_distributed(backend="gloo")
    for _ in range(50):  # warm-up: the group is made at the first call
        fbmt.job.agree(1, "benchmark")
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fbmt.job.agree(1, "benchmark")
        times.append(time.perf_counter() - start)
    out.put((rank, statistics.mean(times) * 1e6, statistics.median(times) * 1e6))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, port, args.calls, out)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    results = sorted(out.get(timeout=600) for _ in procs)
    for proc in procs:
        proc.join()
    print(f"agreement on {args.ranks} gloo ranks, {os.cpu_count()} CPUs, torch {torch.__version__}:")
    for rank, mean, median in results:
        print(f"  rank {rank}: mean {mean:.0f} us, median {median:.0f} us per call")
    sys.exit(0)


if __name__ == "__main__":
    main()
