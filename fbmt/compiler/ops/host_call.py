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
import torch.utils._pytree as pytree

_SCHEMA = (
    "(str path, str arguments, Tensor[] tensors, SymInt[] ints, SymInt[] shape, Tensor[] after, "
    "ScalarType dtype, Device device) -> Tensor"
)


def encode(args: tuple, kwargs: dict, why: Any) -> tuple[str, list[torch.Tensor], list[Any]]:
    """`(args, kwargs)` as JSON, with their tensors and symbolic sizes apart; `why(leaf)` raises for
    a value the JSON cannot hold."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    tensors, ints, held = [], [], []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            held.append({"tensor": len(tensors)})
            tensors.append(leaf.detach())
        elif isinstance(leaf, torch.SymInt):
            held.append({"int": len(ints)})
            ints.append(leaf)
        elif leaf is None or isinstance(leaf, bool | int | float | str):
            held.append({"value": leaf})
        else:
            why(leaf)
    return json.dumps({"spec": pytree.treespec_dumps(spec), "leaves": held}), tensors, ints


def decode(arguments: str, tensors: list[torch.Tensor], ints: list[Any]) -> tuple[tuple, dict]:
    held = json.loads(arguments)
    leaves = [
        tensors[x["tensor"]] if "tensor" in x else ints[x["int"]] if "int" in x else x["value"] for x in held["leaves"]
    ]
    return pytree.tree_unflatten(leaves, pytree.treespec_loads(held["spec"]))


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
