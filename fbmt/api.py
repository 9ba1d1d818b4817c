"""`fbmt.compile`: turn a plain single-device module into a ZeRO-sharded, recomputing, overlapped one.

This is the compiler's public face: the BMTrain layer (`fbmt/bmt`) and users build on the names here
(and on `fbmt.layout`, `fbmt.trace`, `fbmt.ops`), not on the passes or the runtime.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch.nn as nn

from fbmt import distributed
from fbmt.compiled import CompiledModule
from fbmt.layout import plan_layout
from fbmt.options import CompileOptions
from fbmt.runtime.params import build_shards

__all__ = ["compile", "CompileOptions", "CompiledModule"]


def compile(model: nn.Module, **options: Any) -> CompiledModule:
    """Compile `model` for training on every rank of the job; the options are `CompileOptions`'
    fields (docs/options.md).

    The returned module's `parameters()` are this rank's flat shards: build any torch optimizer on
    them. Its `state_dict()` holds full tensors under the original keys. The model is taken over:
    its parameters are replaced by `meta` placeholders so only the shards hold memory. A model built
    under `torch.device("meta")` is materialized block by block with `init_fn(module)` or each
    module's `reset_parameters()`, so no rank ever holds the whole model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fbmt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("fbmt.compile: this module is already compiled")
    taken = next((path for path, m in model.named_modules() if getattr(m, "_fbmt_compiled", False)), None)
    if taken is not None:
        raise ValueError(
            f"fbmt.compile: module '{taken or '<root>'}' ({type(model.get_submodule(taken)).__name__}) was "
            "compiled before: its parameters live in the shards of the CompiledModule that call returned, "
            "and it holds only meta placeholders (compiling it again would train fresh random weights). "
            "Use that compiled module; for a second copy, copy.deepcopy the model before compiling it"
        )
    o = CompileOptions.from_kwargs(options)
    launched = distributed.launched_world_size()
    if o.world_size is None and launched > 1 and not distributed.is_initialized():
        raise RuntimeError(
            f"fbmt.compile: this process is one of {launched} ranks (torchrun's WORLD_SIZE), but "
            "torch.distributed is not initialized, so it would train a whole copy of the model alone "
            "and no gradient would be averaged. Call fbmt.init_distributed() before fbmt.compile "
            "(or pass world_size=1 to compile a single-rank model on purpose)"
        )
    world = o.world_size or distributed.world_size()
    rank = distributed.rank() if world == distributed.world_size() else 0
    device = distributed.compute_device(o.device)
    if o.cuda_graph and device.type != "cuda":
        raise ValueError(
            f"fbmt.compile(cuda_graph=True): CUDA graphs need the model on a CUDA device, and this "
            f"one compiles for {device}; pass device='cuda' or leave cuda_graph off"
        )
    layout = plan_layout(model, world, list(o.blocks) if o.blocks is not None else None, param_dtype=o.param_dtype)
    shards = build_shards(model, layout, rank, device, o.init_fn)
    for m in model.modules():  # a copy.deepcopy of the module keeps the mark
        m._fbmt_compiled = True
    return CompiledModule(model, layout, shards, options=o, device=device, rank=rank)


# `inspect.signature(fbmt.compile)` and help() show every option with its default.
compile.__signature__ = inspect.Signature(
    [inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=nn.Module)]
    + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=f.type)
        for f in dataclasses.fields(CompileOptions)
        if f.init
    ],
    return_annotation=CompiledModule,
)
