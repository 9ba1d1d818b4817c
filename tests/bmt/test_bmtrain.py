"""`import fbmt as bmt` runs BMTrain-style code: the behaviours BMTrain's own test suite checks,
each against a plain PyTorch model with the same names (tests/models/bmt.py)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt as bmt
from fbmt.integrations.bmt.module import lower
from tests.dist import run_ranks
from tests.models.bmt import BLayer, BNet, D, PLayer, PNet, V, bmt_model, data, init_like_bmt, local, plain_reference


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_same(a: dict, b: dict, rtol: float = 0.0, atol: float = 0.0) -> None:
    assert list(a) == list(b), (list(a), list(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# ---- construction: names, seeds, state dicts ----


def _construction(rank: int, world: int) -> dict:
    built = full_params(bmt_model(seed=7))
    torch.manual_seed(7)  # a plain torch model converted by the wrapper keeps its values
    plain = PNet()
    init_like_bmt(plain)
    expected = full_params(plain)
    wrapped = bmt.BMTrainModelWrapper(plain)
    return dict(
        built=built,
        wrapped=full_params(wrapped),
        expected=expected,
        layers_type=type(wrapped.layers).__name__,
        shard_sizes=[p.numel() for p in wrapped.parameters()],
    )


@pytest.mark.parametrize("world", [1, 3, 4])
def test_same_seed_same_weights_on_every_construction_path(world):
    reference = full_params(plain_reference(seed=7))
    outs = run_ranks(world, _construction)
    for out in outs:
        assert_same(out["built"], reference)  # init_parameters == plain torch with the same init calls
        assert_same(out["wrapped"], out["expected"])  # BMTrainModelWrapper keeps the plain model's values
        assert out["layers_type"] == "TransformerBlockList"
    total = sum(p.numel() for p in PNet().parameters())
    assert sum(sum(o["shard_sizes"]) for o in outs) == total  # the ranks' parts partition the model


def test_block_is_transparent():
    inner = PLayer(D)
    block = bmt.Block(inner, use_checkpoint=False, zero_level=2)
    assert [n for n, _ in block.named_parameters()] == ["ln.weight", "ln.bias", "fc.weight", "fc.bias"]
    assert block.fc is inner.fc and block.drop is inner.drop  # attribute access reaches the inner module
    assert isinstance(block.fc.weight, bmt.DistributedParameter)
    assert (block.use_checkpoint, block.zero_level) == (False, 2)
    assert bmt.CheckpointBlock is bmt.Block
    with pytest.raises(ValueError, match="zero_level"):
        bmt.Block(PLayer(D), zero_level=1)


def test_state_dict_keys_and_round_trip_match_plain_torch(tmp_path):
    model = bmt_model(seed=3)
    plain = plain_reference(seed=3)
    assert list(model.state_dict()) == list(plain.state_dict())
    path = str(tmp_path / "model.pt")
    bmt.save(model, path)
    loaded = torch.load(path, weights_only=True)
    assert isinstance(loaded, dict) and all(v.device.type == "cpu" for v in loaded.values())
    fresh = PNet()
    fresh.load_state_dict(loaded)  # a plain module loads BMTrain's format, strict
    assert_same(full_params(fresh), full_params(plain))
    other = BNet()
    bmt.load(other, path)
    assert_same(full_params(other), full_params(plain))
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".tmp")]  # written atomically


def _load_plain_file(rank: int, world: int, path: str) -> dict:
    model = BNet()
    bmt.load(model, path)  # every rank keeps only its part of a file written by plain torch.save
    x, _ = data(0)
    return dict(params=full_params(model), out=model(x).detach(), sizes=[p.numel() for p in model.parameters()])


def test_load_a_torch_save_file_on_two_ranks(tmp_path):
    plain = plain_reference(seed=5)
    path = str(tmp_path / "bmtrain_format.pt")
    torch.save(plain.state_dict(), path)  # BMTrain's format: one torch.save of the unwrapped state dict
    x, _ = data(0)
    for out in run_ranks(2, _load_plain_file, path):
        assert_same(out["params"], full_params(plain))
        torch.testing.assert_close(out["out"], plain(x).detach(), rtol=1e-6, atol=1e-6)


def _load_seen_by_rank0_only(rank: int, world: int, path: str, strict: bool) -> dict:
    import fbmt.files

    if rank == 1:  # a multi-node job: the checkpoint is on node 0's disk only
        fbmt.files.os.path.exists = lambda p: False
    model = BNet()
    keys = bmt.load(model, path, strict=strict)
    return dict(params=full_params(model), missing=list(keys.missing_keys))


def test_load_broadcasts_from_rank0_when_other_ranks_cannot_see_the_file(tmp_path):
    plain = plain_reference(seed=8)
    path = str(tmp_path / "only_on_node0.pt")
    torch.save(plain.state_dict(), path)
    for out in run_ranks(2, _load_seen_by_rank0_only, path, True):
        assert_same(out["params"], full_params(plain))
    partial = plain.state_dict()
    del partial["head.bias"]
    torch.save(partial, path)
    for out in run_ranks(2, _load_seen_by_rank0_only, path, False):
        assert out["missing"] == ["head.bias"]
    with pytest.raises(Exception, match="missing keys \\['head.bias'\\]"):
        run_ranks(2, _load_seen_by_rank0_only, path, True)


def _load_compiled_seen_by_rank0_only(rank: int, world: int, path: str) -> dict:
    import fbmt.files

    if rank == 1:
        fbmt.files.os.path.exists = lambda p: False
    model = bmt.compile(PNet(0.0))
    keys = bmt.load(model, path)
    return dict(params=full_params(model), missing=list(keys.missing_keys))


def test_a_compiled_model_loads_from_rank0_when_other_ranks_cannot_see_the_file(tmp_path):
    """The keys a compiled model expects are those of the model it compiled, not its flat shards'."""
    plain = plain_reference(seed=9)
    path = str(tmp_path / "only_on_node0.pt")
    torch.save(plain.state_dict(), path)
    for out in run_ranks(2, _load_compiled_seen_by_rank0_only, path):
        assert out["missing"] == []
        assert_same(out["params"], full_params(plain))


def test_load_reports_bad_files(tmp_path):
    model = BNet()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        bmt.load(model, str(tmp_path / "missing.pt"))
    bad = plain_reference().state_dict()
    bad["head.weight"] = torch.zeros(3, 3)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(RuntimeError, match="size mismatch for head.weight"):
        bmt.load(model, str(tmp_path / "bad.pt"))
    del bad["head.bias"]
    bad["head.weight"] = torch.zeros(V, D)
    torch.save(bad, tmp_path / "missing_key.pt")
    with pytest.raises(RuntimeError, match="head.bias"):
        bmt.load(model, str(tmp_path / "missing_key.pt"))
    bmt.load(model, str(tmp_path / "missing_key.pt"), strict=False)


# ---- forward and backward against plain torch ----


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    from fbmt.integrations.bmt.module import full_grad

    return {n: full_grad(p) for n, p in model.named_parameters()}


def test_forward_backward_match_plain_torch():
    model, plain = bmt_model(seed=1), plain_reference(seed=1)
    x, y = data(0)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    ref = F.cross_entropy(plain(x).flatten(0, 1), y.flatten())
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, dict(plain.named_parameters())[name].grad, rtol=1e-5, atol=1e-6)
    assert all(p.grad.shape == p.shape for p in model.parameters())  # each .grad is its part


class _Outputs(nn.Module):
    """A block returning a tuple, a list and a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0) -> tuple:
        return self.a(x) * scale, [self.b(x), x.sum()], {"c": torch.relu(x)}


class _OutputsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Outputs(), _Outputs()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = 0
        for blk in self.blocks:
            t, (u, s), d = blk(x, scale=0.5)
            out = out + t.sum() + u.square().sum() + s + d["c"].sum()
        return out


def test_block_outputs_tuples_lists_dicts_and_kwargs():
    torch.manual_seed(0)
    plain = _OutputsNet()
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(_OutputsNet())
    assert isinstance(model.blocks[0], bmt.Block)
    x = torch.randn(3, D, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    out, ref = model(x), plain(x2)
    out.backward()
    ref.backward()
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(x.grad, x2.grad)  # input gradients flow out of the compiled model
    for name, g in _grads(model).items():
        torch.testing.assert_close(g, dict(plain.named_parameters())[name].grad)


class _TwoStreams(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, g: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.f(h) + g), g * 0.5 + bias


@pytest.mark.parametrize("return_hidden_states", [False, True])
def test_transformer_block_list_num_hidden_and_hidden_states(return_hidden_states):
    torch.manual_seed(0)
    plain = nn.ModuleList([_TwoStreams() for _ in range(3)])
    torch.manual_seed(0)
    blocks = bmt.TransformerBlockList([_TwoStreams() for _ in range(3)], num_hidden=2)
    assert len(blocks) == 3 and isinstance(blocks[1], bmt.Block) and len(list(blocks)) == 3
    h, g, bias = torch.randn(2, D), torch.randn(2, D), torch.randn(D)
    out = blocks(h, g, bias, return_hidden_states=return_hidden_states)
    hs, gs, (rh, rg) = [], [], (h, g)
    for m in plain:
        hs.append(rh)
        gs.append(rg)
        rh, rg = m(rh, rg, bias)
    if return_hidden_states:
        assert len(out) == 4
        torch.testing.assert_close(out[2], torch.stack(hs))
        torch.testing.assert_close(out[3], torch.stack(gs))
    else:
        assert len(out) == 2
    torch.testing.assert_close(out[0], rh)
    torch.testing.assert_close(out[1], rg)


def test_single_hidden_returns_a_tensor():
    blocks = bmt.TransformerBlockList([BLayer(D), BLayer(D)])
    bmt.init_parameters(blocks)
    out = blocks(torch.randn(2, D))
    assert isinstance(out, torch.Tensor) and out.shape == (2, D)


def test_toggling_requires_grad():
    model, plain = bmt_model(seed=2), plain_reference(seed=2)
    x, y = data(1)
    named = dict(model.named_parameters())
    for frozen in (True, False, True):
        for name in ("layers.1.fc.weight", "head.bias"):
            named[name].requires_grad_(not frozen)
            dict(plain.named_parameters())[name].requires_grad_(not frozen)
        for p in [*model.parameters(), *plain.parameters()]:
            p.grad = None
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
        for name, g in _grads(model).items():
            ref = dict(plain.named_parameters())[name].grad
            assert (g is None) == (ref is None), name
            if ref is not None:
                torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def test_frozen_blocks_get_no_gradient_and_cost_no_reduction():
    model, plain = bmt_model(seed=4), plain_reference(seed=4)
    for m in (model, plain):
        for p in m.layers[0].parameters():
            p.requires_grad_(False)
    x, y = data(2)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    grads = _grads(model)
    assert all(grads[n] is None for n, _ in plain.layers[0].named_parameters(prefix="layers.0"))
    for name, p in plain.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6)
    shard = lower(model).program.stats("shard")
    assert shard.groups == 5 and shard.reductions == {"reduce_scatter": 4}, shard  # the frozen block's is not reduced


def test_dropout_train_vs_eval():
    model, plain = bmt_model(seed=6, dropout=0.5), plain_reference(seed=6, dropout=0.5)
    x, _ = data(3)
    model.eval()
    plain.eval()
    torch.testing.assert_close(model(x), plain(x))
    model.train()
    a, b = model(x), model(x)
    assert not torch.allclose(a, b)  # fresh masks each call
    assert not torch.allclose(a, plain(x))  # dropout is active in training mode
    model.eval()
    torch.testing.assert_close(model(x), plain(x))


def test_checkpoint_and_zero_level_policies_reach_the_passes():
    model = bmt_model(seed=0, use_checkpoint=False, zero_level=2)
    x, y = data(0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    program = lower(model).program  # the compiled module the BMTrain model runs as
    assert program.stats("remat").declined == "no block recomputes (remat='none')", program.summary("remat")
    shard = program.stats("shard")
    assert shard.zero == 3 and set(shard.zero_by_block.values()) == {2} and len(shard.zero_by_block) == 3, shard
    model = bmt_model(seed=0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    remat = lower(model).program.stats("remat")
    assert [b.block for b in remat.blocks] == ["layers.0", "layers.1", "layers.2"], remat  # the Blocks, not emb/head


def test_calling_a_part_of_a_lowered_model_is_an_error():
    model = bmt_model()
    with pytest.raises(RuntimeError, match="call that model, not its part"):
        model.layers[0](torch.randn(2, D))


def test_converting_a_lowered_model_is_an_error_but_no_op_moves_pass():
    model = bmt_model()
    model.to("cpu").float()  # already there: nothing is copied
    with pytest.raises(RuntimeError, match="cannot convert 'emb'"):
        model.half()
    x, _ = data(0)
    assert model(x).dtype == torch.float32  # still intact


# ---- OptimManager: loss scaling ----


def _bf16_setup(loss_scale: float = 1024, **kw):
    p = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD([p], lr=0.5)
    om = bmt.optim.OptimManager(loss_scale=loss_scale, **kw)
    om.add_optimizer(opt)
    return p, om


def test_overflow_skips_the_step_zeroes_grads_and_divides_the_scale():
    p, om = _bf16_setup(loss_scale=8, min_loss_scale=2)
    for expected in (4, 2, 2):  # divided by the factor, never below min_loss_scale
        p.grad = torch.tensor([1.0, float("inf"), 0, 0], dtype=torch.bfloat16)
        assert om.step() is False
        assert om.loss_scale == expected
        assert torch.equal(p.detach(), torch.ones(4, dtype=torch.bfloat16))  # nothing changed
        assert torch.equal(p.grad, torch.zeros(4, dtype=torch.bfloat16))  # gradients zeroed
    p.grad = torch.tensor([float("nan"), 0, 0, 0], dtype=torch.bfloat16)
    assert om.step() is False


def test_clean_steps_unscale_and_grow_the_scale_up_to_the_bound():
    p, om = _bf16_setup(loss_scale=4, loss_scale_steps=2, max_loss_scale=10)
    scales = []
    for _ in range(6):
        p.grad = torch.full((4,), om.loss_scale * 0.25, dtype=torch.bfloat16)  # unscaled: 0.25
        before = p.detach().clone()
        assert om.step() is True
        torch.testing.assert_close(before - p.detach(), torch.full((4,), 0.125, dtype=torch.bfloat16))
        scales.append(om.loss_scale)
    assert scales == [4, 8, 8, 10, 10, 10]  # x2 after every 2 clean steps, capped at max_loss_scale
    with pytest.raises(ValueError, match="loss_scale"):
        bmt.optim.OptimManager(loss_scale=-1)


def test_scaling_can_be_off():
    p = nn.Parameter(torch.ones(2))
    om = bmt.optim.OptimManager()  # no loss scaling: scale 1, never skips
    om.add_optimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([1.0, 2.0])
    assert om.step() and om.loss_scale == 1 and not om.loss_scale_enabled
    torch.testing.assert_close(p.detach(), torch.tensor([0.0, -1.0]))


def test_a_nan_in_an_fp32_gradient_skips_the_step_too():
    """Under loss scaling every gradient is checked, fp32 included: BMTrain checks fp16/bf16 only, and an
    fp32 NaN then made every parameter NaN with no message."""
    p = nn.Parameter(torch.ones(3))
    om = bmt.optim.OptimManager(loss_scale=64)
    om.add_optimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([float("nan"), 1.0, 0.0])
    assert om.step() is False and om.loss_scale == 32
    assert torch.equal(p.detach(), torch.ones(3)) and torch.equal(p.grad, torch.zeros(3))


def _overflow_on_one_rank(rank: int, world: int) -> dict:
    p = nn.Parameter(torch.ones(3, dtype=torch.float16))
    om = bmt.optim.OptimManager(loss_scale=64)
    om.add_optimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([float("inf") if rank == 1 else 1.0, 0, 0], dtype=torch.float16)
    stepped = om.step()
    return dict(stepped=stepped, scale=om.loss_scale, p=p.detach().clone())


def test_an_overflow_on_any_rank_skips_the_step_on_every_rank():
    for out in run_ranks(2, _overflow_on_one_rank):
        assert out["stepped"] is False and out["scale"] == 32
        assert torch.equal(out["p"], torch.ones(3, dtype=torch.float16))


def test_clip_grad_norm_uses_the_scaled_gradients_and_returns_the_true_norm():
    p = nn.Parameter(torch.zeros(2))
    om = bmt.optim.OptimManager(loss_scale=16)
    om.add_optimizer(torch.optim.SGD([p], lr=1.0))
    p.grad = torch.tensor([3.0, 4.0]) * 16
    norm = om.clip_grad_norm([{"params": [p]}], max_norm=1.0)
    torch.testing.assert_close(norm, torch.tensor(5.0))
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]) * 16, rtol=1e-5, atol=0)
    p.grad = torch.tensor([-3.0, 1.0]) * 16
    torch.testing.assert_close(om.clip_grad_norm([{"params": [p]}], 10.0, norm_type=float("inf")), torch.tensor(3.0))


# ---- end to end: the canonical script's loop on 2 ranks vs plain torch on 1 ----

STEPS = 20


def _bmt_train(rank: int, world: int, steps: int, checkpoint: str | None = None, resume: str | None = None) -> dict:
    model = BNet()
    if resume:
        bmt.load(model, resume + ".model")
    else:
        torch.manual_seed(11)
        bmt.init_parameters(model)
    opt = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=1e-2)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=5e-2, warmup_iter=5, end_iter=100, num_iter=0)
    om = bmt.optim.OptimManager(loss_scale=1024, loss_scale_steps=4)
    om.add_optimizer(opt, sched)
    if resume:
        om.load_state_dict(torch.load(resume + f".optim{rank}", weights_only=False))
    losses, norms, first = [], [], 0 if not resume else steps
    for step in range(first, first + steps):
        x, y = data(step)
        x, y = local(x, rank, world), local(y, rank, world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        losses.append(bmt.sum_loss(loss).item())
        om.zero_grad()
        om.backward(loss)
        norms.append(om.clip_grad_norm(opt.param_groups, max_norm=1.0).item())
        om.step()
        if checkpoint and step == steps // 2 - 1:
            bmt.save(model, checkpoint + ".model")
            torch.save(om.state_dict(), checkpoint + f".optim{rank}")
    return dict(params=full_params(model), losses=losses, norms=norms, scale=om.loss_scale, lr=sched.current_lr)


def _plain_train(steps: int) -> dict:
    torch.manual_seed(11)
    model = PNet()
    torch.manual_seed(11)
    init_like_bmt(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    sched = bmt.lr_scheduler.Noam(opt, start_lr=5e-2, warmup_iter=5, end_iter=100, num_iter=0)
    losses, norms = [], []
    for step in range(steps):
        x, y = data(step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        sched.step()
    return dict(params=full_params(model), losses=losses, norms=norms)


def test_twenty_steps_on_two_ranks_equal_plain_torch_on_one():
    ref = _plain_train(STEPS)
    for out in run_ranks(2, _bmt_train, STEPS):
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(out["norms"]), torch.tensor(ref["norms"]), rtol=1e-4, atol=1e-6)
        assert_same(out["params"], ref["params"], rtol=1e-4, atol=1e-5)
        assert out["scale"] == 1024 * 2 ** (STEPS // 4)  # grew every 4 clean steps
    assert ref["losses"][-1] < ref["losses"][0] - 0.5  # and it learned


def test_resume_is_bit_exact(tmp_path):
    half = STEPS // 2
    ck = str(tmp_path / "ck")
    straight = run_ranks(2, _bmt_train, half * 2, ck)
    resumed = run_ranks(2, _bmt_train, half, None, ck)
    for a, b in zip(straight, resumed):
        assert_same(a["params"], b["params"])  # bit-exact: optimizer, scheduler and loss scale all resumed
        assert a["losses"][half:] == b["losses"]
        assert (a["scale"], a["lr"]) == (b["scale"], b["lr"])


def _reshard_leg(rank: int, world: int, steps: range, path: str, optimizer: str) -> dict:
    """Train `steps` of a 12-sequence global batch; resume from `path` if it exists, save there after."""
    model = BNet()
    resume = os.path.exists(path + ".model")
    if resume:
        bmt.load(model, path + ".model")
    else:
        torch.manual_seed(11)
        bmt.init_parameters(model)
    opt = (
        bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=1e-2)
        if optimizer == "offload"
        else torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=1e-2)
    )
    om = bmt.optim.OptimManager(loss_scale=256)
    om.add_optimizer(opt)
    if resume:
        om.load_state_dict(torch.load(path + ".optim", weights_only=False))
    for step in steps:
        x, y = data(step, batch=12)
        x, y = local(x, rank, world), local(y, rank, world)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        om.zero_grad()
        om.backward(loss)
        om.step()
    bmt.save(model, path + ".model")
    state = om.state_dict(gather_opt=True)  # a collective; every per-element state gathered whole
    if rank == 0:
        torch.save(state, path + ".optim")
    return full_params(model)


@pytest.mark.parametrize("optimizer", ["offload", "torch"])
def test_optimizer_state_resumes_on_a_different_number_of_ranks(tmp_path, optimizer):
    torch.manual_seed(11)
    plain = PNet()
    torch.manual_seed(11)
    init_like_bmt(plain)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=1e-2)
    for step in range(9):
        x, y = data(step, batch=12)
        opt.zero_grad()
        F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
    path = str(tmp_path / "ck")
    run_ranks(2, _reshard_leg, range(3), path, optimizer)
    run_ranks(3, _reshard_leg, range(3, 6), path, optimizer)  # 2 -> 3 ranks
    for out in run_ranks(1, _reshard_leg, range(6, 9), path, optimizer):  # 3 -> 1 rank
        assert_same(out, full_params(plain), rtol=1e-4, atol=1e-5)


# ---- inspect ----


def test_inspect_model_summarizes_full_tensors_and_gradients():
    model, plain = bmt_model(seed=9), plain_reference(seed=9)
    x, y = data(0)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    rows = bmt.inspect.inspect_model(model, "layers.*.fc.*")
    assert [r["name"] for r in rows] == [f"layers.{i}.fc.{k}" for i in range(3) for k in ("weight", "bias")]
    for r in rows:
        p = dict(plain.named_parameters())[r["name"]]
        assert r["shape"] == tuple(p.shape)
        assert math.isclose(r["mean"], p.mean().item(), rel_tol=1e-4, abs_tol=1e-7)
        assert math.isclose(r["std"], p.std().item(), rel_tol=1e-4, abs_tol=1e-7)
        assert (r["min"], r["max"]) == (p.min().item(), p.max().item())
        assert math.isclose(r["grad_mean"], p.grad.mean().item(), rel_tol=1e-3, abs_tol=1e-7)
        assert math.isclose(r["grad_std"], p.grad.std().item(), rel_tol=1e-3, abs_tol=1e-7)
    text = bmt.inspect.format_summary(rows)
    assert text.splitlines()[0].split() == ["name", "shape", "mean", "std", "min", "max", "grad_mean", "grad_std"]
    assert len(text.splitlines()) == 2 + len(rows)


def _inspect_on_ranks(rank: int, world: int) -> list[dict]:
    model = bmt_model(seed=9)
    x, y = data(0)
    loss = F.cross_entropy(model(local(x, rank, world)).flatten(0, 1), local(y, rank, world).flatten()) / world
    model.layers[1].fc.weight.requires_grad_(False)  # frozen after the step: keeps its (None) gradient
    loss.backward()
    return bmt.inspect.inspect_model(model, "*")


def test_inspect_model_gathers_parts_and_gradients_across_ranks():
    plain = plain_reference(seed=9)
    x, y = data(0)
    F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).backward()
    named = dict(plain.named_parameters())
    for rows in run_ranks(2, _inspect_on_ranks):
        assert [r["name"] for r in rows] == list(named)
        for r in rows:
            p = named[r["name"]]
            assert math.isclose(r["mean"], p.mean().item(), rel_tol=1e-4, abs_tol=1e-7)
            assert (r["min"], r["max"]) == (p.min().item(), p.max().item())
            if r["name"] == "layers.1.fc.weight":
                assert r["grad_mean"] is None  # no rank had a gradient for it
            else:
                assert math.isclose(r["grad_mean"], p.grad.mean().item(), rel_tol=1e-3, abs_tol=1e-7), r["name"]
                assert math.isclose(r["grad_std"], p.grad.std().item(), rel_tol=1e-3, abs_tol=1e-7), r["name"]


class _Recording(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        bmt.inspect.record_tensor(h, "h")
        return torch.tanh(h)


def _record_inside_blocks(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = bmt.BMTrainModelWrapper(nn.Sequential(nn.ModuleList([_Recording(), _Recording()])))
    seq = model[0]
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(rank))
    out = []
    for _ in range(2):  # outside an inspector nothing is recorded; inside, values and gradients are
        with bmt.inspect.inspect_tensor() as it:
            y = seq(x)
            y.sum().backward()
        out.append(it.get_summary())
    with bmt.inspect.inspect_tensor() as it:
        seq(x)  # no backward: values without gradients
    out.append(it.get_summary())
    return dict(summaries=out, x=x)


def test_record_tensor_inside_compiled_blocks_covers_values_and_gradients():
    torch.manual_seed(0)
    plain = nn.ModuleList([_Recording(), _Recording()])
    results = run_ranks(2, _record_inside_blocks)
    xs = torch.cat([r["x"] for r in results])  # statistics are over both ranks' values
    h, acts = xs.clone().requires_grad_(), []
    for m in plain:
        pre = m.fc(h)
        pre.retain_grad()
        acts.append(pre)
        h = torch.tanh(pre)
    h.sum().backward()
    for r in results:
        for summary in r["summaries"]:
            assert [row["name"] for row in summary] == ["h", "h"]
            for row, pre in zip(summary, acts):
                assert row["shape"] == (4, D)
                assert math.isclose(row["mean"], pre.mean().item(), rel_tol=1e-4, abs_tol=1e-6)
                assert math.isclose(row["std"], pre.std().item(), rel_tol=1e-4, abs_tol=1e-6)
                assert math.isclose(row["max"], pre.max().item(), rel_tol=1e-5)
                if summary is r["summaries"][-1]:
                    assert row["grad_mean"] is None
                else:
                    assert math.isclose(row["grad_mean"], pre.grad.mean().item(), rel_tol=1e-4, abs_tol=1e-6)


# ---- the rest of the surface ----


def test_fused_cross_entropy_matches_torch_in_fp32():
    torch.manual_seed(0)
    logits = torch.randn(37, 11) * 4
    target = torch.randint(0, 11, (37,))
    target[::5] = -100
    for reduction in ("mean", "sum", "none"):
        for dtype in (torch.float32, torch.bfloat16):
            x = logits.to(dtype).detach().clone().requires_grad_()
            ref_x = logits.to(dtype).float().detach().clone().requires_grad_()
            loss = bmt.loss.FusedCrossEntropy(reduction=reduction, chunk_bytes=4 * 11 * 8)(x, target)  # 8-row chunks
            ref = F.cross_entropy(ref_x, target, reduction=reduction)
            torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
            weights = torch.rand_like(ref) if reduction == "none" else torch.tensor(1.0)
            (loss * weights).sum().backward()
            (ref * weights).sum().backward()
            assert x.grad.dtype == dtype
            torch.testing.assert_close(
                x.grad.float(), ref_x.grad.to(dtype).float(), rtol=1e-2 if dtype != torch.float32 else 1e-5, atol=1e-6
            )
    with pytest.raises(ValueError, match="reshape"):
        bmt.loss.FusedCrossEntropy()(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))


def test_average_recorder_is_a_bias_corrected_moving_average():
    r = bmt.utils.AverageRecorder(alpha=0.5)
    assert r.value == 0
    r.record(4.0)
    assert r.value == 4.0  # no start-up bias
    r.record(2.0)
    assert r.value == pytest.approx((0.5 * 0.5 * 4 + 0.5 * 2) / (1 - 0.25))


def test_nn_layers_and_config_import_as_scripts_expect():
    for name in ("Linear", "ColumnParallelLinear", "RowParallelLinear", "VPEmbedding"):
        assert hasattr(bmt.nn, name)
    lin = bmt.nn.Linear(3, 5)
    assert tuple(lin.weight._original_shape) == (5, 3) and isinstance(lin, bmt.DistributedModule)
    emb = bmt.nn.VPEmbedding(7, 3, dtype=torch.float32)
    bmt.init_parameters(emb)
    assert emb(torch.tensor([1, 2])).shape == (2, 3)
    keys = (
        "rank",
        "local_rank",
        "world_size",
        "zero_size",
        "tp_size",
        "tp_rank",
        "tp_zero_size",
        "tp_zero_rank",
        "pipe_size",
    )
    assert all(k in bmt.config for k in keys) and bmt.global_var.config is bmt.config
    with pytest.raises(NotImplementedError, match="tensor and pipeline parallelism"):
        bmt.init_distributed(seed=0, tp_size=2)
    assert "GiB" in bmt.see_memory("after setup")
