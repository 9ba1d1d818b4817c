"""`fbmt.profile(model, *inputs)`: the measured timeline of a compiled program's nodes on a real run,
to set against `fbmt.simulate` node by node.

    prof = fbmt.profile(model, idx, targets)      # every rank of the job calls it, as it would the model
    sim = fbmt.simulate(model.program)            # the same program, predicted
    print(prof.compare(sim))                      # step, compute, exposed communication, peak memory, top nodes

NOTE: [Profile]
A step is the forward call, the loss (the output's `loss`, the output if it is a scalar, else its
sum) and `loss.backward()`, with the gradients set to None before it, so the step allocates them
as the simulator counts them. The step time is the median of plain steps (`steps` of them, after
`warmup`). The node times come from one more step run node by node through a timing interpreter:
wall clock around each node on the CPU, CUDA events on the compute stream on a GPU. A start node's
time is what issuing costs the compute stream (its copies on one rank; on a CPU the copies too),
a wait node's is how long it stalled: the exposed communication of that collective. The gaps
between nodes in that step are the interpreter's own overhead and are not counted as any node's.
The peak memory is what the step allocates beyond what was alive when it began: CUDA's allocator
statistics, or on a CPU the allocations the torch profiler records. With `backend="inductor"` the
nodes are the compiled regions and the collectives between them.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from fbmt import job
from fbmt.compiler import CompiledModule, take
from fbmt.compiler import collectives as comm
from fbmt.tools.sim import Simulation, size


@dataclass(frozen=True)
class NodeTime:
    node: str
    phase: str
    kind: str  # "compute", "start" or "wait"
    start: float  # seconds from the step's start
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Profile:
    """What one rank measured (NOTE: [Profile])."""

    world_size: int
    device: str
    step_s: float  # the median plain step: forward, loss, backward
    steps_s: list[float]
    nodes: list[NodeTime] = field(repr=False)  # the timed step, node by node, in the order they ran
    peak_bytes: int | None  # allocated by the step beyond what it began with

    @property
    def compute_s(self) -> float:
        return sum(t.seconds for t in self.nodes if t.kind != "wait")

    @property
    def exposed_comm_s(self) -> float:
        return sum(t.seconds for t in self.nodes if t.kind == "wait")

    def times(self) -> dict[str, float]:
        """Measured seconds per node name."""
        return {t.node: t.seconds for t in self.nodes}

    def __str__(self) -> str:
        peak = size(self.peak_bytes) if self.peak_bytes is not None else "not measured"
        return (
            f"measured on {self.device}, {self.world_size} rank(s): step {self.step_s * 1e3:.1f} ms "
            f"(median of {len(self.steps_s)}); node by node: compute {self.compute_s * 1e3:.1f} ms, "
            f"exposed communication {self.exposed_comm_s * 1e3:.1f} ms; peak memory of the step {peak}"
        )

    def compare(self, sim: Simulation, top: int = 10) -> str:
        """Predicted against measured: the step, its parts, the peak, and the nodes that took longest."""

        def row(what: str, p: float, m: float, unit: str = "ms") -> str:
            err = f"{(p - m) / m:+.0%}" if m else "-"
            if unit == "ms":
                return f"{what:<28} {p * 1e3:>12.2f} {m * 1e3:>12.2f} {err:>8}"
            return f"{what:<28} {size(p):>12} {size(m):>12} {err:>8}"

        lines = [f"{'':<28} {'predicted':>12} {'measured':>12} {'error':>8}"]
        lines.append(row("step (ms)", sim.step_s, self.step_s))
        lines.append(row("compute (ms)", sim.compute_s, self.compute_s))
        lines.append(row("exposed communication (ms)", sim.exposed_comm_s, self.exposed_comm_s))
        if self.peak_bytes is not None:
            lines.append(row("peak memory", sim.peak_activation_bytes, self.peak_bytes, unit="bytes"))
        predicted = {name: end - start for name, stream, _, start, end in sim.timeline if stream == "compute"}
        measured = sorted((t for t in self.nodes if t.kind == "compute"), key=lambda t: -t.seconds)[:top]
        if measured:
            lines.append(f"{'node (longest measured)':<28} {'predicted':>12} {'measured':>12}")
            for t in measured:
                p = predicted.get(t.node)
                shown = f"{p * 1e3:.3f}" if p is not None else "-"
                lines.append(f"%{t.node:<27} {shown:>12} {t.seconds * 1e3:>12.3f}")
        return "\n".join(lines)


class _Timed(fx.Interpreter):
    """Runs a graph node by node, timing each (NOTE: [Profile])."""

    def __init__(self, gm: fx.GraphModule, phase: str, clock: _Clock):
        super().__init__(gm)
        self.phase, self.clock = phase, clock

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_module") or n.target is take:  # `take` hands a saved value over
            return super().run_node(n)
        begin = self.clock.mark()
        result = super().run_node(n)
        bucket = n.target is operator.getitem and comm.lowered(getattr(n.args[0], "target", None)) == "start"
        kind = "start" if bucket else comm.lowered(n.target) or "compute"  # a bucket's member is a start too
        self.clock.spans.append((n.name, self.phase, kind, begin, self.clock.mark()))
        return result


class _Clock:
    """Marks in time: the wall clock, or CUDA events on the current stream."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[str, str, str, Any, Any]] = []
        self.origin = self.mark()

    def mark(self) -> Any:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def timeline(self) -> list[NodeTime]:
        if self.cuda:
            torch.cuda.synchronize()
        return [
            NodeTime(name, phase, kind, self.seconds(self.origin, a), self.seconds(self.origin, b))
            for name, phase, kind, a, b in self.spans
        ]


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().sum()
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not leaves:
        raise ValueError("fbmt.profile: the model's output holds no tensor that needs a gradient; pass loss_fn=")
    return leaves[0].float().sum()


def profile(
    model: CompiledModule,
    *args: Any,
    steps: int = 5,
    warmup: int = 2,
    loss_fn: Any = None,
    memory: bool = True,
    **kwargs: Any,
) -> Profile:
    """Measure training steps of `model` on these inputs (NOTE: [Profile]). Every rank of the job must
    call it, as it would call the model; `loss_fn(output)` makes the loss (default: as HF models
    return it, or the output's sum)."""
    if not isinstance(model, CompiledModule):
        raise TypeError(f"fbmt.profile: expected a model returned by fbmt.compile, got {type(model).__name__}")
    if steps < 1:
        raise ValueError(f"fbmt.profile(steps={steps}): at least one step")
    loss_of = loss_fn or _loss
    device = model.device

    def step(clear: bool = True) -> None:
        if clear:
            model.zero_grad(set_to_none=True)
        loss_of(model(*args, **kwargs)).backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if job.is_initialized():
            torch.distributed.barrier()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    sync()
    clock = _Clock(device)
    with _instrumented(model, lambda gm, phase: _Timed(gm, phase, clock).run):
        step()
    nodes = clock.timeline()
    peak = _peak(step, model, device, sync) if memory else None
    return Profile(
        world_size=model.layout.world_size,
        device=str(device),
        step_s=statistics.median(times),
        steps_s=times,
        nodes=nodes,
        peak_bytes=peak,
    )


def _peak(step: Any, model: CompiledModule, device: torch.device, sync: Any) -> int:
    """Bytes a step allocates beyond what it began with, at its most."""
    model.zero_grad(set_to_none=True)  # before the measurement: the step allocates the gradients
    sync()
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(clear=False)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(clear=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: e["ts"])
    if not events:
        return 0
    first = events[0]["args"]
    begin = first["Total Allocated"] - first["Bytes"]
    return max(e["args"]["Total Allocated"] for e in events) - begin


@contextlib.contextmanager
def _instrumented(model: CompiledModule, wrap: Callable[[Any, str], Callable]) -> Iterator[None]:
    """Meanwhile, every program's forward and backward graph runs as `wrap(graph, phase)`. Not with
    CUDA graphs: a replay runs no node."""
    if model.options.cuda_graph:
        raise RuntimeError("fbmt.profile: a model compiled with cuda_graph=True replays graphs that run no node")
    saved = [(exe, exe.forward, exe.backward) for exe in model.executables()]
    try:
        for exe, fwd, bwd in saved:
            exe.forward = wrap(fwd, "fwd")
            if bwd is not None:
                exe.backward = wrap(bwd, "bwd")
        yield
    finally:
        for exe, fwd, bwd in saved:
            exe.forward, exe.backward = fwd, bwd
