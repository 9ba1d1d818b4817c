"""Every notebook's code cells run top to bottom without error (no Jupyter needed)."""

import contextlib
import io
import json
import pathlib

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    namespace: dict = {"__name__": "__main__"}
    out = io.StringIO()
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        if cell["cell_type"] == "code":
            with contextlib.redirect_stdout(out):
                exec(compile("".join(cell["source"]), f"{path.name}[cell {i}]", "exec"), namespace)
    assert out.getvalue().strip(), "the notebook printed nothing"


def test_inspect_program_shows_overlap_and_zero2_memory():
    path = next(p for p in NOTEBOOKS if p.name == "inspect_program.ipynb")
    namespace: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), namespace)
    program_for, overlap, peak = namespace["program_for"], namespace["overlap"], namespace["peak_gathered_bytes"]
    assert sum(overlap(program_for(schedule="prefetch"))) > sum(overlap(program_for(schedule="none"))) == 0
    assert peak(program_for(zero=2)) > peak(program_for(zero=3))
