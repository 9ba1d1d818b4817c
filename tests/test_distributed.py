"""fbmt.distributed: init_distributed alone is rank 0 of 1, an unreachable rendezvous is an error, not a
hang; BMTrain's differentiable collectives on 2 and 4 gloo ranks."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.dist import run_ranks
from tests.workers import collectives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(code: str, env: dict) -> subprocess.CompletedProcess:
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )


def test_without_a_launcher_it_is_a_single_rank_with_seeded_rngs():
    code = (
        "import fbmt, torch, random; fbmt.init_distributed(seed=3); "
        "print(fbmt.rank(), fbmt.world_size(), torch.randint(0, 10**9, ()).item(), random.random())"
    )
    a, b = _run(code, {}), _run(code, {})
    assert a.returncode == 0, a.stderr
    assert a.stdout.split()[:2] == ["0", "1"] and a.stdout == b.stdout  # same seed, same numbers


def test_unreachable_rendezvous_fails_with_a_clear_message_in_time():
    port = _free_port()  # nobody listens there: rank 1 waits for a rank 0 that never comes
    started = time.time()
    r = _run(
        "import fbmt; fbmt.init_distributed(timeout=5, backend='gloo')",  # gloo: also on a machine with one GPU
        dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
    )
    assert r.returncode != 0
    assert time.time() - started < 60
    assert "rank 1 of 2 could not join the job at 127.0.0.1:" in r.stderr and "FBMT_INIT_TIMEOUT" in r.stderr


def test_more_nccl_ranks_than_gpus_on_a_machine_is_named():
    gpus = torch.cuda.device_count()
    r = _run(
        "import fbmt; fbmt.init_distributed(backend='nccl')",
        dict(
            RANK=str(gpus),
            WORLD_SIZE=str(gpus + 1),
            LOCAL_RANK=str(gpus),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
        ),
    )
    assert r.returncode != 0
    assert f"LOCAL_RANK={gpus}, but this machine has {gpus} CUDA device(s)" in r.stderr, r.stderr[-2000:]
    assert "--nproc_per_node" in r.stderr and "backend='gloo'" in r.stderr


def test_missing_master_address_is_named():
    r = _run("import fbmt; fbmt.init_distributed()", dict(RANK="0", WORLD_SIZE="2"))
    assert r.returncode != 0 and "MASTER_ADDR" in r.stderr and "torchrun" in r.stderr


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward(world):
    run_ranks(world, collectives)


def test_bad_op_is_named():
    import fbmt.distributed as D

    with pytest.raises(ValueError, match="op='mean'"):
        D.all_reduce(torch.ones(2), "mean")


def _parts(rank: int, world: int) -> list:
    import fbmt

    x, y = torch.arange(24.0).reshape(8, 3), {"labels": torch.arange(8)}
    mine = fbmt.local_part((x, y))
    try:
        fbmt.local_part(torch.zeros(5, 2))
    except ValueError as e:
        error = str(e)
    return [mine, error]


def test_local_part_gives_each_rank_its_own_part_of_the_global_batch():
    got = run_ranks(2, _parts)
    x = torch.cat([g[0][0] for g in got])
    assert torch.equal(x, torch.arange(24.0).reshape(8, 3))
    assert torch.equal(torch.cat([g[0][1]["labels"] for g in got]), torch.arange(8))
    assert "a global batch of 5 (dim 0 of a tensor of shape (5, 2)) does not split into 2 equal parts" in got[0][1]
