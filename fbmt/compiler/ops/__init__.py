"""The IR's vocabulary beyond communication: what fbmt knows about each op, and graph helpers.

- `tables`: per-op knowledge (aliasing, effects and purity, expensive ops, FLOPs);
- `record`: the recording ops of BMTrain's `inspect.record_tensor`, and print() in a traced forward;
- `graph`: helpers every pass shares (node order, emitting a node with its fake value, buffer readers);
- `fakes`: fbmt's fake kernels for built-in ops whose own fail where the real kernel computes.

Communication nodes are `fbmt.compiler.collectives`; a node's facts (phase, block, ...) are read
and written through `fbmt.compiler.meta`.
"""

from fbmt.compiler.ops import graph, record, tables
from fbmt.compiler.ops.fakes import fake_kernels
from fbmt.compiler.ops.graph import (
    buffer_readers,
    copy_node,
    emit,
    fake_like,
    fake_value,
    nbytes,
    node_order,
    size,
)
from fbmt.compiler.ops.tables import (
    ATTENTION_BACKWARD,
    ATTENTION_FORWARD,
    aliases,
    costs_nothing,
    effectful,
    expensive,
    flops,
    is_view,
    op_name,
    pure,
    view_base,
)

__all__ = [
    "ATTENTION_BACKWARD",
    "ATTENTION_FORWARD",
    "fake_kernels",
    "graph",
    "record",
    "tables",
    "buffer_readers",
    "copy_node",
    "emit",
    "fake_like",
    "fake_value",
    "nbytes",
    "node_order",
    "size",
    "aliases",
    "costs_nothing",
    "effectful",
    "expensive",
    "flops",
    "is_view",
    "op_name",
    "pure",
    "view_base",
]
