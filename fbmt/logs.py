"""What fbmt says while it works: the "fbmt" logger, and where its lines go.

The compiler reports each stage of a build (tracing, each pass, partitioning, each Inductor region
it compiles) and why it builds a new program at INFO; details at DEBUG. Nothing is printed unless
asked: `FBMT_LOG=info` (or `debug`) sends them to stderr, every rank's line prefixed with its rank
and the seconds since fbmt was imported, and `fbmt.logs.show("info")` does the same from code (the
main job does it on rank 0). A program that configures `logging` itself gets the records through
the usual propagation instead.
"""

from __future__ import annotations

import linecache
import logging
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fbmt import flags

log = logging.getLogger("fbmt")
_STARTED = time.perf_counter()
_handler: logging.Handler | None = None


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        rank = flags.RANK.get()
        where = f"rank {rank} " if rank is not None else ""
        return f"[fbmt {where}{time.perf_counter() - _STARTED:7.1f}s] {record.getMessage()}"


def show(level: str | int = "info") -> None:
    """Print fbmt's records of `level` and above to stderr (again: changes the level)."""
    global _handler
    if isinstance(level, str):
        name = level.upper()
        if name not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError(f"fbmt.logs.show({level!r}): expected one of debug, info, warning, error")
        level = getattr(logging, name)
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_Format())
        log.addHandler(_handler)
        log.propagate = False  # a root logger configured too would print every line twice
    log.setLevel(level)


def from_environment() -> None:
    """`show(FBMT_LOG)` where the variable is set (fbmt calls this once, when it is imported)."""
    level = flags.LOG.get()
    if level:
        show(level)


@contextmanager
def stage(what: str, level: int = logging.INFO, *, begin: bool = True) -> Iterator[dict[str, str]]:
    """Log `what` as it begins (`begin`: for a stage long enough to wait for) and, with its seconds,
    as it ends; what the body puts in the dict under "done" ends the last line ("932 nodes")."""
    said: dict[str, str] = {}
    if not log.isEnabledFor(level):
        yield said
        return
    if begin:
        log.log(level, "%s ...", what)
    started = time.perf_counter()
    yield said
    extra = f": {said['done']}" if said.get("done") else ""
    log.log(level, "%s: %.2fs%s", what, time.perf_counter() - started, extra)


_LIBRARY_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (torch.__file__, __file__))


def user_line(frames: list[traceback.FrameSummary]) -> str:
    """`file:line: source` of the innermost of `frames` in the user's code (not torch's, fbmt's or
    the standard library's; an installed package's, such as transformers', counts), or '': where a
    message points the user."""
    found = ""
    for frame in frames:
        f = os.path.abspath(frame.filename)
        if f.startswith(_LIBRARY_DIRS) or "/lib/python" in f and "site-packages" not in f:
            continue
        line = (frame.line or linecache.getline(f, frame.lineno)).strip()
        found = f"{frame.filename}:{frame.lineno}: {line}"
    return found
