"""What a forward writes to its modules, on CUDA through Inductor and CUDA graphs, against eager.

    python tests/gpu/writes_on_gpu.py

A model whose layers keep a balancing loss on themselves and an average in a buffer they assign
anew, and whose root keeps a KL term (NOTE: [What a forward keeps on its modules], NOTE: [Buffers a
forward assigns] in fbmt/compiler/trace.py), trains four SGD steps in fp32 with the loss read from
what it kept, for each backend (eager, Inductor, Inductor with CUDA graphs): the losses, the kept
tensors, the buffers and the parameters against eager PyTorch on the same GPU; and compiled as a script
run with `python` compiles a model it moved to the GPU (no process group, no `device=`): there. Exits
non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fbmt  # noqa: E402


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.register_buffer("ema", torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.fc(x))
        self.aux = y.square().mean()
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)
        return x + y - self.ema


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        self.kl = x.exp().mean() - x.mean()
        return self.head(x)


def train(model: nn.Module, own: nn.Module, device: torch.device) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    for step in range(4):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(device)
        loss = model(x).square().mean() + own.kl + sum(layer.aux for layer in own.layers)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += [loss.detach().clone(), own.kl.detach().clone(), own.layers[2].ema.clone()]
    return seen


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    ref = Model().to(device)
    want = train(ref, ref, device)
    failed = False
    for name, options in [
        ("eager", {"world_size": 1, "device": device}),
        ("inductor", {"world_size": 1, "device": device, "backend": "inductor"}),
        ("inductor + graphs", {"world_size": 1, "device": device, "backend": "inductor", "cuda_graph": True}),
        ("the model's own GPU", {}),  # `python train.py` after `model.cuda()`: no process group, no device=
    ]:
        torch.manual_seed(0)
        base = Model().to(device)
        model = fbmt.compile(copy.deepcopy(base), cache_dir=False, **options)
        if model.device.type != "cuda":
            print(f"{name:20s} compiled for {model.device}, not the model's GPU: MISMATCH")
            failed = True
            continue
        got = train(model, model.compiled_from, device)
        worst = max(((a - b).abs().max() / (b.abs().max() + 1e-6)).item() for a, b in zip(got, want))
        full = model.full_parameters()
        worst = max(worst, *(((full[n] - p).abs().max()).item() for n, p in ref.named_parameters()))
        ok = worst < 1e-4
        failed |= not ok
        print(f"{name:20s} worst relative difference {worst:.2e} {'ok' if ok else 'MISMATCH'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
