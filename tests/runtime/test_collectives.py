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


@pytest.mark.parametrize("world", [2, 3])
def test_a_bucket_gives_each_group_what_its_own_collective_gives(world):
    """NOTE: [Buckets]: one all-gather for several shards, cut into each group's buffer, and one
    reduce-scatter whose chunks hold every group's side by side, equal one collective per group:
    gathers bit for bit; sums to the wire dtype's rounding (with three ranks gloo may add them in
    another order when the buffer is laid out differently)."""
    from tests.workers import buckets

    for r in run_ranks(world, buckets):
        for what, (fused, alone) in r.items():
            assert len(fused) == len(alone) == 3, what
            bf16 = "bfloat16" in what and "reduce" in what
            tol = dict(rtol=2**-7, atol=2**-7) if bf16 else dict(rtol=1e-6, atol=1e-7)
            for i, (f, a) in enumerate(zip(fused, alone)):
                assert f.dtype == a.dtype, what
                if what.startswith("all_gather") or world == 2:
                    assert torch.equal(f, a), f"{what}, group {i}: {f} != {a}"
                torch.testing.assert_close(f, a, **tol, msg=lambda m: f"{what}, group {i}: {m}")


def test_a_buckets_columns_are_filled_row_after_row_and_the_rest_zeroed():
    # each rank's chunk of a group is a row of the group's columns in the bucket (NOTE: [Buckets]);
    # the padding must be zero: the last rank's shard gradient holds it, and gradient norms read it
    from fbmt.compiler.collectives.torch_impl import _fill

    bucket = torch.full((4, 7), float("nan"))  # 4 ranks; this group's chunk is 3 of each row's 7
    pieces = [torch.arange(1.0, 3.0), torch.arange(3.0, 5.0)]  # 4 elements: the second crosses a row end
    _fill(bucket[:, 2:5], pieces, torch.Tensor.copy_)
    assert bucket[:, 2:5].tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert bucket[:, :2].isnan().all() and bucket[:, 5:].isnan().all()  # the other groups' columns
    flat = torch.full((8,), float("nan"))
    _fill(flat, pieces, torch.Tensor.copy_)
    assert flat.tolist() == [1, 2, 3, 4, 0, 0, 0, 0]
    # one rank's reduction: bf16 pieces cast into the fp32 buffer by one foreach copy, rows or not
    for dest in (torch.full((8,), float("nan")), torch.full((4, 7), float("nan"))[:, 2:5]):
        _fill(dest, [p.bfloat16() for p in pieces])
        assert dest.dtype == torch.float32 and dest.flatten().tolist()[:6] == [1, 2, 3, 4, 0, 0]
