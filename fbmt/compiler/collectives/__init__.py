"""Everything fbmt knows about a collective, one row per kind (NOTE: [Collective kinds] in spec.py).

    nodes.py      the IR's communication nodes (starts, `wait`, `release`) and their arguments by role
    spec.py       `CollectiveKind` (a row) and the lookups every layer uses: `kind_of`, `choose`, bytes, buckets
    query.py      a program's collectives as `Collective` records (start, wait, release, bytes, ...)
    table.py      the rows of the kinds fbmt emits: all_gather, reduce_scatter, all_to_all_reduce, and
                  with offload all_gather_from_host, reduce_scatter_to_host
    torch_impl.py their implementations on torch.distributed (copy and reduce streams), and probes
    reference.py  what they mean: results computed synchronously from all-gathers
    copies.py     the bounded-grid Triton copy and sum kernels the implementations use on CUDA

NOTE: [Buckets]
Several collectives of one kind can be fused into one call on the wire (a bucket): fewer calls, so
less fixed latency per byte, for groups too small to fill a link. In the IR they stay one start and
one wait per group, so everything that reads a program (verify, the simulator, `fbmt.Schedule`, the
reference executor) keeps reading per-group collectives; their starts carry the same bucket number
(`meta.bucket`) and stand next to each other, and `verify` checks that members agree on what one
call needs (`bucket_key`: kind, phase, ranks, dtype on the wire, averaging). The partitioner lowers
each run of members to one call of their kind's `bucketed` implementation, which returns a handle per
member, so each member's wait stays where the schedule put it. A kind without one (an all-to-all,
whose exchange is not one buffer per rank) is never bucketed.
"""

from fbmt.compiler.collectives import table
from fbmt.compiler.collectives.nodes import (
    GATHER,
    REDUCE,
    Gather,
    Reduction,
    all_gather,
    all_gather_from_host,
    all_to_all_reduce,
    gather_args,
    not_run,
    reduce_scatter,
    reduce_scatter_to_host,
    reduction_args,
    release,
    wait,
)
from fbmt.compiler.collectives.query import Collective, collectives
from fbmt.compiler.collectives.spec import (
    CollectiveKind,
    Need,
    bucket_key,
    choose,
    held_bytes,
    host_bytes,
    is_collective,
    is_gather,
    is_reduction,
    is_release,
    is_start,
    is_wait,
    kind_of,
    kinds,
    lowered,
    named,
    register,
    unregister,
    wire_bytes,
    wire_dtype,
)
from fbmt.compiler.collectives.torch_impl import Pending

__all__ = [
    "GATHER",
    "REDUCE",
    "Collective",
    "CollectiveKind",
    "Gather",
    "Need",
    "Pending",
    "Reduction",
    "all_gather",
    "all_gather_from_host",
    "all_to_all_reduce",
    "bucket_key",
    "choose",
    "collectives",
    "gather_args",
    "held_bytes",
    "host_bytes",
    "is_collective",
    "is_gather",
    "is_reduction",
    "is_release",
    "is_start",
    "is_wait",
    "kind_of",
    "kinds",
    "lowered",
    "named",
    "not_run",
    "reduce_scatter",
    "reduce_scatter_to_host",
    "reduction_args",
    "register",
    "release",
    "table",
    "unregister",
    "wait",
    "wire_bytes",
    "wire_dtype",
]
