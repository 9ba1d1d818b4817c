"""Tiny reference models for the tests: each exercises a different part of the compiler."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from fbmt.models import GPT, GPTConfig


class MLP(nn.Module):
    """Blocks come from top-level children; ReLU has no parameters."""

    def __init__(self, d: int = 12):
        super().__init__()
        self.fc1 = nn.Linear(d, 4 * d)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(4 * d, 2 * d)
        self.fc3 = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.act(self.fc2(self.act(self.fc1(x)))))


class Buffered(nn.Module):
    """Persistent and non-persistent buffers, a buffer updated in forward, kwargs, dict/tuple outputs."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(2))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.register_buffer("shift", torch.full((d,), 0.1), persistent=False)
        self.register_buffer("running_mean", torch.zeros(d))

    def forward(self, x: torch.Tensor, *, bias: torch.Tensor | None = None, power: int = 2) -> dict:
        h = self.proj(x) * self.scale + self.shift
        if bias is not None:
            h = h + bias
        if self.training:
            with torch.no_grad():
                self.running_mean.mul_(0.9).add_(h.mean(0), alpha=0.1)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return {"out": h, "aux": (h.pow(power).mean(), power)}


class Llama(nn.Module):
    """Llama-style blocks (the GPU benchmark's shape, in miniature): q, k, v and gate/up projections
    that read one input with weights side by side (NOTE: [Merged products]), a rotation of q and k
    (so attention's backward saves v but neither q's nor k's product), RMSNorm, SwiGLU, causal SDPA."""

    class Block(nn.Module):
        def __init__(self, d: int, heads: int, ff: int):
            super().__init__()
            self.heads = heads
            self.attn_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
            self.w1, self.w3 = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            self.w2 = nn.Linear(ff, d, bias=False)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, s, d = x.shape
            h = self.attn_norm(x)
            q, k, v = (w(h).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            q, k = (
                torch.cat([t[..., ::2] * cos - t[..., 1::2] * sin, t[..., ::2] * sin + t[..., 1::2] * cos], -1)
                for t in (q, k)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
            x = x + self.wo(a)
            h = self.ffn_norm(x)
            return x + self.w2(F.silu(self.w1(h)) * self.w3(h))

    def __init__(self, vocab: int = 64, d: int = 16, heads: int = 2, ff: int = 24, n_layer: int = 2, seq: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(self.Block(d, heads, ff) for _ in range(n_layer))
        self.norm, self.output = nn.RMSNorm(d), nn.Linear(d, vocab, bias=False)
        angles = torch.outer(torch.arange(float(seq)), 1.0 / 100 ** (torch.arange(0, d // heads, 2) / (d // heads)))
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx)
        cos, sin = self.cos[: idx.shape[1]], self.sin[: idx.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def gpt(dropout: float = 0.0, n_layer: int = 2) -> GPT:
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=n_layer, n_head=2, d_model=16, dropout=dropout))


def gpt_short() -> GPT:
    """Wider and on 4 tokens: its activations weigh about as much as its gradients, so under
    remat="block" its last blocks save theirs (NOTE: [Trailing blocks]): all of them on up to 8
    sequences, h.1 and h.2 on 16 (its batch on 2 ranks), only h.2 on 24, none on 32."""
    return GPT(GPTConfig(vocab_size=64, seq_len=4, n_layer=3, n_head=2, d_model=128))


def batch(name: str, step: int, global_batch: int | None = None) -> tuple[tuple, dict, torch.Tensor]:
    """(args, kwargs, target) of one global batch for a model, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    global_batch = global_batch or (32 if name == "gpt_short" else 8)
    if name.startswith("gpt") or name == "llama":
        seq = 4 if name == "gpt_short" else 16
        idx = torch.randint(0, 64, (global_batch, seq), generator=g)
        return (idx,), {}, torch.randint(0, 64, (global_batch, seq), generator=g)
    if name == "mlp":
        return (torch.randn(global_batch, 12, generator=g),), {}, torch.randn(global_batch, 12, generator=g)
    x = torch.randn(global_batch, 8, generator=g)
    return (x,), {"bias": torch.randn(8, generator=g), "power": 2}, torch.randn(global_batch, 8, generator=g)


def loss_of(name: str, out, target: torch.Tensor) -> torch.Tensor:
    if name.startswith("gpt") or name == "llama":
        return F.cross_entropy(out.view(-1, out.size(-1)), target.view(-1))
    if name == "mlp":
        return F.mse_loss(out, target)
    return F.mse_loss(out["out"], target) + 0.1 * out["aux"][0]


BUILDERS = {"mlp": MLP, "gpt": gpt, "gpt_short": gpt_short, "buffered": Buffered, "llama": Llama}


def loss_and_gradients_match(ref: nn.Module, model: nn.Module, call: dict) -> None:
    """One call of a model that computes its own loss (a Hugging Face model given labels), eager `ref` and
    compiled `model`: the same loss and every parameter's gradient."""
    want, got = ref(**call).loss, model(**call).loss
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want)
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
