"""Files written atomically: a crash mid-write never leaves a truncated file behind.

(Sharded checkpoints are in `fbmt/checkpoint.py`; BMTrain's `save`/`load` of a model's full state
dict in `fbmt/integrations/bmt/store.py`.)"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from typing import Any

import torch


def save_atomic(obj: Any, path: str) -> None:
    """`torch.save(obj, path)` through a temporary file in the same folder, fsync'ed, then renamed.

    A reader sees either the previous file or the complete new one, never a partial write. The file
    gets the usual permissions (0666 less the umask, as `open` gives), and temporaries that killed
    writers on this machine left behind are removed.
    """
    _write_atomic(path, ".pt", "wb", lambda f: torch.save(obj, f))


def _write_atomic(path: str, suffix: str, mode: str, write: Any) -> None:
    """`write(file)` into a temporary beside `path`, flushed, fsync'ed, renamed over `path`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    _remove_orphans(folder)
    fd, tmp = tempfile.mkstemp(prefix=_tmp_prefix(), suffix=suffix, dir=folder)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp's 0600 would hide a checkpoint from its group
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def _tmp_prefix() -> str:
    """A temporary's name says who writes it, so a later save can tell a dead writer's leftover from a
    live writer's file: .tmp-<host>-<pid>-<random>.pt (the pid of now: a forked child is not its parent)."""
    return f".tmp-{socket.gethostname()}-{os.getpid()}-"


def _remove_orphans(folder: str) -> None:
    host = f".tmp-{socket.gethostname()}-"
    for name in os.listdir(folder):
        if not name.startswith(host):
            continue
        pid = name[len(host) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def describe_unreadable(path: str, e: BaseException) -> str:
    """Why `torch.load(path)` failed, in words a user can act on."""
    size = os.path.getsize(path) if os.path.exists(path) else None
    if size == 0:
        return f"{path!r} is empty (0 bytes): a save that never finished, or a full disk"
    if "Unsupported global" in str(e):  # the weights-only unpickler met a class
        return (
            f"{path!r} holds Python objects besides tensors; fbmt.load reads state dicts (fbmt.save, "
            "torch.save(model.state_dict()))"
        )
    first = (str(e).strip().splitlines() or [""])[0]
    return (
        f"{path!r} ({size} bytes) is not a checkpoint torch can read ({type(e).__name__}: {first[:200]}); "
        "it may be truncated or another kind of file"
    )


def write_json_atomic(obj: Any, path: str) -> None:
    """`obj` as JSON at `path`, through a temporary file, fsync'ed, renamed, the folder fsync'ed."""
    _write_atomic(path, ".json", "w", lambda f: json.dump(obj, f, indent=1))


def fsync_dir(folder: str) -> None:
    """Make a rename or a new file in `folder` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
