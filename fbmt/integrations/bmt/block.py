"""`Block`, `TransformerBlockList` and `BMTrainModelWrapper`: BMTrain's units of sharding and recompute.

A `Block` is transparent: it shares its inner module's parameter, buffer and child dictionaries, so
`named_parameters()`, `state_dict()` keys and attribute access are those of the inner module (no
wrapper prefix). What makes it a Block is only where it sits: at lowering (NOTE: [Lowering]) each
outermost Block becomes a block of fbmt.compile's layout, with `use_checkpoint` as its remat policy
and `zero_level` as its ZeRO level. A `TransformerBlockList` is a sequence of Blocks; the schedule
pass overlaps the next block's gather and the previous block's gradient reduction with compute, as
it does for every chain of blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from fbmt.integrations.bmt.module import DistributedModule, make_distributed


class Block(DistributedModule):
    """One unit of sharding and recompute around `module` (BMTrain's `Block` / `CheckpointBlock`).

    Args:
        module: the wrapped module; its plain parameters become DistributedParameters now.
        use_checkpoint: recompute this block's activations in the backward instead of saving them.
        zero_level: 3 gathers the parameters again for the backward; 2 keeps them gathered from
            forward to backward (more memory, one all-gather less).
    """

    def __init__(self, module: nn.Module, use_checkpoint: bool = True, zero_level: int = 3, **unsupported: Any):
        super().__init__()
        if unsupported:
            raise TypeError(
                f"Block(): unsupported arguments {sorted(unsupported)} (fbmt supports use_checkpoint and zero_level)"
            )
        if zero_level not in (2, 3):
            raise ValueError(f"Block(zero_level={zero_level!r}): expected 2 or 3")
        if isinstance(module, Block):
            raise TypeError("Block(): the module is already a Block")
        make_distributed(module)
        self.__dict__["_module"] = module
        # Share the inner module's dictionaries: the Block *is* the module as far as names go.
        self._parameters, self._buffers, self._modules = module._parameters, module._buffers, module._modules
        self._non_persistent_buffers_set = module._non_persistent_buffers_set
        self.use_checkpoint, self.zero_level = bool(use_checkpoint), zero_level
        self.training = module.training

    @property
    def block_policy(self) -> tuple[bool, int]:
        """(use_checkpoint, zero_level): what lowering makes of this block (NOTE: [Lowering])."""
        return self.use_checkpoint, self.zero_level

    @property
    def inner_module(self) -> nn.Module:
        return self.__dict__["_module"]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner_module(*args, **kwargs)

    def train(self, mode: bool = True) -> Block:
        super().train(mode)
        self.inner_module.training = mode
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_module"], name)

    def __repr__(self) -> str:
        return f"Block(use_checkpoint={self.use_checkpoint}, zero_level={self.zero_level}, {self.inner_module!r})"


CheckpointBlock = Block


class TransformerBlockList(DistributedModule):
    """Blocks run in sequence (BMTrain's TransformerBlockList); also a list: len, iteration, indexing.

    `forward(*args, return_hidden_states=False)`: the first `num_hidden` arguments flow through the
    blocks (each block returns them, as a tensor or a tuple), the rest go to every block unchanged.
    Returns the last block's hidden values (one tensor when `num_hidden == 1`); with
    `return_hidden_states`, followed by one tensor per hidden value stacking its input to every
    block (shape `(len(self), *value.shape)`).
    """

    def __init__(self, modules: Iterable[nn.Module], num_hidden: int = 1, sqrt: bool = False):
        super().__init__()
        if sqrt:
            raise NotImplementedError(
                "TransformerBlockList(sqrt=True): square-root checkpointing is not supported; "
                "each Block's use_checkpoint decides its recompute"
            )
        if num_hidden < 1:
            raise ValueError(f"TransformerBlockList(num_hidden={num_hidden}): must be at least 1")
        for i, m in enumerate(modules):
            self.add_module(str(i), m if isinstance(m, Block) else Block(m))
        self.num_hidden = num_hidden

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[nn.Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> nn.Module:
        return list(self._modules.values())[index]

    def forward(self, *args: Any, return_hidden_states: bool = False) -> Any:
        if len(args) < self.num_hidden:
            raise TypeError(f"TransformerBlockList(num_hidden={self.num_hidden}) got {len(args)} arguments")
        hidden, rest = tuple(args[: self.num_hidden]), tuple(args[self.num_hidden :])
        inputs: list[tuple[torch.Tensor, ...]] = []
        for i, block in enumerate(self):
            if return_hidden_states:
                inputs.append(hidden)
            out = block(*hidden, *rest)
            out = out if isinstance(out, tuple) else (out,)
            if len(out) < self.num_hidden:
                raise ValueError(
                    f"TransformerBlockList: block {i} returned {len(out)} value(s), expected at least "
                    f"num_hidden={self.num_hidden}"
                )
            hidden = out[: self.num_hidden]
        result = hidden if self.num_hidden > 1 else hidden[0]
        if not return_hidden_states:
            return result
        stacked = tuple(torch.stack([h[k] for h in inputs]) for k in range(self.num_hidden))
        return (*hidden, *stacked)


def BMTrainModelWrapper(model: nn.Module) -> nn.Module:
    """Convert a plain module in place: each `ModuleList` becomes a TransformerBlockList of Blocks,
    every other module a DistributedModule, every parameter a DistributedParameter (values kept).
    Returns the model (a new TransformerBlockList if `model` itself is a ModuleList)."""
    if isinstance(model, DistributedModule) and any(isinstance(m, Block) for m in model.modules()):
        return model
    if isinstance(model, nn.ModuleList):
        return TransformerBlockList([Block(m) for m in model])
    for name, child in list(model.named_children()):
        converted = BMTrainModelWrapper(child)
        if converted is not child:
            setattr(model, name, converted)
    make_distributed(model)
    return model
