"""Simulate a compiled program on a machine: step time, exposed communication, peak activation memory.

    model = fbmt.compile(model_built_on_meta, world_size=8, device="meta", param_dtype=torch.bfloat16)
    program = model.trace(tokens, device="cpu")   # fake CPU tensors: nothing is allocated
    print(fbmt.simulate(program, fbmt.sim.H200))  # or fbmt.sim.Machine(...) for another GPU / network

NOTE: [Simulator]
The program is replayed in its own order (the forward, then the backward, exactly as the runtime
runs it) on two streams. The compute stream runs every op for `max(flops / matmul rate, bytes /
memory bandwidth)` plus a launch overhead (a roofline: matrix products and attention are priced by
their FLOPs, everything else by the bytes it reads and writes; views cost nothing). A collective's
start occupies the communication stream, in issue order, for its copies (the cast before an
all-gather, the copy of the gradients into the reduction's buffer: they run on the runtime's copy
stream, NOTE: [Copy stream] in runtime/collectives.py) plus `latency + (N - 1) / N * bytes / bus
bandwidth` (ring all-gather / reduce-scatter; an all-to-all moves as many bytes); on one rank the
copies run on the compute stream. A
`wait` stalls the compute stream until its collective is done: that stall is *exposed
communication*. Peak memory replays the same order with each value alive from its definition to its
last use (views keep their base alive; a reduce-scatter's input lives until its wait), which is how
the runtime frees values; persistent state (shards, gradients, optimizer) is not part of it.

It is a model, to compare schedules and settings, not a promise: BENCHMARKS.md sets it against
measurements.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fbmt import ops
from fbmt.ops import flops, nbytes
from fbmt.program import Program


@dataclass(frozen=True)
class Machine:
    """What the simulator charges for work: rates per GPU and of the links between GPUs."""

    name: str
    matmul_flops: float  # achieved dense matrix-product rate in the compute dtype, FLOP/s
    memory_bandwidth: float  # bytes/s of device memory
    bus_bandwidth: float  # bytes/s per GPU that a ring collective achieves ("busbw")
    latency: float = 20e-6  # seconds per collective
    launch: float = 4e-6  # seconds per kernel
    fp32_matmul_flops: float | None = None  # for fp32 matrix products (default: a 16th of matmul_flops)


# The rates measured on the H200 host of BENCHMARKS.md (matrix products, copy bandwidth, NVLink bus
# bandwidth of an all-gather or reduce-scatter between 2 GPUs).
H200 = Machine(
    "H200 (NVLink)", matmul_flops=700e12, memory_bandwidth=4.19e12, bus_bandwidth=360e9, fp32_matmul_flops=50e12
)


@dataclass
class Simulation:
    machine: Machine
    world_size: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    exposed_by_phase: dict[str, float]
    peak_activation_bytes: int
    timeline: list[tuple[str, str, str, float, float]] = field(repr=False)  # (node, stream, phase, start, end)

    def __str__(self) -> str:
        ms = 1e3
        phases = ", ".join(f"{k} {v * ms:.1f} ms" for k, v in self.exposed_by_phase.items())
        return (
            f"simulated on {self.machine.name}, {self.world_size} rank(s): step {self.step_s * ms:.1f} ms = "
            f"compute {self.compute_s * ms:.1f} ms + exposed communication {self.exposed_comm_s * ms:.1f} ms "
            f"({phases}); communication busy {self.comm_s * ms:.1f} ms; peak activation memory "
            f"{self.peak_activation_bytes / 2**30:.2f} GiB"
        )


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def compute_time(n: fx.Node, machine: Machine) -> float:
    """Roofline time of one compute node on the machine (0 for views and bookkeeping)."""
    if n.op != "call_function" or ops.costs_nothing(n):
        return 0.0
    out = _val(n)
    moved = nbytes(out) + sum(nbytes(_val(a)) for a in n.all_input_nodes)
    work = flops(n)
    rate = machine.matmul_flops
    operand = next((v for v in map(_val, n.all_input_nodes) if isinstance(v, torch.Tensor)), out)
    if work and isinstance(operand, torch.Tensor) and operand.dtype == torch.float32:  # the operands set the rate
        rate = machine.fp32_matmul_flops or machine.matmul_flops / 16
    return machine.launch + max(work / rate, moved / machine.memory_bandwidth)


def _collective(n: fx.Node, machine: Machine) -> tuple[float, float, int]:
    """(copy time, communication time, bytes in flight) of a collective's start node: the casts and
    copy-ins around it, and the transfer itself."""
    if n.target in ops.GATHERS:
        shard, world, dtype = ops.gather_args(n)
        value = _val(shard)
        dtype = dtype or value.dtype
        size = value.numel() * dtype.itemsize
        host = machine.launch + 3 * size / machine.memory_bandwidth if dtype != value.dtype else 0.0
        total = size * world
    else:
        r = ops.reduction_args(n)
        world = r.world_size
        total = r.padded_numel * r.wire_dtype.itemsize
        moved = sum(nbytes(_val(p)) + _val(p).numel() * r.wire_dtype.itemsize for p in r.pieces)
        host = machine.launch + moved / machine.memory_bandwidth
    if world == 1:
        return host, 0.0, 0
    return host, machine.latency + (world - 1) / world * total / machine.bus_bandwidth, total


def simulate(program: Program, machine: Machine = H200) -> Simulation:
    """Replay `program` on `machine` (NOTE: [Simulator])."""
    g = program.graph
    t_compute = t_comm = busy_comm = compute = 0.0
    done: dict[fx.Node, float] = {}
    exposed: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
    timeline = []
    for n in g.nodes:
        phase = n.meta.get("fbmt_phase", "")
        if n.op != "call_function" or n.target is ops.release:
            continue
        if n.target in ops.STARTS:
            host, comm, _ = _collective(n, machine)
            if comm:  # the copies run on the copy stream, right before the collective (NOTE: [Copy stream])
                host, comm = 0.0, host + comm
            t_compute += host
            compute += host
            begin = max(t_compute, t_comm)
            t_comm = begin + comm
            busy_comm += comm
            done[n] = t_comm
            timeline.append((n.name, "comm", phase, begin, t_comm))
        elif n.target is ops.wait:
            end = done.get(n.args[0], 0.0)
            if end > t_compute:
                exposed[phase or "fwd"] = exposed.get(phase or "fwd", 0.0) + end - t_compute
                t_compute = end
        else:
            cost = compute_time(n, machine)
            if cost:
                timeline.append((n.name, "compute", phase, t_compute, t_compute + cost))
            t_compute += cost
            compute += cost
    return Simulation(
        machine=machine,
        world_size=program.layout.world_size,
        step_s=max(t_compute, t_comm),
        compute_s=compute,
        comm_s=busy_comm,
        exposed_comm_s=sum(exposed.values()),
        exposed_by_phase=exposed,
        peak_activation_bytes=peak_memory(program),
        timeline=timeline,
    )


def peak_memory(program: Program) -> int:
    """Peak bytes of values alive at once when the program runs in its order (NOTE: [Simulator])."""
    g = program.graph
    order = ops.node_order(g)
    base: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:  # views and waits alias what they come from
        if n.op == "call_function" and (
            n.target is operator.getitem
            and nbytes(_val(n.args[0])) == 0
            or n.target is not operator.getitem
            and ops.costs_nothing(n)
            or n.target is ops.wait
        ):
            src = n.args[0]
            if isinstance(src, fx.Node):
                base[n] = base.get(src, src)
    owner = {n: base.get(n, n) for n in g.nodes}
    last: dict[fx.Node, int] = {}
    for n in g.nodes:
        for a in n.all_input_nodes:
            o = owner[a]
            last[o] = max(last.get(o, 0), order[n])
    size: dict[fx.Node, int] = {}
    events: list[tuple[float, int]] = []
    for n in g.nodes:
        if n.op == "call_function" and owner[n] is n:
            if n.target in ops.GATHERS:
                shard, world, dtype = ops.gather_args(n)
                size[n] = _val(shard).numel() * world * (dtype or _val(shard).dtype).itemsize
            elif n.target in ops.REDUCTIONS:  # the flat input lives until the wait, the shard after
                r = ops.reduction_args(n)
                waited = min((order[u] for u in n.users if u.target is ops.wait), default=order[n])
                # the flat input, and what an all-to-all receives (NOTE: [Narrow wire]), until the wait
                held = r.padded_numel * r.wire_dtype.itemsize * (2 if n.target is ops.all_to_all_reduce else 1)
                events += [(order[n], held), (waited + 0.5, -held)]
                size[n] = r.padded_numel // r.world_size * r.out_dtype.itemsize
            else:
                size[n] = nbytes(_val(n))
    for n, b in size.items():
        if b:
            events.append((order[n], b))
            events.append((last.get(n, order[n]) + 0.5, -b))
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak
