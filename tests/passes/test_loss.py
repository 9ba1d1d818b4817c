"""The loss pass (NOTE: [Chunked cross-entropy]): a cross-entropy over a large vocabulary is computed
in chunks of tokens, with eager's loss and gradients, and no whole [tokens, vocab] tensor of fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt
from fbmt.compiler.passes import chunk_losses, loss
from tests.dist import run_ranks
from tests.models import hf
from tests.passes.helpers import apply, traced
from tests.workers import gradients_match, step_matches

aten = torch.ops.aten
VOCAB, TOKENS = 200, 24  # 19.2 KB of fp32 logits: chunked into 5 under a 4 KB limit


class _Head(nn.Module):
    """An embedding, the output projection and `F.cross_entropy` over the logits cast to fp32, as
    Hugging Face's loss functions and fbmt's zoo write it."""

    def __init__(self, dtype: torch.dtype = torch.float32, **ce: object):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16, dtype=dtype)
        self.head = nn.Linear(16, VOCAB, bias=False, dtype=dtype)
        self.ce = ce
        if "weight" in ce:  # class weights: a buffer, as a module holds them
            self.register_buffer("weight", ce.pop("weight"))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(x))
        weight = getattr(self, "weight", None)
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1), weight=weight, **self.ce)


def _batch(ignore: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    y = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    y[0, :3] = ignore  # some tokens are padding
    return x, y


def _compiled_matches_eager(model: nn.Module, x: torch.Tensor, y: torch.Tensor, **tol: float) -> fbmt.CompiledModule:
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, checks=True, cache_dir=False)
    step_matches(compiled, ref, x, y, **tol)
    return compiled


@pytest.mark.parametrize(
    "ce", [{}, {"reduction": "sum"}, {"ignore_index": 5}, {"reduction": "sum", "ignore_index": 7}], ids=str
)
def test_a_chunked_cross_entropy_gives_eagers_loss_and_gradients(monkeypatch, ce):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch(ce.get("ignore_index", -100))
    compiled = _compiled_matches_eager(_Head(**ce), x, y, rtol=1e-5, atol=1e-6)
    assert compiled.program.stats("loss").chunked == ((TOKENS, VOCAB, 5),)


def test_every_token_ignored_gives_eagers_nan(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    y[:] = -100
    compiled = fbmt.compile(_Head(), cache_dir=False)
    got, want = compiled(x, y), _Head()(x, y)
    assert torch.isnan(got) and torch.isnan(want)


def test_in_bf16_no_whole_fp32_logits_exist_and_values_are_eagers(monkeypatch):
    """The logits stay bf16; the fp32 ones exist a chunk at a time, in the forward and the backward."""
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    torch.manual_seed(0)
    compiled = _compiled_matches_eager(_Head(torch.bfloat16), x, y, rtol=1e-2, atol=1e-2)
    whole = [
        n
        for n in compiled.program.graph.nodes
        if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype == torch.float32 and v.numel() >= TOKENS * VOCAB
    ]
    assert not whole, whole
    monkeypatch.setattr(loss, "CHUNK_BYTES", 1 << 30)  # the same program unchunked: it has them
    unchunked = fbmt.compile(_Head(torch.bfloat16), cache_dir=False).trace(x, y)
    assert any(
        isinstance(v := n.meta.get("val"), torch.Tensor) and v.dtype == torch.float32 and v.numel() == TOKENS * VOCAB
        for n in unchunked.graph.nodes
    )


def test_a_forward_without_gradients_is_chunked_too(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    model = _Head()
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, cache_dir=False)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), ref(x, y))
    assert compiled.program.stats("loss").chunked == ((TOKENS, VOCAB, 5),)


@pytest.mark.parametrize(
    "ce, why",
    [
        ({"label_smoothing": 0.1}, "read by other ops"),  # the smoothing term sums the log-probabilities
        ({"weight": torch.rand(VOCAB)}, "weighs the classes"),
        ({"reduction": "none"}, "reduction='none'"),
    ],
    ids=["label_smoothing", "weight", "none"],
)
def test_what_it_cannot_chunk_is_kept_and_said(monkeypatch, ce, why):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    model = _Head(**ce)
    program, stats = apply(chunk_losses, traced(model, x, y))
    assert stats.chunked == () and why in str(stats), str(stats)
    if ce.get("reduction") != "none":
        _compiled_matches_eager(model, x, y, rtol=1e-5, atol=1e-6)


def test_a_small_loss_is_left_alone():
    x, y = _batch()
    program, stats = apply(chunk_losses, traced(_Head(), x, y))
    assert stats.chunked == () and str(stats) == "no cross-entropy large enough to chunk"


def _chunked_trains_as_eager(rank: int, world: int, name: str, dtype: torch.dtype) -> str:
    from tests.test_transformers import _trains_as_eager

    loss.CHUNK_BYTES = 1000  # the tiny models' logits, in chunks of a few tokens
    # not through the session's compile cache: a program another test compiled unchunked has this key
    return _trains_as_eager(rank, world, name, dtype, cache=False)


@pytest.mark.parametrize(
    "name, dtype",
    [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.float32), ("bert-mlm", torch.float32)]
    + [("t5", torch.float32), ("whisper", torch.float32)],
    ids=str,
)
def test_hugging_face_losses_chunked_train_as_eager_on_two_ranks(name, dtype):
    """Each family's own loss (causal LM, masked LM, T5's and Whisper's `CrossEntropyLoss`) as called."""
    for said in run_ranks(2, _chunked_trains_as_eager, name, dtype):
        assert said.startswith("cross-entropy over") and "chunks" in said, said


def test_hugging_face_llamas_loss_is_found_and_chunked(monkeypatch):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 1000)
    model = fbmt.compile(hf.build("llama"), cache_dir=False)
    kwargs = hf.inputs("llama", 0)
    model(**kwargs).loss.backward()
    ((tokens, vocab, chunks),) = model.program.stats("loss").chunked
    assert (tokens, vocab) == (kwargs["input_ids"].numel(), hf.VOCAB) and chunks > 1


def test_a_program_of_symbolic_lengths_chunks_its_loss_and_equals_eager_at_new_lengths(monkeypatch):
    """Batches of many lengths (dynamic padding): one program of symbolic sizes after the first, its
    chunk bounds sizes of the graph, and eager's loss and gradients at lengths it never traced."""
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    torch.manual_seed(0)
    model = _Head()
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, checks=True, cache_dir=False)
    # (at 2 x 9 tokens each of the 8 chunks still has two: a chunk of one would be a new program, as
    # any size of 1 is in a program of symbolic sizes)
    for step, length in enumerate((12, 20, 33, 57, 9)):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, VOCAB, (2, length), generator=g), torch.randint(0, VOCAB, (2, length), generator=g)
        y[0, :2] = -100
        step_matches(compiled, ref, x, y, msg=f"length {length}")
    assert len(compiled.programs) == 2, [p.summary("loss") for p in compiled.programs.values()]
    symbolic = [p for p in compiled.programs.values() if not isinstance(p.stats("loss").chunked[0][0], int)]
    assert len(symbolic) == 1 and symbolic[0].stats("loss").chunked[0][1:] == (VOCAB, 8), symbolic[0].summary("loss")


class _TwoLosses(_Head):
    """Two cross-entropies over the same logits (two target sets), and the log-probabilities returned
    too when asked: what the pass must not take apart."""

    def __init__(self, return_log_probs: bool):
        super().__init__()
        self.return_log_probs = return_log_probs

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.embed(x)).float().view(-1, VOCAB)
        loss = F.cross_entropy(logits, y.view(-1)) + 0.5 * F.cross_entropy(logits, y.flip(0).view(-1))
        if self.return_log_probs:
            log_probs = F.log_softmax(logits, -1)
            return loss + 0.0 * F.nll_loss(log_probs, y.view(-1)) + log_probs.sum() * 1e-6
        return loss


@pytest.mark.parametrize("return_log_probs", [False, True])
def test_losses_sharing_their_logits_or_whose_log_probabilities_are_read_give_eagers_values(
    monkeypatch, return_log_probs
):
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    compiled = _compiled_matches_eager(_TwoLosses(return_log_probs), x, y, rtol=1e-5, atol=1e-6)
    stats = compiled.program.stats("loss")
    assert len(stats.chunked) == 2, str(stats)  # the two F.cross_entropy calls
    if return_log_probs:  # the log-probabilities read by a sum as well as a loss stay whole
        assert stats.kept == ("its log-probabilities are read by other ops than the loss",), str(stats)


class _LossAndLogits(_Head):
    """The loss and the logits, as Hugging Face's causal models return them: the logits get a gradient
    from the caller too (zeros when only the loss is used)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.embed(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), y.view(-1)), logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("use", ["loss", "both"])
def test_the_logits_other_gradient_is_added_chunk_by_chunk_with_eagers_values(monkeypatch, dtype, use):
    """NOTE: [The logits' other gradient]: each chunk adds its rows of the caller's gradient, so the
    concatenation of the chunks is read by products alone; the gradients are eager's."""
    monkeypatch.setattr(loss, "CHUNK_BYTES", 4096)
    x, y = _batch()
    torch.manual_seed(0)
    model = _LossAndLogits(dtype)
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, checks=True, cache_dir=False)
    results = []
    for m in (compiled, ref):
        value, logits = m(x, y)
        (value if use == "loss" else value + (logits.float() * torch.linspace(-1, 1, VOCAB)).sum() * 1e-3).backward()
        results.append(value)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(results[0], results[1], **tol)
    gradients_match(compiled, ref, **tol)
    (cat,) = [n for n in compiled.program.graph.nodes if n.target is aten.cat.default]
    assert all(part.target is aten.add.Tensor for part in cat.args[0]), [part.target for part in cat.args[0]]
    assert all(u.target is not aten.add.Tensor for u in cat.users), list(cat.users)
