"""`fbmt.calibrate()`: measure this machine and save the profile the simulator uses by default.

    python -m fbmt.tools.calibration --ranks 2          # CPU: 2 local gloo ranks; GPU: NCCL between 2 GPUs
    machine = fbmt.calibrate()                  # inside a job: every rank calls it; rank 0 saves
    print(fbmt.simulate(program))               # now priced with this machine's numbers

NOTE: [Calibration]
Measured, each as the median of several timed repetitions after a warm-up:
- the achieved rate of square matrix products by size, per dtype (fp32; bf16 on a GPU);
- copy bandwidth (bytes read + written per second, as the roofline counts them);
- on a CPU, causal attention (forward and backward) by size, and the elements per second of the
  ops a core computes slower than it moves their bytes (GELU, SiLU, exp, softmax, layer norm, sums
  and their backwards). On a GPU these stay with the roofline: flash attention runs near the
  product rate and pointwise kernels at memory bandwidth (the H200 rows of BENCHMARKS.md);
- the cost of running one node of an eager program: the host's call through the generated code and
  the dispatcher (on a GPU, or a kernel's launch where that is longer); and of one view, which a
  CPU rank spends in line with its compute while a GPU's host hides it;
- each collective kind the runtime issues (all-gather, reduce-scatter, all-to-all) at several sizes,
  fitted to `latency + (N - 1) / N * bytes / bandwidth` by least squares. On a GPU a run of them
  back to back, the slowest rank's time (a collective ends when every rank is done); on a CPU each
  one after a stretch of products, as in a step, the ranks' mean (their arrival apart included);
- how much slower products run while collectives are in flight (`comm_slowdown`), and how much
  slower collectives run beside products (`comm_stretch`): gloo's threads share the cores with
  compute, NCCL's kernels the SMs;
- how many collectives the backend runs at once (`comm_lanes`: gloo's work queue is served by
  two threads, NCCL's stream by one), from the backend rather than measured;
- on a CPU, what a collective allocates while it runs, per byte of its buffer (`comm_buffer`, from
  the torch profiler's allocation records): gloo copies the buffer it sends or reduces, and at a
  step's peak that copy counts as much as any activation. NCCL's buffers are outside the caching
  allocator, so a GPU's is 0.
Every rank measures at once, as a job runs: on a CPU, ranks share the cores, so a rank's product
rate depends on how many ranks run. A profile is therefore saved per world size
(`~/.cache/fbmt/machine-<host>-<N>.json`, or $FBMT_MACHINE). Outside a job, `calibrate(ranks=N)`
starts N local ranks for the measurement, one thread each as torchrun gives them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from fbmt import job
from fbmt.compiler import collectives as comm
from fbmt.tools.sim import Machine, profile_path

aten = torch.ops.aten


def calibrate(
    *, ranks: int | None = None, save: bool = True, path: str | None = None, quick: bool = False, log: Callable = print
) -> Machine:
    """Measure this machine (NOTE: [Calibration]) and, with `save`, write its profile where
    `fbmt.simulate` looks by default (`path` to choose). Inside a job every rank must call it; outside
    one it starts `ranks` (default 2) local ranks for the measurement. `quick`: fewer sizes."""
    if job.is_initialized():
        machine = _measure(quick, log if job.rank() == 0 else _quiet)
        if save and job.rank() == 0:
            machine.save(path or profile_path(job.world_size()))
            log(f"fbmt.calibrate: saved {path or profile_path(job.world_size())}")
        return machine
    ranks = 2 if ranks is None else ranks
    if ranks == 1:
        machine = _measure(quick, log)
    else:
        machine = _spawned(ranks, quick)
        log(f"fbmt.calibrate: measured on {ranks} local ranks")
    if save:
        machine.save(path or profile_path(ranks))
        log(f"fbmt.calibrate: saved {path or profile_path(ranks)}")
    return machine


def _quiet(*args: object, **kwargs: object) -> None:
    pass


# ---- timing -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, *, at_least: float = 0.02, repeats: int = 5) -> float:
    """The median seconds one call of `fn` takes: calls batched to last `at_least` seconds, after
    a warm-up. In a job every rank makes the same number of calls (as many as the slowest rank
    makes in that time), starting together, so ranks contend as they do in training and a
    collective is called as often on each."""
    together = job.is_initialized() and job.world_size() > 1
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    _sync(device)
    per = torch.tensor([(time.perf_counter() - t0) / 3], dtype=torch.float64)
    if together:
        dist.all_reduce(per, op=dist.ReduceOp.MAX)
    batch = max(1, min(10_000, int(at_least / max(per.item(), 1e-9))))
    times = []
    for _ in range(repeats):
        _sync(device)
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / batch)
    return statistics.median(times)


def _per_call(fn: Callable[[], object], device: torch.device, *, seconds: float = 0.04, repeats: int = 5) -> float:
    """The median seconds one call of local work `fn` takes, as calls in a fixed time: every rank
    starts together and stops at the same time, so the ranks contend for the machine the whole time
    (a fixed number of calls would let the ranks that finish first leave the rest alone)."""
    fn()
    _sync(device)
    together = job.is_initialized() and job.world_size() > 1
    times = []
    for _ in range(repeats):
        if together:
            dist.barrier()
        t0, calls = time.perf_counter(), 0
        while (now := time.perf_counter()) - t0 < seconds or calls == 0:
            fn()
            _sync(device)
            calls += 1
        times.append((now - t0) / calls if calls > 1 else time.perf_counter() - t0)
    return statistics.median(times)


def _local(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds per call of work that runs on this rank alone: on a CPU the ranks share the cores
    (`_per_call`); GPUs are each their own."""
    return _seconds(fn, device) if device.type == "cuda" else _per_call(fn, device)


def _everywhere_mean(x: float) -> float:
    if not job.is_initialized() or job.world_size() == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return t.item() / job.world_size()


# ---- what is measured -----------------------------------------------------------------------------


def _matmul_rates(device: torch.device, quick: bool) -> list[tuple[str, float, float]]:
    dtypes = [torch.float32] + ([torch.bfloat16] if device.type == "cuda" else [])
    sizes = (256, 1024, 4096, 8192) if device.type == "cuda" else (32, 64, 128, 256, 512, 1024)
    if quick:
        sizes = sizes[::2] + sizes[-1:]
    rates = []
    for dtype in dtypes:
        for n in sizes:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            s = _everywhere_mean(_local(lambda: torch.mm(a, b), device))  # noqa: B023
            rates.append((str(dtype).removeprefix("torch."), 2.0 * n**3, 2.0 * n**3 / s))
    return rates


def _attention_rates(device: torch.device, quick: bool) -> list[tuple[str, float, float]]:
    """Causal attention's achieved rate, forward and backward together, by the FLOPs of one call as
    `fbmt.compiler.ops.flops` counts them (a backward as 2.5 forwards), at head size 64."""
    import torch.nn.functional as F

    shapes = ((16, 128), (4, 512)) if quick else ((32, 64), (16, 128), (8, 256), (4, 512))
    rates = []
    for heads, seq in shapes:
        q, k, v = (torch.randn(1, heads, seq, 64, device=device, requires_grad=True) for _ in range(3))
        grad = torch.ones(1, heads, seq, 64, device=device)

        def step() -> None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: B023
            torch.autograd.grad(out, (q, k, v), grad)  # noqa: B023

        forward = 4.0 * q.numel() * seq / 2
        s = _everywhere_mean(_local(step, device))
        rates.append(("float32", forward, 3.5 * forward / s))
    return rates


# What the CPU's elementwise rates are measured on: op -> its call on a [rows, 1024] fp32 input x,
# its output y and a gradient g of x's shape.
_ELEMENTWISE: dict[str, Callable[..., object]] = {
    "gelu": lambda x, y, g, w: aten.gelu.default(x),
    "gelu_backward": lambda x, y, g, w: aten.gelu_backward.default(g, x),
    "silu": lambda x, y, g, w: aten.silu.default(x),
    "silu_backward": lambda x, y, g, w: aten.silu_backward.default(g, x),
    "sigmoid": lambda x, y, g, w: aten.sigmoid.default(x),
    "tanh": lambda x, y, g, w: aten.tanh.default(x),
    "exp": lambda x, y, g, w: aten.exp.default(x),
    "_softmax": lambda x, y, g, w: aten._softmax.default(x, -1, False),
    "_softmax_backward_data": lambda x, y, g, w: aten._softmax_backward_data.default(g, y, -1, torch.float32),
    "_log_softmax": lambda x, y, g, w: aten._log_softmax.default(x, -1, False),
    "_log_softmax_backward_data": lambda x, y, g, w: aten._log_softmax_backward_data.default(g, y, -1, torch.float32),
    "native_layer_norm": lambda x, y, g, w: aten.native_layer_norm.default(x, [x.shape[-1]], w, w, 1e-5),
    "native_layer_norm_backward": lambda x, y, g, w: aten.native_layer_norm_backward.default(
        g, x, [x.shape[-1]], *aten.native_layer_norm.default(x, [x.shape[-1]], w, w, 1e-5)[1:], w, w, [True] * 3
    ),
    "sum": lambda x, y, g, w: aten.sum.dim_IntList(x, [0]),  # a bias's gradient
}


def _elementwise_rates(device: torch.device) -> list[tuple[str, float]]:
    """Elements of the first operand per second, for each op of `_ELEMENTWISE`, on 1M fp32 elements."""
    x = torch.randn(1024, 1024, device=device)
    y, g, w = x.softmax(-1), torch.randn_like(x), torch.ones(1024, device=device)
    return [
        (name, x.numel() / _everywhere_mean(_local(lambda: call(x, y, g, w), device)))  # noqa: B023
        for name, call in _ELEMENTWISE.items()
    ]


def _copy_bandwidth(device: torch.device) -> float:
    n = (256 if device.type == "cuda" else 16) * 2**20 // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    return _everywhere_mean(8.0 * n / _local(lambda: dst.copy_(src), device))


def _host_bandwidth(device: torch.device) -> float:
    """Bytes/s of pinned host-to-device and device-to-host copies (their mean): offload's link. A CPU
    rank's host is its device: its copy bandwidth."""
    if device.type != "cuda":
        return _copy_bandwidth(device)
    n = 256 * 2**20 // 4
    host, dev = torch.randn(n).pin_memory(), torch.empty(n, device=device)
    up = _local(lambda: dev.copy_(host, non_blocking=True), device)
    down = _local(lambda: host.copy_(dev, non_blocking=True), device)
    return _everywhere_mean(8.0 * n / (up + down))


def _node_cost(device: torch.device, op: object = aten.add.Tensor) -> float:
    """Seconds per node of an eager program: a generated GraphModule of tiny adds (or views)."""
    g = fx.Graph()
    x = g.placeholder("x")
    count = 200
    y = x
    for _ in range(count):
        y = g.call_function(op, (y, x) if op is aten.add.Tensor else (y, [4]))
    g.output(y)
    gm = fx.GraphModule(torch.nn.Module(), g)
    t = torch.ones(4, device=device)
    return _everywhere_mean(_local(lambda: gm(t), device) / count)


def _collective(kind: str, total: int, device: torch.device) -> Callable[[bool], object]:
    """One collective of `kind` (a row of fbmt's collectives table) moving `total` bytes in all (the
    whole flat fp32 buffer), as the runtime issues it (the row's probe); the returned function runs
    it (asynchronously with True)."""
    row = next(k for k in comm.kinds() if k.name == kind)
    return row.probe(total // 4, device)


def _links(device: torch.device, quick: bool) -> list[tuple[str, float, float]]:
    world = job.world_size()
    sizes = [2**k for k in ((22, 24, 26, 28) if device.type == "cuda" else (18, 20, 22, 24))]
    if quick:
        sizes = sizes[1::2]
    out = []
    # every kind of the collectives' table; a host kind's copy is priced by `host_bandwidth` and its
    # transfer by the plain kind's link, so it is not measured again
    for kind in [k.name for k in comm.kinds() if not k.host]:
        xs, ts = [], []
        for total in sizes:
            run = _collective(kind, total, device)

            def once() -> None:
                run()  # noqa: B023
                _sync(device)

            if device.type == "cuda":
                s = torch.tensor([_seconds(once, device, at_least=0.05)], dtype=torch.float64)
                dist.all_reduce(s, op=dist.ReduceOp.MAX)  # it ends when the slowest rank is done
                seconds = s.item()
            else:
                seconds = _everywhere_mean(_after_compute(once))
            xs.append((world - 1) / world * total)
            ts.append(seconds)
        latency, per_byte = _fit(xs, ts)
        out.append((kind, latency, 1.0 / per_byte))
    return out


def _after_compute(collective: Callable[[], object], repeats: int = 9) -> float:
    """The median seconds a CPU rank spends in `collective` when it follows compute, as in a step:
    gloo's thread wakes, caches are cold, and the ranks arrive apart by how differently their compute
    ran. The mean over ranks of this is what a step's wait adds on average (the rank that arrives
    first waits for the others, the last one does not)."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    collective()
    times = []
    for _ in range(repeats):
        for _ in range(4):  # about as long as a block's compute between two collectives
            torch.mm(a, b)
        t0 = time.perf_counter()
        collective()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(xs: list[float], ts: list[float]) -> tuple[float, float]:
    """Least squares `t = latency + x * per_byte`, latency at least 0, per_byte positive."""
    n = len(xs)
    mx, mt = sum(xs) / n, sum(ts) / n
    var = sum((x - mx) ** 2 for x in xs)
    per_byte = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else mt / max(mx, 1.0)
    per_byte = max(per_byte, 1e-15)
    latency = mt - per_byte * mx
    if latency < 0:  # through the origin instead
        latency, per_byte = 0.0, sum(x * t for x, t in zip(xs, ts)) / sum(x * x for x in xs)
    return latency, per_byte


def _comm_slowdown(device: torch.device, links: list[tuple[str, float, float]]) -> float:
    """How much longer products take while all-gathers run in the background: the median, over
    pairs of runs made back to back (alone, then beside the collectives), of the ratio within a pair,
    so that the machine's drift (a shared VM's moves by tens of percent within seconds) cancels."""
    n = 1024 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    reps = torch.tensor([8], dtype=torch.float64)

    def products() -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(int(reps.item())):
            torch.mm(a, b)
        _sync(device)
        return time.perf_counter() - t0

    once = products() / reps.item()
    reps.fill_(max(8, math.ceil(0.02 / max(once, 1e-9))))  # a run of about 20 ms
    dist.all_reduce(reps, op=dist.ReduceOp.MAX)  # the same calls on every rank
    latency, bandwidth = next((lat, bw) for k, lat, bw in links if k == "all_gather")
    total = 2**26 if device.type == "cuda" else 2**22
    one = latency + total / bandwidth
    background = _collective("all_gather", total, device)
    products()
    ratios = []
    for _ in range(7):
        dist.barrier()
        alone = products()
        calls = torch.tensor([int(alone / one) + 2], dtype=torch.float64)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)  # as many on every rank; enough to outlast the products
        works = [background(True) for _ in range(int(calls.item()))]
        ratios.append(products() / alone)
        for w in works:
            w.wait()
        _sync(device)
    return max(0.0, _everywhere_mean(statistics.median(ratios)) - 1.0)


def _comm_stretch(device: torch.device) -> float:
    """How much longer all-gathers take while products run beside them (gloo's threads share the
    cores with compute; NCCL's kernels the SMs): the median, over back-to-back pairs, of the ratio
    of the time to finish a run of them beside products to the time alone."""
    n = 1024 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    total = 2**26 if device.type == "cuda" else 2**22
    background = _collective("all_gather", total, device)
    calls = 4

    def run(beside: bool) -> float:
        _sync(device)
        dist.barrier()
        t0 = time.perf_counter()
        works = [background(True) for _ in range(calls)]
        while beside and not all(w.is_completed() for w in works):
            torch.mm(a, b)
        for w in works:
            w.wait()
        _sync(device)
        return time.perf_counter() - t0

    run(False)
    ratios = []
    for _ in range(7):
        alone = run(False)
        ratios.append(run(True) / alone)
    return max(0.0, _everywhere_mean(statistics.median(ratios)) - 1.0)


def _comm_buffer(device: torch.device) -> float:
    """Bytes the allocator hands out while an all-gather or reduce-scatter runs (beyond the buffers
    the runtime allocates for it), per byte of its whole buffer; the larger of the two kinds."""
    if device.type == "cuda":
        return 0.0
    from torch.profiler import ProfilerActivity, profile

    total = 2**22
    ratios = []
    for kind in ("all_gather", "reduce_scatter"):
        run = _collective(kind, total, device)
        run()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                events = sorted(
                    (e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"]
                )
        if events:
            begin = events[0]["args"]["Total Allocated"] - events[0]["args"]["Bytes"]
            ratios.append((max(e["args"]["Total Allocated"] for e in events) - begin) / total)
    worst = torch.tensor([max(ratios, default=0.0)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return round(worst.item(), 2)


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = ""
    return f"{model or platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _measure(quick: bool, log: Callable) -> Machine:
    device = job.local_device()
    world = job.world_size() if job.is_initialized() else 1
    started = time.perf_counter()
    log(f"fbmt.calibrate: products on {world} rank(s) of {_describe(device)} ...", flush=True)
    rates = _matmul_rates(device, quick)
    copy = _copy_bandwidth(device)
    across = _host_bandwidth(device)
    node = _node_cost(device)
    view = 0.0 if device.type == "cuda" else _node_cost(device, aten.view.default)  # a GPU's host runs ahead
    cpu = device.type != "cuda"
    attention = _attention_rates(device, quick) if cpu else []
    elementwise = _elementwise_rates(device) if cpu else []
    links, slowdown, stretch, buffer = [], 0.0, 0.0, 0.0
    if world > 1:
        log("fbmt.calibrate: collectives ...", flush=True)
        links = _links(device, quick)
        slowdown = _comm_slowdown(device, links)
        stretch = _comm_stretch(device)
        buffer = _comm_buffer(device)
    best = max((r for d, _, r in rates if d == ("bfloat16" if device.type == "cuda" else "float32")), default=1e9)
    fp32 = max(r for d, _, r in rates if d == "float32")
    gather = next(((lat, bw) for k, lat, bw in links if k == "all_gather"), (20e-6, 1e9))
    backend = dist.get_backend() if world > 1 else "one rank"
    machine = Machine(
        name=f"{_describe(device)}, {backend}, calibrated {datetime.date.today()}",
        matmul_flops=best,
        memory_bandwidth=copy,
        bus_bandwidth=gather[1],
        latency=gather[0],
        launch=node,
        fp32_matmul_flops=fp32,
        matmul_rates=tuple(rates),
        links=tuple(links),
        comm_slowdown=slowdown,
        comm_stretch=stretch,
        comm_lanes=2 if backend == "gloo" else 1,
        host_bandwidth=across,
        view_cost=view,
        comm_buffer=buffer,
        attention_rates=tuple(attention),
        elementwise_rates=tuple(elementwise),
    )
    log(f"fbmt.calibrate: {summary(machine)} ({time.perf_counter() - started:.0f} s)", flush=True)
    return machine


def summary(m: Machine) -> str:
    """The profile in one line."""
    links = "; ".join(f"{k} {lat * 1e6:.0f} us + {bw / 1e9:.2f} GB/s" for k, lat, bw in m.links) or "no collectives"
    return (
        f"{m.name}: products up to {m.matmul_flops / 1e9:.1f} GFLOP/s, "
        + (
            f"attention up to {max(r for _, _, r in m.attention_rates) / 1e9:.1f} GFLOP/s, "
            if m.attention_rates
            else ""
        )
        + f"copies {m.memory_bandwidth / 1e9:.1f} GB/s, "
        + (f"host <-> device {m.host_bandwidth / 1e9:.1f} GB/s, " if m.host_bandwidth != m.memory_bandwidth else "")
        + f"{m.launch * 1e6:.1f} us per node ({m.view_cost * 1e6:.1f} us per view); {links}; "
        f"compute {m.comm_slowdown:.0%} slower under communication, "
        f"collectives {m.comm_stretch:.0%} slower beside compute"
        + (f"; collectives allocate {m.comm_buffer:.1f}x their buffer while they run" if m.comm_buffer else "")
    )


# ---- outside a job: local ranks ------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, quick: bool, out: str) -> None:
    torch.set_num_threads(1)  # as torchrun runs each of several ranks (OMP_NUM_THREADS=1)
    backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        machine = _measure(quick, print if rank == 0 else _quiet)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(machine.to_dict(), f)
        dist.barrier()  # no rank tears down while a peer may still be in the last collective
    finally:
        dist.destroy_process_group()
    # The profile is on disk and the group is gone: skip interpreter finalization, where gloo's worker
    # threads can still hold work objects and abort the process ("terminate called without an active
    # exception", pytorch/pytorch#179291), which would fail a calibration that succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned(ranks: int, quick: bool) -> Machine:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "machine.json")
        mp.spawn(_worker, args=(ranks, port, quick, out), nprocs=ranks, join=True)
        with open(out) as f:
            return Machine.from_dict(json.load(f))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m fbmt.tools.calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="local ranks to measure with (one per GPU on GPUs)")
    p.add_argument("--quick", action="store_true", help="fewer sizes (about half the time)")
    p.add_argument("--out", default=None, help="where to save the profile (default: where fbmt.simulate looks)")
    args = p.parse_args(argv)
    if args.ranks < 1:
        p.error("--ranks: at least one rank")
    calibrate(ranks=args.ranks, quick=args.quick, path=args.out)


if __name__ == "__main__":
    main()
