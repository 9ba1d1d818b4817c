"""Hugging Face models and recurrent layers on CUDA, compiled by fbmt, against eager on the same GPU.

    torchrun --nproc_per_node=N tests/gpu/hf_on_gpu.py

Each rank trains on its part of a global batch; the eager reference trains on the whole batch. Checked:
tiny random HF Llama, GPT-2 and Mixtral (default grouped_mm experts) called as HF documents, in fp32
(losses and parameters after 3 SGD steps) and Llama in bf16 with the inductor backend; greedy
`generate` tokens; Llama in bf16 called with `use_cache=False` (its causal mask rewritten, its key/value
heads read once); Llama with Hugging Face's checkpoints offloaded to the host (`save_on_cpu`) through
Inductor; nn.LSTM and nn.GRU (cuDNN) forward and backward. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import sys
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fbmt  # noqa: E402
from tests.models import hf  # noqa: E402


def train(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    call: dict | None = None,
    said: list | None = None,
    prepare: Callable[[nn.Module], None] | None = None,
    **options,
) -> float:
    """The worst relative error of the mean loss and the parameters after 3 SGD steps; `call`: more
    keyword arguments of the model's call (`use_cache=False`); `said`: gets the program's summary;
    `prepare`: what the script does to the model before compiling it."""
    ref = hf.build(name).to(device, dtype)
    if prepare is not None:
        prepare(ref)
    model = fbmt.compile(copy.deepcopy(ref), **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ref, model)]
    worst = 0.0
    for step in range(3):
        kwargs = {k: v.to(device) for k, v in hf.inputs(name, step).items()} | (call or {})
        want = ref(**kwargs).loss
        got = model(**{k: fbmt.local_part(v) if torch.is_tensor(v) else v for k, v in kwargs.items()}).loss
        want.backward()
        got.backward()
        mean = got.detach().clone()
        torch.distributed.all_reduce(mean)
        worst = max(worst, abs(mean.item() / fbmt.world_size() - want.item()) / abs(want.item()))
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if said is not None:
        said.append(str(model.program))
    full = model.full_parameters()
    for n, p in ref.named_parameters():
        err = (
            (full[model.layout.aliases.get(n, n)].float() - p.float()).abs().max() / (p.float().abs().max() + 1e-6)
        ).item()
        worst = max(worst, err)
    return worst


def offloaded_checkpoints(model: nn.Module) -> None:
    """Hugging Face's activation checkpointing with the saved inputs on the host (`offload=True`, transformers
    5.24): each layer's checkpoint in `save_on_cpu(pin_memory=True)`; on an older transformers, its layers given
    the same checkpoint function by hand."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None and "offload" in inspect.signature(enable).parameters:
        enable(offload=True)
        return
    model.gradient_checkpointing_enable()
    for m in model.modules():
        if getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = functools.partial(_offloaded_checkpoint, use_reentrant=False)


def _offloaded_checkpoint(function: Callable, *args, **kwargs):
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)


class Recurrent(nn.Module):
    def __init__(self, cell: type[nn.RNNBase]):
        super().__init__()
        self.rnn = cell(8, 16, num_layers=2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0].square().mean()


def recurrent(cell: type[nn.RNNBase], device: torch.device) -> float:
    """cuDNN's recurrent layers: the gradients of a mean loss over every rank's part, against the whole batch."""
    torch.manual_seed(0)
    torch.backends.cudnn.allow_tf32 = False  # eager's cuDNN RNN would compute in TF32; the program's kernels are fp32
    eager = Recurrent(cell).to(device)
    model = fbmt.compile(copy.deepcopy(eager))
    x = torch.randn(4, 5, 8, device=device)
    eager(x).backward()
    model(fbmt.local_part(x)).backward()
    grads = model.full_gradients()
    return max(
        ((grads[n] - p.grad).abs().max() / (p.grad.abs().max() + 1e-6)).item() for n, p in eager.named_parameters()
    )


class NormedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


class NormedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([NormedBlock(), NormedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def batchnorm(device: torch.device) -> float:
    """BatchNorm's running statistics after 2 steps, recomputed blocks (cuDNN's kernel would update twice)."""
    torch.manual_seed(0)
    eager = NormedStack().to(device)
    model = fbmt.compile(copy.deepcopy(eager), remat="block", broadcast_buffers=False)
    for step in range(2):
        x = torch.randn(8, 6, device=device, generator=torch.Generator(device).manual_seed(step))
        eager(x).backward()
        model(x).backward()  # the whole batch on every rank: the statistics are the batch's, as in eager
    return max(
        ((a - b).abs().max() / (a.abs().max() + 1e-6)).item()
        for (_, a), (_, b) in zip(eager.named_buffers(), model.named_buffers())
        if a.is_floating_point()
    )


def main() -> None:
    fbmt.init_distributed(seed=0)
    device = torch.device("cuda", torch.cuda.current_device())
    results = {
        "llama fp32": (train("llama", device, torch.float32), 1e-5),
        "gpt2 fp32": (train("gpt2", device, torch.float32), 1e-5),
        "mixtral fp32": (train("mixtral", device, torch.float32), 1e-5),
        "llama bf16 inductor": (train("llama", device, torch.bfloat16, backend="inductor"), 3e-2),
    }
    # transformers' causal mask becomes is_causal, and its repeated key/value heads are read once on the
    # GPU's kernel (NOTE: [Grouped heads])
    said: list[str] = []
    results["llama bf16 inductor use_cache=False"] = (
        train("llama", device, torch.bfloat16, {"use_cache": False}, said, backend="inductor"),
        3e-2,
    )
    grouped = "read their key/value heads once" in said[0] and "is causal" in said[0]
    # save_on_cpu's pinned copies, traced, were buffers Inductor could not make
    results["llama fp32 inductor, checkpoints offloaded"] = (
        train("llama", device, torch.float32, prepare=offloaded_checkpoints, backend="inductor"),
        1e-4,
    )
    results["lstm"] = (recurrent(nn.LSTM, device), 1e-4)
    results["gru"] = (recurrent(nn.GRU, device), 1e-4)
    results["batchnorm under remat=block"] = (batchnorm(device), 1e-5)
    ref = hf.build("llama").to(device).eval()
    model = fbmt.compile(copy.deepcopy(ref)).eval()
    prompt = hf.inputs("llama", 0, batch=2, seq=5)["input_ids"].to(device)
    same = torch.equal(
        model.generate(prompt, max_new_tokens=4, do_sample=False),
        ref.generate(prompt, max_new_tokens=4, do_sample=False),
    )
    ok = same and grouped and all(err <= tol for err, tol in results.values())
    if fbmt.rank() == 0:
        for what, (err, tol) in results.items():
            print(f"{what}: worst relative error {err:.1e} (tolerance {tol:.0e})")
        print(f"generate: {'the eager tokens' if same else 'DIFFERENT tokens'}")
        print(f"use_cache=False: {'causal, grouped heads read once' if grouped else 'NOT rewritten'}")
        gpu = torch.cuda.get_device_name()
        print(
            f"HF GPU check {'PASSED' if ok else 'FAILED'} on {fbmt.world_size()} x {gpu} with torch {torch.__version__}"
        )
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
