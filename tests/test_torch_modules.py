"""torch.nn modules beyond linear layers, compiled as users write them and compared with eager PyTorch
(DDP where ranks matter): recurrent layers, BatchNorm's buffers (and a BatchNorm frozen by `.eval()`),
buffers a forward assigns anew or registers, a model's own torch.utils.checkpoint calls, embeddings fbmt
refuses, and modules built on the meta device."""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import fbmt
from tests.dist import run_ranks


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.rnn = cell(8, 16, num_layers=2, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, _ = self.rnn(x)
        return self.head(y).square().mean()


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.bn(self.fc(x)))).square().mean()


def _as_ddp(rank: int, world: int, build, shape: tuple, broadcast_buffers: bool) -> None:
    """3 SGD steps, each rank on its own batch, against DDP: parameters and buffers on every rank."""
    torch.manual_seed(0)
    ref = build()
    model = fbmt.compile(copy.deepcopy(ref), broadcast_buffers=broadcast_buffers)
    ddp = DistributedDataParallel(ref, broadcast_buffers=broadcast_buffers)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ddp, model)]
    for step in range(3):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(100 * step + rank))
        want, got = ddp(x), model(x)
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, msg=f"rank {rank} step {step}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=1e-5, atol=1e-6, msg=n)
    for (n, want), (_, got) in zip(ref.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(got, want, msg=f"buffer {n} on rank {rank}")
    return {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("cell", [nn.LSTM, nn.GRU])
def test_recurrent_layers_train_as_eager(cell):
    run_ranks(2, _as_ddp, functools.partial(Recurrent, cell), (3, 5, 8), True)


@pytest.mark.parametrize("broadcast", [True, False])
def test_batchnorm_buffers_follow_ddps_broadcast_buffers(broadcast):
    ranks = run_ranks(2, _as_ddp, Normed, (5, 6), broadcast)
    same = torch.equal(ranks[0]["bn.running_mean"], ranks[1]["bn.running_mean"])
    assert not same  # the last step's update is each rank's own, in DDP as here
    assert ranks[0]["bn.num_batches_tracked"] == 3


def _frozen_batchnorm() -> Normed:
    """A model that trains with its BatchNorm frozen by `.eval()`, as fine-tuning scripts freeze theirs:
    it normalizes by its running statistics (set apart from a batch's) and never updates them."""
    model = Normed()
    with torch.no_grad():
        model.bn.running_mean.fill_(0.5)
        model.bn.running_var.fill_(3.0)
    model.train()
    model.bn.eval()
    return model


def test_a_module_set_to_eval_before_compile_keeps_its_mode_while_the_model_trains():
    ranks = run_ranks(2, _as_ddp, _frozen_batchnorm, (5, 6), True)
    for buffers in ranks:
        assert buffers["bn.num_batches_tracked"] == 0 and torch.equal(buffers["bn.running_mean"], torch.full((8,), 0.5))


class Averaging(nn.Module):
    """A layer that keeps an average by assigning its buffer anew (VQ-VAE codebooks and BYOL's targets
    are written so), where `mul_` and `add_` would update it in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return y - self.ema


class Averaged(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Averaging() for _ in range(3))  # alike: each would be stamped
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def test_buffers_the_forward_assigns_anew_train_as_eager_on_two_ranks():
    """NOTE: [Buffers a forward assigns]: functional_call put the module's own buffers back after the
    trace, so each call computed from the averages' first values, silently."""
    ranks = run_ranks(2, _as_ddp, Averaged, (5, 6), True)
    assert not torch.equal(ranks[0]["layers.2.ema"], torch.zeros(6))


class LazyTable(nn.Module):
    """A table made at the first call and made again for a longer input, as remote-code models' rotary
    embeddings register theirs."""

    def __init__(self):
        super().__init__()
        self.fc, self.cached = nn.Linear(4, 4), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        if n > self.cached:
            table = torch.cos(torch.arange(n, dtype=torch.float32))[None, :, None]
            self.register_buffer("table", table, persistent=False)
            self.cached = n
        return self.fc(x) * self.table[:, :n]


def test_a_buffer_the_forward_registers_and_grows_is_eagers_after_each_call():
    """The trace left a fake tensor registered: the next call failed on it."""
    torch.manual_seed(0)
    ref = LazyTable()
    model = fbmt.compile(copy.deepcopy(ref))
    for n in (3, 3, 5, 4):
        x = torch.randn(2, n, 4)
        torch.testing.assert_close(model(x), ref(x), msg=f"length {n}")
        table = dict(model.named_buffers())["table"]
        assert type(table) is torch.Tensor and torch.equal(table, ref.table), n
    assert model.state_dict().keys() == ref.state_dict().keys()  # not persistent, as it was registered


class Checkpointed(nn.Module):
    """Blocks called through torch.utils.checkpoint in the model's own code, as nanoGPT's forks write them."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3)])
        self.head, self.reentrant = nn.Linear(6, 1), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x).square().mean()


def test_a_models_own_checkpoints_train_as_eager_on_two_ranks():
    """NOTE: [Checkpoints in the model's code]: the trace failed inside the checkpoint's backward."""
    run_ranks(2, _as_ddp, Checkpointed, (5, 6), True)


@pytest.mark.parametrize("input_grad", [True, False])
def test_a_reentrant_checkpoint_gives_eager_gradients_and_none_where_no_input_requires_grad(input_grad):
    """Without an input that requires grad a reentrant checkpoint returns values that do not, eagerly: the
    layers it calls get no gradient (with torch's warning), the head after them does."""
    torch.manual_seed(0)
    ref = Checkpointed(reentrant=True)
    model = fbmt.compile(copy.deepcopy(ref))
    x = torch.randn(5, 6, requires_grad=input_grad)
    warned = pytest.warns(UserWarning, match="None of the inputs have requires_grad=True")
    with warned if not input_grad else contextlib.nullcontext():
        loss = model(x)
    ref(x).backward()
    loss.backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        if p.grad is None:  # eager's None, as fbmt gives a parameter no gradient reached
            assert grads[name] is None, name
        else:
            torch.testing.assert_close(grads[name], p.grad, msg=name)
    assert all(p.grad is None for p in ref.layers.parameters()) != input_grad


class OffloadedCheckpoints(Checkpointed):
    """Each checkpoint in `save_on_cpu`, as Hugging Face's `activation_checkpointing_enable(offload=True)` wraps
    them (pinned where the machine can pin, as there)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                x = checkpoint(layer, x, use_reentrant=False)
        return self.head(x).square().mean()


def test_save_on_cpu_in_the_forward_is_left_out_of_the_program_with_a_warning(caplog):
    """NOTE: [Checkpoints in the model's code]: its copies to the host were traced into the program, as
    buffers Inductor could not make where they were pinned (on a GPU: "Only CPU tensors can be pinned").
    The program has none of them, says so, warns, and gives eager's gradients."""
    torch.manual_seed(0)
    ref = OffloadedCheckpoints()
    model = fbmt.compile(copy.deepcopy(ref))
    with caplog.at_level("WARNING", logger="fbmt"):
        _gradients_as_eager(model, ref, torch.randn(5, 6))
    assert "save_on_cpu(pin_memory=True) in the forward left out" in str(model.program)
    assert any("save_on_cpu" in r.getMessage() and "remat=" in r.getMessage() for r in caplog.records)
    copies = [n for n in model.program.graph.nodes if "empty" in str(n.target) or "copy" in str(n.target)]
    assert not copies, copies


class TransposedGradients(nn.Module):
    """Activations whose gradient arrives transposed, in the projection's backward view of it."""

    def __init__(self, activation):
        super().__init__()
        self.proj, self.activation = nn.Linear(4, 2), activation
        self.weight = nn.Parameter(torch.randn(12, 3, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the product laid out as the weight: its gradient too
        return (self.weight * self.activation(self.proj(x)).transpose(0, 1)).square().sum()


@pytest.mark.parametrize(
    "activation", [nn.Softplus(), nn.Hardtanh(), nn.ELU(), nn.Hardswish(), nn.Tanh()], ids=lambda m: type(m).__name__
)
def test_an_activation_whose_fake_gradient_is_laid_out_otherwise_trains_as_eager(activation):
    """NOTE: [Strides a trace may not know]: softplus_backward of a transposed gradient is transposed, its fake
    contiguous, so the linear's backward view of it failed ("view size is not compatible"). Tanh's fake is
    right: it ran before as it runs now."""
    torch.manual_seed(0)
    ref = TransposedGradients(activation)
    _gradients_as_eager(fbmt.compile(copy.deepcopy(ref)), ref, torch.randn(3, 12, 4))


def _gradients_as_eager(model: nn.Module, ref: nn.Module, x: torch.Tensor) -> None:
    """One backward of each model's scalar output for `x`: every parameter's gradient is eager's."""
    model(x).backward()
    ref(x).backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)


@pytest.mark.parametrize(
    "embedding, said",
    [
        (nn.Embedding(10, 4, max_norm=1.0), r"Embedding '0' has max_norm=1.0: .* does not write its parameters"),
        (nn.Embedding(10, 4, sparse=True), r"Embedding '0' has sparse=True: .* Build it with sparse=False"),
        (nn.EmbeddingBag(10, 4, sparse=True), r"EmbeddingBag '0' has sparse=True"),
    ],
)
def test_an_embedding_fbmt_cannot_run_as_eager_is_refused_naming_it(embedding, said):
    """max_norm failed the trace ("please report it"); sparse=True the shard pass ("reshape is not
    implemented for sparse tensors")."""
    with pytest.raises(ValueError, match=said):
        fbmt.compile(nn.Sequential(embedding, nn.Linear(4, 1)))


def test_multihead_attention_built_on_meta_is_initialized_by_its_reset_parameters():
    with torch.device("meta"):
        mha = nn.MultiheadAttention(8, 2)
    model = fbmt.compile(mha)
    full = model.full_parameters()
    assert torch.equal(full["in_proj_bias"], torch.zeros(24))  # what _reset_parameters sets
    assert full["in_proj_weight"].std() > 0.1
    x = torch.randn(3, 1, 8)
    eager = nn.MultiheadAttention(8, 2)
    eager.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x, x, x)[0], eager(x, x, x)[0])


class RootOwned(nn.Module):
    def __init__(self, with_reset: bool):
        super().__init__()
        self.scale = nn.Parameter(torch.empty(4))
        self.register_buffer("shift", torch.empty(4))
        self.fc = nn.Linear(4, 4)
        if with_reset:
            self.reset_parameters = lambda: (nn.init.ones_(self.scale), self.shift.fill_(0.5))

    def forward(self, x):
        return (self.fc(x) * self.scale + self.shift).sum()


def test_root_level_parameters_and_buffers_built_on_meta():
    with torch.device("meta"):
        model = RootOwned(with_reset=True)
    model = fbmt.compile(model)
    state = model.state_dict()
    assert torch.equal(state["scale"], torch.ones(4)) and torch.equal(state["shift"], torch.full((4,), 0.5))
    with torch.device("meta"):
        bare = RootOwned(with_reset=False)
    with pytest.raises(ValueError, match=r"'<root>' \(RootOwned\) .* owns \['scale', 'shift'\] directly"):
        fbmt.compile(bare)


def test_an_initializer_that_skips_a_parameter_is_refused():
    def forgetful(m):
        if isinstance(m, nn.Linear):
            nn.init.zeros_(m.weight)  # the bias stays unset

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"left \['0.bias'\] without values"):
        fbmt.compile(model, init_fn=forgetful)


class NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.fc(x)))


class NormedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([NormedBlock(), NormedBlock()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("remat", ["block", "selective", "mincut", "none"])
def test_batchnorm_statistics_are_updated_once_per_step_under_every_recompute(remat):
    """A recomputed BatchNorm in the backward must not update the running statistics again."""
    torch.manual_seed(0)
    ref = NormedStack()
    model = fbmt.compile(copy.deepcopy(ref), remat=remat)
    for step in range(2):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        ref(x).backward()
        model(x).backward()
    for (n, want), (_, got) in zip(ref.named_buffers(), model.named_buffers()):
        torch.testing.assert_close(got, want, msg=n)
