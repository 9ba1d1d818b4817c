"""One program for many sequence lengths (NOTE: [Dynamic sizes]): symbolic sizes equal eager at
lengths never traced, a guard that fails compiles anew instead of computing wrong, dynamic=False
keeps a program per shape."""

from __future__ import annotations

import copy
import logging
import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from tests.dist import run_ranks
from tests.models import hf
from tests.models.reference import Llama

LENGTHS = [16, 24, 16, 40, 128, 57, 33, 96, 16, 71]  # 16-128, most never seen before they arrive


def _batch(step: int, length: int, rank: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of 4 sequences (rank r's half: 2), the same on every rank: inputs and
    targets are views of one token tensor, shifted by one, so their strides vary with the length."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 64, (4, length + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return (x, y) if rank is None else (x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])


def _gradients_match_and_clear(model: nn.Module, ref: nn.Module, length: int) -> None:
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"{name} at length {length}")
        p.grad = None
    for p in model.parameters():
        p.grad = None


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def _model() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=128, n_layer=2, n_head=2, d_model=16))  # positions up to 128


def _train_ranks(rank: int, world: int) -> dict:
    model = fbmt.compile(_model(), cache_dir=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, length in enumerate(LENGTHS):
        x, y = _batch(step, length, rank)
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    symbolic = [p for p in model.programs.values() if p.sizes is not None]
    return {
        "losses": losses,
        "params": model.full_parameters(),
        "programs": len(model.programs),
        "symbolic": str(symbolic[0]).splitlines()[:4] if symbolic else None,
    }


def test_a_stream_of_lengths_on_two_ranks_compiles_two_programs_and_trains_as_eager():
    """SGD: Adam would turn rounding-level gradients (the key bias's, zero in exact arithmetic) into
    steps of the learning rate's size, in eager as much as here."""
    got = run_ranks(2, _train_ranks)
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step, length in enumerate(LENGTHS):
        x, y = _batch(step, length)
        loss = _loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert [r["programs"] for r in got] == [2, 2]  # length 16, then one for every other length
    assert any("symbolic sizes: input 0 dim 1" in line for line in got[0]["symbolic"]), got[0]["symbolic"]
    both = (torch.tensor(got[0]["losses"]) + torch.tensor(got[1]["losses"])) / 2
    torch.testing.assert_close(both, torch.tensor(losses), rtol=1e-4, atol=1e-5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


# (sequences per rank, length); 100: past four times 16, within the bound of the program of lengths
SHAPES = [(2, 16), (2, 24), (3, 16), (4, 40), (3, 20), (2, 33), (3, 100)]
EVALUATED = [(2, 20), (3, 28), (4, 12)]


def _hf_shapes(rank: int | None, shapes: list[tuple[int, int]], seed: int = 0) -> list[dict]:
    """Each step's call of a stream whose batch size varies as well as its length (evaluation at another
    batch size, a last batch cut short): rank r's half, or (None) the whole batch."""
    calls = []
    for step, (per_rank, length) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed + step)
        ids = torch.randint(3, hf.VOCAB, (2 * per_rank, length), generator=g)
        part = ids if rank is None else ids[rank * per_rank : (rank + 1) * per_rank]
        calls.append({"input_ids": part, "labels": part})
    return calls


def _train_and_evaluate(model: nn.Module, rank: int | None) -> tuple[list[float], list[float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for call in _hf_shapes(rank, SHAPES):
        loss = model(**call).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        evaluated = [model(**call).loss.item() for call in _hf_shapes(rank, EVALUATED, seed=100)]
    return losses, evaluated


def _train_hf_shapes(rank: int, world: int) -> dict:
    model = fbmt.compile(hf.build("llama"), cache_dir=False)
    losses, evaluated = _train_and_evaluate(model, rank)
    sizes = [str(p.sizes) for p in model.programs.values()]
    return {"losses": losses, "evaluated": evaluated, "params": model.full_parameters(), "sizes": sizes}


def test_batches_of_other_sizes_and_lengths_on_two_ranks_compile_three_programs_and_train_as_eager():
    """The first shape's program, one symbolic in the length, then, at the first batch of another size, one
    symbolic in both the batch and the length (every earlier program counts in what varies), which serves
    every later shape: three programs, where comparing with the first program alone made a fourth. It admits
    the lengths the program before it admitted (up to 128, traced at 24), though traced at 16. The
    evaluation that follows (no gradients, eval mode) takes what varied in training as symbols at its first
    call: one program for its three shapes, not two."""
    got = run_ranks(2, _train_hf_shapes)
    ref = hf.build("llama")
    losses, evaluated = _train_and_evaluate(ref, None)
    assert [len(r["sizes"]) for r in got] == [4, 4], got[0]["sizes"]
    assert all("input 0 dim 0" in got[0]["sizes"][i] and "input 0 dim 1" in got[0]["sizes"][i] for i in (2, 3))
    for mine, want in (("losses", losses), ("evaluated", evaluated)):
        both = (torch.tensor(got[0][mine]) + torch.tensor(got[1][mine])) / 2
        torch.testing.assert_close(both, torch.tensor(want), rtol=1e-4, atol=1e-5, msg=mine)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[0]["params"][name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_hugging_face_llama_with_padding_masks_at_unseen_lengths_matches_eager(backend):
    """As a data collator pads: each batch to its longest sequence, the rest masked, labels -100."""
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, backend=backend)
    rng, compiled = random.Random(0), []
    for step, length in enumerate([12, 20, 9, 31, 64, 17]):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(3, hf.VOCAB, (3, length), generator=g)
        mask = torch.ones_like(ids)
        mask[1, rng.randint(2, length - 1) :] = 0  # one shorter sequence, padded on the right
        labels = ids.masked_fill(mask == 0, -100)
        kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
        out, want = model(**kwargs), ref(**kwargs)
        out.loss.backward()
        want.loss.backward()
        torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
        _gradients_match_and_clear(model, ref, length)
        compiled.append(model.regions.misses)
    assert len(model.programs) == 2, list(model.programs)
    assert compiled[2:] == [compiled[1]] * 4, compiled  # Inductor: nothing compiled after the second length


def _one_symbolic_program_trains_as_eager(ref: nn.Module, lengths: list[int], caplog) -> None:
    """A causal LM at `lengths`: eager's loss and gradients at each, two programs (the first length's, then
    one of symbolic sizes), and no warning (a fallback to a program per length warns)."""
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    with caplog.at_level("WARNING"):
        for step, length in enumerate(lengths):
            ids = torch.randint(3, hf.VOCAB, (2, length), generator=torch.Generator().manual_seed(step))
            out, want = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
            out.loss.backward()
            want.loss.backward()
            torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
            _gradients_match_and_clear(model, ref, length)
    assert len(model.programs) == 2 and list(model.programs.values())[1].sizes is not None, list(model.programs)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_hugging_face_bloom_adds_its_alibi_bias_with_baddbmm_in_one_program_for_every_length(caplog):
    """Bloom's attention adds its ALiBi bias, one row for all queries, as `alibi.baddbmm(q, k)`: torch's
    meta kernel broadcasts that row with `expand` on symbolic sizes, which fails, and the model fell back
    to a program per length (and torch logged the traceback)."""
    config = transformers.BloomConfig(vocab_size=hf.VOCAB, hidden_size=32, n_layer=2, n_head=4)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _one_symbolic_program_trains_as_eager(ref, [8, 11, 9, 14], caplog)


def test_a_linear_attention_of_triangular_solves_has_one_program_for_every_length(caplog):
    """Qwen3-Next's gated delta rule (also Qwen3.5's) solves triangular systems over its chunks: torch's
    meta kernel of `linalg_solve_triangular` fails at symbolic sizes, and the model fell back to a program
    per length, torch logging the traceback. Its merged projections' gradients then met a merge pass that
    hashed symbolic shapes."""
    config = transformers.Qwen3NextConfig(
        **hf.DECODER,
        vocab_size=hf.VOCAB,
        head_dim=8,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config)
    _one_symbolic_program_trains_as_eager(ref, [12, 16, 24, 7], caplog)


def test_llama4s_complex_rotary_embedding_has_one_program_for_every_length(caplog):
    """Llama 4 makes its rotary embedding with `torch.polar`, whose fake kernel (and `complex`'s) fixed the
    length to the traced one: the model compiled a program per length."""
    config = transformers.Llama4TextConfig(
        **hf.DECODER,
        vocab_size=hf.VOCAB,
        head_dim=8,
        intermediate_size_mlp=64,
        num_local_experts=4,
    )
    torch.manual_seed(0)
    _one_symbolic_program_trains_as_eager(
        transformers.AutoModelForCausalLM.from_config(config), [12, 16, 24, 7], caplog
    )


def test_products_that_read_one_input_merge_in_a_program_of_symbolic_sizes_as_in_one_of_exact_sizes():
    """The merge pass (NOTE: [Merged products]) re-derived a slice's views with a symbolic size's node
    among their sizes, which failed, so a program of symbolic sizes merged nothing; merged, its gradients'
    view back to the input's shape held the size as a bare symbol, which the program could not run."""
    torch.manual_seed(0)
    ref = Llama()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, remat="none")
    for step, length in enumerate([8, 12, 10, 14]):
        x, y = _batch(step, length)
        _loss(model(x), y).backward()
        _loss(ref(x), y).backward()
        _gradients_match_and_clear(model, ref, length)
    exact, symbolic = model.programs.values()
    merged = [(len(p.stats("merge").runs), p.stats("merge").gradients) for p in (exact, symbolic)]
    # as many runs (q and k, or with v where torch 2.11's symbolic attention does not save it) and gradients
    assert symbolic.sizes is not None and merged == [(4, 4), (4, 4)], merged


def _saved_bytes(out: torch.Tensor) -> int:
    """Bytes the program keeps from its forward for its backward (each storage once)."""
    saved = [t for t in out.grad_fn.saved if isinstance(t, torch.Tensor)]  # and sizes, as ints
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(storages.values())


def test_a_program_of_symbolic_sizes_decides_what_to_save_at_the_largest_size_it_admits():
    """Under remat="block" the last blocks keep their activations while they weigh less than the gradients
    (NOTE: [Trailing blocks]). A program traced at 24 tokens kept them, and at 128 tokens held more for its
    backward than the program of exactly 128 does. It now admits up to 4 x 24 = 96 -> 128 tokens and decides
    there; a longer call compiles a program of its own."""

    def build(dynamic: bool) -> nn.Module:
        torch.manual_seed(0)
        gpt = GPT(GPTConfig(vocab_size=64, seq_len=256, n_layer=4, n_head=2, d_model=64))
        return fbmt.compile(gpt, world_size=1, cache_dir=False, remat="block", dynamic=dynamic)

    exact, model = build(False), build(True)
    held = {}
    for length in (16, 24, 128, 200):
        x, y = _batch(0, length)
        for name, m in (("symbolic", model), ("exact", exact)) if length == 128 else (("symbolic", model),):
            out = m(x)
            held[name, length] = _saved_bytes(out)
            _loss(out, y).backward()
    assert held["symbolic", 128] <= held["exact", 128], held
    programs = list(model.programs.values())
    assert [str(p.sizes).split("(")[1].split(")")[0] for p in programs[1:]] == [
        "traced at 24, at most 128",
        "traced at 200, at most 1024",
    ], [str(p.sizes) for p in programs]


class Branches(nn.Module):
    """A forward whose Python control flow reads the length: the program assumes a side of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h.cumsum(1) if x.shape[1] > 20 else h * 2


def test_a_size_the_program_does_not_admit_gets_its_own_program_not_a_wrong_result():
    torch.manual_seed(0)
    ref = Branches()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (8, 12, 16, 24, 30, 5):
        x = torch.randn(2, length, 4)
        torch.testing.assert_close(model(x), ref(x), msg=f"length {length}")
    symbolic = [p for p in model.programs.values() if p.sizes is not None]
    assert len(symbolic) == 2, [str(p.sizes) for p in model.programs.values()]  # one each side of 20
    assert "s" in str(symbolic[0].sizes) and "20" in str(symbolic[0].sizes)  # what it assumed, printed
    assert symbolic[0].sizes.admits([torch.randn(2, 24, 4)]) is not None  # and why a length is refused


def test_dynamic_false_compiles_a_program_per_shape():
    torch.manual_seed(0)
    model = fbmt.compile(Branches(), world_size=1, cache_dir=False, dynamic=False)
    for length in (8, 12, 16):
        model(torch.randn(2, length, 4))
    assert len(model.programs) == 3 and all(p.sizes is None for p in model.programs.values())


def test_with_inductor_regions_compile_once_for_every_length_and_equal_eager():
    """NOTE: [Symbolic regions]: after the first two lengths (a program per shape, then one of
    symbolic sizes), lengths never seen before compile nothing, and every one equals eager."""
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=64, seq_len=128, n_layer=1, n_head=2, d_model=16))
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, backend="inductor")
    compiled = []
    for step, length in enumerate((16, 24, 40, 24, 97, 33)):
        x, y = _batch(step, length)
        loss, want = _loss(model(x), y), _loss(ref(x), y)
        loss.backward()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
        _gradients_match_and_clear(model, ref, length)
        compiled.append(model.regions.misses)
    assert len(model.programs) == 2
    assert compiled[1] > compiled[0] and compiled[1:] == [compiled[1]] * 5, compiled
    # size arithmetic (`s0 * 4` for a view) stays inside a region: the symbolic program's regions are
    # the static one's, not cut at every size it computes
    from fbmt.compiler.runtime.regions import Region

    counts = [
        sum(isinstance(m, Region) for gm in (exe.forward, exe.backward) for m in gm.modules())
        for exe in model.executables()
    ]
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "left-padded"])
def test_generate_with_the_default_cache_compiles_a_prompt_program_and_one_for_every_next_token(masked):
    """The cache passed back in is one token longer at each step (NOTE: [A cache that grows]): the first step
    with a cache is traced with its length symbolic, and the mask's (left padding, as a tokenizer pads a
    batch for generation), and serves every later step, up to the model's longest position: 40 tokens after
    a prompt of 5 once took a third program past four times the traced length."""
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    prompt = torch.randint(3, hf.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    call = {"input_ids": prompt}
    if masked:
        call["attention_mask"] = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    how = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    want, got = ref.generate(**call, **how), model.generate(**call, **how)
    assert torch.equal(got, want)
    # the prompt's program, then one for every next token
    assert [p.sizes is not None for p in model.programs.values()] == [False, True]
    symbolic = next(p for p in model.programs.values() if p.sizes is not None)
    # the length of the keys and values of 2 layers, and the mask's (its dimension 1)
    assert sorted(d for _, d in symbolic.sizes.symbols) == [1] * masked + [2] * 4, symbolic.sizes.symbols
    assert f"at most {ref.config.max_position_embeddings})" in str(symbolic.sizes)


class SizeKeyed(nn.Module):
    """A forward that keeps a table per length, keyed by the size: it needs sizes as numbers."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scales = {n: float(n) ** -0.5 for n in range(1, 64)}

    def forward(self, x):
        return self.lin(x) * self.scales[x.shape[1]]


def test_a_forward_that_needs_numeric_sizes_gets_a_program_per_shape_and_a_warning(caplog):
    torch.manual_seed(0)
    ref = SizeKeyed()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    with caplog.at_level("WARNING", logger="fbmt"):
        for length in (8, 12, 16, 12):
            x = torch.randn(2, length, 4)
            torch.testing.assert_close(model(x), ref(x), msg=f"length {length}")
    assert len(model.programs) == 3 and all(p.sizes is None for p in model.programs.values())
    said = [r.getMessage() for r in caplog.records if "cannot be traced with symbolic sizes" in r.getMessage()]
    assert len(said) == 1, said  # tried once, then a program per shape


def test_a_forward_that_fixes_the_size_is_said_once_with_where_and_not_traced_symbolically_again(caplog):
    """A size read as a number makes the symbolic trace a program of one shape: fbmt says where,
    once, and the later shapes compile plain programs instead of symbolic attempts."""
    torch.manual_seed(0)
    ref = UsesSize("tensor of the size")
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    with caplog.at_level("WARNING", logger="fbmt"):
        for length in (8, 12, 16, 30, 12):
            x = torch.randn(2, length, 4)
            torch.testing.assert_close(model(x), ref(x), msg=f"length {length}")
    said = [r.getMessage() for r in caplog.records if "fixes the size that varies" in r.getMessage()]
    assert len(said) == 1 and "input 0 dimension 1 made 12 at" in said[0], said
    assert "test_dynamic.py" in said[0] and "torch.tensor(T" in said[0], said  # the line of the model's code
    assert [p.sizes is not None for p in model.programs.values()] == [False, True, False, False]


class Products(nn.Module):
    """Every way a model multiplies: linear with and without a bias on 3-d and 2-d inputs, on a
    non-contiguous view, `@` of 4-d by 4-d, 3-d by 2-d and 2-d by 3-d, and `torch.matmul` by a vector."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4, bias=False), nn.Linear(4, 4)
        self.w = nn.Parameter(torch.randn(4, 4) / 2)
        self.v = nn.Parameter(torch.randn(4))

    def forward(self, x):
        h = self.b(self.a(x))  # (2, T, 4)
        h = h + self.c(h.transpose(0, 1)).transpose(0, 1) + self.a(h[:, 0])[:, None]
        q = h.view(2, -1, 2, 2).transpose(1, 2)  # (2, 2, T, 2)
        h = h + (torch.softmax(q @ q.transpose(-1, -2), -1) @ q).transpose(1, 2).reshape(h.shape)
        h = (h @ self.w) + (self.w[:2] @ h.transpose(1, 2)).sum(1)[..., None]
        return h + torch.matmul(h, self.v)[..., None]


def test_products_keep_sizes_symbolic_where_torch_matmul_kernel_would_fix_them(monkeypatch):
    """torch 2.11's matmul kernel reads sizes as numbers (NOTE: [Matmul on symbolic sizes]); the
    Python route it takes there is forced here, on any torch: one program for every length, equal
    to eager in values and gradients."""
    from fbmt.compiler import sizes

    monkeypatch.setattr(sizes, "_matmul_fixes_sizes", lambda: True)
    routed = []
    real = sizes._linear
    monkeypatch.setattr(sizes, "_linear", lambda *a, **k: routed.append(1) or real(*a, **k))
    torch.manual_seed(0)
    assert _symbolic_programs_at_lengths_equal_eager(Products(), width=4) == [False, True]
    assert routed  # the symbolic trace went through fbmt's route


def _symbolic_programs_at_lengths_equal_eager(ref: nn.Module, width: int) -> list[bool]:
    """Values and gradients of `ref` compiled equal eager's at five lengths; which programs are symbolic."""
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (8, 12, 16, 30, 12):
        x = torch.randn(2, length, width)
        torch.testing.assert_close(model(x), ref(x), msg=f"length {length}")
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        _gradients_match_and_clear(model, ref, length)
    return [p.sizes is not None for p in model.programs.values()]


class Attention(nn.Module):
    """Attention of 4 query heads over 2 key/value heads, causal or through a mask that depends on the
    length (a bool one and an additive one)."""

    def __init__(self, mask: str):
        super().__init__()
        self.q, self.kv, self.mask = nn.Linear(8, 8), nn.Linear(8, 8), mask

    def forward(self, x):
        b, T, _ = x.shape
        q = self.q(x).view(b, T, 4, 2).transpose(1, 2)
        k, v = self.kv(x).view(b, T, 2, 4).transpose(1, 2).chunk(2, -1)
        keep = torch.ones(T, T, dtype=torch.bool).tril(1)
        masks = {"causal": None, "bool": keep, "additive": torch.zeros(T, T).masked_fill(~keep, -1e4)}
        out = nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=masks[self.mask], is_causal=self.mask == "causal", enable_gqa=True, scale=-0.3
        )
        return out.transpose(1, 2).reshape(b, T, 8)


@pytest.mark.parametrize("mask", ["causal", "bool", "additive"])
def test_attention_on_sdpa_math_backend_keeps_sizes_symbolic_and_equals_eager(monkeypatch, mask):
    """SDPA's math backend runs torch 2.11's matmul kernel inside C++: fbmt runs it as ops there
    (NOTE: [Matmul on symbolic sizes]), forced here on any torch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fbmt.compiler import sizes

    monkeypatch.setattr(sizes, "_matmul_fixes_sizes", lambda: True)
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH):
        assert _symbolic_programs_at_lengths_equal_eager(Attention(mask), width=8) == [False, True]


class TorchAttention(nn.Module):
    """nn.MultiheadAttention (F.multi_head_attention_forward: Python calling `linear` and SDPA by
    torch.nn.functional's names) without and with its weights, given a padding mask."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        pad = torch.zeros(x.shape[:2], dtype=torch.bool)
        pad[0, -2:] = True
        out, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        mixed, weights = self.attn(out, x, x, key_padding_mask=pad)
        return mixed + weights.sum(-1, keepdim=True)


def test_torch_multi_head_attention_keeps_sizes_symbolic_and_equals_eager(monkeypatch):
    """Within F.multi_head_attention_forward the route is off (a mode is off within its own
    __torch_function__), so the products it calls by name are routed for that call (NOTE: [Matmul on
    symbolic sizes]; WavLM's attention), forced here on any torch, and the names are given back."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fbmt.compiler import sizes

    monkeypatch.setattr(sizes, "_matmul_fixes_sizes", lambda: True)
    routed = []
    real = sizes._linear
    monkeypatch.setattr(sizes, "_linear", lambda *a, **k: routed.append(1) or real(*a, **k))
    torch.manual_seed(0)
    with sdpa_kernel(SDPBackend.MATH):
        assert _symbolic_programs_at_lengths_equal_eager(TorchAttention(), width=8) == [False, True]
    assert routed
    assert nn.functional.linear is torch._C._nn.linear
    assert nn.functional.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention


@pytest.mark.parametrize(
    "taking, dropout, flash_alone",
    [({"cudnn", "flash", "efficient"}, 0.0, True), ({"cudnn", "efficient"}, 0.0, False), ({"flash"}, 0.1, False)],
)
def test_a_symbolic_programs_attention_on_cuda_runs_flash_where_flash_takes_it(
    monkeypatch, taking, dropout, flash_alone
):
    """NOTE: [Attention at symbolic sizes], as a machine without CUDA shows it (the kernels' checks stood in
    for, the call on CUDA fakes): flash's kernel alone is enabled for SDPA where its check takes the call
    without dropout; elsewhere SDPA's own choice stands. The GPU check (tests/gpu/lengths_on_gpu.py) runs it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fbmt.compiler import sizes

    enabled = []

    def kernel(*args, **kwargs):
        enabled.append((torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled()))

    monkeypatch.setattr(sizes, "_cuda_kernels_taking", lambda *args: taking)
    monkeypatch.setattr(sizes, "_KERNEL_ATTENTION", kernel)
    with FakeTensorMode():
        q = torch.empty(2, 4, 16, 8, device="cuda")
    sizes._attention(q, q, q, dropout_p=dropout, is_causal=True, math_as_ops=False)
    assert enabled == [(True, not flash_alone)]
    assert torch.backends.cuda.cudnn_sdp_enabled()  # as it was


@pytest.mark.parametrize("learned", [True, False])
def test_a_symbolic_programs_attention_with_a_learned_bias_on_cuda_runs_as_ops(monkeypatch, learned):
    """NOTE: [Attention at symbolic sizes]: a mask that takes a gradient (T5's position bias, the conformer's)
    is computed as SDPA's math as ops on CUDA, where a fused kernel would take it (torch 2.11's trace of that
    kernel's backward stopped inside torch); a mask without a gradient still reaches the kernel. As a machine
    without CUDA shows it: the kernels' checks stood in for, the call on CUDA fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fbmt.compiler import sizes

    called = []
    monkeypatch.setattr(sizes, "_cuda_kernels_taking", lambda *args: {"efficient"})
    monkeypatch.setattr(sizes, "_KERNEL_ATTENTION", lambda *args, **kwargs: called.append(1))
    # a torch built without CUDA cannot record autograd on CUDA fakes: no_grad, as the route reads only
    # whether the mask takes a gradient
    with FakeTensorMode(), torch.no_grad():
        q = torch.empty(2, 4, 16, 8, device="cuda")
        bias = torch.empty(1, 4, 16, 16, device="cuda", requires_grad=learned)
        for math_as_ops in (False, True):
            out = sizes._attention(q, q, q, attn_mask=bias, math_as_ops=math_as_ops)
            assert (out is not None and out.shape == q.shape) if learned else out is None
    assert called == ([] if learned else [1, 1])


def test_the_math_attention_route_refuses_what_sdpa_refuses():
    """A mask and is_causal together: SDPA raises, so the route must not compute an answer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fbmt.compiler import sizes

    q, keep = torch.randn(2, 2, 5, 4), torch.ones(5, 5, dtype=torch.bool)
    with sdpa_kernel(SDPBackend.MATH), sizes._SymbolicKernels(matmul=True):
        with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
            nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=keep, is_causal=True)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(3, 5, 4), (5, 4), (2, 3, 5, 4), "non-contiguous"])
def test_the_python_matmul_route_equals_torch_kernels(shape, bias):
    from fbmt.compiler import sizes

    torch.manual_seed(0)
    x = torch.randn(5, 3, 4).transpose(0, 1) if shape == "non-contiguous" else torch.randn(*shape)
    w, b = torch.randn(6, 4), torch.randn(6) if bias else None
    with sizes._SymbolicKernels(matmul=True):
        got = [nn.functional.linear(x, w, b), x @ w.t(), torch.matmul(x, w[0]), w @ x.transpose(-1, -2)]
    torch.testing.assert_close(
        got, [nn.functional.linear(x, w, b), x @ w.t(), torch.matmul(x, w[0]), w @ x.transpose(-1, -2)]
    )


SIZE_USES = {  # what a forward does with its length: each must equal eager at lengths never traced
    "tensor of the size": lambda h, T: h * torch.tensor(T, dtype=torch.float32),
    "new_tensor of sizes": lambda h, T: h * h.new_tensor([T, T + 1]).sum(),
    "math on the size": lambda h, T: h * math.sqrt(T),
    "division": lambda h, T: h / T,
    "arange": lambda h, T: h * torch.arange(T).float().view(1, T, 1),
    "full of a power": lambda h, T: h * torch.full((1,), T**0.5),
    "interpolate to twice": lambda h, T: nn.functional.interpolate(h.transpose(1, 2), size=T * 2).transpose(1, 2),
}


class UsesSize(nn.Module):
    def __init__(self, use: str):
        super().__init__()
        self.lin, self.use = nn.Linear(4, 4), use

    def forward(self, x):
        return SIZE_USES[self.use](self.lin(x), x.shape[1])


@pytest.mark.parametrize("use", sorted(SIZE_USES))
def test_a_size_read_as_a_number_is_never_baked_into_a_program_for_other_lengths(use):
    torch.manual_seed(0)
    ref = UsesSize(use)
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (8, 12, 16, 30, 12):
        x = torch.randn(2, length, 4)
        torch.testing.assert_close(model(x), ref(x), msg=f"length {length}")


class Memo:
    """An argument object that counts what it has seen in an int, as a sliding window's cache layer does."""

    def __init__(self, seen: int, total: torch.Tensor):
        self.seen, self.total = seen, total


class Positions(nn.Module):
    """Positions from the count an argument object holds, which the forward then advances."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, memo):
        pos = torch.arange(memo.seen, memo.seen + x.shape[1], dtype=x.dtype)
        memo.seen += x.shape[1]
        memo.total = memo.total + x.sum(1)
        return self.lin(x) * pos[None, :, None]


def test_a_number_an_argument_object_holds_is_one_program_for_every_value():
    """NOTE: [Numbers in an object]: the second value of the count makes a program that takes it as a size;
    later values run it, and the object comes back holding the count eager's forward leaves (an int)."""
    torch.manual_seed(0)
    ref = Positions()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for seen, length in ((3, 5), (4, 5), (9, 5), (16, 5), (7, 5)):  # up to four times the 4 traced
        x = torch.randn(2, length, 4)
        mine, theirs = Memo(seen, torch.zeros(2, 4)), Memo(seen, torch.zeros(2, 4))
        torch.testing.assert_close(model(x, mine), ref(x, theirs), msg=f"seen {seen}")
        assert type(mine.seen) is int and mine.seen == theirs.seen == seen + length
        torch.testing.assert_close(mine.total, theirs.total)
    assert len(model.programs) == 2
    symbolic = list(model.programs.values())[1]
    assert symbolic.numbers == ((1, (("attr", "seen"),)),), symbolic.numbers


def test_a_large_number_is_given_to_its_program_without_memory_for_its_size():
    """A number an argument object holds may be large (every token a layer has seen): its input is one byte."""
    from fbmt.compiler import sizes

    given = sizes.number_input(2**40, torch.device("cpu"))
    assert given.shape == (2**40,) and given.untyped_storage().nbytes() == 1


class Lengths(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), x.shape[1]


def test_a_size_a_program_of_symbolic_sizes_returns_is_the_calls_own_number():
    """A forward that returns a size (a count of tokens) gives, from a program of symbolic sizes, the number
    at the call's sizes, not the trace's symbol."""
    torch.manual_seed(0)
    ref = Lengths()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (5, 7, 11):
        out, n = model(torch.randn(2, length, 4))
        assert type(n) is int and n == length
    assert len(model.programs) == 2


def test_a_pad_that_aligns_a_symbolic_length_assumes_nothing_of_its_residue():
    """SDPA pads an attention mask of a length not a multiple of 8 by `8 - s % 8` (its kernels read aligned
    rows); traced as a cat of the mask and its padding, cat's choice of layout asked whether the padding is 1
    wide: a guard on the length's residue, and generate() on CUDA compiled a program per class. The trace's
    pad assumes nothing of the residue, and equals F.pad at lengths of every residue, where it pads, crops and
    pads several dimensions."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fbmt.compiler import sizes, trace

    for shape in ((2, 1, 1, 13), (2, 4, 5, 13), (3, 13)):
        mode = sizes.symbolic_mode()
        mask = sizes.fake_inputs(mode, [torch.ones(*shape, dtype=torch.bool)], {0: (len(shape) - 1,)})[0]
        with mode:
            padded = trace._constant_pad_nd(mask, [0, 8 - mask.shape[-1] % 8])
        assert not mode.shape_env.guards, (shape, mode.shape_env.guards)
        assert padded.shape[:-1] == mask.shape[:-1]

    def aligned(x):
        return trace._constant_pad_nd(x, [0, 8 - x.shape[-1] % 8])

    def several(x):  # crop one at the left, pad two at the right; pad one row above
        return trace._constant_pad_nd(x, [-1, 2, 1, 0], value=-1.5)

    traced = [make_fx(f, tracing_mode="symbolic")(torch.randn(2, 3, 13)) for f in (aligned, several)]
    for n in (5, 8, 15, 16, 23):
        x = torch.randn(2, 3, n)
        torch.testing.assert_close(traced[0](x), F.pad(x, (0, 8 - n % 8)))
        torch.testing.assert_close(traced[1](x), F.pad(x, (-1, 2, 1, 0), value=-1.5))
