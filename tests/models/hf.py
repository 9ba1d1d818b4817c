"""Tiny random Hugging Face models, as users build them (`from_config`; nothing is downloaded), with
the inputs their documentation calls them with. Dropout is off so that a model split over ranks
and the same model on the whole batch see the same arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

transformers.logging.set_verbosity_error()

VOCAB = 96
DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def _configs() -> dict[str, Callable[[], transformers.PretrainedConfig]]:
    t = transformers
    return {
        "gpt2": lambda: t.GPT2Config(
            n_layer=2, n_embd=32, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
        ),
        "llama": lambda: t.LlamaConfig(**DECODER),
        "mistral": lambda: t.MistralConfig(**DECODER),
        "qwen2": lambda: t.Qwen2Config(**DECODER),
        "bert-mlm": lambda: _bert(),
        "bert-cls": lambda: _bert(num_labels=3),
        "t5": lambda: t.T5Config(
            num_layers=2,
            num_decoder_layers=2,
            d_model=32,
            d_ff=64,
            num_heads=4,
            d_kv=8,
            dropout_rate=0.0,
            decoder_start_token_id=0,
        ),
        "whisper": lambda: t.WhisperConfig(
            num_mel_bins=8,
            encoder_layers=2,
            decoder_layers=2,
            d_model=32,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_source_positions=16,  # input features of 2 x 16 frames
            max_target_positions=32,
            pad_token_id=1,
            bos_token_id=2,
            eos_token_id=2,
            decoder_start_token_id=2,
            suppress_tokens=[],
            begin_suppress_tokens=[],
        ),
        "mixtral": lambda: t.MixtralConfig(**DECODER, num_local_experts=4, num_experts_per_tok=2),
        "qwen2-moe": lambda: t.Qwen2MoeConfig(
            **DECODER,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    }


def _bert(**extra: Any) -> transformers.BertConfig:
    return transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        **extra,
    )


NAMES = list(_configs())


def config(name: str) -> transformers.PretrainedConfig:
    c = _configs()[name]()
    c.vocab_size = VOCAB
    return c


def build(name: str, seed: int = 0, **kwargs: Any) -> transformers.PreTrainedModel:
    """The model `name`, initialized from `seed`, as transformers' auto classes build it."""
    c = config(name)
    auto = {
        "bert-mlm": transformers.AutoModelForMaskedLM,
        "bert-cls": transformers.AutoModelForSequenceClassification,
        "t5": transformers.AutoModelForSeq2SeqLM,
        "whisper": transformers.AutoModelForSpeechSeq2Seq,
    }.get(name, transformers.AutoModelForCausalLM)
    torch.manual_seed(seed)
    return auto.from_config(c, **kwargs)


def inputs(name: str, step: int, batch: int = 4, seq: int = 8) -> dict[str, torch.Tensor]:
    """The keyword arguments of one training call, as the model's documentation writes it."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    if name == "bert-cls":
        return {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "labels": torch.randint(0, 3, (batch,), generator=g),
        }
    if name == "bert-mlm":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (batch, seq), generator=g)}
    if name == "t5":
        return {"input_ids": ids, "labels": torch.randint(3, VOCAB, (batch, seq // 2), generator=g)}
    if name == "whisper":  # log-mel features: num_mel_bins x 2 * max_source_positions
        features = torch.randn(batch, 8, 32, generator=g)
        return {"input_features": features, "labels": torch.randint(3, VOCAB, (batch, seq // 2), generator=g)}
    return {"input_ids": ids, "labels": ids}
