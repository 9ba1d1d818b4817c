"""Checkpoint files written atomically: a crash mid-write never leaves a truncated file behind.

(BMTrain's `save`/`load` of a model's full state dict are in `fbmt/bmt/store.py`.)"""

from __future__ import annotations

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
