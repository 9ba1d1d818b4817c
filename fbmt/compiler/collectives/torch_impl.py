"""How the collectives of a program run: the implementations of the table's kinds on
`torch.distributed` (and the probes `fbmt.calibrate` times).

Each start issues its operation asynchronously and returns a `Pending` handle; `wait` returns the
result. On NCCL, `async_op=True` runs the collective on ProcessGroupNCCL's own stream, and `wait()`
only makes the current (compute) stream wait on an event: no host synchronization inside a step. On
gloo the collective runs on gloo's worker thread and `wait()` blocks the host. The partitioner puts
these functions in the graphs it builds (each kind's `implementation`, and `wait`); `release` markers
are dropped there, since the generated code frees every value after its last use.

NOTE: [Copy stream]
On CUDA the copies around a collective run on a side stream per device, not on the compute stream:
the cast of a shard to the compute dtype before its gather, and the copy of a group's gradients into
the flat buffer of its reduction. They are memory-bound and small, so they overlap the block that
computes meanwhile instead of delaying it. Ordering, with no host synchronization:
- the side stream first waits for the compute stream at the start (so it sees the optimizer's last
  write of the shard, and the gradients just computed); the collective, issued from the side stream,
  waits for the side stream; the compute stream's `wait` waits for the collective;
- output buffers are allocated on the compute stream, which reads them; the side stream's
  temporaries (the cast shard, the flat gradient buffer) are held by the `Pending` handle until its
  `wait`, and are reused by the side stream only after its next wait for the compute stream, which
  has by then waited for the collective; the gradient pieces, allocated on the compute stream and
  freed there right after the start, are marked with `record_stream` so the allocator does not hand
  their memory out again before the side stream has copied them.
The copies themselves use a bounded share of the SMs (NOTE: [Bounded copies] in copies.py).
The mean over ranks is NCCL's `ReduceOp.AVG` (no separate divide over the shard); gloo has no AVG
for reduce-scatter, so there the shard is divided after the wait.

`all_to_all_reduce` (NOTE: [Narrow wire] in passes/shard.py) exchanges the pieces in their own dtype
and sums what arrives in the reduce dtype. Two ranks exchange through an all-gather, each sending
the chunk its partner reduces: NCCL runs an all-to-all as point-to-point sends on few channels, and
an all-gather on as many as its reduce-scatter (BENCHMARKS.md). On CUDA the sum runs on a third
stream, the reduce stream, once the exchange is done (the compute stream only waits for it at
`wait`), on a bounded grid: on the copy stream it would hold up the next casts behind the exchange.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist

from fbmt.compiler.collectives import copies
from fbmt.job import all_gather_into, reduce_scatter_into


class Pending:
    """An issued collective: its output tensor, the work handle to wait on, what to do after."""

    __slots__ = ("tensor", "work", "divisor", "out_dtype", "keep", "then", "what")

    def __init__(
        self,
        tensor: torch.Tensor,
        work: object | None,
        divisor: int = 1,
        out_dtype: torch.dtype | None = None,
        keep: Any = None,
        then: Any = None,
        what: str = "a collective",
    ):
        self.tensor, self.work, self.divisor, self.out_dtype = tensor, work, divisor, out_dtype
        self.what = what  # for the message when a peer never joins it
        self.keep = keep  # side-stream temporaries, alive until the wait (NOTE: [Copy stream])
        self.then = then  # what computes `tensor` once the work is done (gloo, NOTE: [Narrow wire])


class _Recorded:
    """A work handle for an event: waiting makes the current stream wait for it."""

    __slots__ = ("event",)

    def __init__(self, event: torch.cuda.Event):
        self.event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)


_streams: dict[tuple[str, int], torch.cuda.Stream] = {}  # (kind, device index) -> the side stream, made once


def _side_stream(kind: str, device: torch.device) -> torch.cuda.Stream:
    """The device's stream of this kind ("copy", "reduce"), made on first use."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _streams.get((kind, index))
    if stream is None:
        stream = _streams[kind, index] = torch.cuda.Stream(device)
    return stream


def _copy_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The device's copy stream, made to wait for everything queued so far on the compute stream
    (NOTE: [Copy stream]); None off CUDA."""
    if device.type != "cuda":
        return None
    stream = _side_stream("copy", device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return stream


def _reduce_stream(device: torch.device) -> torch.cuda.Stream:
    """The device's reduce stream (all_to_all_reduce); the caller orders it after what it must see."""
    return _side_stream("reduce", device)


def _on(stream: torch.cuda.Stream | None) -> Any:
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def _nccl(t: torch.Tensor) -> bool:
    return t.is_cuda and "nccl" in str(dist.get_backend())


def all_gather(shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None) -> Pending:
    """Start gathering a flat shard from every rank into one flat buffer (rank-major), cast to
    `dtype` first if given (mixed precision: fewer bytes on the wire)."""
    cast = dtype is not None and dtype != shard.dtype
    if world_size == 1:
        return Pending(shard.to(dtype) if cast else shard, None)
    out = torch.empty(shard.numel() * world_size, dtype=dtype if cast else shard.dtype, device=shard.device)
    with _on(_copy_stream(shard.device)):
        if cast:
            shard = copies.copy_(torch.empty(shard.numel(), dtype=dtype, device=shard.device), shard)
        work = all_gather_into(out, shard, async_op=True)
    return Pending(out, work, keep=shard if cast else None, what=f"an all-gather of {out.numel()} {out.dtype}")


def reduce_scatter(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Pending:
    """Start reducing a group's gradients over ranks; this rank receives the mean (or sum) of its shard.

    `pieces` (1-D, in layout order) are copied into one zero-padded flat buffer of `padded_numel`
    elements, cast to `wire_dtype` in the same copy (mixed precision: no intermediate flat in the
    compute dtype), summed in that dtype; the result is returned as `out_dtype`.
    """
    dtype, device = wire_dtype, pieces[0].device
    if world_size == 1:  # nothing to overlap with: fill the buffer on the compute stream
        flat = torch.empty(padded_numel, dtype=dtype, device=device)
        _fill(flat, pieces)
        return Pending(flat, None, out_dtype=out_dtype)
    out = torch.empty(padded_numel // world_size, dtype=dtype, device=device)
    avg = average and _nccl(out)
    side = _copy_stream(device)
    with _on(side):
        flat = torch.empty(padded_numel, dtype=dtype, device=device)
        _fill(flat, pieces, copies.copy_)
        op = dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM
        work = reduce_scatter_into(out, flat, op=op, async_op=True)
    keep = (flat, _guard(pieces, side))
    return Pending(
        out,
        work,
        divisor=world_size if average and not avg else 1,
        out_dtype=out_dtype,
        keep=keep,
        what=f"a reduce-scatter into {out.numel()} {out.dtype}",
    )


def all_to_all_reduce(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Pending:
    """`reduce_scatter` with the pieces' own dtype on the wire, summed in `reduce_dtype` (see above)."""
    device = pieces[0].device
    out = torch.empty(padded_numel // world_size, dtype=reduce_dtype, device=device)
    side = _copy_stream(device)
    with _on(side):
        flat = torch.empty(padded_numel, dtype=pieces[0].dtype, device=device)
        _fill(flat, pieces, copies.copy_)
        received = torch.empty_like(flat)
        sent, got = flat.view(world_size, -1), received.view(world_size, -1)
        if world_size == 2:  # each rank sends the chunk its partner reduces: an all-gather delivers it
            rank = dist.get_rank()
            work = all_gather_into(received, sent[1 - rank], async_op=True)
        else:
            work = dist.all_to_all_single(received, flat, async_op=True)

    def reduce() -> torch.Tensor:
        if world_size == 2:  # its own chunk, and the partner's chunk for it
            return copies.sum_(out, sent[rank], got[1 - rank], 0.5 if average else 1.0)
        return (torch.mean if average else torch.sum)(got, 0, dtype=out.dtype, out=out)

    if side is None:  # gloo: sum after the wait, on the host
        return Pending(
            out, work, out_dtype=out_dtype, keep=(flat, received), then=reduce, what="an all-to-all gradient reduction"
        )
    held = _guard(pieces, side)
    stream = _reduce_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # `out` is the compute stream's memory
    with _on(stream):
        work.wait()  # the reduce stream waits for the exchange
        reduce()
        done = torch.cuda.Event()
        done.record(stream)
    return Pending(out, _Recorded(done), out_dtype=out_dtype, keep=(flat, received, held))


def _guard(pieces: list[torch.Tensor], side: torch.cuda.Stream | None) -> list[torch.Tensor] | None:
    """Keep the gradient pieces' memory from the allocator until the side stream has copied them.

    They are the compute stream's, freed there right after the start. Eagerly, `record_stream` tells
    the allocator to wait for the side stream before reusing them. While a CUDA graph is captured the
    allocator cannot check such uses and keeps every recorded block until the capture ends, which
    would hold all of a step's gradients at once; so then the pieces are returned, for the `Pending`
    to hold until its wait (the next reduce-scatter's start, NOTE: [CUDA graphs] in graphs.py)."""
    if side is None:
        return None
    if torch.cuda.is_current_stream_capturing():
        return pieces
    for p in pieces:
        p.record_stream(side)
    return None


def _fill(dest: torch.Tensor, pieces: list[torch.Tensor], copy: Any = None) -> None:
    """Copy the pieces end to end into `dest` and zero the rest. `dest` is a flat buffer, or the
    rows of one group's columns in a bucket's flat buffer (NOTE: [Buckets]), filled row after row:
    a piece that crosses a row's end continues on the next. `copy(dst, src)` copies one piece (the
    copy stream's bounded kernel); without it all are copied at once on the current stream
    (`_copy_all`)."""
    rows = dest.view(1, -1) if dest.dim() == 1 else dest
    width, offset = rows.shape[1], 0
    into, out_of = [], []
    for p in pieces:
        done, n = 0, p.numel()
        while done < n:
            r, c = divmod(offset, width)
            take = min(width - c, n - done)
            into.append(rows[r, c : c + take])
            out_of.append(p[done : done + take])
            done, offset = done + take, offset + take
    if copy is None:
        _copy_all(into, out_of)
    else:
        for d, src in zip(into, out_of):
            copy(d, src)
    r, c = divmod(offset, width)
    if r < rows.shape[0]:
        rows[r, c:].zero_()
        rows[r + 1 :].zero_()


def _copy_all(into: list[torch.Tensor], out_of: list[torch.Tensor]) -> None:
    """`d.copy_(s)` for every pair, casting, as one `torch._foreach_copy_` (FSDP2 copies its
    gathered parameters out the same way).

    NOTE: [Gradient copy-in]
    On one rank a group's reduce-scatter is this copy of its bf16 gradients into the fp32 buffer the
    optimizer reads, on the compute stream. A `Tensor.copy_` per piece runs torch's casting copy
    kernel, which loads and stores one element at a time when it casts; the foreach kernel moves
    aligned vectors and does a group in one launch (benchmarks/grad_copy.py times both)."""
    if into:
        torch._foreach_copy_(into, out_of)


def wait(pending: Pending) -> torch.Tensor:
    if pending.work is not None:
        try:
            pending.work.wait()
        except RuntimeError as e:  # gloo: a peer that never joined within the group's timeout
            where = pending.what if " outside " in pending.what else f"{pending.what} of the compiled program"
            raise RuntimeError(
                f"fbmt: rank {dist.get_rank()} waited in {where}, and a peer never joined it: another rank stalled, "
                "died, or left the program (its log says which). "
                f"Raise FBMT_TIMEOUT if its steps take longer ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
            ) from e
    tensor = pending.then() if pending.then is not None else pending.tensor
    pending.keep = pending.then = None
    if pending.divisor != 1:
        tensor.div_(pending.divisor)
    if pending.out_dtype is not None and pending.out_dtype != tensor.dtype:
        return tensor.to(pending.out_dtype)
    return tensor


# ---- offload: a shard in host memory (NOTE: [Offload] in passes/shard.py) ----------------------


def all_gather_from_host(
    shard: torch.Tensor, world_size: int, dtype: torch.dtype | None = None, *, device: torch.device
) -> Pending:
    """`all_gather` of a shard in host memory: copied to `device` on the copy stream, then cast and
    gathered there (NOTE: [Copy stream]); where the host is the device (a CPU run), `all_gather`."""
    if device.type != "cuda":
        return all_gather(shard, world_size, dtype)
    cast = dtype is not None and dtype != shard.dtype
    out = torch.empty(shard.numel() * world_size, dtype=dtype if cast else shard.dtype, device=device)
    with _on(side := _copy_stream(device)):
        if world_size == 1:  # the buffer is the shard: copied in (and cast on the device, into it)
            local = torch.empty(shard.numel(), dtype=shard.dtype, device=device) if cast else out
            local.copy_(shard, non_blocking=True)
            if cast:
                copies.copy_(out, local)
            send = None
            work: Any = _Recorded(_recorded(side))
        else:
            local = torch.empty(shard.numel(), dtype=shard.dtype, device=device)
            local.copy_(shard, non_blocking=True)
            send = copies.copy_(torch.empty(shard.numel(), dtype=dtype, device=device), local) if cast else local
            work = all_gather_into(out, send, async_op=True)
    return Pending(out, work, keep=(local, send), what=f"an all-gather from host memory of {out.numel()} {out.dtype}")


def reduce_scatter_to_host(
    pieces: list[torch.Tensor],
    world_size: int,
    padded_numel: int,
    average: bool,
    wire_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> Pending:
    """`reduce_scatter`, then this rank's shard of the result copied to pinned host memory on the copy
    stream, once the reduction is done; where the host is the device (a CPU run), `reduce_scatter`.
    The host tensor is complete once the device has run the copy: the Executable synchronizes with the
    device at the end of a backward that has one (NOTE: [Offload])."""
    pending = reduce_scatter(pieces, world_size, padded_numel, average, wire_dtype, reduce_dtype, out_dtype)
    device = pieces[0].device
    if device.type != "cuda":
        return pending
    with _on(side := _copy_stream(device)):
        host = _to_host(pending, out_dtype)
        host.work = _Recorded(_recorded(side))
    return host


def _to_host(pending: Pending, out_dtype: torch.dtype) -> Pending:
    """On the current (copy) stream: wait for a reduction, finish its shard (divide, cast) and copy it
    to pinned host memory; the handle's `work` is for the caller to set, once its copies are queued.
    The device buffers stay held until the handle's wait, which the compute stream orders after them."""
    if pending.work is not None:
        pending.work.wait()  # the copy stream waits for the reduction (once for a bucket: `_Once`; gloo: the host)
    shard = pending.tensor if pending.divisor == 1 else pending.tensor / pending.divisor
    shard = shard.to(out_dtype)
    host = torch.empty(shard.numel(), dtype=out_dtype, pin_memory=True)
    host.copy_(shard, non_blocking=True)
    return Pending(host, None, keep=(pending.keep, pending.tensor, shard), what=f"{pending.what} to host memory")


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


# ---- buckets: several groups' collectives as one call (NOTE: [Buckets] in fbmt/compiler/collectives/) ----


class _Once:
    """The work handle a bucket's members share: the first member's wait waits for it; the later
    ones, which run after it on the same stream, find it done."""

    __slots__ = ("work",)

    def __init__(self, work: Any):
        self.work = work

    def wait(self) -> None:
        work, self.work = self.work, None
        if work is not None:
            work.wait()


class _Split:
    """A bucket's gathered buffer (rank-major over the members' shards side by side), cut into each
    member's own rank-major buffer at the first member's wait; then the bucket's buffer and its send
    buffer (the copy stream's, held until the compute stream has waited: NOTE: [Copy stream]) are
    freed."""

    __slots__ = ("out", "send", "sizes", "world", "parts")

    def __init__(self, out: torch.Tensor, send: torch.Tensor, sizes: list[int], world: int):
        self.out, self.send, self.sizes, self.world, self.parts = out, send, sizes, world, None

    def part(self, i: int) -> torch.Tensor:
        if self.parts is None:
            columns = self.out.view(self.world, -1).split(self.sizes, dim=1)
            self.parts = [c.contiguous().view(-1) for c in columns]
            self.out = self.send = None
        part, self.parts[i] = self.parts[i], None
        return part


def all_gather_bucket(members: list[tuple]) -> list[Pending]:
    """Start one all-gather for several groups' shards (each member: (shard, world size, wire
    dtype or None), all with one world size and wire dtype): the shards are copied side by side into
    one send buffer, cast on the way; a handle per member, whose wait returns that group's gathered
    buffer."""
    shards = [m[0] for m in members]
    world, dtype = members[0][1], members[0][2] or shards[0].dtype
    if world == 1:
        return [all_gather(*m) for m in members]
    sizes = [s.numel() for s in shards]
    device = shards[0].device
    out = torch.empty(world * sum(sizes), dtype=dtype, device=device)
    with _on(_copy_stream(device)):
        send = torch.empty(sum(sizes), dtype=dtype, device=device)
        offset = 0
        for s in shards:
            copies.copy_(send[offset : offset + s.numel()], s)
            offset += s.numel()
        work = all_gather_into(out, send, async_op=True)
    split, shared = _Split(out, send, sizes, world), _Once(work)
    what = f"a bucket of {len(members)} all-gathers ({out.numel()} {out.dtype})"
    # no handle holds the bucket's buffers: `split` frees them once cut, at the first member's wait
    return [Pending(None, shared, then=functools.partial(split.part, i), what=what) for i in range(len(members))]


def reduce_scatter_bucket(members: list[tuple]) -> list[Pending]:
    """Start one reduce-scatter for several groups' gradients (each member: a reduction's arguments,
    all with one world size, wire dtype and averaging). Each rank's chunk of the bucket holds every
    member's chunk side by side, so this rank's result is every member's shard side by side, and
    each member's handle returns a view of its own."""
    pieces0, world, _, average, dtype, _, _ = members[0]
    if world == 1:
        return [reduce_scatter(*m) for m in members]
    device = pieces0[0].device
    chunks = [m[2] // world for m in members]
    out = torch.empty(sum(chunks), dtype=dtype, device=device)
    avg = average and _nccl(out)
    side = _copy_stream(device)
    with _on(side):
        flat = torch.empty(world * sum(chunks), dtype=dtype, device=device)
        rows, offset = flat.view(world, -1), 0
        for (pieces, *_), chunk in zip(members, chunks):
            _fill(rows[:, offset : offset + chunk], pieces, copies.copy_)
            offset += chunk
        work = reduce_scatter_into(out, flat, op=dist.ReduceOp.AVG if avg else dist.ReduceOp.SUM, async_op=True)
    keep = (flat, [_guard(m[0], side) for m in members])
    shared, handles, offset = _Once(work), [], 0
    what = f"a bucket of {len(members)} reduce-scatters into {out.numel()} {out.dtype}"
    for (*_, out_dtype), chunk in zip(members, chunks):
        divisor = world if average and not avg else 1
        handles.append(Pending(out[offset : offset + chunk], shared, divisor, out_dtype, keep=keep, what=what))
        offset += chunk
    return handles


def all_gather_from_host_bucket(members: list[tuple], *, device: torch.device) -> list[Pending]:
    """`all_gather_bucket` of shards in host memory: each copied into its place in the send buffer on
    the device (the copy stream's), which is cast and gathered as one call."""
    if device.type != "cuda":
        return all_gather_bucket(members)
    shards = [m[0] for m in members]
    world, dtype = members[0][1], members[0][2] or shards[0].dtype
    if world == 1:
        return [all_gather_from_host(*m, device=device) for m in members]
    sizes = [s.numel() for s in shards]
    out = torch.empty(world * sum(sizes), dtype=dtype, device=device)
    with _on(_copy_stream(device)):
        staged = torch.empty(sum(sizes), dtype=shards[0].dtype, device=device)
        offset = 0
        for s in shards:
            staged[offset : offset + s.numel()].copy_(s, non_blocking=True)
            offset += s.numel()
        send = (
            copies.copy_(torch.empty(sum(sizes), dtype=dtype, device=device), staged)
            if dtype != staged.dtype
            else staged
        )
        work = all_gather_into(out, send, async_op=True)
    split, shared = _Split(out, (staged, send), sizes, world), _Once(work)
    what = f"a bucket of {len(members)} all-gathers from host memory ({out.numel()} {out.dtype})"
    return [Pending(None, shared, then=functools.partial(split.part, i), what=what) for i in range(len(members))]


def reduce_scatter_to_host_bucket(members: list[tuple]) -> list[Pending]:
    """`reduce_scatter_bucket`, then each member's shard of the result copied to pinned host memory on
    the copy stream once the reduction is done (as `reduce_scatter_to_host`)."""
    handles = reduce_scatter_bucket(members)
    device = members[0][0][0].device
    if device.type != "cuda":
        return handles
    with _on(side := _copy_stream(device)):
        hosts = [_to_host(pending, m[-1]) for pending, m in zip(handles, members)]
        done = _Recorded(_recorded(side))  # after every member's copy
    for host in hosts:
        host.work = done
    return hosts


# ---- probes: one call of each kind as the runtime issues it, for fbmt.calibrate ----------------


def _buffers(numel: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A whole fp32 buffer of about `numel` elements (a multiple of the world size) and one rank's part."""
    world = dist.get_world_size()
    n = max(world, numel // world * world)
    return torch.ones(n, device=device), torch.ones(n // world, device=device), world


def probe_all_gather(numel: int, device: torch.device) -> Callable[[bool], Any]:
    flat, part, _ = _buffers(numel, device)
    return lambda async_op=False: all_gather_into(flat, part, async_op=async_op)


def probe_reduce_scatter(numel: int, device: torch.device) -> Callable[[bool], Any]:
    flat, part, _ = _buffers(numel, device)
    return lambda async_op=False: reduce_scatter_into(part, flat, async_op=async_op)


def probe_all_gather_from_host(numel: int, device: torch.device) -> Callable[[bool], Any]:
    _, part, world = _buffers(numel, device)
    host = part.cpu().pin_memory() if device.type == "cuda" else part

    def run(async_op: bool = False) -> Any:
        pending = all_gather_from_host(host, world, device=device)
        return pending.work if async_op else wait(pending)

    return run


def probe_reduce_scatter_to_host(numel: int, device: torch.device) -> Callable[[bool], Any]:
    flat, _, world = _buffers(numel, device)

    def run(async_op: bool = False) -> Any:
        pending = reduce_scatter_to_host([flat], world, flat.numel(), False, flat.dtype, flat.dtype, flat.dtype)
        return pending.work if async_op else wait(pending)

    return run


def probe_all_to_all(numel: int, device: torch.device) -> Callable[[bool], Any]:
    flat, part, world = _buffers(numel, device)
    received = torch.empty_like(flat)
    if world == 2:  # as the runtime exchanges two ranks' chunks (NOTE: [Narrow wire])
        return lambda async_op=False: all_gather_into(received, part, async_op=async_op)
    return lambda async_op=False: dist.all_to_all_single(received, flat, async_op=async_op)
