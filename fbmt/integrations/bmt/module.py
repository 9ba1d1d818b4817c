"""`DistributedModule` and lowering: BMTrain-style models run on the machinery of `fbmt.compile`.

NOTE: [Lowering]
A model built from `DistributedParameter`s, `DistributedModule`s and `Block`s is *lowered* the
first time it is needed whole: `fbmt.init_parameters(model)`, `fbmt.load(model, path)`, or its first
call. Lowering

1. makes every module in the tree a DistributedModule (a class swap, as BMTrain's wrapper does),
2. plans the flat layout of `fbmt.compile` with the `Block`s as the blocks (everything else is
   grouped by the usual rule) on `meta` stand-ins of the full shapes,
3. builds each group's shard from the parameters' current values, one full parameter at a time,
4. turns each parameter into a view of its part of its group's shard (NOTE: [Two partitions]),
5. creates a `CompiledModule` in view mode (autograd fills each parameter's `.grad` with its slice
   of the shard gradient), with each Block's `use_checkpoint`/`zero_level` as its block policy,
   gradients summed over ranks (BMTrain's convention: `OptimManager.backward` divides the loss by
   the world size) and no recompute outside Blocks.

Calling the model then traces and runs programs exactly as `fbmt.compile` does: there is no second,
hook-based ZeRO. The lowered model's parameters are the same objects as before, so an optimizer
built on them keeps working. `state_dict()` and `load_state_dict()` work before and after
lowering and always speak full tensors under the unwrapped names.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn

from fbmt import job
from fbmt.compiler import (
    CompiledModule,
    CompileOptions,
    FlatGroup,
    Layout,
    ParamSlot,
    Plan,
    Routes,
    copy_into_shard,
    local_range,
    plan_layout,
    tracing,
)
from fbmt.integrations import torch_guards
from fbmt.integrations.bmt.parameter import (
    DistributedParameter,
    _gather_construction,
    _mark,
    full_tensor,
    is_distributed,
    set_view,
    view_of,
    write_full,
)


class DistributedModule(nn.Module):
    """A module whose parameters are sharded over all ranks (BMTrain's DistributedModule).

    Calling it outside another fbmt model lowers it (NOTE: [Lowering]) and runs the compiled
    program. `state_dict()` returns full tensors (a collective: call it on every rank).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if tracing():  # inside a program being traced: the ordinary module call
            return super().__call__(*args, **kwargs)
        return lower(self)(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        if is_lowered(self):  # .to()/.half()/.cuda() that would copy a parameter would cut it off its shard
            for name, p in self.named_parameters():
                if fn(p) is not p:
                    raise RuntimeError(
                        f"fbmt: cannot convert '{name}' of this model (.to/.half/.float/.cuda...): "
                        "its parameters are views of sharded storage. Build the model with the dtype "
                        "you want (DistributedParameter(..., dtype)); it is already on this rank's "
                        "device"
                    )
        return super()._apply(fn, recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with gathering():
            return super().state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        for name, p in self._parameters.items():
            if p is not None:
                destination[prefix + name] = (
                    _context.keep(full_tensor(p)) if is_distributed(p) else p if keep_vars else p.detach()
                )
        for name, b in self._buffers.items():
            if b is not None and name not in self._non_persistent_buffers_set:
                destination[prefix + name] = b if keep_vars else b.detach()
        if type(self).get_extra_state is not nn.Module.get_extra_state:
            destination[prefix + "_extra_state"] = self.get_extra_state()

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list,
        unexpected_keys: list,
        error_msgs: list,
    ) -> None:
        local: dict[str, torch.Tensor] = {n: p for n, p in self._parameters.items() if p is not None}
        local.update(
            {n: b for n, b in self._buffers.items() if b is not None and n not in self._non_persistent_buffers_set}
        )
        for name, t in local.items():
            key = prefix + name
            if key not in state_dict:
                if strict:
                    missing_keys.append(key)
                continue
            value = state_dict[key]
            shape = tuple(getattr(t, "_original_shape", t.shape))
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
                error_msgs.append(
                    f"size mismatch for {key}: copying a param with shape "
                    f"{tuple(getattr(value, 'shape', ()))} from checkpoint, the shape in current "
                    f"model is {shape}."
                )
                continue
            write_full(t, value)
        extra = prefix + "_extra_state"
        if type(self).set_extra_state is not nn.Module.set_extra_state and extra in state_dict:
            self.set_extra_state(state_dict[extra])
        if strict:
            for key in state_dict:
                if key.startswith(prefix) and key != extra:
                    first = key[len(prefix) :].split(".", 1)[0]
                    if first not in self._modules and first not in local:
                        unexpected_keys.append(key)


_classes: dict[type, type] = {}


def distributed_class(cls: type) -> type:
    """`cls` with DistributedModule's state-dict and call behaviour mixed in (cached per class)."""
    if issubclass(cls, DistributedModule):
        return cls
    if cls not in _classes:
        _classes[cls] = type(
            cls.__name__, (cls, DistributedModule), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    return _classes[cls]


def make_distributed(module: nn.Module) -> nn.Module:
    """In place: every module of the tree a DistributedModule, every plain parameter a
    DistributedParameter holding only this rank's part (tied parameters stay tied)."""
    converted: dict[int, nn.Parameter] = {}
    for m in module.modules():
        if not isinstance(m, DistributedModule):
            m.__class__ = distributed_class(type(m))
        for k, p in list(m._parameters.items()):
            if p is not None and not is_distributed(p):
                if id(p) not in converted:
                    converted[id(p)] = DistributedParameter(p.detach(), requires_grad=p.requires_grad)
                m._parameters[k] = converted[id(p)]
    return module


# ---- lowering ----


def lower(module: nn.Module) -> CompiledModule:
    """The CompiledModule that runs `module`, lowering it first if needed (NOTE: [Lowering])."""
    compiled = module.__dict__.get("_fbmt_compiled")
    if compiled is not None:
        return compiled
    root = module.__dict__.get("_fbmt_root")
    if root is not None and root() is not None:
        raise RuntimeError(
            f"fbmt: this {type(module).__name__} is part of a {type(root()).__name__} that runs as "
            "one compiled model; call that model, not its part"
        )
    for path, sub in module.named_modules():
        if sub is not module and "_fbmt_compiled" in sub.__dict__:
            raise RuntimeError(
                f"fbmt: submodule '{path}' ({type(sub).__name__}) was already set up as a model of "
                "its own (by init_parameters, load or calling it); call init_parameters/load on the "
                "whole model first"
            )
    make_distributed(module)
    world, rank, device = job.world_size(), job.rank(), job.compute_device()
    by_name = dict(module.named_parameters())
    for name, p in by_name.items():
        if view_of(p) is not None:
            raise RuntimeError(f"fbmt: parameter '{name}' already belongs to another lowered model")
    policies = block_policies(module)
    layout = _plan_on_stand_ins(module, world, list(policies))
    shards, views = [], []
    with torch.no_grad():
        for g in layout.groups:  # one full parameter at a time: no rank ever holds the whole model
            shard = torch.zeros(g.shard_numel, dtype=g.dtype, device=device)
            for s in g.slots:
                copy_into_shard(shard, g, rank, {s.name: full_tensor(by_name[s.name])})
            shards.append(nn.Parameter(shard, requires_grad=False))
        for g, shard in zip(layout.groups, shards):
            views.append([_become_view(by_name[s.name], shard, g, s, rank, world) for s in g.slots])
        for m in module.modules():  # buffers are replicated and live on the compute device
            for k, b in m._buffers.items():
                if b is not None and b.device != device:
                    m._buffers[k] = b.to(device)
    options = CompileOptions(
        zero=3,
        remat="none",
        grad_reduce="sum",
        blocks={path: dict(zero=z, remat="block" if ckpt else "none") for path, (ckpt, z) in policies.items()},
    )
    plan = Plan.of(options, layout.world_size)
    compiled = ViewModule(module, layout, shards, options=options, plan=plan, device=device, rank=rank, views=views)
    torch_guards.install(compiled.gradient_leaves())
    # BMTrain's own module class keeps the model it runs as (a DistributedModule, as BMTrain's keeps its state)
    module.__dict__["_fbmt_compiled"] = compiled
    for sub in module.modules():
        if sub is not module:
            sub.__dict__["_fbmt_root"] = weakref.ref(module)
    for vs in views:
        for v in vs:
            view_of(v).compiled = weakref.ref(compiled)
    return compiled


class ViewModule(CompiledModule):
    """A lowered model's compiled module in view mode: for each group, one leaf Parameter per slot,
    viewing this rank's part of that parameter inside the group's shard (possibly empty). Autograd
    then accumulates a slice of the shard gradient into each view's `.grad`, so optimizers and
    `named_parameters()` see ordinary per-parameter tensors; the flat shards hold no gradients."""

    def __init__(self, *args: Any, views: list[list[nn.Parameter]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.views = views
        self._view_routes: Routes = {}  # group -> (view index, lo, hi in the shard) of each view
        index = 0
        for group, vs in zip(self.layout.groups, views):
            base, self._view_routes[group.index] = self.rank * group.shard_numel, []
            for slot, v in zip(group.slots, vs):
                lo, hi = local_range(group, slot, self.rank)
                assert v.numel() == max(0, hi - lo), f"view of {slot.name} has the wrong size"
                self._view_routes[group.index].append((index, max(0, lo - base), max(lo, hi) - base))
                index += 1

    def trainable(self) -> tuple[bool, ...]:
        return tuple(any(v.requires_grad for v in vs) for vs in self.views)

    def _adopt(self) -> None:
        super()._adopt()
        if "views" in self.__dict__:  # a copy's views (lower() installs the original's once they exist)
            torch_guards.install(self.gradient_leaves())

    def gradient_leaves(self) -> list[torch.Tensor]:
        return [v for vs in self.views for v in vs]

    def slot_views(self, group: int) -> list[torch.Tensor]:
        return list(self.views[group])

    def _routes(self) -> Routes:
        return self._view_routes

    def _view_arguments(self) -> list[torch.Tensor]:
        return self.gradient_leaves()


def is_lowered(module: nn.Module) -> bool:
    """Has `module` (or the model it is part of) been lowered."""
    root = module.__dict__.get("_fbmt_root")
    return "_fbmt_compiled" in module.__dict__ or (root is not None and root() is not None)


def block_policies(module: nn.Module) -> dict[str, tuple[bool, int]]:
    """Path -> (use_checkpoint, zero_level) of every outermost Block in the tree (a Block says what
    it is by its `block_policy`)."""
    out: dict[str, tuple[bool, int]] = {}
    for path, m in module.named_modules():
        policy = getattr(m, "block_policy", None) if isinstance(m, DistributedModule) else None
        if policy is not None and not any(path.startswith(b + ".") for b in out):
            out[path] = policy
    return out


def _plan_on_stand_ins(module: nn.Module, world: int, blocks: list[str]) -> Layout:
    """Plan the layout with each parameter replaced, for the call, by a meta tensor of its full shape."""
    owners: list[tuple[nn.Module, str, nn.Parameter]] = []
    stand_in: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                if id(p) not in stand_in:
                    shape = p._original_shape if is_distributed(p) else p.shape
                    stand_in[id(p)] = nn.Parameter(
                        torch.empty(shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad
                    )
                owners.append((m, k, p))
    try:
        for m, k, p in owners:
            m._parameters[k] = stand_in[id(p)]
        return plan_layout(module, world, blocks, split_frozen=False)
    finally:
        for m, k, p in owners:
            m._parameters[k] = p


def _become_view(
    p: nn.Parameter, shard: torch.Tensor, g: FlatGroup, s: ParamSlot, rank: int, world: int
) -> nn.Parameter:
    lo, hi = local_range(g, s, rank)
    hi = max(lo, hi)
    base = rank * g.shard_numel
    p.grad = None  # a construction-partition gradient has the wrong size
    p.data = shard.data[lo - base : hi - base]
    _mark(p, torch.Size(s.shape), lo - s.offset, hi - s.offset, world, getattr(p, "_init_method", None))
    set_view(p, _View(g, s))
    return p


class _View:
    """Where a lowered parameter lives: its group and slot in its model's flat layout."""

    def __init__(self, group: FlatGroup, slot: ParamSlot):
        self.group, self.slot = group, slot
        self.compiled: Any = None  # weakref to the CompiledModule, set once it exists

    def full(self, p: torch.Tensor) -> torch.Tensor:
        flat = _context.params(self.compiled(), self.group)
        return flat[self.slot.offset : self.slot.offset + self.slot.numel].view(self.slot.shape)

    def full_grad(self, p: torch.Tensor) -> torch.Tensor | None:
        flat = _context.grads(self.compiled(), self.group)
        if flat is None or not flat[1][self.group.slots.index(self.slot)]:
            return None
        return flat[0][self.slot.offset : self.slot.offset + self.slot.numel].view(self.slot.shape)


def full_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The whole gradient of a (possibly partial) parameter, or None if no rank has one; a collective."""
    view = view_of(p)
    if view is not None:
        return view.full_grad(p)
    if is_distributed(p):
        has = torch.tensor([float(p.grad is not None)], device=p.device)
        if job.world_size() > 1:
            torch.distributed.all_reduce(has)
        if not has.item():
            return None
        local = p.grad.detach() if p.grad is not None else torch.zeros_like(p.detach())
        return _gather_construction(local.reshape(-1), p)
    return None if p.grad is None else p.grad.detach()


class _GatherContext:
    """Gathers whole groups, remembering the last one (walking a model visits a group's parameters
    together, so each group is gathered once); outside `gathering()` nothing is remembered."""

    def __init__(self) -> None:
        self.depth, self.last_params, self.last_grads = 0, None, None
        self.rank0_cpu = False

    def params(self, compiled: CompiledModule, g: FlatGroup) -> torch.Tensor:
        key = (id(compiled), g.index)
        if self.last_params is not None and self.last_params[0] == key:
            return self.last_params[1]
        flat = compiled.gather(g.index)
        if self.depth:
            self.last_params = (key, flat)
        return flat

    def grads(self, compiled: CompiledModule, g: FlatGroup) -> tuple[torch.Tensor, list[bool]] | None:
        key = (id(compiled), g.index)
        if self.last_grads is not None and self.last_grads[0] == key:
            return self.last_grads[1]
        shard = compiled.flat_params[g.index]
        local = torch.zeros(g.shard_numel + len(g.slots), dtype=torch.float32, device=shard.device)
        base = compiled.rank * g.shard_numel
        for i, (s, v) in enumerate(zip(g.slots, compiled.views[g.index])):
            if v.grad is not None:
                lo = s.offset + v._start_partition - base
                local[lo : lo + v.numel()] = v.grad.detach().reshape(-1).float()
                local[g.shard_numel + i] = 1.0
        rows = job.gather_flat(local).view(g.world_size, -1)
        has = (rows[:, g.shard_numel :].sum(0) > 0).tolist()
        flat = rows[:, : g.shard_numel].reshape(-1).to(g.dtype)
        result = (flat, has) if any(has) else None
        if self.depth:
            self.last_grads = (key, result)
        return result

    def keep(self, t: torch.Tensor) -> torch.Tensor:
        """What a state dict stores for a gathered tensor: an independent copy (on the CPU of rank 0
        only while saving, an empty placeholder elsewhere)."""
        if self.rank0_cpu:
            return t.detach().cpu().clone() if job.rank() == 0 else torch.empty(0)
        return t.detach().clone()


_context = _GatherContext()


@contextmanager
def gathering(rank0_cpu: bool = False) -> Iterator[None]:
    """Within it, parameters read whole are gathered once per group and remembered (`rank0_cpu`: onto
    rank 0's CPU only, as a save needs); outside it nothing is remembered."""
    previous = _context.rank0_cpu
    _context.depth += 1
    _context.rank0_cpu = rank0_cpu or previous
    try:
        yield
    finally:
        _context.depth -= 1
        _context.rank0_cpu = previous
        if not _context.depth:
            _context.last_params = _context.last_grads = None


def init_parameters(model: nn.Module) -> None:
    """Run every parameter's `init_method` on its full tensor and keep this rank's part.

    Parameters are visited in module order (then registration order), drawing from the global RNG,
    so the same seed gives the same weights on every rank and as an unsharded model that calls the
    same initializers in the same order. Lowers the model first (NOTE: [Lowering]).
    """
    if not is_lowered(model):
        lower(model)
    seen: set[int] = set()
    with torch.no_grad():
        for m in model.modules():
            for p in m._parameters.values():
                init = getattr(p, "_init_method", None)
                if p is None or init is None or id(p) in seen:
                    continue
                seen.add(id(p))
                full = torch.empty(p._original_shape, dtype=p.dtype, device=p.device)
                init(full)
                write_full(p, full)
