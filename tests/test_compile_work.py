"""What compiling does, and what it skips: the second trace only where the graph mutates, fewer
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


@pytest.fixture
def functionalizations(monkeypatch):
    calls = []
    real = trace_module.functionalize

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trace_module, "functionalize", counted)
    return calls


@pytest.mark.parametrize("cls, second_trace", [(Plain, False), (InPlace, True)])
def test_functionalization_runs_where_the_graph_mutates_and_both_match_eager(cls, second_trace, functionalizations):
    torch.manual_seed(0)
    ref = cls()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, device="cpu", cache_dir=False)
    x = torch.randn(3, 8)
    for _ in range(2):  # twice: the buffer's update is written back once per call
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert bool(functionalizations) == second_trace
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], b, msg=name)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 4)).transpose(1, 3).unbind(2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


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
