"""Offload (NOTE: [Offload] in fbmt/compiler/passes/shard.py): with `offload=True` the shards, their
gradients and the optimizer's state live in host memory, and the program's collectives are the host
kinds, which copy across where the host is not the device. On CPU ranks the host is the device, so
these tests check what the option changes in the program, the simulator and the module, and that it
trains as the program without it does; tests/gpu/offload_model_on_gpu.py checks the copies on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from fbmt.optim import AdamOffloadOptimizer
from tests.dist import run_ranks

STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=16, n_head=2))


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(step))


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())


def _train(rank: int, world: int, offload: bool, optimizer: str, options: dict, accumulate: bool) -> dict:
    model = fbmt.compile(_gpt(), cache_dir=False, offload=offload, **options)
    if optimizer == "cpu-adam":
        opt = AdamOffloadOptimizer(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        x = _batch(step)[2 * rank : 2 * rank + 2]
        if accumulate:  # the first micro-batch's gradients held on the rank, reduced with the second's
            with model.no_sync():
                _loss(model, x[:1]).backward()
            x = x[1:]
        loss = _loss(model, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    kinds = sorted({n.target.__name__ for n in model.program.collectives()})
    return {"params": model.full_parameters(), "losses": losses, "kinds": kinds, "state": model.state_dict()}


@pytest.mark.parametrize(
    "optimizer, options, accumulate",
    [
        ("adamw", {}, False),
        ("cpu-adam", {}, False),  # fbmt's C++ Adam on the shards in place, as offload is meant to be used
        ("adamw", {}, True),
        (  # offload never sends on a narrow wire: the program without it neither, to be the same program
            "adamw",
            {"param_dtype": torch.bfloat16, "narrow_wire": False, "schedule": ("bucket", {"bucket_bytes": 1 << 20})},
            False,
        ),
    ],
    ids=["adamw", "cpu-adam", "no_sync", "bf16-buckets"],
)
def test_offload_trains_equal_to_the_program_without_it_on_2_ranks(optimizer, options, accumulate):
    got = {}
    for offload in (False, True):
        got[offload] = run_ranks(2, _train, offload, optimizer, options, accumulate)[1]
    assert got[True]["kinds"] == ["all_gather_from_host", "reduce_scatter_to_host"]
    assert got[False]["kinds"] == ["all_gather", "reduce_scatter"]
    assert got[True]["losses"] == got[False]["losses"]
    for name, p in got[False]["params"].items():
        assert torch.equal(got[True]["params"][name], p), name
    for key, v in got[False]["state"].items():
        assert torch.equal(got[True]["state"][key], v), key


def test_offloaded_shards_and_gradients_live_in_host_memory_and_stay_there():
    model = fbmt.compile(_gpt(), cache_dir=False, world_size=1, offload=True)
    _loss(model, _batch(0)).backward()
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in model.parameters())
    model.to("cpu")
    model.to("cpu:0")  # the host, however it is written (Trainer writes this)
    model.cpu()
    assert all(p.device.type == "cpu" for p in model.parameters())
    with pytest.raises(ValueError, match=r"offload=True.*compile it with device='meta'"):
        model.to("meta")
    with pytest.raises(TypeError, match="param_dtype=torch.float16"):  # a cast is refused, never skipped
        model.type(torch.float16)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(ValueError, match="offload=True, cuda_graph=True"):
        fbmt.compile(_gpt(), cache_dir=False, world_size=1, offload=True, cuda_graph=True)


def test_the_simulator_prices_the_copies_across_the_host_link():
    from fbmt.compiler.collectives import host_bytes
    from fbmt.tools.sim import H200

    programs = {}
    for offload in (False, True):
        model = fbmt.compile(_gpt(), cache_dir=False, world_size=2, offload=offload)
        programs[offload] = model.trace(_batch(0)[:2])
    slow, fast = (dataclasses.replace(H200, host_bandwidth=bw) for bw in (1e6, 1e15))
    plain = fbmt.simulate(programs[False], slow).step_s
    assert fbmt.simulate(programs[False], fast).step_s == plain  # no host kind: nothing crosses
    assert fbmt.simulate(programs[True], fast).step_s == pytest.approx(plain, rel=1e-3)
    copied = sum(host_bytes(n) for n in programs[True].collectives())
    assert copied > 0 and all(host_bytes(n) == 0 for n in programs[False].collectives())
    assert fbmt.simulate(programs[True], slow).step_s >= plain + 0.9 * copied / 1e6


def test_an_offloaded_model_compiled_on_meta_to_inspect_holds_no_memory():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=16, n_head=2))
    model = fbmt.compile(model, cache_dir=False, world_size=8, device="meta", offload=True)
    assert all(p.is_meta for p in model.parameters())
    program = model.trace(_batch(0)[:2], device="cpu")
    assert {n.target.__name__ for n in program.collectives()} == {"all_gather_from_host", "reduce_scatter_to_host"}
