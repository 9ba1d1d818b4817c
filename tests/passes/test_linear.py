"""No pass walks the graph once per block or per collective: compile time must follow the program's
size, not its size times its depth (issue 31). Counted, not timed: every walk of a graph's nodes
from fbmt's code while a program is traced and passed, for a model of 2 and of 6 layers."""

from __future__ import annotations

import collections
import sys

import pytest
import torch
import torch.fx as fx

import fbmt
from fbmt.models.gpt import GPT, GPTConfig

# remat's trailing-block search is a binary search over the last blocks: it walks log2(depth) times
LOGARITHMIC = {"saved_with"}


def _within(frame, names: set[str], depth: int = 4) -> bool:
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in names:
            return True
        frame = frame.f_back
    return False


def _walks(monkeypatch: pytest.MonkeyPatch, n_layer: int, **options) -> collections.Counter:
    nodes = fx.Graph.nodes
    walks: collections.Counter = collections.Counter()

    def counted(graph: fx.Graph):
        caller = sys._getframe(1)
        if "/fbmt/" in caller.f_code.co_filename.replace("\\", "/") and not _within(caller, LOGARITHMIC):
            walks[f"{caller.f_code.co_filename.rsplit('fbmt', 1)[-1]}:{caller.f_code.co_name}"] += 1
        return nodes.fget(graph)

    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, d_model=32, n_head=2, vocab_size=64, seq_len=16))
    compiled = fbmt.compile(model, world_size=4, device="meta", **options)
    monkeypatch.setattr(fx.Graph, "nodes", property(counted))
    compiled.trace(torch.zeros(2, 16, dtype=torch.long), device="cpu")
    monkeypatch.undo()
    return walks


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"schedule": ("bucket", {"bucket_bytes": 120_000})},  # about two blocks' gathers a bucket
        {"schedule": "greedy"},
        {"remat": "mincut"},
        {"remat": "selective", "zero": 2},
    ],
    ids=["prefetch-block", "bucket", "greedy", "mincut", "selective-zero2"],
)
def test_walks_do_not_grow_with_depth(monkeypatch, options):
    shallow, deep = _walks(monkeypatch, 2, **options), _walks(monkeypatch, 6, **options)
    grew = {k: (shallow[k], deep[k]) for k in shallow.keys() | deep.keys() if deep[k] > shallow[k]}
    assert not grew, f"walks of the whole graph that grow with depth (2 layers, 6 layers): {grew}"
    assert sum(deep.values()) > 0  # the counting sees the passes' walks


def _gather_views(n_layer: int) -> tuple[int, int]:
    """(distinct fake values, views) among the slices of gathered buffers and their views."""
    from fbmt.compiler import collectives

    aten = torch.ops.aten
    with torch.device("meta"):
        model = GPT(GPTConfig(n_layer=n_layer, d_model=32, n_head=2, vocab_size=64, seq_len=16))
    compiled = fbmt.compile(model, world_size=4, device="meta", cache_dir=False)
    program = compiled.trace(torch.zeros(2, 16, dtype=torch.long), device="cpu")
    slices = [
        n
        for n in program.graph.nodes
        if n.target is aten.slice.Tensor and isinstance(n.args[0], fx.Node) and collectives.is_wait(n.args[0])
    ]
    views = slices + [u for s in slices for u in s.users if u.target is aten.view.default]
    return len({id(n.meta["val"]) for n in views}), len(views)


def test_the_parameters_views_of_every_layer_share_their_fake_values():
    """NOTE: [Values by their metadata]: the shard pass's views of each layer's gathered parameters are
    made once per layout, not once per layer (each a fake op of a few hundred microseconds)."""
    (distinct2, views2), (distinct6, views6) = _gather_views(2), _gather_views(6)
    assert views6 > views2 and distinct6 == distinct2, ((distinct2, views2), (distinct6, views6))


def _merged_views(n_layer: int) -> tuple[int, int, int]:
    """(distinct fake values, values, of which `_unsafe_view`s) among what the merge pass makes: each
    merged product, its column slices, and their views (re-derived), transitively."""
    from fbmt.compiler import ops

    aten = torch.ops.aten
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer, num_attention_heads=2
    )
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    compiled = fbmt.compile(model, world_size=4, device="meta", cache_dir=False)
    ids = torch.zeros(2, 16, dtype=torch.long)
    program = compiled.trace(input_ids=ids, labels=ids, use_cache=False, device="cpu")
    columns = [  # a merged product's outputs: column slices of an mm
        s
        for n in program.graph.nodes
        if n.target is aten.mm.default
        for s in n.users
        if s.target is aten.slice.Tensor and s.args[1] == 1
    ]
    todo = list(columns)
    views = [*columns, *{s.args[0] for s in columns}]  # the slices, and the products they cut
    while todo:
        n = todo.pop()
        users = [u for u in n.users if ops.aliases(u) and u.args[0] is n]
        views += users
        todo += users
    unsafe = sum(v.target is aten._unsafe_view.default for v in views)
    return len({id(v.meta["val"]) for v in views}), len(views), unsafe


def test_the_merged_products_and_their_views_share_fake_values_across_layers():
    """NOTE: [Values by their metadata]: the merge pass makes each layer's merged products, their slices
    and their views (`_unsafe_view`s among them) once per layout, not once per layer."""
    (distinct2, views2, unsafe2), (distinct6, views6, unsafe6) = _merged_views(2), _merged_views(6)
    assert views6 > views2 and unsafe6 > unsafe2 and distinct6 == distinct2, (
        (distinct2, views2, unsafe2),
        (distinct6, views6, unsafe6),
    )


def test_fakes_that_carry_values_are_not_memoized_by_their_metadata():
    """NOTE: [Values by their metadata]: two fakes of one metadata whose propagated constants differ give
    results of their own; without constants, one result serves both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fbmt.compiler import ops

    mode = FakeTensorMode()
    with mode:
        a, b = torch.empty(2), torch.empty(2)
    mul = torch.ops.aten.mul.Tensor
    assert ops.fake_value(mode, mul, (a, 2.0), {}) is ops.fake_value(mode, mul, (b, 2.0), {})
    a.constant, b.constant = torch.tensor([1.0, 2.0]), torch.tensor([5.0, 7.0])
    assert ops.fake_value(mode, mul, (a, 3.0), {}) is not ops.fake_value(mode, mul, (b, 3.0), {})
