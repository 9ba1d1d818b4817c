"""Golden printouts: the final program of a few tiny models, as `print(program)` shows it.

A change to fbmt that changes a generated program (a pass that moves, adds or drops a node, a
renamed op, another recompute choice) shows up here as a diff of plain text, even when every
numerical test still passes. Where the change is meant, regenerate the files and read the diff:

    FBMT_UPDATE_GOLDEN=1 python -m pytest tests/test_golden.py

The programs are traced on fake tensors for 2 ranks in one process. Pass times are left out. The
aten ops a model traces to can change with torch's version, so each file's first line lists the
versions it was checked on (regenerating writes the current one; add others by hand once they give
the same text), and another version skips it.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

import fbmt
from tests.models.reference import BUILDERS, batch

FOLDER = Path(__file__).parent / "golden"
TORCH = ".".join(torch.__version__.split(".")[:2])
CASES = {
    # ZeRO-3, block recompute, prefetch: gathers, releases, reduce-scatters, recomputed blocks
    "gpt": ("gpt", dict()),
    # mixed precision, selective recompute: bf16 gathers and compute, fp32 gradient reduction
    "gpt_bf16_selective": ("gpt", dict(param_dtype=torch.bfloat16, remat="selective")),
    # ZeRO-2, min-cut recompute: merged products (q/k, gate/up) and their merged gradients
    "llama_mincut_zero2": ("llama", dict(remat="mincut", zero=2)),
    # buffers (one updated in the forward), keyword arguments, dict and tuple outputs
    "buffered": ("buffered", dict()),
}


def _text(name: str, options: dict) -> str:
    torch.manual_seed(0)
    model = fbmt.compile(BUILDERS[name](), world_size=2, device="cpu", **options)
    args, kwargs, _ = batch(name, 0)
    program = model.trace(*args, **kwargs)
    # where the program came from (compiled in N s, or loaded from the cache) is not what it is
    text = [line for line in str(program).splitlines() if line != f"# {program.origin}"]
    lines = [re.sub(r"^# pass (\S+)\s+[\d.]+ ms  ", r"# pass \1: ", line) for line in text]
    return f"# torch {TORCH}\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("case", sorted(CASES))
def test_final_program_is_unchanged(case: str) -> None:
    path = FOLDER / f"{case}.txt"
    got = _text(*CASES[case])
    if os.environ.get("FBMT_UPDATE_GOLDEN"):
        FOLDER.mkdir(exist_ok=True)
        path.write_text(got)
    want = path.read_text()
    checked_on = want.splitlines()[0].removeprefix("# torch ").split()
    if TORCH not in checked_on:
        pytest.skip(f"{path.name} was checked on torch {', '.join(checked_on)}; this is torch {TORCH}")
    want = want.split("\n", 1)[1]
    got = got.split("\n", 1)[1]
    assert got == want, f"the program of {case} changed; if that is meant, regenerate (see the module docstring)"
