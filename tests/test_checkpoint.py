"""`fbmt.checkpoint.save_atomic`: a reader sees the old file or the complete new one, never a part."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from fbmt.checkpoint import save_atomic


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
        from fbmt.checkpoint import save_atomic

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
