"""BMTrain's differentiable collectives (fbmt.distributed) on 2 and 4 gloo ranks."""

import pytest

from tests.dist import run_ranks
from tests.workers import collectives


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward(world):
    run_ranks(world, collectives)


def test_bad_op_is_named():
    import torch

    import fbmt.distributed as D

    with pytest.raises(ValueError, match="op='mean'"):
        D.all_reduce(torch.ones(2), "mean")
