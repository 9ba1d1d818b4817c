"""fbmt.models' zoo against Hugging Face: each model loads a tiny random HF checkpoint (saved with
`save_pretrained`) and gives HF's logits; what it saves HF loads; compiled on meta, it loads block
by block; a wrong folder is a clear error."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

import fbmt
from fbmt.models import GPT2, T5, BertClassifier, BertConfig, BertMLM, CheckpointError, Llama, load_tokenizer
from tests.dist import run_ranks
from tests.models import hf

ROOT = Path(__file__).resolve().parents[1]
ZOO = {"llama": Llama, "gpt2": GPT2, "bert-mlm": BertMLM, "bert-cls": BertClassifier, "t5": T5}


def _saved(name: str, folder, **config) -> torch.nn.Module:
    model = hf.build(name, **config).eval()
    model.save_pretrained(folder)
    return model


def _hf_logits(model, name: str, kwargs: dict) -> torch.Tensor:
    return model(**{k: v for k, v in kwargs.items() if k != "labels" or name == "t5"}).logits  # T5's decoder reads them


@pytest.mark.parametrize("name", list(ZOO))
def test_a_zoo_model_loads_a_hugging_face_folder_and_gives_its_logits(name, tmp_path):
    ref = _saved(name, tmp_path)
    model = ZOO[name].from_pretrained(str(tmp_path)).eval()
    kwargs = hf.inputs(name, 0)
    out = model(**kwargs)
    torch.testing.assert_close(out.logits, _hf_logits(ref, name, kwargs), rtol=0, atol=1e-5)
    torch.testing.assert_close(out.loss, ref(**kwargs).loss, rtol=0, atol=1e-5)
    # what it saves, transformers loads as the same model
    model.save_pretrained(str(tmp_path / "again"))
    back = type(ref).from_pretrained(str(tmp_path / "again")).eval()
    torch.testing.assert_close(_hf_logits(back, name, kwargs), _hf_logits(ref, name, kwargs), rtol=0, atol=1e-6)


def test_llama_variants_grouped_query_rope_scaling_bias_and_tied_embeddings(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    for i, extra in enumerate(
        [
            {"rope_scaling": {**scaling, "original_max_position_embeddings": 4}},
            {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
            {"attention_bias": True, "tie_word_embeddings": True},
        ]
    ):
        folder = tmp_path / str(i)
        torch.manual_seed(0)
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf.DECODER, vocab_size=hf.VOCAB, **extra)).eval()
        ref.save_pretrained(folder)
        model = Llama.from_pretrained(str(folder)).eval()
        ids = hf.inputs("llama", i)["input_ids"]
        torch.testing.assert_close(model(ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5, msg=str(extra))


@pytest.mark.parametrize("heads, kv_heads", [(4, 8), (6, 4), (4, 0)])
def test_a_llama_config_whose_query_heads_do_not_share_its_key_heads_evenly_is_refused(heads, kv_heads):
    """With 4 query heads and the default 8 key/value heads, each key head was repeated 4 // 8 = 0 times
    and eager torch computed a loss from attention over no keys at all."""
    from fbmt.models.llama import LlamaConfig

    with pytest.raises(ValueError, match=f"num_attention_heads={heads} is not a multiple of num_key_value_heads"):
        LlamaConfig(hidden_size=48, num_attention_heads=heads, num_key_value_heads=kv_heads)


def test_t5_v1_1_gated_gelu_untied_with_a_padding_mask(tmp_path):
    c = transformers.T5Config(
        num_layers=2,
        num_decoder_layers=1,
        d_model=32,
        d_ff=64,
        num_heads=4,
        d_kv=8,
        dropout_rate=0.0,
        vocab_size=hf.VOCAB,
        feed_forward_proj="gated-gelu",
        decoder_start_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    ref = transformers.T5ForConditionalGeneration(c).eval()
    ref.save_pretrained(tmp_path)
    model = T5.from_pretrained(str(tmp_path)).eval()
    kwargs = hf.inputs("t5", 0)
    mask = torch.ones_like(kwargs["input_ids"])
    mask[0, -3:] = 0
    want, got = ref(**kwargs, attention_mask=mask), model(**kwargs, attention_mask=mask)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)


def _compiled_from_meta(rank: int, world: int, folder: str) -> None:
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.device("meta"):
        model = Llama.from_pretrained(folder)  # reads the config and the index only
    model = fbmt.compile(model).eval()  # each block's tensors are read as the block is materialized
    kwargs = hf.inputs("llama", 0)
    torch.testing.assert_close(model(**kwargs).logits, ref(**kwargs).logits, rtol=0, atol=1e-5)
    model.save_pretrained(os.path.join(folder, "saved"))  # gathered from the shards; rank 0 writes
    torch.distributed.barrier()
    back = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(folder, "saved")).eval()
    torch.testing.assert_close(back(**kwargs).logits, ref(**kwargs).logits, rtol=0, atol=1e-6)


def test_compiled_on_meta_a_sharded_checkpoint_loads_block_by_block_and_saves_back(tmp_path):
    model = hf.build("llama").eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    run_ranks(2, _compiled_from_meta, str(tmp_path))


def test_a_wrong_folder_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        Llama.from_pretrained(str(tmp_path))
    _saved("gpt2", tmp_path / "gpt2")
    with pytest.raises(CheckpointError, match="lacks .* tensors Llama needs"):
        Llama.from_pretrained(str(tmp_path / "gpt2"))
    _saved("llama", tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    (tmp_path / "llama" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(CheckpointError, match="the model has .* \\(config.json and the weights disagree\\)"):
        Llama.from_pretrained(str(tmp_path / "llama"))
    os.remove(tmp_path / "llama" / "model.safetensors")
    with pytest.raises(CheckpointError, match="has neither model.safetensors nor"):
        Llama.from_pretrained(str(tmp_path / "llama"))
    _saved("bert-cls", tmp_path / "cls")
    with pytest.raises(CheckpointError, match="lacks 5 tensors BertMLM needs"):  # an MLM needs its head
        BertMLM.from_pretrained(str(tmp_path / "cls"))
    _saved("gpt2", tmp_path / "more")
    config = json.loads((tmp_path / "more" / "config.json").read_text())
    (tmp_path / "more" / "config.json").write_text(json.dumps({**config, "n_layer": 1}))
    with pytest.raises(CheckpointError, match="has no place for"):  # a layer more than the config says
        GPT2.from_pretrained(str(tmp_path / "more"))


def test_a_classifier_fine_tuned_from_a_masked_lm_checkpoint_gets_a_fresh_head(tmp_path, caplog):
    mlm = _saved("bert-mlm", tmp_path)
    with caplog.at_level("WARNING", logger="fbmt"):
        model = BertClassifier.from_pretrained(str(tmp_path))
    assert "4 parameters of its head are not in" in caplog.text and "not using another head's" in caplog.text
    torch.testing.assert_close(model.embeddings.word.weight, mlm.bert.embeddings.word_embeddings.weight)
    assert torch.isfinite(model.classifier.weight).all() and model.classifier.weight.std() > 0


def test_the_tokenizer_of_a_folder(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        ["a small test", "a test of a tokenizer"], trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    assert load_tokenizer(str(tmp_path)).encode("a test").ids == tok.encode("a test").ids
    with pytest.raises(CheckpointError, match="has no tokenizer.json"):
        load_tokenizer(str(tmp_path / "nothing"))


def test_a_zoo_model_trains_under_compile_as_eager(tmp_path):
    _saved("bert-cls", tmp_path)
    ref = BertClassifier.from_pretrained(str(tmp_path))
    model = fbmt.compile(copy.deepcopy(ref))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model)]
    for step in range(3):
        kwargs = hf.inputs("bert-cls", step)
        torch.manual_seed(step)
        want = ref(**kwargs).loss
        torch.manual_seed(step)
        got = model(**kwargs).loss
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want)
        for opt in opts:
            opt.step()
            opt.zero_grad()


def test_a_zoo_model_built_from_its_config_is_initialized_as_hf_initializes():
    model = BertMLM(BertConfig(vocab_size=hf.VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4))
    assert abs(model.embeddings.word.weight.std().item() - 0.02) < 0.005  # not nn.Embedding's N(0, 1)
    assert torch.equal(model.embeddings.word.weight[0], torch.zeros(32))  # the padding row
    kwargs = hf.inputs("bert-mlm", 0)
    assert abs(model(**kwargs).loss.item() - torch.log(torch.tensor(float(hf.VOCAB))).item()) < 0.5


def test_the_fine_tuning_example_beats_the_majority_class(tmp_path):
    """examples/finetune_bert.py on 2 ranks: pretrained folder made, loaded on meta, fine-tuned, evaluated."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(ROOT / "examples/finetune_bert.py")]
    args = ["--out", str(tmp_path / "bert"), "--pretrain-steps", "100", "--epochs", "5"]
    run = subprocess.run([*cmd, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.search(r"held-out accuracy ([\d.]+)% after \d+ steps; the majority class alone: ([\d.]+)%", run.stdout)
    assert found, run.stdout[-2000:]
    accuracy, majority = map(float, found.groups())
    assert accuracy > majority + 15, run.stdout[-2000:]
    assert (tmp_path / "bert" / "model.safetensors").exists() and (tmp_path / "bert" / "tokenizer.json").exists()


def test_a_save_that_fails_leaves_the_earlier_save_intact(tmp_path, monkeypatch):
    model = Llama.from_pretrained(str(_saved_folder(tmp_path)))
    model.save_pretrained(str(tmp_path / "out"))
    before = (tmp_path / "out" / "model.safetensors").read_bytes()
    import safetensors.torch

    def broken(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(str(tmp_path / "out"))
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]  # no temporary left


def _saved_folder(tmp_path):
    _saved("llama", tmp_path / "hf")
    return tmp_path / "hf"


def test_a_mistral_checkpoint_loads_as_llama_within_its_sliding_window(tmp_path):
    torch.manual_seed(0)
    ref = transformers.MistralForCausalLM(
        transformers.MistralConfig(**hf.DECODER, vocab_size=hf.VOCAB, sliding_window=8)
    ).eval()
    ref.save_pretrained(tmp_path)
    model = Llama.from_pretrained(str(tmp_path)).eval()
    ids = hf.inputs("mistral", 0)["input_ids"]  # 8 tokens: within the window
    torch.testing.assert_close(model(ids).logits, ref(input_ids=ids).logits, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="exceed the config's sliding_window of 8"):
        model(torch.cat([ids, ids], dim=1))
