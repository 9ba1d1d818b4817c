"""The fp8 pass (NOTE: [FP8 products]): the repeated layers' products in FP8 with dynamic scales.

torch runs `_scaled_mm` on the CPU, so the pass's program is checked here against an eager model
whose layers make the same casts by hand (to the bit), and against plain bf16 (loosely: FP8 is a
different number format, not an error)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt
from fbmt.compiler import meta

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rowwise_on_cpu() -> bool:
    a = torch.ones(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), torch.ones(16, 1), torch.ones(1, 16), out_dtype=torch.bfloat16)
        return True
    except RuntimeError:  # torch 2.11's CPU kernel takes one scale per tensor only
        return False


def _cast(x: torch.Tensor, rowwise: bool, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What the pass makes of one operand: FP8 row-major, and the scale to multiply back by."""
    top = torch.finfo(fmt).max
    wide = x.float()
    amax = wide.abs().amax([1] if rowwise else [], keepdim=rowwise)
    scale = amax.clamp_min(1e-12).reciprocal() * top
    return (wide * scale).clamp(-top, top).to(fmt).contiguous(), scale.reciprocal()


def _product(a: torch.Tensor, b: torch.Tensor, rowwise: bool, fa: torch.dtype, fb: torch.dtype) -> torch.Tensor:
    a8, inv_a = _cast(a, rowwise, fa)
    bt8, inv_b = _cast(b.t(), rowwise, fb)
    return torch._scaled_mm(a8, bt8.t(), inv_a, inv_b.t() if rowwise else inv_b, out_dtype=a.dtype)


class _Fp8Linear(torch.autograd.Function):
    """A linear layer's three products as the pass makes them: values e4m3, gradients e5m2
    ("tensorwise"), or all e4m3 ("rowwise")."""

    @staticmethod
    def forward(ctx, x, w, bias, rowwise):
        x2 = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(x2, w)
        ctx.rowwise, ctx.shape = rowwise, x.shape
        return (_product(x2, w.t(), rowwise, E4M3, E4M3) + bias).view(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x2, w = ctx.saved_tensors
        grad = E4M3 if ctx.rowwise else E5M2
        g2 = g.reshape(-1, g.shape[-1])
        gx = _product(g2, w, ctx.rowwise, grad, E4M3).view(ctx.shape)
        gw = _product(g2.t(), x2, ctx.rowwise, grad, E4M3)
        return gx, gw, g2.sum(0), None


class Layer(nn.Module):
    def __init__(self, fp8: str | None = None):
        super().__init__()
        self.up, self.down, self.fp8 = nn.Linear(32, 64), nn.Linear(64, 32), fp8

    def _linear(self, x, m):
        if self.fp8 is None:
            return m(x)
        return _Fp8Linear.apply(x, m.weight, m.bias, self.fp8 == "rowwise")

    def forward(self, x):
        return x + self._linear(F.gelu(self._linear(x, self.up)), self.down)


class Net(nn.Module):
    def __init__(self, fp8: str | None = None):
        super().__init__()
        self.layers = nn.ModuleList([Layer(fp8) for _ in range(2)])
        self.head = nn.Linear(32, 48)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _step(model, x, y):
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    return loss


@pytest.mark.parametrize(
    "recipe, options",
    [("tensorwise", {}), ("rowwise", {}), ("tensorwise", {"zero": 2, "remat": "none"})],
)
def test_fp8_products_equal_eager_layers_that_cast_alike(recipe, options):
    # with block recompute (the default) a weight's cast is shared by the forward and the recompute; with
    # ZeRO-2 and nothing recomputed the backward reads the forward's scales (NOTE: [One cast per value])
    if recipe == "rowwise" and not _rowwise_on_cpu():
        pytest.skip("this torch's CPU _scaled_mm takes one scale per tensor")
    torch.manual_seed(0)
    base = Net().to(torch.bfloat16).float()  # weights bf16 holds exactly: both models compute with the same
    ref = Net(fp8=recipe)
    ref.load_state_dict(base.state_dict())
    ref.to(torch.bfloat16)
    model = fbmt.compile(base, fp8=recipe, param_dtype=torch.bfloat16, checks=True, cache_dir=False, **options)
    x, y = torch.randn(4, 8, 32, dtype=torch.bfloat16), torch.randint(0, 48, (4, 8))
    loss, ref_loss = _step(model, x, y), _step(ref, x, y)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name], p.grad.float()), name
    stats = model.program.stats("fp8")
    # per layer: two forward products, two weight gradients, and the input gradients of both but the first
    assert stats.products == 4 + 4 + 3, stats
    assert "FP8" in str(model.program)


def test_fp8_stays_close_to_bf16_and_leaves_the_head_and_odd_sizes():
    torch.manual_seed(0)
    ref = Net()
    ref.layers.append(Layer())
    ref.layers[2].up, ref.layers[2].down = nn.Linear(32, 24), nn.Linear(24, 32)  # 24: not a multiple of 16
    x, y = torch.randn(4, 8, 32), torch.randint(0, 48, (4, 8))
    losses = {}
    for recipe in (None, "tensorwise"):
        model = fbmt.compile(_copy(ref), fp8=recipe, param_dtype=torch.bfloat16, checks=True, cache_dir=False)
        losses[recipe] = _step(model, x, y).item()
        if recipe:
            stats = model.program.stats("fp8")
            # layers 0 and 1 as above; of layer 2 (width 24) only the product of sizes 24 x 32 x 32 (the up
            # projection's weight gradient, over the 32 tokens) fits the kernels; the head's stay bf16
            assert stats.products == 4 + 4 + 3 + 1, stats
            outside = "3 kept: outside the repeated layers (the head, the embeddings)"  # the head's three
            assert stats.kept == ("5 kept: inner or outer size not a known multiple of 16", outside), stats
            targets = [n.target for n in model.program.graph.nodes]
            assert torch.ops.aten._scaled_mm.default in targets
    assert abs(losses["tensorwise"] - losses[None]) < 0.02 * abs(losses[None]), losses


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_fp8_is_off_by_default_and_checked():
    model = fbmt.compile(Net(), cache_dir=False)
    model(torch.randn(2, 16, 32)).sum().backward()
    assert str(model.program.stats("fp8")) == "off"
    assert torch.ops.aten._scaled_mm.default not in [n.target for n in model.program.graph.nodes]
    with pytest.raises(ValueError, match="fp8='e4m3'.*tensorwise"):
        fbmt.compile(Net(), fp8="e4m3")


def test_an_fp8_program_is_saved_and_loaded_by_the_compile_cache(tmp_path):
    torch.manual_seed(0)
    ref = Net()
    x = torch.randn(2, 16, 32)
    outs = []
    for _ in range(2):
        model = fbmt.compile(_copy(ref), fp8="tensorwise", param_dtype=torch.bfloat16, cache_dir=tmp_path)
        outs.append(model(x.bfloat16()))
        origin = model.program.origin
    assert origin.startswith("loaded"), origin
    assert torch.equal(outs[0], outs[1])
    bf16 = fbmt.compile(_copy(ref), param_dtype=torch.bfloat16, cache_dir=tmp_path)  # another option: a miss
    bf16(x.bfloat16())
    assert bf16.program.origin.startswith("compiled") and str(bf16.program.stats("fp8")) == "off"


def test_a_hugging_face_llama_trains_in_fp8_close_to_bf16():
    """transformers' LlamaForCausalLM as called (labels shifted inside): its layers' products (q, k and
    v merged, gate and up merged, o and down) in FP8, the lm_head's in bf16, and the losses of three
    SGD steps within 2% of bf16's."""
    from tests.models import hf

    torch.manual_seed(0)
    base = hf.build("llama")
    losses = {}
    for recipe in (None, "tensorwise"):
        model = fbmt.compile(_copy(base), fp8=recipe, param_dtype=torch.bfloat16, checks=True, cache_dir=False)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses[recipe] = []
        for step in range(3):
            out = model(**hf.inputs("llama", step))
            out.loss.backward()
            opt.step(), opt.zero_grad()
            losses[recipe].append(out.loss.item())
        if recipe:  # every product of the layers, the merged q/k/v and gate/up too; the lm_head's three stay
            stats = model.program.stats("fp8")
            assert stats.products > 0 and stats.kept == (
                "3 kept: outside the repeated layers (the head, the embeddings)",
            )
            assert model.program.stats("merge").runs  # q/k/v and gate/up are merged products
    for a, b in zip(losses["tensorwise"], losses[None]):
        assert abs(a - b) < 0.02 * b, losses


def test_rowwise_scales_keep_products_that_are_not_bf16():
    """torch's kernels with a scale per row write bf16 only: fp32 products stay as they are, and say so."""
    model = fbmt.compile(Net(), fp8="rowwise", cache_dir=False)
    model(torch.randn(2, 16, 32)).sum().backward()
    stats = model.program.stats("fp8")
    assert stats.products == 0 and "rowwise scales with torch.float32 operands" in str(stats), stats


def test_fp8_on_a_gpu_without_fp8_products_is_refused_at_compile(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"compute capability 8.9 or later.*NVIDIA A100 of 8.0"):
        fbmt.compile(Net(), fp8="tensorwise", device=torch.device("cuda", 0), world_size=1)


def _two_ranks_against_eager(rank: int, world: int) -> int:
    """ZeRO-3 on 2 ranks: each gathers the weights in bf16 and casts them after the gather; each rank's
    activations get their own scales. Against the hand-cast eager layers on this rank's half of the
    batch, their gradients averaged over the ranks, for two batches."""
    import torch.distributed as dist

    torch.manual_seed(0)
    base = Net().to(torch.bfloat16).float()
    ref = Net(fp8="tensorwise")
    ref.load_state_dict(base.state_dict())
    ref.to(torch.bfloat16)
    model = fbmt.compile(base, fp8="tensorwise", param_dtype=torch.bfloat16, checks=True, cache_dir=False)
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, 32, generator=g).bfloat16(), torch.randint(0, 48, (8, 8), generator=g)
        part = slice(4 * rank, 4 * rank + 4)
        loss, ref_loss = _step(model, x[part], y[part]), _step(ref, x[part], y[part])
        assert torch.equal(loss, ref_loss), (step, loss, ref_loss)
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            want = p.grad.float()
            dist.all_reduce(want)
            assert torch.equal(grads[name], want / world), (step, name)
        model.zero_grad(), ref.zero_grad()
    return model.program.stats("fp8").products


def test_fp8_on_two_ranks_equals_eager_layers_that_cast_alike():
    from tests.dist import run_ranks

    products = run_ranks(2, _two_ranks_against_eager)
    assert products[0] == products[1] > 0, products


def test_fp8_in_a_program_of_symbolic_lengths():
    """Batches of several lengths: one program of symbolic sizes after the first, its products in FP8
    but the weight gradients' (whose inner size, the token count, is a symbol the kernels cannot be
    shown to take), and each length's loss within 2% of bf16's."""
    torch.manual_seed(0)
    base = Net()
    fp8 = fbmt.compile(_copy(base), fp8="tensorwise", param_dtype=torch.bfloat16, checks=True, cache_dir=False)
    bf16 = fbmt.compile(_copy(base), param_dtype=torch.bfloat16, cache_dir=False)
    for length in (8, 12, 20, 28):
        g = torch.Generator().manual_seed(length)
        x, y = torch.randn(4, length, 32, generator=g), torch.randint(0, 48, (4, length), generator=g)
        got, want = _step(fp8, x, y).item(), _step(bf16, x, y).item()
        assert abs(got - want) < 0.02 * want, (length, got, want)
    assert len(fp8.programs) == 2, list(fp8.programs)
    symbolic = fp8.program.stats("fp8")  # the latest program: the symbolic one
    # it decides what to save at the most tokens it admits (4 x 64; NOTE: [Dynamic sizes]), where its layers
    # recompute: their products' recomputes run in FP8 too
    assert symbolic.products == 9 and "4 kept: inner or outer size not a known multiple of 16" in symbolic.kept


def _amax_values(program) -> list:
    """The value each amax of a program reduces (through its fp32 cast and transposes), whether it
    reads the value through a transpose, and the dimensions it reduces."""
    from fbmt.compiler.passes.fp8 import _untransposed

    values = []
    for n in program.graph.nodes:
        if n.target is torch.ops.aten.amax.default:
            x = n.args[0].args[0]  # amax(abs(x))
            if x.target is torch.ops.aten._to_copy.default:
                x = x.args[0]
            values.append((*_untransposed(x), tuple(n.args[1])))
    return values


def test_each_value_a_product_reads_gets_one_amax():
    """NOTE: [One cast per value]: a layer's input, weights and loss gradients are each read by two or
    three products, in two layouts, with one scale: one amax each (not two per product), and the
    same numbers as the eager layers that cast per product (the test above)."""
    for fp8 in ("tensorwise", "rowwise") if _rowwise_on_cpu() else ("tensorwise",):
        model = fbmt.compile(Net(), fp8=fp8, param_dtype=torch.bfloat16, checks=True, cache_dir=False)
        model(torch.randn(2, 16, 32, dtype=torch.bfloat16)).float().square().mean().backward()
        values, products = _amax_values(model.program), model.program.stats("fp8").products
        assert len(values) == len(set(values)), fp8  # no value reduced twice alike
        assert not any(flipped for _, flipped, _ in values), values  # each read as stored
        if fp8 == "tensorwise":  # per layer: input, two weights, the hidden value; two loss gradients;
            # the weights' amaxes are saved for the backward, not taken again from the weights it gathers
            assert len({v for v, _, _ in values}) == len(values) == 2 * (4 + 2) < 2 * products == 22, values
        amaxes = [n for n in model.program.graph.nodes if n.target is torch.ops.aten.amax.default]
        assert not [n for n in amaxes if meta.recompute(n) == "param"], fp8  # NOTE in fbmt/compiler/passes/shard.py


def _gathers_and_casts(model) -> tuple[list, int]:
    """The dtypes a compiled model's gathers cast to, and the casts of its regions' graphs."""
    from fbmt.compiler.collectives import torch_impl

    dtypes, casts = [], 0
    for exe in model.executables():
        for gm in (exe.forward, exe.backward):
            dtypes += [n.args[2] for n in gm.graph.nodes if n.target is torch_impl.all_gather]
            for region in gm.children():
                if hasattr(region, "gm"):  # a Region: the traced compute Inductor compiles
                    casts += sum(n.target is torch.ops.aten._to_copy.default for n in region.gm.graph.nodes)
    return dtypes, casts


def test_one_ranks_fp8_weights_are_cast_where_they_are_read_with_the_same_results(monkeypatch):
    """NOTE: [One rank's gathers]: on one rank with Inductor, an FP8 program's gathers copy nothing and
    each weight is cast in the region that reads it, computing what the gathers' copies gave; a bf16
    program keeps its gathers' copies."""
    from fbmt.compiler import pipeline

    torch.manual_seed(0)
    base = Net().to(torch.bfloat16).float()  # weights bf16 holds exactly: a cast kept or elided gives the same
    x, y = torch.randn(4, 8, 32, dtype=torch.bfloat16), torch.randint(0, 48, (4, 8))
    options = dict(fp8="tensorwise", param_dtype=torch.bfloat16, backend="inductor", cache_dir=False, world_size=1)
    fp8 = fbmt.compile(_copy(base), **options)
    loss = _step(fp8, x, y)
    dtypes, casts = _gathers_and_casts(fp8)
    # the layers' gathers, in the forward and again in the backward, copy nothing; the head's, kept from the
    # forward for the backward (the last block's), keeps its copy
    assert sorted(map(str, dtypes)) == ["None"] * 4 + ["torch.bfloat16"] and casts > 4, (dtypes, casts)
    partition = pipeline.partition
    monkeypatch.setattr(pipeline, "partition", lambda program, casts_where_read: partition(program))
    copied = fbmt.compile(_copy(base), **options)
    assert torch.equal(_step(copied, x, y), loss)
    assert set(_gathers_and_casts(copied)[0]) == {torch.bfloat16}
    want, got = copied.full_gradients(), fp8.full_gradients()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    monkeypatch.undo()
    bf16 = fbmt.compile(_copy(base), **{**options, "fp8": None})
    _step(bf16, x, y)
    assert set(_gathers_and_casts(bf16)[0]) == {torch.bfloat16}
