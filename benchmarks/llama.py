"""A Llama-style decoder in plain PyTorch (RMSNorm, RoPE, SwiGLU, causal SDPA), the model the GPU
benchmark trains with fbmt and with FSDP2. No fbmt imports: the peers see exactly the same module."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    dim: int = 2048
    n_layers: int = 24
    n_heads: int = 16
    ffn_dim: int = 5632
    vocab_size: int = 32000
    max_seq: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    n_kv_heads: int | None = None  # grouped-query attention (read by gpu_train.py --hf; this Llama has none)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def n_params(self) -> int:
        kv = (self.n_kv_heads or self.n_heads) * self.head_dim
        per_layer = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_dim + 2 * self.dim
        return self.n_layers * per_layer + 2 * self.vocab_size * self.dim + self.dim

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: 6 per parameter (forward + backward) plus causal attention
        scores and values (6 * layers * dim * seq), the convention the peer table uses."""
        return 6 * self.n_params() + 6 * self.n_layers * self.dim * seq


CONFIGS = {
    "1.36b": LlamaConfig(dim=2048, n_layers=24, n_heads=16, ffn_dim=5632),
    "6.7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, ffn_dim=11008),
    "13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, ffn_dim=13824),
    "30b": LlamaConfig(dim=6656, n_layers=60, n_heads=52, ffn_dim=17920),
    "0.89b": LlamaConfig(dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, n_kv_heads=8),  # issue 20's HF model
    "tiny": LlamaConfig(dim=128, n_layers=4, n_heads=4, ffn_dim=352, vocab_size=512, max_seq=256),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(cfg: LlamaConfig, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=device, dtype=torch.float32) / cfg.head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); rotate pairs (first half, second half)."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(cfg.dim, cfg.norm_eps), Attention(cfg)
        self.ffn_norm, self.ffn = RMSNorm(cfg.dim, cfg.norm_eps), FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_tables(self.cfg, tokens.shape[1], tokens.device)
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def init_weights(module: nn.Module) -> None:
    """Deterministic init for any submodule (used for meta materialization by every method)."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=0.02 / math.sqrt(2))
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, std=0.02)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


class LlamaWithLoss(Llama):
    """The same model returning the training loss: with the loss inside, a compiled program's output
    is a scalar, and the logits and their gradient live and die inside the program."""

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        logits = super().forward(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
