"""Single-process behaviours a user relies on, each checked against eager PyTorch."""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import sys
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt
from fbmt.compiler import host_calls, meta
from tests.models.reference import MLP, Buffered, batch, gpt, loss_of
from tests.workers import step_matches


def _pair(build, **cfg):
    torch.manual_seed(0)
    ref = build()
    return ref, fbmt.compile(copy.deepcopy(ref), checks=True, **cfg)


@pytest.mark.parametrize("remat", ["block", "none"])
def test_dropout_masks_match_eager_and_survive_recompute(remat):
    ref, model = _pair(lambda: gpt(dropout=0.3), remat=remat)
    (idx,), _, tgt = batch("gpt", 0)
    torch.manual_seed(7)
    ref_loss = loss_of("gpt", ref(idx), tgt)
    ref_loss.backward()
    torch.manual_seed(7)
    loss = loss_of("gpt", model(idx), tgt)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=lambda m: f"{n}: {m}")
    if remat == "block":  # the masks are saved, never redrawn: no random op in the backward
        bwd = [n for n in model.program.graph.nodes if meta.phase(n) == "bwd"]
        assert not any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) for n in bwd)
        assert any(meta.recompute(n) == "activation" for n in bwd)


class DropsAcross(nn.Module):
    """Dropout of tensors that are not contiguous: a sequence transposed, a convolution's output permuted
    back to (batch, length, channels); `writes` adds a count written in place to a buffer, so the trace
    is functionalized whole instead of rewritten (NOTE: [Writes to fresh tensors])."""

    def __init__(self, writes: bool):
        super().__init__()
        self.lin, self.conv, self.head = nn.Linear(8, 8), nn.Conv1d(8, 8, 3, padding=1), nn.Linear(8, 2)
        self.writes = writes
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.writes:
            self.calls.add_(1)
        h = self.lin(x).transpose(0, 1).contiguous().transpose(0, 1)  # (batch, length, 8), laid out length-first
        h = F.dropout(h, 0.4, self.training) * 2
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(F.dropout(F.gelu(h), 0.3, self.training)).mean(1)


@pytest.mark.parametrize("writes", [False, True])
def test_dropout_of_a_tensor_laid_out_otherwise_draws_eagers_mask(writes):
    """NOTE: [Draws in memory order]: `bernoulli_` fills a transposed tensor in the order of its memory; the
    program draws the same mask (it drew another before), at three lengths (the third symbolic)."""
    ref, model = _pair(lambda: DropsAcross(writes))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step, length in enumerate((5, 7, 9)):
        x = torch.randn(3, length, 8, generator=torch.Generator().manual_seed(step))
        losses = []
        for m, opt in zip((ref, model), opts):
            torch.manual_seed(step)
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        torch.testing.assert_close(losses[1], losses[0], msg=f"step {step}")
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), msg=n)


class LayerDrop(nn.Module):
    """Layers skipped at random as transformers before 5.24 writes it (BART's encoder): a draw in every
    training call, compared in Python with the drop probability even where that is 0."""

    def __init__(self, layerdrop: float):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x):
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    continue
            x = F.dropout(torch.tanh(layer(x)), 0.2, self.training)
        return x


def test_a_layer_drop_draw_that_cannot_drop_trains_as_eager():
    """NOTE: [Draws compared with a bound]: `torch.rand([]) < 0` in Python failed the trace (transformers
    5.17's BART family could not train); it is false whatever is drawn, and the draws stay in the program,
    so the dropouts after them draw eager's masks. A probability above 0 is still refused, named."""
    ref, model = _pair(lambda: LayerDrop(0.0))
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        outs = []
        for m in (ref, model):
            torch.manual_seed(step)
            outs.append((m(x).square().mean(), torch.rand(4)))  # the generator as each call leaves it
            outs[-1][0].backward()
        torch.testing.assert_close(outs[1], outs[0], msg=f"step {step}")
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    with pytest.raises(fbmt.TraceError, match=r"if dropout_probability < self.layerdrop"):
        fbmt.compile(LayerDrop(0.3))(torch.randn(4, 8))


class HostDraws(nn.Module):
    """Numbers drawn on the host in the forward: `how` says from which generator, and whether seeded."""

    def __init__(self, how: str):
        super().__init__()
        self.lin, self.how = nn.Linear(4, 4), how
        self.rng = np.random.default_rng(0)

    def forward(self, x):
        if self.how == "python":
            scale = random.uniform(0.5, 1.5)
        elif self.how == "held":
            scale = float(self.rng.random())
        elif self.how == "seeded":  # BigBird's random attention: the same draws at every call
            np.random.seed(3)
            random.seed(3)
            scale = float(np.random.rand()) + random.random()
        else:
            scale = float(np.random.rand())
        return (self.lin(x) * scale).sum()


@pytest.mark.parametrize(
    "how, said",
    [
        ("python", r"calls random.uniform\(\)\n  at .*test_behaviours.py:\d+: scale = random.uniform"),
        ("numpy", r"calls numpy.random.rand\(\)\n  at .*test_behaviours.py:\d+: scale = float\(np.random.rand"),
        ("held", r"draws from rng \(Generator\)"),
    ],
)
def test_a_number_drawn_on_the_host_is_refused_where_eager_draws_anew(how, said):
    """NOTE: [Host draws]: `random.uniform()` or `np.random.rand()` in a forward became a constant of the
    program, which gave the first trace's draw at every call where eager draws anew: another loss at every
    step, silently. It is refused, naming the line; a generator seeded in the forward traces as eager."""
    x = torch.randn(2, 4)
    with pytest.raises(fbmt.TraceError, match=rf"'<root>' \(HostDraws\): it {said}(.|\n)*torch.rand"):
        fbmt.compile(HostDraws(how))(x)
    ref, model = _pair(lambda: HostDraws("seeded"))
    for step in range(2):
        step_matches(model, ref, x, msg=f"step {step}")
        ref.zero_grad()
        model.zero_grad()


class Waits(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        time.sleep(0.02)  # another thread runs meanwhile
        return self.lin(x).sum()


def test_draws_of_another_thread_while_tracing_are_not_the_models():
    """NOTE: [Host draws]: a thread drawing from Python's random while the forward is traced (a data
    pipeline's) changed the generator's state, which was taken for the model's draw."""
    stop = threading.Event()

    def draw() -> None:
        while not stop.is_set():
            random.random()

    thread = threading.Thread(target=draw)
    thread.start()
    try:
        ref, model = _pair(Waits)
        step_matches(model, ref, torch.randn(2, 4))
    finally:
        stop.set()
        thread.join()


def _spans(shape: tuple[int, int], lengths: torch.Tensor, p: float) -> np.ndarray:
    """Host work of SpecAugment's kind: each row's length read on the host, its spans drawn with numpy."""
    out = np.zeros(shape, dtype=bool)
    for row, n in enumerate(lengths.tolist()):
        out[row, :n] = np.random.rand(n) < p
    return out


class Spans(nn.Module):
    """A learned embedding put where `_spans` says, as wav2vec2's SpecAugment puts its `masked_spec_embed`."""

    def __init__(self, misuse: str | None = None):
        super().__init__()
        self.lin, self.misuse = nn.Linear(4, 4), misuse
        self.embed = nn.Parameter(torch.randn(4))

    def forward(self, x, mask):
        h = self.lin(x)
        if self.misuse == "seeded":  # eager draws the spans from this seed, a program from numpy as it finds it
            np.random.seed(0)
        spans = _spans(tuple(h.shape[:2]), mask.sum(-1), 0.5)
        if self.misuse == "read":
            spans = spans.any(axis=1)
        if self.misuse == "dropped":
            return (h * h).sum()
        h[torch.tensor(spans, device=h.device, dtype=torch.bool)] = self.embed
        return (h * h).sum()


@pytest.fixture
def spans_on_host(monkeypatch):
    """`_spans` registered as a host call, as the Hugging Face integration registers SpecAugment's."""
    found = [
        host_calls.HostFunction(sys.modules[__name__], "_spans", lambda b: (tuple(b.arguments["shape"]), torch.bool))
    ]
    monkeypatch.setattr(host_calls, "_FINDERS", [*host_calls._FINDERS, lambda: found])


def test_a_host_call_draws_eagers_numbers_at_every_call(spans_on_host):
    """NOTE: [Host calls]: a registered function of the forward runs on the host at every call, on the
    call's values (the rows' lengths, read with .tolist()), drawing from numpy as eager does: eager's
    spans, losses and gradients, and numpy's generator left where eager leaves it, at lengths never traced."""
    torch.manual_seed(0)
    ref = Spans()
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False)
    for step, length in enumerate([5, 7, 9, 6]):
        x = torch.randn(2, length, 4)
        mask = torch.ones(2, length, dtype=torch.long)
        mask[1, length - 2 :] = 0
        results = []
        for m in (ref, model):
            np.random.seed(step)
            loss = m(x, mask)
            loss.backward()
            results.append((loss, np.random.get_state()[1].copy()))
        (want, state), (got, after) = results
        torch.testing.assert_close(got, want, msg=f"step {step}")
        assert (after == state).all(), f"step {step}: numpy's generator is not where eager left it"
        grads = model.full_gradients()
        for name, p in ref.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, msg=f"step {step}: {name}")
        ref.zero_grad()
        model.zero_grad()
    assert len(model.programs) == 2  # the second length's symbolic program serves the others
    assert "calls _spans on the host at every call" in str(model.program)  # said in the program's summary


def test_a_program_with_a_host_call_loaded_from_the_cache_draws_eagers_numbers(spans_on_host, tmp_path):
    """NOTE: [Host calls]: the call is one node of the saved program, which a second job loads and runs."""
    torch.manual_seed(0)
    ref = Spans()
    x, mask = torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.long)
    np.random.seed(1)
    want = ref(x, mask)
    for job in ("saves", "loads"):
        model = fbmt.compile(copy.deepcopy(ref), cache_dir=tmp_path)
        np.random.seed(1)
        torch.testing.assert_close(model(x, mask), want, msg=job)
    assert model.program.origin.startswith("loaded from the compile cache")


@pytest.mark.parametrize(
    "misuse, said",
    [
        ("read", r"the result of _spans\(\), (.|\n)*is read for .any\n  at .*: spans = spans.any"),
        ("dropped", r"the result of _spans\(\), (.|\n)*is never turned into a tensor\n  at .*: spans = _spans"),
        ("seeded", r"the forward seeds numpy.random and calls a function on the host at every call"),
    ],
)
def test_a_host_calls_result_used_on_the_host_is_refused(spans_on_host, misuse, said):
    """NOTE: [Host calls]: a result the program cannot compute again at every call: refused, naming the line."""
    mask = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(fbmt.TraceError, match=said):
        fbmt.compile(Spans(misuse), cache_dir=False)(torch.randn(2, 5, 4), mask)


def test_a_function_drawing_on_the_host_unregistered_is_refused():
    """Without the registration `_spans` reads values no trace has, then draws from numpy."""
    with pytest.raises(fbmt.TraceError, match=r"at .*: for row, n in enumerate\(lengths.tolist\(\)\)"):
        fbmt.compile(Spans(), cache_dir=False)(torch.randn(2, 5, 4), torch.ones(2, 5, dtype=torch.long))


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fill = nn.Parameter(torch.randn(4))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, x):
        h = self.lin(x)
        h[x[..., 0] > 0] = self.fill  # one value for every selected row
        h[x > 1] = self.scale  # one value for every selected element
        return (h * h).sum()


def test_a_differentiable_value_assigned_where_a_mask_is_true_trains_as_eager():
    """NOTE: [Masked assignment]: `h[mask] = parameter` could not be traced: autograd's backward gathers
    the gradient at the mask's true elements, a size of values."""
    ref, model = _pair(Masked)
    for step in range(2):
        step_matches(model, ref, torch.randn(3, 5, 4), msg=f"step {step}")
        ref.zero_grad()
        model.zero_grad()


def test_a_gradient_penalty_through_the_compiled_backward_is_refused():
    """`torch.autograd.grad(out, x, create_graph=True)` (a gradient penalty, WGAN-GP's) differentiates the
    backward: the compiled backward is not differentiable, and it gave wrong parameter gradients, silently
    (the first layer's bias got zeros). It is refused, saying what to do; without create_graph it matches."""
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
    x = torch.randn(4, 8)
    xi = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
    (got,) = torch.autograd.grad(model(xi).sum(), xi)
    (want,) = torch.autograd.grad(ref(xi).sum(), xi)
    torch.testing.assert_close(got, want)


def test_calls_under_inference_mode_trace_and_run_as_under_no_grad():
    """An evaluation loop under `torch.inference_mode()` (PyTorch's recommended one) failed to trace
    ("Inference tensors do not track version counter"), for its inputs too. It traces outside it (an input
    made inside from a copy) and runs inside it: outputs and BatchNorm's running statistics (in train mode
    too) are eager's, and training goes on after."""
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)))
    x = torch.randn(6, 8)
    for train in (False, True):
        ref.train(train), model.train(train)
        with torch.inference_mode():
            torch.testing.assert_close(model(x), ref(x))
            inside = x * 1.0  # an input made there: an inference tensor, without a version counter
            torch.testing.assert_close(model(inside[:4]), ref(inside[:4]))  # a new program, traced from it
    for name, b in ref.named_buffers():
        torch.testing.assert_close(model.state_dict()[name], b, msg=name)
    model(x).sum().backward()
    ref(x).sum().backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_torch_compile_around_a_compiled_model_runs_it_as_it_is():
    """`torch.compile(fbmt.compile(model))` failed inside Dynamo at a placeholder (`is_conj`), then traced
    fbmt's runtime; the call now runs the compiled model as it is: eager's output and gradients, and an
    attribute set after is still read."""
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.0), nn.Tanh(), nn.Linear(16, 4)))
    wrapped = torch.compile(model)
    x = torch.randn(4, 8)
    out, want = wrapped(x), ref(x)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)
    model[1].p = ref[1].p = 0.5
    torch.manual_seed(1)
    out = wrapped(x)
    torch.manual_seed(1)
    torch.testing.assert_close(out, ref(x))


@pytest.mark.parametrize("mode", ["detect_anomaly", "checkpoint"])
def test_a_call_under_an_autograd_mode_traces_apart_from_it(mode):
    """A first call under `torch.autograd.detect_anomaly()` (its NaN checks read values) or inside
    `torch.utils.checkpoint` (its saved tensors' hooks took the trace's fakes) failed to trace; it traces
    apart from the mode, and the call and its backward are eager's."""
    from torch.utils.checkpoint import checkpoint

    ref, model = _pair(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)))
    x = torch.randn(4, 8)
    with torch.autograd.detect_anomaly() if mode == "detect_anomaly" else contextlib.nullcontext():
        out = model(x) if mode == "detect_anomaly" else checkpoint(model, x, use_reentrant=False)
        want = ref(x)
        out.square().sum().backward()
        want.square().sum().backward()
    torch.testing.assert_close(out, want)
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


def test_train_eval_and_no_grad_inference():
    ref, model = _pair(lambda: gpt(dropout=0.5))
    (idx,), _, _ = batch("gpt", 1)
    ref.eval()
    model.eval()
    assert not model.compiled_from.training and not model.compiled_from.h[0].drop.training
    with torch.no_grad():
        out = model(idx)
        torch.testing.assert_close(out, ref(idx))
    assert not model.program.needs_grad
    assert not any(r.kind == "tangent" for r in model.program.inputs)
    torch.testing.assert_close(model(idx), ref(idx))  # eval with grad: a new program, same numbers
    model.train()
    torch.manual_seed(3)
    train_out = model(idx)
    torch.manual_seed(3)
    ref.train()
    torch.testing.assert_close(train_out, ref(idx))
    assert len(model.programs) == 3


def test_frozen_parameters_stay_frozen():
    torch.manual_seed(0)
    ref = MLP()
    ref.fc2.requires_grad_(False)
    model = fbmt.compile(copy.deepcopy(ref), checks=True)
    frozen = [p for p in model.parameters() if not p.requires_grad]
    assert len(frozen) == 1 and frozen[0].numel() == ref.fc2.weight.numel() + ref.fc2.bias.numel()
    opts = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
        for m in (ref, model)
    ]
    for step in range(3):
        (x,), _, y = batch("mlp", step)
        for m, opt in zip((ref, model), opts):
            F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
    assert frozen[0].grad is None
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_parameters():
    ref, model = _pair(lambda: gpt().to(torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    (idx,), _, tgt = batch("gpt", 0)
    loss, ref_loss = loss_of("gpt", model(idx), tgt), loss_of("gpt", ref(idx), tgt)
    loss.backward()
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        assert grads[n].dtype == torch.bfloat16
        torch.testing.assert_close(grads[n], p.grad, rtol=2e-2, atol=1e-3)


def test_state_dict_has_original_keys_and_round_trips():
    ref, model = _pair(Buffered)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)  # same keys, same order; the non-persistent buffer is absent
    assert "shift" not in sd
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k])
    plain = Buffered()
    plain.load_state_dict(sd)  # loadable by the plain module
    torch.manual_seed(123)
    other = fbmt.compile(Buffered(), checks=True)
    other.load_state_dict(sd)
    (x,), kw, _ = batch("buffered", 0)
    torch.testing.assert_close(other(x, **kw)["out"], ref(x, **kw)["out"])
    with pytest.raises(RuntimeError, match="missing keys"):
        other.load_state_dict({k: v for k, v in sd.items() if k != "proj.bias"})
    bad = dict(sd, **{"proj.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match="size mismatch for proj.weight"):
        other.load_state_dict(bad)


def test_a_buffer_assigned_a_new_tensor_is_read_by_the_next_call():
    """The compiled module finds each buffer's owner once, but reads the buffer at every call."""
    ref, model = _pair(Buffered)
    (x,), kw, _ = batch("buffered", 0)
    model(x, **kw)
    for m in (ref, model.compiled_from):
        m.scale = torch.full((8,), 2.0)  # a new tensor, not an in-place update
    torch.testing.assert_close(model(x, **kw)["out"], ref(x, **kw)["out"])


def test_tied_weights_appear_under_both_names():
    ref, model = _pair(gpt)
    sd = model.state_dict()
    assert "lm_head.weight" in sd and "wte.weight" in sd
    torch.testing.assert_close(sd["lm_head.weight"], sd["wte.weight"])
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters())


class OneLayerTwice(nn.Module):
    """`nn.ModuleList([layer] * 3)`: one layer registered at three paths, its weights shared across depth."""

    def __init__(self):
        super().__init__()
        layer = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.layers = nn.ModuleList([layer] * 3)
        self.head = nn.Linear(6, 1)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x).square().mean()


def test_a_layer_registered_at_several_paths_trains_as_eager():
    """torch's functional_call put the trace's fake tensor back into the shared layer (it restores name by
    name): the second call refused the model, naming a parameter 'deleted or replaced after fbmt.compile'."""
    ref, model = _pair(OneLayerTwice)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for step in range(3):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        losses = [m(x) for m in (ref, model)]
        torch.testing.assert_close(losses[1], losses[0], msg=f"step {step}")
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), msg=n)


def test_new_input_shapes_retrace_and_stay_correct():
    ref, model = _pair(gpt)
    for T in (16, 8, 16):
        idx = torch.randint(0, 64, (2, T))
        torch.testing.assert_close(model(idx), ref(idx))
    assert len(model.programs) == 2


def test_input_gradients():
    ref, model = _pair(MLP)
    x = torch.randn(4, 12, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    model(x).square().sum().backward()
    ref(x2).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for i, layer in enumerate(self.inner):
            x = layer(x)
            if i == 1 and x.sum() > 0:  # data-dependent control flow
                x = -x
        return x


class Checks(nn.Module):
    """Checks of values in the forward whose other branch raises, in the ways code writes them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, labels):
        if labels is not None and labels.max() >= 4:
            raise ValueError("labels must be below 4")
        assert (x.abs() < 100).all(), "an input past 100"
        if not torch.isfinite(x).all():
            raise ValueError("an input not finite")
        return self.lin(x).gather(1, labels[:, None]).sum()


def test_a_check_that_raises_is_traced_past_and_raises_at_a_call_that_fails_it():
    """NOTE: [Checks that raise]: `if labels.max() >= 4: raise`, `assert (...).all()` and `if not ...: raise`
    failed the trace; a call takes the branch that does not raise, so the program does, and checks each at
    every call: values eager refuses raise there too, naming the line."""
    ref, model = _pair(Checks)
    x = torch.randn(3, 4)
    for labels in (torch.tensor([0, 1, 3]), torch.tensor([2, 2, 1])):
        step_matches(model, ref, x, labels, msg=f"labels {labels.tolist()}")
    checks = [n for n in model.program.graph.nodes if n.target is torch.ops.aten._assert_async.msg]
    assert len(checks) == 3, model.program
    for bad, line in (
        ((x, torch.tensor([0, 4, 1])), "if labels is not None and labels.max"),
        ((x * 1000, torch.tensor([0, 1, 1])), "assert"),
        ((x / 0, torch.tensor([0, 1, 1])), "assert"),  # inf and nan: the assert first, as in eager
    ):
        with pytest.raises((ValueError, AssertionError)):
            ref(*bad)
        with pytest.raises(RuntimeError, match=rf"raises in eager at .*test_behaviours.py:\d+: {line}"):
            model(*bad)


def _last_of_and(y):
    if y.shape[0] > 0 and (y > 1e6).any():
        raise ValueError("huge")
    return y.sum()


def _first_of_and(y):  # false with its first operand true and the second false: either answer may be eager's
    if (y > 1e6).any() and y.shape[0] > 0:
        raise ValueError("huge")
    return y.sum()


def _first_of_assert_or(y):
    assert (y < 1e6).all() or y.shape[0] > 0
    return y.sum()


def _negated_and(y):
    if not ((y < 1e6).all() and y.shape[0] > 0):
        raise ValueError("huge")
    return y.sum()


def _no_raise(y):
    if (y > 0).any():
        y = -y
    return y.sum()


class _Tested(nn.Module):
    def __init__(self, test):
        super().__init__()
        self.lin, self.test = nn.Linear(4, 4), test

    def forward(self, x):
        return self.test(self.lin(x))


@pytest.mark.parametrize(
    "test, traced",
    [
        (_last_of_and, True),
        (_first_of_and, False),
        (_first_of_assert_or, False),
        (_negated_and, True),
        (_no_raise, False),
    ],
)
def test_a_check_is_traced_past_only_where_its_answer_alone_keeps_eager_from_raising(test, traced):
    """NOTE: [Checks that raise]: in `if a and t: raise` the tensor t's answer that does not raise is False
    only where it comes last; before `a` it may be True too, and a program checking `not t` would refuse
    calls eager takes. Those, and an `if` that does not raise, stay trace errors."""
    ref, model = _pair(lambda: _Tested(test))
    x = torch.randn(2, 4)
    if traced:
        step_matches(model, ref, x)
    else:
        with pytest.raises(fbmt.TraceError, match=r"if|assert"):
            model(x)


def _guarded_write(h, x):
    big = x > 1
    if big.any():
        h[big] = 0.0
    return h


def _guarded_write_torch_any(h, x):
    big = x > 1
    if torch.any(big):
        h[big] = -1.0
        h[:][big] = 2.0  # a second write where the mask is true, through a view
    return h


def _guarded_other(h, x):
    big = x > 1
    if big.any():
        h = h * 2  # not a write where the mask is true: the answer matters
    return h


def _guarded_write_else(h, x):
    big = x > 1
    if big.any():
        h[big] = 0.0
    else:
        h = h * 2
    return h


class _Guarded(nn.Module):
    def __init__(self, guard):
        super().__init__()
        self.lin, self.guard = nn.Linear(4, 4), guard

    def forward(self, x):
        return (self.guard(self.lin(x), x) ** 2).sum()


@pytest.mark.parametrize(
    "guard, traced",
    [(_guarded_write, True), (_guarded_write_torch_any, True), (_guarded_other, False), (_guarded_write_else, False)],
)
def test_an_if_on_any_of_a_mask_guarding_writes_where_it_is_true_is_traced_past(guard, traced):
    """NOTE: [Guards of masked writes]: `if mask.any(): x[mask] = v` computes the same with either answer,
    so the trace takes the body (wav2vec2's pretraining loss); where the answer matters, a trace error."""
    ref, model = _pair(lambda: _Guarded(guard))
    x = torch.randn(3, 4)
    if not traced:
        with pytest.raises(fbmt.TraceError, match=r"if big.any\(\)|if torch.any\(big\)"):
            model(x)
        return
    for step, scale in enumerate([3.0, 0.1]):  # some elements above 1, then none
        step_matches(model, ref, x * scale, msg=f"step {step}")
        ref.zero_grad()
        model.zero_grad()


def test_untraceable_code_names_module_op_and_line():
    model = fbmt.compile(DataDependent())
    with pytest.raises(fbmt.TraceError) as err:
        model(torch.randn(2, 4))
    msg = str(err.value)
    assert "'<root>' (DataDependent)" in msg
    assert "if i == 1 and x.sum() > 0" in msg and "test_behaviours.py" in msg
    assert "torch.where" in msg


class _BackwardFails(torch.autograd.Function):
    """A function whose gradient formula fails where the trace runs it, as a kernel's backward may."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("no gradient formula here")


class FailsInBackward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _BackwardFails.apply(self.fc(x)).sum()


def test_a_failure_in_the_backward_is_named_as_the_backward_not_an_unknown_module():
    """No module's forward runs while autograd traces the gradient formulas: the error says it was the
    backward, where it once said module '<unknown>'."""
    model = fbmt.compile(FailsInBackward())
    with pytest.raises(fbmt.TraceError) as err:
        model(torch.randn(2, 4)).backward()
    msg = str(err.value)
    assert "could not trace the backward of FailsInBackward" in msg and "no gradient formula here" in msg
    assert "<unknown>" not in msg


class ConvertsItsLayer(nn.Module):
    """Converts a submodule in its forward on every call, as SwitchTransformers' router does."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.fc, self.dtype = nn.Linear(4, 4), dtype

    def forward(self, x):
        self.fc = self.fc.to(self.dtype)
        return self.fc(x.to(self.dtype)).float()


def test_a_conversion_in_the_forward_that_changes_nothing_runs_and_one_that_would_is_named():
    """NOTE: [Conversions in the forward]: eager's `.to` of a module already in that dtype changes nothing."""
    ref, model = _pair(lambda: ConvertsItsLayer(torch.float32))
    x = torch.randn(3, 4)
    ref(x).square().sum().backward()
    model(x).square().sum().backward()
    grads = model.full_gradients()
    for name, p in ref.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, msg=name)
    model = fbmt.compile(ConvertsItsLayer(torch.float64))
    with pytest.raises(
        fbmt.TraceError, match=r"module '<root>' converts a Linear's weight in its forward.*before fbmt"
    ):
        model(x)


class Settable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.k = nn.Linear(4, 4), nn.Dropout(0.5), 1.0
        self.register_buffer("temp", torch.tensor(1.0))

    def forward(self, x):
        return self.drop(self.fc(x)) * self.k * self.temp


def test_an_attribute_set_after_compile_is_read_by_the_next_call_as_in_eager():
    """NOTE: [Attributes read as constants]: a dropout's p, a plain attribute of the model and a buffer,
    set on the compiled model as on the eager one; the first two build a program each, the buffer is an
    input."""
    ref, model = _pair(Settable)
    x = torch.randn(3, 4)
    for name, value in [("k", 1.0), ("drop.p", 0.0), ("k", 3.0), ("temp", torch.tensor(2.0)), ("drop.p", 0.25)]:
        for m in (ref, model):  # (the first sets what was there: the program compiled before any change)
            owner, _, attr = name.rpartition(".")
            setattr(m.get_submodule(owner) if owner else m, attr, value)
        torch.manual_seed(0)
        want = ref(x)
        torch.manual_seed(0)
        torch.testing.assert_close(model(x), want, msg=name)
    assert len(model.programs) == 4  # as built, p = 0.0, k = 3.0 (the buffer is an input), p = 0.25


class ReadsAFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2 if getattr(self, "flag", False) else self.fc(x)


def test_an_attribute_new_to_the_model_set_or_deleted_after_compile_is_read_as_in_eager():
    """NOTE: [Attributes read as constants]: the traced forward read the attribute's absence."""
    ref, model = _pair(ReadsAFlag)
    x = torch.randn(3, 4)
    for step in ["as built", True, False, True, "deleted"]:
        for m in (ref, model):
            if step == "deleted":
                del m.flag
            elif step != "as built":
                m.flag = step
        torch.testing.assert_close(model(x), ref(x), msg=str(step))
    assert "flag" not in model.__dict__ and not hasattr(model.compiled_from, "flag")
    assert len(model.programs) == 3  # absent, True, False


def test_a_hook_registered_or_removed_after_compile_runs_as_in_eager():
    """NOTE: [Attributes read as constants]: the trace runs the hooks there are; with them removed, the
    first program serves again."""
    ref, model = _pair(Settable)
    ref.drop.p = model.drop.p = 0.0
    x = torch.randn(3, 4)
    handles = {}

    def add(kind, fn):
        handles[kind] = [getattr(m.fc, f"register_{kind}")(fn) for m in (ref, model)]

    def remove(kind):
        for h in handles.pop(kind):
            h.remove()

    steps = [
        ("as built", lambda: None),
        ("a forward hook", lambda: add("forward_hook", lambda mod, args, out: out * 10)),
        ("removed", lambda: remove("forward_hook")),
        ("a pre-hook", lambda: add("forward_pre_hook", lambda mod, args: (args[0] + 1,))),
        ("both", lambda: add("forward_hook", lambda mod, args, out: out * 10)),
    ]
    for step, change in steps:
        change()
        torch.testing.assert_close(model(x), ref(x), msg=step)
    assert len(model.programs) == 4  # as built (and once removed), a forward hook, a pre-hook, both


class Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1  # read by nothing it computes
        return self.fc(x)


def test_an_attribute_the_forward_sets_at_every_call_is_named_and_stops_building_programs(caplog):
    ref, model = _pair(Counts)
    x = torch.randn(3, 4)
    with caplog.at_level(logging.WARNING, logger="fbmt"):
        for step in range(6):
            torch.testing.assert_close(model(x), ref(x))
            if step == 0:  # the trace ran the forward more than once, and counted the call once
                assert model.compiled_from.calls == ref.calls == 1
    assert len(model.programs) <= 3
    assert "the forward sets Counts.calls at every call" in caplog.text


class Scales(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.calls = nn.Linear(4, 4), 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x) * self.calls  # computes with the count: each call would need a program


def test_a_count_the_forward_computes_with_is_eagers_at_the_first_call_and_refused_at_the_next(tmp_path):
    """NOTE: [What a forward keeps on its modules]: tracing runs the forward twice or more; the program
    computes with what one eager call sees, and the count is counted once. A program loaded from the
    compile cache counts it too, so a second run meets the same refusal."""
    x = torch.randn(3, 4)
    for run in ("compiles", "loads"):
        ref, model = _pair(Scales, cache_dir=tmp_path)
        torch.testing.assert_close(model(x), ref(x), msg=run)
        assert model.program.origin.startswith("loaded" if run == "loads" else "compiled")
        assert model.compiled_from.calls == ref.calls == 1, run
        with pytest.raises(RuntimeError, match="sets Scales.calls at every call and computes with it"):
            model(x)


class Keeps(nn.Module):
    """Tensors a forward keeps for the training loop: a VAE's KL term on the model, a mixture of experts'
    balancing loss on each layer (in a dict beside a plain value), an activation a hook keeps."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x):
        for layer in self.layers:
            y = torch.tanh(layer(x))
            layer.aux = {"balance": y.square().mean(), "experts": 4}
            x = x + y
        self.kl = x.exp().mean() - x.mean()
        return self.head(x)


def test_tensors_the_forward_keeps_on_its_modules_are_each_calls_and_train_as_in_eager(caplog):
    ref, model = _pair(Keeps)
    for m in (ref, model):
        m.head.register_forward_hook(lambda mod, args, out: setattr(mod, "seen", out.detach()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    with caplog.at_level(logging.WARNING, logger="fbmt"):
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            for m, opt in zip((ref, model), opts):
                own = m.compiled_from if m is model else m
                loss = m(x).square().mean() + own.kl + sum(layer.aux["balance"] for layer in own.layers)
                loss.backward()
                opt.step()
                opt.zero_grad()
                m.loss = loss.detach()
            torch.testing.assert_close(model.loss, ref.loss, msg=f"step {step}")
            torch.testing.assert_close(model.compiled_from.head.seen, ref.head.seen)
            assert model.compiled_from.layers[2].aux["experts"] == 4
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(full[n], p.detach(), msg=n)
    assert "returned nothing" not in caplog.text  # the hook's activation is kept, not lost
    text = str(model.program)
    assert "keeps tensors on its modules" in text  # its layers are traced as code
    assert "output[kl]=" in text and "output[layers.2.aux]=" in text  # named by where they are kept


class AlsoDetached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        z = y * 1.0
        z[:, 0] = 2 * z[:, 0]  # written in place: the program takes a view of `z` from `z` itself
        return y, y.detach(), z, z.detach()[:, 1:]  # `y`: one node of the program, returned twice


def test_an_output_returned_beside_its_detached_self_or_a_view_of_it_is_eagers():
    ref, model = _pair(AlsoDetached)
    x = torch.randn(3, 4)
    for m in (ref, model):
        y, seen, z, part = m(x)
        assert y.requires_grad and not seen.requires_grad
        assert z.requires_grad and not part.requires_grad, "a detached view required grad as its base"
        (y.square().mean() + seen.sum() + z.sum() + part.square().sum()).backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


@torch.compile(backend="eager")  # a helper of the model's code under torch.compile (any backend)
def _scaled_gelu(x):
    return F.gelu(x) * 2


class CallsCompiled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return _scaled_gelu(self.fc(x))


def test_a_function_under_torch_compile_in_the_models_code_traces_as_its_python():
    """Dynamo refused make_fx's trace ("using FX to symbolically trace a dynamo-optimized function"), and
    with Inductor ran its kernel on the fake forward's tensors: a segmentation fault."""
    ref, model = _pair(CallsCompiled)
    x = torch.randn(3, 4)
    for m in (ref, model):
        m(x).square().sum().backward()
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


class Clips(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            self.fc.weight[0].clamp_(-0.1, 0.1)  # weight clipping written inside the forward, on a view
        return self.fc(x)


def test_a_forward_that_writes_a_parameter_in_place_is_refused_naming_it():
    """The program's gathered copy would take the write, never the shards: the trace failed, "please report it"."""
    _, model = _pair(Clips)
    with pytest.raises(fbmt.TraceError, match=r"writes parameter 'fc.weight' in place \(aten.clamp_"):
        model(torch.randn(3, 4))


class KeepsAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 6), nn.Linear(6, 2)
        self.start = nn.Parameter(torch.randn(6))

    def forward(self, x):
        h = self.embed(x)
        h[:, 0] = self.start  # written in place
        self.first = h.detach()[:, :1]  # a view of it, kept: the program takes it again from `h` at its end
        return self.head(h)


def test_a_view_of_a_tensor_written_in_place_kept_on_a_module_is_eagers():
    """The view was made after the backward in the program, which the forward could not return (a
    KeyError from the partitioner)."""
    ref, model = _pair(KeepsAView)
    for m in (ref, model):
        m(torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    own = model.compiled_from
    torch.testing.assert_close(own.first, ref.first)
    assert not own.first.requires_grad
    grads = model.full_gradients()
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, msg=n)


class Appends(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.losses = nn.Linear(4, 4), []

    def forward(self, x):
        y = self.fc(x)
        self.losses.append(y.square().mean())  # a list the training loop sums: no place in a program
        return y


def test_tensors_the_forward_adds_to_a_list_its_module_holds_are_refused_naming_it():
    _, model = _pair(Appends)
    with pytest.raises(fbmt.TraceError, match=r"puts tensors into Appends '<root>'.losses, a list"):
        model(torch.randn(3, 4))
    assert model.compiled_from.losses == []  # the trace left nothing in it


def test_a_hugging_face_config_flag_set_after_compile_is_read_by_the_next_call():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    ref, model = _pair(lambda: transformers.LlamaForCausalLM(config))
    ids = torch.randint(0, 64, (2, 8))
    assert model(ids).hidden_states is None
    for m in (ref, model):
        m.config.output_hidden_states = True
    want, got = ref(ids).hidden_states, model(ids).hidden_states
    assert len(got) == len(want) == 3
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _no_dropout(m: nn.Module) -> None:
    if isinstance(m, nn.Dropout):
        m.p = 0.0


@pytest.mark.parametrize("how", ["modules", "apply"])
def test_a_loop_over_the_compiled_models_modules_changes_them_as_in_eager(how):
    """NOTE: [The compiled model's modules]: a loop over `modules()` (or `apply`) reaches the model's own
    modules, and the parameters stay the shards an optimizer steps."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    ref, model = _pair(lambda: transformers.BertModel(config, add_pooling_layer=False))
    paths = [p for p, _ in model.named_modules()]
    assert paths == [p for p, _ in ref.named_modules()] + ["flat_params"]
    assert all(isinstance(p, nn.Parameter) and p.device.type == "cpu" for p in model.parameters())
    assert [n for n, _ in model.named_parameters()] == [f"flat_params.{i}" for i in range(len(model.flat_params))]
    ids = torch.randint(0, 64, (2, 8))
    for m in (ref, model):
        if how == "modules":
            for sub in m.modules():
                _no_dropout(sub)
        else:
            m.apply(_no_dropout)
    torch.testing.assert_close(model(ids).last_hidden_state, ref(ids).last_hidden_state)  # no dropout left
    with pytest.raises(RuntimeError, match=r"parameter 'encoder.layer.1.output.dense.weight' belongs to a module"):
        model.apply(lambda m: nn.init.zeros_(m.weight) if isinstance(m, nn.Linear) else None)


def test_a_compiled_sequential_indexes_and_iterates_its_own_layers():
    """NOTE: [Containers compiled whole]: `model[1]` is the model's dropout, not the shards' list."""
    ref, model = _pair(lambda: nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)))
    assert len(model) == 3 and [type(m) for m in model] == [type(m) for m in ref]
    ref[1].p = model[-2].p = 0.0
    x = torch.randn(3, 4)
    torch.testing.assert_close(model(x), ref(x))
    with pytest.raises(RuntimeError, match=r"Sequential\.append\(\) on a compiled model would change"):
        model.append(nn.ReLU())


class PlainTensorAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.scale = nn.Linear(4, 4), torch.tensor(2.0)  # not a buffer: the program cannot take it

    def forward(self, x):
        return self.fc(x) * self.scale


def test_a_tensor_that_is_no_parameter_buffer_or_argument_is_named_with_what_to_do():
    with pytest.raises(
        fbmt.TraceError, match=r"plain attributes: scale\. Register each as a buffer \(`self\.register_buffer\('scale'"
    ):
        fbmt.compile(PlainTensorAttribute())(torch.randn(2, 4))


def test_input_on_the_wrong_device_is_named():
    model = fbmt.compile(MLP())
    with pytest.raises(ValueError, match=r"tensor input #0 \(shape \(2, 12\)\) is on meta.*\.to\('cpu'\)"):
        model(torch.empty(2, 12, device="meta"))


@pytest.mark.parametrize("var", ["FBMT_COPY_BLOCK", "FBMT_SUM_WARPS"])
def test_a_copy_or_sum_tile_that_is_not_a_power_of_two_is_a_named_error(monkeypatch, var):
    from fbmt import flags
    from fbmt.compiler.collectives import copies

    tile = copies.tiling if "COPY" in var else copies.sum_tiling
    monkeypatch.setenv(var, "3")
    tile.cache_clear()
    try:
        with pytest.raises(ValueError, match=rf"\${var}='3': expected a power of two"):
            tile()
    finally:
        monkeypatch.delenv(var)
        tile.cache_clear()
    defaults = (flags.COPY_BLOCK, flags.COPY_WARPS) if "COPY" in var else (flags.SUM_BLOCK, flags.SUM_WARPS)
    assert tile() == tuple(f.default for f in defaults)


def test_autocast_is_part_of_the_program_key():
    """A call under torch.autocast computes as eager autocast does, and a later call without it does not
    reuse that program."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model = fbmt.compile(copy.deepcopy(ref))
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = ref(x), model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want)
    plain = model(x)
    assert plain.dtype == torch.float32
    torch.testing.assert_close(plain, ref(x))


def test_a_deep_copy_of_a_compiled_model_computes_with_its_own_parameters():
    """The pattern of an EMA copy: copy.deepcopy(model), then change the copy's parameters only."""
    torch.manual_seed(0)
    ref = MLP()
    model = fbmt.compile(copy.deepcopy(ref))
    x = torch.randn(4, 12)
    before = model(x).detach()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
        for p in ref.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(twin(x), ref(x))
    torch.testing.assert_close(model(x), before)


def test_a_deep_copy_reads_the_attributes_set_on_its_own_modules():
    """NOTE: [Attributes read as constants] on a copy: its watch reads the copy's modules, not the
    original's, and a hook registered before the copy is still told from the first call's."""
    ref, model = _pair(Settable)
    ref.drop.p = model.drop.p = 0.0
    x = torch.randn(3, 4)
    model(x)
    for m in (ref, model):
        m.fc.register_forward_hook(lambda mod, args, out: out * 10)
    twin = copy.deepcopy(model)
    torch.testing.assert_close(twin(x), ref(x))  # the hook's program
    twin.k = ref.k = 3.0
    torch.testing.assert_close(twin(x), ref(x))
    assert model.k == 1.0


def test_the_ddp_unwrap_idiom_keeps_the_compiled_model():
    """Scripts unwrap DDP before saving with `model.module if hasattr(model, "module") else model`; on a
    compiled model that must keep the model itself, whose state_dict gathers the shards, not reach the
    module it took over, which holds meta placeholders."""
    torch.manual_seed(0)
    ref = MLP()
    model = fbmt.compile(copy.deepcopy(ref))
    unwrapped = model.module if hasattr(model, "module") else model
    assert unwrapped is model
    state = unwrapped.state_dict()
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(state[name], p)


def test_a_hook_that_returns_nothing_is_named_and_one_that_returns_its_output_is_not(caplog):
    """NOTE: [Hooks that return nothing]: a forward hook that keeps activations ran only in the trace, on
    fake tensors, and the list it filled held those from then on, without a word. Such a hook (forward, full
    backward, or their pre-hooks) is named in a warning, once; one that returns what it changes is in the
    program."""
    torch.manual_seed(0)
    model = fbmt.compile(MLP())
    kept: list = []
    model.fc1.register_forward_hook(lambda mod, args, out: kept.append(out.detach()))
    model.fc2.register_full_backward_hook(lambda mod, grad_in, grad_out: None)
    model.fc2.register_forward_hook(lambda mod, args, out: out * 2)
    inputs: list = []
    model.fc3.register_forward_pre_hook(lambda mod, args: inputs.append(args[0]))
    model.fc3.register_forward_pre_hook(lambda mod, args: (args[0] * 3,))
    x = torch.randn(3, 12)
    with caplog.at_level(logging.WARNING, logger="fbmt"):
        model(x).sum().backward()
        traced = len(kept)
        model(x).sum().backward()
    said = [r.getMessage() for r in caplog.records if "returned nothing" in r.getMessage()]
    named = (
        "module 'fc1' has a forward hook",
        "module 'fc3' has a forward pre-hook",
        "module 'fc2' has a full backward hook",
    )
    assert len(said) == 3 and all(n in m for n, m in zip(named, said)), said  # in the order they ran
    # what it warns of: the trace's fake tensors, and nothing from the steps
    assert len(kept) == traced and all(torch._subclasses.fake_tensor.is_fake(t) for t in kept)
