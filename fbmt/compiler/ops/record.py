"""Host ops: `fbmt::record` and `fbmt::record_grad` report a value (or its gradient) to the
active recorder while a program runs, and `fbmt::print` is a `print()` inside a traced forward.
BMTrain's `inspect.record_tensor` emits the first two when it is called inside a model being traced;
outside one they are ordinary calls.

A recorder is any object with `on_value(name, tensor)` and `on_grad(name, tensor)`; `recording(r)` makes
it the active one for a block of code. Programs traced while one is active carry these ops, and
programs traced without one do not, so `active()` is part of a compiled module's cache key. The ops
report from the host, so a program that holds them is never replayed as a CUDA graph.

`print(...)` in a forward would otherwise run once, while tracing, and show fake tensors; `trace`
turns each call into `fbmt::print(tensors, template)`, which prints the real values on every call.
"""

from __future__ import annotations

import builtins
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch


class Recorder(Protocol):
    def on_value(self, name: str, x: torch.Tensor) -> None: ...

    def on_grad(self, name: str, g: torch.Tensor) -> None: ...


_recorders: list[Recorder] = []


def active() -> bool:
    """Is a recorder collecting."""
    return bool(_recorders)


@contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    _recorders.append(recorder)
    try:
        yield recorder
    finally:
        _recorders.remove(recorder)


@torch.library.custom_op("fbmt::record", mutates_args=())
def _record(x: torch.Tensor, name: str) -> None:
    if _recorders:
        _recorders[-1].on_value(name, x)


@_record.register_fake
def _(x: torch.Tensor, name: str) -> None:
    return None


@torch.library.custom_op("fbmt::record_grad", mutates_args=())
def _record_grad(g: torch.Tensor, name: str) -> None:
    if _recorders:
        _recorders[-1].on_grad(name, g)


@_record_grad.register_fake
def _(g: torch.Tensor, name: str) -> None:
    return None


@torch.library.custom_op("fbmt::print", mutates_args=())
def _print(tensors: list[torch.Tensor], template: str) -> None:
    parts, sep, end, stream = json.loads(template)
    words = [str(tensors[p]) if isinstance(p, int) else p for p in parts]
    print(*words, sep=sep, end=end, file=getattr(sys, stream), flush=True)


@_print.register_fake
def _(tensors: list[torch.Tensor], template: str) -> None:
    return None


RECORD = torch.ops.fbmt.record.default
RECORD_GRAD = torch.ops.fbmt.record_grad.default
PRINT = torch.ops.fbmt.print.default
OPS = frozenset((RECORD, RECORD_GRAD, PRINT))


def record(x: torch.Tensor, name: str) -> None:
    """Report `x` now, and its gradient once autograd computes it, to the active recorder."""
    if not _recorders or not isinstance(x, torch.Tensor):
        return
    RECORD(x, name)
    if x.requires_grad:
        x.register_hook(lambda g: RECORD_GRAD(g, name))


def holds_records(graph: Any) -> bool:
    """Does an fx graph call a recording op."""
    return any(n.target in OPS for n in graph.nodes)


class PrintError(RuntimeError):
    """A print() inside a traced forward that formats a tensor into a string."""


@contextmanager
def prints_traced(where: Any) -> Iterator[None]:
    """While tracing: `print(...)` becomes an `fbmt::print` op of the program (see the module
    docstring). `where()` names the module being traced, for the error about formatted tensors."""
    original = builtins.print

    def traced_print(*args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None, flush: bool = False):
        stream = {None: "stdout", sys.stdout: "stdout", sys.stderr: "stderr"}.get(file)
        if stream is None:  # a file of the user's: print() into it runs once, as in any trace
            return original(*args, sep=sep, end=end, file=file, flush=flush)
        tensors, parts = [], []
        for a in args:
            if isinstance(a, torch.Tensor):
                parts.append(len(tensors))
                tensors.append(a)
            else:
                text = str(a)
                if "FakeTensor(" in text or "FunctionalTensor(" in text:
                    raise PrintError(
                        f"print() in the forward of {where()} formats a tensor into a string while "
                        "fbmt traces it, where the tensor has no values; pass the tensor as an argument "
                        "of its own, print('x =', x), and fbmt prints its values on every call"
                    )
                parts.append(text)
        PRINT(tensors, json.dumps([parts, " " if sep is None else sep, "\n" if end is None else end, stream]))

    builtins.print = traced_print
    try:
        yield
    finally:
        builtins.print = original
