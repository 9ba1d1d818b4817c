"""Multi-rank behaviours beyond numerical equivalence (spawned gloo ranks on CPU)."""

from tests.dist import run_ranks
from tests.workers import (
    dropout_recompute,
    last_block_saved,
    meta_init_memory,
    mismatched_shapes,
    state_dict_round_trip,
)


def test_dropout_recompute_reproduces_masks_on_two_ranks():
    run_ranks(2, dropout_recompute)


def test_last_blocks_saving_their_activations_still_matches_eager():
    for remat in run_ranks(2, last_block_saved):
        assert remat.trailing.blocks == ("h.1", "h.2", "ln_f", "lm_head") and remat.trailing.saved, remat


def test_state_dict_is_full_and_loads_into_shards():
    run_ranks(2, state_dict_round_trip)


def test_meta_model_is_materialized_shard_by_shard():
    blocks, width = 16, 2048  # 16 blocks of 16.8 MB: a 268 MB model
    # A fixed mmap threshold makes glibc return each freed block to the OS, so RSS shows live memory.
    for r in run_ranks(2, meta_init_memory, blocks, width, env={"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}):
        assert r["shard_bytes"] < 0.51 * r["model_bytes"]
        # Each rank keeps half the model plus, briefly, one block; never the whole model.
        assert r["peak"] < 0.5 * r["model_bytes"] + 3 * r["model_bytes"] / blocks, r


def test_ranks_with_different_programs_fail_instead_of_hanging():
    for msg in run_ranks(2, mismatched_shapes):
        assert "ranks compiled different programs" in msg and "same input shapes" in msg
