"""BERT: an encoder of post-norm blocks with fused q/k/v and `scaled_dot_product_attention`, with a masked
language modeling head (`BertMLM`) or a sequence classification head (`BertClassifier`). Loads and saves
Hugging Face `BertForMaskedLM` / `BertForSequenceClassification` folders (`fbmt.models.pretrained`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fbmt.models.llama import Output
from fbmt.models.pretrained import PretrainedModel, Source, split_config


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    classifier_dropout: float | None = None
    num_labels: int = 2
    initializer_range: float = 0.02
    pad_token_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> BertConfig:
        if "id2label" in hf:
            hf = {"num_labels": len(hf["id2label"]), **hf}
        required = {"hidden_act": "gelu", "position_embedding_type": "absolute", "is_decoder": False}
        return split_config(cls, hf, "Bert", required)

    def to_hf(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("extra", "num_labels")}
        labels = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
        return {"id2label": labels, **self.extra, **out, "model_type": "bert", "hidden_act": "gelu"}


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size, padding_idx=cfg.pad_token_id)
        self.position = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.p = cfg.hidden_dropout_prob

    def forward(self, ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(ids)
        x = self.word(ids) + self.position(pos) + self.token_type(types)
        return F.dropout(self.norm(x), self.p, self.training)


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        d = cfg.hidden_size
        self.n_head, self.cfg = cfg.num_attention_heads, cfg
        self.qkv = nn.Linear(d, 3 * d)
        self.attn_out = nn.Linear(d, d)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(d, cfg.intermediate_size)
        self.down = nn.Linear(cfg.intermediate_size, d)
        self.out_norm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        drop = self.cfg.attention_probs_dropout_prob if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop).transpose(1, 2).reshape(b, s, d)
        p = self.cfg.hidden_dropout_prob
        x = self.attn_norm(x + F.dropout(self.attn_out(y), p, self.training))
        return self.out_norm(x + F.dropout(self.down(F.gelu(self.up(x))), p, self.training))


class Bert(PretrainedModel):
    """The encoder (embeddings and layers); `BertMLM` and `BertClassifier` put a head on it."""

    config_class = BertConfig
    hf_architecture = "BertModel"
    prefix = "bert."  # where HF's task models keep the encoder

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config)
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))

    def encode(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask[:, None, None, :].bool() if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
            if getattr(module, "padding_idx", None) is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def hf_names(self) -> dict[str, Source]:
        e = f"{self.prefix}embeddings"
        names = {
            "embeddings.word.weight": Source((f"{e}.word_embeddings.weight",)),
            "embeddings.position.weight": Source((f"{e}.position_embeddings.weight",)),
            "embeddings.token_type.weight": Source((f"{e}.token_type_embeddings.weight",)),
            "embeddings.norm.weight": Source((f"{e}.LayerNorm.weight",)),
            "embeddings.norm.bias": Source((f"{e}.LayerNorm.bias",)),
        }
        parts = {
            "attn_out": "attention.output.dense",
            "attn_norm": "attention.output.LayerNorm",
            "up": "intermediate.dense",
            "down": "output.dense",
            "out_norm": "output.LayerNorm",
        }
        for i in range(self.config.num_hidden_layers):
            hf = f"{self.prefix}encoder.layer.{i}"
            for kind in ("weight", "bias"):
                qkv = tuple(f"{hf}.attention.self.{p}.{kind}" for p in ("query", "key", "value"))
                names[f"layers.{i}.qkv.{kind}"] = Source(qkv)
                for ours, theirs in parts.items():
                    names[f"layers.{i}.{ours}.{kind}"] = Source((f"{hf}.{theirs}.{kind}",))
        return names


class BertMLM(Bert):
    """Masked language modeling: `model(input_ids, attention_mask=None, token_type_ids=None, labels=None)`
    returns `Output(loss, logits)`, the loss over the positions whose label is not -100."""

    hf_architecture = "BertForMaskedLM"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        d = config.hidden_size
        self.transform = nn.Linear(d, d)
        self.transform_norm = nn.LayerNorm(d, eps=config.layer_norm_eps)
        self.decoder_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Output:
        h = self.transform_norm(F.gelu(self.transform(self.encode(input_ids, attention_mask, token_type_ids))))
        logits = F.linear(h, self.embeddings.word.weight, self.decoder_bias)  # tied to the token embedding
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        return Output(loss, logits)

    def init_module(self, module: nn.Module) -> None:
        super().init_module(module)
        if module is self:
            nn.init.zeros_(self.decoder_bias)

    def hf_names(self) -> dict[str, Source]:
        p = "cls.predictions"
        return super().hf_names() | {
            "transform.weight": Source((f"{p}.transform.dense.weight",)),
            "transform.bias": Source((f"{p}.transform.dense.bias",)),
            "transform_norm.weight": Source((f"{p}.transform.LayerNorm.weight",)),
            "transform_norm.bias": Source((f"{p}.transform.LayerNorm.bias",)),
            "decoder_bias": Source((f"{p}.bias",)),
        }

    def ignored_hf_names(self) -> list[str]:
        return ["cls.predictions.decoder.weight", "cls.predictions.decoder.bias"]  # tied copies

    def other_heads(self) -> list[str]:
        return ["bert.pooler.", "classifier."]


class BertClassifier(Bert):
    """Sequence classification: the first token's pooled state through a linear head. `model(input_ids,
    attention_mask=None, token_type_ids=None, labels=None)` returns `Output(loss, logits)`: cross entropy
    for `num_labels > 1`, mean squared error for one (regression), as HF's model does."""

    hf_architecture = "BertForSequenceClassification"

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> Output:
        pooled = torch.tanh(self.pooler(self.encode(input_ids, attention_mask, token_type_ids)[:, 0]))
        p = self.config.classifier_dropout
        logits = self.classifier(F.dropout(pooled, self.config.hidden_dropout_prob if p is None else p, self.training))
        loss = None
        if labels is not None:
            loss = (
                F.mse_loss(logits.squeeze(-1), labels.float())
                if self.config.num_labels == 1
                else F.cross_entropy(logits.float(), labels)
            )
        return Output(loss, logits)

    def hf_names(self) -> dict[str, Source]:
        return super().hf_names() | {
            "pooler.weight": Source(("bert.pooler.dense.weight",)),
            "pooler.bias": Source(("bert.pooler.dense.bias",)),
            "classifier.weight": Source(("classifier.weight",)),
            "classifier.bias": Source(("classifier.bias",)),
        }

    def head_parameters(self) -> list[str]:
        return ["pooler.weight", "pooler.bias", "classifier.weight", "classifier.bias"]

    def other_heads(self) -> list[str]:
        return ["cls."]  # a masked-LM checkpoint's head, when fine-tuning from one
