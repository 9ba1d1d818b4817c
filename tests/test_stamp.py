"""Stamped blocks (NOTE: [Stamped blocks] in fbmt/compiler/stamp.py): a kind of block traced once and
copied for its other calls gives the program tracing every block gives, node for node, names and
every fact of fbmt's included, for every pass; blocks that are not alike, or that meet what their
kind's trace did not see, are traced as code or traced again. The same program computes the same
values: the equivalence tests (tests/test_equivalence.py) train stamped GPTs against eager."""

from __future__ import annotations

import copy
import dataclasses
import threading
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import fx

import fbmt
from fbmt.compiler import stamp as stamping
from fbmt.models.gpt import GPT, GPTConfig
from tests.models.reference import loss_and_gradients_match
from tests.workers import step_matches

KEYS = ("fbmt_phase", "fbmt_module", "fbmt_block", "fbmt_recompute", "fbmt_group", "fbmt_bucket")


def _program(monkeypatch: pytest.MonkeyPatch, stamp: bool, build, args: tuple, kwargs: dict | None = None, **options):
    monkeypatch.setenv("FBMT_STAMP", "1" if stamp else "0")
    torch.manual_seed(0)
    options = {"world_size": 2, "device": "meta", **options}
    compiled = fbmt.compile(build(), cache_dir=False, **options)
    return compiled.trace(*args, device="cpu", **(kwargs or {}))


def _facts(program) -> list[tuple]:
    return [
        (n.name, n.op, str(n.target), str(n.args), str(n.kwargs), *(n.meta.get(k) for k in KEYS))
        for n in program.graph.nodes
    ]


def _unnamed(program) -> list[tuple]:
    """Each node's target and module, in the graph's order."""
    return [(str(n.target), n.meta.get("fbmt_module")) for n in program.graph.nodes]


def _masks(program) -> list[str]:
    """What each attention kernel of the forward is given as its mask, in order."""
    mask = lambda n: n.kwargs.get("attn_mask") or (n.args[3] if len(n.args) > 3 else None)  # noqa: E731
    return [
        str(getattr(mask(n), "target", None))
        for n in program.graph.nodes
        if "scaled_dot_product" in str(n.target) and "backward" not in str(n.target)
    ]


def _trace_line(program) -> str:
    return next((str(r.stats) for r in program.history if r.name == "trace"), "")


def _same(monkeypatch, build, args, kwargs=None, **options) -> str:
    """Both programs are one program, pass by pass; what the stamped trace said of itself."""
    whole = _program(monkeypatch, False, build, args, kwargs, **options)
    stamped = _program(monkeypatch, True, build, args, kwargs, **options)
    assert _facts(stamped) == _facts(whole)
    texts = {r.name: r.text for r in whole.history}
    for r in stamped.history:
        if r.name in texts:
            assert r.text == texts[r.name], f"pass {r.name} differs"
    assert "stamped" not in _trace_line(whole)
    return _trace_line(stamped)


def _tokens(n: int = 16, vocab: int = 64) -> tuple:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, vocab, (2, n), generator=g), torch.randint(0, vocab, (2, n), generator=g))


def _gpt(n_layer: int = 3):
    return lambda: GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=32))


def test_gpt_blocks_are_stamped_into_the_program_a_whole_trace_gives(monkeypatch):
    said = _same(monkeypatch, _gpt(4), _tokens())
    assert "traced 1 block kind(s) once and stamped their calls (h.0's x4)" in said


@pytest.mark.parametrize("options", [{"remat": "none", "zero": 2}, {"remat": "selective", "fp8": "tensorwise"}])
def test_options_do_not_change_what_stamping_gives(monkeypatch, options):
    assert "stamped" in _same(monkeypatch, _gpt(3), _tokens(), **options)


def test_a_trace_without_gradients_is_stamped_too(monkeypatch):
    def build():
        model = _gpt(3)()
        model.eval()
        return model

    with torch.no_grad():  # a forward alone: its kind has no backward, its calls no stamp_grad
        said = _same(monkeypatch, build, (_tokens()[0],))
    assert "stamped" in said


class _Switch(nn.Module):
    """A block whose code path depends on an attribute that differs between blocks."""

    def __init__(self, i: int):
        super().__init__()
        self.i = i
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return x + (F.gelu(y) if self.i % 2 == 0 else torch.tanh(y))


class _Index(nn.Module):
    """A block that keeps its index (as Hugging Face's layer_idx) without using it."""

    def __init__(self, i: int):
        super().__init__()
        self.layer_idx = i
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + F.silu(self.fc(x))


class _Stack(nn.Module):
    def __init__(self, block, n: int = 4):
        super().__init__()
        self.inp = nn.Linear(16, 16)  # every block's input requires grad, the first's too
        self.layers = nn.ModuleList(block(i) for i in range(n))
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x).square().mean()


def _x():
    return (torch.randn(4, 16),)


def test_blocks_whose_attributes_change_what_runs_are_kinds_of_their_own(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_Switch), _x())
    assert "traced 2 block kind(s) once and stamped their calls (layers.0's x2, layers.1's x2)" in said


def test_an_attribute_that_changes_nothing_does_not_split_a_kind(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_Index), _x())
    assert "(layers.0's x4)" in said


class _Aux(nn.Module):
    """A block of two results; the model uses the second of the last block only."""

    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = self.fc(x)
        return x + y, y.sum()


class _AuxStack(_Stack):
    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x, aux = layer(x)
        return self.head(x).square().mean() + aux  # the other blocks' aux get no gradient


def test_calls_whose_results_no_one_reads_are_a_kind_of_their_own(monkeypatch):
    # the fake forward's autograd graph says which results the backward gives gradients to: the aux of
    # the first three blocks gets none (their kind is traced so), the last block's does (traced as code)
    said = _same(monkeypatch, lambda: _AuxStack(_Aux), _x())
    assert "(layers.0's x3)" in said


def _t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=16, d_ff=32, num_layers=4, num_decoder_layers=4, num_heads=2, d_kv=8,
        decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config)


def test_t5_blocks_that_pass_on_the_bias_they_got_are_stamped(monkeypatch):
    """Each T5 layer returns the position biases it got, for the next (the first computes them: a kind
    of its own). Those results are the tensors the layer got, after its op as before it: no gradient
    goes through the op for them (the last layer's gets none at all), and the next layer knows the
    decoder's cross-attention bias as the zeros it is, so its mask is dropped as the whole trace drops it."""
    ids, labels = _tokens()
    call = dict(input_ids=ids, labels=labels[:, :8].contiguous())
    whole, stamped = (_program(monkeypatch, stamp, _t5, (), call) for stamp in (False, True))
    assert "(encoder.block.1's x3, decoder.block.1's x3)" in _trace_line(stamped)
    # the same ops, the attention kernels given the same masks (none where the whole trace drops one);
    # the bias's gradient sums the layers' parts in another order (NOTE: [Stamped blocks])
    assert sorted(op for op, *_ in _unnamed(stamped)) == sorted(op for op, *_ in _unnamed(whole))
    assert _masks(stamped) == _masks(whole)
    _t5_stamped_trains_as_in_eager()


def _t5_stamped_trains_as_in_eager() -> None:
    """A T5's loss and every gradient of one call, compiled (its layers stamped) and eager."""
    ids, labels = _tokens()
    call = dict(input_ids=ids, labels=labels[:, :8].contiguous())
    ref = _t5()
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    loss_and_gradients_match(ref, model, call)
    assert "(encoder.block.1's x3, decoder.block.1's x3)" in _trace_line(model.program)


class _DropsGrad(torch.autograd.Function):
    """Reads its second argument, and gives it no gradient: a reader the fake forward's graph shows."""

    @staticmethod
    def forward(ctx, x, aux):
        return x + aux.detach()

    @staticmethod
    def backward(ctx, g):
        return g, None


class _DroppedAuxStack(_Stack):
    def forward(self, x):
        x = self.inp(x)
        total = 0
        for layer in self.layers:
            x, aux = layer(x)
            total = total + aux
        return _DropsGrad.apply(self.head(x).square().mean(), total)


def test_a_result_its_kind_gave_a_gradient_that_gets_none_makes_the_trace_run_again_whole(monkeypatch):
    said = _same(monkeypatch, lambda: _DroppedAuxStack(_Aux), _x())
    assert "stamped" not in said  # every aux got none: traced again, every block as code


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.shared = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Index(i) for i in range(3))
        self.layers[1].fc = self.shared  # a block's parameter read outside it too

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.shared(x).square().mean()


def test_blocks_with_a_parameter_tied_outside_are_traced_as_code(monkeypatch):
    said = _same(monkeypatch, _Tied, _x())
    assert "(layers.0's x2)" in said  # layers.0 and layers.2


class _Norm(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.bn = nn.BatchNorm1d(16)

    def forward(self, x):
        return x + self.bn(self.fc(x))


def test_blocks_that_update_a_buffer_are_traced_as_code(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_Norm), _x(), world_size=1, device="cpu")
    assert "stamped" not in said


class _Pair(nn.Module):
    """A block holding a list of two sub-blocks of one class: candidates within a candidate."""

    def __init__(self, i: int):
        super().__init__()
        self.inner = nn.ModuleList(_Index(j) for j in range(2))

    def forward(self, x, scale: float = 1.0):
        for layer in self.inner:
            x = layer(x) * scale
        return x


def test_blocks_within_stamped_blocks(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_Pair, n=3), _x())
    assert "(layers.0's x3)" in said  # the sub-blocks' calls go with the blocks that make them


class _Keyword(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Pair(i) for i in range(3))

    def forward(self, x):
        x = self.inp(x)
        for i, layer in enumerate(self.layers):
            x = layer(x, scale=0.5 if i == 1 else 1.0)  # a plain argument that differs: another kind
        return x.square().mean()


def test_calls_with_different_plain_arguments_are_not_one_kind(monkeypatch):
    said = _same(monkeypatch, _Keyword, _x())
    # layers.1 is traced as code; its sub-blocks are stamped from their own kind
    assert "(layers.0's x2, layers.0.inner.0's x2)" in said


@pytest.mark.parametrize("family", ["llama", "mistral_window", "qwen2"])
def test_hugging_face_decoders_are_stamped_into_the_same_programs(monkeypatch, family):
    transformers = pytest.importorskip("transformers")
    sizes = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    config, model_class = {
        "llama": (lambda: transformers.LlamaConfig(**sizes), transformers.LlamaForCausalLM),
        # a window narrower than the sequence: its mask is not causal, and stays
        "mistral_window": (
            lambda: transformers.MistralConfig(sliding_window=4, **sizes),
            transformers.MistralForCausalLM,
        ),
        "qwen2": (lambda: transformers.Qwen2Config(**sizes), transformers.Qwen2ForCausalLM),
    }[family]

    def build():
        return model_class._from_config(config(), attn_implementation="sdpa")

    ids = _tokens(16, 64)[0]
    # use_cache=False: the causal mask is built from sizes and given to every layer (NOTE: [Causal masks])
    said = _same(monkeypatch, build, (), {"input_ids": ids, "labels": ids, "use_cache": False})
    assert "(model.layers.0's x3)" in said, said
    # a padding mask, from an input: the layers get a mask that depends on an input, as their kind
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    said = _same(monkeypatch, build, (), {"input_ids": ids, "labels": ids, "attention_mask": pad, "use_cache": False})
    assert "(model.layers.0's x3)" in said, said
    # called as Hugging Face documents: each layer writes its keys and values to the cache the forward
    # built (its own slot); the copies write theirs, and its empty start is a constant of each copy
    said = _same(monkeypatch, build, (), {"input_ids": ids, "labels": ids})
    assert "(model.layers.0's x3)" in said, said
    # ...and kept, the cache's tensors are outputs, and the layers' writes to it reach them
    said = _same(monkeypatch, build, (), {"input_ids": ids, "labels": ids, "use_cache": True})
    assert "(model.layers.0's x3)" in said or "stamped" not in said, said


def _hooked(where: str):
    def build():
        model = _Stack(_Index)
        # on the first block, whose call is its kind's traced one
        if where == "forward":
            model.layers[0].register_forward_hook(lambda m, i, o: o * 2.0)
        elif where == "pre":
            model.layers[0].register_forward_pre_hook(lambda m, args: (args[0] * 3.0,))
        else:  # inside the block: its forward runs other ops than the others'
            model.layers[0].fc.register_forward_hook(lambda m, i, o: o - 1.0)
        return model

    return build


@pytest.mark.parametrize("where", ["forward", "pre", "inside"])
def test_a_hook_on_one_block_runs_for_that_block_alone(monkeypatch, where):
    said = _same(monkeypatch, _hooked(where), _x())
    if where == "inside":
        assert "(layers.1's x3)" in said  # layers.0 is a kind of its own, of one call: traced as code
    else:
        assert "(layers.0's x4)" in said  # the block's own hooks run around its stamped call


class _InPlace(nn.Module):
    """torch's RMSNorm adds its epsilon in place: the kind's graph is functionalized, as the model's is."""

    def __init__(self, i: int):
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class _IntoInput(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x.mul_(0.5)  # writes to its argument: a copy of its graph would write to its exemplar's
        return x + self.fc(x)


def test_blocks_with_in_place_ops_on_their_own_values_are_stamped(monkeypatch):
    assert "(layers.0's x4)" in _same(monkeypatch, lambda: _Stack(_InPlace), _x())


def test_blocks_that_write_to_an_argument_are_traced_as_code(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_IntoInput), _x())
    # traced alone, the argument is a leaf that autograd will not let it write to; any other
    # writer to an input is refused after functionalization ("it writes to one of its inputs")
    assert "blocks traced as code: layers.0's kind:" in said and "stamped" not in said


class _Convolved(nn.Module):
    """A convolution over the sequence, then a residual added in place: the gradient a block gets (the
    next block's convolution's input gradient, transposed) is not laid out as the block's output."""

    def __init__(self, i: int):
        super().__init__()
        self.conv = nn.Conv1d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        return self.fc(x).add_(x)


def test_a_gradient_laid_out_otherwise_than_its_blocks_output_is_read_as_the_kind_was_traced(monkeypatch):
    """The kind's backward reshaped its tangent with a `view`, valid for the layout traced (its output's);
    the gradient the next block gave was transposed, and the program failed in its backward ("view size
    is not compatible"). Now each such gradient is copied to the traced layout first."""
    monkeypatch.setenv("FBMT_STAMP", "1")
    torch.manual_seed(0)
    ref = _Stack(_Convolved, n=2)
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    x = torch.randn(2, 7, 16)
    for m in (ref, model):
        m(x).backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    assert "stamped" in _trace_line(model.program)


class _Rotary(nn.Module):
    """A decoder's layer given tables the model computed from constants (its rotary angles)."""

    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, cos, sin):
        return x + self.fc(x * cos + x.flip(-1) * sin)


class _RotaryStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Rotary(i) for i in range(4))

    def forward(self, x):
        angles = torch.arange(16, dtype=torch.float32) / 16
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, angles.cos(), angles.sin())
        return x


def test_a_kind_whose_every_call_gets_tables_from_constants_is_traced_once(monkeypatch):
    # the kind is traced at its first call, for the tables' values (NOTE: [Stamped blocks], step 2): a
    # trace of it without them would be thrown away, the compile time of a block for nothing
    from fbmt.compiler import trace

    kinds = []
    traced = trace._trace_kind
    monkeypatch.setattr(trace, "_trace_kind", lambda mod, kind, *a: kinds.append(kind) or traced(mod, kind, *a))
    said = _same(monkeypatch, _RotaryStack, (torch.randn(2, 16),))
    assert "(layers.0's x4)" in said, said
    assert len({k.id for k in kinds}) == 1 and kinds[0].known, kinds  # one kind traced, for the tables


class _MaskInside(nn.Module):
    """A block that builds a causal mask from sizes itself (decided while its kind is traced) and whose
    RMSNorm writes in place (its kind's graph is functionalized, as the model's is)."""

    def __init__(self, i: int):
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.unsqueeze(1) for t in self.qkv(self.norm(x)).split(d, -1))  # one head
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=causal).squeeze(1)


def test_a_mask_a_block_builds_itself_is_decided_in_its_kind(monkeypatch):
    said = _same(monkeypatch, lambda: _Stack(_MaskInside), (torch.randn(2, 8, 16),))
    assert "(layers.0's x4)" in said and "is causal" in said, said


class _WindowInside(nn.Module):
    """A block that builds a sliding window of 10 from its input's length: causal up to 10 tokens."""

    def __init__(self, i: int):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.unsqueeze(1) for t in self.qkv(x).split(d, -1))  # one head
        ones = torch.ones(s, s, dtype=torch.bool, device=x.device)
        window = ones.tril() & ~ones.tril(-10)
        return x + F.scaled_dot_product_attention(q, k, v, attn_mask=window).squeeze(1)


def _hf_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4)
    config = transformers.LlamaConfig(num_key_value_heads=2, max_position_embeddings=64, **sizes)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


@pytest.mark.parametrize("case", ["gpt", "window-inside", "hf-default"], ids=lambda c: c)
def test_a_program_of_symbolic_sizes_is_stamped_and_computes_what_the_whole_trace_does(monkeypatch, case):
    """The second length makes a program of symbolic sizes (NOTE: [Dynamic sizes]), stamped as a fixed-size
    one is; at every length, unseen ones included, losses and gradients are the whole trace's and eager's. A
    window a block builds from the length is decided in its kind and proved again at every length the
    program admits: at 24 tokens a window of 10 is no longer causal, and that length gets a program of its
    own. Hugging Face's decoder is called as HF documents it (with its cache); its mask at symbolic sizes,
    which each copy gets as an input, is tests/test_masks.py's."""
    window = case == "window-inside"
    build = {
        "gpt": _gpt(3),
        "window-inside": lambda: _Stack(_WindowInside, 3),
        "hf-default": _hf_llama,
    }[case]
    lengths = (8, 9, 10, 24, 13) if window else (8, 12, 16, 11)  # the GPT has 16 positions
    ref = build()

    def batch(n):
        g = torch.Generator().manual_seed(n)
        if case == "gpt":
            return (torch.randint(0, 64, (2, n), generator=g),), {}, lambda out: out.float().square().mean()
        if case.startswith("hf"):
            ids = torch.randint(0, 64, (2, n), generator=g)
            return (), {"input_ids": ids, "labels": ids}, lambda out: out.loss
        return (torch.randn(2, n, 16, generator=g),), {}, lambda out: out

    got = {}
    for stamp in (False, True):
        monkeypatch.setenv("FBMT_STAMP", "1" if stamp else "0")
        model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
        got[stamp] = []
        for n in lengths:
            args, kwargs, loss_of = batch(n)
            loss = loss_of(model(*args, **kwargs))
            loss.backward()
            got[stamp].append((loss.detach(), model.full_gradients()))
            model.zero_grad()
        symbolic = [p for p in model.programs.values() if p.sizes is not None]
        assert symbolic and all(("stamped" in _trace_line(p)) == stamp for p in symbolic), [
            _trace_line(p) for p in symbolic
        ]
        if window:  # 8; 9, 10 and 13; 24
            assert len(model.programs) == 3 and "is causal" in _trace_line(symbolic[0]), model.programs
    for n, (loss, grads), (whole_loss, whole_grads) in zip(lengths, got[True], got[False]):
        args, kwargs, loss_of = batch(n)
        want = loss_of(ref(*args, **kwargs))
        want.backward()
        torch.testing.assert_close(loss, whole_loss, rtol=1e-6, atol=1e-7, msg=f"length {n}")
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=f"length {n}")
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], whole_grads[name], rtol=1e-6, atol=1e-7, msg=f"{name} at {n}")
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=f"{name} at {n}")
        ref.zero_grad()


class _Attention(nn.Module):
    def __init__(self, i: int = 0):
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return x + self.out(a)


class _TwoLengths(nn.Module):
    """Layers of one class on two sequences whose lengths vary apart (an encoder's and a decoder's)."""

    def __init__(self):
        super().__init__()
        self.inx, self.iny = nn.Linear(16, 16), nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Attention() for _ in range(4))

    def forward(self, x, y):
        x, y = self.inx(x), self.iny(y)
        for i, layer in enumerate(self.layers):
            if i % 2:
                y = layer(y)
            else:
                x = layer(x)
        return x.square().mean() + y.abs().mean()


def test_layers_on_two_lengths_that_vary_apart_are_kinds_of_their_own():
    """In a program of symbolic sizes the calls on each sequence have sizes in its own symbol: a copy of
    the other's kind would compute at the other length. Every pair, equal lengths too, is eager's."""
    torch.manual_seed(0)
    ref = _TwoLengths()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for a, b in [(8, 12), (9, 14), (13, 7), (10, 10)]:
        g = torch.Generator().manual_seed(100 * a + b)
        x, y = torch.randn(2, a, 16, generator=g), torch.randn(2, b, 16, generator=g)
        step_matches(model, ref, x, y, msg=f"lengths {a}, {b}")
        ref.zero_grad()
        model.zero_grad()
    symbolic = [p for p in model.programs.values() if p.sizes is not None]
    assert len(model.programs) == 2 and "stamped their calls (layers.0's x2, layers.1's x2)" in _trace_line(
        symbolic[0]
    ), [_trace_line(p) for p in model.programs.values()]


class _Repeated(nn.Module):
    """One layer object repeated in the list: it is no block of its own, and is left as it was."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 16)
        act = nn.Tanh()
        self.layers = nn.ModuleList([act, act, act])

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _no_wrapper_left(model: nn.Module) -> bool:
    from fbmt.compiler.stamp import _Bound

    return not any(isinstance(vars(m).get("forward"), _Bound) for m in model.modules())


def test_a_layer_repeated_in_its_list_is_not_stamped_and_keeps_its_forward(monkeypatch):
    built = []

    def build():
        built.append(_Repeated())
        return built[-1]

    assert "stamped" not in _same(monkeypatch, build, _x())
    assert all(_no_wrapper_left(m) for m in built)


def test_no_block_keeps_a_wrapper_after_a_trace(monkeypatch):
    model = _Stack(_Index)
    assert "stamped" in _trace_line(_program(monkeypatch, True, lambda: model, _x()))
    assert _no_wrapper_left(model)


class _Scaled(nn.Module):
    """Blocks whose ops are the same but for a scalar each keeps (a per-layer scale)."""

    def __init__(self, i: int):
        super().__init__()
        self.scale = 1.0 + i % 2
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x) * self.scale


def test_a_scalar_that_differs_between_blocks_splits_their_kind(monkeypatch):
    # a kind of layers 0 and 2 and one of 1 and 3: a copy with another block's scalar would train wrong
    said = _same(monkeypatch, lambda: _Stack(_Scaled), _x())
    assert "(layers.0's x2, layers.1's x2)" in said, said


class _Notes:
    """An object the blocks write to, as Hugging Face's layers write to the cache the forward built."""

    def __init__(self, n: int, lock: bool = False):
        self.slots = [None] * n
        self.count = 0
        if lock:  # what copy.deepcopy refuses
            self.lock = threading.Lock()


class _Noting(nn.Module):
    """Writes a tensor to its own slot and counts; `share`: adds a tensor the forward put in the object
    (as models that share keys and values across layers read another layer's)."""

    def __init__(self, i: int, share: bool = False):
        super().__init__()
        self.i, self.share = i, share
        self.fc = nn.Linear(16, 16)

    def forward(self, x, notes):
        y = x + F.silu(self.fc(x))
        if self.share:
            y = y + notes.base
        notes.slots[self.i] = y * 2
        notes.count += 1
        return y


class _NotingStack(nn.Module):
    def __init__(self, share: bool = False, read: bool = False, lock: bool = False, n: int = 4):
        super().__init__()
        self.read, self.lock = read, lock
        self.inp = nn.Linear(16, 16)
        self.layers = nn.ModuleList(_Noting(i, share) for i in range(n))

    def forward(self, x):
        notes = _Notes(len(self.layers), self.lock)
        x = self.inp(x)
        notes.base = x.tanh()
        for layer in self.layers:
            x = layer(x, notes)
        loss = x.square().mean()
        if self.read:  # what the blocks wrote reaches the loss: their copies' writes need a gradient
            loss = loss + sum(s.mean() for s in notes.slots)
        return loss + notes.count


def test_blocks_that_write_to_an_object_the_forward_built_are_stamped(monkeypatch):
    assert "(layers.0's x4)" in _same(monkeypatch, _NotingStack, _x())


def test_what_stamped_blocks_wrote_to_an_object_keeps_its_gradient(monkeypatch):
    # a copy's writes get a gradient its kind's trace did not give them: the trace runs again whole
    # (were they cut from the graph, the loss would lose their part of the gradient without a word)
    said = _same(monkeypatch, lambda: _NotingStack(read=True), _x())
    assert "stamped" not in said, said


def test_blocks_that_read_a_tensor_an_object_holds_are_traced_as_code(monkeypatch):
    # a copy of the object would hold another tensor than the one each call read
    said = _same(monkeypatch, lambda: _NotingStack(share=True), _x())
    assert "stamped" not in said, said


def test_blocks_given_an_object_that_cannot_be_copied_are_traced_as_code(monkeypatch):
    # the kind's trace needs a copy of the object as its exemplar got it
    said = _same(monkeypatch, lambda: _NotingStack(lock=True), _x())
    assert "stamped" not in said, said


@dataclasses.dataclass(frozen=True)
class _Frozen:
    slot: Any = None


class _IntoFrozen(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x, box):
        y = x + self.fc(x)
        object.__setattr__(box, "slot", y * 2)  # a write setattr would refuse
        return y


class _FrozenStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(_IntoFrozen(i) for i in range(3))

    def forward(self, x):
        box = _Frozen()
        for layer in self.layers:
            x = layer(x, box)
        return x.square().mean()


def test_blocks_writing_to_an_object_that_refuses_setattr_are_traced_as_code(monkeypatch):
    # a copy of the object as the exemplar got it, and each copy's write, go through setattr
    said = _same(monkeypatch, _FrozenStack, _x())
    assert "stamped" not in said, said


@pytest.mark.parametrize("view", [torch.ops.aten.detach.default, torch.ops.aten.alias.default])
def test_a_kinds_trace_that_detaches_or_aliases_an_input_first_is_stamped_reading_the_input(view):
    """torch 2.13's trace of a kind that writes to its own values detaches an input before the block's first
    op; 2.14's and later ones alias it. Either is the input's value: the copies read the call's argument."""
    g = fx.Graph()
    x, w, tangent = g.placeholder("x"), g.placeholder("w"), g.placeholder("tangent")
    first = g.call_function(view, (x,))
    out = g.call_function(torch.ops.aten.mul.Tensor, (first, w))
    out.meta["fbmt_module"] = "layers.0"
    grad = g.call_function(torch.ops.aten.mul.Tensor, (tangent, w))
    g.output([out, grad])
    kind = stamping.Kind(0, "layers.0", nn.Identity(), [], [], [], None, [], None, [], True, [])
    assert stamping.split_kind(kind, g, n_outputs=1, wrt=[0]) is None
    assert kind.prelude == [first] and kind.forward == [out] and kind.backward == [grad]
    assert kind.outputs == [out] and kind.grads == [grad]


def test_without_autograds_node_numbers_t5_is_stamped_all_the_same(monkeypatch):
    """A torch without `_get_sequence_nr` tells no results apart by their readers: the ones a layer
    passes on as it got them still go around the op, so T5's layers are still one kind."""
    monkeypatch.setattr(stamping, "_next_node_number", None)
    _t5_stamped_trains_as_in_eager()
