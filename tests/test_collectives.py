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


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_gradients_reduced_in_fp32_travel_as_bf16_and_sum_the_same(world):
    # NOTE: [Narrow wire]: the bf16 pieces exchanged (two ranks: an all-gather, three: an all-to-all)
    # and summed in fp32 by the receiver give what an fp32 reduce-scatter of the upcast pieces gives
    import torch

    from tests.workers import narrow_pieces, narrow_wire

    every = torch.stack([torch.cat(narrow_pieces(q)) for q in range(world)]).double()
    want = torch.nn.functional.pad(every.mean(0), (0, 1)).view(world, -1)  # each rank's shard of the mean
    for rank, r in enumerate(run_ranks(world, narrow_wire)):
        assert r["1"][0] and not r["0"][0]  # the exchange, then the fp32 reduce-scatter
        torch.testing.assert_close(r["1"][1].double(), want[rank], rtol=1e-7, atol=0)
        torch.testing.assert_close(r["1"][1], r["0"][1], rtol=1e-7, atol=0)
