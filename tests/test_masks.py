"""Attention masks that depend on sizes alone (NOTE: [Causal masks] in fbmt/compiler/masks.py): a mask
that is exactly causal becomes `is_causal=True`, one that attends everywhere is dropped, and every other
(a padding mask from the inputs, a sliding window, a bidirectional one) is kept; results equal eager's
either way, and the program's summary says what became of each mask."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import fbmt
from tests.dist import run_ranks
from tests.models import hf


class _Attention(nn.Module):
    """One attention over a mask built from sizes (or, `"input"`, from the input's values)."""

    def __init__(self, mask: str):
        super().__init__()
        self.mask = mask
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: torch.Tensor, kv_extra: int = 0) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        k, v = torch.cat([k[:, :, :kv_extra], k], 2), torch.cat([v[:, :, :kv_extra], v], 2)
        s = k.shape[2]
        i, j = torch.arange(n, device=x.device)[:, None], torch.arange(s, device=x.device)[None, :]
        masks = {
            "bool": lambda: j <= i,  # top-left causal: what is_causal means
            "float-inf": lambda: torch.zeros(n, s).masked_fill(j > i, float("-inf")),
            "float-min": lambda: torch.zeros(b, 1, n, s).masked_fill(j > i, torch.finfo(torch.float32).min),
            "all": lambda: torch.ones(b, 1, n, s, dtype=torch.bool),
            "window": lambda: (j <= i) & (i - j < 3),
            "bottom-right": lambda: j <= i + (s - n),  # causal as a cache extends it: not is_causal's
            "input": lambda: (j <= i) & (x[:, None, :, :1] > -100),  # true everywhere, but read from x
            "scaled": lambda: torch.zeros(n, s).masked_fill(j > i, -5.0),  # a bias, not a mask
        }
        return F.scaled_dot_product_attention(q, k, v, attn_mask=masks[self.mask]())


_EXPECT = {
    "bool": "is causal",
    "float-inf": "is causal",
    "float-min": "is causal",
    "all": "attends everywhere",
    "window": "kept (not causal",
    "bottom-right": "kept (not causal",
    "input": "kept (it depends on an input",
    "scaled": "kept (additive values",
}


@pytest.mark.parametrize("mask", list(_EXPECT))
def test_a_mask_is_rewritten_only_where_it_is_provably_causal_or_attends_everywhere(mask):
    torch.manual_seed(0)
    ref = _Attention(mask)
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for kv_extra in (0, 2):  # a square attention, and one with more keys than queries
        x = torch.randn(2, 7, 16, requires_grad=True)
        want = ref(x, kv_extra)
        got = model(x, kv_extra)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        g = torch.randn_like(want)
        torch.testing.assert_close(torch.autograd.grad(got, x, g)[0], torch.autograd.grad(want, x, g)[0])
        summary = str(model.program).splitlines()
        said = next(line for line in summary if line.startswith("# pass trace"))
        square_causal = mask == "bottom-right" and kv_extra == 0  # bottom-right and top-left agree there
        expect = "is causal" if square_causal else _EXPECT[mask]
        assert expect in said, said
        attention = [n for n in model.program.graph.nodes if "scaled_dot_product" in str(n.target)]
        first = attention[0]  # the forward's: a tensor beside query, key and value is the mask
        has_mask = any(isinstance(a, torch.fx.Node) for a in [*first.args[3:], *first.kwargs.values()])
        assert has_mask == ("kept" in expect), (mask, first.args, first.kwargs)
        named = said.split("attention mask ")[1].split(" ")[0]  # the mask's node, erased once nothing reads it
        assert (named in {n.name for n in model.program.graph.nodes}) == ("kept" in expect), named


def _built(config: transformers.PretrainedConfig) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _mistral_window() -> transformers.PreTrainedModel:
    config = hf.config("mistral")
    config.sliding_window = 4  # narrower than the 8 tokens
    return _built(config)


_MODELS = {
    "llama": lambda: hf.build("llama"),
    "qwen2": lambda: hf.build("qwen2"),
    "mistral-window": _mistral_window,
    # global and sliding-window layers alternate: one mask of each
    "gemma3": lambda: _built(
        transformers.Gemma3TextConfig(
            **hf.DECODER,
            head_dim=8,
            sliding_window=4,
            vocab_size=hf.VOCAB,
            layer_types=["sliding_attention", "full_attention"],
        )
    ),
}


def _trains_with_use_cache_off(rank: int, world: int, name: str, padded: bool) -> None:
    ref = _MODELS[name]()
    model = fbmt.compile(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(2):
        kwargs = dict(hf.inputs("llama", step), use_cache=False)  # input_ids and labels, as every decoder takes
        if padded:
            mask = torch.ones_like(kwargs["input_ids"])
            mask[0, :3] = 0  # left padding, as batched generation and some collators make it
            kwargs["attention_mask"] = mask
        want = ref(**kwargs).loss  # the whole batch
        got = model(**{k: fbmt.local_part(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}).loss
        want.backward()
        got.backward()
        mean = got.detach().clone()
        torch.distributed.all_reduce(mean)  # every rank's part holds as many tokens: the mean of means
        torch.testing.assert_close(mean / world, want.detach(), rtol=1e-5, atol=1e-6)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)
    said = next(line for line in str(model.program).splitlines() if line.startswith("# pass trace"))
    if padded:
        assert "is causal" not in said and "kept (it depends on an input" in said, said
    elif name == "mistral-window":
        assert "is causal" not in said and "kept (not causal" in said, said
    elif name == "gemma3":
        assert "is causal" in said and "kept (not causal" in said, said
    else:  # and its two key/value heads are read once for the four query heads (NOTE: [Grouped heads])
        assert "is causal" in said and "read their key/value heads once" in said, said


@pytest.mark.parametrize("name", list(_MODELS))
def test_hugging_face_decoders_with_use_cache_off_train_as_eager_on_the_causal_kernel(name):
    """transformers builds the causal mask as a tensor when use_cache=False; it becomes is_causal=True
    where it is causal, and a sliding window narrower than the sequence keeps its mask."""
    run_ranks(2, _trains_with_use_cache_off, name, False)


def test_a_padding_mask_keeps_its_mask():
    run_ranks(2, _trains_with_use_cache_off, "llama", True)


def test_a_symbolic_program_proves_its_causal_mask_again_at_every_size_it_admits():
    """A sliding window of 16 is causal at the traced length 10, and not at 24: the program of symbolic
    sizes rewrote the mask for 10 and 12, refuses 24 (naming the mask), and a program that keeps the mask
    takes 24; every loss and gradient is eager's."""
    config = hf.config("mistral")
    config.sliding_window = 16
    ref = _built(config)
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (8, 10, 12, 24, 14):
        ids = torch.randint(3, hf.VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        want = ref(input_ids=ids, labels=ids, use_cache=False).loss
        got = model(input_ids=ids, labels=ids, use_cache=False).loss
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        want.backward()
        got.backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    programs = list(model.programs.values())
    assert [p.sizes is not None for p in programs] == [False, True, True]  # 8; 10 and 12 (and 14); 24
    causal, kept = programs[1], programs[2]
    assert "is causal" in causal.summary("trace") and "kept (not causal" in kept.summary("trace")
    # its layers are stamped, each copy given the mask the model built (NOTE: [Stamped blocks]): the kind
    # proves it through the mask's graph of the sizes
    assert "stamped their calls (model.layers.0's x2)" in causal.summary("trace"), causal.summary("trace")
    at_24 = [torch.zeros(2, 24, dtype=torch.long)] * 2
    assert "attention mask" in causal.sizes.admits(at_24) and causal.sizes.admits([at_24[0][:, :14]] * 2) is None


def _repeat_kv(x: torch.Tensor, r: int) -> torch.Tensor:  # transformers' repeat_kv, written out
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, r, s, d).reshape(b, h * r, s, d)


_REPEATS = {
    "repeat_kv": _repeat_kv,
    "repeat_interleave": lambda x, r: torch.repeat_interleave(x, r, dim=1),
    "tiled": lambda x, r: x.repeat(1, r, 1, 1),  # head h reads key head h % H: not grouped heads
    "tiled-by-expand": lambda x, r: x[:, None].expand(x.shape[0], r, *x.shape[1:]).flatten(1, 2),  # the same
}


class _Grouped(nn.Module):
    """Four query heads over two key/value heads, repeated for SDPA as transformers does where it passes a
    mask; the mask built from sizes."""

    def __init__(self, repeat: str, mask: str, variant: str = ""):
        super().__init__()
        self.repeat, self.mask, self.variant = repeat, mask, variant
        self.q, self.kv = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q(x).view(b, n, 4, 4).transpose(1, 2)
        kv = self.kv(x).view(b, n, 2, 2, 4).permute(2, 0, 3, 1, 4).clone()
        k, v = kv
        if self.variant == "wide value":  # values of another head size than keys': SDPA's fused kernels take none
            v = torch.cat([v, v.flip(-1)], -1)
        k, v = _REPEATS[self.repeat](k, 2), _REPEATS[self.repeat](v, 2)
        if self.variant == "written after":  # the keys and values change, their copies do not
            kv.mul_(3.0)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        mask = {"none": None, "causal": j <= i, "window": (j <= i) & (i - j < 3)}[self.mask]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize(
    "mask, variant",
    [("none", ""), ("causal", ""), ("window", ""), ("causal", "wide value"), ("causal", "written after")],
)
@pytest.mark.parametrize("repeat", list(_REPEATS))
def test_repeated_key_value_heads_are_read_once_where_sdpa_takes_grouped_heads(repeat, mask, variant):
    """NOTE: [Grouped heads]: SDPA reads the key/value heads themselves (enable_gqa) where the call ends
    up without a mask and they repeat each head in turn; a tiling of the heads (another attention), a
    kept mask, a call whose grouped heads would run on SDPA's math kernel, and keys and values written in
    place after the repeat (the copies hold the old values) keep the copies; eager's results every way."""
    torch.manual_seed(0)
    ref = _Grouped(repeat, mask, variant)
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    x = torch.randn(2, 7, 16)
    g = torch.randn(2, 4, 7, 8 if variant == "wide value" else 4)
    outs, xs = [], []
    for m in (model, ref):  # the parameters' gradients compared as one SGD step applies them
        xs.append(x.clone().requires_grad_())
        outs.append(m(xs[-1]))
        outs[-1].backward(g)
        torch.optim.SGD(m.parameters(), lr=1.0).step()
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-5, atol=1e-6, msg=k)
    grouped = not repeat.startswith("tiled") and mask != "window" and not variant
    attention = [n for n in model.program.graph.nodes if "scaled_dot_product" in str(n.target)]
    if attention:  # (values wider than keys: the host's math, written out as products)
        assert attention[0].args[1].meta["val"].shape[1] == (2 if grouped else 4), attention[0].format_node()
    said = [line for line in str(model.program).splitlines() if line.startswith("# pass trace")]
    assert any("read their key/value heads once" in line for line in said) == grouped, said
    if grouped:  # the repeats are erased with the rewrite
        copies = [n for n in model.program.graph.nodes if n.target is torch.ops.aten.expand.default]
        assert not copies, copies
