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
all-gather, the copy of the gradients into the reduce-scatter buffer: they run on the runtime's copy
stream, NOTE: [Copy stream]) plus `latency + (N - 1) / N * bytes / bus bandwidth` (ring
all-gather / reduce-scatter); on one rank the copies run on the compute stream. A
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

from fbmt.program import Program, nbytes
from fbmt.runtime import collectives

_FREE = {"view", "_unsafe_view", "reshape", "slice", "t", "transpose", "permute", "expand", "alias", "unsqueeze",
         "squeeze", "select", "as_strided", "split", "split_with_sizes", "unbind", "detach", "lift_fresh_copy"}
_ATTENTION = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
              "_scaled_dot_product_cudnn_attention", "_flash_attention", "_efficient_attention")


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
    gpus_per_node: int | None = None  # ranks that share the fast link (default: all of them, one machine)


# Measured on the H200 host of BENCHMARKS.md: ~700 TFLOP/s bf16 matmul (71% of the 989 peak), 4.19 TB/s
# copy bandwidth; NVLink all-gather/reduce-scatter bus bandwidth ~360 GB/s for 2 GPUs.
H200 = Machine("H200 (NVLink)", matmul_flops=700e12, memory_bandwidth=4.19e12, bus_bandwidth=360e9,
               fp32_matmul_flops=50e12)


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
        return (f"simulated on {self.machine.name}, {self.world_size} rank(s): step {self.step_s * ms:.1f} ms = "
                f"compute {self.compute_s * ms:.1f} ms + exposed communication {self.exposed_comm_s * ms:.1f} ms "
                f"({phases}); communication busy {self.comm_s * ms:.1f} ms; peak activation memory "
                f"{self.peak_activation_bytes / 2**30:.2f} GiB")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def _name(n: fx.Node) -> str:
    t = n.target
    return t.overloadpacket.__name__ if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))


def flops(n: fx.Node) -> float:
    """FLOPs of a matrix product or attention node (0 for everything else)."""
    name = _name(n)
    args = [_val(a) for a in n.args]
    if name in ("mm", "addmm", "bmm", "baddbmm", "mm_into"):
        a, b = (args[0], args[1]) if name in ("mm", "bmm", "mm_into") else (args[1], args[2])
        return 2.0 * a.numel() * b.shape[-1]
    if name.startswith(_ATTENTION):
        q, k = args[0], args[1]
        work = 4.0 * q.numel() * k.shape[-2]  # QK^T and PV: 2 * b*h*s*t*d each
        if any(a is True for a in n.args[3:]) or n.kwargs.get("is_causal"):
            work /= 2
        return work * (2.5 if name.endswith("backward") else 1.0)
    if name == "convolution":
        out, w = _val(n), args[1]
        return 2.0 * out.numel() * w[0].numel() if out is not None else 0.0
    return 0.0


def compute_time(n: fx.Node, machine: Machine) -> float:
    """Roofline time of one compute node on the machine (0 for views and bookkeeping)."""
    if n.op != "call_function" or n.target in (operator.getitem, collectives.grad_buffer) or _name(n) in _FREE:
        return 0.0  # views, and allocations
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
    if n.target is collectives.all_gather:
        shard, world = _val(n.args[0]), n.args[1]
        dtype = n.args[2] if len(n.args) > 2 else shard.dtype
        size = shard.numel() * _itemsize(dtype)
        host = machine.launch + 3 * size / machine.memory_bandwidth if dtype != shard.dtype else 0.0
        total = size * world
    else:  # reduce_scatter(pieces, world, padded_numel, average, wire_dtype, out_dtype[, buffer])
        pieces, world, padded = n.args[0], n.args[1], n.args[2]
        first = _val(pieces[0])
        reduce = n.args[4] if len(n.args) > 4 else first.dtype
        wire = collectives.on_wire(first.dtype, reduce, world, machine.gpus_per_node or world) \
            if len(n.args) <= 6 else reduce
        total = padded * _itemsize(wire)
        copied = [p for p in pieces if p.target is not collectives.mm_into]  # the rest are in place already
        moved = sum(nbytes(_val(p)) + _val(p).numel() * _itemsize(wire) for p in copied)
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
        if n.op != "call_function" or n.target is collectives.release:
            continue
        if n.target in collectives.STARTS:
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
        elif n.target is collectives.wait:
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
    return Simulation(machine=machine, world_size=program.layout.world_size, step_s=max(t_compute, t_comm),
                      compute_s=compute, comm_s=busy_comm, exposed_comm_s=sum(exposed.values()),
                      exposed_by_phase=exposed, peak_activation_bytes=peak_memory(program, machine.gpus_per_node),
                      timeline=timeline)


def peak_memory(program: Program, gpus_per_node: int | None = None) -> int:
    """Peak bytes of values alive at once when the program runs in its order (NOTE: [Simulator]);
    `gpus_per_node` as `Machine` has it."""
    g = program.graph
    order = {n: i for i, n in enumerate(g.nodes)}
    base: dict[fx.Node, fx.Node] = {}
    for n in g.nodes:  # views and waits alias what they come from, mm_into the buffer it writes
        if n.op == "call_function" and (n.target is operator.getitem and nbytes(_val(n.args[0])) == 0
                                        or _name(n) in _FREE or n.target in (collectives.wait, collectives.mm_into)):
            src = n.args[2] if n.target is collectives.mm_into else n.args[0]
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
            if n.target is collectives.all_gather:
                shard = _val(n.args[0])
                dtype = n.args[2] if len(n.args) > 2 else shard.dtype
                size[n] = shard.numel() * n.args[1] * _itemsize(dtype)
            elif n.target is collectives.reduce_scatter:  # the flat input lives until the wait, the shard after
                pieces, world, padded = n.args[0], n.args[1], n.args[2]
                piece = _val(pieces[0]).dtype
                wire = n.args[4] if len(n.args) > 4 else piece
                out = n.args[5] if len(n.args) > 5 else wire
                waited = min((order[u] for u in n.users if u.target is collectives.wait), default=order[n])
                if len(n.args) > 6:  # the flat input is the group's grad_buffer: it lives until the wait
                    last[n.args[6]] = max(last.get(n.args[6], 0), waited)
                else:  # the flat input, and what an exchange receives (NOTE: [Narrow wire]), until the wait
                    narrow = collectives.on_wire(piece, wire, world, gpus_per_node or world)
                    held = padded * _itemsize(narrow) * (2 if narrow != wire else 1)
                    events += [(order[n], held), (waited + 0.5, -held)]
                size[n] = padded // world * _itemsize(out)
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

