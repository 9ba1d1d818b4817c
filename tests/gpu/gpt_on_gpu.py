"""The GPT equivalence check on CUDA + NCCL, with host synchronization forbidden inside steps.

    torchrun --nproc_per_node=2 tests/gpu/gpt_on_gpu.py

For every zero/remat/schedule combination (eager, and some with backend="inductor", one of them with
direct_grads, four with cuda_graph=True): 5 SGD steps of a compiled GPT (each rank one sequence of the
global batch: so few tokens that its last two blocks save their activations under remat="block",
NOTE: [Trailing blocks]) against eager PyTorch on the whole batch on one GPU. After the first step
(which compiles), steps run under `torch.cuda.set_sync_debug_mode("error")`: any host sync inside
fbmt's forward, backward or the collectives raises (with cuda_graph=True, after the step that captures).
With cuda_graph=True it also checks that the gradients are the graph pool's memory (no copy), and that
the misuses the graphs must refuse are refused: a forward while the last gradients are still set, and
two forwards before a backward.
"""

import itertools
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fbmt
from fbmt.models import GPT, GPTConfig
from fbmt.runtime.graphs import WARMUP

CFG = GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=256, dropout=0.0)


def data(step: int, batch: int, device: torch.device):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 256, (batch, CFG.seq_len), generator=g)
    return x.to(device), torch.roll(x, -1, 1).to(device)


def run(model, steps: int, rank: int, world: int, device, guard: int, batch: int):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = data(step, batch, device)
        n = batch // world
        x, y = x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        if step >= guard:
            torch.cuda.set_sync_debug_mode("error")
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.set_sync_debug_mode(0)
        losses.append(loss.detach())
    return torch.stack(losses)


def misuse(model, rank: int, world: int, device) -> float:
    """The graphs' rules (NOTE: [CUDA graphs]): refused, not silently wrong. Returns 0, or 1 on a failure."""
    failed = 0.0
    x, y = data(0, world, device)
    x, y = x[rank:rank + 1], y[rank:rank + 1]
    shard = model.flat_params[0]
    F.cross_entropy(model(x).view(-1, 256), y.reshape(-1)).backward()
    stolen = shard.grad.untyped_storage().data_ptr() in model._graphed[1]._grad_storage
    for what, call in (("a forward with last step's gradients still set", lambda: model(x)),
                       ("two forwards before a backward", lambda: (model.zero_grad(), model(x), model(x)))):
        try:
            call()
            failed = 1.0
            result = "NOT refused (FAILED)"
        except RuntimeError as e:
            result = f"refused: {str(e)[:80]}..."
        if rank == 0:
            print(f"    cuda_graph: {what}: {result}", flush=True)
    if rank == 0:
        print(f"    cuda_graph: gradients are views of the graph pool (no copy): {stolen}", flush=True)
    return failed if stolen else 1.0


def main() -> None:
    fbmt.init_distributed(seed=0)
    rank, world = fbmt.rank(), fbmt.world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    ref = GPT(CFG).to(device)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    want = run(ref, 5, 0, 1, device, guard=99, batch=world)
    want_params = {n: p.detach() for n, p in ref.named_parameters()}
    worst = 0.0
    combos = [(z, r, s, "eager", False, False) for z, r, s in itertools.product(
        (3, 2), ("block", "selective", "none"), ("prefetch", "none"))]
    combos += [(3, "block", "prefetch", "inductor", False, False),
               (3, "selective", "prefetch", "inductor", False, False),
               (3, "mincut", "prefetch", "inductor", False, False), (2, "mincut", "prefetch", "inductor", False, False),
               (3, "block", "prefetch", "inductor", True, False),
               (3, "block", "prefetch", "eager", False, True), (3, "block", "prefetch", "inductor", False, True),
               (3, "mincut", "prefetch", "inductor", False, True), (2, "mincut", "prefetch", "inductor", False, True)]
    for zero, remat, schedule, backend, direct, graph in combos:
        torch.manual_seed(0)
        model = GPT(CFG)
        model.load_state_dict(init)
        model = fbmt.compile(model, zero=zero, remat=remat, schedule=schedule, backend=backend, checks=True,
                             direct_grads=direct, cuda_graph=graph)
        t0 = time.perf_counter()
        losses = run(model, 5, rank, world, device, guard=WARMUP + 1 if graph else 1, batch=world)
        torch.cuda.synchronize()
        dist.all_reduce(losses)
        losses /= world
        got = model.full_parameters()
        err = max((got[n] - p).abs().max().item() / p.abs().max().item() for n, p in want_params.items())
        lerr = ((losses - want).abs() / want.abs()).max().item()
        worst = max(worst, err, lerr)
        if rank == 0:
            print(f"zero={zero} remat={remat:<9} schedule={schedule:<8} {backend:<8}"
                  f"{' direct_grads' if direct else ''}{' cuda_graph' if graph else ''}: loss rel err {lerr:.1e}, "
                  f"param max rel err after 5 steps {err:.1e}, 5 steps {time.perf_counter() - t0:.2f}s "
                  f"(no host sync after step 1); remat: {model.program.summary('remat')[-90:]}", flush=True)
        if graph:
            worst = max(worst, misuse(model, rank, world, device))
            model.release_graphs()  # NCCL's communicators wait for graphs that captured them
    if rank == 0:
        print(f"GPU check {'PASSED' if worst < 1e-4 else 'FAILED'}: worst relative error {worst:.1e} "
              f"on {world} x {torch.cuda.get_device_name()} with torch {torch.__version__}", flush=True)
    dist.destroy_process_group()
    if worst >= 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
