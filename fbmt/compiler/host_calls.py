"""Functions of a model's code that the program calls on the host at every call (NOTE: [Host calls]).

NOTE: [Host calls]
Some forwards compute on the host what no program can: wav2vec2's SpecAugment (HuBERT's, WavLM's, and
the other speech encoders', on in training by default) draws its masked spans with numpy, as many as
each row's length allows (read from the attention mask with `.tolist()`), and the forward turns the
array into a tensor with `torch.tensor(spans, device=..., dtype=torch.bool)`. A trace would hold one
draw as a constant (NOTE: [Host draws]), and cannot read the lengths at all.

A function registered here (`register`: the Hugging Face integration registers `_compute_mask_indices`
wherever transformers' modeling modules define or import it) is a host call. While the model is traced,
the name its module calls it by is a stand-in returning a `HostArray` that holds the call; where the
model's code converts that (`torch.tensor(a, dtype=..., device=...)`, `torch.as_tensor`, `torch.from_numpy`), the trace
records one `fbmt::host_call` node (fbmt/compiler/ops/host_call.py), which calls the function on the
call's values at every call, its result's shape as the registration says for the traced sizes
(symbolic ones included). So a program draws where eager draws, from the same generator and in the
same order (each call's node waits for the one before): given the same numpy seed, eager's masks.
A `HostArray` is good for that conversion alone: any other use of it on the host is refused, naming
the line, as is one never converted or converted out of the order of the calls (the program's draws
would then differ from eager's).

The node runs Python and reads values on the host, as eager's call does: a program holding one runs
without CUDA graphs (`cuda_graph=True` replays no host work).
"""

from __future__ import annotations

import inspect
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from fbmt.compiler.ops import host_call
from fbmt.logs import user_line


def said(graph: Any) -> list[str]:
    """One line per host call in a traced graph, for the program's summary."""
    return [
        f"{n.name} calls {n.args[0].partition(':')[2]} on the host at every call (NOTE: [Host calls]; no CUDA graphs)"
        for n in graph.find_nodes(op="call_function", target=torch.ops.fbmt.host_call.default)
    ]


@dataclass(frozen=True)
class HostFunction:
    """A function called on the host at every call: `namespace.name` is how the model's code calls it,
    `result(bound)` the shape and dtype of its result given its bound arguments."""

    namespace: ModuleType
    name: str
    result: Callable[[inspect.BoundArguments], tuple[tuple, torch.dtype]]


_FINDERS: list[Callable[[], Iterable[HostFunction]]] = []


def register(finder: Callable[[], Iterable[HostFunction]]) -> None:
    """Add `finder`, called at each trace, for the host functions of the modules loaded by then."""
    _FINDERS.append(finder)


class Calls:
    """The host calls of one run of a forward while it is traced."""

    def __init__(self, error: type[Exception]) -> None:
        self.error = error
        self.made: list[HostArray] = []
        self.last: torch.Tensor | None = None  # the latest host call's result: the next one waits for it

    @contextmanager
    def installed(self) -> Iterator[None]:
        """The registered functions, called by their modules' names, are stand-ins within."""
        saved = []
        for finder in _FINDERS:
            for h in finder():
                f = vars(h.namespace).get(h.name)  # its own names: a lazy module imports on a missing one
                if f is None or isinstance(f, _StandIn):
                    continue
                saved.append((h.namespace, h.name, f))
                setattr(h.namespace, h.name, _StandIn(self, f, h))
        try:
            yield
            waiting = [a for a in self.made if not a.converted]
            if waiting:
                raise waiting[0].refused("never turned into a tensor", waiting[0].line)
        finally:
            for namespace, name, f in saved:
                setattr(namespace, name, f)


class _StandIn:
    """A registered function while the model is traced: its call, held for the conversion."""

    def __init__(self, calls: Calls, f: Callable[..., Any], h: HostFunction) -> None:
        self.calls, self.f, self.h = calls, f, h
        self.signature = inspect.signature(f)

    def __call__(self, *args: Any, **kwargs: Any) -> HostArray:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        shape, dtype = self.h.result(bound)
        line = user_line(traceback.extract_stack()[:-1])
        made = HostArray(self.calls, self.f, args, kwargs, tuple(shape), dtype, line)
        self.calls.made.append(made)
        return made


class HostArray:
    """A host call's result while traced: it becomes the program's node where a tensor is made of it."""

    def __init__(
        self,
        calls: Calls,
        f: Callable[..., Any],
        args: tuple,
        kwargs: dict,
        shape: tuple,
        dtype: torch.dtype,
        line: str | None,
    ) -> None:
        self._held = (calls, f, args, kwargs, shape, dtype, line)
        self.converted = False

    @property
    def line(self) -> str | None:
        return self._held[6]

    def tensor(
        self,
        dtype: torch.dtype | None = None,
        device: torch.device | str | int | None = None,
        requires_grad: bool = False,
        **unsupported: Any,
    ) -> torch.Tensor:
        """`torch.tensor(self, dtype=, device=)`: the program's call of the function, at every call."""
        calls, f, args, kwargs, shape, declared, line = self._held
        at = user_line(traceback.extract_stack()[:-1])
        if requires_grad or any(v not in (None, False) for v in unsupported.values()):
            raise self.refused("made a tensor with " + ", ".join(["requires_grad", *unsupported]), at)
        earlier = [a for a in calls.made[: next(i for i, a in enumerate(calls.made) if a is self)] if not a.converted]
        if earlier:
            raise earlier[0].refused(f"turned into a tensor after a later call's result (at {at})", earlier[0].line)

        def unheld(value: Any) -> None:
            raise self.refused(f"called with a {type(value).__name__}, which a program cannot pass it again", line)

        arguments, tensors, ints = host_call.encode(args, kwargs, unheld)
        out = torch.ops.fbmt.host_call(
            f"{f.__module__}:{f.__qualname__}",
            arguments,
            tensors,
            ints,
            list(shape),
            [] if calls.last is None else [calls.last],
            dtype if dtype is not None else declared,
            torch.device(device) if device is not None else torch.get_default_device(),
        )
        calls.last, self.converted = out, True
        return out

    def refused(self, what: str, line: str | None) -> Exception:
        calls, f, *_ = self._held
        return calls.error(
            f"fbmt.compile: the result of {f.__qualname__}(), which a program calls on the host at every call "
            f"(NOTE: [Host calls]), is {what}" + (f"\n  at {line}" if line else "") + "\n  why: a program can "
            "only make a tensor of it (torch.tensor(result, dtype=..., device=...)), where each call's result "
            "then goes; a use on the host would run on this trace's values alone"
        )

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise self.refused("used as a numpy array", user_line(traceback.extract_stack()[:-1]))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # protocols Python looks up (copy, pickle): not there
            raise AttributeError(name)
        raise self.refused(f"read for .{name}", user_line(traceback.extract_stack()[:-1]))

    def _misused(self, *args: Any) -> Any:
        raise self.refused("used on the host", user_line(traceback.extract_stack()[:-1]))

    __getitem__ = __setitem__ = __len__ = __iter__ = __bool__ = __add__ = __mul__ = _misused
