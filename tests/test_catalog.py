"""The catalog of bad inputs and faults: each ends, within a bounded time, with a message that says
what is wrong and what to do, and leaves every checkpoint that existed intact.

Here: checkpoint files (fbmt.save/load, fbmt.checkpoint) and the main job. Elsewhere, one test each:
the user mistakes around fbmt.compile (compile before init_distributed, an optimizer built before
compile, requires_grad_ or a deleted parameter after it, compile twice, a buffer of another shape,
gather_opt, print in forward, a formatted tensor in print, ranks running different programs, a
stalled rank: tests/test_guards.py); input shapes that differ across ranks (tests/test_multirank.py);
an unreachable rendezvous, a missing MASTER_ADDR, more NCCL ranks than GPUs (tests/test_distributed.py);
a save that fails on one rank, an incomplete checkpoint, another model's checkpoint, more layers,
another optimizer's state, a background save that fails unwaited, another number of ranks
(tests/test_checkpoint.py); a rank killed mid-training or mid-save (tests/test_resume.py); writes to
a compiled model's parameters, weights loaded on rank 0 only, Hugging Face's checkpointing and
resizing, a cast, a late rank, a damaged checkpoint on 2 ranks (tests/test_habits.py); a model built
on meta initialized as from_config (tests/test_meta_init.py); --resume of nothing, a model of other
sizes than its checkpoint (tests/test_train.py).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
import torch

import fbmt
from tests.dist import run_ranks
from tests.models.reference import MLP, batch, gpt

# ---- fbmt.load of files that are not checkpoints ----


def _garbage(path, kind: str) -> None:
    if kind == "zero-byte":
        open(path, "wb").close()
    elif kind == "truncated":
        torch.save(MLP().state_dict(), path)
        data = open(path, "rb").read()
        open(path, "wb").write(data[: len(data) // 2])
    elif kind == "text":
        open(path, "w").write("not a checkpoint\n")
    elif kind == "pickled object":
        torch.save({"model": MLP()}, path)
    elif kind == "a list":
        torch.save([torch.ones(2)], path)


@pytest.mark.parametrize(
    "kind, says",
    [
        ("zero-byte", r"is empty \(0 bytes\): a save that never finished"),
        ("truncated", r"is not a checkpoint torch can read .* truncated or another kind of file"),
        ("text", r"is not a checkpoint torch can read"),
        ("pickled object", r"holds Python objects besides tensors; fbmt.load reads state dicts"),
        ("a list", r"holds a list, not a state dict of tensors"),
    ],
)
def test_loading_a_file_that_is_not_a_checkpoint_says_what_it_is(tmp_path, kind, says):
    path = str(tmp_path / "bad.pt")
    _garbage(path, kind)
    with pytest.raises(RuntimeError, match=says):
        fbmt.load(fbmt.compile(MLP()), path)


def _corrupt_on_rank0_only(rank: int, world: int, path: str) -> str:
    import fbmt.files

    if rank == 1:  # another machine: it cannot see rank 0's disk, so rank 0 reads and broadcasts
        fbmt.files.os.path.exists = lambda p: False
    try:
        fbmt.load(fbmt.compile(MLP()), path)
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_corrupt_file_only_rank0_sees_fails_every_rank_instead_of_hanging(tmp_path):
    path = str(tmp_path / "bad.pt")
    _garbage(path, "truncated")
    for rank, message in enumerate(run_ranks(2, _corrupt_on_rank0_only, path)):
        assert "is not a checkpoint torch can read" in message, message
        assert ("read on rank 0" in message) == (rank == 1)


# ---- fbmt.save where rank 0 cannot write ----


def _save_into(rank: int, world: int, path: str) -> str:
    try:
        fbmt.save(fbmt.compile(MLP()), path)
    except (RuntimeError, OSError) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def test_a_save_rank0_cannot_write_fails_on_every_rank():
    for rank, message in enumerate(run_ranks(2, _save_into, "/sys/fbmt-read-only/model.pt")):  # read-only, root too
        assert message, f"rank {rank} returned as if saved"
        if rank == 1:
            assert "rank 0 could not write '/sys/fbmt-read-only/model.pt'" in message, message


def test_a_saved_file_has_the_usual_permissions_and_a_killed_writers_temporary_goes(tmp_path):
    stale = tmp_path / f".tmp-{os.uname().nodename}-999999999-abc.pt"  # a pid no process has
    stale.write_bytes(b"half a checkpoint")
    live = tmp_path / f".tmp-{os.uname().nodename}-{os.getpid()}-abc.pt"  # a live writer's: kept
    live.write_bytes(b"being written")
    fbmt.save(fbmt.compile(MLP()), str(tmp_path / "m.pt"))
    mode = stat.S_IMODE(os.stat(tmp_path / "m.pt").st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask, oct(mode)
    assert not stale.exists() and live.exists()


# ---- fbmt.checkpoint of damaged or unwritable folders ----


def _saved(folder: str) -> tuple[fbmt.CompiledModule, str]:
    torch.manual_seed(0)
    model = fbmt.compile(gpt())
    return model, fbmt.checkpoint.save(folder, 1, model=model)


def _damage(path: str, how: str) -> str:
    """Damage checkpoint `path` as a disk or a person might; the file it damaged."""
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    if how == "truncated":
        with open(os.path.join(path, data), "r+b") as f:
            f.truncate(100)
    elif how == "one value flipped":  # one byte in the middle of the tensors' data, the file's size unchanged
        size = os.path.getsize(os.path.join(path, data))
        with open(os.path.join(path, data), "r+b") as f:
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x40]))
    elif how == "metadata deleted":
        os.unlink(os.path.join(path, ".metadata"))
        return ".metadata"
    return data


@pytest.mark.parametrize("how", ["truncated", "one value flipped", "metadata deleted"])
def test_a_damaged_checkpoint_asked_for_by_name_is_refused_naming_the_file(tmp_path, how):
    """NOTE: [Checkpoints that cannot be silently wrong]: a flipped value loaded without a word (DCP keeps no
    checksum), and a deleted .metadata gave a raw FileNotFoundError."""
    model, path = _saved(str(tmp_path))
    damaged = _damage(path, how)
    says = "is missing" if how == "metadata deleted" else "is not the file that was saved"
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=rf"step-00000001' is damaged: {damaged} {says}"):
        fbmt.checkpoint.load(path, model=model)


@pytest.mark.parametrize("how", ["truncated", "one value flipped", "metadata deleted"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before_it(tmp_path, how, caplog):
    torch.manual_seed(0)
    model = fbmt.compile(gpt())
    fbmt.checkpoint.save(str(tmp_path), 1, model=model)
    want = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2.0)
    newest = fbmt.checkpoint.save(str(tmp_path), 2, model=model)
    _damage(newest, how)
    with caplog.at_level("WARNING", logger="fbmt"):
        resumed = fbmt.checkpoint.load(str(tmp_path), model=model)
    assert resumed.step == 1 and "step-00000002 is damaged" in caplog.text
    got = model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.items())
    _damage(resumed.path, how)  # and with every checkpoint damaged, an error, never a fresh start
    with pytest.raises(fbmt.checkpoint.CheckpointError, match="every complete checkpoint under .* is damaged"):
        fbmt.checkpoint.load(str(tmp_path), model=model)


def test_two_jobs_given_one_checkpoint_folder_are_refused_at_the_second_ones_first_save(tmp_path):
    """Two jobs saving into one folder (a second launch, a typo) wrote over each other's checkpoints."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _saved(str(tmp_path))  # this process's job holds the folder's lock from now on
    second = (
        "import sys, fbmt; from tests.models.reference import MLP; "
        "fbmt.checkpoint.save(sys.argv[1], 5, model=fbmt.compile(MLP()))"
    )
    run = subprocess.run(
        [sys.executable, "-c", second, str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )  # fmt: skip
    assert run.returncode != 0 and f"another job is saving checkpoints into '{tmp_path}'" in run.stderr
    assert f"pid {os.getpid()}" in run.stderr and not (tmp_path / "step-00000005").exists()
    assert fbmt.checkpoint.save(str(tmp_path), 6, model=_saved(str(tmp_path))[0]).endswith("step-00000006")


def test_saving_into_a_read_only_folder_says_so(tmp_path):
    model, _ = _saved(str(tmp_path))
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"cannot create checkpoint .*/sys/fbmt-ck"):
        fbmt.checkpoint.save("/sys/fbmt-ck", 2, model=model)
    assert [s for s, _ in fbmt.checkpoint.checkpoints(str(tmp_path))] == [1]  # the earlier one: intact


def test_a_single_file_given_to_checkpoint_load_points_to_the_right_call(tmp_path):
    model, _ = _saved(str(tmp_path / "ck"))
    path = str(tmp_path / "plain.pt")
    torch.save(model.state_dict(), path)
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"is a file; .*model.load_state_dict"):
        fbmt.checkpoint.load(path, model=model)


def test_checkpointing_a_module_that_is_not_compiled_is_refused():
    with pytest.raises(TypeError, match=r"expected the module fbmt.compile returned, got MLP"):
        fbmt.checkpoint.save("unused", 1, model=MLP())


def test_an_optimizer_on_other_parameters_is_refused(tmp_path):
    model = fbmt.compile(MLP())
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"parameter #0 of the SGD .* not one of the model's"):
        fbmt.checkpoint.save(str(tmp_path), 1, model=model, optimizer=opt)


def test_loading_optimizer_state_a_checkpoint_does_not_hold_says_so(tmp_path):
    model, path = _saved(str(tmp_path))
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"holds no optimizer state; pass optimizer=None"):
        fbmt.checkpoint.load(path, model=model, optimizer=opt)


def test_input_on_the_wrong_device_is_named():
    model = fbmt.compile(MLP(), device="meta")
    with pytest.raises(ValueError, match=r"tensor input #0 .* is on cpu, but this model's parameters are on meta"):
        model(batch("mlp", 0)[0][0])


# ---- the main job ----


def test_a_diverging_main_job_stops_and_says_the_checkpoint_is_intact(tmp_path):
    args = ["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "16", "--batch-size", "2"]
    cmd = [sys.executable, "-m", "fbmt.train", "--steps", "40", "--save-every", "1", "--lr", "1e12", *args]
    run = subprocess.run(
        [*cmd, "--corpus-mb", "0.2", "--checkpoints", str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "training diverged" in out and "lower --lr" in out, out[-2000:]
    assert fbmt.checkpoint.latest(str(tmp_path)) is not None
