"""What compiling does, and what it skips: the second trace only where the graph writes to more than
the tensors it made, fewer
cycle collections while compiling, the block of a module found by its path's prefixes."""

from __future__ import annotations

import copy
import gc
import random

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.compiler import pipeline
from fbmt.compiler import trace as trace_module
from fbmt.compiler.layout import Layout
from tests.models.reference import loss_and_gradients_match


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class InPlace(Plain):
    """In-place ops on an intermediate and on a buffer: the graph needs functionalization."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        h = self.a(x)
        h.mul_(2).add_(1)
        self.calls.add_(1)
        return self.b(torch.relu(h))


class Fresh(Plain):
    """In-place ops on a product's result and on a factory's (NOTE: [Writes to fresh tensors]): they
    are rewritten as their functional ops, without a second trace."""

    def forward(self, x):
        h = self.a(x)
        h.mul_(2).add_(1)
        noise = torch.empty_like(h).fill_(0.5)
        noise.add_(h)
        return self.b(torch.relu(h) * noise)


class ThroughView(Plain):
    """A write to a slice of a product's result; its backward reads the gradient's slice, then writes
    zeros through it: both rewritten, the write scattered back into the whole."""

    def forward(self, x):
        h = self.a(x)
        h[:, :4].mul_(3)
        return self.b(torch.relu(h))


class ViewThenWrite(Plain):
    """A view taken before the write and read after it sees the write: functionalization, not a rewrite."""

    def forward(self, x):
        h = self.a(x)
        v = h.view(-1, 4, 4)
        h.mul_(2)
        return self.b(torch.relu(v.reshape(-1, 16) + h))


class ShiftRight(Plain):
    """Writes through a slice, a select and a slice of a slice of a factory's result, as T5 and BART
    shift their labels right: each its functional op scattered back into the whole, no second trace."""

    def forward(self, x):
        shifted = x.new_zeros(x.shape)
        shifted[:, 1:] = x[:, :-1].clone()
        shifted[:, 0] = 0.5
        shifted[1:][:, 2:4].mul_(-1)
        shifted.masked_fill_(shifted > 1, 1.0)
        return self.b(torch.tanh(self.a(shifted)))


class ReadThenShift(Plain):
    """mBART's shift: a slice read (its clone) before the tensor is written through another slice."""

    def forward(self, x):
        shifted = x.clone()
        shifted.masked_fill_(shifted > 1, 1.0)
        shifted[:, 1:] = shifted[:, :-1].clone()
        shifted[:, 0] = shifted.t()[-1]
        return self.b(torch.tanh(self.a(shifted)))


class SliceReadAfterWrite(Plain):
    """A slice taken before a write to the whole and read after it sees the write."""

    def forward(self, x):
        shifted = x.new_zeros(x.shape)
        head = shifted[:, :2]
        shifted.add_(x)
        return self.b(torch.tanh(self.a(shifted))) * head.sum()


class WritesOfAnotherDtype(Plain):
    """In-place ops keep the dtype of the tensor they write, where their functional ops would promote
    (bf16 plus fp32 is fp32): the rewrite casts back, as functionalization does."""

    def forward(self, x):
        h = self.a(x).bfloat16()
        h.add_(torch.full(h.shape, 1e-3))
        h[:, 1:].mul_(torch.full((h.shape[0], 15), 1.001))
        return self.b(torch.relu(h.float()))


class StridesRead(Plain):
    """A product written in place keeps its tensor's strides (column-major here), where the functional
    product is row-major: `as_strided`, which reads the storage by strides, is left to functionalization."""

    def forward(self, x):
        h = torch.empty_strided((3, 16), (1, 3), device=x.device).zero_()
        h.addmm_(x, self.a.weight.t()).add_(self.a.bias)
        return self.b(torch.tanh(h.as_strided((3, 16), (16, 1))))


class StridesReadDownstream(Plain):
    """The same layout read by `as_strided` of a tensor computed from the one written (which follows its
    layout in eager), no gradient going through either."""

    def forward(self, x):
        h = torch.empty_strided((3, 16), (1, 3), device=x.device).zero_()
        h.addmm_(x, torch.linspace(-1, 1, 128, device=x.device).view(8, 16))
        return self.b(torch.tanh(self.a(x) * (h * 2).as_strided((3, 16), (16, 1))))


class WriteBetween(Plain):
    """A write to the whole between a view and the write through it: the view holds the first write."""

    def forward(self, x):
        shifted = x.new_zeros(x.shape)
        view = shifted[:, 1:]
        shifted.add_(x)
        view.mul_(3)
        return self.b(torch.tanh(self.a(shifted)))


class ViewOfTheViewReadAfter(Plain):
    """A view of the written view, taken before the write and read after it, sees the write."""

    def forward(self, x):
        shifted = x.new_zeros(x.shape)
        view = shifted[:, 1:]
        first = view[0]
        view.copy_(x[:, :-1])
        return self.b(torch.tanh(self.a(shifted))) * first.sum()


class Dropout(Plain):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.b(self.drop(torch.tanh(self.a(x))))


class ThroughPermute(Plain):
    """Writes through a permute of a fresh tensor and a slice of one: each the functional op's value permuted
    back (NOTE: [Draws in memory order] makes dropout's draw one)."""

    def forward(self, x):
        h = torch.tanh(self.a(x))  # (3, 16)
        y = h.new_zeros(16, 3)
        y.permute(1, 0).add_(h)
        z = h.new_ones(3, 16)
        z.t()[1:].mul_(h.t()[1:] * 3)
        return self.b(y.t() * z)


class DropoutAcross(Plain):
    """Dropout of a transposed tensor: eager's mask, drawn through a permute, with no second trace."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        h = torch.tanh(self.a(x)).t().contiguous().t()
        return self.b(self.drop(h))


@pytest.fixture
def functionalizations(monkeypatch):
    calls = []
    real = trace_module.functionalize

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_module, "functionalize", counted)
    return calls


@pytest.mark.parametrize(
    "cls, second_trace",
    [
        (Plain, False),
        (InPlace, True),
        (Fresh, False),
        (Dropout, False),
        (ShiftRight, False),
        (ReadThenShift, False),
        (WritesOfAnotherDtype, False),
        (ThroughView, False),
        (ThroughPermute, False),
        (DropoutAcross, False),
        (ViewThenWrite, True),
        (StridesRead, True),
        (StridesReadDownstream, True),
        (SliceReadAfterWrite, True),
        (WriteBetween, True),
        (ViewOfTheViewReadAfter, True),
    ],
)
def test_functionalization_runs_where_the_graph_mutates_and_both_match_eager(cls, second_trace, functionalizations):
    torch.manual_seed(0)
    ref = cls()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, device="cpu", cache_dir=False)
    x = torch.randn(3, 8)
    for step in range(2):  # twice: the buffer's update is written back once per call
        torch.manual_seed(step)  # the same dropout masks
        model(x).square().sum().backward()
        torch.manual_seed(step)
        ref(x).square().sum().backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], b, msg=name)
    assert bool(functionalizations) == second_trace


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).transpose(1, 3).unbind(2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_writes_to_fresh_tensors_rewritten_give_the_functionalized_program(family, monkeypatch):
    """Hugging Face's dropout (its mask drawn in place) rewritten without the second trace: the program
    functionalization gives, names included, stamped or not (NOTE: [Writes to fresh tensors])."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
        )
        model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 64, (2, 8))

    def text() -> str:
        compiled = fbmt.compile(copy.deepcopy(model), world_size=2, device="cpu", cache_dir=False)
        return "\n".join(line for line in str(compiled.trace(input_ids=ids, labels=ids)).splitlines() if line[0] != "#")

    for stamping in ("1", "0"):
        monkeypatch.setenv("FBMT_STAMP", stamping)
        rewritten = text()
        assert "= bernoulli.p(" in rewritten and "= bernoulli_.float(" not in rewritten
        with monkeypatch.context() as m:
            m.setattr(trace_module, "_without_writes", lambda graph: False)
            assert rewritten == text()


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_labels_shifted_right_through_slices_need_no_second_trace(family, functionalizations, monkeypatch):
    """T5 and BART shift their labels right by writing through a slice and a select of `new_zeros`: no
    second trace, eager's loss and gradients; T5's program has functionalization's ops, less the views
    of the whole it takes after each write and leaves unread."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "t5":
        config = transformers.T5Config(
            vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8,
            decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        ref = transformers.T5ForConditionalGeneration(config)
    else:
        config = transformers.BartConfig(
            vocab_size=64, d_model=16, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
            decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
            max_position_embeddings=32,
        )  # fmt: skip
        ref = transformers.BartForConditionalGeneration(config)
    ids, labels = torch.randint(2, 64, (2, 9)), torch.randint(2, 64, (2, 7))
    labels[1, 5:] = -100  # padding: shifted in as the pad token
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, device="cpu", cache_dir=False)
    loss_and_gradients_match(ref, model, dict(input_ids=ids, labels=labels))
    assert not functionalizations
    if family == "t5":
        views = (torch.ops.aten.slice.Tensor, torch.ops.aten.select.int)

        def ops() -> list[str]:
            program = fbmt.compile(copy.deepcopy(ref), world_size=2, device="cpu", cache_dir=False).trace(
                input_ids=ids, labels=labels
            )
            return sorted(str(n.target) for n in program.graph.nodes if n.users or n.target not in views)

        rewritten = ops()
        monkeypatch.setattr(trace_module, "_without_writes", lambda graph: False)
        assert ops() == rewritten


def test_keyword_arguments_given_their_default_are_dropped():
    """Attention's gradient formula passes `attn_mask=None`; the program prints as if traced twice."""
    program = fbmt.compile(Attention(), world_size=1, device="cpu", cache_dir=False).trace(torch.randn(2, 5, 8))
    for n in program.graph.nodes:
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload):
            assert not any(trace_module._default(n.target, k, v) for k, v in n.kwargs.items()), n.format_node()


def test_compiling_collects_less_often_and_puts_the_thresholds_back(monkeypatch):
    seen = []
    real = pipeline.compile_program

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold())
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "compile_program", spy)
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        fbmt.compile(Plain(), world_size=1, device="cpu", cache_dir=False).trace(torch.randn(3, 8))
        assert seen[-1][0] >= 200_000 and gc.get_threshold() == (700, 10, 10)
        gc.set_threshold(0)  # a user who turned automatic collection off keeps it off
        fbmt.compile(Plain(), world_size=1, device="cpu", cache_dir=False).trace(torch.randn(3, 8))
        assert seen[-1][0] == 0 and gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def _longest_prefix(blocks: tuple[str, ...], path: str | None) -> str | None:
    """What `block_of_module` answered before it looked up prefixes: a scan of every block."""
    if path is None:
        return None
    best = None
    for b in blocks:
        if b == "" or path == b or path.startswith(b + "."):
            if best is None or len(b) > len(best):
                best = b
    return best


@pytest.mark.parametrize("root", [True, False])
def test_block_of_module_is_the_longest_block_that_prefixes_the_path(root):
    rng = random.Random(0)
    blocks = ("",) * root + tuple(f"h.{i}" for i in range(12)) + ("h.3.attn", "h.1x", "lm_head")
    layout = Layout(blocks=blocks, groups=(), aliases={}, world_size=1)
    names = ["h", "h.1", "h.10", "h.1x", "h.3", "attn", "q", "lm_head", "wte", "h.3.attn", "x"]
    paths = [None, ""] + [".".join(rng.choices(names, k=rng.randint(1, 4))) for _ in range(500)]
    for path in paths:
        assert layout.block_of_module(path) == _longest_prefix(blocks, path), path


def test_a_model_compiled_on_meta_traces_with_its_buffers_where_its_parameters_are_traced():
    """BERT's token types (a buffer) index an embedding: compiled on meta for inspection and traced on
    CPU fakes, the buffers are on the CPU as the parameters are, so its gradient's op meets one device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertForMaskedLM(config)
    ids = torch.randint(0, 64, (2, 8))
    program = fbmt.compile(model, world_size=2, device="meta", cache_dir=False).trace(
        input_ids=ids, labels=ids, device="cpu"
    )
    devices = {n.meta["val"].device.type for n in program.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
    assert devices == {"cpu"}, devices
