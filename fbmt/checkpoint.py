"""Checkpoints: files written atomically (a crash mid-write never leaves a truncated file behind), and
BMTrain's `save`/`load` of a model's full state dict."""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt import distributed


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


def save(model: nn.Module, file_name: str, non_blocking: bool = False) -> None:
    """BMTrain's `save`: one `torch.save` file of the model's state dict, with full tensors under the
    unwrapped names (a plain `nn.Module` with the same structure loads it). A collective: every rank
    calls it; rank 0 gathers to its CPU and writes atomically; the others hold nothing."""
    from fbmt.modules.module import gathering

    with gathering(rank0_cpu=True):
        state = model.state_dict()
    if distributed.rank() == 0:
        save_atomic(OrderedDict((k, v.detach().cpu()) for k, v in state.items()), file_name)
    del state
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the file exists for every rank once save returns


def load(model: nn.Module, file_name: str, strict: bool = True) -> Any:
    """BMTrain's `load`: read a file written by `save` (or by BMTrain, or `torch.save(state_dict)`);
    every rank keeps only its part. The file is memory-mapped, so a rank reads only the pages
    holding its part. Returns the missing/unexpected keys, as `load_state_dict` does."""
    from fbmt.modules.module import DistributedModule, is_lowered, lower

    if not os.path.exists(file_name):
        raise FileNotFoundError(f"fbmt.load: no checkpoint at {file_name!r}")
    try:
        state = torch.load(file_name, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # legacy (pre-zipfile) files cannot be memory-mapped
            raise
        state = torch.load(file_name, map_location="cpu", weights_only=True)
    if isinstance(model, DistributedModule) and not is_lowered(model):
        lower(model)
    return model.load_state_dict(state, strict=strict)
