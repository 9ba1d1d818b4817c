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
`create_optimizer` is wrapped too, for a compiled model on any number of ranks: Trainer's split of weight
decay by name is kept inside the flat shards (NOTE: [Decay split inside flat shards] in decay.py).
They are installed on the Trainer class when `fbmt.compile` runs after transformers' trainer was
imported, or else when it is imported (`install_when_imported`); never by importing it.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fbmt.integrations import decay, imports

_WRAPPED = (
    "_save",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "create_optimizer",
    "get_decay_parameter_names",
)
_installed: set[type] = set()


def install_when_imported() -> None:
    """Install now where Trainer is imported, else when it is."""
    imports.after_import("transformers.trainer", install)


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
            "checkpoints on several ranks and keeps its weight-decay split inside flat shards; use a transformers "
            "release fbmt supports (5.x)"
        )
    trainer._save = _every_rank_reads_the_state(trainer._save)
    trainer._save_optimizer_and_scheduler = _each_rank_saves_its_optimizer(trainer._save_optimizer_and_scheduler)
    trainer._load_optimizer_and_scheduler = _each_rank_loads_its_optimizer(trainer._load_optimizer_and_scheduler)
    trainer.create_optimizer = _decay_split_inside_shards(trainer.create_optimizer)
    _installed.add(trainer)


def _sharded(model: Any) -> bool:
    """A compiled model on several ranks."""
    from fbmt.compiler import CompiledModule

    return isinstance(model, CompiledModule) and dist.is_initialized() and dist.get_world_size() > 1


def rank_file(stem: str = "optimizer", suffix: str = ".pt") -> str:
    """This rank's optimizer file beside a library's own, which rank 0 writes for every rank."""
    return f"{stem}.fbmt-rank{dist.get_rank()}-of-{dist.get_world_size()}{suffix}"


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
            torch.save(self.optimizer.state_dict(), os.path.join(output_dir, rank_file()))
        return out

    return _save_optimizer_and_scheduler


def _each_rank_loads_its_optimizer(load: Callable) -> Callable:
    @functools.wraps(load)
    def _load_optimizer_and_scheduler(self: Any, checkpoint: str | None) -> Any:
        out = load(self, checkpoint)
        mine = os.path.join(checkpoint, rank_file()) if checkpoint is not None and _sharded(self.model) else None
        if mine is not None and os.path.isfile(mine) and self.optimizer is not None:
            device = next((p.device for g in self.optimizer.param_groups for p in g["params"]), "cpu")
            self.optimizer.load_state_dict(torch.load(mine, map_location=device, weights_only=True))
        return out

    return _load_optimizer_and_scheduler


def _decay_split_inside_shards(create: Callable) -> Callable:
    """NOTE: [Decay split inside flat shards] in decay.py."""
    from fbmt.compiler import CompiledModule

    @functools.wraps(create)
    def create_optimizer(self: Any, model: Any = None) -> Any:
        opt_model = self.model if model is None else model
        if self.optimizer is not None or not isinstance(opt_model, CompiledModule):
            return create(self, model)
        whole, partly = decay.by_shards(opt_model, self.get_decay_parameter_names(opt_model._orig))
        self.get_decay_parameter_names = lambda _: whole  # this call's groups, of shards
        try:
            out = create(self, model)
        finally:
            del self.get_decay_parameter_names
        like = next(
            (i for i, g in enumerate(self.optimizer.param_groups) if g.get("weight_decay") == self.args.weight_decay),
            None,
        )
        if partly and self.args.weight_decay and like is None:
            raise RuntimeError(
                f"fbmt: Trainer's optimizer has no group of weight_decay={self.args.weight_decay}, which fbmt "
                "applies to the decayed parameters inside flat shards; build the optimizer yourself "
                "(Trainer(optimizers=(opt, None))) on model.parameters()"
            )
        decay.decay_within(self.optimizer, opt_model, partly if self.args.weight_decay else {}, like or 0)
        return out

    return create_optimizer
