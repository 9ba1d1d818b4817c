"""Recording ops: `fbmt::record` and `fbmt::record_grad` report a value (or its gradient) to the
active recorder while a program runs. BMTrain's `inspect.record_tensor` emits them when it is called
inside a model being traced; outside one they are ordinary calls.

A recorder is any object with `on_value(name, tensor)` and `on_grad(name, tensor)`; `recording(r)` makes
it the active one for a block of code. Programs traced while one is active carry these ops, and
programs traced without one do not, so `active()` is part of a compiled module's cache key. The ops
report from the host, so a program that holds them is never replayed as a CUDA graph.
"""

from __future__ import annotations

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


RECORD = torch.ops.fbmt.record.default
RECORD_GRAD = torch.ops.fbmt.record_grad.default
OPS = frozenset((RECORD, RECORD_GRAD))


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
