"""The table: one row per collective kind fbmt emits (NOTE: [Collective kinds] in spec.py).

all_gather         a group's shard -> its whole buffer, cast to the compute dtype on the way
reduce_scatter     a group's gradients -> this rank's shard of their mean or sum (a ring)
all_to_all_reduce  the same with the gradients' own, narrower dtype on the wire, summed wider by
                   the receiver (NOTE: [Narrow wire] in passes/shard.py); where the option asks
all_gather_from_host, reduce_scatter_to_host
                   the first two for a shard in host memory (NOTE: [Offload] in passes/shard.py):
                   copied to the device before the gather, the gradient's shard back after the
                   reduction; with offload=True (never on a narrow wire)
"""

from __future__ import annotations

from fbmt.compiler.collectives import reference, torch_impl
from fbmt.compiler.collectives.nodes import (
    GATHER,
    REDUCE,
    all_gather,
    all_gather_from_host,
    all_to_all_reduce,
    reduce_scatter,
    reduce_scatter_to_host,
)
from fbmt.compiler.collectives.spec import CollectiveKind, Need, register


def _narrow(need: Need) -> bool:
    """NOTE: [Narrow wire]: a reduction asked to sum wider than the gradients' own dtype sends them as
    they are, where the option allows it and there is a wire at all."""
    return (
        need.narrow_wire
        and need.world_size > 1
        and need.grads_dtype == need.compute_dtype
        and need.wire_dtype.itemsize > need.compute_dtype.itemsize
    )


ALL_GATHER = register(
    CollectiveKind(
        node=all_gather,
        role=GATHER,
        implementation=torch_impl.all_gather,
        bucketed=torch_impl.all_gather_bucket,
        reference=reference.all_gather,
        probe=torch_impl.probe_all_gather,
    )
)
REDUCE_SCATTER = register(
    CollectiveKind(
        node=reduce_scatter,
        role=REDUCE,
        implementation=torch_impl.reduce_scatter,
        bucketed=torch_impl.reduce_scatter_bucket,
        reference=reference.reduction,
        probe=torch_impl.probe_reduce_scatter,
    )
)
ALL_TO_ALL_REDUCE = register(
    CollectiveKind(
        node=all_to_all_reduce,
        role=REDUCE,
        implementation=torch_impl.all_to_all_reduce,
        reference=reference.reduction,
        probe=torch_impl.probe_all_to_all,
        buffers=2,  # the flat input, and what it receives
        sends=lambda need: need.compute_dtype,  # the gradients' own dtype
        label="on a narrow wire: all-to-all",
        use=_narrow,
    )
)
ALL_GATHER_FROM_HOST = register(
    CollectiveKind(
        node=all_gather_from_host,
        role=GATHER,
        implementation=torch_impl.all_gather_from_host,
        bucketed=torch_impl.all_gather_from_host_bucket,
        reference=reference.all_gather,
        probe=torch_impl.probe_all_gather_from_host,
        label="from host memory",
        use=lambda need: need.host,
        host=True,
    )
)
REDUCE_SCATTER_TO_HOST = register(
    CollectiveKind(
        node=reduce_scatter_to_host,
        role=REDUCE,
        implementation=torch_impl.reduce_scatter_to_host,
        bucketed=torch_impl.reduce_scatter_to_host_bucket,
        reference=reference.reduction,
        probe=torch_impl.probe_reduce_scatter_to_host,
        label="to host memory",
        use=lambda need: need.host,
        host=True,
    )
)
