"""GPT-2: learned positions, pre-norm blocks, fused q/k/v, causal `scaled_dot_product_attention`, tied
output embedding. Loads and saves Hugging Face `GPT2LMHeadModel` folders (`fbmt.models.pretrained`),
whose Conv1D weights are stored transposed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fbmt.models.llama import Output
from fbmt.models.pretrained import PretrainedModel, Source, split_config


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # default: 4 * n_embd
    layer_norm_epsilon: float = 1e-5
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    initializer_range: float = 0.02
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> GPT2Config:
        required = {
            "activation_function": "gelu_new",
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
        }
        return split_config(cls, hf, "GPT2", required)

    def to_hf(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {**self.extra, **out, "model_type": "gpt2", "activation_function": "gelu_new"}


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        d, inner = cfg.n_embd, cfg.n_inner or 4 * cfg.n_embd
        self.cfg, self.n_head = cfg, cfg.n_head
        self.ln_1 = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d, eps=cfg.layer_norm_epsilon)
        self.fc = nn.Linear(d, inner)
        self.fc_proj = nn.Linear(inner, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, s, 3, self.n_head, d // self.n_head).permute(2, 0, 3, 1, 4)
        drop = self.cfg.attn_pdrop if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=drop).transpose(1, 2).reshape(b, s, d)
        x = x + F.dropout(self.proj(y), self.cfg.resid_pdrop, self.training)
        h = self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate="tanh"))
        return x + F.dropout(h, self.cfg.resid_pdrop, self.training)


class GPT2(PretrainedModel):
    """A causal language model: `model(input_ids, labels=None)` returns `Output(loss, logits)`, the loss
    as HF's `GPT2LMHeadModel` computes it (labels shifted inside, -100 ignored)."""

    config_class = GPT2Config
    hf_architecture = "GPT2LMHeadModel"

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.init_weights()

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = F.dropout(self.wte(input_ids) + self.wpe(pos), self.config.embd_pdrop, self.training)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return Output(loss, logits)

    def init_module(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def hf_names(self) -> dict[str, Source]:
        t = "transformer"
        names = {
            "wte.weight": Source((f"{t}.wte.weight",)),
            "wpe.weight": Source((f"{t}.wpe.weight",)),
            "ln_f.weight": Source((f"{t}.ln_f.weight",)),
            "ln_f.bias": Source((f"{t}.ln_f.bias",)),
        }
        ours_to_hf = {"ln_1": "ln_1", "qkv": "attn.c_attn", "proj": "attn.c_proj", "ln_2": "ln_2"}
        ours_to_hf |= {"fc": "mlp.c_fc", "fc_proj": "mlp.c_proj"}
        for i in range(self.config.n_layer):
            for ours, hf in ours_to_hf.items():
                conv = not ours.startswith("ln")  # GPT-2's Conv1D keeps (in, out): the transpose of a Linear's
                names[f"h.{i}.{ours}.weight"] = Source((f"{t}.h.{i}.{hf}.weight",), transpose=conv)
                names[f"h.{i}.{ours}.bias"] = Source((f"{t}.h.{i}.{hf}.bias",))
        return names

    def ignored_hf_names(self) -> list[str]:
        return ["lm_head.weight"]  # tied to the token embedding
