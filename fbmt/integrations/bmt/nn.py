"""BMTrain's layers (`bmtrain.nn`): `Linear` as a DistributedModule, and the tensor-parallel names.

Tensor parallelism is not supported yet (`init_distributed(tp_size>1)` raises), so with its only
possible size, 1, `ColumnParallelLinear` and `RowParallelLinear` are `Linear` and `VPEmbedding` is an
embedding whose `projection` maps hidden states back to the vocabulary. Scripts that import them
run unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fbmt.integrations.bmt.module import DistributedModule
from fbmt.integrations.bmt.parameter import DistributedParameter, ParameterInitializer


class Linear(DistributedModule):
    """`y = x @ weight.T + bias`, weight (dim_out, dim_in) Xavier-normal, bias zeros (BMTrain's init)."""

    def __init__(self, dim_in: int, dim_out: int, bias: bool = True, dtype: torch.dtype | None = None):
        super().__init__()
        self.dim_in, self.dim_out = self.in_features, self.out_features = dim_in, dim_out
        self.weight = DistributedParameter(
            torch.empty(dim_out, dim_in, dtype=dtype), init_method=torch.nn.init.xavier_normal_
        )
        self.bias = (
            DistributedParameter(torch.empty(dim_out, dtype=dtype), init_method=torch.nn.init.zeros_) if bias else None
        )

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    """`Linear` (tensor-parallel size 1): the gather/split options have nothing to split."""

    def __init__(
        self,
        dim_in: int,
        dim_out: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        gather_output: bool = False,
        gather_input: bool = True,
        async_gather_chunks: int = 2,
    ):
        super().__init__(dim_in, dim_out, bias, dtype)


class RowParallelLinear(Linear):
    """`Linear` (tensor-parallel size 1): the split/all-reduce options have nothing to split."""

    def __init__(
        self,
        dim_in: int,
        dim_out: int,
        bias: bool = True,
        dtype: torch.dtype | None = None,
        split_input: bool = False,
        all_reduce_output: bool = False,
    ):
        super().__init__(dim_in, dim_out, bias, dtype)


class VPEmbedding(DistributedModule):
    """A vocabulary embedding (tensor-parallel size 1); `projection(x)` gives vocabulary logits."""

    def __init__(
        self,
        vocab_size: int,
        embedding_size: int,
        dtype: torch.dtype = torch.half,
        init_mean: float = 0.0,
        init_std: float = 1.0,
    ):
        super().__init__()
        self.vocab_size, self.dim_model = vocab_size, embedding_size
        self.weight = DistributedParameter(
            torch.empty(vocab_size, embedding_size, dtype=dtype),
            init_method=ParameterInitializer(torch.nn.init.normal_, mean=init_mean, std=init_std),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def projection(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


__all__ = ["Linear", "ColumnParallelLinear", "RowParallelLinear", "VPEmbedding"]
