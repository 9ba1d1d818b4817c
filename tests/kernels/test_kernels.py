"""numba-CUDA kernels against torch references: under the simulator on CPU, on the GPU where there is one."""

from __future__ import annotations

import pytest
import torch

import fbmt.kernels as K  # numba-cuda is part of the test environment: without it these tests fail
from fbmt.optim import AdamOptimizer

DEV = "cuda" if torch.cuda.is_available() else "cpu"
N = 1000 if DEV == "cpu" else 1_000_003  # the simulator runs each CUDA thread as a Python thread


def _adam_reference(master, grads, out_dtype, decoupled, inv_scale, lr=1e-2, wd=0.1):
    q = torch.nn.Parameter(master.clone())
    opt = (torch.optim.AdamW if decoupled else torch.optim.Adam)([q], lr=lr, weight_decay=wd)
    for g in grads:
        q.grad = g.float() * inv_scale
        opt.step()
    return q.detach()


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decoupled", [True, False])
def test_fused_adam_matches_torch(grad_dtype, out_dtype, decoupled):
    torch.manual_seed(0)
    master = torch.randn(N, device=DEV)
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    grads = [(torch.randn(N, device=DEV) * 64).to(grad_dtype) for _ in range(4)]
    want = _adam_reference(master, grads, out_dtype, decoupled, inv_scale=1 / 64)
    out = torch.full((N,), float("nan"), device=DEV, dtype=out_dtype) if out_dtype else None  # poisoned
    for step, g in enumerate(grads, 1):
        K.fused_adam_(
            master,
            m,
            v,
            g,
            out,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.1,
            step=step,
            inv_scale=1 / 64,
            decoupled=decoupled,
        )
    torch.testing.assert_close(master, want, rtol=0, atol=1e-6 * want.abs().max().item())
    if out is not None:
        assert torch.equal(out, master.to(out_dtype)), "the parameter is the master rounded to nearest even"


def test_fused_adam_skip_flag_changes_nothing():
    master, m, v = torch.randn(N, device=DEV), torch.zeros(N, device=DEV), torch.zeros(N, device=DEV)
    out = torch.zeros(N, device=DEV, dtype=torch.bfloat16)
    before = master.clone()
    flag = torch.ones(1, dtype=torch.int32, device=DEV)
    K.fused_adam_(
        master,
        m,
        v,
        torch.randn(N, device=DEV),
        out,
        lr=1e-2,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=0.0,
        step=1,
        skip=flag,
    )
    assert torch.equal(master, before) and not m.any() and not v.any() and not out.any()


def _tensors():
    torch.manual_seed(1)
    unaligned = torch.randn(3001, device=DEV).bfloat16()[1:]  # starts 2 bytes in: the per-element path
    return [
        torch.randn(5000, device=DEV),
        torch.randn(4096, device=DEV).bfloat16(),
        torch.randn(77, device=DEV).half(),
        torch.randn(K.kernels.CHUNK + 3, device=DEV),
        torch.randn(1, device=DEV).bfloat16(),
        unaligned,
        torch.randn(40000, device=DEV).half(),
    ]


POSITIONS = [
    (0, 0),
    (1, 4095),
    (2, 76),
    (3, 4096),
    (3, 1 << 16),
    (3, (1 << 16) + 2),
    (4, 0),
    (5, 0),
    (5, 2999),
    (6, 7),
    (6, 39999),
]


@pytest.mark.parametrize(
    "which, where, bad",
    [(w, p, float("inf")) for w, p in POSITIONS]
    + [(w, p, b) for w, p in ((1, 17), (6, 39999)) for b in (float("-inf"), float("nan"))],
)
def test_multi_tensor_nonfinite_finds_every_position(which, where, bad):
    ts = _tensors()
    flag = K.multi_tensor_nonfinite(ts)
    assert flag.device.type == torch.device(DEV).type and flag.item() == 0  # the result stays on the device
    ts[which][where] = bad
    assert K.multi_tensor_nonfinite(ts).item() == 1
    assert K.multi_tensor_nonfinite([t for k, t in enumerate(ts) if k != which]).item() == 0  # the others are clean
    acc = torch.zeros(1, dtype=torch.int32, device=DEV)
    K.multi_tensor_nonfinite(ts[:1], flag=acc)
    K.multi_tensor_nonfinite(ts, flag=acc)
    assert acc.item() == 1


def test_multi_tensor_sum_of_squares():
    ts = _tensors()
    got = K.multi_tensor_sum_of_squares(ts)
    want = sum(t.double().square().sum() for t in ts)
    assert got.dtype == torch.float32 and got.device.type == torch.device(DEV).type
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=0)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 3e38 -> fp16 inf, on purpose
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cast_rounds_to_nearest_even_like_torch(dtype):
    torch.manual_seed(2)
    x = torch.randn(N, device=DEV) * 1000
    ulp_bits = 16 if dtype == torch.bfloat16 else 13  # fp32 bits below the target's last mantissa bit
    ties = (x.view(torch.int32) & ~((1 << ulp_bits) - 1)) | (1 << (ulp_bits - 1))  # exactly half-way
    x[: N // 4] = ties[: N // 4].view(torch.float32)
    x[-4:] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3.0e38], device=DEV)
    dst = torch.empty(N, device=DEV, dtype=dtype)
    K.cast_(x, dst)
    want = x.to(dtype)
    assert torch.equal(dst[:-2], want[:-2]) and torch.isnan(dst[-2]) and dst[-1] == want[-1]


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="sizes differ"):
        K.fused_adam_(
            torch.zeros(4, device=DEV),
            torch.zeros(4, device=DEV),
            torch.zeros(4, device=DEV),
            torch.zeros(5, device=DEV),
            lr=1,
            beta1=0.9,
            beta2=0.9,
            eps=1e-8,
            weight_decay=0,
            step=1,
        )
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        K.multi_tensor_nonfinite([torch.zeros(3, device=DEV, dtype=torch.float64)])
    with pytest.raises(ValueError, match="cast_"):
        K.cast_(torch.zeros(3, device=DEV), torch.zeros(3, device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_optimizer_kernels_and_torch_path_agree(dtype):
    torch.manual_seed(3)
    start = torch.randn(N, device=DEV).to(dtype)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    ref = torch.nn.Parameter(start.float())
    opts = [
        AdamOptimizer([a], lr=1e-2, weight_decay=0.1, use_kernels=True, hold_steps=1),
        AdamOptimizer([b], lr=1e-2, weight_decay=0.1, use_kernels=False, hold_steps=1),
        torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1),
    ]
    for step in range(4):
        g = torch.randn(N, device=DEV).to(dtype)
        a.grad, b.grad, ref.grad = g.clone(), g.clone(), g.float()
        opts[2].param_groups[0]["lr"] = 0.0 if step == 0 else 1e-2  # hold_steps=1
        for o in opts:
            o.step()
    want = ref.detach().to(dtype)
    for path in (a, b):  # the kernels and the torch path, each against torch.optim.AdamW
        if dtype == torch.float32:
            torch.testing.assert_close(path.detach(), want, rtol=0, atol=1e-6 * want.abs().max().item())
        else:  # within one ulp of the rounded fp32 reference
            assert (path.detach().view(torch.int16).int() - want.view(torch.int16).int()).abs().max() <= 1


def test_adam_optimizer_skips_nonfinite_steps_and_resumes_exactly():
    p = torch.nn.Parameter(torch.randn(N, device=DEV).bfloat16())
    opt = AdamOptimizer([p], lr=1e-2, skip_nonfinite=True, use_kernels=True)
    p.grad = torch.randn(N, device=DEV).bfloat16()
    opt.step()
    before = p.detach().clone()
    p.grad[3] = float("nan")
    opt.step()
    assert opt.last_step_skipped and torch.equal(p.detach(), before) and opt.state[p]["step"] == 1
    saved = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    resumed = AdamOptimizer([q], lr=1.0, use_kernels=True)
    resumed.load_state_dict(saved)
    g = torch.randn(N, device=DEV).bfloat16()
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    resumed.step()
    assert torch.equal(p.detach(), q.detach())
    assert torch.equal(opt.state[p]["master"], resumed.state[q]["master"])


def test_empty_parts_of_sharded_parameters_are_no_ops():
    """Under fbmt's BMTrain layer a rank's part of a parameter can be empty: nothing to launch."""
    full, empty = torch.nn.Parameter(torch.ones(6, device=DEV)), torch.nn.Parameter(torch.ones(0, device=DEV))
    opt = AdamOptimizer([full, empty], lr=0.1, use_kernels=True, skip_nonfinite=True)
    full.grad, empty.grad = torch.ones(6, device=DEV), torch.ones(0, device=DEV)
    opt.step()
    assert not opt.last_step_skipped and empty.numel() == 0
    torch.testing.assert_close(full.detach().cpu(), torch.full((6,), 0.9))
    found = K.multi_tensor_nonfinite([torch.ones(0, device=DEV), torch.tensor([float("nan")], device=DEV)])
    assert found.item() == 1
