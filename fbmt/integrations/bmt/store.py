"""BMTrain's `save`/`load`: one file of a model's full state dict, written by rank 0, read by every
rank into its own part."""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt import job
from fbmt.compiler import CompiledModule
from fbmt.files import describe_unreadable, save_atomic
from fbmt.integrations.bmt.module import DistributedModule, gathering, is_lowered, lower


def save(model: nn.Module, file_name: str, non_blocking: bool = False) -> None:
    """BMTrain's `save`: one `torch.save` file of the model's state dict, with full tensors under the
    unwrapped names (a plain `nn.Module` with the same structure loads it). A collective: every rank
    calls it; rank 0 gathers to its CPU and writes atomically; the others hold nothing."""
    with gathering(rank0_cpu=True):
        state = model.state_dict()
    failure: list[Any] = [None]
    if job.rank() == 0:
        try:
            save_atomic(OrderedDict((k, v.detach().cpu()) for k, v in state.items()), file_name)
        except Exception as e:  # every rank learns it: a save that failed on rank 0 failed
            failure = [f"{type(e).__name__}: {e}"]
            error = e
    del state
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(failure, src=0)  # also: the file exists for every rank once save returns
    if failure[0] is not None:
        if job.rank() == 0:
            raise error
        raise RuntimeError(f"fbmt.save: rank 0 could not write {file_name!r} ({failure[0]}); the file is unchanged")


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
        try:
            state = torch.load(file_name, map_location="cpu", mmap=True, weights_only=True)
        except RuntimeError as e:
            if "mmap" not in str(e):  # legacy (pre-zipfile) files cannot be memory-mapped
                raise
            state = torch.load(file_name, map_location="cpu", weights_only=True)
    except Exception as e:
        raise RuntimeError(f"fbmt.load: {describe_unreadable(file_name, e)}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise RuntimeError(
            f"fbmt.load: {file_name!r} holds a {type(state).__name__}, not a state dict of tensors "
            "(fbmt.save, torch.save(model.state_dict()))"
        )
    return state


def _on_every_rank(flag: bool) -> list[bool]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [flag]
    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return flags


def _load_broadcast(model: nn.Module, file_name: str, strict: bool, chunk_bytes: int = 256 << 20) -> Any:
    """Rank 0 reads; every rank receives the tensors chunk by chunk and loads each chunk."""
    state: dict[str, torch.Tensor] = {}
    meta: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            state = _read(file_name)
            meta = [[(k, tuple(v.shape), v.dtype) for k, v in state.items()]]
        except RuntimeError as e:
            meta = [str(e)]  # the other ranks would wait for tensors that never come
    dist.broadcast_object_list(meta, src=0)
    if isinstance(meta[0], str):
        raise RuntimeError(meta[0] + (" (read on rank 0)" if dist.get_rank() else ""))
    device = job.local_device()
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
    """Where each key of `model`'s state dict lives; a compiled model's keys are the model's it compiled."""
    model = model.compiled_from if isinstance(model, CompiledModule) else model
    return [(f"{name}." if name else "", m) for name, m in model.named_modules(remove_duplicate=False)]
