"""The notebooks: each executes headlessly in a Jupyter kernel without an error, and each is committed
with its outputs (pictures included), so it reads on a code host without running."""

import contextlib
import io
import json
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_are_there():
    assert [p.name for p in NOTEBOOKS] == [
        "01_compile_pass_by_pass.ipynb",
        "02_strategies.ipynb",
        "03_memory_budget.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_in_a_kernel(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[:1]
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert images or path.name.startswith("01"), "the notebook drew nothing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_its_outputs(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c.get("outputs") for c in code), "run it and save it with its outputs (see notebooks/README.md)"
    assert all(c.get("id") for c in nb["cells"])
    kinds = {k for c in code for o in c["outputs"] for k in o.get("data", {})}
    assert "image/png" in kinds or "image/svg+xml" in kinds


def test_compile_pass_by_pass_shows_overlap_and_zero2_memory():
    path = next(p for p in NOTEBOOKS if p.name.startswith("01"))
    namespace: dict = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                exec("".join(cell["source"]), namespace)
    program_for, overlap, peak = namespace["program_for"], namespace["overlap"], namespace["peak_gathered_bytes"]
    assert sum(overlap(program_for(schedule="prefetch"))) > sum(overlap(program_for(schedule="none"))) == 0
    assert peak(program_for(zero=2)) > peak(program_for(zero=3))
