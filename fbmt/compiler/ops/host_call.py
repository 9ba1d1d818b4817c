"""A Python function the program calls on the host at every call (NOTE: [Host calls] in
fbmt/compiler/host_calls.py).

`fbmt::host_call` runs the function at `path` (`module:qualname`) on the call's values and converts its
result as `torch.tensor(result, dtype=, device=)` does, where the model's code converted it. Its
arguments travel as JSON (`arguments`) with the tensors and symbolic sizes among them apart, so the
op is one node a saved program can hold. It draws (numpy's generator, for SpecAugment): effectful
(ops/tables.py), so no pass drops, repeats or recomputes it, and `after`, the results of the host
calls before it, keeps the draws in eager's order.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any

import torch

_SCHEMA = (
    "(str path, str arguments, Tensor[] tensors, SymInt[] ints, SymInt[] shape, Tensor[] after, "
    "ScalarType dtype, Device device) -> Tensor"
)


def encode(args: tuple, kwargs: dict, why: Any) -> tuple[str, list[torch.Tensor], list[Any]]:
    """`(args, kwargs)` as JSON (`{"args": [...], "kwargs": {...}}`, a tuple as `{"tuple": [...]}`), with
    their tensors (`{"tensor": i}`) and symbolic sizes (`{"int": i}`) apart; `why(value)` raises for a value
    the JSON cannot hold."""
    tensors: list[torch.Tensor] = []
    ints: list[Any] = []

    def held(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return {"tensor": len(tensors) - 1}
        if isinstance(x, torch.SymInt):
            ints.append(x)
            return {"int": len(ints) - 1}
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if isinstance(x, tuple | list):
            return {type(x).__name__: [held(v) for v in x]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": {k: held(v) for k, v in x.items()}}
        why(x)

    arguments = {"args": [held(a) for a in args], "kwargs": {k: held(v) for k, v in kwargs.items()}}
    return json.dumps(arguments), tensors, ints


def decode(arguments: str, tensors: list[torch.Tensor], ints: list[Any]) -> tuple[tuple, dict]:
    def value(x: Any) -> Any:
        if not isinstance(x, dict):
            return x
        (kind, v), *_ = x.items()
        if kind == "tensor":
            return tensors[v]
        if kind == "int":
            return ints[v]
        if kind == "dict":
            return {k: value(e) for k, e in v.items()}
        return (tuple if kind == "tuple" else list)(value(e) for e in v)

    held = json.loads(arguments)
    return tuple(value(a) for a in held["args"]), {k: value(v) for k, v in held["kwargs"].items()}


@functools.cache
def function(path: str) -> Any:
    """The function at `module:qualname`."""
    module, _, name = path.partition(":")
    f: Any = importlib.import_module(module)
    for part in name.split("."):
        f = getattr(f, part)
    return f


@torch.library.custom_op("fbmt::host_call", mutates_args=(), schema=_SCHEMA)
def host_call(
    path: str,
    arguments: str,
    tensors: list[torch.Tensor],
    ints: list[int],
    shape: list[int],
    after: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    args, kwargs = decode(arguments, tensors, ints)
    out = torch.tensor(function(path)(*args, **kwargs), dtype=dtype, device=device)
    if tuple(out.shape) != tuple(shape):
        raise RuntimeError(
            f"fbmt: the host function {path} returned a result of shape {tuple(out.shape)} where the "
            f"program was traced for {tuple(shape)} at this call's sizes"
        )
    return out


@host_call.register_fake
def _host_call_fake(path, arguments, tensors, ints, shape, after, dtype, device):  # noqa: ANN001, ANN202
    return torch.empty(shape, dtype=dtype, device=device)
