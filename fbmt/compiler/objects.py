"""Objects in a call's arguments and results that hold tensors without being pytrees.

torch's pytree flattens tuples, lists, dicts and registered classes (Hugging Face's `ModelOutput`
is one); anything else is a leaf. Some leaves hold tensors all the same, the one that matters most
being a Hugging Face cache (`DynamicCache` -> `layers` -> `keys`, `values`): `generate()` passes
one in, the forward grows it, and the output returns it. A program sees only tensors, so fbmt
treats such an object as its tensors plus a template:

- `tensors_in(obj)`: the tensors reachable through its attributes, lists, tuples and dicts, each
  once, in a fixed order (attribute order, then item order), so two objects built the same way
  give their tensors in the same order.
- `fingerprint(obj)`: what a program built for this object depends on: its types, every tensor's
  shape, dtype, device and requires_grad, and every plain value (ints, bools, strings). Two calls
  whose objects share a fingerprint run the same program; `differences` says where two differ.
- `rebuild(template, tensors)`: a deep copy of `template` with its tensors (in `tensors_in`
  order) replaced by `tensors`: what tracing calls the forward with (fake tensors, so the caller's
  object is never touched), and what the compiled model returns (the program's real outputs).
- `state(obj)`, `changes(before, after)`, `put(obj, path, value)`: what a call did to an object,
  leaf by leaf, and doing it again elsewhere (a stamped block's writes to a cache, NOTE: [Stamped
  blocks]).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import types
from typing import Any

import torch
import torch.nn as nn

# values a program keeps as they are (the compile cache saves them as such)
PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, enum.Enum)
_OPAQUE = (type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType, nn.Module)


def is_object(x: Any) -> bool:
    """A pytree leaf that is neither a tensor nor a plain value, and has attributes to look into."""
    return not isinstance(x, (torch.Tensor, *PLAIN, *_OPAQUE)) and hasattr(x, "__dict__")


def _children(x: Any) -> list[Any]:
    if isinstance(x, dict):
        return list(x.values())
    if isinstance(x, (list, tuple)):
        return list(x)
    if is_object(x):
        return list(vars(x).values())
    return []


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """Every tensor reachable from `obj`, once each, in a fixed order."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            found.setdefault(id(x), x)
        elif id(x) not in seen:
            seen.add(id(x))
            for c in _children(x):
                walk(c)

    walk(obj)
    return list(found.values())


def fingerprint(obj: Any) -> Any:
    """A hashable summary of `obj` that decides the program a call with it runs (module docstring)."""
    seen: dict[int, int] = {}

    def fp(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), x.dtype, x.device, x.requires_grad)
        if isinstance(x, PLAIN):
            return x
        if isinstance(x, _OPAQUE):
            return ("opaque", id(x))
        if id(x) in seen:  # shared or cyclic: the structure says where it was seen first
            return ("seen", seen[id(x)])
        seen[id(x)] = len(seen)
        if isinstance(x, dict):
            return (type(x), tuple((k, fp(v)) for k, v in x.items()))
        if isinstance(x, (list, tuple)):
            return (type(x), tuple(fp(v) for v in x))
        if is_object(x):
            return (type(x), tuple((k, fp(v)) for k, v in vars(x).items()))
        if isinstance(x, numbers.Number):  # NumPy scalars
            return (type(x), x)
        raise TypeError(
            f"fbmt: an argument object ({type(obj).__name__}) holds a {type(x).__name__}, which fbmt cannot compare "
            "between calls (so it cannot tell whether a compiled program still fits); pass tensors, plain values, "
            "or lists, dicts and objects of them"
        )

    return fp(obj)


def differences(old: Any, new: Any, path: tuple = ()) -> list[tuple[tuple, Any, Any]]:
    """Where two `fingerprint`s differ, as (path from the object, old, new): the path in `state`'s steps
    (`path_text` writes it as `.layers[0].cumulative_length`), old and new a value, a tensor's
    `("T", shape, ...)`, or a part whose structure differs as a whole."""
    if old == new:
        return []
    same_kind = isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new) == 2
    if same_kind and isinstance(old[0], type) and old[0] is new[0] and isinstance(old[1], tuple):
        kind, a, b = old[0], old[1], new[1]
        keyed = kind is dict or not issubclass(kind, (list, tuple))  # (key, fingerprint) pairs: dicts, objects
        if len(a) == len(b) and (not keyed or [k for k, _ in a] == [k for k, _ in b]):
            found = []
            for i, (x, y) in enumerate(zip(a, b)):
                if keyed:
                    found += differences(x[1], y[1], (*path, ("key" if kind is dict else "attr", x[0])))
                else:
                    found += differences(x, y, (*path, ("item", i)))
            return found
    return [(path, old, new)]


def path_text(path: tuple) -> str:
    """A path of `state`'s steps as a user writes it after the object's name: `.layers[0].cumulative_length`."""
    return "".join(f".{k}" if how == "attr" else f"[{k!r}]" for how, k in path)


def replaced(fp: Any, path: tuple, value: Any) -> Any:
    """The `fingerprint` `fp` with the value at `path` (`state`'s steps) replaced by `value`; `fp` itself
    where nothing is there."""
    if not path:
        return value
    if not (isinstance(fp, tuple) and len(fp) == 2 and isinstance(fp[0], type) and isinstance(fp[1], tuple)):
        return fp
    (how, k), rest = path[0], path[1:]
    kind, parts = fp
    if how == "item":
        if not issubclass(kind, (list, tuple)) or not 0 <= k < len(parts):
            return fp
        return (kind, (*parts[:k], replaced(parts[k], rest, value), *parts[k + 1 :]))
    return (kind, tuple((name, replaced(v, rest, value) if name == k else v) for name, v in parts))


def rebuild(template: Any, tensors: list[torch.Tensor]) -> Any:
    """A deep copy of `template` whose tensors (in `tensors_in` order) are `tensors`."""
    old = tensors_in(template)
    if len(old) != len(tensors):
        raise ValueError(f"{type(template).__name__} holds {len(old)} tensors, {len(tensors)} were given")
    return copy.deepcopy(template, {id(t): n for t, n in zip(old, tensors)})


def update_in_place(target: Any, source: Any) -> None:
    """Make `target` (the caller's object) hold what `source` holds, attribute by attribute."""
    state = vars(target)
    state.clear()
    state.update(vars(source))


def input_tensors(leaves: list[Any]) -> list[torch.Tensor]:
    """A call's tensors in the order a program takes them: the tensor leaves, then each object's."""
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    for x in leaves:
        if is_object(x):
            tensors += tensors_in(x)
    return tensors


class DroppedCache:
    """What a training call returns for a cache its forward built (a Hugging Face `DynamicCache`),
    unless `use_cache=True` is passed: keeping it would make every layer's keys and values outputs
    of the program, each with a gradient buffer in the backward. Any use of it raises."""

    def __init__(self, what: str):
        self._what = what

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"fbmt: this training call did not keep the {self._what} its forward built (a program output "
            "for every layer's keys and values, and their gradients); pass use_cache=True in the call to "
            "get it, or use_cache=False to say it is not needed"
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_what":
            raise AttributeError(name)
        self._refuse()

    __bool__ = __len__ = __iter__ = __getitem__ = __call__ = _refuse

    def __repr__(self) -> str:
        return f"<{self._what} not kept by fbmt in a training call: pass use_cache=True to keep it>"


MISSING = ("missing",)  # what `get` gives for a path that holds nothing; `put` of it deletes the attribute


@dataclasses.dataclass(frozen=True)
class Size:
    """A number an object holds after a call of a program of symbolic sizes, as an expression in its
    symbols (the cache's count of tokens, one more than the number it was given: NOTE: [Numbers in an
    object]); `value` is the number at a call's sizes."""

    expr: Any  # a sympy expression

    def value(self, sizes: dict[Any, int]) -> int:
        return int(self.expr.xreplace(sizes))

    def __deepcopy__(self, memo: dict) -> Size:  # immutable: every copy of a template shares it
        return self


def number_at(leaves: list[Any], where: tuple[int, tuple]) -> int | None:
    """The int at `where` (an argument leaf, and a path in it of `state`'s steps); None where there is none."""
    i, path = where
    leaf = get(leaves[i], path) if i < len(leaves) else MISSING
    ok = isinstance(leaf, tuple) and len(leaf) == 3 and leaf[0] == "plain" and leaf[1] is int
    return leaf[2] if ok else None


def sized(template: Any) -> list[tuple[tuple, Size]]:
    """The numbers in `template` (an object as a symbolic trace left it) that are sizes (SymInts), made
    `Size`s in place, by path: a template keeps no SymInt, which belongs to its trace (and cannot be saved)."""
    found = []
    for path, leaf in state(template).items():
        if isinstance(leaf, tuple) and leaf[0] == "plain" and isinstance(leaf[2], torch.SymInt):
            size = Size(leaf[2].node.expr)
            put(template, path, ("plain", Size, size))
            found.append((path, size))
    return found


def state(obj: Any) -> dict[tuple, Any]:
    """Every leaf reachable from `obj`, by path (("attr", name), ("item", i), ("key", k) steps): a tensor
    (itself), ("plain", type, value), ("opaque", id), and for each container or object on the way
    ("node", type, size, id), so a container replaced, resized or shared anew shows as a change."""
    out: dict[tuple, Any] = {}
    seen: set[int] = set()

    def walk(x: Any, path: tuple) -> None:
        if isinstance(x, torch.Tensor):
            out[path] = x
        elif isinstance(x, (*PLAIN, numbers.Number, torch.SymInt, Size)):
            out[path] = ("plain", type(x), x)
        elif isinstance(x, _OPAQUE):
            out[path] = ("opaque", id(x))
        elif id(x) in seen:
            out[path] = ("seen", id(x))
        else:
            seen.add(id(x))
            if isinstance(x, dict):
                out[path] = ("node", type(x), tuple(x), id(x))
                for k, v in x.items():
                    walk(v, (*path, ("key", k)))
            elif isinstance(x, (list, tuple)):
                out[path] = ("node", type(x), len(x), id(x))
                for i, v in enumerate(x):
                    walk(v, (*path, ("item", i)))
            elif is_object(x):
                out[path] = ("node", type(x), None, id(x))
                for k, v in vars(x).items():
                    walk(v, (*path, ("attr", k)))
            else:
                out[path] = ("other", id(x))

    walk(obj, ())
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if any(isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.SymInt) for x in (a, b)):
        # sizes as expressions: comparing them as numbers would add a guard to the trace
        return a[:2] == b[:2] and a[2].node.expr == b[2].node.expr
    try:
        return bool(a == b)
    except Exception:  # a value whose == is not a bool
        return False


def changes(before: dict[tuple, Any], after: dict[tuple, Any]) -> list[tuple[tuple, Any]] | None:
    """The leaves of `after` that `before` did not hold, by path, in `after`'s order: a tensor, or
    ("plain", type, value). None where more changed than leaves of the objects already there (a path
    gone, a container or object replaced, resized or added, an opaque value changed)."""
    if any(p not in after for p in before):
        return None
    out = []
    for path, leaf in after.items():
        old = before.get(path, MISSING)
        if _same(old, leaf):
            continue
        if not (isinstance(leaf, torch.Tensor) or leaf[0] == "plain"):
            return None
        if old is not MISSING and not (isinstance(old, torch.Tensor) or old[0] == "plain"):
            return None
        out.append((path, leaf))
    return out


def _step(x: Any, step: tuple) -> Any:
    how, k = step
    return getattr(x, k) if how == "attr" else x[k]


def put(obj: Any, path: tuple, leaf: Any) -> None:
    """Set the leaf at `path` (a tensor, or ("plain", type, value)) in `obj`; `MISSING`: delete the
    attribute there."""
    *head, (how, k) = path
    for step in head:
        obj = _step(obj, step)
    if leaf is MISSING:
        delattr(obj, k)
        return
    value = leaf if isinstance(leaf, torch.Tensor) else leaf[2]
    if how == "attr":
        setattr(obj, k, value)
    else:
        obj[k] = value


def get(obj: Any, path: tuple) -> Any:
    """The leaf at `path` in `obj`, as `state` gives it (`MISSING` where there is none)."""
    try:
        for step in path:
            obj = _step(obj, step)
    except (AttributeError, KeyError, IndexError, TypeError):
        return MISSING
    return obj if isinstance(obj, torch.Tensor) else state(obj)[()]
