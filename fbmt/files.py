"""Files written atomically: a crash mid-write never leaves a truncated file behind.

(Sharded checkpoints are in `fbmt/checkpoint.py`; BMTrain's `save`/`load` of a model's full state
dict in `fbmt/bmt/store.py`.)"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import torch


def save_atomic(obj: Any, path: str) -> None:
    """`torch.save(obj, path)` through a temporary file in the same folder, fsync'ed, then renamed.

    A reader sees either the previous file or the complete new one, never a partial write.
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(obj: Any, path: str) -> None:
    """`obj` as JSON at `path`, through a temporary file, fsync'ed, renamed, the folder fsync'ed."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


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
