"""The GPU benchmark harness (`benchmarks/gpu_train.py`) on one gloo CPU rank, with its tiny model: a change
that breaks it fails here, not on the GPU machine, whose time is scarce. Nothing is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import _free_port

ROOT = Path(__file__).resolve().parent.parent


def _train(out: Path, *args: str) -> list[dict]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}"]
    command += ["benchmarks/gpu_train.py", "--config", "tiny", "--seq", "64", "--batch", "2", "--steps", "2"]
    done = subprocess.run(
        [*command, "--warmup", "1", "--out", str(out), *args], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())["results"]


@pytest.mark.parametrize("how", [(), ("--interleave", "--profile")])  # one after the other, or in turn
def test_gpu_train_trains_fbmt_and_fsdp2_alike_on_a_cpu_rank(tmp_path, how):
    results = _train(tmp_path / "results.json", "--methods", "fbmt,fsdp2", *how)
    assert [r["method"] for r in results] == ["fbmt", "fsdp2"]
    ours, theirs = (r["losses"] for r in results)
    assert ours == pytest.approx(theirs, abs=1e-3)


def test_gpu_train_times_an_earlier_commit_beside_this_tree(tmp_path):
    """`--base`: benchmarks/base_package.sh writes HEAD's fbmt as fbmt_base, and both run in one process."""
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: base_package.sh archives a commit")
    subprocess.run(
        ["bash", "benchmarks/base_package.sh", "HEAD", str(tmp_path)], cwd=ROOT, check=True, capture_output=True
    )
    results = _train(tmp_path / "results.json", "--base", str(tmp_path), "--methods", "fbmt,base-fbmt")
    assert [r["method"] for r in results] == ["fbmt", "base-fbmt"]
    assert results[0]["losses"] == results[1]["losses"]


def test_cpu_adam_benchmark_steps_both_optimizers_on_one_memory():
    """`benchmarks/cpu_adam.py` points torch's moments at fbmt's (its `share_state`): a change to either
    optimizer's state breaks it here. Tiny, nothing timed that matters."""
    command = [sys.executable, "benchmarks/cpu_adam.py", "--numel", "200000", "--steps", "4"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "(a) fp32 vs AdamW(fused=True)" in done.stdout and "(b) bf16 grad/param" in done.stdout, done.stdout
