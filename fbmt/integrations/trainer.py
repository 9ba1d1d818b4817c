"""Hugging Face Trainer's checkpoints of a compiled model on several ranks.

NOTE: [Trainer checkpoints]
Trainer saves a checkpoint every `save_steps` (500 by default) as if every rank held the whole model:
rank 0 alone reads `model.state_dict()` and `optimizer.state_dict()`, and every rank loads rank 0's
optimizer file to resume. A compiled model's state dict gathers each parameter from every rank's
shard, a collective, so rank 0 waited in it while the others trained on, until the timeout stopped the
job; and each rank's optimizer holds the state of its own shards, so a resume gave every rank rank 0's
(NOTE: [Another rank's optimizer state]). So three of Trainer's methods are wrapped where the model is
a compiled one on several ranks (elsewhere they are Trainer's own):
- `_save` (which Trainer calls on every rank) first reads the state dict on every rank, then hands it
  to Trainer's own `_save` on the rank that writes (which saves it with `save_pretrained`);
- `_save_optimizer_and_scheduler` also saves each rank's optimizer state beside Trainer's file
  (`optimizer.fbmt-rank{r}-of-{w}.pt`);
- `_load_optimizer_and_scheduler` then loads each rank its own, where the checkpoint has it (resumed on
  another number of ranks, rank 0's file loads and the first step refuses it, saying why).
They are installed where accelerate, under Trainer, first reads the compiled model (its
`_is_accelerate_prepared`), on the Trainer class already imported; never at import.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

_WRAPPED = ("_save", "_save_optimizer_and_scheduler", "_load_optimizer_and_scheduler")
_installed: set[type] = set()


def install() -> None:
    """Wrap Trainer's checkpoint methods, once, where transformers' Trainer has been imported."""
    module = sys.modules.get("transformers.trainer")
    trainer = getattr(module, "Trainer", None)
    if trainer is None or trainer in _installed:
        return
    missing = [name for name in _WRAPPED if not callable(getattr(trainer, name, None))]
    if missing:  # another transformers: say so rather than save a checkpoint that cannot resume
        raise RuntimeError(
            f"fbmt: transformers' Trainer has no {missing}, through which fbmt saves and resumes a compiled model's "
            "checkpoints on several ranks; use a transformers release fbmt supports (5.x), or save_strategy='no'"
        )
    trainer._save = _every_rank_reads_the_state(trainer._save)
    trainer._save_optimizer_and_scheduler = _each_rank_saves_its_optimizer(trainer._save_optimizer_and_scheduler)
    trainer._load_optimizer_and_scheduler = _each_rank_loads_its_optimizer(trainer._load_optimizer_and_scheduler)
    _installed.add(trainer)


def _sharded(model: Any) -> bool:
    """A compiled model on several ranks."""
    from fbmt.compiler import CompiledModule

    return isinstance(model, CompiledModule) and dist.is_initialized() and dist.get_world_size() > 1


def _rank_file() -> str:
    return f"optimizer.fbmt-rank{dist.get_rank()}-of-{dist.get_world_size()}.pt"


def _every_rank_reads_the_state(save: Callable) -> Callable:
    @functools.wraps(save)
    def _save(self: Any, output_dir: str | None = None, state_dict: dict | None = None) -> Any:
        if state_dict is None and _sharded(self.model):
            state_dict = self.model.state_dict()  # a collective: Trainer calls _save on every rank
            if not self.args.should_save:
                return None
        return save(self, output_dir, state_dict)

    return _save


def _each_rank_saves_its_optimizer(save: Callable) -> Callable:
    @functools.wraps(save)
    def _save_optimizer_and_scheduler(self: Any, output_dir: str) -> Any:
        out = save(self, output_dir)
        if _sharded(self.model) and self.optimizer is not None:
            os.makedirs(output_dir, exist_ok=True)
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, _rank_file()))
        return out

    return _save_optimizer_and_scheduler


def _each_rank_loads_its_optimizer(load: Callable) -> Callable:
    @functools.wraps(load)
    def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> Any:
        out = load(self, checkpoint)
        mine = os.path.join(checkpoint, _rank_file()) if checkpoint is not None and _sharded(self.model) else None
        if mine is not None and os.path.isfile(mine) and self.optimizer is not None:
            device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), "cpu")
            self.optimizer.load_state_dict(torch.load(mine, map_location=device, weights_only=True))
        return out

    return _load_optimizer_and_scheduler
