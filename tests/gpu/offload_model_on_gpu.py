"""A model compiled with offload=True on CUDA + NCCL trains as the same model without offload.

    torchrun --nproc_per_node=N tests/gpu/offload_model_on_gpu.py

Offload (NOTE: [Offload] in fbmt/compiler/passes/shard.py) keeps the shards in pinned host memory and
copies them across as the collectives run. For fp32 and bf16 compute, eager and Inductor, the prefetch
and bucket schedules: 4 steps of a compiled GPT with offload=True against the same compile without it,
both stepped by `AdamOffloadOptimizer` (fbmt's C++ Adam: in place on the host shards with offload, on
a host master of the device shards without), with one micro-batch under `no_sync()`. The losses and
parameters must be bit-identical (no gradient clip: its norm sums host gradients in another order than
device ones); the shards and gradients must be pinned host tensors; the device must hold less between
steps with offload. Then a clipped step must agree within rounding.
"""

import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fbmt
from fbmt.models import GPT, GPTConfig
from fbmt.optim import AdamOffloadOptimizer

CFG = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256, dropout=0.0)


def data(step: int, rank: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 256, (2, CFG.seq_len), generator=g).to(device)


def loss_of(model, x):
    return F.cross_entropy(model(x)[:, :-1].reshape(-1, 256).float(), x[:, 1:].reshape(-1))


def train(offload: bool, options: dict, rank: int, device: torch.device, clip: bool = False) -> dict:
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.manual_seed(0)
    model = fbmt.compile(GPT(CFG), cache_dir=False, offload=offload, **options)
    opt = AdamOffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(4):
        x = data(step, rank, device)
        with model.no_sync():
            loss_of(model, x[:1]).backward()
        loss = loss_of(model, x[1:])
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        pinned = all(p.is_pinned() and p.grad.device.type == "cpu" for p in model.parameters())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    kinds = sorted({n.target.__name__ for n in model.program.collectives()})
    params = {k: v.cpu() for k, v in model.full_parameters().items()}
    return {
        "losses": losses,
        "params": params,
        "resident": torch.cuda.memory_allocated() - before,
        "pinned": pinned,
        "kinds": kinds,
    }


def main() -> int:
    fbmt.init_distributed()
    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    cases = {
        "fp32 eager": {},
        "bf16 eager": {"param_dtype": torch.bfloat16},
        "bf16 eager, buckets": {"param_dtype": torch.bfloat16, "schedule": ("bucket", {"bucket_bytes": 4 << 20})},
        "fp32 eager, zero=2": {"zero": 2},
        "bf16 inductor": {"param_dtype": torch.bfloat16, "backend": "inductor"},
    }
    failed = 0
    for name, options in cases.items():
        options = {"narrow_wire": False, **options}  # offload never sends on a narrow wire: the same program
        off, on = train(False, options, rank, device), train(True, options, rank, device)
        same_losses = off["losses"] == on["losses"]
        worst = max((on["params"][k] - v).abs().max().item() for k, v in off["params"].items())
        ok = same_losses and worst == 0.0 and on["pinned"] and on["resident"] < off["resident"]
        ok = ok and on["kinds"] == ["all_gather_from_host", "reduce_scatter_to_host"]
        failed += not ok
        if rank == 0:
            print(
                f"{name:22s} losses equal: {same_losses}  max |param diff| {worst:.1e}  pinned host shards, host "
                f"gradients: {on['pinned']}  device memory held between steps {off['resident'] / 2**20:.1f} -> "
                f"{on['resident'] / 2**20:.1f} MiB  {'ok' if ok else 'FAILED'}",
                flush=True,
            )
    off, on = train(False, {}, rank, device, clip=True), train(True, {}, rank, device, clip=True)
    worst = max((on["params"][k] - v).abs().max().item() for k, v in off["params"].items())
    failed += worst > 1e-5
    if rank == 0:
        print(f"{'fp32 eager, clipped':22s} max |param diff| {worst:.1e}  {'ok' if worst <= 1e-5 else 'FAILED'}")
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    sys.exit(main())
