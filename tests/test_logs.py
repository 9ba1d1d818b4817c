"""What fbmt says while it compiles (fbmt/logs.py): each stage with its seconds under FBMT_LOG, why
a new program is built, and a warning when programs pile up for new input shapes (issue 31)."""

from __future__ import annotations

import copy
import logging
import os
import subprocess
import sys

import pytest
import torch

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from tests.models import hf

SCRIPT = """
import torch, fbmt
from fbmt.models.gpt import GPT, GPTConfig
m = fbmt.compile(GPT(GPTConfig(n_layer=2, d_model=32, n_head=2)), world_size=1)
m(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
"""


def _run(**env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        # no compile cache: what these tests read is what compiling says
        [sys.executable, "-c", SCRIPT],
        env={**os.environ, "FBMT_CACHE_DIR": "off", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_fbmt_log_prints_each_stage_with_its_seconds():
    out = _run(FBMT_LOG="info", RANK="3")
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("[fbmt rank 3 ")]
    text = "\n".join(lines)
    assert "tracing GPT's forward and backward (7 blocks) ..." in text, out.stderr
    assert "nodes" in text and "passes: " in text and "remat " in text and "program 1 built in" in text, text
    assert "pass remat" not in text  # a pass's own line is DEBUG


def test_fbmt_log_debug_adds_each_pass_and_unset_prints_nothing():
    debug = _run(FBMT_LOG="debug")
    assert debug.returncode == 0, debug.stderr
    assert "pass shard: " in debug.stderr and "gathers" in debug.stderr, debug.stderr
    quiet = _run(FBMT_LOG="")
    assert quiet.returncode == 0 and "[fbmt" not in quiet.stderr, quiet.stderr


def test_a_misspelt_level_names_the_variable():
    out = _run(FBMT_LOG="verbose")
    assert out.returncode != 0 and "$FBMT_LOG='verbose'" in out.stderr and "expected debug, info" in out.stderr


@pytest.fixture
def records(caplog):
    caplog.set_level(logging.INFO, logger="fbmt")
    return caplog


def _messages(caplog, level=logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fbmt" and r.levelno == level]


def test_a_new_program_says_what_differs(records):
    torch.manual_seed(0)
    model = fbmt.compile(GPT(GPTConfig(n_layer=1, d_model=32, n_head=2)), world_size=1)
    model(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    model(torch.zeros(2, 24, dtype=torch.long)).sum().backward()
    with torch.no_grad():
        model(torch.zeros(2, 24, dtype=torch.long))
    said = [m for m in _messages(records) if m.startswith("a new program")]
    assert said == [
        "a new program for argument 0 of shape (2, 24), where it was (2, 16) (1 built so far)",
        "a new program for another grad mode (2 built so far)",
    ]
    assert not _messages(records, logging.WARNING)  # two shapes: no warning yet


def test_programs_for_new_shapes_warn_once_naming_the_keyword(records):
    model = fbmt.compile(hf.build("llama"), world_size=1, dynamic=False)  # a program per shape
    for length in (8, 12, 16, 20, 24):
        ids = torch.randint(0, hf.VOCAB, (2, length))
        model(input_ids=ids, labels=ids).loss.backward()
    assert "a new program for input_ids of shape (2, 12), where it was (2, 8) (1 built so far)" in _messages(records)
    warnings = _messages(records, logging.WARNING)
    assert len(warnings) == 1, warnings  # programs 4 and 5: once
    assert warnings[0].startswith("fbmt: program 4 for new input shapes (input_ids of shape (2, 20)")
    assert "pad_to_multiple_of" in warnings[0]


def test_programs_for_new_values_of_a_number_argument_warn_once_naming_it(records):
    """Hugging Face's loss takes `num_items_in_batch`; passed as an int that changes every step, each value
    is a program: a warning names it and says to pass a tensor, which one program takes at every value."""
    torch.manual_seed(0)
    ref = hf.build("llama")
    model = fbmt.compile(copy.deepcopy(ref), world_size=1)
    ids = torch.randint(0, hf.VOCAB, (2, 8))
    for n in (5, 6, 7, 8, 9):
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=n).loss
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids, num_items_in_batch=n).loss)
    warnings = _messages(records, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("fbmt: program 4 for num_items_in_batch 8, where it was 7: a number among")
    assert "(num_items_in_batch)" in warnings[0] and "torch.tensor(n)" in warnings[0]
    programs = len(model.programs)
    for n in (5, 6, 7):  # as a tensor: one more program, for every value
        loss = model(input_ids=ids, labels=ids, num_items_in_batch=torch.tensor(n)).loss
        torch.testing.assert_close(loss, ref(input_ids=ids, labels=ids, num_items_in_batch=n).loss)
    assert len(model.programs) == programs + 1


def test_programs_for_new_values_of_a_number_an_argument_object_holds_warn_once_naming_it(records):
    """A Hugging Face cache whose layers keep a sliding window (Gemma 2) counts its tokens in an int. With
    dynamic=False it is a constant of each program: every step of generate() is a program. The log names
    the number inside the cache, and a warning says so once, past the prompt's program."""
    import transformers

    from tests.test_families import VOCAB, _model

    ref = _model("gemma2", transformers.AutoModelForCausalLM).eval()
    model = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, dynamic=False)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    want = ref.generate(input_ids=ids, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(input_ids=ids, max_new_tokens=6, do_sample=False), want)
    said = " ".join(_messages(records))
    assert ".layers[0].cumulative_length 8, where it was 7" in said, said  # where in the cache, not its repr
    warnings = _messages(records, logging.WARNING)
    assert len(warnings) == 1, warnings
    assert "a number an argument object holds (" in warnings[0] and ".layers[0].cumulative_length" in warnings[0]
    assert "sliding window" in warnings[0]


def test_by_default_a_second_length_compiles_one_program_for_every_length(records):
    model = fbmt.compile(hf.build("llama"), world_size=1)
    for length in (8, 12, 16, 20, 24):
        ids = torch.randint(0, hf.VOCAB, (2, length))
        model(input_ids=ids, labels=ids).loss.backward()
    assert len(model.programs) == 2
    assert "one program for many input sizes: symbolic in input 0 dimension 1, input 1 dimension 1" in " ".join(
        _messages(records)
    )
    assert not _messages(records, logging.WARNING)
