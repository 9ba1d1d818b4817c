"""A model built on `meta` and compiled is initialized as `from_config` initializes it (issue 34): for every
transformers family the tests use, each tensor's statistics are within sampling error of eager's, and a
tensor that does not depend on the seed (a sinusoidal table, ones, zeros, position ids) is exactly eager's.
NOTE: [Materializing shard by shard]: the model's `_init_weights` runs as `model.apply` would reach each
block, ancestors included (Whisper's encoder sets its positions, CLIP's attention its projections' scale)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

import fbmt
from tests.models import hf

_IDS = dict(pad_token_id=1, bos_token_id=2, eos_token_id=2)
EXTRA = {
    "clip-text": (
        transformers.CLIPTextModel,
        lambda: transformers.CLIPTextConfig(
            vocab_size=hf.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=16,
            **_IDS,
        ),
    ),
}


def _eager(name: str, seed: int) -> torch.nn.Module:
    if name in EXTRA:
        cls, config = EXTRA[name]
        torch.manual_seed(seed)
        return cls(config())
    return hf.build(name, seed=seed)


def _on_meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):
        return _eager(name, 0)


@pytest.mark.parametrize("name", [*hf.NAMES, *EXTRA])
def test_a_model_built_on_meta_is_initialized_as_from_config_initializes_it(name):
    one, other = _eager(name, 0).state_dict(), _eager(name, 1).state_dict()
    torch.manual_seed(123)
    got = fbmt.compile(_on_meta(name)).state_dict()
    assert got.keys() == one.keys()
    for k, want in one.items():
        g = got[k]
        assert g.shape == want.shape and g.dtype == want.dtype, k
        if torch.equal(want, other[k]):  # the same whatever the seed: computed, not drawn
            assert torch.equal(g, want), f"{k}: eager computes it; fbmt's differs"
            continue
        n = want.numel()
        sigma = float(want.double().std()) if n > 1 else 0.0
        mean_err = abs(float(g.double().mean()) - float(want.double().mean()))
        std_err = abs(float(g.double().std()) - sigma) if n > 1 else 0.0
        assert mean_err <= 6 * sigma / math.sqrt(n) + 1e-6, (
            f"{k}: mean {float(g.double().mean()):.4g} against {float(want.double().mean()):.4g}"
        )
        assert std_err <= 6 * sigma / math.sqrt(2 * n) + 1e-6, (
            f"{k}: std {float(g.double().std()):.4g} against {sigma:.4g}"
        )
