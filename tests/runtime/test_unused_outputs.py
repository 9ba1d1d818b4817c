"""An output the caller does not differentiate (NOTE: [Unused outputs' gradients]): its zero gradient is
one zero expanded where the backward reads it as values only, and the gradients are eager's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt
from fbmt.compiler.passes import loss
from fbmt.compiler.runtime import partition
from tests.workers import gradients_match


class _LossAndLogits(nn.Module):
    """The loss and the logits, as Hugging Face's causal models return them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.embed(x))
        return F.cross_entropy(logits.float().view(-1, 50), y.view(-1)), logits


class _HiddenAndOut(nn.Module):
    """An output whose gradient reaches a product first: its zeros must be a real tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.a(x)
        return self.b(h).square().mean(), torch.tanh(h) @ self.b.weight


def _tangents(monkeypatch) -> list[list[torch.Tensor]]:
    seen: list[list[torch.Tensor]] = []
    run = partition.Executable.run_backward

    def spy(self, saved, *tangents):
        seen.append(list(tangents))
        return run(self, saved, *tangents)

    monkeypatch.setattr(partition.Executable, "run_backward", spy)
    return seen


@pytest.mark.parametrize(
    "chunked, backend", [(False, "eager"), (True, "eager"), (True, "inductor")], ids=["whole", "chunked", "inductor"]
)
def test_unused_logits_get_one_expanded_zero_and_eagers_gradients(monkeypatch, chunked, backend):
    """With Inductor the regions reading the expanded zero are compiled for its layout, and again for
    the caller's dense gradient when the logits are used."""
    if chunked:
        monkeypatch.setattr(loss, "CHUNK_BYTES", 1024)
    seen = _tangents(monkeypatch)
    torch.manual_seed(0)
    model = _LossAndLogits()
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, checks=True, cache_dir=False, backend=backend)
    x, y = torch.randint(0, 50, (2, 12)), torch.randint(0, 50, (2, 12))
    for m in (compiled, ref):
        m(x, y)[0].backward()
    gradients_match(compiled, ref)
    (tangents,) = seen
    logits = [t for t in tangents if t.dim() == 3]
    assert len(logits) == 1 and logits[0].stride() == (0, 0, 0), [t.stride() for t in tangents]
    # used, the logits' gradient is the caller's
    seen.clear()
    for m in (compiled, ref):
        m.zero_grad()
        value, out = m(x, y)
        (value + out.float().pow(2).mean()).backward()
    gradients_match(compiled, ref)
    assert all(t.stride() != (0, 0, 0) for t in seen[0])
    if backend == "inductor":  # new lengths (a program of symbolic sizes), the logits used and unused in turn
        for step, length in enumerate((16, 20, 16, 20, 12)):
            x, y = torch.randint(0, 50, (2, length)), torch.randint(0, 50, (2, length))
            for m in (compiled, ref):
                m.zero_grad()
                value, out = m(x, y)
                (value + out.float().pow(2).mean() if step % 2 else value).backward()
            gradients_match(compiled, ref, f"length {length}, logits {'used' if step % 2 else 'unused'}: ")


def test_an_unused_output_read_by_a_product_gets_real_zeros(monkeypatch):
    seen = _tangents(monkeypatch)
    torch.manual_seed(0)
    model = _HiddenAndOut()
    ref = copy.deepcopy(model)
    compiled = fbmt.compile(model, checks=True, cache_dir=False)
    x = torch.randn(4, 8)
    for m in (compiled, ref):
        m(x)[0].backward()
    gradients_match(compiled, ref)
    assert all(0 not in t.stride() for t in seen[0]), [t.stride() for t in seen[0]]
