"""`compile_module`: the compiler's entry point, a plain module in, a `CompiledModule` out.

`fbmt.compile` (fbmt/api.py) is what users call: it checks the options, then calls this with the
class that adds the integrations and with remat="auto"'s search. This function plans the layout,
builds this rank's shards (materializing a `meta` model block by block), takes the module over and
resolves the options into a plan; nothing is traced until the first call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fbmt import job
from fbmt.compiler import owners
from fbmt.compiler.layout import plan_layout
from fbmt.compiler.module import CompiledModule
from fbmt.compiler.options import CompileOptions
from fbmt.compiler.pipeline import Search
from fbmt.compiler.plan import Plan
from fbmt.compiler.runtime.params import InitFn, agree_on_weights, build_shards
from fbmt.compiler.runtime.regions import in_background, start_compile_workers


def compile_module(
    model: nn.Module,
    options: CompileOptions,
    *,
    module_class: type[CompiledModule] = CompiledModule,
    search: Search | None = None,
    init_fn: InitFn | None = None,
    **class_args: Any,
) -> CompiledModule:
    """Compile `model` for every rank of the job (`options`: docs/options.md) into a `module_class`.

    The returned module's `parameters()` are this rank's flat shards: build any torch optimizer on
    them. Its `state_dict()` holds full tensors under the original keys. The model is taken over:
    its parameters are replaced by `meta` placeholders so only the shards hold memory. A model built
    under `torch.device("meta")` is materialized block by block with `init_fn(module)` (default:
    `options.init_fn`, else each module's `reset_parameters()`), so no rank ever holds the whole model.
    `search`: remat="auto"'s (`pipeline.Search`)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"fbmt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("fbmt.compile: this module is already compiled")
    taken = owners.taken(model)
    if taken is not None:
        raise ValueError(
            f"fbmt.compile: module '{taken or '<root>'}' ({type(model.get_submodule(taken)).__name__}) was "
            "compiled before: its parameters live in the shards of the CompiledModule that call returned, "
            "and it holds only meta placeholders (compiling it again would train fresh random weights). "
            "Use that compiled module; for a second copy, copy.deepcopy the model before compiling it"
        )
    owners.refuse_gradient_hooks(model)
    _check_embeddings(model)
    o = options
    launched = job.launched_world_size()
    if o.world_size is None and launched > 1 and not job.is_initialized():
        raise RuntimeError(
            f"fbmt.compile: this process is one of {launched} ranks (torchrun's WORLD_SIZE), but "
            "torch.distributed is not initialized, so it would train a whole copy of the model alone "
            "and no gradient would be averaged. Call fbmt.init_distributed() before fbmt.compile "
            "(or pass world_size=1 to compile a single-rank model on purpose)"
        )
    world = o.world_size or job.world_size()
    rank = job.rank() if world == job.world_size() else 0
    device = _device_for(model, o.device, world)
    if o.cuda_graph and device.type != "cuda":
        raise ValueError(
            f"fbmt.compile(cuda_graph=True): CUDA graphs need the model on a CUDA device, and this "
            f"one compiles for {device}; pass device='cuda' or leave cuda_graph off"
        )
    if o.fp8 is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        name, (major, minor) = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
        raise ValueError(
            f"fbmt.compile(fp8={o.fp8!r}): FP8 products need a GPU of compute capability 8.9 or later (Ada, "
            f"Hopper, Blackwell); {device} is a {name} of {major}.{minor}. Leave fp8 off on this GPU"
        )
    plan = Plan.of(o, world)  # every option resolved and checked, before the model is touched (NOTE: [Plan])
    if plan.backend == "inductor" and not in_background(o.background_compile, device, o.cuda_graph):
        start_compile_workers(device)  # they start while the model is built and traced
    layout = plan_layout(model, world, o.block_paths, param_dtype=o.param_dtype)
    if world > 1 and world == job.world_size():  # NOTE: [Ranks' weights]
        agree_on_weights(model, layout, o.weights)
    # NOTE: [Offload] in passes/shard.py: the shards (so their gradients and the optimizer's state) in
    # pinned host memory, which the device's copies read and write without staging; a model compiled on
    # `meta` to inspect its programs holds no memory, offloaded or not
    home = torch.device("cpu") if o.offload and device.type != "meta" else device
    shards = build_shards(model, layout, rank, device, o.init_fn or init_fn, home=home)
    return module_class(
        model, layout, shards, options=o, plan=plan, device=device, rank=rank, search=search, **class_args
    )


def _device_for(model: nn.Module, device: torch.device | str | None, world: int) -> torch.device:
    """Where the shards live and the program runs: `device` if given; else, for a model on a GPU that this
    process trains alone (`world_size=1`, or no process group), the model's own GPU, as a script run with
    `python train.py` after `model.cuda()` means; else this rank's device (its GPU under NCCL, the CPU
    under gloo). A model on a GPU in a job of ranks over gloo is refused: gloo reduces on the CPU."""
    if device is not None:
        return job.compute_device(device)
    held = {t.device for t in (*model.parameters(), *model.buffers()) if t.device.type not in ("meta", "cpu")}
    if len(held) != 1:
        return job.compute_device()
    (own,) = held
    if world == 1 or not job.is_initialized():
        return job.compute_device(own)
    if job.local_device().type == "cpu":
        raise ValueError(
            f"fbmt.compile: the model's parameters are on {own}, but this job's {world} ranks joined over "
            f"{dist.get_backend()}, whose collectives run on the CPU. Initialize with NCCL "
            "(fbmt.init_distributed() picks it when GPUs are visible, or backend='nccl'), or pass "
            "device='cpu' to train on the CPU on purpose"
        )
    return job.compute_device()


def _check_embeddings(model: nn.Module) -> None:
    """Embeddings fbmt cannot compile as eager runs them are refused, naming them and saying what to do:
    one that writes its own weight in the forward (`max_norm`), one with sparse gradients (a flat
    shard's gradient is dense)."""
    for path, m in model.named_modules():
        if not isinstance(m, (nn.Embedding, nn.EmbeddingBag)):
            continue
        name = f"{type(m).__name__} '{path or '<root>'}'"
        if m.max_norm is not None:
            raise ValueError(
                f"fbmt.compile: {name} has max_norm={m.max_norm}: each forward renormalizes, in place, the rows "
                "of its weight it reads, and a compiled program does not write its parameters. Build it without "
                "max_norm (a norm cap on what it returns, `e * (cap / e.norm(dim=-1, keepdim=True)).clamp(max=1)`, "
                "computes without writing the weight)"
            )
        if m.sparse:
            raise ValueError(
                f"fbmt.compile: {name} has sparse=True: its weight's gradient would be sparse, and a flat shard's "
                "gradient is dense. Build it with sparse=False before compiling (the same values, as a dense "
                "gradient; step it with a dense optimizer such as torch.optim.AdamW, not SparseAdam)"
            )
