"""The reference executor: run a joint Program op by op, its forward and backward together.

It is the definition of what a program means, and slow on purpose: each aten node runs as traced,
and each collective runs synchronously as its kind's `reference` (fbmt/compiler/collectives/reference.py:
built from all-gathers alone; a reduction is every rank's flat buffer gathered, and this rank's chunk
summed in the reduce dtype). The fast path (`partition`, the copy and reduce streams, Inductor
regions, CUDA graphs) must compute the same values; the pass tests run programs here before and
after a pass. On one rank it needs no process group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.fx as fx
import torch.nn as nn

from fbmt.compiler import collectives as comm
from fbmt.compiler.program import Program, Role


class _Reference(fx.Interpreter):
    """A start runs its kind's reference and returns the result; `wait` hands it on; `release` does nothing."""

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        kind = comm.kind_of(target)
        if kind is not None:
            return kind.reference(*args, **kwargs)
        if target is comm.wait:
            return args[0]
        if target is comm.release:
            return None
        return target(*args, **kwargs)


def run_program(program: Program, feed: Callable[[Role], Any]) -> dict[Role, Any]:
    """Run `program` with `feed(role)` as each placeholder's value; its outputs by role."""
    interpreter = _Reference(fx.GraphModule(nn.Module(), program.graph))
    results = interpreter.run(*[feed(role) for role in program.inputs])
    return dict(zip(program.outputs, results))
