"""Users' habits around a compiled model (issue 34): each gives the right result, or an error that says
what happened and what to do, never a silently wrong model."""

from __future__ import annotations

import copy

import pytest
import torch

import fbmt
from tests.dist import run_ranks
from tests.models.reference import MLP
from tests.workers import gradients_match


def _loaded_on_rank0_only(rank: int, world: int, weights: str) -> object:
    torch.manual_seed(0)
    pretrained = MLP()
    torch.manual_seed(100 + rank)  # each rank's own random initialization
    model = MLP()
    if rank == 0:  # what DDP users do: DDP's start-up broadcast gives every rank rank 0's weights
        model.load_state_dict(pretrained.state_dict())
    try:
        compiled = fbmt.compile(model, weights=weights)
    except ValueError as e:
        return str(e)
    full = compiled.full_parameters()
    return {name: torch.equal(full[name], p) for name, p in pretrained.named_parameters()}


def test_weights_loaded_on_rank_0_only_are_every_ranks_as_ddp_makes_them():
    """NOTE: [Ranks' weights]: every rank takes rank 0's values where the ranks' differ."""
    for same in run_ranks(2, _loaded_on_rank0_only, "rank0"):
        assert all(same.values()), same


def test_ranks_whose_weights_differ_are_an_error_that_names_the_parameter_on_request():
    for message in run_ranks(2, _loaded_on_rank0_only, "check"):
        assert isinstance(message, str) and "rank(s) [1]" in message and "'fc1.weight'" in message, message


def test_a_bad_weights_option_is_named():
    with pytest.raises(ValueError, match="weights='all'"):
        fbmt.compile(MLP(), weights="all")


@pytest.mark.parametrize(
    "write",
    [
        lambda m: m.fc3.weight.zero_(),  # through the module's attributes (the compiled model forwards them)
        lambda m: torch.nn.init.zeros_(m.fc3.weight),
        lambda m: m.fc3.weight.data.normal_(),  # what an _init_weights does
        lambda m: m.fc3.weight.copy_(torch.zeros(12, 24)),
        lambda m: m.fc3.weight[0].fill_(0.0),
        lambda m: m.fc3.reset_parameters(),
        lambda m: m.fc3.load_state_dict({"weight": torch.zeros(12, 24), "bias": torch.zeros(12)}),
    ],
    ids=["zero_", "nn.init", "data", "copy_", "slice", "reset_parameters", "load_state_dict"],
)
def test_a_write_to_a_compiled_models_parameter_is_refused_by_name_and_nothing_is_lost(write):
    """NOTE: [Placeholders refuse values]: the module compile took over holds placeholders; a write to
    one would be lost (the values live in the shards), so it raises at once, naming the parameter."""
    torch.manual_seed(0)
    model = fbmt.compile(MLP())
    before = model.state_dict()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"fc3\.weight.*compiled\.load_state_dict"):
        write(model)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    x = torch.randn(2, 12)
    model.load_state_dict({"fc3.weight": torch.zeros(12, 24)}, strict=False)  # the way that reaches the shards
    torch.testing.assert_close(model(x), model.state_dict()["fc3.bias"].expand(2, 12))


def test_reading_a_compiled_models_parameter_is_refused_by_name_and_its_shape_is_there():
    model = fbmt.compile(MLP())
    weight = model.fc1.weight
    assert weight.shape == (48, 12) and weight.dtype == torch.float32 and weight.numel() == 576
    with pytest.raises(RuntimeError, match=r"'fc1\.weight'.*`norm` on it would compute with no values"):
        weight.norm()


def test_a_write_to_a_compiled_models_buffer_reaches_the_program():
    """Buffers are not sharded: the program reads the module's own at every call, so a write counts."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.BatchNorm1d(6)).eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    x = torch.randn(4, 6)
    with torch.no_grad():
        for m in (ref, model.compiled_from):
            m[1].running_mean.fill_(0.5)
            m[1].running_var.mul_(4.0)
        torch.testing.assert_close(model(x), ref(x))


@pytest.mark.parametrize("reentrant", [None, True, False])
def test_hugging_faces_gradient_checkpointing_trains_as_eager_and_says_remat_decides(caplog, reentrant):
    """NOTE: [Hugging Face's checkpointing]: gradient_checkpointing_enable() before compile was refused,
    and after it (what Trainer(gradient_checkpointing=True) calls) too; an unmodified script failed. Its
    checkpoint calls are traced as calls: eager's loss and gradients, remat= named, remat='none' warned."""
    from tests.models.hf import build, inputs

    ref = build("llama")
    kwargs = None if reentrant is None else {"use_reentrant": reentrant}
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    with caplog.at_level("INFO", logger="fbmt"):
        model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False)
        model.gradient_checkpointing_enable()  # Trainer's call, made on the model it wraps
    said = [r.getMessage() for r in caplog.records if "gradient checkpointing on" in r.getMessage()]
    assert len(said) == 2 and all("remat='block'" in m for m in said), said
    for step in range(2):
        call = inputs("llama", step)
        want, got = ref(**call).loss, model(**call).loss
        want.backward()
        got.backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        gradients_match(model, ref, f"step {step}: ", rtol=1e-4)
        ref.zero_grad()
        model.zero_grad()
    caplog.clear()
    with caplog.at_level("WARNING", logger="fbmt"):
        fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, remat="none")
    assert "remat='none' keeps every activation" in caplog.text, caplog.text


def test_resizing_a_compiled_hugging_face_model_says_to_resize_before():
    """resize_token_embeddings after compile ended in "Tensor.item() cannot be called on meta tensors"."""
    from tests.models.hf import build

    compiled = fbmt.compile(build("llama"), world_size=1, cache_dir=False)
    with pytest.raises(RuntimeError, match=r"resize_token_embeddings\(\) on a compiled model: .* before fbmt.compile"):
        compiled.resize_token_embeddings(128)


def test_a_new_adapter_after_compile_says_to_add_it_before():
    """peft's add_adapter() on a compiled LoRA model failed at a placeholder's `__set__`; it says to add the
    adapter before compiling."""
    import peft

    from tests.models.hf import build

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    compiled = fbmt.compile(peft.get_peft_model(build("llama"), config))
    with pytest.raises(RuntimeError, match=r"PeftModel.add_adapter\(\) on a compiled model: .* before fbmt.compile"):
        compiled.add_adapter("second", peft.LoraConfig(r=2, target_modules=["k_proj"]))


def test_casting_a_compiled_model_says_how_to_compute_in_that_dtype():
    """model.to(torch.bfloat16) after compile failed later with "expected m1 and m2 to have the same dtype"."""
    model = fbmt.compile(MLP())
    for cast in (lambda: model.to(torch.bfloat16), lambda: model.half(), lambda: model.to("cpu", torch.float16)):
        with pytest.raises(TypeError, match=r"param_dtype=torch\.(bfloat16|float16)"):
            cast()
    assert model.to(torch.float32) is model and model.float() is model  # their own dtype: nothing to do
    model(torch.randn(2, 12))


def test_moving_a_compiled_model_to_another_device_says_to_move_it_before_compile():
    """`model.to(other)` after compile moved the shards under programs compiled for the first device: the
    next call failed inside them, or refused its inputs on the new device (a CPU machine's other device is
    meta; CUDA is refused alike). A move to the device it is on is nothing (Trainer makes one)."""
    model = fbmt.compile(MLP())
    x = torch.randn(2, 12)
    want = model(x)
    assert model.to("cpu") is model and model.cpu() is model and model.to("cpu:0") is model
    for move in (lambda: model.to("meta"), lambda: model.to(device="meta"), lambda: model.to_empty(device="meta")):
        with pytest.raises(
            ValueError, match=r"compiled for cpu to meta after fbmt.compile.*compile with device='meta'"
        ):
            move()
    torch.testing.assert_close(model(x), want)  # nothing moved


def _one_rank_late(rank: int, world: int) -> str:
    """Rank 1 comes to its second call 6 s late (evaluating alone, say); rank 0 waits in the agreement."""
    import logging
    import time

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("fbmt").addHandler(handler)
    torch.manual_seed(0)
    model = fbmt.compile(MLP())
    x = torch.randn(4, 12)
    model(x)
    if rank == 1:
        time.sleep(6)
    model(x)
    return "\n".join(seen)


def test_a_rank_kept_waiting_names_the_late_rank_within_seconds_and_waits_on():
    """An evaluation on rank 0 only was named, but only after FBMT_TIMEOUT's 600 s: the waiting rank now
    names the one it waits for after FBMT_STALL_WARNING seconds, and goes on once it comes."""
    said = run_ranks(2, _one_rank_late, env={"FBMT_STALL_WARNING": "2"})
    assert "rank 0 has waited 2s at a call of the compiled model (call 2) for rank 1 (at call 1)" in said[0], said
    assert "has waited" not in said[1]


def _saved_on_rank0_alone(rank: int, world: int, folder: str) -> str:
    from tests.models import hf

    model = fbmt.compile(hf.build("llama"))
    ids = torch.randint(0, hf.VOCAB, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    try:
        if rank == 0:
            model.save_pretrained(folder)  # the DDP habit: rank 0 saves, the others train on
        else:
            model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_save_on_rank0_alone_says_it_is_a_collective(tmp_path):
    """`if rank == 0: model.save_pretrained(folder)` waits in the state dict's gather for ranks that never
    come: rank 0's error said it waited in "the compiled program"; it names the gather, outside the
    program, and how to save on every rank."""
    said = run_ranks(2, _saved_on_rank0_alone, str(tmp_path), env={"FBMT_TIMEOUT": "3"}, barrier=False)
    assert "waited in the gather of flat group 'model.embed_tokens/float32' outside the program" in said[0], said[0]
    assert "save_pretrained(folder, is_main_process=rank == 0)" in said[0] and "of the compiled program" not in said[0]


def _damaged_on_two_ranks(rank: int, world: int, folder: str) -> dict:
    import os

    from tests.test_catalog import _damage

    torch.manual_seed(0)
    model = fbmt.compile(MLP())
    fbmt.checkpoint.save(folder, 1, model=model)
    want = model.state_dict()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    newest = fbmt.checkpoint.save(folder, 2, model=model)
    if rank == 0:
        _damage(newest, "one value flipped")  # the ranks read the files each other checks
    torch.distributed.barrier()
    resumed = fbmt.checkpoint.load(folder, model=model)
    got = model.state_dict()
    return dict(step=resumed.step, same=all(torch.equal(got[k], v) for k, v in want.items()), files=os.listdir(newest))


def test_on_two_ranks_a_damaged_newest_checkpoint_falls_back_on_every_rank(tmp_path):
    for out in run_ranks(2, _damaged_on_two_ranks, str(tmp_path / "ck")):
        assert out["step"] == 1 and out["same"], out


def _writes_on_two_ranks(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = fbmt.compile(MLP())
    try:
        with torch.no_grad():
            torch.nn.init.zeros_(model.fc3.weight)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_on_two_ranks_a_write_after_compile_is_refused_on_every_rank():
    for said in run_ranks(2, _writes_on_two_ranks):
        assert "'fc3.weight'" in said and "change nothing" in said, said
