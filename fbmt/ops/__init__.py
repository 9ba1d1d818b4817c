"""The IR's vocabulary: what the nodes of a program may be, and what fbmt knows about each op.

- `collectives`: the communication nodes (`all_gather`, `reduce_scatter`, `all_to_all_reduce`,
  `wait`, `release`) and their arguments by name;
- `record`: the recording ops of BMTrain's `inspect.record_tensor`;
- `tables`: per-op knowledge (aliasing, effects, expensive ops, FLOPs);
- `graph`: helpers every pass shares.

It imports nothing else of fbmt: the program, the passes and the runtime all build on it.
"""

from fbmt.ops import collectives, graph, record, tables
from fbmt.ops.collectives import (
    BUCKETABLE,
    COLLECTIVES,
    GATHERS,
    REDUCTIONS,
    STARTS,
    all_gather,
    all_to_all_reduce,
    bucket_key,
    bucket_of,
    gather_args,
    reduce_scatter,
    reduction_args,
    release,
    wait,
)
from fbmt.ops.graph import BWD, FWD, buffer_readers, emit, fake_like, nbytes, node_order
from fbmt.ops.tables import aliases, costs_nothing, effectful, expensive, flops, is_view, pure, view_base

__all__ = [
    "BWD",
    "FWD",
    "collectives",
    "graph",
    "record",
    "tables",
    "BUCKETABLE",
    "COLLECTIVES",
    "GATHERS",
    "REDUCTIONS",
    "STARTS",
    "all_gather",
    "all_to_all_reduce",
    "bucket_key",
    "bucket_of",
    "gather_args",
    "reduce_scatter",
    "reduction_args",
    "release",
    "wait",
    "buffer_readers",
    "emit",
    "fake_like",
    "nbytes",
    "node_order",
    "aliases",
    "costs_nothing",
    "effectful",
    "expensive",
    "flops",
    "is_view",
    "pure",
    "view_base",
]
