"""Functions that run on every spawned rank (module level, so spawn can pickle them)."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

import fbmt
from fbmt.compiler import collectives as comm
from tests.models.reference import BUILDERS, batch, loss_of

CONFIGS = [
    dict(zero=z, remat=r, schedule=s) for z, r, s in itertools.product((3, 2), ("block", "none"), ("prefetch", "none"))
]
# On 4 ranks (on CI's 2 cores, the slowest runs): the two corners of CONFIGS. What 4 ranks add is the
# sharding over more ranks, and each of the options is checked on its own on 1 and 2 ranks.
CONFIGS_ON_4 = [dict(zero=3, remat="block", schedule="prefetch"), dict(zero=2, remat="none", schedule="none")]
STEPS = 5


def _local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


def eager_reference(name: str, steps: int = STEPS) -> dict:
    torch.manual_seed(0)
    model = BUILDERS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for step in range(steps):
        args, kwargs, target = batch(name, step)
        loss = loss_of(name, model(*args, **kwargs), target)
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return dict(
        losses=losses,
        grads=grads,
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        buffers={n: b.clone() for n, b in model.named_buffers()},
    )


def train_compiled(name: str, rank: int, world: int, cfg: dict, steps: int = STEPS, accum: int = 1) -> dict:
    torch.manual_seed(0)
    model = fbmt.compile(BUILDERS[name](), checks=True, **cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses, grads = [], None
    for step in range(steps):
        args, kwargs, target = batch(name, step)
        args, target = tuple(_local(a, rank, world) for a in args), _local(target, rank, world)
        total = torch.zeros(())
        for micro in range(accum):  # gradient accumulation over micro-batches of the local batch
            a, t = tuple(_local(x, micro, accum) for x in args), _local(target, micro, accum)
            loss = loss_of(name, model(*a, **kwargs), t) / accum
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total)
        if step == 0:
            grads = model.full_gradients()
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    return dict(
        losses=losses,
        grads=grads,
        params=model.full_parameters(),
        buffers={n: b.clone() for n, b in model.named_buffers()},
        programs=len(model.programs),
        remat=model.program.stats("remat"),
        shard=model.program.stats("shard"),
    )


def compare(got: dict, want: dict, what: str, buffers: bool, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(
        torch.tensor(got["losses"]),
        torch.tensor(want["losses"]),
        rtol=rtol,
        atol=atol,
        msg=lambda m: f"{what}: losses differ\n{m}",
    )
    for kind in ("grads", "params") + (("buffers",) if buffers else ()):
        assert got[kind].keys() == want[kind].keys(), f"{what}: {kind} names differ"
        for n in want[kind]:
            torch.testing.assert_close(
                got[kind][n], want[kind][n], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {kind[:-1]} {n} differs\n{m}"
            )


def lm_step_matches(model, ref, x: torch.Tensor, y: torch.Tensor) -> None:
    """One forward and backward of a compiled language model (one process) against its eager twin:
    the loss, and every gathered gradient."""
    import torch.nn.functional as F

    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref_loss = F.cross_entropy(ref(x).flatten(0, 1), y.flatten())
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def gradients_match(model, ref, msg: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Every gathered gradient of a compiled model (one process) against its eager twin's `.grad`."""
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        want = p.grad.to(grads[name].dtype)  # a model of low precision: gathered in its compute dtype
        torch.testing.assert_close(grads[name], want, rtol=rtol, atol=atol, msg=f"{msg}{name}")


def step_matches(model, ref, *args, msg: str = "", rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """One forward and backward of a compiled model whose output is a scalar loss against its eager
    twin: the loss, and every gathered gradient."""
    got, want = model(*args), ref(*args)
    got.backward()
    want.backward()
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=msg)
    gradients_match(model, ref, f"{msg}: " if msg else "", rtol=rtol, atol=atol)


def equivalence(rank: int, world: int, name: str) -> list[str]:
    want = eager_reference(name)
    done = []
    for cfg in CONFIGS if world < 4 else CONFIGS_ON_4:
        what = f"{name} world={world} {cfg}"
        compare(train_compiled(name, rank, world, cfg), want, what, buffers=world == 1)
        done.append(what)
    if name == "gpt":
        cfg = dict(zero=3, remat="block", schedule="prefetch")
        what = f"{name} world={world} {cfg} accumulating 2 micro-batches"
        compare(train_compiled(name, rank, world, cfg, accum=2), want, what, buffers=False)
        done.append(what)
        for zero, remat in itertools.product((3, 2), ("selective", "mincut")) if world < 4 else ():
            cfg = dict(zero=zero, remat=remat, schedule="prefetch")
            compare(train_compiled(name, rank, world, cfg), want, f"{name} world={world} {cfg}", buffers=False)
            done.append(f"{name} world={world} {cfg}")
        if world == 2:  # compiled regions between real collectives, each block's recompute placed late
            cfg = dict(zero=3, remat="block", schedule="prefetch", backend="inductor")
            what = f"{name} world={world} {cfg}"
            compare(
                train_compiled(name, rank, world, cfg, steps=2),
                eager_reference(name, steps=2),
                what,
                buffers=False,
                rtol=1e-4,
                atol=1e-5,
            )
            done.append(what)
        cfg = dict(zero=3, remat="none", schedule="prefetch", prefetch=2)  # gathers two blocks ahead
        compare(train_compiled(name, rank, world, cfg), want, f"{name} world={world} {cfg}", buffers=False)
        done.append(f"{name} world={world} {cfg}")
    return done


def last_block_saved(rank: int, world: int) -> object:
    """The last blocks save their activations and the first recomputes (NOTE: [Trailing blocks]), and
    training still matches eager."""
    cfg = dict(zero=3, remat="block", schedule="prefetch")
    got = train_compiled("gpt_short", rank, world, cfg)
    compare(got, eager_reference("gpt_short"), f"gpt_short world={world} {cfg}", buffers=False)
    return got["remat"]


def dropout_recompute(rank: int, world: int) -> None:
    """With dropout on, saving activations and recomputing them must give identical training."""
    from tests.models.reference import gpt

    results = []
    for remat in ("block", "selective", "none"):
        torch.manual_seed(0)
        model = fbmt.compile(gpt(dropout=0.3), remat=remat, checks=True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        torch.manual_seed(100 + rank)
        for step in range(3):
            args, _, target = batch("gpt", step)
            loss_of("gpt", model(_local(args[0], rank, world)), _local(target, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        results.append(model.full_parameters())
    for other in results[1:]:
        for n in results[0]:
            torch.testing.assert_close(results[0][n], other[n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def state_dict_round_trip(rank: int, world: int) -> None:
    from tests.models.reference import gpt

    torch.manual_seed(0)
    ref = gpt()
    torch.manual_seed(0)
    model = fbmt.compile(gpt(), checks=True)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v)
    torch.manual_seed(5)
    other = fbmt.compile(gpt(), checks=True)
    other.load_state_dict(sd)
    (idx,), _, _ = batch("gpt", 0)
    torch.testing.assert_close(other(idx), ref(idx))


def meta_init_memory(rank: int, world: int, blocks: int, width: int) -> dict:
    """Peak RSS growth while compiling a meta-built model: shards plus one block, never the whole."""
    import resource

    import torch.nn as nn

    class Deep(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))

        def forward(self, x):
            for layer in self.layers:
                x = torch.relu(layer(x))
            return x

    with torch.device("meta"):
        fbmt.compile(nn.ModuleList([nn.Linear(8, 8)]))  # warm-up: torch's one-time allocations on first use
        deep = Deep()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    model = fbmt.compile(deep)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    full = model.full_parameters()
    w = full["layers.3.weight"]
    bound = 1 / width**0.5  # nn.Linear's reset_parameters: uniform(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert 0.9 * bound < w.abs().max() <= bound and abs(w.mean()) < 0.01 * bound, "not initialized as nn.Linear"
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    model_bytes = sum(v.numel() * v.element_size() for v in full.values())
    return dict(peak=peak, shard_bytes=shard_bytes, model_bytes=model_bytes)


def mismatched_shapes(rank: int, world: int) -> str:
    from tests.models.reference import MLP

    model = fbmt.compile(MLP())
    try:
        with torch.set_grad_enabled(rank == 0):  # rank 1 would skip the backward's collectives
            model(torch.randn(2, 12))
    except RuntimeError as e:
        return str(e)
    return "no error"


def collectives(rank: int, world: int) -> None:
    """Forward values and gradients of the differentiable collectives against the analytic answer."""
    D = fbmt.distributed
    xs = [torch.tensor([1.0 + r, 2.0 - r, 3.0 * (r + 1)]) for r in range(world)]  # every rank's input
    ws = [torch.tensor([1.0, -2.0, 0.5]) * (r + 1) for r in range(world)]  # every rank's loss weights
    total_w = sum(ws)
    stacked = torch.stack(xs)
    cases = {
        "sum": (stacked.sum(0), lambda: total_w),
        "avg": (stacked.mean(0), lambda: total_w / world),
        "max": (stacked.max(0).values, lambda: total_w * (xs[rank] == stacked.max(0).values)),
        "min": (stacked.min(0).values, lambda: total_w * (xs[rank] == stacked.min(0).values)),
        "prod": (stacked.prod(0), lambda: total_w * torch.cat([stacked[:rank], stacked[rank + 1 :]]).prod(0)),
    }
    for op, (want, grad) in cases.items():
        x = xs[rank].clone().requires_grad_()
        y = D.all_reduce(x, op)
        (y * ws[rank]).sum().backward()
        torch.testing.assert_close(y.detach(), want, msg=lambda m: f"all_reduce {op}: {m}")
        torch.testing.assert_close(x.grad, grad(), msg=lambda m: f"all_reduce {op} grad: {m}")

    x = xs[rank].clone().requires_grad_()
    y = D.all_gather(x)
    torch.testing.assert_close(y.detach(), stacked)
    (y * torch.arange(1.0, 1 + y.numel()).view_as(y)).sum().backward()
    torch.testing.assert_close(x.grad, world * torch.arange(1.0, 1 + y.numel()).view_as(y)[rank])

    x = torch.arange(2.0 * world).mul(rank + 1).requires_grad_()  # rows: world * 2
    y = D.reduce_scatter(x, "sum")
    full = sum(torch.arange(2.0 * world).mul(r + 1) for r in range(world))
    torch.testing.assert_close(y.detach(), full[2 * rank : 2 * rank + 2])
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2 * world))  # every rank's slice reaches every rank

    x = xs[rank].clone().requires_grad_()
    y = D.broadcast(x, src=1)
    torch.testing.assert_close(y.detach(), xs[1])
    (y * ws[rank]).sum().backward()
    torch.testing.assert_close(x.grad, total_w if rank == 1 else torch.zeros(3))

    torch.testing.assert_close(D.sum_loss(torch.tensor(float(rank))), torch.tensor((world - 1) / 2))
    torch.testing.assert_close(
        D.gather_result(torch.full((2, 3), float(rank))),
        torch.cat([torch.full((2, 3), float(r)) for r in range(world)]),
    )
    D.synchronize()


def narrow_pieces(rank: int) -> list[torch.Tensor]:
    """One rank's bf16 gradient pieces (11 elements, padded to 12), of very different magnitude per rank."""
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(n, generator=g).mul(10.0 ** (rank - 2)).bfloat16() for n in (5, 6)]


def narrow_wire(rank: int, world: int) -> dict:
    """A group's bf16 gradients reduced in fp32, sent as bf16 (NOTE: [Narrow wire]) and as fp32, by
    the runtime and by the reference executor."""
    from fbmt.compiler.collectives import torch_impl as C

    pieces, fp32, bf16 = narrow_pieces(rank), torch.float32, torch.bfloat16
    return {
        "narrow": C.wait(C.all_to_all_reduce(pieces, world, 12, True, bf16, fp32, fp32)),
        "ring": C.wait(C.reduce_scatter(pieces, world, 12, True, fp32, fp32, fp32)),
        "reference": comm.kind_of(comm.all_to_all_reduce).reference(pieces, world, 12, True, bf16, fp32, fp32),
    }


def buckets(rank: int, world: int) -> dict:
    """Three groups' gathers and reductions as one bucket each and one by one (NOTE: [Buckets]):
    shards cast for the wire and not; gradient pieces that cross the ends of the ranks' chunks,
    averaged and summed, sent as bf16 and returned as fp32."""
    from fbmt.compiler.collectives import torch_impl as C

    g = torch.Generator().manual_seed(rank)
    out: dict = {}
    shards = [torch.randn(n, generator=g) for n in (5, 1, 8)]
    for wire in (None, torch.bfloat16):
        fused = [C.wait(h) for h in C.all_gather_bucket([(s, world, wire) for s in shards])]
        out[f"all_gather, wire {wire}"] = (fused, [C.wait(C.all_gather(s, world, wire)) for s in shards])
    groups = [[torch.randn(7, generator=g), torch.randn(3, generator=g)], [torch.randn(1, generator=g)]]
    groups.append([torch.randn(9, generator=g)])
    padded = [-(-sum(p.numel() for p in ps) // world) * world for ps in groups]
    for average in (True, False):
        for wire, result in ((torch.float32, torch.float32), (torch.bfloat16, torch.float32)):
            members = [(ps, world, n, average, wire, wire, result) for ps, n in zip(groups, padded)]
            fused = [C.wait(h) for h in C.reduce_scatter_bucket(members)]
            alone = [C.wait(C.reduce_scatter(*m)) for m in members]
            out[f"reduce_scatter, average {average}, wire {wire}"] = (fused, alone)
    return out
