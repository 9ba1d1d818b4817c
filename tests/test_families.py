"""More Hugging Face model families, as users build and call them, against eager PyTorch: one process,
fp32, two SGD steps (the second on a padded batch), the loss and every parameter's gradient at each.

`tests/test_transformers.py` runs a few families in depth (several ranks, caches, `generate`); this
is the net for the others, whose attention, norms, rotary embeddings, routers and state-space layers
are each their own code in transformers. Tiny configs through `AutoConfig.for_model` (nothing is
downloaded); dropout and the routers' jitter noise off, as both draw numbers eager and fbmt draw
differently."""

from __future__ import annotations

import copy
import sys
import types
from typing import Any

import numpy as np
import pytest
import torch

import fbmt

transformers = pytest.importorskip("transformers")

VOCAB = 128
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
NO_DRAWS = dict.fromkeys(
    [
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "hidden_dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        "hidden_dropout_prob",
        "attention_probs_dropout_prob",
        "router_jitter_noise",
        "input_jitter_noise",
    ],
    0.0,
)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)

CAUSAL: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": dict(MOE, num_experts=4),
    "gemma": {},
    "gemma2": dict(sliding_window=4),  # transformers runs it with eager attention only
    "gemma3_text": dict(sliding_window=4),
    "phi": dict(partial_rotary_factor=0.5),
    "phi3": {},
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "olmo2": {},
    "gpt_neox": dict(rotary_pct=0.5),
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "stablelm": {},
    "granite": {},
    "cohere2": dict(sliding_window=4),
    "starcoder2": {},
    "deepseek_v3": dict(
        MOE,
        n_routed_experts=4,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        head_dim=8,
        num_key_value_heads=4,  # multi-head latent attention: a key and value per head
        n_group=1,
        topk_group=1,
    ),
    "gptj": dict(rotary_dim=8),
    "bloom": {},
    "mpt": {},
    "mamba": {},
    "doge": {},  # its dynamic mask's softplus: NOTE: [Strides a trace may not know]
    # hybrids of attention and recurrent layers, one of each (transformers' cache needs an attention layer)
    "qwen3_next": dict(
        MOE,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        shared_expert_intermediate_size=32,
    ),
    "bamba": dict(attn_layer_indices=[1], mamba_chunk_size=8),  # 2 chunks a call; 256 (its default) pads to 256
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=8),
}
MASKED = ["roberta", "electra", "deberta-v2", "modernbert", "distilbert", "albert"]
SEQ2SEQ = ["bart", "mbart", "pegasus", "marian"]
VISION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=32,
    patch_size=8,
    num_labels=3,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
    drop_path_rate=0.0,
)
IMAGE: dict[str, dict[str, Any]] = {
    "vit": {},
    "beit": dict(use_mask_token=False),
    "dinov2": {},
    "convnext": dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2),
    "resnet": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"),
}
CLASSIFIERS = ["llama", "qwen3", "gpt2", "roberta"]
ENCODER_DECODER = dict(
    d_model=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=128,
    decoder_ffn_dim=128,
    decoder_start_token_id=2,
    num_labels=3,
)


def _model(model_type: str, auto: Any) -> torch.nn.Module:
    extra = ENCODER_DECODER if model_type in SEQ2SEQ or auto is transformers.AutoModelForSequenceClassification else {}
    config = transformers.AutoConfig.for_model(
        model_type, **{**SMALL, **NO_DRAWS, **extra, **CAUSAL.get(model_type, {})}
    )
    torch.manual_seed(0)
    try:
        return auto.from_config(config, attn_implementation="sdpa")
    except ValueError:  # a family transformers runs with its eager attention only (Gemma 2)
        return auto.from_config(config, attn_implementation="eager")


def _padded(ids: torch.Tensor) -> torch.Tensor:
    """An attention mask of a batch padded on the left (row 0) and on the right (row 1)."""
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    return mask


def _calls(kind: str, g: torch.Generator) -> list[dict[str, torch.Tensor]]:
    """Two steps' calls as each head's documentation writes them: a language model's second step a
    padded batch (its pads' labels -100), a sequence-to-sequence model's a padded source, a classifier's
    a batch padded on the right with the pad token; an image classifier's, two batches of images."""
    calls = []
    for step in range(2):
        if kind == "image":
            calls.append(dict(pixel_values=torch.randn(2, 3, 32, 32, generator=g), labels=torch.tensor([0, 2])))
            continue
        if kind == "audio":
            calls.append(dict(input_values=torch.randn(2, 400 + 40 * step, generator=g), labels=torch.tensor([0, 2])))
            continue
        if kind == "ctc":  # a transcript a row, the shorter padded with -100 (as the CTC collators pad)
            labels = torch.randint(1, AUDIO["vocab_size"], (2, 6), generator=g)
            labels[1, 4 - step :] = -100
            audio = torch.randn(2, 400 + 40 * step, generator=g)
            call = dict(input_values=audio, labels=labels)
            if step:  # the second row's audio padded with zeros, as the feature extractor pads
                audio[1, 300:] = 0
                call["attention_mask"] = (audio != 0).long()
            calls.append(call)
            continue
        if kind == "speech":
            features = torch.randn(2, 16, 32, generator=g)
            calls.append(dict(input_features=features, labels=torch.randint(3, VOCAB, (2, 5 + 2 * step), generator=g)))
            continue
        if kind == "long":  # a masked language model of sparse attention: blocks enough to draw from
            ids = torch.randint(3, VOCAB, (2, 32), generator=g)
            calls.append(dict(input_ids=ids, labels=ids))
            continue
        ids = torch.randint(3, VOCAB, (3, 12), generator=g)
        mask = _padded(ids) if step else torch.ones_like(ids)
        if kind == "causal":
            call = dict(input_ids=ids, labels=ids.masked_fill(mask == 0, -100))
            calls.append(dict(call, attention_mask=mask) if step else call)
        elif kind == "masked":
            calls.append(dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)))
        elif kind == "seq2seq":
            calls.append(dict(input_ids=ids, attention_mask=mask, labels=ids[:, :6].contiguous()))
        else:  # a classifier: its pooling finds each row's last token that is not the pad token
            ids[1, 9:] = SMALL["pad_token_id"]
            right = torch.ones_like(ids)
            right[1, 9:] = 0
            calls.append(dict(input_ids=ids, attention_mask=right, labels=torch.tensor([0, 2, 1])))
    return calls


def _trains_like_eager(ref: torch.nn.Module, kind: str) -> None:
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step, call in enumerate(_calls(kind, torch.Generator().manual_seed(1))):
        losses, drawn = [], []
        for m in (ref, model):
            torch.manual_seed(step)  # a model with dropout on draws eager's masks
            np.random.seed(step)  # and one with SpecAugment on eager's spans (NOTE: [Host calls])
            losses.append(m(**call).loss)
            drawn.append(np.random.get_state()[1].copy())
        want, got = losses
        assert (drawn[0] == drawn[1]).all(), f"step {step}: numpy's generator is not where eager's call left it"
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"step {step}: the loss")
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            if p.grad is None:  # unused by the call (DINOv2's mask token): zeros (NOTE: [Unused parameters])
                assert grads[name] is None or not grads[name].any(), name
                continue
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    buffers = dict(model.named_buffers())  # what the forwards update (batch norm's running statistics)
    for name, b in ref.named_buffers():
        torch.testing.assert_close(buffers[name], b, msg=name)


@pytest.mark.parametrize("model_type", list(CAUSAL))
def test_a_causal_lm_of_this_family_trains_as_in_eager(model_type):
    _trains_like_eager(_model(model_type, transformers.AutoModelForCausalLM), "causal")


@pytest.mark.parametrize("model_type", ["mamba", "gemma2"])
def test_generate_with_a_cache_that_is_not_only_growing_tensors_gives_the_eager_tokens(model_type):
    """NOTE: [A cache that grows] traces a step of generation with the cache's length symbolic. Mamba's cache
    holds recurrent states (it has no length); a sliding window's layer (Gemma 2, window 4) counts its tokens
    in an int, which the step's program takes as a size (NOTE: [Numbers in an object]): a prompt's program
    and one for every next token."""
    ref = _model(model_type, transformers.AutoModelForCausalLM).eval()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = ref.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False), want)
    if model_type == "gemma2":
        assert len(model.programs) == 2, [str(p.sizes) for p in model.programs.values()]
        counted = list(model.programs.values())[1].numbers
        assert [path[-1] for _, path in counted] == [("attr", "cumulative_length")], counted


def test_generate_with_a_sliding_window_that_fills_gives_the_eager_tokens_and_cache():
    """Mistral with a window of 10 from a prompt of 6: the keys grow until the window is full, then keep
    its length while the layer's count goes on (NOTE: [Numbers in an object]). 30 new tokens compile a
    bounded set of programs (the window's edge is a program or two of its own), not one per token, and the
    cache generate returns holds eager's tensors and counts."""
    config = transformers.AutoConfig.for_model("mistral", **{**SMALL, **NO_DRAWS, "sliding_window": 10})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    call = dict(input_ids=ids, max_new_tokens=30, do_sample=False, return_dict_in_generate=True)
    want, got = ref.generate(**call), model.generate(**call)
    assert torch.equal(got.sequences, want.sequences)
    assert len(model.programs) <= 5, [str(p.sizes) for p in model.programs.values()]
    for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers):
        assert type(mine.cumulative_length) is int and mine.cumulative_length == theirs.cumulative_length
        torch.testing.assert_close(mine.keys, theirs.keys)


def test_generate_with_a_static_cache_of_sliding_windows_compiles_a_prompt_program_and_one_for_every_token():
    """A static cache keeps its tensors' shapes; its sliding window's layers count their tokens in an int
    (`cumulative_length_int`), which the first step's program takes as a size (NOTE: [Numbers in an object])."""
    ref = _model("gemma2", transformers.AutoModelForCausalLM).eval()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    call = dict(input_ids=ids, max_new_tokens=8, do_sample=False, cache_implementation="static")
    assert torch.equal(model.generate(**call), ref.generate(**call))
    assert len(model.programs) == 2, [str(p.sizes) for p in model.programs.values()]


def test_a_cache_built_by_a_program_of_symbolic_sizes_holds_eagers_counts():
    """Mistral called with use_cache=True at three lengths: the cache the symbolic program's forward builds
    counts its tokens in an int (its sliding window's layers), which came back as the trace's symbol."""
    config = transformers.AutoConfig.for_model("mistral", **{**SMALL, **NO_DRAWS, "sliding_window": 10})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
    for length in (6, 8, 12):
        ids = torch.randint(3, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            want, got = ref(input_ids=ids, use_cache=True), model(input_ids=ids, use_cache=True)
        torch.testing.assert_close(got.logits, want.logits)
        for mine, theirs in zip(got.past_key_values.layers, want.past_key_values.layers):
            assert type(mine.cumulative_length) is int and mine.cumulative_length == theirs.cumulative_length
            torch.testing.assert_close(mine.keys, theirs.keys)


@pytest.mark.parametrize("model_type", ["gpt2", "bert"])
def test_a_model_of_its_published_depth_trains_with_dropout_as_in_eager(model_type):
    """GPT-2 small's and BERT-base's 12 layers, dropout on as their configs have it: the shard pass
    once followed the forward's chain of layers from each dropout mask by recursion, past Python's
    limit. Both draw their masks as eager does, given the same seed."""
    causal = model_type == "gpt2"
    auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModelForMaskedLM
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=12, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    _trains_like_eager(auto.from_config(config, attn_implementation="sdpa"), "causal" if causal else "masked")


@pytest.mark.parametrize("model_type", MASKED)
def test_a_masked_lm_of_this_family_trains_as_in_eager(model_type):
    _trains_like_eager(_model(model_type, transformers.AutoModelForMaskedLM), "masked")


@pytest.mark.parametrize("model_type", SEQ2SEQ)
def test_a_sequence_to_sequence_lm_of_this_family_trains_as_in_eager(model_type):
    _trains_like_eager(_model(model_type, transformers.AutoModelForSeq2SeqLM), "seq2seq")


@pytest.mark.parametrize("model_type", list(IMAGE))
def test_an_image_classifier_of_this_family_trains_as_in_eager(model_type):
    """Patch embeddings, convolutions, and (ResNet) batch norm, whose running statistics the forward
    updates."""
    config = transformers.AutoConfig.for_model(model_type, **{**VISION, **IMAGE[model_type]})
    torch.manual_seed(0)
    _trains_like_eager(transformers.AutoModelForImageClassification.from_config(config), "image")


@pytest.mark.parametrize("model_type", CLASSIFIERS)
def test_a_sequence_classifier_of_this_family_trains_as_in_eager(model_type):
    _trains_like_eager(_model(model_type, transformers.AutoModelForSequenceClassification), "classifier")


AUDIO = dict(
    vocab_size=32,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    conv_dim=(16, 16),
    conv_stride=(5, 2),
    conv_kernel=(10, 3),
    num_conv_pos_embeddings=16,
    num_conv_pos_embedding_groups=4,
    num_labels=3,
    **dict.fromkeys(["hidden_dropout", "attention_dropout", "activation_dropout", "feat_proj_dropout"], 0.0),
    layerdrop=0.0,
)


WHISPER = dict(
    {**ENCODER_DECODER, **NO_DRAWS, "decoder_start_token_id": 1},
    vocab_size=VOCAB,
    num_mel_bins=16,
    max_source_positions=16,
    max_target_positions=32,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def test_an_audio_classifier_trains_as_in_eager_with_spec_augment_on():
    """wav2vec2's SpecAugment, on in training by default (mask_time_prob=0.05), draws its masked spans with
    numpy: refused once (NOTE: [Host draws]), it now runs on the host at every call (NOTE: [Host calls]),
    eager's spans given the same numpy seed; its learned embedding put where they fall (NOTE: [Masked
    assignment]) gets eager's gradient. The spans along the features too."""
    config = transformers.AutoConfig.for_model("wav2vec2", **AUDIO, mask_feature_prob=0.2, mask_feature_length=4)
    torch.manual_seed(0)
    _trains_like_eager(transformers.AutoModelForAudioClassification.from_config(config), "audio")


class _Lazy(types.ModuleType):
    """A package of transformers' that imports its submodules when an attribute it lacks is read."""

    def __getattr__(self, name):
        raise ImportError(f"{self.__name__} imported its submodules for {name!r}")


def test_host_calls_are_found_without_importing_transformers_lazy_packages(monkeypatch):
    """NOTE: [Host calls]: looking for SpecAugment's function in every loaded modeling module read an
    attribute of transformers' lazy packages, which then imported their submodules (transformers 5.17:
    Aria's image processor, which needs torchvision): the trace failed."""
    monkeypatch.setitem(sys.modules, "transformers.models.lazy_family", _Lazy("transformers.models.lazy_family"))
    config = transformers.AutoConfig.for_model("wav2vec2", **AUDIO)
    model = fbmt.compile(transformers.AutoModelForAudioClassification.from_config(config), cache_dir=False)
    model(input_values=torch.randn(2, 400), labels=torch.tensor([0, 2])).loss.backward()


def test_a_ctc_head_trains_as_in_eager_and_checks_its_labels_at_every_call():
    """wav2vec2's CTC head could not be traced: it checks `labels.max() >= vocab_size` in Python (NOTE:
    [Checks that raise]) and gathers its targets with `masked_select` (NOTE: [CTC's selected targets]).
    It trains as eager; labels past the vocabulary raise at the call, as eager raises."""
    config = transformers.AutoConfig.for_model("wav2vec2", **AUDIO)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCTC.from_config(config)
    _trains_like_eager(ref, "ctc")
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    bad = dict(input_values=torch.randn(2, 400), labels=torch.tensor([[1, 2], [3, AUDIO["vocab_size"]]]))
    with pytest.raises(ValueError, match="Label values must be"):
        ref(**bad)
    with pytest.raises(RuntimeError, match=r"raises in eager at .*modeling_wav2vec2.py:\d+: if labels is not None"):
        model(**bad)


@pytest.mark.parametrize("model_type", ["wavlm", "wav2vec2-conformer"])
def test_a_ctc_head_of_this_family_trains_as_in_eager(model_type):
    """The conformer writes its position table in place, so its trace is run again under functionalization:
    the label check's failed read, left in the first graph, failed that run (NOTE: [Checks that raise])."""
    config = transformers.AutoConfig.for_model(model_type, **AUDIO)
    torch.manual_seed(0)
    _trains_like_eager(transformers.AutoModelForCTC.from_config(config), "ctc")


def test_a_ctc_head_given_attention_masks_takes_one_program_for_every_length():
    """WavLM's label check, decided in the fake forward of a symbolic trace, left a value read there pending
    in the shape environment, which failed the trace: a program for each length. Lengths never traced run
    as eager."""
    config = transformers.AutoConfig.for_model("wavlm", **AUDIO, final_dropout=0.0)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCTC.from_config(config)
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    g = torch.Generator().manual_seed(0)
    for step, length in enumerate([400, 440, 480, 420]):
        audio = torch.randn(2, length, generator=g)
        audio[1, 300:] = 0
        call = dict(input_values=audio, attention_mask=(audio != 0).long(), labels=torch.tensor([[1, 2], [3, 4]]))
        losses = []
        for m in (ref, model):
            np.random.seed(step)
            losses.append(m(**call).loss)
        torch.testing.assert_close(losses[1], losses[0], msg=f"length {length}")
    assert len(model.programs) == 2


def test_wav2vec2_pretraining_trains_as_in_eager_as_its_documentation_calls_it():
    """Self-supervised pretraining as transformers documents it: the masked spans and the sampled negatives
    drawn with numpy outside the model and passed in; inside, the spans get the learned embedding (NOTE:
    [Masked assignment]), the quantizer draws Gumbel noise (torch's: eager's, seeded alike) and the loss
    sets negatives equal to their positive to -inf under `if neg_is_pos.any()` (NOTE: [Guards of masked
    writes]). Losses and gradients as eager's, two steps."""
    from transformers.models.wav2vec2.modeling_wav2vec2 import _compute_mask_indices, _sample_negative_indices

    config = transformers.AutoConfig.for_model(
        "wav2vec2", **AUDIO, num_codevectors_per_group=8, codevector_dim=16, proj_codevector_dim=16, num_negatives=4
    )
    torch.manual_seed(0)
    ref = transformers.Wav2Vec2ForPreTraining(config)
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    np.random.seed(0)
    for step in range(2):
        audio = torch.randn(2, 400)
        frames = int(ref._get_feat_extract_output_lengths(400))
        spans = _compute_mask_indices((2, frames), mask_prob=0.3, mask_length=2, min_masks=2)
        negatives = torch.tensor(_sample_negative_indices((2, frames), 4, spans))
        spans = torch.tensor(spans, dtype=torch.bool)
        losses = []
        for m in (ref, model):
            torch.manual_seed(step)
            losses.append(m(audio, mask_time_indices=spans, sampled_negative_indices=negatives).loss)
        torch.testing.assert_close(losses[1], losses[0], msg=f"step {step}: the loss")
        for loss in losses:
            loss.backward()
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=f"step {step}: {name}")
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_whisper_trains_as_in_eager():
    """Speech recognition's sequence-to-sequence model: log-mel features into convolutions, the decoder
    given labels of two lengths."""
    config = transformers.AutoConfig.for_model("whisper", **WHISPER)
    torch.manual_seed(0)
    _trains_like_eager(transformers.AutoModelForSpeechSeq2Seq.from_config(config), "speech")


def test_big_birds_random_attention_seeded_in_its_forward_trains_as_in_eager():
    """NOTE: [Host draws]: BigBird's block-sparse attention seeds numpy with the layer's index and draws its
    random blocks in every training call: the same blocks each call, constants a program can hold."""
    config = transformers.AutoConfig.for_model(
        "big_bird", **{**SMALL, **NO_DRAWS}, attention_type="block_sparse", block_size=2, num_random_blocks=2
    )
    torch.manual_seed(0)
    _trains_like_eager(transformers.AutoModelForMaskedLM.from_config(config), "long")


def test_a_router_that_reads_values_is_named_without_a_setting_it_lacks():
    """JetMoE's top-k gating reads its experts' sizes with `.tolist()`: the trace error names the router
    and does not suggest `experts_implementation`, which this family cannot set."""
    config = transformers.AutoConfig.for_model("jetmoe", **{**SMALL, **NO_DRAWS})
    model = fbmt.compile(transformers.AutoModelForCausalLM.from_config(config), cache_dir=False)
    ids = torch.randint(3, VOCAB, (2, 12))
    with pytest.raises(fbmt.TraceError, match=r"experts\.router' \(JetMoeTopKGating\)") as error:
        model(input_ids=ids, labels=ids)
    assert "experts_implementation" not in str(error.value), error.value


def test_layerdrop_is_named_with_the_setting_that_turns_it_off():
    """LayerDrop skips a layer where `torch.rand([])` falls under its probability, a Python `if` on a value:
    the trace error says which setting turns it off (transformers 5.17 drew it even at probability 0, and
    the error said only to rewrite the model's `if`)."""
    config = transformers.AutoConfig.for_model(
        "bart", **{**SMALL, **NO_DRAWS, **ENCODER_DECODER, "encoder_layerdrop": 0.3}
    )
    model = fbmt.compile(transformers.AutoModelForSeq2SeqLM.from_config(config), world_size=1, cache_dir=False)
    ids = torch.randint(3, VOCAB, (2, 8))
    with pytest.raises(fbmt.TraceError, match=r"LayerDrop .* probability 0\.3.*encoder_layerdrop"):
        model(input_ids=ids, labels=ids[:, :4])


def test_checkpointing_enabled_after_compile_trains_only_what_eager_trains():
    """NOTE: [Hugging Face's checkpointing]: Trainer(gradient_checkpointing=True, gradient_checkpointing_kwargs=
    {"use_reentrant": True}) enables it on the compiled model. With DINOv2's embeddings frozen, eager's
    reentrant checkpoints get no input that requires grad: the layers get no gradient and AdamW leaves
    them. The call changed nothing on a compiled model, whose program trained every layer, silently."""
    config = transformers.AutoConfig.for_model("dinov2", **VISION)
    torch.manual_seed(0)
    ref = transformers.AutoModelForImageClassification.from_config(config)
    ref.dinov2.embeddings.requires_grad_(False)
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    call = dict(
        pixel_values=torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), labels=torch.tensor([0, 2])
    )
    torch.testing.assert_close(model(**call).loss, ref(**call).loss)  # a first program, without checkpoints
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (ref, model)]
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):
        for _ in range(2):
            for m, opt in zip((ref, model), opts):
                m(**call).loss.backward()
                opt.step()
                opt.zero_grad()
    assert ref.dinov2.encoder.layer[0].mlp.fc1.weight.grad is None  # eager's own, as the docstring says
    state = model.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)


def test_unused_parameters_are_named_and_frozen_ones_train_as_in_eager(caplog):
    """NOTE: [Unused parameters]: DINOv2 called without `bool_masked_pos` reads no mask token. Eager leaves
    its `.grad` None and AdamW skips it; fbmt's shard gives it zeros, so weight decay would shrink it:
    the compile says so, naming it, and a model that froze it before `fbmt.compile` trains as eager."""
    config = transformers.AutoConfig.for_model("dinov2", **VISION)
    torch.manual_seed(0)
    ref = transformers.AutoModelForImageClassification.from_config(config)
    call = dict(
        pixel_values=torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)), labels=torch.tensor([0, 2])
    )
    with caplog.at_level("WARNING", logger="fbmt"):
        unfrozen = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
        unfrozen(**call).loss.backward()
    assert "does not use 1 trainable parameter: dinov2.embeddings.mask_token" in caplog.text, caplog.text
    assert "dinov2.embeddings.mask_token" in unfrozen.program.summary("shard")

    ref.dinov2.embeddings.mask_token.requires_grad_(False)
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (ref, model)]
    for _ in range(2):
        ref(**call).loss.backward()
        model(**call).loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    state = model.state_dict()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(state[name], p.detach(), rtol=1e-4, atol=1e-5, msg=name)
