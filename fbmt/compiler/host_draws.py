"""Draws from the host's random generators in a traced forward (NOTE: [Host draws]).

NOTE: [Host draws]
A forward that draws from Python's `random` or numpy's generator (LayerDrop written with
`np.random.random()`, an augmentation that picks its crop with `random.randint`) computes on numbers
the trace sees as constants: a program would replay this trace's draws at every call, where eager
draws anew, and train on other values, silently. So while the fake forward runs, the functions of
`random` and `numpy.random` are watched (the first draw's module and line are kept), and the
generators' states, and those of the generator objects the modules hold (`self.rng`), are compared
before and after. A forward that seeds a generator before it draws from it (BigBird's random
attention runs `np.random.seed(layer)`) draws the same numbers at every call, which a program can
hold; eager leaves the generator where those draws took it, and so does each call of the program
(the state the trace's forward left it in, set again after the call: `leave`). Any other draw is
refused, naming the module and the line, with what to do instead: torch's random functions, which a
program runs at every call, or the draw made outside the model and passed in. (Functions registered
as host calls, SpecAugment's among them, run at every call instead: NOTE: [Host calls].)
"""

from __future__ import annotations

import random
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from fbmt.logs import user_line

_PYTHON_SEEDS = ("seed", "setstate")
_NUMPY_SEEDS = ("seed", "set_state")


def _numpy() -> Any:
    """numpy, where something has imported it (a forward that draws from it has)."""
    return sys.modules.get("numpy")


def _state(gen: Any) -> Any:
    """A comparable copy of a generator's state."""
    if isinstance(gen, random.Random):
        return gen.getstate()
    np = _numpy()
    if isinstance(gen, np.random.RandomState):
        name, keys, *rest = gen.get_state()
        return name, keys.tobytes(), *rest
    return repr(gen.bit_generator.state)  # a numpy Generator: a dict of ints and arrays


def _generators(module: nn.Module) -> list[tuple[str, Any]]:
    """The global generators and those the modules hold, each with the name a message gives it."""
    np = _numpy()
    kinds: tuple[type, ...] = (random.Random,)
    found = [("random", random._inst)]  # type: ignore[attr-defined]  # named as _Watch names them
    if np is not None:
        kinds += (np.random.RandomState, np.random.Generator)
        found.append(("numpy.random", np.random.mtrand._rand))
    for path, m in module.named_modules():
        for attr, v in vars(m).items():
            if isinstance(v, kinds):
                found.append((f"{path + '.' if path else ''}{attr} ({type(v).__name__})", v))
    return found


class _Watch:
    """The generators' functions while the fake forward runs: which generators it seeded before
    drawing, and where it first drew from one it had not seeded."""

    def __init__(self, where: Callable[[], str | None]) -> None:
        self.where = where
        self.thread = threading.get_ident()  # the forward's; another thread's calls are not the model's
        self.seeded: set[str] = set()
        self.drawn: set[str] = set()
        self.elsewhere: set[str] = set()  # generators another thread called meanwhile
        self.unseeded: tuple[str, str, str] | None = None  # (generator, module, line) of the first such draw

    def wrap(self, gen: str, name: str, f: Callable[..., Any], seeds: bool) -> Callable[..., Any]:
        def watched(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.thread:
                self.elsewhere.add(gen)
            elif seeds:
                value = args[0] if args else next(iter(kwargs.values()), None)
                if gen not in self.drawn and value is not None:
                    self.seeded.add(gen)  # a seed of its own (none seeds from the OS: not the same each call)
            elif gen not in self.seeded and self.unseeded is None:
                where = self.where()
                line = user_line(traceback.extract_stack()[:-1])
                self.unseeded = (f"{gen}.{name}()", "<root>" if where == "" else where or "<unknown>", line)
            if not seeds and threading.get_ident() == self.thread:
                self.drawn.add(gen)
            return f(*args, **kwargs)

        return watched

    @contextmanager
    def installed(self) -> Iterator[None]:
        namespaces = [(random, "random", random._inst, _PYTHON_SEEDS)]  # type: ignore[attr-defined]
        np = _numpy()
        if np is not None:
            namespaces.append((np.random, "numpy.random", np.random.mtrand._rand, _NUMPY_SEEDS))
        saved = []
        for space, gen, inst, seeds in namespaces:
            for name, f in list(vars(space).items()):
                if getattr(f, "__self__", None) is inst or name in seeds:
                    saved.append((space, name, f))
                    setattr(space, name, self.wrap(gen, name, f, name in seeds))
        try:
            yield
        finally:
            for space, name, f in saved:
                setattr(space, name, f)


@contextmanager
def refused(
    module: nn.Module, where: Callable[[], str | None], error: type[Exception]
) -> Iterator[list[tuple[str, Any]]]:
    """Within (the fake forward): raises `error` where the forward drew from a host generator it had not
    seeded (NOTE: [Host draws]); `where()` is the path of the module running. Gives a list that holds,
    after, each global generator the forward seeded with the state it left it in (for `leave`)."""
    generators = _generators(module)
    watch = _Watch(where)
    left: list[tuple[str, Any]] = []
    with watch.installed():  # the states read while watched: another thread's calls between are seen
        before = [_state(g) for _, g in generators]
        yield left
        changed = [name for (name, g), s in zip(generators, before) if _state(g) != s]
        left.extend((name, _GETS[name]()) for name in sorted(watch.seeded - watch.elsewhere))
    # a state another thread's calls changed is not the forward's to answer for
    changed = [name for name in changed if name not in watch.seeded and name not in watch.elsewhere]
    if not changed and watch.unseeded is None:
        return
    if watch.unseeded is not None:
        what, path, line = watch.unseeded
        said = f"'{path}' ({_class(module, path)}): it calls {what}" + (f"\n  at {line}" if line else "")
    else:
        names = ", ".join("Python's random" if name == "random" else name for name in changed)
        said = f"'<root>' ({type(module).__name__}): it draws from {names}"
    raise error(
        f"fbmt.compile could not trace module {said}\n  why: a number drawn on the host is a constant of "
        "the traced program, which would use this trace's draw at every call where eager draws anew. Draw "
        "with torch's random functions (torch.rand, torch.randint, torch.randperm, torch.bernoulli), which "
        "the program runs at every call, or draw outside the model and pass the result in" + _hint(module) + "."
    )


# by the generators themselves: the modules' functions are watched while the forward runs
_GETS = {"random": lambda: random._inst.getstate(), "numpy.random": lambda: _numpy().random.mtrand._rand.get_state()}
_SETS = {
    "random": lambda state: random._inst.setstate(state),
    "numpy.random": lambda state: _numpy().random.mtrand._rand.set_state(state),
}


def leave(left: list[tuple[str, Any]]) -> None:
    """Set the generators a forward seeded to where the traced forward left them, as eager's call leaves
    them (NOTE: [Host draws])."""
    for name, state in left:
        _SETS[name](state)


def _class(module: nn.Module, path: str) -> str:
    try:
        return type(module.get_submodule(path) if path not in ("<root>", "<unknown>") else module).__name__
    except AttributeError:
        return type(module).__name__


def _hint(module: nn.Module) -> str:
    """What a Hugging Face model's config turns off: LayerDrop written with numpy (wav2vec2's adapter,
    Data2Vec-Audio's)."""
    config = getattr(module, "config", None)
    names = [k for k in ("layerdrop",) if getattr(config, k, None) not in (None, 0, 0.0, False)]
    if not names:
        return ""
    return (
        "; this model's config has "
        + ", ".join(f"{k}={getattr(config, k)!r}" for k in names)
        + " (set to 0 or False to turn off)"
    )
