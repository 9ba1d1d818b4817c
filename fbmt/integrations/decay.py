"""A weight-decay split by parameter name, kept inside flat shards.

NOTE: [Decay split inside flat shards]
Hugging Face's Trainer, with `weight_decay > 0` (as fine-tuning recipes set it), decays every parameter
but biases and norm weights: it puts them in two parameter groups by name. A compiled model's parameters
are its flat shards, and one shard holds a block's matrices and its norms together, so no split of the
shards is that split of the parameters. Where Trainer builds its optimizer on a compiled model
(`create_optimizer`, wrapped in integrations/trainer.py), its own rule (`get_decay_parameter_names`, a
subclass's too) is read on the model's names (`by_shards`): a shard whose parameters the rule decays
wholly goes to the decayed group, any other to the weight_decay=0 group, and this rank's elements of the
decayed parameters of such a shard are remembered (`decay_within`). Before each step of that optimizer
they are decayed as the decayed group decays (its lr and weight_decay at that step): decoupled decay
multiplies the parameter before the update, which reads only the gradient and the moments, so decaying
first is the same step. An L2 penalty (SGD, torch's Adam) joins the gradient inside the step instead:
it is refused, saying what to use. A step a fused optimizer is told to skip (GradScaler's `found_inf`)
decays nothing. An optimizer built before compiling keeps its split the same way (NOTE: [Optimizers built
before compiling] in adopt.py); a split a script writes over the compiled model's `named_parameters()`
sees only shards and stays refused (torch_guards).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from fbmt.compiler import CompiledModule, group_of, local_range


@dataclass
class Decayed:
    """Elements of `shard` (this rank's) that `like`, the decayed group, would decay."""

    shard: torch.Tensor
    ranges: list[tuple[int, int]]  # [lo, hi) within the shard
    names: list[str]  # the decayed parameters among the shard's, for errors
    like: int  # the index of the decayed group (a loaded state dict replaces the groups' dicts)


_within: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> [Decayed]


def by_shards(model: CompiledModule, decayed: Iterable[str]) -> tuple[list[str], dict[str, list[tuple[str, int, int]]]]:
    """For a rule that decays the parameters named `decayed` (the model's names): the names of the shards
    it decays wholly (`model.named_parameters()`'s), and for every other shard holding a decayed parameter,
    this rank's elements of each (name, start, end)."""
    decayed = set(decayed)
    whole: list[str] = []
    partly: dict[str, list[tuple[str, int, int]]] = {}
    for name, shard in model.named_parameters():
        group = group_of(shard)
        if group is None:
            continue
        hit = [s for s in group.slots if s.name in decayed]
        if len(hit) == len(group.slots):
            whole.append(name)
        elif hit:
            base = model.rank * group.shard_numel  # where this rank's shard starts in the flat buffer
            spans = [(s.name, *local_range(group, s, model.rank)) for s in hit]
            partly[name] = [(n, lo - base, hi - base) for n, lo, hi in spans]
    return whole, partly


def decay_within(
    optimizer: torch.optim.Optimizer, model: CompiledModule, partly: dict[str, list[tuple[str, int, int]]], like: int
) -> None:
    """`optimizer`'s groups follow a decay split by name: before each of its steps, decay the elements
    `by_shards` named as its group of index `like` decays."""
    shards = dict(model.named_parameters())
    keep_decayed(
        optimizer,
        [
            Decayed(shards[n], [(a, b) for _, a, b in spans if a < b], [s for s, _, _ in spans], like)
            for n, spans in partly.items()
        ],
    )


def keep_decayed(optimizer: torch.optim.Optimizer, decayed: list[Decayed]) -> None:
    """Before each of `optimizer`'s steps, decay `decayed` as their groups decay (an L2 penalty refused)."""
    if decayed and not _decoupled(optimizer):
        d = decayed[0]
        raise RuntimeError(
            f"fbmt: {type(optimizer).__name__} adds weight decay to the gradient (an L2 penalty), and flat shard "
            f"'{group_of(d.shard).name}' of the compiled model holds parameters the decay split decays "
            f"({d.names[:2]}) beside ones it leaves out: fbmt keeps them apart inside a shard for decoupled decay "
            "only. Use torch's AdamW (Trainer's optim='adamw_torch_fused' or 'adamw_torch'), or weight_decay=0"
        )
    _within[optimizer] = [*_within.get(optimizer, []), *decayed]


def before_step(optimizer: torch.optim.Optimizer, kwargs: dict[str, Any]) -> None:
    """Decay what `decay_within` remembered for `optimizer`, unless this step is skipped."""
    within = _within.get(optimizer)
    if not within:
        return
    found_inf = kwargs.get("found_inf")
    if found_inf is not None and float(found_inf) != 0:
        return  # the fused step skips itself: GradScaler found inf/nan
    hosts = {p: g for g in optimizer.param_groups for p in g["params"]}
    views: dict[float, list[torch.Tensor]] = {}
    for w in within:
        host = hosts.get(w.shard)
        if host is None:
            continue  # taken out of the optimizer since
        like = optimizer.param_groups[w.like]
        lr, wd = float(like["lr"]), float(like["weight_decay"])
        if float(host["lr"]) != lr:
            raise RuntimeError(
                f"fbmt: the learning rate of the group that holds flat shard '{group_of(w.shard).name}' ({host['lr']}) "
                f"differs from the decayed group's ({like['lr']}), which decays its parameters {w.names[:2]}: "
                "inside one shard they step with one learning rate. Keep the groups' learning rates equal"
            )
        if wd:
            flat = w.shard.detach()
            views.setdefault(1 - lr * wd, []).extend(flat[a:b] for a, b in w.ranges)
    with torch.no_grad():
        for factor, vs in views.items():
            torch._foreach_mul_(vs, factor)


def holds_split(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer`'s decay split by name is kept inside its shards (its groups' split is not
    what decides)."""
    return optimizer in _within


def _decoupled(optimizer: torch.optim.Optimizer) -> bool:
    """torch's decoupled decay, applied before the update from the group's lr. fbmt's own Adams decay an
    fp32 master of a low-precision shard and hold or skip steps of their own: not these."""
    if type(optimizer).__module__.startswith("fbmt."):
        return False
    return isinstance(optimizer, torch.optim.AdamW) or all(
        g.get("decoupled_weight_decay", False) for g in optimizer.param_groups
    )
