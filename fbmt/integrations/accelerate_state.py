"""accelerate's `save_state` and `load_state` of a compiled model on several ranks.

NOTE: [accelerate's checkpoints]
`Accelerator.save_state` writes each optimizer's state on the main process alone and `load_state`
gives that file to every rank, as if every rank's optimizer held the same state. A compiled model's
optimizer holds this rank's flat shards' moments: every rank but 0 resumed with rank 0's, which the
first step refuses (NOTE: [Another rank's optimizer state]), after the run that saved had ended. So
the two functions `Accelerator` calls are wrapped where an optimizer holds a compiled model's shards
on several ranks (elsewhere they are accelerate's own): after accelerate's save every rank writes its
own state beside accelerate's file (`optimizer.fbmt-rank{r}-of-{w}.bin`, as for Trainer: NOTE:
[Trainer checkpoints]), and after accelerate's load each rank loads its own, where the folder has it
(resumed on another number of ranks, rank 0's stays, and the first step says so). The model's state
needs nothing: `save_state` reads it on every rank (a gather), and `load_state` loads the whole.
Installed by `fbmt.compile` where `accelerate.accelerator` is imported, else when it is.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fbmt.compiler import group_of
from fbmt.integrations import imports, trainer

_MODULE = "accelerate.accelerator"
_WRAPPED = ("save_accelerator_state", "load_accelerator_state")
_installed: set[Any] = set()


def install_when_imported() -> None:
    imports.after_import(_MODULE, install)


def install() -> None:
    module = sys.modules.get(_MODULE)
    if module is None or module in _installed:
        return
    missing = [name for name in _WRAPPED if not callable(getattr(module, name, None))]
    if missing:  # another accelerate: its save_state would keep rank 0's optimizer state alone
        raise RuntimeError(
            f"fbmt: accelerate.accelerator has no {missing}, through which fbmt saves and resumes each rank's "
            "optimizer state of a compiled model; use an accelerate release fbmt supports (1.x), or fbmt.checkpoint"
        )
    module.save_accelerator_state = _each_rank_saves(module.save_accelerator_state)
    module.load_accelerator_state = _each_rank_loads(module.load_accelerator_state)
    _installed.add(module)


def _own_files(optimizers: list, folder: str) -> list[tuple[Any, str]]:
    """Each optimizer that holds a compiled model's shards on several ranks, with this rank's file."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return []
    return [
        (opt, os.path.join(folder, trainer.rank_file("optimizer" if i == 0 else f"optimizer_{i}", ".bin")))
        for i, opt in enumerate(optimizers)
        if any(group_of(p) is not None for g in opt.param_groups for p in g["params"])
    ]


def _each_rank_saves(save: Callable) -> Callable:
    signature = inspect.signature(save)

    @functools.wraps(save)
    def save_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        out = save(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        for opt, path in _own_files(given["optimizers"], str(given["output_dir"])):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save(opt.state_dict(), path)
        return out

    return save_accelerator_state


def _each_rank_loads(load: Callable) -> Callable:
    signature = inspect.signature(load)

    @functools.wraps(load)
    def load_accelerator_state(*args: Any, **kwargs: Any) -> Any:
        out = load(*args, **kwargs)
        given = signature.bind(*args, **kwargs).arguments
        for opt, path in _own_files(given["optimizers"], str(given["input_dir"])):
            if os.path.isfile(path):
                device = next((p.device for g in opt.param_groups for p in g["params"]), "cpu")
                opt.load_state_dict(torch.load(path, map_location=device, weights_only=True))
        return out

    return load_accelerator_state
