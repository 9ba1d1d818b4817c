"""BMTrain's `save`/`load`: one file of a model's full state dict, written by rank 0, read by every
rank into its own part."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt import distributed
from fbmt.bmt.module import DistributedModule, gathering, is_lowered, lower
from fbmt.files import save_atomic


def save(model: nn.Module, file_name: str, non_blocking: bool = False) -> None:
    """BMTrain's `save`: one `torch.save` file of the model's state dict, with full tensors under the
    unwrapped names (a plain `nn.Module` with the same structure loads it). A collective: every rank
    calls it; rank 0 gathers to its CPU and writes atomically; the others hold nothing."""
    with gathering(rank0_cpu=True):
        state = model.state_dict()
    if distributed.rank() == 0:
        save_atomic(OrderedDict((k, v.detach().cpu()) for k, v in state.items()), file_name)
    del state
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # the file exists for every rank once save returns


def load(model: nn.Module, file_name: str, strict: bool = True) -> Any:
    """BMTrain's `load`: read a file written by `save` (or by BMTrain, or `torch.save(state_dict)`);
    every rank keeps only its part. Returns the missing/unexpected keys, as `load_state_dict` does.

    Where every rank sees the file (a shared filesystem), each memory-maps it and reads only the
    pages holding its part. Where only rank 0 does (a multi-node job with the checkpoint on node 0's
    disk), rank 0 reads it and broadcasts it tensor by tensor, in chunks, so no rank ever holds the
    whole state. A collective: every rank calls it with the same arguments."""
    seen = _on_every_rank(os.path.exists(file_name))
    if not seen[0]:
        raise FileNotFoundError(
            f"fbmt.load: no checkpoint at {file_name!r} (rank 0 must be able to read it; "
            f"ranks that see it: {[r for r, ok in enumerate(seen) if ok]})"
        )
    if isinstance(model, DistributedModule) and not is_lowered(model):
        lower(model)
    if all(seen):
        return model.load_state_dict(_read(file_name), strict=strict)
    return _load_broadcast(model, file_name, strict)


def _read(file_name: str) -> dict[str, torch.Tensor]:
    try:
        return torch.load(file_name, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # legacy (pre-zipfile) files cannot be memory-mapped
            raise
        return torch.load(file_name, map_location="cpu", weights_only=True)


def _on_every_rank(flag: bool) -> list[bool]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [flag]
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return flags


def _load_broadcast(model: nn.Module, file_name: str, strict: bool, chunk_bytes: int = 256 << 20) -> Any:
    """Rank 0 reads; every rank receives the tensors chunk by chunk and loads each chunk."""
    state = _read(file_name) if dist.get_rank() == 0 else {}
    meta = [[(k, tuple(v.shape), v.dtype) for k, v in state.items()]]
    dist.broadcast_object_list(meta, src=0)
    device = distributed.local_device()
    loaded: list[str] = []
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for key, shape, dtype in meta[0]:
        t = state[key].to(device) if dist.get_rank() == 0 else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0)
        chunk[key] = t
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            model.load_state_dict(chunk, strict=False)
            loaded += list(chunk)
            chunk, size = {}, 0
    model.load_state_dict(chunk, strict=False)
    loaded += list(chunk)
    expected = [
        prefix + name
        for prefix, m in _prefixed_modules(model)
        for name, t in [*m._parameters.items(), *m._buffers.items()]
        if t is not None and name not in m._non_persistent_buffers_set
    ]
    missing = [k for k in expected if k not in set(loaded)]
    unexpected = [k for k in loaded if k not in set(expected)]
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error(s) in loading state_dict for {type(model).__name__}: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def _prefixed_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(f"{name}." if name else "", m) for name, m in model.named_modules(remove_duplicate=False)]
