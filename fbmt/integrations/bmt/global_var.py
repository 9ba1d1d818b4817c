"""`config`: what the job looks like (BMTrain's `bmtrain.global_var.config`), filled by
`fbmt.init_distributed` (the dict lives in `fbmt.distributed`, BMTrain's `bmt.distributed`)."""

from fbmt.integrations.bmt.distributed import config

__all__ = ["config"]
