"""`CompileOptions`: the one declaration of `fbmt.compile`'s options, each checked once, each with an
effect (the others are tested where they act: prefetch in tests/passes/test_schedule.py, zero and
remat in tests/passes and the equivalence suite, the dtypes in test_mixed_precision.py)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn

import fbmt
from fbmt.compiler import Plan
from tests.models.reference import MLP


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(zero=1), "zero=1"),
        (dict(remat="auto"), "remat='auto'"),
        (dict(schedule="fast"), "schedule='fast'"),
        (dict(prefetch=0), "prefetch=0"),
        (dict(blocks=["nope"]), "no submodule named"),
        (dict(blocks={"fc1": {"recompute": True}}), r"unknown policy keys \['recompute'\]"),
        (dict(blocks={"fc1": {"zero": 1}}), "zero=1.*for block 'fc1'"),
        (dict(disable=("shard",)), "cannot be disabled"),
        (dict(disable=("nope",)), "no pass named 'nope'"),
        (dict(cuda_graph=True), r"cuda_graph=True.*CUDA device.*compiles for cpu"),
        (dict(backend="tvm"), "backend='tvm'"),
        (dict(grad_reduce="max"), "grad_reduce='max'"),
        (dict(param_dtype=torch.int8), "param_dtype"),
        (dict(world_size=0), "world_size=0"),
    ],
)
def test_bad_options_are_named_when_the_model_is_compiled(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fbmt.compile(MLP(), **kwargs)


def test_an_unknown_option_lists_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['zero_level'\]; the options are \['zero', 'remat'"):
        fbmt.compile(MLP(), zero_level=2)


def test_compiles_signature_is_the_option_list():
    params = inspect.signature(fbmt.compile).parameters
    fields = [f for f in dataclasses.fields(fbmt.CompileOptions) if f.init]
    assert list(params) == ["model"] + [f.name for f in fields]
    assert all(params[f.name].default == f.default for f in fields)


def test_environment_defaults_and_explicit_values(monkeypatch):
    monkeypatch.setenv("FBMT_CHECKS", "1")
    monkeypatch.setenv("FBMT_DUMP_DIR", "/tmp/somewhere")
    monkeypatch.setenv("FBMT_NARROW_WIRE", "0")
    o = fbmt.CompileOptions()
    assert o.checks is True and o.dump_dir == "/tmp/somewhere" and o.narrow_wire is False
    o = fbmt.CompileOptions(checks=False, dump_dir="/elsewhere", narrow_wire=True)
    assert o.checks is False and o.dump_dir == "/elsewhere" and o.narrow_wire is True
    monkeypatch.setenv("FBMT_CHECKS", "yes")
    with pytest.raises(ValueError, match=r"\$FBMT_CHECKS='yes': expected 0 or 1"):
        fbmt.CompileOptions()


def test_blocks_as_a_list_or_with_policies():
    model = fbmt.compile(MLP(), world_size=2, blocks=["fc1", "fc2", "fc3"])
    assert model.layout.blocks == ("fc1", "act", "fc2", "fc3")  # the parameterless act is grouped on its own
    assert [g.block for g in model.layout.groups] == ["fc1", "fc2", "fc3"]
    o = fbmt.CompileOptions(remat="none", blocks={"fc1": {"remat": "block", "zero": 2}, "fc2": {}, "fc3": {"zero": 2}})
    assert o.block_paths == ["fc1", "fc2", "fc3"]
    plan = Plan.of(o, world_size=2)  # resolved once: a block that sets one policy takes the default of the other
    assert plan.zero_per_block == {"fc1": 2, "fc3": 2} and plan.remat_per_block == {"fc1": "block", "fc3": "none"}


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.empty(4))

    def forward(self, x):
        return x * self.scale


class _Owned(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.scale = _Scale()

    def forward(self, x):
        for layer in self.layers:
            x = self.scale(layer(x))
        return x


def _init(m: nn.Module) -> None:
    with torch.no_grad():
        for name, p in m.named_parameters(recurse=False):
            p.fill_(0.5 if name == "weight" else -1.0)
        if "scale" in m._buffers:
            m.scale.fill_(2.0)


def test_init_fn_initializes_a_model_built_on_meta_module_by_module():
    with torch.device("meta"):
        model = _Owned()
    compiled = fbmt.compile(model, init_fn=_init)
    full = compiled.full_parameters()
    assert all(torch.equal(full[f"layers.{i}.weight"], torch.full((4, 4), 0.5)) for i in range(2))
    assert all(torch.equal(full[f"layers.{i}.bias"], torch.full((4,), -1.0)) for i in range(2))
    assert torch.equal(dict(compiled.named_buffers())["scale.scale"], torch.full((4,), 2.0))
    ref = _Owned()
    ref.apply(_init)
    x = torch.randn(3, 4)
    torch.testing.assert_close(compiled(x), ref(x))
