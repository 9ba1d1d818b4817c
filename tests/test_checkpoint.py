"""`fbmt.checkpoint.save_atomic`: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from fbmt.files import save_atomic


class _Exploding:
    """Pickles a few bytes, then fails, as a save cut short by a full disk or an exception."""

    def __reduce__(self):
        raise OSError(28, "No space left on device")


def test_a_write_that_fails_midway_leaves_the_old_file_whole_and_no_temporary(tmp_path):
    path = tmp_path / "ck.pt"
    save_atomic({"step": 1, "w": torch.arange(4.0)}, str(path))
    with pytest.raises(OSError, match="No space left"):
        save_atomic({"step": 2, "w": torch.zeros(1 << 16), "bad": _Exploding()}, str(path))
    assert torch.load(path)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck.pt"]


def test_a_process_killed_while_writing_leaves_the_old_file_whole(tmp_path):
    """SIGKILL in the middle of the write: no cleanup runs, and the old checkpoint still loads."""
    path = tmp_path / "ck.pt"
    save_atomic({"step": 1}, str(path))
    writer = textwrap.dedent(f"""
        import os, signal, torch
        from fbmt.files import save_atomic

        class Slow:  # the kill comes after part of the new file is on disk
            def __reduce__(self):
                os.kill(os.getpid(), signal.SIGKILL)

        save_atomic({{"step": 2, "big": torch.zeros(1 << 20), "slow": Slow()}}, {str(path)!r})
    """)
    run = subprocess.run([sys.executable, "-c", writer], capture_output=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    assert torch.load(path)["step"] == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ck.pt"]
    assert all(p.startswith(".tmp-") for p in leftovers)  # a killed writer's temporary, never the checkpoint


def test_the_new_file_replaces_the_old_one_complete(tmp_path):
    path = tmp_path / "sub" / "ck.pt"
    save_atomic({"step": 1}, str(path))
    save_atomic({"step": 2, "w": torch.ones(3)}, str(path))
    loaded = torch.load(path)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.ones(3))
    assert os.listdir(path.parent) == ["ck.pt"]


# ---- fbmt.checkpoint: sharded checkpoints on torch.distributed.checkpoint ----


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), ()])
def test_any_range_of_a_tensor_is_the_boxes_that_cover_it(shape):
    from fbmt.checkpoint import _boxes

    n = max(1, int(torch.tensor(shape).prod().item()) if shape else 1)
    full = torch.arange(float(n)).reshape(shape)
    for lo in range(n + 1):
        for hi in range(lo, n + 1):
            got = torch.zeros(n)
            for offsets, sizes, a, b in _boxes(shape, lo, hi):
                index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
                got[a:b] = full[index].reshape(-1)
                assert len(_boxes(shape, lo, hi)) <= max(1, 2 * len(shape) - 1)
            want = torch.zeros(n)
            want[lo:hi] = full.reshape(-1)[lo:hi]
            assert torch.equal(got, want), (lo, hi)


def _train_steps(model, opt, sched, steps, first, world, rank, name="gpt"):
    from tests.models.reference import batch, loss_of

    for step in range(first, first + steps):
        args, _, target = batch(name, step)
        n = args[0].shape[0] // world
        local = slice(rank * n, (rank + 1) * n)
        loss = loss_of(name, model(args[0][local]), target[local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()


def _fresh(dropout=0.0, lr=1e-2, optimizer="adamw"):
    import fbmt
    from tests.models.reference import gpt

    torch.manual_seed(0)
    model = fbmt.compile(gpt(dropout=dropout))
    make = {
        "adamw": torch.optim.AdamW,
        "fbmt-adam": fbmt.optim.AdamOptimizer,
        "fbmt-offload": fbmt.optim.AdamOffloadOptimizer,
    }[optimizer]
    opt = make(model.parameters(), lr=lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _save_after(rank, world, folder, steps, dropout, optimizer="adamw"):
    import fbmt

    model, opt, sched = _fresh(dropout, optimizer=optimizer)
    _train_steps(model, opt, sched, steps, 0, world, rank)
    fbmt.checkpoint.save(folder, steps, model=model, optimizer=opt, state={"sched": sched, "data": {"next": steps}})
    _train_steps(model, opt, sched, steps, steps, world, rank)
    return model.full_parameters()


def _resume(rank, world, folder, steps, dropout, optimizer="adamw"):
    import fbmt

    model, opt, sched = _fresh(dropout, optimizer=optimizer)
    torch.manual_seed(1234 + rank)  # the streams a fresh job would draw: the checkpoint replaces them
    resumed = fbmt.checkpoint.load(folder, model=model, optimizer=opt, state={"sched": sched, "data": {"next": 0}})
    assert resumed.step == steps and resumed.state["data"] == {"next": steps}, resumed
    assert sched.last_epoch == steps
    _train_steps(model, opt, sched, steps, steps, world, rank)
    return model.full_parameters()


def test_resume_on_the_same_ranks_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    from tests.dist import run_ranks

    folder = str(tmp_path / "ck")
    straight = run_ranks(2, _save_after, folder, 4, 0.2)[0]  # dropout on: the RNG states matter
    resumed = run_ranks(2, _resume, folder, 4, 0.2)[0]
    for k, v in straight.items():
        assert torch.equal(resumed[k], v), k


@pytest.mark.parametrize("world", [1, 4])
def test_a_checkpoint_of_two_ranks_resumes_on_another_number_of_ranks(tmp_path, world):
    from tests.dist import run_ranks

    folder = str(tmp_path / "ck")
    straight = run_ranks(2, _save_after, folder, 3, 0.0)[0]
    resumed = run_ranks(world, _resume, folder, 3, 0.0) if world > 1 else [_single(_resume, folder, 3)]
    # Another number of ranks sums gradients in another order, and Adam turns the rounding of the key
    # bias's gradient (zero up to rounding: softmax ignores it) into steps of 1e-6; an uninterrupted
    # run on `world` ranks differs from the 2-rank one by as much.
    for k, v in straight.items():
        torch.testing.assert_close(resumed[0][k], v, rtol=1e-5, atol=1e-5, msg=k)


def _single(fn, *args):
    return fn(0, 1, *args, 0.0)


@pytest.mark.parametrize("optimizer", ["fbmt-adam", "fbmt-offload"])
def test_fbmt_adams_state_reshards_too(tmp_path, optimizer):
    from tests.dist import run_ranks

    folder = str(tmp_path / "ck")
    straight = run_ranks(2, _save_after, folder, 3, 0.0, optimizer)[0]
    resumed = run_ranks(4, _resume, folder, 3, 0.0, optimizer)[0]
    for k, v in straight.items():  # as for AdamW above
        torch.testing.assert_close(resumed[k], v, rtol=1e-5, atol=1e-5, msg=k)


def test_a_checkpoint_is_plain_pytorch_state_under_the_original_names(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.dist import run_ranks
    from tests.models.reference import gpt

    folder = str(tmp_path / "ck")
    full = run_ranks(2, _save_after, folder, 1, 0.0)[0]
    del full
    out = str(tmp_path / "plain.pt")
    dcp_to_torch_save(str(tmp_path / "ck" / "step-00000001"), out)
    plain = torch.load(out, weights_only=False)
    reference = gpt()
    reference.load_state_dict(plain["model"])  # every name, every shape: strict
    assert set(plain["optim"]["state"]["h.0.attn.qkv.weight"]) >= {"exp_avg", "exp_avg_sq", "step"}
    assert plain["optim"]["state"]["h.0.attn.qkv.weight"]["exp_avg"].shape == reference.h[0].attn.qkv.weight.shape


def _fail_on_rank1(rank, world, folder):
    import torch.distributed.checkpoint as dcp

    import fbmt

    model, opt, _ = _fresh()
    fbmt.checkpoint.save(folder, 1, model=model, optimizer=opt)
    if rank == 1:  # a full disk on one rank only
        original = dcp.FileSystemWriter.write_data

        def full_disk(self, plan, planner):
            raise OSError(28, "No space left on device")

        dcp.FileSystemWriter.write_data = full_disk
    try:
        fbmt.checkpoint.save(folder, 2, model=model, optimizer=opt)
    except fbmt.checkpoint.CheckpointError as e:
        message = str(e)
    else:
        message = ""
    if rank == 1:
        dcp.FileSystemWriter.write_data = original
    return message, sorted(os.listdir(folder)), fbmt.checkpoint.latest(folder)


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_keeps_the_last_checkpoint(tmp_path):
    from tests.dist import run_ranks

    folder = str(tmp_path / "ck")
    for message, files, latest in run_ranks(2, _fail_on_rank1, folder):
        assert "writing" in message and "step-00000002" in message and "intact" in message, message
        assert files == [".lock", "step-00000001"] and latest.endswith("step-00000001")  # the job's lock stays


def test_an_incomplete_checkpoint_is_never_loaded_and_keep_prunes_old_ones(tmp_path):
    import fbmt

    folder = str(tmp_path / "ck")
    model, opt, _ = _fresh()
    for step in (1, 2, 3, 4):
        fbmt.checkpoint.save(folder, step, model=model, optimizer=opt, keep=2)
    assert [s for s, _ in fbmt.checkpoint.checkpoints(folder)] == [3, 4]
    os.unlink(os.path.join(folder, "step-00000004", "fbmt.json"))  # as if killed before the marker
    assert fbmt.checkpoint.latest(folder).endswith("step-00000003")
    assert fbmt.checkpoint.load(folder, model=model, optimizer=opt).step == 3
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"incomplete.*complete checkpoints beside it"):
        fbmt.checkpoint.load(os.path.join(folder, "step-00000004"), model=model)
    assert fbmt.checkpoint.load(str(tmp_path / "nothing-here"), model=model) is None


def test_loading_another_models_checkpoint_says_so(tmp_path):
    import fbmt
    from tests.models.reference import MLP

    model, opt, _ = _fresh()
    fbmt.checkpoint.save(str(tmp_path), 1, model=model)
    other = fbmt.compile(MLP())
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"does not fit this MLP: it holds .* the first '"):
        fbmt.checkpoint.load(str(tmp_path), model=other)


def _async_save(rank, world, folder):
    import fbmt

    model, opt, sched = _fresh()
    _train_steps(model, opt, sched, 2, 0, world, rank)
    at_save = model.full_parameters()
    import time

    import torch.distributed.checkpoint as dcp

    write = dcp.FileSystemWriter.write_data

    def slow_write(self, plan, planner):  # the disk is slow: the next steps run before the write
        time.sleep(1.0)
        return write(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow_write
    pending = fbmt.checkpoint.save(folder, 2, model=model, optimizer=opt, blocking=False)
    _train_steps(model, opt, sched, 2, 2, world, rank)  # training goes on while it writes
    assert pending.wait().endswith("step-00000002")
    model2, opt2, _ = _fresh()
    assert fbmt.checkpoint.load(folder, model=model2, optimizer=opt2).step == 2
    loaded = model2.full_parameters()
    for k, v in at_save.items():
        assert torch.equal(loaded[k], v), k  # what the model was at the save, not after


def test_a_background_save_holds_the_state_at_the_call_while_training_goes_on(tmp_path):
    from tests.dist import run_ranks

    run_ranks(2, _async_save, str(tmp_path / "ck"))


def test_a_checkpoint_with_more_layers_is_refused_by_its_first_extra_tensor(tmp_path):
    """A checkpoint of 4 layers loaded into 2 was accepted (model alone), the extra layers dropped;
    with the optimizer the error named the same names on both sides. strict=False loads what both hold."""
    import fbmt
    from tests.models.reference import gpt

    torch.manual_seed(0)
    bigger = fbmt.compile(gpt(n_layer=4))
    fbmt.checkpoint.save(str(tmp_path), 1, model=bigger, optimizer=torch.optim.SGD(bigger.parameters(), lr=0.1))
    smaller = fbmt.compile(gpt(n_layer=2))
    for opt in (None, torch.optim.SGD(smaller.parameters(), lr=0.1)):
        with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"this model lacks, the first 'h\.2\..*strict=False"):
            fbmt.checkpoint.load(str(tmp_path), model=smaller, optimizer=opt)
    fbmt.checkpoint.load(str(tmp_path), model=smaller, strict=False)
    full, want = smaller.state_dict(), bigger.state_dict()
    assert all(torch.equal(full[k], want[k]) for k in full)


def test_another_kind_of_optimizers_state_is_named_as_such(tmp_path):
    import fbmt

    model, opt, _ = _fresh()
    model(torch.randint(0, 64, (2, 16)))[0].sum().backward()
    opt.step()
    fbmt.checkpoint.save(str(tmp_path), 1, model=model, optimizer=opt)
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fbmt.checkpoint.CheckpointError, match=r"the state of a AdamW, and this optimizer is a SGD"):
        fbmt.checkpoint.load(str(tmp_path), model=model, optimizer=other)


_FAILING_BACKGROUND_SAVE = """
import sys, torch, fbmt
import torch.distributed.checkpoint as dcp
from tests.models.reference import MLP

def full_disk(self, *args, **kwargs):
    raise OSError(28, "No space left on device")

dcp.FileSystemWriter.write_data = full_disk
fbmt.checkpoint.save(sys.argv[1], 1, model=fbmt.compile(MLP()), blocking=False)
print("the script ends without waiting for the save")
"""


def test_a_background_save_that_fails_unwaited_is_reported_at_exit(tmp_path):
    """save(blocking=False) to a full disk, then the script exits without wait(): it exited 0 with no
    message and no checkpoint; now the failure is said and the exit code is 1."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(
        [sys.executable, "-c", _FAILING_BACKGROUND_SAVE, str(tmp_path / "ck")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=dict(os.environ, PYTHONPATH=root),
    )
    assert run.returncode == 1, run.stderr[-2000:]
    assert "a background save was never waited for, and failed" in run.stderr and "No space left" in run.stderr
    assert "the script ends" in run.stdout and not [n for n in os.listdir(tmp_path / "ck") if n.startswith("step-")]
