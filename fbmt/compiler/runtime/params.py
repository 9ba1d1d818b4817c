"""Flat shards: build them from a module (materializing `meta` modules block by block), gather them.

NOTE: [Materializing shard by shard]
A model built under `torch.device("meta")` has no storage. For each block in turn, its parameters
(and the buffers of its modules) get real storage on the target device, filled with a value no
initializer writes (NaN); each module that owns them is initialized (`_initializer`: an init_fn, which
`fbmt.compile` makes a Hugging Face model's own `_init_weights`, runs on the owners and their ancestors
as `model.apply` would; otherwise the owner's `reset_parameters()`); a tensor the
initializer left unset is an error, not uninitialized memory; this rank copies its slice into the
shards; the block goes back to `meta`. Every rank draws the same random numbers (one seed
broadcast from rank 0), so the slices agree, and no rank holds more than one block of full
parameters at a time.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt.compiler import owners as owners_
from fbmt.compiler.collectives import torch_impl
from fbmt.compiler.layout import FlatGroup, Layout, copy_into_shard
from fbmt.compiler.owners import Placeholder

InitFn = Callable[[nn.Module], None]
log = logging.getLogger("fbmt")


def build_shards(
    module: nn.Module,
    layout: Layout,
    rank: int,
    device: torch.device,
    init_fn: InitFn | None,
    *,
    home: torch.device | None = None,
) -> list[nn.Parameter]:
    """This rank's flat shards of `module`'s parameters, in layout order, in `home` memory (default:
    `device`, where a `meta` model's blocks are materialized and its buffers go); host memory is pinned
    where `device` is a GPU (NOTE: [Offload] in passes/shard.py)."""
    home = home or device
    pin = home.type == "cpu" and device.type == "cuda"
    refs = _param_refs(module)
    shards = []
    with torch.no_grad():
        seed = _shared_seed() if any(p.is_meta for p in module.parameters()) else None
        # what each block's materializing reads, found once: per block, a look-up over the whole
        # module would make building a deep model's shards quadratic in its depth
        meta_buffers = _meta_buffers(module, layout) if seed is not None else {}
        for block in layout.blocks:
            groups = [g for g in layout.groups if g.block == block]
            names = [s.name for g in groups for s in g.slots]
            if seed is not None:
                _materialize(module, layout, block, names, refs, device, init_fn, seed, meta_buffers.get(block, []))
            params = {n: module.get_parameter(n) for n in names}
            for g in groups:
                assert g.index == len(shards), "shards must come out in layout.groups order (the runtime zips them)"
                shard = torch.zeros(g.shard_numel, dtype=g.dtype, device=home, pin_memory=pin)
                copy_into_shard(shard, g, rank, params)
                shards.append(nn.Parameter(shard, requires_grad=g.requires_grad))
                for slot in g.slots:
                    _to_meta(params[slot.name], refs, slot.name, owners_.Moved(slot.name, shards[-1], g, slot, rank))
            del params  # the block's full tensors die here, before the next block is materialized
    for m in module.modules():  # buffers are replicated: every rank keeps them whole, on the device
        for k, b in m._buffers.items():
            if b is not None:
                if b.is_meta:
                    raise ValueError(
                        f"buffer '{k}' of {type(m).__name__} is on the meta device and no block "
                        "initialized it; give fbmt.compile an init_fn(module) that fills it"
                    )
                m._buffers[k] = b.to(device)
    return shards


# NOTE: [Ranks' weights]
# Every rank builds its shards from its own copy of the model, so a model whose copies differ (the
# pretrained weights loaded on rank 0 only, as DDP users do because DDP broadcasts rank 0's at its
# start; ranks seeded apart) would train a mix of them, every rank holding a slice of its own. So
# before the shards are built, each rank digests each parameter (a float64 sum and a position-weighted
# sum, on the parameter's device: one pass over the weights, which compile reads anyway) and the ranks
# compare the digests (one small all-gather). Where they differ, `weights="rank0"` (the default) gives
# every rank rank 0's values of those parameters (a broadcast of them alone) and logs which they were;
# `weights="check"` raises on every rank, naming the first. A model built on `meta` is materialized
# from one seed on every rank (NOTE: [Materializing shard by shard]) and is not compared.
def _digest(t: torch.Tensor) -> tuple[float, float]:
    x = t.detach().reshape(-1)
    x = torch.nan_to_num(x.double() if (x.is_floating_point() or x.is_complex()) else x.to(torch.float64), nan=1.5e300)
    weights = torch.arange(x.numel(), device=x.device, dtype=torch.float64).remainder_(251).add_(1)
    return float(x.sum()), float((x * weights).sum())


def _same(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Digests of the same values (summed in another order, a CPU's thread count may change it)."""
    return all(abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1.0) for x, y in zip(a, b))


def agree_on_weights(module: nn.Module, layout: Layout, policy: str) -> None:
    """Make every rank's parameters rank 0's where they differ, or raise (`policy`: NOTE: [Ranks' weights])."""
    params = dict(module.named_parameters())
    names = [s.name for g in layout.groups for s in g.slots if not params[s.name].is_meta]
    if not names or not dist.is_initialized():
        return
    mine = [_digest(params[n]) for n in names]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [n for i, n in enumerate(names) if any(not _same(d[i], every[0][i]) for d in every)]
    if not differ:
        return
    ranks = [r for r, d in enumerate(every) if not all(_same(x, y) for x, y in zip(d, every[0]))]
    if policy == "check":
        raise ValueError(
            f"fbmt.compile(weights='check'): rank(s) {ranks} hold other values than rank 0 for {len(differ)} "
            f"parameter(s), the first '{differ[0]}' (pretrained weights loaded on some ranks only, or ranks "
            "seeded apart); load the same weights on every rank, or compile with weights='rank0' (the "
            "default) to take rank 0's, as DDP does"
        )
    log.warning(
        "fbmt.compile: rank(s) %s held other values than rank 0 for %d parameter(s) (%s%s); every rank "
        "takes rank 0's, as DDP's start-up broadcast does (weights='check' makes this an error)",
        ranks,
        len(differ),
        ", ".join(differ[:3]),
        ", ..." if len(differ) > 3 else "",
    )
    nccl = dist.get_backend() == "nccl"
    with torch.no_grad():
        for n in differ:
            p = params[n]
            on = p.detach().cuda() if nccl and not p.is_cuda else p.detach()
            dist.broadcast(on, src=0)
            if on is not p:
                p.copy_(on)


def gather_group(shard: torch.Tensor, group: FlatGroup, device: torch.device | None = None) -> torch.Tensor:
    """The whole flat buffer of a group (a blocking all-gather), on `device` (default: the shard's; a
    shard in host memory is gathered on the compute device, NOTE: [Offload] in passes/shard.py)."""
    shard = shard.detach() if device is None else shard.detach().to(device)
    pending = torch_impl.all_gather(shard, group.world_size)
    pending.what = (
        f"the gather of flat group '{group.name}' outside the program (state_dict(), save_pretrained(), "
        "full_parameters() and full_gradients() are collectives: call them on every rank, e.g. "
        "model.save_pretrained(folder, is_main_process=rank == 0), not on rank 0 alone)"
    )
    return torch_impl.wait(pending)


def _param_refs(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    refs: dict[int, list[tuple[nn.Module, str]]] = defaultdict(list)
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None:
                refs[id(p)].append((m, k))
    return refs


def _swap(p: torch.Tensor, new: nn.Parameter, refs: dict, name: str, into: owners_.Moved | None = None) -> None:
    # An optimizer built on the module before compiling still holds `p`, which nothing updates any
    # more: the registry lets fbmt step the shard `into` names in its place (integrations/adopt.py).
    owners_.moved(p, name, into)
    owners = refs.pop(id(p))
    for m, k in owners:
        m._parameters[k] = new  # tied parameters stay tied: every owner gets the same object
    refs[id(new)] = owners


def _to_meta(p: torch.Tensor, refs: dict, name: str, into: owners_.Moved) -> None:
    if not p.is_meta:
        _swap(p, Placeholder(torch.empty_like(p, device="meta"), p.requires_grad, name), refs, name, into)


def _shared_seed() -> int:
    seed = [
        int(torch.randint(0, 2**62, (), device="cpu").item())
    ]  # explicit: compile may run under a meta device context
    if dist.is_initialized():
        dist.broadcast_object_list(seed, src=0)
    return seed[0]


def _materialize(
    module: nn.Module,
    layout: Layout,
    block: str,
    names: list[str],
    refs: dict,
    device: torch.device,
    init_fn: InitFn | None,
    seed: int,
    meta_buffers: list[tuple[str, nn.Module]],
) -> None:
    owners: dict[str, nn.Module] = {}
    fresh: dict[str, torch.Tensor] = {}  # what was materialized, each filled with a value no init writes
    for n in names:
        path = n.rpartition(".")[0]
        owners[path] = module.get_submodule(path)
        p = module.get_parameter(n)
        fresh[n] = _unset_like(p, device)
        _swap(p, nn.Parameter(fresh[n], requires_grad=p.requires_grad), refs, n)
    for path, m in meta_buffers:
        if any(b is not None and b.is_meta for b in m._buffers.values()):
            owners[path] = m
            for k, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[k] = fresh[f"{path}.{k}" if path else k] = _unset_like(b, device)
    initialize = _initializer(module, init_fn)
    # An init_fn runs as `model.apply(init_fn)` would reach the block: on the modules that own its
    # tensors and on their ancestors, children first, for an ancestor may set its children's tensors
    # (a Whisper encoder its sinusoidal positions, a CLIP attention its projections' scale). Tensors of
    # other blocks that it touches are meta or placeholders, and stay as they are (`owners_.quiet`).
    targets = _with_ancestors(module, owners) if init_fn is not None else owners
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), owners_.quiet():
        torch.manual_seed(seed + layout.blocks.index(block))
        for path, m in targets.items():
            initialize(path, m)
    # An initializer that skips a tensor (a Hugging Face _init_weights that does not know a module, a
    # reset_parameters that forgets a buffer) would leave uninitialized memory: refuse instead. On the
    # meta device (a model compiled only to be inspected or simulated) there are no values to check.
    unset = [n for n, t in fresh.items() if device.type != "meta" and _still_unset(t)]
    if unset:
        raise ValueError(
            f"fbmt.compile: the model was built on the meta device, and initializing it left {unset[:4]} without "
            "values (its module's reset_parameters(), or the model's _init_weights, does not set them); pass "
            "fbmt.compile(..., init_fn=fn) where fn(module) initializes what each module owns directly"
        )


def _meta_buffers(module: nn.Module, layout: Layout) -> dict[str | None, list[tuple[str, nn.Module]]]:
    """Per block, its modules that hold a buffer on the meta device (with their paths)."""
    out: dict[str | None, list[tuple[str, nn.Module]]] = defaultdict(list)
    for path, m in module.named_modules():
        if any(b is not None and b.is_meta for b in m._buffers.values()):
            out[layout.block_of_module(path)].append((path, m))
    return out


def _with_ancestors(root: nn.Module, owners: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """`owners` and every module above them, in the order `root.apply` visits them: children first."""
    wanted = set(owners)
    for path in owners:
        parts = path.split(".") if path else []
        wanted.update(".".join(parts[:i]) for i in range(len(parts)))
    out: dict[str, nn.Module] = {}

    def visit(path: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            sub = f"{path}.{name}" if path else name
            if sub in wanted:
                visit(sub, child)
        out[path] = m

    visit("", root)
    return out


def _unset_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Storage for `t` on `device`, filled with NaN (floating point) or the smallest integer."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.full_like(t, float("nan"), device=device)
    if t.dtype == torch.bool:
        return torch.zeros_like(t, device=device)  # no value marks a bool as unset
    return torch.full_like(t, torch.iinfo(t.dtype).min, device=device)


def _still_unset(t: torch.Tensor) -> bool:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return bool(t.isnan().all()) and t.numel() > 0
    if t.dtype == torch.bool:
        return False
    return bool((t == torch.iinfo(t.dtype).min).all()) and t.numel() > 0


def _initializer(root: nn.Module, init_fn: InitFn | None) -> Callable[[str, nn.Module], None]:
    """How each module that owns meta state gets its values: `init_fn(module)` (which `fbmt.compile`
    makes a Hugging Face model's own `_init_weights`, what `from_config` runs, where the user gives
    none); else the module's `reset_parameters()` (torch's modules) or `_reset_parameters()`
    (nn.MultiheadAttention, and modules written after it)."""

    def initialize(path: str, m: nn.Module) -> None:
        if init_fn is not None:
            init_fn(m)
        elif callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
        elif callable(getattr(m, "_reset_parameters", None)):
            m._reset_parameters()
        else:
            owned = [k for k, v in [*m._parameters.items(), *m._buffers.items()] if v is not None]
            raise ValueError(
                f"module '{path or '<root>'}' ({type(m).__name__}) was built on the meta device and owns "
                f"{owned} directly, but has no reset_parameters() to give them values; add a "
                "reset_parameters() to it that initializes what it owns (torch's own modules have one), or "
                "pass fbmt.compile(..., init_fn=fn) where fn(module) does"
            )

    return initialize


class Placeholders:
    """The `meta` placeholders a compiled module's parameters became, by owner: a user who deletes,
    replaces or (un)freezes one after compiling must not be ignored silently."""

    def __init__(self, module: nn.Module, layout: Layout, shards: list[nn.Parameter]):
        group_of = {s.name: g.index for g in layout.groups for s in g.slots}
        self.layout, self.shards = layout, list(shards)  # what the flat shards must stay
        self.held = [
            (m, k, p, name, group_of[layout.aliases[name]])
            for path, m in module.named_modules(remove_duplicate=False)
            for k, p in m._parameters.items()
            if p is not None
            for name in [f"{path}.{k}" if path else k]
        ]
        self.seen = self._flags(self.shards)

    def _flags(self, shards: list[nn.Parameter]) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
        # read past the placeholders' `__torch_function__`, which every call would otherwise enter once per
        # parameter (most of the host's time before a step's first kernel, at a few hundred parameters)
        with torch._C.DisableTorchFunctionSubclass():
            return tuple(p.requires_grad for _, _, p, _, _ in self.held), tuple(p.requires_grad for p in shards)

    def check(self, current: list[nn.Parameter]) -> None:
        """The module's parameters are still the placeholders compile left, the flat shards (`current`)
        still the ones it made, and `requires_grad_` on a placeholder (`model.fc.weight.requires_grad_(False)`)
        or on a shard applies to the shard's whole group."""
        if len(current) != len(self.shards) or any(a is not b for a, b in zip(current, self.shards)):
            raise RuntimeError(
                "fbmt: the compiled model's flat shards were replaced after fbmt.compile (FSDP's fully_shard or "
                "FullyShardedDataParallel around a compiled model does this): fbmt already shards the parameters "
                "and reduces the gradients; use the compiled model as it is, without FSDP or DDP around it"
            )
        for m, k, p, name, _ in self.held:
            if m._parameters.get(k) is not p:
                raise RuntimeError(
                    f"fbmt: parameter '{name}' was deleted or replaced after fbmt.compile, but the compiled "
                    "program computes with the original, whose values live in the flat shards; change the "
                    "module before compiling it, or load new values with model.load_state_dict(...)"
                )
        flags = self._flags(current)
        if flags == self.seen:
            return
        if flags[0] != self.seen[0]:  # a placeholder changed: its whole group follows
            for group in self.layout.groups:
                mine = [(name, p.requires_grad) for _, _, p, name, g in self.held if g == group.index]
                wanted = {rg for _, rg in mine}
                if len(wanted) > 1:
                    frozen = [n for n, rg in mine if not rg]
                    raise RuntimeError(
                        f"fbmt: {frozen[:3]} of flat group '{group.name}' are frozen but other parameters of "
                        "that group still train, and a group's shard trains as one. Freeze before fbmt.compile "
                        "(frozen parameters then get a shard of their own), or freeze the whole block "
                        f"'{group.block or '<root>'}' (e.g. model.get_submodule(...).requires_grad_(False))"
                    )
                current[group.index].requires_grad_(wanted.pop())
        else:  # a shard changed (through model.parameters()): its placeholders follow, for the next check
            for _, _, p, _, g in self.held:
                p.requires_grad_(current[g].requires_grad)
        self.seen = self._flags(current)


def broadcast_buffers(buffers: dict[str, torch.Tensor], names: list[str]) -> None:
    """Rank 0's values of these buffers on every rank (`broadcast_buffers`), one broadcast per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        by_dtype.setdefault(buffers[name].dtype, []).append(buffers[name])
    with torch.no_grad():
        for tensors in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=0)
            for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(v.view_as(t))
