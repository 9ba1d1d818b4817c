"""The GPT (and Llama) equivalence check on CUDA + NCCL, with host synchronization forbidden inside steps.

    torchrun --nproc_per_node=2 tests/gpu/gpt_on_gpu.py

For every zero/remat/schedule combination (eager, and some with backend="inductor", four with
cuda_graph=True): 5 SGD steps of a compiled GPT (each rank one sequence of the
global batch: so few tokens that its last two blocks save their activations under remat="block",
NOTE: [Trailing blocks]) against eager PyTorch on the whole batch on one GPU. After the first step
(which compiles; regions compiling in the background are waited for), steps run under
`torch.cuda.set_sync_debug_mode("error")`: any host sync inside
fbmt's forward, backward or the collectives raises (with cuda_graph=True, after the step that captures).
With cuda_graph=True it also checks what the graphs promise: the gradients are the graph pool's memory
(no copy); gradients accumulated over two backward calls, or zeroed in place, add up as eagerly; two
forwards before a backward are refused. Then a Llama-style model (tests/models/reference.py), whose
q/k and gate/up products the merge pass merges (NOTE: [Merged products]), in the benchmark's settings;
and the GPT's products in FP8 against its bf16 program (`fp8_rules`).
"""

import itertools
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import fbmt
from fbmt.compiler.runtime.graphs import WARMUP
from fbmt.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.models.reference import Llama  # noqa: E402

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
        x, y = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        if step == guard and hasattr(model, "wait_compiled"):
            model.wait_compiled()  # the background compiles in first: a compile may synchronize, the steps not
        if step >= guard:
            torch.cuda.set_sync_debug_mode("error")
        loss = F.cross_entropy(model(x).view(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        torch.cuda.set_sync_debug_mode(0)
        losses.append(loss.detach())
    return torch.stack(losses)


def _steps(model):
    """A backward of one batch, and every gradient gathered as one flat tensor."""

    def backward(x, y):
        F.cross_entropy(model(x).view(-1, 256), y.reshape(-1)).backward()

    def grads():
        return torch.cat([g.reshape(-1) for g in model.full_gradients().values()])

    return backward, grads


def graph_rules(model, rank: int, world: int, device) -> float:
    """What the graphs promise (NOTE: [CUDA graphs]): the gradients are the pool's memory; gradients
    accumulated over two backward calls, or zeroed in place, are copied out of the pool before the next
    replay, so they add up as eagerly; two forwards before a backward are refused. 0, or 1 on a failure."""
    failed = 0.0
    batches = [tuple(t[rank : rank + 1] for t in data(step, world, device)) for step in (10, 11)]
    backward, grads = _steps(model)
    model.zero_grad()
    backward(*batches[0])
    stolen = model.flat_params[0].grad.untyped_storage().data_ptr() in model.graphs._grad_storage
    first = grads()
    model.zero_grad()
    backward(*batches[1])
    second = grads()
    model.zero_grad()
    backward(*batches[0])
    backward(*batches[1])  # accumulates onto the first batch's gradients
    both = grads()
    for p in model.parameters():  # zero_grad(set_to_none=False), as BMTrain's OptimManager does
        p.grad.zero_()
    backward(*batches[1])
    again = grads()
    checks = {
        "gradients are the graph pool's memory (no copy)": stolen,
        "two backward calls accumulate": torch.allclose(both, first + second, rtol=1e-4, atol=1e-6),
        "gradients zeroed in place, then one backward": torch.allclose(again, second, rtol=1e-4, atol=1e-6),
    }
    model.zero_grad()
    try:
        outs = (model(batches[0][0]), model(batches[0][0]))
        checks["two forwards before a backward are refused"] = False
        del outs
    except RuntimeError:
        checks["two forwards before a backward are refused"] = True
    for what, ok in checks.items():
        failed = max(failed, 0.0 if ok else 1.0)
        if rank == 0:
            print(f"    cuda_graph: {what}: {'yes' if ok else 'NO (FAILED)'}", flush=True)
    return failed


def sync_rules(model, rank: int, world: int, device) -> float:
    """Accumulation without sync (NOTE: [Accumulation without sync]) on CUDA streams: two micro-batches, the
    first under no_sync(), give the gradients of two synced backward calls, with one reduction per group."""
    batches = [tuple(t[rank : rank + 1] for t in data(step, world, device)) for step in (12, 13)]
    backward, grads = _steps(model)
    model.zero_grad()
    for b in batches:
        backward(*b)
    synced = grads()
    model.zero_grad()
    before = model.gradient_reductions
    with model.no_sync():
        backward(*batches[0])
    backward(*batches[1])
    once = model.gradient_reductions - before == len(model.layout.groups)
    ok = once and torch.allclose(grads(), synced, rtol=1e-4, atol=1e-6)
    model.zero_grad()
    if rank == 0:
        said = "yes" if ok else "NO (FAILED)"
        print(f"    no_sync: accumulates as synced backward calls, one reduction per group: {said}", flush=True)
    return 0.0 if ok else 1.0


def check(build, combos: list[tuple], rank: int, world: int, device: torch.device) -> float:
    """`build()`'s model compiled with each combination against eager PyTorch: the worst relative error."""
    torch.manual_seed(0)
    ref = build().to(device)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    want = run(ref, 5, 0, 1, device, guard=99, batch=world)
    want_params = {n: p.detach() for n, p in ref.named_parameters()}
    worst = 0.0
    for zero, remat, schedule, backend, graph in combos:
        torch.manual_seed(0)
        model = build()
        model.load_state_dict(init)
        model = fbmt.compile(
            model, zero=zero, remat=remat, schedule=schedule, backend=backend, checks=True, cuda_graph=graph
        )
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
            print(
                f"{type(ref).__name__} zero={zero} remat={remat:<9} schedule={schedule:<8} {backend:<8}"
                f"{' cuda_graph' if graph else ''}: loss rel err {lerr:.1e}, "
                f"param max rel err after 5 steps {err:.1e}, 5 steps {time.perf_counter() - t0:.2f}s "
                f"(no host sync after step 1); remat: {model.program.summary('remat')[-60:]}; "
                f"merge: {model.program.summary('merge')}",
                flush=True,
            )
        if graph:
            worst = max(worst, graph_rules(model, rank, world, device))
            model.release_graphs()  # NCCL's communicators wait for graphs that captured them
        elif backend == "inductor" or schedule == "bucket":
            worst = max(worst, sync_rules(model, rank, world, device))
    return worst


def fp8_rules(rank: int, world: int, device: torch.device) -> float:
    """FP8 products (NOTE: [FP8 products]) on this GPU, with Inductor: the GPT, its weights ones bf16 holds
    exactly, trains 5 steps within 3% of its bf16 program's losses; on one rank its gathers copy nothing
    and each weight is cast where it is read (NOTE: [One rank's gathers]), and the first step's loss equals
    that of the same program with the gathers' copies. 0, or 1 on a failure."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        if rank == 0:
            print("    fp8: skipped (this GPU has no FP8 products)", flush=True)
        return 0.0
    from fbmt.compiler import pipeline
    from fbmt.compiler.collectives import torch_impl

    def build():
        torch.manual_seed(0)
        return GPT(CFG).to(torch.bfloat16).float()  # weights bf16 holds: a cast kept or fused gives the same

    def losses(fp8, copies=False):
        partition = pipeline.partition
        if copies:
            pipeline.partition = lambda program, casts_where_read: partition(program)
        try:
            model = fbmt.compile(build(), fp8=fp8, param_dtype=torch.bfloat16, backend="inductor", cache_dir=False)
            got = run(model, 5, rank, world, device, guard=1, batch=world)
        finally:
            pipeline.partition = partition
        dist.all_reduce(got)
        gathers = [
            n.args[2] for e in model.executables() for n in e.forward.graph.nodes if n.target is torch_impl.all_gather
        ]
        return got / world, gathers

    fp8, gathers = losses("tensorwise")
    bf16, _ = losses(None)
    checks = {"FP8 losses within 3% of bf16's": bool(((fp8 - bf16).abs() / bf16).max() < 0.03)}
    if world == 1:
        copied, _ = losses("tensorwise", copies=True)
        checks["one rank: the layers' gathers copy nothing"] = None in gathers
        checks["one rank: the first loss as with the gathers' copies"] = bool(fp8[0] == copied[0])
    for what, ok in checks.items():
        if rank == 0:
            print(f"    fp8: {what}: {'yes' if ok else 'NO (FAILED)'} (losses {[round(v, 4) for v in fp8.tolist()]})")
    return 0.0 if all(checks.values()) else 1.0


def main() -> None:
    fbmt.init_distributed(seed=0)
    rank, world = fbmt.rank(), fbmt.world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.backends.cuda.matmul.allow_tf32 = False
    combos = [
        (z, r, s, "eager", False)
        for z, r, s in itertools.product((3, 2), ("block", "selective", "none"), ("prefetch", "none"))
    ]
    combos += [
        (3, "block", "prefetch", "inductor", False),
        (3, "selective", "prefetch", "inductor", False),
        (3, "mincut", "prefetch", "inductor", False),
        (2, "mincut", "prefetch", "inductor", False),
        (3, "block", "prefetch", "eager", True),
        (3, "block", "prefetch", "inductor", True),
        (3, "mincut", "prefetch", "inductor", True),
        (2, "mincut", "prefetch", "inductor", True),
        (3, "block", "bucket", "eager", False),
        (3, "mincut", "bucket", "inductor", True),
    ]
    worst = check(lambda: GPT(CFG), combos, rank, world, device)
    llama = [
        (3, "block", "prefetch", "eager", False),
        (2, "none", "prefetch", "eager", False),
        (2, "mincut", "prefetch", "inductor", False),
        (3, "block", "prefetch", "inductor", False),
        (2, "mincut", "prefetch", "inductor", True),
    ]
    worst = max(
        worst,
        check(lambda: Llama(vocab=256, d=256, heads=4, ff=512, n_layer=3, seq=CFG.seq_len), llama, rank, world, device),
    )
    worst = max(worst, fp8_rules(rank, world, device))
    if rank == 0:
        print(
            f"GPU check {'PASSED' if worst < 1e-4 else 'FAILED'}: worst relative error {worst:.1e} "
            f"on {world} x {torch.cuda.get_device_name()} with torch {torch.__version__}",
            flush=True,
        )
    dist.destroy_process_group()
    if worst >= 1e-4:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
