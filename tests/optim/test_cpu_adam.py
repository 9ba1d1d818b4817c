"""The native fused CPU Adam (fbmt._C) and AdamOffloadOptimizer against torch.optim, on every SIMD level."""

from __future__ import annotations

import copy

import pytest
import torch

import fbmt
from fbmt.integrations.optim import AdamOffloadOptimizer, cpu_adam

LEVELS = cpu_adam.supported_simd_levels()
N = 3 * 4096 + 77  # not a multiple of any vector width or block: heads and tails are exercised
STEPS = 50


@pytest.fixture(params=LEVELS)
def level(request):
    previous = cpu_adam.set_simd_level(request.param)
    yield request.param
    cpu_adam.set_simd_level(previous)


def _grads(n: int, steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * (1 + step % 3) for step in range(steps)]


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """Max error relative to the largest magnitude (per-element relative error is meaningless near 0)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


@pytest.mark.parametrize("decoupled, reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
def test_fp32_matches_torch_over_50_steps(level, decoupled, reference):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N))
    q = torch.nn.Parameter(p.detach().clone())
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    opt = AdamOffloadOptimizer([p], decoupled_weight_decay=decoupled, **hp)
    ref = reference([q], **hp)
    for g in _grads(N, STEPS):
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    assert _rel(p, q) < 1e-6
    st = opt.state[p]
    assert _rel(st["exp_avg_sq"], ref.state[q]["exp_avg_sq"]) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_within_one_ulp_of_rounded_fp32_reference(level, dtype):
    torch.manual_seed(1)
    master = torch.nn.Parameter(torch.randn(N).to(dtype).float())  # the reference: fp32 master ...
    p = torch.nn.Parameter(master.detach().to(dtype))  # ... and fbmt on the low-precision parameter
    opt = AdamOffloadOptimizer([p], lr=1e-2, weight_decay=0.05)
    ref = torch.optim.AdamW([master], lr=1e-2, weight_decay=0.05)
    for g in _grads(N, STEPS, seed=2):
        p.grad = g.to(dtype)
        master.grad = p.grad.float()  # the same low-precision gradient, upcast
        opt.step()
        ref.step()
    want = master.detach().to(dtype)  # rounding the fp32 reference (to nearest even)
    ulps = (p.detach().view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert ulps.max().item() <= 1, f"{(ulps > 1).sum()} elements more than one ulp away"
    assert _rel(opt.state[p]["master"], master.detach()) < 1e-6
    # Exactly the master rounded to nearest even (torch's cast), not merely within an ulp (truncation is).
    assert torch.equal(p.detach(), opt.state[p]["master"].to(dtype))


def test_every_simd_level_gives_identical_bits():
    results = []
    for lvl in LEVELS:
        previous = cpu_adam.set_simd_level(lvl)
        p = torch.nn.Parameter(torch.linspace(-2, 2, N).bfloat16())
        opt = AdamOffloadOptimizer([p], lr=1e-2, weight_decay=0.1)
        for g in _grads(N, 5):
            p.grad = g.bfloat16()
            opt.step()
        results.append((p.detach().clone(), opt.state[p]["master"].clone()))
        cpu_adam.set_simd_level(previous)
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]) and torch.equal(other[1], results[0][1])


def test_threads_do_not_change_results():
    n = 3 * (1 << 18) + 77  # split over threads, in more chunks than threads, with a ragged last chunk
    outs = []
    for threads in (1, 2, 3):
        p = torch.nn.Parameter(torch.linspace(-1, 1, n))
        opt = AdamOffloadOptimizer([p], lr=1e-2, threads=threads)
        for g in _grads(n, 3):
            p.grad = g
            opt.step()
        outs.append(p.detach().clone())
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_hold_steps_keep_lr_at_zero_then_follow_adam():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N))
    q = torch.nn.Parameter(p.detach().clone())
    opt = AdamOffloadOptimizer([p], lr=1e-2, hold_steps=3)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0)
    start = p.detach().clone()
    for step, g in enumerate(_grads(N, 8)):
        p.grad, q.grad = g.clone(), g.clone()
        ref.param_groups[0]["lr"] = 0.0 if step < 3 else 1e-2
        opt.step()
        ref.step()
        if step < 3:
            assert torch.equal(p.detach(), start), "parameters moved during hold_steps"
    assert _rel(p, q) < 1e-6 and opt.hold_steps == 0


def test_loss_scale_is_unscaled_inside_the_update():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(N))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = AdamOffloadOptimizer([p], lr=1e-2), torch.optim.AdamW([q], lr=1e-2, weight_decay=0)
    for g in _grads(N, 10):
        p.grad = (g * 1024).bfloat16().float()
        q.grad = p.grad / 1024
        opt.step(scale=1024)
        ref.step()
    assert _rel(p, q) < 1e-6


def test_nonfinite_gradients_are_detected_and_skipped():
    grad = torch.randn(N)
    master, m, v = torch.randn(N), torch.zeros(N), torch.zeros(N)
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1)
    assert not cpu_adam.fused_adam_(master.clone(), m.clone(), v.clone(), grad, check="report", **hp)
    for bad in (float("inf"), float("-inf"), float("nan")):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            g = grad.clone().to(dtype)
            g[N - 5] = bad
            assert cpu_adam.has_nonfinite(g)
            before = master.clone()
            assert cpu_adam.fused_adam_(master, m, v, g, check="skip", **hp)
            assert torch.equal(master, before) and not m.any(), "a skipped step changed the state"
            assert cpu_adam.fused_adam_(master.clone(), m.clone(), v.clone(), g, check="report", **hp)
    p, q = torch.nn.Parameter(torch.randn(10)), torch.nn.Parameter(torch.randn(10))
    opt = AdamOffloadOptimizer([p, q], lr=1e-2, skip_nonfinite=True)
    p.grad, q.grad = torch.randn(10), torch.full((10,), float("nan"))
    before = (p.detach().clone(), q.detach().clone())
    opt.step()
    assert opt.last_step_skipped and torch.equal(p.detach(), before[0]) and torch.equal(q.detach(), before[1])
    q.grad = torch.randn(10)
    opt.step()
    assert not opt.last_step_skipped and not torch.equal(p.detach(), before[0])


def test_state_dict_round_trips_exactly():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300).bfloat16()), torch.nn.Parameter(torch.randn(7, 5))]
    opt = AdamOffloadOptimizer(params, lr=1e-2, weight_decay=0.1, hold_steps=7)
    grads = _grads(300 + 35, 10)

    def step(opt, ps, g):
        ps[0].grad, ps[1].grad = g[:300].bfloat16(), g[300:].view(7, 5).clone()
        opt.step()

    for g in grads[:5]:
        step(opt, params, g)
    saved = copy.deepcopy(opt.state_dict())
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = AdamOffloadOptimizer(clones, lr=1.0)
    resumed.load_state_dict(saved)
    assert resumed.hold_steps == 2 and resumed.param_groups[0]["lr"] == 1e-2
    for g in grads[5:]:
        step(opt, params, g)
        step(resumed, clones, g)
    for a, b in zip(params, clones):
        assert torch.equal(a.detach(), b.detach())
    assert torch.equal(opt.state[params[0]]["master"], resumed.state[clones[0]]["master"])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="`grad` must be a contiguous CPU tensor"):
        cpu_adam.fused_adam_(
            torch.zeros(4),
            torch.zeros(4),
            torch.zeros(4),
            torch.zeros(5),
            lr=1,
            beta1=0.9,
            beta2=0.9,
            eps=1e-8,
            weight_decay=0,
            step=1,
        )
    with pytest.raises(ValueError, match="`master`"):
        cpu_adam.fused_adam_(
            torch.zeros(4).double(),
            torch.zeros(4),
            torch.zeros(4),
            torch.zeros(4),
            lr=1,
            beta1=0.9,
            beta2=0.9,
            eps=1e-8,
            weight_decay=0,
            step=1,
        )
    with pytest.raises(ValueError, match="set_simd_level"):
        cpu_adam.set_simd_level("sse9")
    with pytest.raises(ValueError, match="invalid lr"):
        AdamOffloadOptimizer([torch.nn.Parameter(torch.zeros(2))], lr=-1)


def test_trains_a_compiled_model_like_adamw():
    from tests.models.reference import MLP, batch

    torch.manual_seed(0)
    ref = MLP()
    model = fbmt.compile(copy.deepcopy(ref))
    opt = AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        (x,), _, y = batch("mlp", step)
        for m, o in ((model, opt), (ref, ref_opt)):
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        assert _rel(full[n], p.detach()) < 1e-6, n
