"""The runtime's gradient reductions on gloo ranks."""

import pytest
import torch

from tests.dist import run_ranks


@pytest.mark.parametrize("world", [2, 3])
def test_bf16_gradients_reduced_in_fp32_travel_as_bf16_and_sum_the_same(world):
    # NOTE: [Narrow wire]: the bf16 pieces exchanged (two ranks: an all-gather, three: an all-to-all)
    # and summed in fp32 by the receiver give what an fp32 reduce-scatter of the upcast pieces gives
    from tests.workers import narrow_pieces, narrow_wire

    every = torch.stack([torch.cat(narrow_pieces(q)) for q in range(world)]).double()
    want = torch.nn.functional.pad(every.mean(0), (0, 1)).view(world, -1)  # each rank's shard of the mean
    for rank, r in enumerate(run_ranks(world, narrow_wire)):
        torch.testing.assert_close(r["narrow"].double(), want[rank], rtol=1e-7, atol=0)
        torch.testing.assert_close(r["narrow"], r["ring"], rtol=1e-7, atol=0)
        torch.testing.assert_close(r["narrow"], r["reference"], rtol=1e-7, atol=0)
