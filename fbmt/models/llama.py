"""Llama, and its kin with the same checkpoint layout (Mistral, for inputs within its sliding window), with
`attention_bias` (HF Llama's: q, k, v and the output projection): grouped-query attention through
`scaled_dot_product_attention`, RoPE with linear or Llama-3 frequency scaling, fused q/k/v and gate/up
projections. Loads and saves Hugging Face `LlamaForCausalLM` folders (`fbmt.models.pretrained`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from fbmt.models.pretrained import CheckpointError, PretrainedModel, Source, split_config


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 16
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int | None = None  # default: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # {"rope_type": "linear" | "llama3", "factor": ..., ...}
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    sliding_window: int | None = None  # Mistral's: longer inputs are refused (attention here is not windowed)
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # other config.json keys, written back

    def __post_init__(self) -> None:
        # each key/value head serves num_attention_heads // num_key_value_heads query heads: any other pair
        # would repeat the heads zero or a fractional number of times, and attention would read keys that
        # are not the model's (with 4 query heads and the default 8, none: eager torch computed a loss)
        h, kv = self.num_attention_heads, self.num_key_value_heads
        if kv < 1 or h % kv:
            raise ValueError(
                f"fbmt.models.LlamaConfig: num_attention_heads={h} is not a multiple of num_key_value_heads={kv} "
                f"(the default is 8); set num_key_value_heads to a divisor of {h} ({h} for a key per query head)"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> LlamaConfig:
        hf = dict(hf)
        rope = hf.pop("rope_parameters", None) or {}  # transformers 5 keeps theta and scaling together
        theta = rope.get("rope_theta", hf.pop("rope_theta", 10000.0))
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"} or hf.pop("rope_scaling", None)
        if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("linear", "llama3"):
            raise CheckpointError(f"fbmt.models.Llama: RoPE scaling {scaling} is not implemented (linear, llama3 are)")
        if not hf.pop("use_sliding_window", True):  # Qwen2's: a window in the config, switched off
            hf.pop("sliding_window", None)
        hf.setdefault("num_key_value_heads", hf.get("num_attention_heads", cls.num_attention_heads))
        config = split_config(cls, hf, "Llama", {"mlp_bias": False, "hidden_act": "silu"})
        return dataclasses.replace(config, rope_theta=theta, rope_scaling=scaling)

    def to_hf(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("extra", "rope_scaling", "rope_theta")}
        out = {**self.extra, **out, "model_type": "llama", "hidden_act": "silu"}
        out["rope_parameters"] = {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}
        return out


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    d = cfg.dim_per_head
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # as HF, in fp32
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        inv = inv / s["factor"]
    elif kind == "llama3":
        old = s["original_max_position_embeddings"]
        low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
        mid = (1 - smooth) * inv / s["factor"] + smooth * inv
        inv = torch.where(wavelen > low, inv / s["factor"], torch.where(wavelen < high, inv, mid))
    return inv


class RMSNorm(nn.Module):
    """A scale, no shift, no mean subtracted, computed in fp32; the normalized value is cast back to the
    input's dtype before the scale (Llama's) or to the weight's (`cast_to_weight`, T5's)."""

    def __init__(self, dim: int, eps: float, cast_to_weight: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.cast_to_weight = eps, cast_to_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(self.weight.dtype if self.cast_to_weight else x.dtype)


class Rotary(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def reset_parameters(self) -> None:
        self.inv_freq.copy_(rope_frequencies(self.cfg))

    def forward(self, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq, device=self.inv_freq.device, dtype=torch.float32)
        f = torch.outer(t, self.inv_freq)
        emb = torch.cat([f, f], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-b, a], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.h, self.kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_per_head
        self.qkv = nn.Linear(cfg.hidden_size, (self.h + 2 * self.kv) * self.d, bias=cfg.attention_bias)
        self.out = nn.Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)  # HF Llama: o_proj too

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        q = _rotate(q.view(b, s, self.h, self.d).transpose(1, 2), cos, sin)
        k = _rotate(k.view(b, s, self.kv, self.d).transpose(1, 2), cos, sin)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        if self.kv != self.h:
            k, v = (t.repeat_interleave(self.h // self.kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
        return self.out(y.transpose(1, 2).reshape(b, s, self.h * self.d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Output(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class Llama(PretrainedModel):
    """A causal language model: `model(input_ids, labels=None, attention_mask=None)` returns `Output(loss,
    logits)`; with labels, the loss is next-token cross entropy (labels shifted inside, -100 ignored), as
    HF's `LlamaForCausalLM` computes it."""

    config_class = LlamaConfig
    hf_architecture = "LlamaForCausalLM"

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = Rotary(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.init_weights()

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None
    ) -> Output:
        window = self.config.sliding_window
        if window is not None and input_ids.shape[1] > window:
            raise ValueError(
                f"fbmt.models.Llama: {input_ids.shape[1]} tokens exceed the config's sliding_window of {window}, "
                "and this model attends to every earlier token; use transformers' own model for longer inputs"
            )
        x = self.embed(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.dtype)
        mask = None
        if attention_mask is not None:  # padding: causal and key-padding, as one boolean mask
            s = input_ids.shape[1]
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
            mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(loss, logits)

    def init_module(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (RMSNorm, Rotary)):
            module.reset_parameters() if isinstance(module, Rotary) else nn.init.ones_(module.weight)

    def hf_names(self) -> dict[str, Source]:
        names = {"embed.weight": Source(("model.embed_tokens.weight",)), "norm.weight": Source(("model.norm.weight",))}
        if not self.config.tie_word_embeddings:
            names["lm_head.weight"] = Source(("lm_head.weight",))
        for i in range(self.config.num_hidden_layers):
            hf, ours = f"model.layers.{i}", f"layers.{i}"
            names[f"{ours}.attn_norm.weight"] = Source((f"{hf}.input_layernorm.weight",))
            names[f"{ours}.mlp_norm.weight"] = Source((f"{hf}.post_attention_layernorm.weight",))
            names[f"{ours}.attn.qkv.weight"] = Source(tuple(f"{hf}.self_attn.{p}_proj.weight" for p in "qkv"))
            if self.config.attention_bias:
                names[f"{ours}.attn.qkv.bias"] = Source(tuple(f"{hf}.self_attn.{p}_proj.bias" for p in "qkv"))
            names[f"{ours}.attn.out.weight"] = Source((f"{hf}.self_attn.o_proj.weight",))
            if self.config.attention_bias:
                names[f"{ours}.attn.out.bias"] = Source((f"{hf}.self_attn.o_proj.bias",))
            names[f"{ours}.mlp.gate_up.weight"] = Source((f"{hf}.mlp.gate_proj.weight", f"{hf}.mlp.up_proj.weight"))
            names[f"{ours}.mlp.down.weight"] = Source((f"{hf}.mlp.down_proj.weight",))
        return names

    def ignored_hf_names(self) -> list[str]:
        return ["lm_head.weight"] if self.config.tie_word_embeddings else []

    def split_sizes(self, name: str, even: list[int]) -> list[int]:
        if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
            c = self.config
            return [c.num_attention_heads * c.dim_per_head] + [c.num_key_value_heads * c.dim_per_head] * 2
        return even
