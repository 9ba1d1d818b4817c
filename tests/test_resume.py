"""The main job survives a dead rank: `torchrun --max-restarts=1` restarts it, it resumes from the
newest complete checkpoint, and it ends with exactly the parameters of a run nobody interrupted."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4"]
RUN = [*TINY, "--corpus-mb", "0.5", "--dropout", "0.1", "--save-every", "4"]  # dropout: RNG states matter


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list[str], env: dict | None = None) -> str:
    run = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _train(folder, steps: int, *extra: str) -> str:
    # one thread per rank everywhere: another thread count sums in another order, and bits differ
    cmd = [sys.executable, "-m", "fbmt.train", "--steps", str(steps), *RUN, "--checkpoints", str(folder), *extra]
    return _run(cmd, env={"OMP_NUM_THREADS": "1"})


def _exported(folder) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(folder, "model.pt"), weights_only=False)["model"]


def _assert_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    _train(folder, 12)
    return _exported(folder)


def test_running_again_with_more_steps_continues_bit_identically_and_starting_afresh_is_refused(
    tmp_path, uninterrupted
):
    _train(tmp_path, 8)
    out = _train(tmp_path, 12)
    assert "resumed from" in out and "step-00000008 (step 8 of 12)" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("step ")][0] == "9/12"
    _assert_identical(_exported(tmp_path), uninterrupted)
    steps = [line.split(",")[0] for line in open(tmp_path / "metrics.csv").read().splitlines()[1:]]
    assert steps == [str(s) for s in range(1, 13)]  # one row per step, none twice
    again = _train(tmp_path, 12)  # nothing left to do: said so, and nothing overwritten
    assert "already trained to step 12" in again
    run = subprocess.run(  # starting afresh over the earlier run's checkpoints is refused
        [sys.executable, "-m", "fbmt.train", "--steps", "4", *RUN, "--checkpoints", str(tmp_path), "--resume", "no"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0 and "holds an earlier run's checkpoints" in run.stdout + run.stderr
    _assert_identical(_exported(tmp_path), uninterrupted)


@pytest.mark.parametrize("fault", ["step:6", "save:8"])
def test_a_rank_killed_mid_training_or_mid_save_is_restarted_and_ends_identical(tmp_path, uninterrupted, fault):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{_port()}",
        os.path.join(ROOT, "tests", "scripts", "faulty_train.py"),
        "--steps",
        "12",
        *RUN,
        "--checkpoints",
        str(tmp_path),
    ]
    out = _run(cmd, env={"FBMT_TEST_FAULT": fault, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT})
    assert "resumed from" in out, out[-3000:]
    resumed_at = 4  # the last complete checkpoint before the fault (step 8's save was cut short)
    assert f"step-{resumed_at:08d} (step {resumed_at} of 12)" in out, out[-3000:]
    _assert_identical(_exported(tmp_path), uninterrupted)


def test_two_torchrun_agents_as_two_nodes_train_as_one_node_does(tmp_path, uninterrupted):
    """Multi-node as users launch it (one agent per machine, here both on this one), ending with the
    one-node run's parameters."""
    port = _port()
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=fbmt-test",
                "-m",
                "fbmt.train",
                "--steps",
                "12",
                *RUN,
                "--checkpoints",
                str(tmp_path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
        )
        for node in (0, 1)
    ]
    outs = [a.communicate(timeout=300)[0] for a in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert "2 ranks on cpu" in "".join(outs)
    _assert_identical(_exported(tmp_path), uninterrupted)
