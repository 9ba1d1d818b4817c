"""Run a list of passes: time, record, verify and dump every one of them.

A pass is a plain function `(program) -> (program, stats)` (options bound with
`functools.partial`, so the runner knows no pass's arguments). After each pass the runner appends a
record (name, seconds, stats, the program's text) to the program's history, verifies the program
when checks are on (a failure names the pass), and with a dump folder writes the text to
`NN-name.txt` there, so plain `diff` shows what each pass changed. A disabled pass leaves the
program as it was and says so in the history.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch.fx as fx

from fbmt import logs
from fbmt.compiler.passes.verify import check
from fbmt.compiler.program import Note, Program

Pass = Callable[[Program], tuple[Program, Any]]  # (the new program, the pass's stats record)
REQUIRED = ("shard",)  # the runtime needs its collectives: it cannot be disabled


def run_passes(
    program: Program,
    passes: list[tuple[str, Pass]],
    *,
    disable: tuple[str, ...] = (),
    checks: bool = False,
    dump_dir: str | None = None,
    given_up: bool = False,
) -> Program:
    """`given_up`: the caller will not read `program` again, so the first pass that writes may write to
    its graph instead of a copy (a copy of tens of thousands of nodes costs as much as a pass)."""
    if dump_dir:
        os.makedirs(dump_dir, exist_ok=True)
        _dump(dump_dir, 0, "trace", program)
    made: set[fx.Graph] = {program.graph} if given_up else set()  # graphs no one else reads
    # (a pass made them): a pass writes to those in place, and copies the caller's first
    for i, (name, fn) in enumerate(passes, 1):
        started = time.perf_counter()
        before, given = program, program.graph
        before._owned = given in made  # a pass writing to it writes in place (Program.copy)
        if name in disable:
            program, stats = program.copy(shared=True), Note("disabled by the user")
        else:
            program, stats = fn(program)
        written = program.graph is not given or program._written
        before._owned = before._written = program._owned = program._written = False
        if written:
            made.add(program.graph)
        # a pass that changed nothing (copy(shared=True)) leaves the text of the program as it was
        program.record(name, time.perf_counter() - started, stats, unchanged=not written)
        logs.log.debug("pass %s: %.2fs: %s", name, program.history[-1].seconds, program.history[-1].summary)
        if checks and name != "verify" and name not in disable:
            check(program, after=name)
        if dump_dir:
            _dump(dump_dir, i, name, program)
    return program


def _dump(folder: str, index: int, name: str, program: Program) -> None:
    with open(os.path.join(folder, f"{index:02d}-{name}.txt"), "w") as f:
        f.write(str(program) + "\n")
