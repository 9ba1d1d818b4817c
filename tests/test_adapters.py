"""Adapters cost what they should: a `peft` LoRA fine-tune of a Hugging Face model, as users write
it, trains as eager, and its frozen parameters get no gradient reduction, no gradient and no
optimizer state (they sit in flat groups of their own)."""

from __future__ import annotations

import peft  # installed by scripts/install.sh --test: a missing one fails here, never skips
import torch

import fbmt
from fbmt.compiler import meta
from tests.dist import run_ranks
from tests.models import hf

STEPS = 3


def _lora_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(hf.build("llama"), config)


def _fine_tune(rank: int, world: int, compiled: bool) -> dict:
    model = _lora_llama()
    if compiled:
        model = fbmt.compile(model, cache_dir=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter, as scripts and Trainer pass them
    losses = []
    for step in range(STEPS):
        batch = hf.inputs("llama", step)
        out = model(**(fbmt.local_part(batch) if compiled else batch))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(out.loss.item())
    if not compiled:
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    program, groups = model.program, model.layout.groups
    return {
        "losses": losses,
        "params": model.full_parameters(),
        "reduced": sorted(meta.group(n) for n in program.collectives() if "reduce_scatter" in n.target.__name__),
        "trainable": [g.index for g in groups if g.requires_grad],
        "frozen_slots": [s.name for g in groups if not g.requires_grad for s in g.slots],
        "trainable_slots": [s.name for g in groups if g.requires_grad for s in g.slots],
        "frozen_grads": [p.grad is not None for p in model.parameters() if not p.requires_grad],
        "frozen_states": sum(1 for p in model.parameters() if not p.requires_grad and opt.state.get(p)),
        "trainable_states": sum(1 for p in model.parameters() if p.requires_grad and opt.state.get(p)),
    }


def test_a_lora_fine_tune_reduces_and_keeps_state_only_for_the_adapters_and_trains_as_eager():
    got = run_ranks(2, _fine_tune, True)
    want = _fine_tune(0, 1, False)
    r = got[0]
    assert r["trainable_slots"] and all("lora_" in name for name in r["trainable_slots"]), r["trainable_slots"]
    assert not any("lora_" in name for name in r["frozen_slots"])
    assert r["reduced"] == r["trainable"]  # one gradient reduction per adapter group, none for a frozen one
    assert r["frozen_grads"] and not any(r["frozen_grads"])  # no gradient buffer on a frozen shard
    assert r["frozen_states"] == 0 and r["trainable_states"] == len(r["trainable"])
    both = (torch.tensor(got[0]["losses"]) + torch.tensor(got[1]["losses"])) / 2  # each rank's half of the batch
    torch.testing.assert_close(both, torch.tensor(want["losses"]), rtol=1e-4, atol=1e-5)
    for name, p in want["params"].items():
        torch.testing.assert_close(r["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)
