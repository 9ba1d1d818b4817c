"""An optimizer built on the model before `fbmt.compile` steps the compiled model's flat shards.

NOTE: [Optimizers built before compiling]
`torch.compile` leaves a model's parameters where they are, so scripts build the optimizer before
compiling as often as after (nanoGPT: `configure_optimizers`, then `torch.compile`; a resumed run loads
the optimizer's state before it too). `fbmt.compile` replaces each parameter by a placeholder and keeps
its values in this rank's flat shards, so such an optimizer holds parameters nothing reads any more.
Where it is one of torch's elementwise optimizers, its groups are rewritten to hold the shards instead,
before the first of its step, `zero_grad`, `load_state_dict` of a state saved from shards, GradScaler's
`unscale_` or `fbmt.checkpoint` save or load that comes after compile:

- a shard steps as one, so every parameter it holds that trains must be in the optimizer: one left out
  is refused, naming it (freeze it before compiling instead);
- a shard whose parameters are all in one group takes the place of its first parameter there;
- a shard whose parameters are in groups that differ in weight decay alone (the split by name of HF
  Trainer and accelerate's examples, nanoGPT's by `p.dim()`: computed on the real parameters, so read
  correctly here) joins the group among them with weight_decay=0, and the others' parameters decay
  inside it as their groups decay (NOTE: [Decay split inside flat shards]); groups that differ in
  anything else (a learning rate per layer where two layers share a shard) are refused, naming the
  parameters and the setting;
- state the optimizer already holds (loaded before compiling, or from steps in eager) moves with it: each
  state tensor shaped like its parameter becomes this rank's elements of the shard, and a per-parameter
  count (`step`) must agree across the shard's parameters; a state of another shape is refused;
- a state saved from a compiled model's optimizer (of its shards: its groups say whose it is, NOTE:
  [Another rank's optimizer state]) and loaded before compiling, as nanoGPT resumes, does not fit groups
  of parameters, and torch's `load_state_dict` would refuse it: it is kept (`keep_for_shards`; the
  optimizer's `state_dict()` gives it back meanwhile) and loaded once the groups hold the shards. An
  optimizer that steps while it still waits (its model was never compiled) is refused, as it would step
  without the state it was given.

Every refusal is made before anything changes, and alike on every rank (a rank that holds none of a
parameter refuses what the others refuse), so ranks never part over it.

torch's optimizers keep nothing of a parameter beyond `param_groups` and `state` until they step, which
is what makes the rewrite complete; another optimizer class (fbmt's own, which copy parameters when
built; bitsandbytes'; apex's) is left alone and refused at its first step, saying to build it after
compiling.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Any

import torch

from fbmt.compiler import Moved, group_of, moved_into, replaced
from fbmt.integrations import decay

# torch's optimizers that update each element from its own gradient and state (NOTE: [Optimizers of
# flat shards] in torch_guards.py)
_ELEMENTWISE = frozenset(
    ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop", "ASGD", "Rprop")
)
_DECAY_ONLY = frozenset(("params", "param_names", "weight_decay"))  # what groups sharing a shard may differ in
_looked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> (parameters, replaced()) looked at


def shards_for_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Rewrite `optimizer`'s groups to hold flat shards where they hold parameters `fbmt.compile`
    replaced (NOTE: [Optimizers built before compiling]); nothing where they hold none or where the
    optimizer is not one of torch's elementwise ones. What it refuses, it refuses before changing anything."""
    count = (sum(len(g["params"]) for g in optimizer.param_groups), replaced())
    if _looked.get(optimizer) == count:  # looked at, and no parameter added or replaced since
        return
    found: dict[int, list[tuple[int, torch.Tensor, Moved]]] = defaultdict(list)  # shard id -> (group, p, where)
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            m = moved_into(p)
            if m is not None:
                found[id(m.shard)].append((gi, p, m))
    if not found or not _adoptable(optimizer):
        _looked[optimizer] = count
        return
    decayed: list[decay.Decayed] = []
    hosts = {shard: _host(optimizer, members, decayed) for shard, members in found.items()}
    states = {shard: _state(optimizer, members) for shard, members in found.items()}
    decay.keep_decayed(optimizer, decayed)  # refuses an L2 penalty: before the groups change
    for shard, members in found.items():
        for _, p, _ in members:
            optimizer.state.pop(p, None)
        if states[shard]:
            optimizer.state[members[0][2].shard] = states[shard]
    for gi, group in enumerate(optimizer.param_groups):
        params, names, placed = [], [], set()
        listed = group.get("param_names")
        for i, p in enumerate(group["params"]):
            m = moved_into(p)
            if m is None:
                params.append(p)
                names.append(listed[i] if listed else None)
            elif hosts[id(m.shard)] == gi and id(m.shard) not in placed:
                placed.add(id(m.shard))
                params.append(m.shard)
                names.append(f"flat_params.{m.group.index}")
        group["params"] = params
        if listed is not None:
            group["param_names"] = names
    _looked[optimizer] = (sum(len(g["params"]) for g in optimizer.param_groups), replaced())
    kept = optimizer.__dict__.pop(_KEPT, None)
    if kept is not None:  # a state saved from shards, loaded before compiling: it fits the groups now
        optimizer.load_state_dict(kept)


_KEPT = "_fbmt_state_for_its_shards"  # where an optimizer keeps a state loaded before compiling


def keep_for_shards(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> bool:
    """Keep a state saved from shards that does not fit `optimizer`'s groups of parameters yet, to load
    when they hold the shards (NOTE: [Optimizers built before compiling]); False where they never will
    (another class of optimizer, or groups that hold shards already: torch then says why it does not fit)."""
    holds_shards = any(group_of(p) is not None for g in optimizer.param_groups for p in g["params"])
    if not _adoptable(optimizer) or holds_shards:
        return False
    if _KEPT not in optimizer.__dict__:
        optimizer.register_state_dict_post_hook(_still_kept)
    optimizer.__dict__[_KEPT] = state_dict
    return True


def forget_kept(optimizer: torch.optim.Optimizer) -> None:
    """A later load replaces the state `optimizer` keeps for its shards: the last load wins, as in torch."""
    optimizer.__dict__.pop(_KEPT, None)


def still_waiting(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` keeps a state for shards it does not hold yet."""
    return _KEPT in optimizer.__dict__


def _still_kept(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """The state an optimizer keeps for its shards is its state until they come (a save in between
    loses nothing)."""
    return optimizer.__dict__.get(_KEPT, state_dict)


def torch_elementwise(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` is (or derives from) one of torch's elementwise optimizers."""
    return any(c.__name__ in _ELEMENTWISE and c.__module__.startswith("torch.optim") for c in type(optimizer).__mro__)


def _adoptable(optimizer: torch.optim.Optimizer) -> bool:
    fbmt_own = any(c.__module__.startswith("fbmt.") for c in type(optimizer).__mro__)
    return torch_elementwise(optimizer) and not fbmt_own


def _host(
    optimizer: torch.optim.Optimizer, members: list[tuple[int, torch.Tensor, Moved]], decayed: list[decay.Decayed]
) -> int:
    """The group that steps the shard of `members` (its parameters in the optimizer), refusing what one
    group cannot step; the elements another group decays are added to `decayed`."""
    kind = type(optimizer).__name__
    group = members[0][2].group
    held = {m.slot.name for _, _, m in members}
    left = [s.name for s in group.slots if s.name not in held]
    if left and group.requires_grad:
        raise RuntimeError(
            f"fbmt: this {kind} was built before fbmt.compile and holds parameter '{members[0][2].name}' but not "
            f"'{left[0]}', which fbmt.compile put in the same flat shard '{group.name}': a shard steps as one, so "
            f"'{left[0]}' would train where eager leaves it. Give the optimizer every parameter that trains, or "
            f"freeze '{left[0]}' before compiling (requires_grad_(False))"
        )
    indices = sorted({gi for gi, _, _ in members})
    if len(indices) == 1:
        return indices[0]
    named = {gi: next(m.name for g, _, m in members if g == gi) for gi in indices}  # one parameter of each group
    first = optimizer.param_groups[indices[0]]
    for gi in indices[1:]:
        other = optimizer.param_groups[gi]
        for key in sorted((set(first) | set(other)) - _DECAY_ONLY):
            if not _same(first.get(key), other.get(key)):
                raise RuntimeError(
                    f"fbmt: this {kind} was built before fbmt.compile and steps parameters '{named[indices[0]]}' "
                    f"and '{named[gi]}' with different {key} ({first.get(key)} and {other.get(key)}), but "
                    f"fbmt.compile put them in one flat shard '{group.name}', which steps with one {key}. Make "
                    f"them blocks of their own (fbmt.compile(model, blocks=[...])), or give their groups one {key}"
                )
    plain = [gi for gi in indices if not optimizer.param_groups[gi].get("weight_decay")]
    if not plain:
        raise RuntimeError(
            f"fbmt: this {kind} was built before fbmt.compile and decays parameters '{named[indices[0]]}' and "
            f"'{named[indices[1]]}' of flat shard '{group.name}' by different weight_decay, none of them 0: fbmt "
            "keeps a decay split inside a shard where one of its groups decays nothing. Build the optimizer "
            "after compiling, on model.parameters()"
        )
    for gi, _, m in members:
        lo, hi, _ = m.local()
        if gi != plain[0] and optimizer.param_groups[gi].get("weight_decay"):
            # kept where this rank holds none of it too: every rank refuses an L2 split alike
            decayed.append(decay.Decayed(m.shard, [(lo, hi)] if lo < hi else [], [m.name], gi))
    return plain[0]


def _state(optimizer: torch.optim.Optimizer, members: list[tuple[int, torch.Tensor, Moved]]) -> dict[str, Any]:
    """The state of the shard of `members`, made of theirs (NOTE: [Optimizers built before compiling])."""
    states = [optimizer.state.get(p) for _, p, _ in members]
    if not any(states):
        return {}
    names = [m.name for _, _, m in members]
    shard = members[0][2].shard
    why = ""
    if not all(states):
        some, none = (names[next(i for i, s in enumerate(states) if bool(s) == b)] for b in (True, False))
        why = f"holds state for parameter '{some}' but none for '{none}'"
    elif any(set(st) != set(states[0]) for st in states):
        other = next(i for i, st in enumerate(states) if set(st) != set(states[0]))
        why = f"holds state of other kinds for parameter '{names[other]}' than for '{names[0]}'"
    moved: dict[str, Any] = {}
    for key in states[0] if not why else ():
        values = [st[key] for st in states]
        shaped = [isinstance(v, torch.Tensor) and v.dim() > 0 for v in values]
        wrong = next(
            (i for i, (v, (_, p, _)) in enumerate(zip(values, members)) if shaped[i] and v.shape != p.shape), None
        )
        if wrong is not None:  # a compiled model's optimizer saved its shards' state
            why = (
                f"holds state '{key}' of shape {tuple(values[wrong].shape)} for parameter '{names[wrong]}' of shape "
                f"{tuple(members[wrong][1].shape)} (a state saved from a compiled model's optimizer is its shards': "
                "load it into an optimizer built after compiling, on model.parameters(), on the rank that saved it)"
            )
        elif all(shaped):
            flat = torch.zeros(shard.numel(), dtype=values[0].dtype, device=shard.device)
            for v, (_, _, m) in zip(values, members):
                lo, hi, start = m.local()
                if lo < hi:
                    flat[lo:hi] = v.detach().reshape(-1)[start : start + hi - lo].to(shard.device)
            moved[key] = flat
        elif not any(shaped) and all(_same(v, values[0]) for v in values):
            moved[key] = values[0]  # a count every parameter of the shard shares (`step`)
        else:
            other = next(i for i, v in enumerate(values) if not _same(v, values[0]))
            why = f"holds state '{key}' that differs between parameters '{names[0]}' and '{names[other]}'"
        if why:
            break
    if why:
        raise RuntimeError(
            f"fbmt: the {type(optimizer).__name__} built before fbmt.compile {why}, which share flat shard "
            f"'{members[0][2].group.name}' that steps as one. Resume with fbmt.checkpoint, or build the optimizer "
            "after compiling"
        )
    return moved


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        both = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        return both and a.shape == b.shape and bool((a == b).all())
    return a == b
