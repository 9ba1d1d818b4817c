"""What `fbmt.compile` took over from the user's objects, kept beside them and never set on them.

- A parameter the model held becomes a `Placeholder`: a `meta` parameter of fbmt's own class, so the
  module says it was compiled (`taken`), a deep copy of it too (copies keep their class). It holds
  no values, so anything that would read or write them raises at once, naming the parameter (NOTE:
  [Placeholders refuse values]).
- A hook on a parameter's gradient, there before compile or registered on a placeholder after, is
  refused: nothing would run it (NOTE: [Hooks on a parameter's gradient]).
- The parameter it replaced is remembered (`moved`), weakly, with the shard its values went to: an
  optimizer built before compiling still holds it, and `moved_into` lets fbmt step the shards in its
  place (integrations/adopt.py), `moved_name` name it where it cannot.
- Each flat shard knows its group (`group_of`), for code that meets a shard alone (BMTrain's
  OptimManager, the weight-decay guard).

The maps hold their keys weakly (`torch.utils.weak.WeakIdKeyDictionary`: tensors by identity), so a
module, parameter or shard the user drops is freed as usual.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from fbmt.compiler.layout import FlatGroup, ParamSlot, local_range

# NOTE: [Placeholders refuse values]
# After fbmt.compile the module it took over holds placeholders where its parameters were; their values
# live in the compiled model's flat shards. A write to one (`model.lm_head.weight.zero_()`,
# `nn.init.zeros_(...)`, `copy_`, `load_state_dict` on a submodule, `.data.normal_()` in an
# `_init_weights`) would change a meta tensor and be lost, and a read would compute with nothing. So
# a placeholder answers what its metadata says (shape, dtype, device, requires_grad, size, numel,
# ...), hands out views of itself as placeholders too (`.data`, `detach`, `view`, `t`, slicing: their
# later use raises), and raises at anything else, naming the parameter and the op, and saying how to
# read (`state_dict`) or write (`load_state_dict`) the values. Tracing never meets one: it runs the
# module on fake tensors put in the placeholders' place (`torch.func.functional_call`).
_METADATA = frozenset(
    {
        "numel", "nelement", "dim", "ndimension", "size", "stride", "element_size", "storage_offset",
        "is_floating_point", "is_complex", "is_contiguous", "is_signed", "requires_grad_", "get_device",
        "data_ptr", "untyped_storage", "__repr__", "__format__", "__hash__", "__reduce_ex__", "__setstate__",
        "__getstate__", "__deepcopy__", "_is_view", "has_names", "is_shared", "type", "__len__", "retain_grad",
    }
)  # fmt: skip
_HOOKS = frozenset({"register_hook", "register_post_accumulate_grad_hook"})
_VIEWS = frozenset(
    {
        "detach", "view", "view_as", "reshape", "reshape_as", "t", "transpose", "permute", "expand", "expand_as",
        "__getitem__", "narrow", "unsqueeze", "squeeze", "flatten", "unflatten", "as_strided", "alias", "split",
        "chunk", "unbind", "select", "movedim", "swapaxes", "T", "mT", "H", "mH", "data",
    }
)  # fmt: skip


class Placeholder(nn.Parameter):
    """A `meta` parameter standing where a compiled module's parameter was: its values live in the
    compiled module's flat shards; it refuses to be read or written (NOTE: [Placeholders refuse values])."""

    compiled_name: str = "a parameter"

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True, name: str = "") -> Placeholder:
        p = super().__new__(cls, data, requires_grad)
        p.compiled_name = name or cls.compiled_name
        return p

    def __deepcopy__(self, memo: dict) -> Placeholder:
        if id(self) not in memo:
            empty = torch.empty(self.shape, dtype=self.dtype, device="meta")
            memo[id(self)] = Placeholder(empty, self.requires_grad, self.compiled_name)
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        kwargs = kwargs or {}
        name = _op_name(func)
        if name == "grad" and _is_getter(func) and not _quiet:
            raise RuntimeError(
                f"fbmt: parameter '{_named(args)}' belongs to a module fbmt.compile took over: it is a placeholder, "
                "and its gradient lives in the compiled model's flat shards (model.parameters(), each rank's part of "
                "every parameter), so its .grad is never set. model.full_gradients() gathers every parameter's "
                "gradient by name (a collective: call it on every rank)"
            )
        with torch._C.DisableTorchFunctionSubclass():
            if _quiet or name in _METADATA or (_is_getter(func) and name not in _VIEWS):
                return func(*args, **kwargs)
            if name in _VIEWS:
                out = func(*args, **kwargs)
                return _placeholders(out, _named(args))
        named = _named([*args, *kwargs.values()])
        if name in _HOOKS:
            raise RuntimeError(_hook_refused(named, name, "the parameter belongs to a module fbmt.compile took over"))
        inplace = (name.endswith("_") and not name.startswith("__")) or name in _INPLACE or "out" in kwargs
        writes = inplace and bool(args) and isinstance(args[0], Placeholder)  # the placeholder is what it writes
        raise RuntimeError(
            f"fbmt: parameter '{named}' belongs to a module fbmt.compile took over: it is a placeholder, and "
            f"its values live in the compiled model's flat shards, so `{name}` on it would "
            f"{'change nothing' if writes else 'compute with no values'}. Read the values with "
            "compiled.state_dict() and write them with compiled.load_state_dict({name: tensor}, strict=False) "
            "(both collectives: call them on every rank), or change the module before compiling it"
        )


_INPLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ipow__"})


# NOTE: [Hooks on a parameter's gradient]
# A hook on a parameter's gradient (`p.register_hook(lambda g: g * mask)`, to train some rows of an
# embedding; `register_post_accumulate_grad_hook`, an optimizer step in the backward) runs where autograd
# computes that parameter's gradient. A compiled model's parameters are placeholders whose gradients
# are never computed: the program computes the flat shards' gradients, each rank its part of the
# batch, and reduces them. A hook on the parameter was dropped at compile, and one registered on the
# placeholder after never ran: the gradients came out unhooked, silently. Traced into the program it
# would see a rank's local gradient before the reduction, which for anything but a linear map (a
# clamp) is not what one process computes. So both are refused, naming the parameter, with the ways
# that work: hooks on the compiled model's parameters (the shards) or a change to the gradients after
# backward.
def _hook_refused(name: str, how: str, why: str) -> str:
    return (
        f"fbmt: a hook on the gradient of parameter '{name}' ({how}) would never run: {why}, and the compiled "
        "program computes the gradients of its flat shards, never this parameter's (NOTE: [Hooks on a "
        "parameter's gradient]). Register such hooks on the compiled model's parameters (its flat shards, "
        "model.parameters(), e.g. an optimizer step in the backward), or change the gradients after backward"
    )


def refuse_gradient_hooks(model: nn.Module) -> None:
    """A parameter of `model` with a hook on its gradient is refused before compile takes it over."""
    for name, p in model.named_parameters(remove_duplicate=False):
        for attribute, how in (
            ("_backward_hooks", "register_hook"),
            ("_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook"),
        ):
            if getattr(p, attribute, None):
                raise ValueError(_hook_refused(name, how, "fbmt.compile replaces the parameter by flat shards"))


def _op_name(func: object) -> str:
    if _is_getter(func):
        return func.__self__.__name__  # the attribute a property reads ("shape", "data", ...)
    return getattr(func, "__name__", str(func))


def _is_getter(func: object) -> bool:
    return getattr(func, "__name__", None) == "__get__" and type(getattr(func, "__self__", None)).__name__ == (
        "getset_descriptor"
    )


def _named(args: object) -> str:
    """The name of the first placeholder among an op's arguments."""
    for a in args if isinstance(args, (list, tuple)) else [args]:
        if isinstance(a, Placeholder):
            return a.compiled_name
        if isinstance(a, (list, tuple)):
            found = _named(a)
            if found != Placeholder.compiled_name:
                return found
    return Placeholder.compiled_name


def _placeholders(out: object, name: str) -> object:
    """A view's results as placeholders of the same parameter."""
    if isinstance(out, torch.Tensor):
        view = out.as_subclass(Placeholder)
        view.compiled_name = name
        return view
    if isinstance(out, (list, tuple)):
        return type(out)(_placeholders(o, name) for o in out)
    return out


_quiet = False  # while fbmt materializes a block: an initializer's writes to other blocks do nothing


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Meanwhile, placeholders let ops run (on meta: they change and compute nothing) instead of raising:
    initializing one block of a model built on meta may touch the others (NOTE: [Materializing shard
    by shard])."""
    global _quiet
    before, _quiet = _quiet, True
    try:
        yield
    finally:
        _quiet = before


_MOVED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # the user's parameter -> _Where
_GROUPS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a flat shard -> its FlatGroup
_TAKEN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a module compile took over -> True


@dataclass(frozen=True)
class Moved:
    """Where the values of a parameter compile replaced went: `slot` of this rank's flat `shard`."""

    name: str
    shard: torch.Tensor
    group: FlatGroup
    slot: ParamSlot
    rank: int

    def local(self) -> tuple[int, int, int]:
        """This rank's elements of the parameter: shard[lo:hi] holds its flat elements from `start` on
        (lo >= hi: none)."""
        base = self.rank * self.group.shard_numel
        lo, hi = local_range(self.group, self.slot, self.rank)
        return lo - base, hi - base, lo - self.slot.offset


@dataclass(frozen=True)
class _Where:
    """A `Moved`, its shard held weakly: an optimizer the user keeps must not keep a dropped model's shards."""

    name: str
    shard: weakref.ref | None = None
    group: FlatGroup | None = None
    slot: ParamSlot | None = None
    rank: int = 0


_replaced = 0  # parameters compile replaced in this process, ever


def moved(p: torch.Tensor, name: str, into: Moved | None = None) -> None:
    """`p` (named `name` in its model) was replaced by a placeholder, its values copied `into` a flat shard
    where they went to one."""
    global _replaced
    _replaced += 1
    _MOVED[p] = (
        _Where(name) if into is None else _Where(name, weakref.ref(into.shard), into.group, into.slot, into.rank)
    )


def replaced() -> int:
    """How many parameters compile has replaced in this process: what was learnt of an optimizer's
    parameters (whether one was replaced) holds until this changes."""
    return _replaced


def moved_name(p: torch.Tensor) -> str | None:
    """The name of a parameter compile replaced with a placeholder; None for any other tensor."""
    where = _MOVED.get(p)
    return where.name if where is not None else None


def moved_into(p: torch.Tensor) -> Moved | None:
    """Where the values of a parameter compile replaced went, while its shard lives; None for any other
    tensor."""
    where = _MOVED.get(p)
    shard = where.shard() if where is not None and where.shard is not None else None
    return None if shard is None else Moved(where.name, shard, where.group, where.slot, where.rank)


def own_shards(shards: list[nn.Parameter], groups: tuple[FlatGroup, ...]) -> None:
    """Remember each shard's group."""
    for shard, group in zip(shards, groups):
        _GROUPS[shard] = group


def group_of(shard: torch.Tensor) -> FlatGroup | None:
    """The flat group of a compiled module's shard; None for any other tensor."""
    return _GROUPS.get(shard)


def take(module: nn.Module) -> None:
    """Every module of `module`'s tree now belongs to a compiled module."""
    for m in module.modules():
        _TAKEN[m] = True


def taken(module: nn.Module) -> str | None:
    """The path of the first module of the tree that a compiled module took over (a copy of one
    included: it holds placeholders), or None."""
    for path, m in module.named_modules():
        if m in _TAKEN or any(isinstance(p, Placeholder) for p in m._parameters.values()):
            return path
    return None
