"""The main job end to end: `python -m fbmt.train` launches ranks, trains, saves a usable checkpoint."""

import os
import subprocess
import sys

import torch

from fbmt.models import GPT, GPTConfig


def test_main_job_trains_and_saves_a_plain_checkpoint(tmp_path):
    out = tmp_path / "ck.pt"
    cmd = [sys.executable, "-m", "fbmt.train", "--ranks", "2", "--steps", "30", "--layers", "2", "--d-model", "64",
           "--heads", "2", "--seq-len", "64", "--corpus-mb", "1", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 30 and "tok/s" in lines[-1] and "r1:" in lines[-1]
    losses = [float(line.split("loss ")[1].split()[0]) for line in lines]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # the loss falls
    ck = torch.load(out, weights_only=False)
    model = GPT(GPTConfig(**ck["config"]))
    model.load_state_dict(ck["model"])  # a plain nn.Module loads it: full tensors, original keys
    assert not list(tmp_path.glob(".tmp-*")), "no temporary file left behind"
