"""The main job end to end: `python -m fbmt.train` launches ranks, trains, checkpoints, exports a usable model."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from fbmt.models import GPT, GPTConfig

SMALL = "--layers 2 --d-model 64 --heads 2 --seq-len 64 --corpus-mb 1".split()


def _main_job(*args: str, ok: bool = True) -> subprocess.CompletedProcess:
    """`python -m fbmt.train ARGS`, as a user runs it; `ok`: it must succeed."""
    run = subprocess.run(
        [sys.executable, "-m", "fbmt.train", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    if ok:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _losses(stdout: str) -> list[float]:
    return [float(line.split("loss ")[1].split()[0]) for line in stdout.splitlines() if line.startswith("step ")]


def test_main_job_trains_checkpoints_and_exports_a_plain_model(tmp_path):
    args = ["--ranks", "2", "--steps", "30", *SMALL, "--checkpoints", str(tmp_path)]
    run = _main_job(*args)
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 30 and "tok/s" in lines[-1] and "r1:" in lines[-1]
    losses = _losses(run.stdout)
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses  # the loss falls
    ck = torch.load(tmp_path / "model.pt", weights_only=False)
    model = GPT(GPTConfig(**ck["config"]))
    model.load_state_dict(ck["model"])  # a plain nn.Module loads it: full tensors, original keys
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "metrics.csv", "model.pt", "step-00000030"]
    assert len((tmp_path / "metrics.csv").read_text().splitlines()) == 31  # a header and a row per step
    # a --resume that names nothing (a typo) is an error, said before any rank starts; a model of other sizes
    # than the checkpoint's is one too, named by its first differing tensor, and torchrun's traceback does not
    # bury it; the earlier run's checkpoint stays as it was
    before = {f.name: f.stat().st_mtime_ns for f in (tmp_path / "step-00000030").iterdir()}
    for extra, says, launched in [
        (["--resume", str(tmp_path / "step-00000300")], "does not exist; nothing was trained or overwritten", False),
        (["--resume", str(tmp_path.parent)], "holds no complete checkpoint; nothing was trained", False),
        (
            ["--layers", "3", "--steps", "40"],
            r"does not fit this GPT: it lacks \d+ the model has, the first 'h\.2\.",
            True,
        ),
    ]:
        run = _main_job(*args, *extra, ok=False)
        out = run.stdout + run.stderr
        assert run.returncode != 0 and re.search(says, out), (extra, out[-2000:])
        assert ("launching" in run.stdout) == launched and "Traceback" not in out, (extra, out[-2000:])
    assert "fbmt.train: rank 0 exited with code 1" in out, out[-2000:]
    assert before == {f.name: f.stat().st_mtime_ns for f in (tmp_path / "step-00000030").iterdir()}


def test_main_job_on_one_rank_runs_in_its_own_process_and_trains(tmp_path):
    """`--ranks 1` (a machine of one GPU) is a group of one in this process: no torchrun, no second start."""
    run = _main_job("--ranks", "1", "--steps", "8", *SMALL, "--save-every", "0", "--checkpoints", str(tmp_path))
    assert "launching" not in run.stdout and "1 rank on cpu" in run.stdout, run.stdout[-2000:]
    assert len(_losses(run.stdout)) == 8 and (tmp_path / "model.pt").exists()


def test_main_job_options_that_cannot_work_are_refused_before_anything_starts(capsys):
    from fbmt.train import parse_args

    for bad, says in [
        (["--ranks", "0"], "at least one rank"),
        (["--heads", "3"], "--heads 3 does not divide --d-model 128"),
        (["--steps", "0"], "at least one step"),
        # (other tests of this process register strategies of their own: the list holds the built-in ones among them)
        (["--schedule", "fastest"], "no strategy 'fastest'; the registered ones are ["),
        (["--schedule", "greedy:memory=1"], "unknown option(s) ['memory']; its options are: memory_bound=None"),
        (["--schedule", "nowhere.json"], "No such file"),
    ]:
        with pytest.raises(SystemExit) as exited:
            parse_args(bad)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and says in err, (bad, err[-500:])
        if bad[-1] == "fastest":
            assert all(f"'{name}'" in err for name in ("bmtrain", "bucket", "fsdp2", "greedy", "prefetch")), err
    # and from the command line, before any rank is launched
    run = subprocess.run(
        [sys.executable, "-m", "fbmt.train", "--ranks", "0"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "at least one rank" in run.stderr and "launching" not in run.stdout, run.stderr


def test_the_schedule_argument_takes_every_strategy_its_options_and_saved_schedules(tmp_path):
    import fbmt
    from fbmt.train import schedule_arg

    assert schedule_arg("fsdp2") == "fsdp2"
    assert schedule_arg("greedy:memory_bound=2e8") == ("greedy", {"memory_bound": 200_000_000})
    assert schedule_arg("prefetch:depth=2,small=8") == ("prefetch", {"depth": 2, "small": 8})
    torch.manual_seed(0)
    model = fbmt.compile(GPT(GPTConfig(vocab_size=32, n_layer=2, n_head=2, d_model=16, seq_len=8)), world_size=1)
    idx = torch.randint(0, 32, (1, 8))
    saved = model.trace(idx).schedule()
    saved.to_json(str(tmp_path / "s.json"))
    assert schedule_arg(str(tmp_path / "s.json")) == saved


def test_main_job_with_offload_trains_and_resumes_its_host_optimizer(tmp_path):
    """`--offload`: fbmt.compile(offload=True) stepped by AdamOffloadOptimizer; its checkpoint resumes."""
    losses = []
    for steps in ("16", "20"):
        run = _main_job(
            "--ranks", "2", *SMALL, "--checkpoints", str(tmp_path), "--offload", "--save-every", "8", "--steps", steps
        )
        assert ", offload," in run.stdout
        losses += _losses(run.stdout)
    assert "fbmt.train: resumed from" in run.stdout and "(step 16 of 20)" in run.stdout, run.stdout[-2000:]
    assert len(losses) == 20 and sum(losses[-4:]) / 4 < losses[0] - 0.5, losses  # resumed at 16, and learning


def test_main_job_trains_in_fp8(tmp_path):
    """`--fp8 tensorwise`: the blocks' products in FP8 (fbmt.compile(fp8=...)), on the CPU ranks' _scaled_mm
    (a reference kernel, slow at the main job's sizes: hence 4 sequences a step)."""
    fp8 = "--batch-size 4 --steps 16 --fp8 tensorwise".split()
    run = _main_job("--ranks", "2", *SMALL, *fp8, "--checkpoints", str(tmp_path))
    assert ", fp8 tensorwise," in run.stdout
    losses = _losses(run.stdout)
    assert len(losses) == 16 and sum(losses[-4:]) / 4 < losses[0] - 0.5, losses


def test_bmtrain_example_runs_under_torchrun_and_its_loss_falls(tmp_path):
    out = tmp_path / "gpt.pt"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        os.path.join(root, "examples", "bmtrain_gpt.py"),
        "--steps",
        "40",
        "--layers",
        "2",
        "--dim",
        "64",
        "--seq",
        "64",
        "--batch",
        "4",
        "--save",
        str(out),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "| iter   39 | loss" in run.stdout
    first, last = (float(v) for v in run.stdout.split("\nloss ")[1].split(" (")[0].split(" -> "))
    assert last < first - 0.5, run.stdout[-2000:]
    state = torch.load(out, weights_only=True)  # BMTrain's format: full tensors, unwrapped names
    assert state["transformers.1.attn.project_q.weight"].shape == (64, 64)
    assert state["word_emb.weight"].shape == (256, 64)
