"""`fbmt.compile`: turn a plain single-device module into a ZeRO-sharded, recomputing, overlapped one."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch
import torch.nn as nn

from fbmt import distributed
from fbmt.passes import default_pipeline
from fbmt.passes.blocks import plan_layout
from fbmt.passes.remat import POLICIES
from fbmt.passes.schedule import STRATEGIES
from fbmt.runtime.module import CompiledModule
from fbmt.runtime.params import build_shards

BACKENDS = ("eager", "inductor")


@dataclass(frozen=True)
class CompileOptions:
    zero: int = 3
    """3: gather parameters again for the backward; 2: keep them gathered from forward to backward."""
    remat: str = "block"
    """"block": save only block inputs and recompute each block in the backward; "selective": save
    matmul and attention outputs, recompute the cheap ops between them; "mincut": recompute only the
    cheap ops whose recompute saves memory (a minimum cut, as torch.compile's partitioner); "none":
    save all."""
    schedule: str = "prefetch"
    """A registered strategy: "prefetch" (overlap communication with compute) or "none"."""
    prefetch: int = 1
    """How many blocks ahead "prefetch" issues parameter gathers."""
    blocks: tuple[str, ...] | None = None
    """Module paths to use as blocks instead of the children of repeated ModuleLists."""
    block_policies: tuple[tuple[str, int, str], ...] = ()
    """(block path, zero, remat) for blocks whose policy differs from `zero`/`remat`."""
    grad_reduce: str = "mean"
    """How gradients combine over ranks: "mean" (as one big batch) or "sum" (BMTrain's convention)."""
    param_dtype: torch.dtype | None = None
    """Mixed precision: gather and compute with floating parameters in this dtype (shards, gradients
    and the optimizer keep the stored dtype); floating inputs are cast to it."""
    reduce_dtype: torch.dtype | None = None
    """Mixed precision: reduce gradients in this dtype (default: the stored dtype, e.g. fp32)."""
    direct_grads: bool = False
    """Weight gradients that are plain matrix products are written by them straight into the
    reduce-scatter buffer, in the reduce dtype (NOTE: [Direct gradients]). Experimental: on 2x H200
    with backend="inductor" it was 0.6-1.6% slower (each product cuts a compiled region; BENCHMARKS.md)."""
    backend: str = "eager"
    """"eager": run the aten graphs op by op; "inductor": compile each compute region between
    collectives with Inductor, once per distinct region (identical blocks share it)."""
    cuda_graph: bool = False
    """Replay each training step's forward and backward as CUDA graphs after two warm-up calls (CUDA
    only; NOTE: [CUDA graphs]): no launch gaps between kernels. Needs fixed input shapes and each
    backward before the next forward; gradients still set at a forward (not cleared with
    `zero_grad(set_to_none=True)`) are copied out of the graphs' memory first. The step's peak memory
    stays reserved between steps."""
    disable: tuple[str, ...] = ()
    """Pass names to skip (to bisect a problem); "shard" cannot be skipped."""
    checks: bool = False
    """Verify the program after every pass (always on in tests; $FBMT_CHECKS=1)."""
    dump_dir: str | None = None
    """Write the program after every pass to this folder ($FBMT_DUMP_DIR), for `diff`."""

    def __post_init__(self) -> None:
        for path, zero, remat in [("", self.zero, self.remat), *self.block_policies]:
            where = f" for block '{path}'" if path else ""
            if zero not in (2, 3):
                raise ValueError(f"fbmt.compile(zero={zero!r}){where}: expected 3 or 2")
            if remat not in POLICIES:
                raise ValueError(f"fbmt.compile(remat={remat!r}){where}: expected one of {POLICIES}")
        if self.schedule not in STRATEGIES:
            raise ValueError(f"fbmt.compile(schedule={self.schedule!r}): known strategies are {sorted(STRATEGIES)}")
        if self.prefetch < 1:
            raise ValueError(f"fbmt.compile(prefetch={self.prefetch}): must be at least 1")
        if self.grad_reduce not in ("mean", "sum"):
            raise ValueError(f"fbmt.compile(grad_reduce={self.grad_reduce!r}): expected 'mean' or 'sum'")
        if self.backend not in BACKENDS:
            raise ValueError(f"fbmt.compile(backend={self.backend!r}): expected one of {BACKENDS}")
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise ValueError(f"fbmt.compile({name}={dtype!r}): expected a floating-point torch.dtype")

    def pipeline(self) -> list:
        """The pass pipeline these options select."""
        return default_pipeline(zero=self.zero, remat=self.remat, schedule=self.schedule, prefetch=self.prefetch,
                                grad_reduce=self.grad_reduce, reduce_dtype=self.reduce_dtype,
                                direct_grads=self.direct_grads,
                                zero_per_block={b: z for b, z, _ in self.block_policies},
                                remat_per_block={b: r for b, _, r in self.block_policies})


Blocks = Union[list[str], dict[str, dict[str, Any]], None]


def make_options(*, zero: int = 3, remat: str = "block", schedule: str = "prefetch", prefetch: int = 1,
                 blocks: Blocks = None, grad_reduce: str = "mean", param_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, backend: str = "eager", disable: tuple[str, ...] = (),
                 checks: bool | None = None, dump_dir: str | None = None,
                 direct_grads: bool = False, cuda_graph: bool = False) -> CompileOptions:
    """CompileOptions from `fbmt.compile`'s keyword arguments (environment defaults filled in)."""
    policies = []
    if isinstance(blocks, dict):
        for path, policy in blocks.items():
            unknown = set(policy or {}) - {"zero", "remat"}
            if unknown:
                raise ValueError(f"fbmt.compile(blocks={{{path!r}: ...}}): unknown policy keys {sorted(unknown)}; "
                                 "a block's policy may set 'zero' and 'remat'")
            if policy:
                policies.append((path, policy.get("zero", zero), policy.get("remat", remat)))
    return CompileOptions(
        zero=zero, remat=remat, schedule=schedule, prefetch=prefetch,
        blocks=tuple(blocks) if blocks is not None else None, block_policies=tuple(policies),
        grad_reduce=grad_reduce, param_dtype=param_dtype, reduce_dtype=reduce_dtype, backend=backend,
        direct_grads=direct_grads, cuda_graph=cuda_graph, disable=tuple(disable),
        checks=bool(os.environ.get("FBMT_CHECKS")) if checks is None else checks,
        dump_dir=dump_dir or os.environ.get("FBMT_DUMP_DIR"))


def compile(model: nn.Module, *, zero: int = 3, remat: str = "block", schedule: str = "prefetch",
            prefetch: int = 1, blocks: Blocks = None, grad_reduce: str = "mean",
            param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
            backend: str = "eager", direct_grads: bool = False, cuda_graph: bool = False,
            disable: tuple[str, ...] = (), checks: bool | None = None, dump_dir: str | None = None,
            world_size: int | None = None, device: torch.device | str | None = None,
            init_fn: Callable[[nn.Module], None] | None = None) -> CompiledModule:
    """Compile `model` for training on every rank of the job (see README and docs/ARCHITECTURE.md).

    The returned module's `parameters()` are this rank's flat shards: build any torch optimizer on
    them. Its `state_dict()` holds full tensors under the original keys. The model is taken over:
    its parameters are replaced by `meta` placeholders so only the shards hold memory. A model built
    under `torch.device("meta")` is materialized block by block with `init_fn(module)` or each
    module's `reset_parameters()`, so no rank ever holds the whole model.

    Mixed precision as FSDP2's MixedPrecisionPolicy: `param_dtype=torch.bfloat16` gathers and
    computes in bf16 while shards, gradients and the optimizer stay in the stored dtype (fp32);
    `reduce_dtype` is the dtype gradients are reduced in (default: the stored one).

    `blocks` is a list of module paths, or a dict from path to that block's own policy, e.g.
    `{"layers.0": {"remat": "none"}, "layers.1": {}}`. `world_size` (default: the process group's)
    lets one process compile for any world size, to inspect programs with `model.trace(*inputs)`;
    running such a model needs that many ranks.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fbmt.compile expects an nn.Module, got {type(model).__name__}")
    if isinstance(model, CompiledModule):
        raise TypeError("fbmt.compile: this module is already compiled")
    options = make_options(zero=zero, remat=remat, schedule=schedule, prefetch=prefetch, blocks=blocks,
                           grad_reduce=grad_reduce, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                           backend=backend, direct_grads=direct_grads, cuda_graph=cuda_graph, disable=disable,
                           checks=checks, dump_dir=dump_dir)
    world = world_size or distributed.world_size()
    rank = distributed.rank() if world == distributed.world_size() else 0
    device = resolve_device(device)
    if cuda_graph and device.type != "cuda":
        raise ValueError(f"fbmt.compile(cuda_graph=True): CUDA graphs need the model on a CUDA device, and this "
                         f"one compiles for {device}; pass device='cuda' or leave cuda_graph off")
    layout = plan_layout(model, world, list(options.blocks) if options.blocks is not None else None,
                         param_dtype=param_dtype)
    shards = build_shards(model, layout, rank, device, init_fn)
    return CompiledModule(model, layout, shards, options=options, device=device, rank=rank)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The compute device: the given one, else this rank's; "cuda" means the current CUDA device."""
    device = torch.device(device) if device is not None else distributed.local_device()
    if device.type == "cuda" and device.index is None:  # compare as cuda:N
        device = torch.device("cuda", torch.cuda.current_device())
    return device
