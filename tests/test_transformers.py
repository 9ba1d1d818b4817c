"""Hugging Face `transformers` models as users run them, compiled by fbmt and compared with eager.

Every model is called exactly as its documentation writes it (`model(input_ids=..., labels=...)`,
`use_cache` left at the config's default), from tiny random configs (`tests/models/hf.py`)."""

from __future__ import annotations

import copy
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import transformers

import fbmt
from fbmt.compiler.objects import DroppedCache
from tests.dist import run_ranks
from tests.models import hf

ROOT = Path(__file__).resolve().parents[1]


def _local(kwargs: dict, rank: int, world: int) -> dict:
    return {k: fbmt.local_part(v) if v.dim() else v for k, v in kwargs.items()}


def _trains_as_eager(rank: int, world: int, name: str, dtype: torch.dtype, cache: bool = True) -> str:
    ref = hf.build(name).to(dtype)
    model = fbmt.compile(copy.deepcopy(ref), **({} if cache else {"cache_dir": False}))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for step in range(3):
        kwargs = hf.inputs(name, step)
        want = ref(**kwargs).loss  # the whole batch
        got = model(**_local(kwargs, rank, world)).loss  # this rank's part of it
        want.backward()
        got.backward()
        mean = got.detach().clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / world, want.detach(), **tol, msg=f"{name} step {step} loss")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[model.layout.aliases.get(n, n)], p.detach(), **tol, msg=f"{name}: {n}")
    return str(model.program.stats("loss"))  # what became of the model's loss (tests/passes/test_loss.py)


@pytest.mark.parametrize("name", hf.NAMES)
def test_each_model_called_as_documented_trains_as_eager_on_two_ranks(name):
    run_ranks(2, _trains_as_eager, name, torch.float32)


def _padded_labels_train_as_eager(rank: int, world: int) -> None:
    """Labels padded with -100, more on rank 1's part: each rank's mean over its own tokens, averaged over
    ranks as the gradients are, is not the mean over the whole batch's tokens; HF's loss summed over the
    rank's tokens and divided by `num_items_in_batch` = the batch's count / world size is (README)."""
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref))
    kwargs = hf.inputs("llama", 0)
    labels = kwargs["labels"].clone()
    labels[2:, 3:] = -100  # the last two rows, rank 1's part
    kwargs["labels"] = labels
    count = (labels[:, 1:] != -100).sum()  # the tokens the shifted loss counts
    ref(**kwargs).loss.backward()
    local = _local(kwargs, rank, world)
    model(**local).loss.backward()
    mean_of_means = model.full_gradients()["model.embed_tokens.weight"]
    assert not torch.allclose(mean_of_means, ref.model.embed_tokens.weight.grad, rtol=1e-3, atol=1e-5)
    model.zero_grad()
    model(**local, num_items_in_batch=count / world).loss.backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[model.layout.aliases.get(n, n)], p.grad, rtol=1e-5, atol=1e-6, msg=n)


def test_padded_labels_give_one_process_gradients_with_the_batch_count():
    run_ranks(2, _padded_labels_train_as_eager)


@pytest.mark.parametrize("name", ["mixtral", "llama"])
def test_bf16_models_train_as_eager(name):
    """Mixture of experts with transformers' default grouped_mm experts, in bf16 as in fp32."""
    run_ranks(2, _trains_as_eager, name, torch.bfloat16)


def _generates(rank: int, world: int, name: str) -> None:
    ref = hf.build(name).eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    prompt = hf.inputs(name, 0, batch=2, seq=5)["input_ids"]
    want = ref.generate(prompt, max_new_tokens=4, do_sample=False)
    got = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, want), (got, want)


def _generates_prompts_of_its_own(rank: int, world: int) -> None:
    ref = hf.build("llama").eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    prompt = hf.inputs("llama", rank, batch=1, seq=5 + 2 * rank)["input_ids"]  # each rank its own
    tokens = ref.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=None)[0, prompt.shape[1] :]
    # rank 1's sequence ends at its first token, rank 0's never: rank 1 is done three calls before rank 0
    eos = int(tokens[0]) if rank == 1 else next(t for t in range(hf.VOCAB) if t not in tokens.tolist())
    want = ref.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=0)
    got = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(got, want), (rank, got, want)
    # what Seq2SeqTrainer's predict_with_generate reads to keep a finished rank generating too
    assert transformers.integrations.fsdp.is_fsdp_managed_module(model)


def test_generate_on_ranks_whose_sequences_end_apart_gives_the_eager_tokens():
    """NOTE: [Generation on every rank]: a rank whose sequences ended first stopped calling the model, and
    the others waited in their next call until the timeout; transformers keeps it calling, as for ZeRO-3."""
    run_ranks(2, _generates_prompts_of_its_own)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_generate_runs_the_compiled_program_and_gives_the_eager_tokens(name):
    run_ranks(2, _generates, name)


def test_generate_with_a_static_cache_compiles_two_programs():
    """A StaticCache keeps its shape (the forward writes into it in place): one program reads the prompt,
    one every next token."""
    ref = hf.build("llama").eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    prompt = hf.inputs("llama", 0, batch=2, seq=5)["input_ids"]
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    got = model.generate(prompt, max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want), (got, want)
    assert len(model.programs) == 2


def _generates_from_an_encoder(rank: int, world: int, name: str) -> None:
    ref = hf.build(name).eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    inputs = {k: v[:2] for k, v in hf.inputs(name, 0).items() if k != "labels"}
    how = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, output_scores=True, return_dict_in_generate=True)
    want, got = ref.generate(**inputs, **how), model.generate(**inputs, **how)
    assert torch.equal(got.sequences, want.sequences), (got.sequences, want.sequences)
    for a, b in zip(want.scores, got.scores):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    encoder = {"t5": "encoder", "whisper": "model.encoder"}[name]
    assert [p.entry for p in model.programs.values()].count(encoder) == 1  # generate's model.get_encoder()(...)
    # generate() keeps the keyword arguments the encoder's forward names: it reads the class's signature
    taken = model.get_encoder()
    assert inspect.signature(taken.forward) == inspect.signature(type(taken).forward.__get__(taken))


@pytest.mark.parametrize("name", ["t5", "whisper"])
def test_encoder_decoder_generate_runs_the_encoder_as_a_program_and_gives_the_eager_tokens(name):
    """generate() calls `model.get_encoder()(...)` before the decoder steps (Whisper's from a method that
    calls super(), which needs the compiled model to be an instance of the model's class)."""
    run_ranks(2, _generates_from_an_encoder, name)


@pytest.mark.parametrize("name", ["bart", "whisper", "t5"])
def test_encoder_decoder_generate_compiles_one_decoder_program_for_every_step_past_the_second(name):
    """An encoder-decoder's cache (`EncoderDecoderCache`) grows in its self-attention part (NOTE: [A cache that
    grows]): from the third step one program serves every length up to the decoder's longest position (T5,
    whose positions are relative, names none: `_UNNAMED_LONGEST`). The first step's cache is empty and the
    second's holds one token, a size traced as a constant: 3 decoder programs for 20 tokens, where one per
    fourfold made 4."""
    from tests import test_families as fam

    if name in ("whisper", "t5"):  # the families' T5 keeps T5Config's 6 decoder layers beside 2 encoder
        # layers, for which eager generate() sizes its cache wrong (an IndexError in transformers)
        ref = hf.build(name).eval()
        inputs = {k: v[:2] for k, v in hf.inputs(name, 0).items() if k != "labels"}
    else:
        ref = fam._model(name, transformers.AutoModelForSeq2SeqLM).eval()
        inputs = {"input_ids": torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0))}
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False).eval()
    how = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    want, got = ref.generate(**inputs, **how), model.generate(**inputs, **how)
    assert torch.equal(got, want), (got, want)
    decoder = [p for p in model.programs.values() if "encoder" not in p.entry]
    assert len(decoder) == 3, [str(p.sizes) for p in decoder]


def _submodules_run_over_the_shards(rank: int, world: int) -> None:
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    for step in range(2):  # what prompt tuning and multimodal models do: build inputs_embeds, then call the model
        kwargs = hf.inputs("llama", step)
        for m, opt, part in ((ref, opts[0], lambda v: v), (model, opts[1], fbmt.local_part)):
            embeds = m.get_input_embeddings()(part(kwargs["input_ids"])) * 1.5
            m(inputs_embeds=embeds, labels=part(kwargs["labels"])).loss.backward()
            opt.step()
            opt.zero_grad()
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    h, ids = torch.randn(2, 3, 32), hf.inputs("llama", 5)["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model.lm_head(h), ref.lm_head(h))
        torch.testing.assert_close(model.compiled_from(input_ids=ids).logits, ref(input_ids=ids).logits)
    head = next(p for p in model.programs.values() if p.entry == "lm_head")
    assert "1 all-gathers" in str(head) and "`lm_head`" in str(head)  # only the group lm_head reads
    twin = copy.deepcopy(model)  # an EMA twin's submodules run over the twin's shards
    before = len(model.programs)
    with torch.no_grad():
        twin.flat_params[-1].zero_()
        assert twin.compiled_from.get_submodule("lm_head")(h).abs().max() == 0 < model.lm_head(h).abs().max()
    assert len(model.programs) == before


def test_a_submodule_called_on_its_own_runs_as_a_program_over_the_shards():
    """`model.get_input_embeddings()(ids)` with gradients trains as eager (two programs, one backward);
    `model.lm_head(h)` and the taken-over model computed as eager; each runs over its own model's shards."""
    run_ranks(2, _submodules_run_over_the_shards)


def test_a_submodule_whose_instance_has_its_own_forward_is_refused_where_it_is_called():
    ref = hf.build("llama")
    head = ref.lm_head
    head.forward = lambda h: nn.Linear.forward(head, h)  # a library's hook does this
    model = fbmt.compile(ref, world_size=1, cache_dir=False)
    with pytest.raises(
        RuntimeError, match=r"`lm_head` \(Linear\) of a compiled LlamaForCausalLM was called on its own"
    ):
        model.lm_head(torch.randn(2, 3, 32))
    ids = hf.inputs("llama", 0)["input_ids"]
    assert model(input_ids=ids).logits.shape == (*ids.shape, hf.VOCAB)  # the model's own call traces it


def test_the_compiled_class_derives_from_the_models_class_and_finds_every_name_as_before():
    """NOTE: [The wrapped class as a base]: deriving from the model's class lets its super() calls run,
    and must change no lookup: a name the compiler's class has is the compiler's (nn.Module's `cuda`, not
    PreTrainedModel's), any other the model's, bound to the compiled model."""
    from fbmt.api import _Compiled

    model = fbmt.compile(hf.build("whisper"), world_size=1, cache_dir=False)
    cls, wrapped = type(model), type(model.compiled_from)
    assert isinstance(model, wrapped) and isinstance(model, transformers.GenerationMixin)
    overridden = 0
    for name in dir(wrapped):
        if name.startswith("__") or name == "forward":  # forward: the compiled one, with the model's signature
            continue
        own = inspect.getattr_static(_Compiled, name, None)
        if own is not None:
            overridden += inspect.getattr_static(wrapped, name) is not own
            assert inspect.getattr_static(cls, name) is own, name
    assert overridden > 5  # PreTrainedModel overrides some of nn.Module's (`cuda`, `float`, `to`, ...)
    assert model.prepare_inputs_for_generation.__func__ is wrapped.prepare_inputs_for_generation
    assert model.config is model.compiled_from.config and model.main_input_name == "input_features"


def test_the_cache_of_an_inference_call_holds_the_real_keys_and_values():
    ref = hf.build("llama").eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    ids = hf.inputs("llama", 0)["input_ids"]
    with torch.no_grad():
        want, got = ref(input_ids=ids), model(input_ids=ids)
    assert type(got.past_key_values) is type(want.past_key_values)
    for a, b in zip(want.past_key_values.layers, got.past_key_values.layers):
        assert type(b.keys) is torch.Tensor  # not a fake left from tracing
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values)
    # fed back, as generate() does: the caller's cache grows in place, and the logits are eager's
    step = torch.randint(3, hf.VOCAB, (ids.shape[0], 1))
    cache = got.past_key_values
    with torch.no_grad():
        want2 = ref(input_ids=step, past_key_values=want.past_key_values)
        got2 = model(input_ids=step, past_key_values=cache)
    assert got2.past_key_values is cache and cache.get_seq_length() == ids.shape[1] + 1
    torch.testing.assert_close(got2.logits, want2.logits)
    with torch.no_grad():  # the same by the keyword transformers 5 names it (`past_key_values` is deprecated)
        want3 = ref(input_ids=step, cache=want.past_key_values)
        got3 = model(input_ids=step, cache=cache)
    assert got3.past_key_values is cache and cache.get_seq_length() == ids.shape[1] + 2
    torch.testing.assert_close(got3.logits, want3.logits)


def test_a_training_call_drops_the_cache_it_built_and_says_so():
    model = fbmt.compile(hf.build("llama"))
    kwargs = hf.inputs("llama", 0)
    out = model(**kwargs)
    assert isinstance(out.past_key_values, DroppedCache)
    with pytest.raises(RuntimeError, match="pass use_cache=True"):
        out.past_key_values.get_seq_length()
    assert "dropped the DynamicCache" in str(model.program)
    out.loss.backward()


def test_use_cache_true_in_a_training_call_keeps_a_differentiable_cache():
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref))
    kwargs = hf.inputs("llama", 0)
    want, got = ref(**kwargs, use_cache=True), model(**kwargs, use_cache=True)
    # a gradient through the cache's keys reaches the parameters, as in eager
    (want.loss + want.past_key_values.layers[1].keys.sum()).backward()
    (got.loss + got.past_key_values.layers[1].keys.sum()).backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-5, msg=n)


def test_tensors_made_inside_forward_are_inputs_of_the_program():
    class Shift(nn.Module):  # what T5's _shift_right does: an in-place write of a Python scalar (torch 2.13
        # traces it as a tensor constant, 2.15 as a fill), and a tensor made from Python values
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            x = x.clone()
            x[:, 0] = 1.5
            x[:, 1] = torch.tensor([0.5, -1.0, 2.0])
            return self.fc(x).sum()

    torch.manual_seed(0)
    ref = Shift()
    model = fbmt.compile(copy.deepcopy(ref))
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), ref(x))
    text, constants = str(model.program), model.program.stats("trace").constants
    assert "input constant[_tensor_constant0]" in text
    assert 1 <= len(constants) == text.count("= input constant["), model.program.summary("trace")


def test_num_parameters_counts_the_models_parameters():
    """`num_parameters()` counted the flat shards: this rank's part, embeddings not told apart (NOTE:
    [Adapters loaded by name])."""
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref))
    for kwargs in ({}, {"exclude_embeddings": True}, {"only_trainable": True}):
        assert model.num_parameters(**kwargs) == ref.num_parameters(**kwargs), kwargs


def test_forward_presents_the_models_signature():
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref))
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert "input_ids" in inspect.signature(model.forward).parameters
    assert model.config is model.compiled_from.config and model.device == torch.device("cpu")
    assert model.main_input_name == "input_ids" and model.can_generate()


def _trainer_saves_and_resumes(rank: int, world: int, folder: str, lora: bool) -> list[float]:
    import shutil

    import peft

    sys.path.insert(0, str(ROOT / "examples"))
    from hf_trainer import Counting

    def run(resume: bool) -> tuple[transformers.Trainer, torch.nn.Module]:
        torch.manual_seed(0)
        model = hf.build("llama")
        if lora:  # Trainer resumes it with peft's load_adapter
            model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        model = fbmt.compile(model)
        args = transformers.TrainingArguments(
            output_dir=folder, per_device_train_batch_size=2, max_steps=6, learning_rate=1e-3, save_steps=3,
            logging_steps=1, report_to=[], seed=0, disable_tqdm=True, use_cpu=True, dataloader_drop_last=True,
        )  # fmt: skip
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Counting(2 * 6 * world, 8, hf.VOCAB))
        trainer.train(resume_from_checkpoint=f"{folder}/checkpoint-3" if resume else None)
        return trainer, model

    _, whole = run(resume=False)  # saves at steps 3 and 6: before, rank 0 waited in the state dict's gather
    want = whole.full_parameters()
    torch.distributed.barrier()
    if rank == 0:
        shutil.rmtree(f"{folder}/checkpoint-6")
    torch.distributed.barrier()
    trainer, resumed = run(resume=True)  # each rank its own optimizer state
    got = resumed.full_parameters()
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, msg=f"rank {rank}: {name}")
    if not lora:
        saved = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/checkpoint-3")  # what Trainer wrote
        assert set(saved.state_dict()) >= set(want)
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("lora", [False, True], ids=["", "lora"])
def test_trainer_checkpoints_save_and_resume_on_two_ranks(tmp_path, lora):
    """NOTE: [Trainer checkpoints]: Trainer saving every `save_steps` waited forever on rank 0 (the state
    dict gathers from every rank, and only rank 0 asked), and a resume gave every rank rank 0's optimizer
    state; a LoRA run resumed its adapters from their initial values (NOTE: [Adapters loaded by name]). A
    run saved at step 3 and resumed there ends with the parameters of the run that went through."""
    losses = run_ranks(2, _trainer_saves_and_resumes, str(tmp_path), lora)
    assert len(losses[0]) == 6 and losses[0] == losses[1]


@pytest.mark.parametrize("offload", [False, True], ids=["", "offload"])
def test_the_trainer_example_matches_eager_ddp(offload):
    """examples/hf_trainer.py: transformers.Trainer on 2 ranks, 2 micro-batches per step; --check trains
    eager DDP and compares. accelerate runs the first micro-batch under no_sync(): one gradient reduction
    per flat group per optimizer step; Trainer's weight decay skips biases and norm weights inside the flat
    shards (NOTE: [Decay split inside flat shards]). --offload: shards in host memory, stepped by
    AdamOffloadOptimizer (built on the shards: no decay split)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "examples/hf_trainer.py"]
    run = subprocess.run(
        [
            *cmd,
            "--steps",
            "6",
            "--accumulate",
            "2",
            "--check",
            *(["--offload", "--weight-decay", "0"] if offload else ["--weight-decay", "0.1"]),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "check: max loss difference" in run.stdout, run.stdout[-2000:]
    said = re.search(r"gradient reductions per optimizer step: ([\d.]+) \((\d+) flat groups\)", run.stdout)
    assert said and float(said.group(1)) == int(said.group(2)), run.stdout[-2000:]


def test_accelerate_mixed_precision_is_refused_with_what_to_do():
    accelerate = pytest.importorskip("accelerate")
    model = fbmt.compile(hf.build("llama"))
    assert model._is_accelerate_prepared  # so accelerate does not wrap it in DDP
    accelerate.state.AcceleratorState._reset_state()
    try:
        accelerate.Accelerator(mixed_precision="bf16", cpu=True)
        with pytest.raises(RuntimeError, match="param_dtype=torch.bfloat16"):
            accelerate.Accelerator().prepare_model(model)
    finally:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_eager_experts_name_the_setting_fbmt_can_trace():
    model = fbmt.compile(hf.build("mixtral", experts_implementation="eager"))
    with pytest.raises(fbmt.TraceError, match='experts_implementation="grouped_mm"'):
        model(**hf.inputs("mixtral", 0))


@pytest.mark.parametrize("name", ["llama", "bert-mlm", "t5"])
def test_a_model_built_on_meta_is_initialized_by_its_own_init_weights(name):
    ref = hf.build(name)
    with torch.device("meta"):
        meta = hf.build(name)
    model = fbmt.compile(meta)
    for (n, a), (_, b) in zip(ref.named_buffers(), model.named_buffers()):  # rotary inv_freq, position_ids
        assert torch.equal(a, b), n
    for n, p in model.full_parameters().items():
        assert torch.isfinite(p).all(), n
    model.load_state_dict(ref.state_dict())
    kwargs = hf.inputs(name, 0)
    torch.testing.assert_close(model(**kwargs).loss, ref(**kwargs).loss)


def _trainer_run(model: torch.nn.Module, out: str, name: str, **kwargs: Any) -> torch.nn.Module:
    data = [{k: v[0] for k, v in hf.inputs(name, i, batch=1).items()} for i in range(3)]
    defaults = dict(max_steps=3, learning_rate=0.05, per_device_train_batch_size=1, weight_decay=0.5)
    args = transformers.TrainingArguments(
        output_dir=out, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, **{**defaults, **kwargs}
    )
    transformers.Trainer(model=model, args=args, train_dataset=data).train()
    return model


@pytest.mark.parametrize(("name", "optim"), [("gpt2", "adamw_torch_fused"), ("llama", "adamw_torch")])
def test_trainers_decay_split_is_kept_inside_flat_shards(tmp_path, name, optim):
    """NOTE: [Decay split inside flat shards]: Trainer decays all but biases and norm weights, which share
    a flat shard with the matrices; fbmt decays the shard's matrices before each step, and the run equals
    eager (in float64, to the last digits: a bias or norm decayed, or a matrix not, is off by 1e-3)."""
    ref = _trainer_run(hf.build(name).double(), str(tmp_path), name, optim=optim)
    model = _trainer_run(fbmt.compile(hf.build(name).double()), str(tmp_path), name, optim=optim)
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-9, msg=n)


def test_trainer_given_an_optimizer_built_before_compile_trains_as_eager(tmp_path):
    """NOTE: [Optimizers built before compiling]: a script builds AdamW with its own decay split by name on
    the model's parameters, then compiles, and hands the optimizer to Trainer; the run equals eager's."""

    def run(compile_it: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = hf.build("llama").double()
        named = list(model.named_parameters())
        exempt = ("bias", "norm")
        opt = torch.optim.AdamW(
            [
                {"params": [p for n, p in named if not any(k in n for k in exempt)], "weight_decay": 0.5},
                {"params": [p for n, p in named if any(k in n for k in exempt)], "weight_decay": 0.0},
            ],
            lr=0.05,
        )
        model = fbmt.compile(model) if compile_it else model
        data = [{k: v[0] for k, v in hf.inputs("llama", i, batch=1).items()} for i in range(3)]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True,
            max_steps=3, per_device_train_batch_size=1, lr_scheduler_type="constant",
        )  # fmt: skip
        transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None)).train()
        return model

    ref, full = run(False), run(True).full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=0, atol=1e-9, msg=n)


def test_an_l2_decay_split_inside_flat_shards_is_refused(tmp_path):
    """SGD adds the decay to the gradient inside its step, where fbmt cannot keep a shard's norms out."""
    with pytest.raises(RuntimeError, match=r"SGD adds weight decay to the gradient .* Use torch's AdamW"):
        _trainer_run(fbmt.compile(hf.build("llama")), str(tmp_path), "llama", optim="sgd")


def test_a_decay_split_by_name_in_a_script_is_refused():
    """A script that splits `model.named_parameters()` by name sees flat shards: its weight_decay=0 group
    (biases and norms) comes out empty, and they would decay, unlike eager."""
    model = fbmt.compile(hf.build("gpt2"))
    no_decay = ("bias", "ln_")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups)
    model(**hf.inputs("gpt2", 0)).loss.backward()
    with pytest.raises(RuntimeError, match="weight_decay=0 group .* is empty"):
        opt.step()
    torch.optim.AdamW(model.parameters(), weight_decay=0.01).step()  # every parameter decayed on purpose


def _accelerate_saves_and_resumes(rank: int, world: int, folder: str) -> None:
    """accelerate's own recipe: prepare, train, `save_state`; a new run `load_state`s and trains on."""
    import accelerate

    def run(steps: range, resume: bool) -> torch.nn.Module:
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        accelerator = accelerate.Accelerator(cpu=True)
        torch.manual_seed(0)
        model = fbmt.compile(hf.build("llama"))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, opt = accelerator.prepare(model, opt)
        if resume:
            accelerator.load_state(folder)
        for step in steps:
            model(**hf.inputs("llama", 10 * step + rank)).loss.backward()
            opt.step()
            opt.zero_grad()
            if step == 2 and not resume:
                accelerator.save_state(folder)
        return model

    want = run(range(6), resume=False).full_parameters()
    got = run(range(3, 6), resume=True).full_parameters()
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, msg=f"rank {rank}: {name}")


def test_accelerate_save_state_resumes_each_ranks_optimizer_on_two_ranks(tmp_path):
    """accelerate's `save_state` wrote rank 0's optimizer state alone, and `load_state` gave it to every
    rank: each rank's optimizer holds its own shards' moments (NOTE: [Trainer checkpoints])."""
    pytest.importorskip("accelerate")
    run_ranks(2, _accelerate_saves_and_resumes, str(tmp_path))
