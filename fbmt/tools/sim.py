"""Simulate a compiled program on a machine: step time, exposed communication, the memory curve.

    model = fbmt.compile(model_built_on_meta, world_size=8, device="meta", param_dtype=torch.bfloat16)
    program = model.trace(tokens, device="cpu")   # fake CPU tensors: nothing is allocated
    sim = fbmt.simulate(program, fbmt.sim.H200)   # default: this host's fbmt.calibrate() profile, else H200
    print(sim); print(sim.table())                # the step; one line per collective
    sim.chrome_trace("step.json")                 # for chrome://tracing or ui.perfetto.dev

NOTE: [Simulator]
The program is replayed in its own order (the forward, then the backward, exactly as the runtime
runs it) on two streams. The compute stream runs every op for `max(flops / matmul rate, bytes /
memory bandwidth)` plus a launch overhead (a roofline: matrix products and attention are priced by
their FLOPs, at the rate measured for products, or attention calls, of that size and dtype where the
machine has one, everything else by the bytes it reads and writes; views cost nothing). Where the
machine measured an op's elements per second (a CPU core's transcendentals and normalizations run
slower than their bytes move), the op takes the longer of the two times. A collective's start
occupies the communication stream (one of the backend's `comm_lanes` workers: NCCL runs a process
group's collectives one after another, gloo on two threads), in issue order, for its copies (the
cast before an all-gather, the copy of the gradients into the reduction's buffer: they run on the
runtime's copy stream, NOTE: [Copy stream] in runtime/collectives.py) plus `latency + (N - 1) / N *
bytes / bus bandwidth` (ring all-gather / reduce-scatter; an all-to-all moves as many bytes), with
each kind's own latency and bandwidth where they were measured; on one rank the copies run on the
compute stream. A host kind's copy between host memory and the device (`offload=True`, NOTE: [Offload]
in passes/shard.py) adds `host_bytes / host_bandwidth` to its time on the communication stream, on one
rank too. Compute that runs while a collective is in flight is slowed by the machine's
`comm_slowdown` (NCCL's kernels take SMs; gloo's threads take cores), and a collective beside
compute by its `comm_stretch`. A `wait` stalls the compute stream until its collective is done (from
the stall on, the collective runs alone, at full speed): that stall is *exposed communication*,
recorded per collective. The memory curve replays the same order with each value alive from its
definition to its last use (views keep their base alive; a reduce-scatter's input lives until its
wait), which is how the runtime frees values, split into activations, gathered parameters and
gradient buffers, plus what a collective allocates while it runs where the machine's `comm_buffer`
says it does (gloo copies its buffer: an all-gather's copy lives while the transfer runs, a
reduce-scatter's until its wait); persistent state (shards, gradients, optimizer) is not part of it.

It is a model, to compare schedules and settings, not a promise: BENCHMARKS.md sets it against
measurements.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import operator
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fbmt import files, flags
from fbmt.compiler import Program, meta, ops
from fbmt.compiler import collectives as comm
from fbmt.compiler.collectives import wire_bytes
from fbmt.compiler.ops import ATTENTION_BACKWARD, ATTENTION_FORWARD, flops, nbytes, op_name
from fbmt.compiler.ops import size as size  # re-exported: fbmt.sim.size


@dataclass(frozen=True)
class Machine:
    """What the simulator charges for work: rates per GPU (or CPU rank) and of the links between them.

    The flat rates are enough for a GPU whose products run near one rate; `fbmt.calibrate()` measures
    the finer ones: the achieved product rate by size and dtype, each collective kind's latency and
    bandwidth, the host's cost per node, and how much slower compute runs while a collective is in
    flight (NOTE: [Simulator])."""

    name: str
    matmul_flops: float  # achieved dense matrix-product rate in the compute dtype, FLOP/s
    memory_bandwidth: float  # bytes/s of device memory
    bus_bandwidth: float  # bytes/s per GPU that a ring collective achieves ("busbw")
    latency: float = 20e-6  # seconds per collective
    launch: float = 4e-6  # seconds per kernel (per node run: the host's overhead where it exceeds the GPU's)
    fp32_matmul_flops: float | None = None  # for fp32 matrix products (default: a 16th of matmul_flops)
    # measured products: (dtype name, FLOPs of one product, achieved FLOP/s), interpolated by FLOPs
    matmul_rates: tuple[tuple[str, float, float], ...] = ()
    # measured collectives: (kind, latency s, bus bandwidth bytes/s); a kind not listed uses the flat pair
    links: tuple[tuple[str, float, float], ...] = ()
    comm_slowdown: float = 0.0  # compute runs (1 + this) times slower while a collective is in flight
    comm_stretch: float = 0.0  # a collective runs (1 + this) times slower while compute runs beside it
    # collectives the backend runs at once: NCCL one stream per process group; gloo a work queue
    # served by two threads per device (ProcessGroupGloo's default)
    comm_lanes: int = 1
    # seconds per view, reshape or unpacking node: the host's call, which a GPU hides behind the kernels
    # queued before it, but a CPU rank spends in line with its compute
    view_cost: float = 0.0
    # bytes a collective allocates while it runs, per byte of its whole buffer, where the allocator
    # sees them: gloo copies the buffer it sends or reduces; NCCL's buffers are its own
    comm_buffer: float = 0.0
    # measured attention kernels, forward and backward together: (dtype name, FLOPs of one call as
    # `fbmt.compiler.ops.flops` counts them, achieved FLOP/s), interpolated by FLOPs; where none are listed,
    # attention runs at the product rate, as flash kernels do on a GPU
    attention_rates: tuple[tuple[str, float, float], ...] = ()
    # ops a core computes slower than it moves their bytes (transcendentals, normalizations,
    # reductions on a CPU): (op name, elements of the first operand per second); such an op takes
    # the longer of that and its roofline time
    elementwise_rates: tuple[tuple[str, float], ...] = ()
    # bytes/s of a copy between pinned host memory and the device (PCIe): what offload's copies take
    # (NOTE: [Offload] in fbmt/compiler/passes/shard.py); a CPU rank's host is its device
    host_bandwidth: float = 50e9

    def link(self, kind: str) -> tuple[float, float]:
        """(latency, bus bandwidth) of a collective kind ("all_gather", "reduce_scatter", ...)."""
        for k, latency, bandwidth in self.links:
            if k == kind:
                return latency, bandwidth
        return self.latency, self.bus_bandwidth

    def matmul_rate(self, work: float, dtype: torch.dtype) -> float:
        """The achieved FLOP/s of a product of `work` FLOPs in `dtype`: the measured rates of that
        dtype interpolated in log-log (clamped at the ends), else the flat rate."""
        rate = _interpolated(self.matmul_rates, work, dtype)
        if rate is not None:
            return rate
        if dtype == torch.float32:
            return self.fp32_matmul_flops or self.matmul_flops / 16
        return self.matmul_flops

    def attention_rate(self, work: float, dtype: torch.dtype) -> float:
        """The achieved FLOP/s of an attention call of `work` FLOPs: measured, else the product rate."""
        rate = _interpolated(self.attention_rates, work, dtype)
        return rate if rate is not None else self.matmul_rate(work, dtype)

    def elementwise_rate(self, op: str) -> float | None:
        """Elements per second measured for the aten op named `op`, if it was."""
        return next((r for name, r in self.elementwise_rates if name == op), None)

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data (what `save` writes)."""
        return {"fbmt_machine": 1, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Machine:
        """A profile from what `to_dict` made."""
        if d.get("fbmt_machine") != 1:
            raise ValueError("not an fbmt machine profile (written by fbmt.calibrate or Machine.save)")
        fields = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in d.items() if k in fields}
        for k in ("matmul_rates", "links", "attention_rates", "elementwise_rates"):
            d[k] = tuple(tuple(x) for x in d.get(k, ()))
        return cls(**d)

    def save(self, path: str) -> None:
        """Write this profile as JSON, whole (temporary file, fsync, rename)."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.write_json_atomic(self.to_dict(), path)

    @classmethod
    def load(cls, path: str) -> Machine:
        """A profile written by `save` or `fbmt.calibrate()`."""
        with open(path) as f:
            try:
                return cls.from_dict(json.load(f))
            except (json.JSONDecodeError, TypeError, ValueError) as e:
                raise ValueError(f"{path!r}: {e}; make one with fbmt.calibrate()") from None


def _interpolated(table: tuple[tuple[str, float, float], ...], work: float, dtype: torch.dtype) -> float | None:
    """A rate of `table`'s (dtype name, work, rate) points for `dtype`, interpolated in log-log
    (clamped at the ends); None where the table has no point of that dtype."""
    name = str(dtype).removeprefix("torch.")
    points = sorted((f, r) for d, f, r in table if d == name)
    if not points:
        return None
    if work <= points[0][0]:
        return points[0][1]
    for (f0, r0), (f1, r1) in zip(points, points[1:]):
        if work <= f1:
            t = (math.log(work) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))
    return points[-1][1]


# The rates measured on the H200 host of BENCHMARKS.md (matrix products, copy bandwidth, NVLink bus
# bandwidth of an all-gather or reduce-scatter between 2 GPUs).
H200 = Machine(
    "H200 (NVLink)",
    matmul_flops=700e12,
    memory_bandwidth=4.19e12,
    bus_bandwidth=360e9,
    fp32_matmul_flops=50e12,
    host_bandwidth=50e9,  # PCIe 5.0 x16, pinned
)


def profile_path(world_size: int) -> str:
    """Where `fbmt.calibrate()` saves this machine's profile for jobs of `world_size` ranks (NOTE:
    [Calibration] in fbmt/tools/calibration.py): $FBMT_MACHINE, else a file per host and world size in the
    user's cache folder."""
    return flags.MACHINE.get() or os.path.join(
        os.path.expanduser("~"), ".cache", "fbmt", f"machine-{socket.gethostname()}-{world_size}.json"
    )


def default_machine(world_size: int) -> Machine:
    """The profile `fbmt.calibrate()` saved on this host for `world_size` ranks, else the H200 of
    BENCHMARKS.md."""
    path = profile_path(world_size)
    return Machine.load(path) if os.path.exists(path) else H200


@dataclass(frozen=True)
class CollectiveTiming:
    """One collective as simulated: what it moves and when (seconds from the step's start)."""

    node: str  # its start node's name
    kind: str
    group: int
    block: str
    phase: str
    bytes: int  # the whole buffer, as it travels
    issued: float  # when the compute stream reached its start
    began: float  # when the communication stream took it up (after the collectives before it)
    ended: float
    waited: float  # when the compute stream reached its wait
    exposed: float  # how long that wait stalled the compute stream


@dataclass(frozen=True)
class MemoryCurve:
    """The bytes alive after each node runs, split by what holds them (NOTE: [Simulator])."""

    nodes: tuple[str, ...]  # every node of the program, in order
    times: tuple[float, ...]  # when the compute stream reaches each
    activations: tuple[int, ...]  # values the program computes (saved activations, temporaries)
    gathered: tuple[int, ...]  # gathered parameter buffers
    gradients: tuple[int, ...]  # flat gradient buffers in flight to a reduction, and its output shards
    alive_at_peak: tuple[tuple[str, str, int], ...]  # (node, kind, bytes) alive at the peak, largest first

    @property
    def total(self) -> list[int]:
        return [a + g + r for a, g, r in zip(self.activations, self.gathered, self.gradients)]

    @property
    def peak(self) -> int:
        return max(self.total, default=0)

    @property
    def peak_node(self) -> str:
        total = self.total
        return self.nodes[total.index(max(total))] if total else ""


@dataclass
class Simulation:
    machine: Machine
    world_size: int
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    exposed_by_phase: dict[str, float]
    peak_activation_bytes: int  # the peak of `memory`: every value the step holds beyond its persistent state
    timeline: list[tuple[str, str, str, float, float]] = field(repr=False)  # (node, stream, phase, start, end)
    collectives: list[CollectiveTiming] = field(default_factory=list, repr=False)
    memory: MemoryCurve | None = field(default=None, repr=False)

    def __str__(self) -> str:
        phases = ", ".join(f"{k} {_ms(v)}" for k, v in self.exposed_by_phase.items())
        return (
            f"simulated on {self.machine.name}, {self.world_size} rank(s): step {_ms(self.step_s)} = "
            f"compute {_ms(self.compute_s)} + exposed communication {_ms(self.exposed_comm_s)} "
            f"({phases}); communication busy {_ms(self.comm_s)}; peak memory of the step "
            f"{size(self.peak_activation_bytes)}"
        )

    def table(self) -> str:
        """One line per collective: what it moves, when it runs, and what its wait exposed."""
        lines = [f"{'collective':<44} {'bytes':>10} {'issued':>9} {'ran':>19} {'waited':>9} {'exposed':>9}"]
        for c in self.collectives:
            name = f"{c.phase} {c.kind} {c.block or '<root>'} (group {c.group})"
            lines.append(
                f"{name:<44} {size(c.bytes):>10} {_ms(c.issued):>9} {_ms(c.began) + '-' + _ms(c.ended):>19} "
                f"{_ms(c.waited):>9} {_ms(c.exposed):>9}"
            )
        return "\n".join(lines)

    def chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """The timeline in the Chrome trace format (chrome://tracing, ui.perfetto.dev): compute and
        communication as two threads, each exposed wait as a slice on the compute thread, and the
        memory curve as counters; written to `path` when given."""
        events: list[dict[str, Any]] = [
            {"ph": "M", "pid": 0, "tid": tid, "name": "thread_name", "args": {"name": name}}
            for tid, name in ((0, "compute"), (1, "communication"))
        ]
        for node, stream, phase, start, end in self.timeline:
            events.append(
                {
                    "ph": "X",
                    "pid": 0,
                    "tid": 0 if stream == "compute" else 1,
                    "name": node,
                    "cat": phase,
                    "ts": start * 1e6,
                    "dur": (end - start) * 1e6,
                }
            )
        for c in self.collectives:
            if c.exposed > 0:
                events.append(
                    {
                        "ph": "X",
                        "pid": 0,
                        "tid": 0,
                        "name": f"exposed: {c.node}",
                        "cat": "exposed",
                        "ts": c.waited * 1e6,
                        "dur": c.exposed * 1e6,
                    }
                )
        if self.memory is not None:
            for t, a, g, r in zip(
                self.memory.times, self.memory.activations, self.memory.gathered, self.memory.gradients
            ):
                events.append(
                    {
                        "ph": "C",
                        "pid": 0,
                        "name": "memory (bytes)",
                        "ts": t * 1e6,
                        "args": {"activations": a, "gathered parameters": g, "gradient buffers": r},
                    }
                )
        trace = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"machine": self.machine.name}}
        if path is not None:
            files.write_json_atomic(trace, path)
        return trace


def _val(n: Any) -> Any:
    return n.meta.get("val") if isinstance(n, fx.Node) else n


_ATTENTION = ATTENTION_FORWARD | ATTENTION_BACKWARD


def compute_time(n: fx.Node, machine: Machine) -> float:
    """Roofline time of one compute node on the machine (NOTE: [Simulator]; a view costs the
    machine's view cost, bookkeeping nothing)."""
    if n.op != "call_function":
        return 0.0
    if ops.costs_nothing(n):
        return machine.view_cost
    out = _val(n)
    moved = nbytes(out) + sum(nbytes(_val(a)) for a in n.all_input_nodes)
    work = flops(n)
    rate = machine.matmul_flops
    name = op_name(n.target)
    operand = next((v for v in map(_val, n.all_input_nodes) if isinstance(v, torch.Tensor)), out)
    if work and isinstance(operand, torch.Tensor):  # the operands' dtype and the product's size set the rate
        rate = (machine.attention_rate if name in _ATTENTION else machine.matmul_rate)(work, operand.dtype)
    seconds = max(work / rate, moved / machine.memory_bandwidth)
    per = machine.elementwise_rate(name) if machine.elementwise_rates else None
    if per and isinstance(operand, torch.Tensor):
        seconds = max(seconds, operand.numel() / per)
    return machine.launch + seconds


def _collective(n: fx.Node, machine: Machine) -> tuple[float, float, int]:
    """(copy time, communication time, bytes in flight) of a collective's start node: the casts and
    copy-ins around it, and the transfer itself."""
    total = wire_bytes(n)
    kind = comm.kind_of(n)
    if kind.role == comm.GATHER:
        shard, world, dtype = comm.gather_args(n)
        value = _val(shard)
        cast = dtype is not None and dtype != value.dtype  # the shard cast before it is sent
        host = machine.launch + 3 * (total // world) / machine.memory_bandwidth if cast else 0.0
    else:
        r = comm.reduction_args(n)
        world = r.world_size
        moved = sum(nbytes(_val(p)) + _val(p).numel() * r.wire_dtype.itemsize for p in r.pieces)
        host = machine.launch + moved / machine.memory_bandwidth
    copied = comm.host_bytes(n)  # offload's copy between host and device, serial with the collective
    across = copied / machine.host_bandwidth if copied and machine.host_bandwidth else 0.0
    if world == 1:
        return host, across, copied
    latency, bandwidth = machine.link(_link_of(kind))
    return host, across + latency + kind.traffic(world) * total / bandwidth, total


def _link_of(kind: comm.CollectiveKind) -> str:
    """The link a kind's transfer takes: its own; a host kind's is its role's plain kind's (its copy
    across the host link is priced apart)."""
    if kind.host:
        return "all_gather" if kind.role == comm.GATHER else "reduce_scatter"
    return kind.name


def _bucket(members: list[tuple[fx.Node, float, int]], machine: Machine) -> tuple[float, float]:
    """(copy time, communication time) of one call for a bucket's members: their copies, and one
    latency for all their bytes."""
    first = members[0][0]
    world, kind = comm.bucket_key(first)[2], comm.kind_of(first)
    if world == 1:
        return sum(h for _, h, _ in members), 0.0
    latency, bandwidth = machine.link(_link_of(kind))
    return sum(h for _, h, _ in members), latency + kind.traffic(world) * sum(b for _, _, b in members) / bandwidth


def _stretched(cost: float, now: float, comm_busy_until: float, slowdown: float) -> float:
    """How long `cost` seconds of compute take from `now` when a collective runs until
    `comm_busy_until` and slows compute by `slowdown` meanwhile."""
    shared = comm_busy_until - now
    if slowdown <= 0 or shared <= 0:
        return cost
    if shared >= cost * (1 + slowdown):
        return cost * (1 + slowdown)
    return shared + cost - shared / (1 + slowdown)


def simulate(program: Program, machine: Machine | None = None) -> Simulation:
    """Replay `program` on `machine` (NOTE: [Simulator]); by default the profile `fbmt.calibrate()`
    saved on this host, else the H200 of BENCHMARKS.md."""
    machine = machine or default_machine(program.layout.world_size)
    g = program.graph
    t_compute = busy_comm = compute = 0.0
    lanes = [0.0] * max(1, machine.comm_lanes)  # when each of the backend's workers is free
    started: dict[fx.Node, tuple[float, float, float]] = {}  # start -> (issued, began, ended)
    exposed: dict[str, float] = {"fwd": 0.0, "bwd": 0.0}
    timeline = []
    records = []
    reached: list[float] = []
    blocks = {grp.index: grp.block for grp in program.layout.groups}
    members: list[tuple[fx.Node, float, int]] = []  # a bucket's starts so far: (start, copy time, bytes)
    split: dict[int, float] = {}  # a gather bucket -> the time to cut its buffer (at its first wait)
    call: dict[fx.Node, tuple[int, list[fx.Node], int]] = {}  # a start -> its call's timeline entry, starts, lane
    waited_at: dict[str, int] = {}  # a start's name -> its wait's position (a bucket's: its first member's)
    bucket_waited: dict[int, int] = {}  # a bucket -> its first member's wait's position
    for n in g.nodes:
        reached.append(t_compute)
        phase = meta.phase(n) or ""
        if n.op != "call_function" or comm.is_release(n):
            continue
        if comm.is_start(n):
            host, busy, moved = _collective(n, machine)
            bucket = meta.bucket(n)
            if bucket is not None:  # one call for the run of members, issued with the last (NOTE: [Buckets])
                members.append((n, host, moved))
                if n.next.op == "call_function" and meta.bucket(n.next) == bucket:
                    continue
                host, busy = _bucket(members, machine)
                if comm.is_gather(n) and busy:  # the bucket's buffer cut into the members' at the first wait
                    split[bucket] = machine.launch * len(members) + 2 * sum(b for _, _, b in members) / (
                        machine.memory_bandwidth
                    )
            issued = [m for m, _, _ in members] or [n]
            members = []
            if busy:  # the copies run on the copy stream, right before the collective (NOTE: [Copy stream])
                host, busy = 0.0, host + busy
            t_compute += host
            compute += host
            lane = min(range(len(lanes)), key=lanes.__getitem__)  # in issue order, on the first free worker
            begin = max(t_compute, lanes[lane])
            busy *= 1 + machine.comm_stretch  # compute runs beside it, until a wait stalls for it
            lanes[lane] = begin + busy
            busy_comm += busy
            for m in issued:
                started[m] = (t_compute, begin, lanes[lane])
                call[m] = (len(timeline), issued, lane)
            timeline.append((n.name if len(issued) == 1 else f"bucket {bucket}", "comm", phase, begin, lanes[lane]))
        elif comm.is_wait(n):
            start = n.args[0]
            bucket = meta.bucket(start)
            at = len(reached) - 1
            waited_at[start.name] = at if bucket is None else bucket_waited.setdefault(bucket, at)
            issued, began, end = started.get(start, (t_compute, t_compute, t_compute))
            if end > t_compute and machine.comm_stretch:  # from here on it runs alone, at full speed
                since = max(t_compute, began)
                done = since + (end - since) / (1 + machine.comm_stretch)
                busy_comm -= end - done
                index, together, lane = call[start]  # a bucket's members share the call
                if lanes[lane] == end:
                    lanes[lane] = done
                timeline[index] = (*timeline[index][:3], began, done)
                for m in together:
                    started[m] = (started[m][0], began, done)
                end = done
            stall = max(0.0, end - t_compute)
            group = meta.group(start)
            records.append(
                CollectiveTiming(
                    start.name,
                    start.target.__name__,
                    group,
                    blocks.get(group, ""),
                    (meta.phase(start) or ""),
                    wire_bytes(start),
                    issued,
                    began,
                    end,
                    t_compute,
                    stall,
                )
            )
            if stall:
                exposed[phase or "fwd"] = exposed.get(phase or "fwd", 0.0) + stall
                t_compute = end
            copy = split.pop(meta.bucket(start), 0.0)  # at the first of its members' waits
            if copy:
                timeline.append((f"split {start.name}", "compute", phase, t_compute, t_compute + copy))
                t_compute += copy
                compute += copy
        else:
            cost = compute_time(n, machine)
            if cost:
                took = _stretched(cost, t_compute, max(lanes), machine.comm_slowdown)
                timeline.append((n.name, "compute", phase, t_compute, t_compute + took))
                t_compute += took
                compute += took
    running = []  # (first node, last node, kind, start's name, bytes) of what collectives allocate in flight
    if machine.comm_buffer:
        # from where it begins running (not before its start): gloo's all-gather frees its flat copy
        # when the transfer ends, its reduce-scatter's work object holds the input's copy until it is
        # waited on (a bucket's members share one, dropped at the first member's wait)
        index = {n.name: i for i, n in enumerate(g.nodes)}
        for c in records:
            first = max(index[c.node], bisect.bisect_left(reached, c.began))
            last = waited_at[c.node] - 1
            if c.kind == "all_gather":
                last = min(last, bisect.bisect_right(reached, c.ended) - 1)
            if last < first:
                continue
            kind = "gathered" if c.kind == "all_gather" else "gradients"
            running.append((first, last, kind, c.node, int(machine.comm_buffer * c.bytes)))
    curve = memory_curve(program, reached, running)
    return Simulation(
        machine=machine,
        world_size=program.layout.world_size,
        step_s=max(t_compute, *lanes),
        compute_s=compute,
        comm_s=busy_comm,
        exposed_comm_s=sum(exposed.values()),
        exposed_by_phase=exposed,
        peak_activation_bytes=curve.peak,
        timeline=timeline,
        collectives=sorted(records, key=lambda c: c.issued),
        memory=curve,
    )


def peak_memory(program: Program) -> int:
    """Peak bytes of values alive at once when the program runs in its order (NOTE: [Simulator])."""
    return memory_curve(program).peak


def memory_curve(
    program: Program, times: list[float] | None = None, running: list[tuple[int, int, str, str, int]] = ()
) -> MemoryCurve:
    """The bytes alive after each node, by kind: each value from its definition to its last use
    (views keep their base alive; a reduction's flat input lives until its wait), and `running`'s
    (first node, last node, kind, name, bytes): what collectives allocate while they run."""
    g = program.graph
    nodes = list(g.nodes)
    order = ops.node_order(g)
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:  # views and waits alias what they come from
        if n.op == "call_function" and (
            n.target is operator.getitem
            and nbytes(_val(n.args[0])) == 0
            or n.target is not operator.getitem
            and ops.costs_nothing(n)
            or comm.is_wait(n)
        ):
            src = n.args[0]
            if isinstance(src, fx.Node):
                base[n] = base.get(src, src)
    owner = {n: base.get(n, n) for n in nodes}
    last: dict[fx.Node, int] = {}
    for n in nodes:
        for a in n.all_input_nodes:
            o = owner[a]
            last[o] = max(last.get(o, 0), order[n])
    kinds = ("activations", "gathered", "gradients")
    deltas = {k: [0] * (len(nodes) + 1) for k in kinds}
    spans: list[tuple[int, int, str, str, int]] = []  # (from, to inclusive, kind, node, bytes)

    def hold(first: int, end: int, kind: str, name: str, b: int) -> None:
        if b:
            deltas[kind][first] += b
            deltas[kind][end + 1] -= b
            spans.append((first, end, kind, name, b))

    for first, end, kind, name, b in running:
        hold(first, min(end, len(nodes) - 1), kind, f"{name} (in flight)", b)

    def waited(start: fx.Node) -> int:
        return min((order[u] for u in start.users if comm.is_wait(u)), default=order[start])

    # a bucket of more than one rank (NOTE: [Buckets]): its first start, and its members' first and last wait
    buckets: dict[int, list[int]] = {}  # bucket -> [first start, first wait, last wait, bytes]
    for n in nodes:
        b = meta.bucket(n) if n.op == "call_function" else None
        if b is not None and comm.bucket_key(n)[2] > 1:
            first, lo, hi, total = buckets.setdefault(b, [order[n], waited(n), waited(n), 0])
            buckets[b] = [min(first, order[n]), min(lo, waited(n)), max(hi, waited(n)), total + wire_bytes(n)]
    for b, (first, lo, _, total) in buckets.items():
        head = nodes[first]
        if comm.is_gather(head):  # its buffer and its send buffer live until it is cut at its first wait
            hold(first, lo, "gathered", f"bucket {b}", total + total // comm.bucket_key(head)[2])
    for n in nodes:
        if n.op != "call_function" or owner[n] is not n:
            continue
        bucket = buckets.get(meta.bucket(n))
        if comm.is_gather(n):
            since = bucket[1] if bucket else order[n]  # a bucket member's own buffer: from the cut on
            hold(since, max(since, last.get(n, order[n])), "gathered", n.name, wire_bytes(n))
        elif comm.is_reduction(n):  # the flat input lives until the wait, the shard after
            r = comm.reduction_args(n)
            waited_at = bucket[2] if bucket else waited(n)  # a bucket's flat buffer: until its last wait
            # the flat input, and what an all-to-all receives (NOTE: [Narrow wire]), until the wait
            hold(order[n], waited_at, "gradients", n.name, comm.held_bytes(n))
            hold(
                order[n],
                last.get(n, order[n]),
                "gradients",
                n.name,
                r.padded_numel // r.world_size * r.out_dtype.itemsize,
            )
        else:
            hold(order[n], last.get(n, order[n]), "activations", n.name, nbytes(_val(n)))
    curves = {}
    for k in kinds:
        alive, curve = 0, []
        for i in range(len(nodes)):
            alive += deltas[k][i]
            curve.append(alive)
        curves[k] = tuple(curve)
    total = [sum(curves[k][i] for k in kinds) for i in range(len(nodes))]
    at = total.index(max(total)) if total else 0
    alive_at_peak = sorted(
        ((name, kind, b) for first, end, kind, name, b in spans if first <= at <= end), key=lambda x: -x[2]
    )
    return MemoryCurve(
        nodes=tuple(n.name for n in nodes),
        times=tuple(times) if times is not None else tuple(float(i) for i in range(len(nodes))),
        activations=curves["activations"],
        gathered=curves["gathered"],
        gradients=curves["gradients"],
        alive_at_peak=tuple(alive_at_peak),
    )


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1e-2 else f"{s * 1e3:.1f} ms"
