"""Sharded checkpoints of a training run, written and read by `torch.distributed.checkpoint` (DCP).

    fbmt.checkpoint.save("ckpt", step, model=model, optimizer=opt, state={"sched": sched})
    resumed = fbmt.checkpoint.load("ckpt", model=model, optimizer=opt, state={"sched": sched})
    start = resumed.step if resumed else 0

Each rank writes only the parts of parameters and optimizer state its flat shards hold, in
parallel; no rank gathers the model. A checkpoint is a folder `step-<step>` holding DCP's files and,
once every rank's files are durable, `fbmt.json`: a folder without it is incomplete and never loaded.
Loading on another number of ranks reshards model and optimizer state, because the files are
keyed like plain PyTorch's (`model.<param>`, `optim.state.<param>.<key>`, `optim.param_groups`),
with each parameter in its own shape: `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`
turns a checkpoint into one `torch.save` file that an unsharded model loads.

NOTE: [Pieces of flat shards]
A rank holds a contiguous range of each parameter's flattened elements (`layout.local_range`). DCP
describes what a rank writes or reads as boxes of the parameter's shape (offsets and sizes per
dimension), so a range becomes up to 2·ndim−1 boxes (a partial row, whole rows, a partial row, one
dimension down at a time), each a view into the shard. DCP plans with `__create_write_items__` /
`__create_chunk_list__` of `_Pieces`, and the planners below look the views up.

NOTE: [Checkpoints that cannot be silently wrong]
- A job holds a lock on the folder it saves into (`.lock`, an fcntl lock rank 0 takes at its first save
  and keeps until the process ends, released by the OS if it dies): a second job given the same folder
  (a second launch, a typo) is refused at its first save instead of writing over the first job's.
- Each rank records a CRC-32 of every file it wrote (DCP's `__<rank>_*.distcp`; rank 0 also `.metadata`),
  and the marker lists them. `load` verifies them first, the ranks sharing the files; a checkpoint whose
  file is missing, truncated or changed is damaged: asked for by name, that is an error naming the
  file; found as the newest in a folder, the next older complete one is loaded instead, and the log
  says so. A folder whose checkpoints are all damaged is an error, never a fresh start.
- A background save that fails and is never waited for is reported when the process exits, which
  then exits with 1.

What else a checkpoint holds: buffers (replicated), every rank's RNG states (torch, CUDA, Python,
NumPy; restored when the number of ranks is the same, so a resumed run draws the same dropout masks),
and `state`: objects with `state_dict()`/`load_state_dict()` (an lr scheduler, a data sampler),
loaded in place, or plain values, returned in `Resumed.state` (rank 0's are saved).
"""

from __future__ import annotations

import atexit
import copy as copy_module
import fcntl
import logging
import math
import os
import random
import re
import shutil
import socket
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from fbmt import job
from fbmt.compiler import CompiledModule, local_range
from fbmt.files import fsync_dir, save_atomic, write_json_atomic
from fbmt.integrations.adopt import shards_for_parameters
from fbmt.integrations.torch_guards import unmarked

__all__ = [
    "save",
    "load",
    "latest",
    "checkpoints",
    "wait_for_pending",
    "Resumed",
    "PendingSave",
    "CheckpointError",
    "save_atomic",
]

log = logging.getLogger("fbmt")

MARKER = "fbmt.json"
LOCK = ".lock"
_NAME = re.compile(r"^step-(\d+)$")
_locks: dict[str, int] = {}  # folder -> the file descriptor holding this process's lock on it


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which one, why, and what to do."""


@dataclass
class Resumed:
    """What `load` restored: the step it was saved at, from where, on how many ranks."""

    step: int
    path: str
    world_size: int
    state: dict[str, Any] = field(default_factory=dict)


# ---- where checkpoints are ----


def checkpoints(folder: str) -> list[tuple[int, str]]:
    """The complete checkpoints under `folder`, as (step, path), oldest first."""
    if not os.path.isdir(folder):
        return []
    found = []
    for name in os.listdir(folder):
        m = _NAME.match(name)
        if m and os.path.isfile(os.path.join(folder, name, MARKER)):
            found.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(found)


def latest(folder: str) -> str | None:
    """The newest complete checkpoint under `folder`, or None."""
    found = checkpoints(folder)
    return found[-1][1] if found else None


# ---- saving ----


def save(
    folder: str,
    step: int,
    *,
    model: CompiledModule,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
    keep: int | None = 3,
    blocking: bool = True,
) -> Any:
    """Write checkpoint `folder/step-<step>` (a collective: every rank calls it). Returns its path.

    It is complete once this returns on any rank; a save that fails on any rank (a full disk, a
    read-only folder) raises on every rank and leaves the existing checkpoints as they were. `keep`:
    how many complete checkpoints to keep, the newest (None: all). The folder must be one that every
    rank sees (on several machines: a shared filesystem).

    `blocking=False`: copy this rank's state to host memory, write it in a background thread (over a
    gloo group of its own, so training's collectives go on), and return a `PendingSave` at once; its
    `wait()` returns the path. The next `save` or `load` waits for it first."""
    _require_compiled(model, "save")
    wait_for_pending()
    rank, world = job.rank(), job.world_size()
    name = f"step-{int(step):08d}"
    final, partial = os.path.join(folder, name), os.path.join(folder, f".{name}.partial")
    started = time.perf_counter()

    def prepare() -> None:
        os.makedirs(folder, exist_ok=True)
        _hold_lock(folder)
        for stale in os.listdir(folder):  # what a save killed midway left behind
            if stale.endswith(".partial"):
                shutil.rmtree(os.path.join(folder, stale), ignore_errors=True)
        os.makedirs(partial)

    _on_rank0(prepare, f"cannot create checkpoint {partial!r}")
    copy = not blocking  # a background write must not read what the next steps change
    sd: dict[str, Any] = {"model": _model_pieces(model, copy)}
    per_element: list[str] = []
    if optimizer is not None:
        sd["optim"] = _optimizer_pieces(model, optimizer, copy)
        per_element = sorted({k for per in sd["optim"]["state"].values() for k, v in per.items() if _is_pieces(v)})
    sd[f"rng.rank{rank}"] = _rng_state()
    for key, value in (state or {}).items():
        sd[f"state.{key}"] = copy_module.deepcopy(value.state_dict() if _stateful(value) else value)

    def write(group: Any = None) -> None:
        try:
            dcp.save(sd, checkpoint_id=partial, planner=_SavePlanner(), process_group=group, no_dist=world == 1)
        except (Exception, CheckpointException) as e:  # DCP's own error is a BaseException
            if rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(
                f"fbmt.checkpoint.save: writing {final!r} failed ({_first_line(e)}); the earlier checkpoints "
                f"under {folder!r} are intact. Check free space and permissions of the folder"
            ) from e

    def finish(sums: dict[str, str]) -> None:
        _check_every_file_is_here(partial)
        sums = {**sums, **_checksums(partial, [".metadata"])}  # DCP's coordinator wrote it last
        write_json_atomic(
            dict(
                step=int(step),
                checksums=sums,  # CRC-32 of every file (NOTE: [Checkpoints that cannot be silently wrong])
                world_size=world,
                per_element=per_element,  # optimizer states with one value per parameter element
                optimizer=type(optimizer).__name__ if optimizer is not None else None,
                fbmt=_version(),
                saved=time.strftime("%Y-%m-%d %H:%M:%S"),
            ),
            os.path.join(partial, MARKER),
        )
        if os.path.exists(final):  # saving a step again: the old copy goes only once the new one is whole
            old = os.path.join(folder, f".{name}.old")
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        fsync_dir(folder)
        if keep is not None:
            for _, path in checkpoints(folder)[:-keep]:
                shutil.rmtree(path, ignore_errors=True)
        log.info("fbmt: saved %s in %.1fs", final, time.perf_counter() - started)

    if not blocking:
        group = _background_group()

        def background() -> None:
            write(group)  # returns on every rank only once every rank's files are written
            sums = _gather_checksums(partial, rank, group)
            if rank == 0:
                finish(sums)

        _pending.append(PendingSave(final, background))
        return _pending[-1]
    try:
        write()
    finally:
        if world > 1:
            dist.barrier()  # rank 0 removed the partial folder before anyone goes on
    sums = _gather_checksums(partial, rank, None)
    _on_rank0(lambda: finish(sums), f"cannot complete checkpoint {final!r}")
    return final


class PendingSave:
    """A checkpoint `save(blocking=False)` is writing; `wait()` returns its path or raises its error.

    Rank 0 completes the checkpoint (writes its marker), so an error in that last step is raised by
    rank 0's `wait()` only."""

    def __init__(self, path: str, work: Any):
        self.path, self._error = path, None
        self._thread = threading.Thread(target=self._run, args=(work,), name="fbmt-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, work: Any) -> None:
        try:
            work()
        except BaseException as e:  # handed to wait()
            self._error = e

    def done(self) -> bool:
        """Has the write ended (finished or failed)."""
        return not self._thread.is_alive()

    def wait(self) -> str:
        """Block until the checkpoint is written; its path, or the error that stopped it."""
        self._thread.join()
        if self in _pending:
            _pending.remove(self)
        if self._error is not None:
            raise self._error
        return self.path


_pending: list[PendingSave] = []
_group: list[Any] = []


@atexit.register
def _report_failed_saves_at_exit() -> None:
    """A `save(blocking=False)` whose write failed and that nobody waited for would be lost without a
    word, and the process exit 0. Python joins the writing thread before it runs this; a failure is
    then said on this rank's stderr, and the process exits with 1."""
    failed = [p for p in _pending if p.done() and p._error is not None]
    for p in failed:
        print(f"fbmt.checkpoint: a background save was never waited for, and failed: {p._error}", file=sys.stderr)
    if failed:
        sys.stdout.flush()
        os._exit(1)


def wait_for_pending() -> None:
    """Wait for a `save(blocking=False)` still writing (raises its error, if it failed)."""
    while _pending:
        _pending[0].wait()


def _background_group() -> Any:
    """A gloo group for background writes' collectives, made once (a collective itself)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    if not _group:
        _group.append(dist.new_group(backend="gloo"))
    return _group[0]


# ---- loading ----


def load(
    path: str,
    *,
    model: CompiledModule,
    optimizer: torch.optim.Optimizer | None = None,
    state: dict[str, Any] | None = None,
    strict: bool = True,
) -> Resumed | None:
    """Restore a checkpoint `save` wrote (a collective: every rank calls it with the same arguments).

    `path`: a checkpoint (`.../step-00000100`), or a folder of them, whose newest complete one is
    loaded; None when the folder holds none (a fresh start). The checkpoint may come from any number
    of ranks; the RNG states are restored only from the same number. `strict`, as torch's
    `load_state_dict`: the checkpoint's model tensors and the model's must be the same names (False:
    load those both have); a tensor of another shape is always an error, naming it."""
    _require_compiled(model, "load")
    wait_for_pending()
    candidates = _on_rank0(lambda: _resolve(path), "")  # newest first
    if not candidates:
        return None
    chosen, damaged = None, []
    for candidate in candidates:
        problem = _verify(candidate)
        if problem is None:
            chosen = candidate
            break
        if len(candidates) == 1 and candidate == os.path.normpath(path):
            raise CheckpointError(f"fbmt.checkpoint.load: {candidate!r} is damaged: {problem}")
        damaged.append(f"{candidate}: {problem}")
        if job.rank() == 0:
            log.warning("fbmt: %s is damaged (%s); trying the one before it", candidate, problem)
    if chosen is None:
        raise CheckpointError(
            f"fbmt.checkpoint.load: every complete checkpoint under {path!r} is damaged ({'; '.join(damaged)}); "
            "nothing was loaded. Restore the files, or start afresh in another folder"
        )
    if damaged and job.rank() == 0:
        log.warning("fbmt: loading %s, the newest checkpoint under %s that verifies", chosen, path)
    marker = _on_rank0(lambda: _read_marker(chosen), "")
    rank, world = job.rank(), job.world_size()
    reader = dcp.FileSystemReader(chosen)
    saved = reader.read_metadata().state_dict_metadata
    sd: dict[str, Any] = {"model": _model_destination(model, saved, chosen, strict)}
    restore_optim = None
    if optimizer is not None:
        if not any(k.startswith("optim.") for k in saved):
            raise CheckpointError(f"fbmt.checkpoint.load: {chosen!r} holds no optimizer state; pass optimizer=None")
        kind = marker.get("optimizer")
        if kind is not None and kind != type(optimizer).__name__:
            raise CheckpointError(
                f"fbmt.checkpoint.load: {chosen!r} holds the state of a {kind}, and this optimizer is a "
                f"{type(optimizer).__name__}: build the optimizer the saved run built, or load the model "
                "alone (optimizer=None) and start the optimizer afresh"
            )
        sd["optim"], restore_optim = _optimizer_destination(model, optimizer, saved, marker.get("per_element", []))
    same_world = marker["world_size"] == world
    if same_world:
        sd[f"rng.rank{rank}"] = _rng_state()  # the same structure: DCP loads into it
    elif rank == 0:
        log.warning(
            "fbmt: %s was saved on %d ranks and this job has %d: resharded; random number streams start afresh",
            chosen,
            marker["world_size"],
            world,
        )
    for key, value in (state or {}).items():
        if f"state.{key}" not in saved and not any(s.startswith(f"state.{key}.") for s in saved):
            raise CheckpointError(f"fbmt.checkpoint.load: {chosen!r} holds no state {key!r} (it has {_states(saved)})")
        sd[f"state.{key}"] = value.state_dict() if _stateful(value) else value  # the structure to load into
    try:
        dcp.load(sd, checkpoint_id=chosen, planner=_LoadPlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:
        raise CheckpointError(
            f"fbmt.checkpoint.load: cannot load {chosen!r} into this {type(model.compiled_from).__name__}: "
            f"{_first_line(e)}. Is it a checkpoint of this model (same parameter names and shapes)?"
        ) from e
    if restore_optim is not None:
        restore_optim(sd["optim"])
    if same_world:
        _set_rng_state(sd[f"rng.rank{rank}"])
    values = {}
    for key, value in (state or {}).items():
        if _stateful(value):
            value.load_state_dict(sd[f"state.{key}"])
            values[key] = value
        else:
            values[key] = sd[f"state.{key}"]
    log.info("fbmt: resumed from %s (step %d)", chosen, marker["step"])
    return Resumed(step=marker["step"], path=chosen, world_size=marker["world_size"], state=values)


def _resolve(path: str) -> list[str]:
    """The checkpoints `load(path)` may load, newest first: `path` itself, or the complete ones under it."""
    if os.path.isfile(os.path.join(path, MARKER)):
        return [os.path.normpath(path)]
    if _NAME.match(os.path.basename(os.path.normpath(path))):
        raise CheckpointError(
            f"fbmt.checkpoint.load: {path!r} is incomplete (it has no {MARKER}: its save did not finish) "
            f"or missing; complete checkpoints beside it: {[p for _, p in checkpoints(os.path.dirname(path))]}"
        )
    if os.path.isfile(path):
        raise CheckpointError(
            f"fbmt.checkpoint.load: {path!r} is a file; fbmt.checkpoint reads the folders fbmt.checkpoint.save "
            "writes (for a single torch.save file, use model.load_state_dict(torch.load(path)) or fbmt.load)"
        )
    found = [p for _, p in reversed(checkpoints(path))]
    if not found and os.path.isdir(path):
        incomplete = sorted(n for n in os.listdir(path) if _NAME.match(n))
        if incomplete:
            log.warning(
                "fbmt: %s holds only incomplete checkpoints %s (no %s): starting afresh", path, incomplete, MARKER
            )
    return found


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _checksums(folder: str, names: list[str]) -> dict[str, str]:
    return {n: _crc32(os.path.join(folder, n)) for n in names if os.path.isfile(os.path.join(folder, n))}


def _gather_checksums(folder: str, rank: int, group: Any) -> dict[str, str]:
    """Every rank's CRC-32s of the data files it wrote (`__<rank>_*`), on rank 0 (a collective)."""
    mine = _checksums(folder, sorted(n for n in os.listdir(folder) if n.startswith(f"__{rank}_")))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine, group=group)
    return {k: v for sums in every for k, v in sums.items()}


def _verify(path: str) -> str | None:
    """What is wrong with checkpoint `path`'s files, or None (a collective: the ranks share the files)."""
    rank, world = job.rank(), job.world_size()
    problem = None
    try:
        sums = _read_marker(path).get("checksums")
        if sums is None:  # written before fbmt kept checksums: DCP's metadata must read at least
            dcp.FileSystemReader(path).read_metadata()
        else:
            for i, (name, want) in enumerate(sorted(sums.items())):
                if i % world != rank:
                    continue
                full = os.path.join(path, name)
                if not os.path.isfile(full):
                    problem = f"{name} is missing"
                    break
                if _crc32(full) != want:
                    problem = f"{name} is not the file that was saved (its checksum differs: truncated or changed)"
                    break
    except Exception as e:  # an unreadable marker or metadata
        problem = _first_line(e)
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem)
        problem = next((p for p in every if p is not None), None)
    return problem


def _hold_lock(folder: str) -> None:
    """Take this process's lock on `folder` (once; NOTE: [Checkpoints that cannot be silently wrong]), or
    raise naming the job that holds it."""
    key = os.path.abspath(folder)
    if key in _locks:
        return
    fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 256).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise CheckpointError(
            f"fbmt.checkpoint.save: another job is saving checkpoints into {folder!r} ({holder} holds its "
            f"{LOCK}); two jobs writing one folder would write over each other's checkpoints. Give this job "
            "another folder, or stop the other one"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}".encode())
    _locks[key] = fd


def _read_marker(path: str) -> dict[str, Any]:
    import json

    with open(os.path.join(path, MARKER)) as f:
        return json.load(f)


def _states(saved: dict[str, Any]) -> list[str]:
    return sorted({k.split(".")[1] for k in saved if k.startswith("state.")})


# ---- what a rank writes and reads ----


class _Pieces:
    """This rank's part of one parameter-shaped tensor, as boxes that view local storage (NOTE: [Pieces
    of flat shards])."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, boxes: list[tuple[tuple, tuple, torch.Tensor]]):
        self.shape, self.dtype, self.boxes = torch.Size(shape), dtype, boxes

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                    properties=TensorProperties.create_from_tensor(view),
                    size=self.shape,
                ),
            )
            for offsets, sizes, view in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in self.boxes]

    def find(self, offsets: Any) -> torch.Tensor:
        for o, _, view in self.boxes:
            if torch.Size(o) == torch.Size(offsets):
                return view
        raise KeyError(offsets)


def _boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple, tuple, int, int]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as boxes: (offsets, sizes, flat lo, flat hi)."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,) if shape else (), (hi - lo,) if shape else (), lo, hi)]
    inner = math.prod(shape[1:])

    def row(r: int, a: int, b: int) -> list[tuple[tuple, tuple, int, int]]:
        return [((r, *o), (1, *s), r * inner + x, r * inner + y) for o, s, x, y in _boxes(shape[1:], a, b)]

    first, last = lo // inner, (hi - 1) // inner
    if first == last:
        return row(first, lo - first * inner, hi - first * inner)
    out = []
    if lo % inner:
        out += row(first, lo % inner, inner)
        first += 1
    whole = hi // inner
    if whole > first:
        out.append(((first, *[0] * (len(shape) - 1)), (whole - first, *shape[1:]), first * inner, whole * inner))
    if hi % inner:
        out += row(whole, 0, hi % inner)
    return out


def _pieces(shape: tuple[int, ...], lo: int, local: torch.Tensor) -> _Pieces:
    """`local` holds elements [lo, lo + local.numel()) of a flattened tensor of `shape`."""
    flat = local.detach().reshape(-1)
    boxes = [(o, s, flat[a - lo : b - lo].view(s)) for o, s, a, b in _boxes(shape, lo, lo + flat.numel())]
    return _Pieces(shape, local.dtype, boxes)


@dataclass(frozen=True)
class _Part:
    """Elements [a, b) of a flat tensor hold elements [start, start + b - a) of `slot` (of `group`)."""

    group: Any
    slot: Any
    a: int
    b: int
    start: int

    def of(self, tensor: torch.Tensor, copy: bool = False) -> Any:
        if self.slot.numel == 0:  # nothing to shard: DCP keeps it as a (replicated) empty tensor
            return torch.empty(self.slot.shape, dtype=tensor.dtype)
        local = tensor.detach().reshape(-1)[self.a : self.b]
        return _pieces(self.slot.shape, self.start, local.to("cpu", copy=True) if copy else local)


def _parts(model: CompiledModule) -> dict[int, list[_Part]]:
    """id(shard or view) -> the slots it holds elements of, on this rank."""
    out: dict[int, list[_Part]] = {}
    for group, shard in zip(model.layout.groups, model.flat_params):
        base, parts = model.rank * group.shard_numel, []
        for s in group.slots:
            lo, hi = local_range(group, s, model.rank)
            parts.append(_Part(group, s, lo - base, max(lo, hi) - base, lo - s.offset))
        out[id(shard)] = parts
        for s, view in zip(group.slots, model.slot_views(group.index)):
            lo, hi = local_range(group, s, model.rank)
            out[id(view)] = [_Part(group, s, 0, max(lo, hi) - lo, lo - s.offset)]
    return out


def _model_pieces(model: CompiledModule, copy: bool = False) -> dict[str, Any]:
    parts = _parts(model)
    pieces = {part.slot.name: part.of(shard, copy) for shard in model.flat_params for part in parts[id(shard)]}
    out: dict[str, Any] = {}
    for k, v in model.compiled_from.state_dict(keep_vars=True).items():  # every name, tied ones too, in torch's order
        if k in model.layout.aliases:
            out[k] = pieces[model.layout.aliases[k]]
        else:
            out[k] = v.detach().to("cpu", copy=True) if copy else v.detach()
    return out


def _model_destination(model: CompiledModule, saved: dict[str, Any], chosen: str, strict: bool) -> dict[str, Any]:
    """What DCP loads the model into: the model's pieces, checked against the checkpoint's tensors first
    (names, and shapes), so that a checkpoint of another model is refused by its first difference."""
    mine = _model_pieces(model)
    theirs = {k[len("model.") :]: md for k, md in saved.items() if k.startswith("model.")}
    shapes = {k: tuple(v.shape) for k, v in model.compiled_from.state_dict(keep_vars=True).items()}
    for k, shape in shapes.items():
        md = theirs.get(k)
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != shape:
            raise CheckpointError(
                f"fbmt.checkpoint.load: {chosen!r} holds '{k}' of shape {tuple(md.size)}, and this "
                f"{type(model.compiled_from).__name__} has it of shape {shape}: is it a checkpoint of this model "
                "(the same sizes: layers, width, heads, vocabulary)?"
            )
    extra = [k for k in theirs if k not in shapes]
    missing = [k for k in shapes if k not in theirs]
    if strict and (extra or missing):
        said = []
        if extra:
            k = extra[0]
            size = tuple(theirs[k].size) if isinstance(theirs[k], TensorStorageMetadata) else "a value"
            said.append(f"it holds {len(extra)} tensor(s) this model lacks, the first '{k}' {size}")
        if missing:
            said.append(f"it lacks {len(missing)} the model has, the first '{missing[0]}' {shapes[missing[0]]}")
        raise CheckpointError(
            f"fbmt.checkpoint.load: {chosen!r} does not fit this {type(model.compiled_from).__name__}: "
            f"{'; '.join(said)}. Load a checkpoint of this model (the same layers and names), or pass "
            "strict=False to load the tensors both have"
        )
    return {k: v for k, v in mine.items() if k in theirs}


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _owners(model: CompiledModule, optimizer: torch.optim.Optimizer) -> list[list[_Part]]:
    shards_for_parameters(optimizer)  # built before compiling (NOTE: [Optimizers built before compiling])
    parts = _parts(model)
    owners = []
    for i, p in enumerate(_params(optimizer)):
        if id(p) not in parts:
            raise CheckpointError(
                f"fbmt.checkpoint: parameter #{i} of the {type(optimizer).__name__} (shape {tuple(p.shape)}) is "
                "not one of the model's; build the optimizer on model.parameters()"
            )
        owners.append(parts[id(p)])
    return owners


def _per_element(v: Any, p: torch.Tensor) -> bool:
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == p.numel()


def _optimizer_pieces(model: CompiledModule, optimizer: torch.optim.Optimizer, copy: bool = False) -> dict[str, Any]:
    """The optimizer's state as torch's `get_optimizer_state_dict` keys it: by parameter name."""
    owners, params = _owners(model, optimizer), _params(optimizer)
    sd = unmarked(optimizer.state_dict())  # keyed by name, for any rank (NOTE: [Another rank's optimizer state])
    state: dict[str, dict[str, Any]] = {}
    for index, entry in sd["state"].items():
        for part in owners[int(index)]:
            per = state.setdefault(part.slot.name, {})
            for k, v in entry.items():
                if _per_element(v, params[int(index)]):
                    per[k] = part.of(v, copy)
                else:  # "step": the same on every rank
                    per[k] = v.to("cpu", copy=True) if copy and isinstance(v, torch.Tensor) else v
    groups = []
    for g in sd["param_groups"]:
        names = [part.slot.name for i in g["params"] for part in owners[i]]
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    extra = {k: v for k, v in sd.items() if k not in ("state", "param_groups")}
    return {"state": state, "param_groups": groups, **({"extra": extra} if extra else {})}


def _optimizer_destination(
    model: CompiledModule, optimizer: torch.optim.Optimizer, saved: dict[str, Any], per_element: list[str]
) -> Any:
    """Tensors for DCP to load this rank's optimizer state into, and the function that hands it on."""
    owners = _owners(model, optimizer)
    params = _params(optimizer)
    keys: dict[str, list[str]] = {}
    for fqn in saved:
        if fqn.startswith("optim.state."):
            name, _, k = fqn[len("optim.state.") :].rpartition(".")
            keys.setdefault(name, []).append(k)
    state: dict[str, dict[str, Any]] = {}
    buffers: dict[int, dict[str, torch.Tensor]] = {}  # per optimizer parameter: its per-element states
    for i, parts in enumerate(owners):
        for part in parts:
            per = state.setdefault(part.slot.name, {})
            for k in keys.get(part.slot.name, []):
                md = saved[f"optim.state.{part.slot.name}.{k}"]
                if not isinstance(md, TensorStorageMetadata):
                    per[k] = None  # bytes: DCP puts the saved value here
                elif tuple(md.size) == part.slot.shape and (part.slot.shape or k in per_element):
                    mine = buffers.setdefault(i, {})
                    if k not in mine:
                        mine[k] = torch.zeros(params[i].numel(), dtype=md.properties.dtype, device=params[i].device)
                    per[k] = part.of(mine[k])
                else:
                    per[k] = torch.empty(md.size, dtype=md.properties.dtype)
    mine = unmarked(optimizer.state_dict())
    groups = [{**g, "params": []} for g in mine["param_groups"]]  # the structure to load into
    extra = {k: v for k, v in mine.items() if k not in ("state", "param_groups")}
    dest = {"state": state, "param_groups": groups, **({"extra": extra} if extra else {})}

    def restore(loaded: dict[str, Any]) -> None:
        torch_state: dict[int, dict[str, Any]] = {}
        for i, parts in enumerate(owners):
            entry: dict[str, Any] = {}
            for part in parts:
                for k, v in loaded["state"].get(part.slot.name, {}).items():
                    if k in buffers.get(i, {}):
                        entry[k] = buffers[i][k]
                    elif k not in entry:
                        entry[k] = v
            if entry:
                torch_state[i] = entry
        groups = loaded["param_groups"]
        mine = optimizer.state_dict()["param_groups"]
        if len(groups) != len(mine):
            raise CheckpointError(
                f"fbmt.checkpoint.load: the checkpoint's optimizer has {len(groups)} parameter groups, this "
                f"{type(optimizer).__name__} {len(mine)}; build the optimizer as the saved run did"
            )
        torch_groups = []
        for saved_g, g in zip(groups, mine):
            want = [part.slot.name for i in g["params"] for part in owners[i]]
            if sorted(saved_g["params"]) != sorted(want):
                only_saved = sorted(set(saved_g["params"]) - set(want))
                only_mine = sorted(set(want) - set(saved_g["params"]))
                said = [f"'{only_saved[0]}' only in the checkpoint's"] if only_saved else []
                said += [f"'{only_mine[0]}' only in this optimizer's"] if only_mine else []
                raise CheckpointError(
                    f"fbmt.checkpoint.load: the optimizer's parameter group {len(torch_groups)} holds other "
                    f"parameters than the checkpoint's ({', '.join(said) or 'the same names, in other groups'}); "
                    "build the optimizer's parameter groups as the saved run did"
                )
            torch_groups.append({**{k: v for k, v in saved_g.items() if k != "params"}, "params": g["params"]})
        optimizer.load_state_dict({"state": torch_state, "param_groups": torch_groups, **(loaded.get("extra") or {})})

    return dest, restore


# ---- random number streams ----


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np

        out["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return out


def _set_rng_state(saved: dict[str, Any]) -> None:
    torch.set_rng_state(saved["torch"])
    random.setstate(saved["python"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])
    if "numpy" in saved:
        import numpy as np

        np.random.set_state(saved["numpy"])


# ---- DCP's planners, taught where the pieces live ----


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        return obj.find(index.offset) if isinstance(obj, _Pieces) else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def set_up_planner(self, state_dict: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        # DCP's set-up rebuilds the state dict and drops values it does not know: hide the pieces
        pieces: dict[tuple[str, ...], _Pieces] = {}

        def hide(d: dict[str, Any], path: tuple[str, ...]) -> None:
            for k, v in d.items():
                if isinstance(v, _Pieces):
                    pieces[(*path, k)], d[k] = v, "fbmt:pieces"
                elif isinstance(v, dict):
                    hide(v, (*path, k))

        hide(state_dict, ())
        super().set_up_planner(state_dict, *args, **kwargs)
        for path, v in pieces.items():
            d = self.original_state_dict
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = v
            self.state_dict[".".join(path)] = v

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.find(index.offset) if isinstance(obj, _Pieces) else super().lookup_tensor(index)


# ---- helpers ----


def _is_pieces(value: Any) -> bool:
    return isinstance(value, _Pieces)


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _require_compiled(model: Any, what: str) -> None:
    if not isinstance(model, CompiledModule):
        raise TypeError(
            f"fbmt.checkpoint.{what}(model=...): expected the module fbmt.compile returned, got "
            f"{type(model).__name__} (for a BMTrain model, use fbmt.save / fbmt.load)"
        )


def _on_rank0(fn: Any, what: str) -> Any:
    """Run `fn` on rank 0; every rank returns its result, or raises if it raised there."""
    result: list[Any] = [None, None]
    if job.rank() == 0:
        try:
            result = [fn(), None]
        except Exception as e:
            result = [None, e if isinstance(e, CheckpointError) else f"{what}: {_first_line(e)}"]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    value, error = result
    if isinstance(error, BaseException):
        raise error
    if error is not None:
        raise CheckpointError(f"fbmt.checkpoint: {error} (on rank 0)")
    return value


def _check_every_file_is_here(path: str) -> None:
    """Every rank's data file is in rank 0's folder: otherwise the ranks do not share it."""
    meta = dcp.FileSystemReader(path).read_metadata()
    files = {info.relative_path for info in (meta.storage_data or {}).values()}
    missing = sorted(f for f in files if not os.path.exists(os.path.join(path, f)))
    if missing:
        raise CheckpointError(
            f"fbmt.checkpoint.save: {missing} written by other ranks are not in rank 0's {path!r}; the "
            "checkpoint folder must be on a filesystem every rank shares"
        )


def _first_line(e: BaseException) -> str:
    if isinstance(e, CheckpointException):  # one line per failed rank, without the tracebacks
        return "; ".join(f"rank {r}: {_first_line(exc)}" for r, (exc, _) in sorted(e.failures.items()))
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fbmt")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
