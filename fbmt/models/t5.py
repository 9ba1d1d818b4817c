"""T5: an encoder-decoder with RMS layer norms, relative position biases (bucketed, computed once per stack
and shared by its blocks), unscaled `scaled_dot_product_attention`, and a ReLU or gated-GELU (T5 v1.1)
feed-forward. Loads and saves Hugging Face `T5ForConditionalGeneration` folders
(`fbmt.models.pretrained`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fbmt.models.llama import Output, RMSNorm
from fbmt.models.pretrained import CheckpointError, PretrainedModel, Source, split_config


@dataclass(frozen=True)
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None  # default: num_layers
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    dropout_rate: float = 0.1
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"  # or "gated-gelu"
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool | None = None  # the decoder's output times d_model ** -0.5; default: when tied
    decoder_start_token_id: int = 0
    pad_token_id: int = 0
    initializer_factor: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def gated(self) -> bool:
        return self.feed_forward_proj.startswith("gated")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> T5Config:
        if hf.get("feed_forward_proj", "relu") not in ("relu", "gated-gelu"):
            raise CheckpointError(f"fbmt.models.T5: feed_forward_proj={hf['feed_forward_proj']!r} is not implemented")
        return split_config(cls, hf, "T5")

    def to_hf(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        out["num_decoder_layers"] = self.num_decoder_layers or self.num_layers
        if self.scale_decoder_outputs is None:
            out["scale_decoder_outputs"] = self.tie_word_embeddings
        return {**self.extra, **out, "model_type": "t5", "is_encoder_decoder": True}


def relative_buckets(q: int, k: int, bidirectional: bool, buckets: int, max_distance: int, device: Any) -> torch.Tensor:
    """T5's bucket of each (query, key) offset: exact near, logarithmic far, one bucket past max_distance."""
    rel = torch.arange(k, device=device)[None, :] - torch.arange(q, device=device)[:, None]
    out = torch.zeros_like(rel)
    if bidirectional:
        buckets //= 2
        out = out + (rel > 0).long() * buckets
        rel = rel.abs()
    else:
        rel = -torch.min(rel, torch.zeros_like(rel))
    exact = buckets // 2
    far = exact + (torch.log(rel.float() / exact) / math.log(max_distance / exact) * (buckets - exact)).long()
    far = torch.min(far, torch.full_like(far, buckets - 1))
    return out + torch.where(rel < exact, rel, far)


class Attention(nn.Module):
    def __init__(self, cfg: T5Config, relative: bool, decoder: bool):
        super().__init__()
        self.h, self.d, self.cfg, self.decoder = cfg.num_heads, cfg.d_kv, cfg, decoder
        inner = self.h * self.d
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.kv = nn.Linear(cfg.d_model, 2 * inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)
        self.relative = nn.Embedding(cfg.relative_attention_num_buckets, self.h) if relative else None

    def bias(self, q: int, k: int, device: Any) -> torch.Tensor:
        c = self.cfg
        buckets = relative_buckets(
            q, k, not self.decoder, c.relative_attention_num_buckets, c.relative_attention_max_distance, device
        )
        return self.relative(buckets).permute(2, 0, 1).unsqueeze(0)  # (1, heads, q, k)

    def forward(self, x: torch.Tensor, source: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.h, self.d).permute(2, 0, 3, 1, 4)
        drop = self.cfg.dropout_rate if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), dropout_p=drop, scale=1.0)
        return self.o(y.transpose(1, 2).reshape(b, s, self.h * self.d))


class FeedForward(nn.Module):
    def __init__(self, cfg: T5Config):
        super().__init__()
        self.cfg = cfg
        self.wi = nn.Linear(cfg.d_model, (2 if cfg.gated else 1) * cfg.d_ff, bias=False)
        self.wo = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.gated:
            gate, up = self.wi(x).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = F.relu(self.wi(x))
        return self.wo(F.dropout(h, self.cfg.dropout_rate, self.training))


class Block(nn.Module):
    def __init__(self, cfg: T5Config, decoder: bool, first: bool):
        super().__init__()
        self.p = cfg.dropout_rate
        self.self_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon, cast_to_weight=True)
        self.self_attn = Attention(cfg, relative=first, decoder=decoder)
        if decoder:
            self.cross_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon, cast_to_weight=True)
            self.cross_attn = Attention(cfg, relative=False, decoder=True)
        self.ff_norm = RMSNorm(cfg.d_model, cfg.layer_norm_epsilon, cast_to_weight=True)
        self.ff = FeedForward(cfg)

    def forward(
        self, x: torch.Tensor, bias: torch.Tensor, memory: torch.Tensor | None, memory_bias: torch.Tensor | None
    ) -> torch.Tensor:
        h = self.self_norm(x)
        x = x + F.dropout(self.self_attn(h, h, bias), self.p, self.training)
        if memory is not None:
            x = x + F.dropout(self.cross_attn(self.cross_norm(x), memory, memory_bias), self.p, self.training)
        return x + F.dropout(self.ff(self.ff_norm(x)), self.p, self.training)


def _padding_bias(mask: torch.Tensor | None, dtype: torch.dtype, b: int, k: int, device: Any) -> torch.Tensor:
    if mask is None:
        return torch.zeros(b, 1, 1, k, dtype=dtype, device=device)
    return (1.0 - mask[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class T5(PretrainedModel):
    """Sequence to sequence: `model(input_ids, attention_mask=None, labels=None, decoder_input_ids=None)`
    returns `Output(loss, logits)`. With labels and no decoder_input_ids, the decoder reads the labels
    shifted right (decoder_start_token_id first, -100 as padding), as HF's model does."""

    config_class = T5Config
    hf_architecture = "T5ForConditionalGeneration"

    def __init__(self, config: T5Config):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = nn.ModuleList(Block(config, False, i == 0) for i in range(config.num_layers))
        self.encoder_norm = RMSNorm(config.d_model, config.layer_norm_epsilon, cast_to_weight=True)
        n_dec = config.num_decoder_layers or config.num_layers
        self.decoder = nn.ModuleList(Block(config, True, i == 0) for i in range(n_dec))
        self.decoder_norm = RMSNorm(config.d_model, config.layer_norm_epsilon, cast_to_weight=True)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.shared.weight
        self.init_weights()

    def shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        start = torch.full_like(labels[:, :1], self.config.decoder_start_token_id)
        shifted = torch.cat([start, labels[:, :-1]], dim=1)
        return shifted.masked_fill(shifted == -100, self.config.pad_token_id)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
    ) -> Output:
        p, training = self.config.dropout_rate, self.training
        b, s = input_ids.shape
        x = F.dropout(self.shared(input_ids), p, training)
        pad = _padding_bias(attention_mask, x.dtype, b, s, x.device)
        bias = self.encoder[0].self_attn.bias(s, s, x.device) + pad
        for block in self.encoder:
            x = block(x, bias, None, None)
        memory = F.dropout(self.encoder_norm(x), p, training)

        if decoder_input_ids is None:
            if labels is None:
                raise ValueError("fbmt.models.T5: give labels or decoder_input_ids")
            decoder_input_ids = self.shift_right(labels)
        t = decoder_input_ids.shape[1]
        y = F.dropout(self.shared(decoder_input_ids), p, training)
        causal = torch.ones(t, t, dtype=torch.bool, device=y.device).tril()
        future = torch.zeros(t, t, dtype=y.dtype, device=y.device).masked_fill(~causal, torch.finfo(y.dtype).min)
        dbias = self.decoder[0].self_attn.bias(t, t, y.device) + future
        for block in self.decoder:
            y = block(y, dbias, memory, pad)
        y = F.dropout(self.decoder_norm(y), p, training)
        c = self.config
        if c.tie_word_embeddings if c.scale_decoder_outputs is None else c.scale_decoder_outputs:
            y = y * c.d_model**-0.5
        logits = self.lm_head(y)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return Output(loss, logits)

    def init_module(self, module: nn.Module) -> None:
        c, f = self.config, self.config.initializer_factor
        if isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
            return
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return
        path = self._paths()[module]
        # T5's own scales: attention is unscaled, so the query projection carries 1/sqrt(d_kv)
        fan_in = {
            "q": c.d_model * c.d_kv,
            "kv": c.d_model,
            "o": c.num_heads * c.d_kv,
            "wi": c.d_model,
            "wo": c.d_ff,
            "relative": c.d_model,
        }.get(path.rpartition(".")[2])
        std = f * 1.0 if module is self.shared or fan_in is None else f * fan_in**-0.5
        nn.init.normal_(module.weight, std=std)

    def hf_names(self) -> dict[str, Source]:
        c = self.config
        names = {"shared.weight": Source(("shared.weight",))}
        if not c.tie_word_embeddings:
            names["lm_head.weight"] = Source(("lm_head.weight",))
        for stack, ours, blocks in (("encoder", "encoder", c.num_layers), ("decoder", "decoder", len(self.decoder))):
            names[f"{ours}_norm.weight"] = Source((f"{stack}.final_layer_norm.weight",))
            for i in range(blocks):
                hf, me = f"{stack}.block.{i}.layer", f"{ours}.{i}"
                attn = [("self_attn", "self_norm", f"{hf}.0", "SelfAttention")]
                if stack == "decoder":
                    attn.append(("cross_attn", "cross_norm", f"{hf}.1", "EncDecAttention"))
                for mine, norm, layer, kind in attn:
                    names[f"{me}.{mine}.q.weight"] = Source((f"{layer}.{kind}.q.weight",))
                    names[f"{me}.{mine}.kv.weight"] = Source((f"{layer}.{kind}.k.weight", f"{layer}.{kind}.v.weight"))
                    names[f"{me}.{mine}.o.weight"] = Source((f"{layer}.{kind}.o.weight",))
                    names[f"{me}.{norm}.weight"] = Source((f"{layer}.layer_norm.weight",))
                if i == 0:
                    table = f"{hf}.0.SelfAttention.relative_attention_bias.weight"
                    names[f"{me}.self_attn.relative.weight"] = Source((table,))
                ff = f"{hf}.{2 if stack == 'decoder' else 1}"
                wi = (f"{ff}.DenseReluDense.wi_0.weight", f"{ff}.DenseReluDense.wi_1.weight") if c.gated else None
                names[f"{me}.ff.wi.weight"] = Source(wi or (f"{ff}.DenseReluDense.wi.weight",))
                names[f"{me}.ff.wo.weight"] = Source((f"{ff}.DenseReluDense.wo.weight",))
                names[f"{me}.ff_norm.weight"] = Source((f"{ff}.layer_norm.weight",))
        return names

    def ignored_hf_names(self) -> list[str]:
        tied = ["encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]  # copies of shared.weight
        return tied + (["lm_head.weight"] if self.config.tie_word_embeddings else [])
