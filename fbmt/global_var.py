"""`config`: what the job looks like (BMTrain's `bmtrain.global_var.config`), filled by
`fbmt.init_distributed`. Tensor and pipeline parallelism are not supported, so `tp_size` and
`pipe_size` are 1 and every parameter is sharded over all ranks (`zero_size == world_size`)."""

from __future__ import annotations

from typing import Any

config: dict[str, Any] = dict(rank=0, local_rank=0, world_size=1, local_size=1, zero_size=1, zero_rank=0,
                              tp_size=1, tp_rank=0, tp_zero_size=1, tp_zero_rank=0, pipe_size=1, pipe_rank=0,
                              device="cpu", initialized=False)
