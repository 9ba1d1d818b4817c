"""A tiny language model written twice: with BMTrain's classes (`import fbmt as bmt`) and in plain
PyTorch, with the same parameter names, so the two can be compared value for value."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import fbmt as bmt

V, D, L = 16, 8, 3


# ---- BMTrain style ----


class BLinear(bmt.DistributedModule):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.weight = bmt.DistributedParameter(
            torch.empty(dim_out, dim_in), init_method=bmt.ParameterInitializer(nn.init.normal_, std=0.3)
        )
        self.bias = bmt.DistributedParameter(torch.empty(dim_out), init_method=nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BLayerNorm(bmt.DistributedModule):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = bmt.DistributedParameter(torch.ones(dim), init_method=nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.zeros(dim), init_method=nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class BLayer(bmt.DistributedModule):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.ln, self.fc, self.drop = BLayerNorm(dim), BLinear(dim, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(self.ln(x))
        if gate is not None:
            h = h * gate
        return x + self.drop(torch.tanh(h))


class BNet(bmt.DistributedModule):
    def __init__(self, dropout: float = 0.0, use_checkpoint: bool = True, zero_level: int = 3):
        super().__init__()
        self.emb = bmt.DistributedParameter(
            torch.empty(V, D), init_method=bmt.ParameterInitializer(nn.init.normal_, std=1.0)
        )
        self.layers = bmt.TransformerBlockList(
            [bmt.Block(BLayer(D, dropout), use_checkpoint=use_checkpoint, zero_level=zero_level) for _ in range(L)]
        )
        self.head = BLinear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(F.embedding(ids, self.emb)))


# ---- plain PyTorch, same names ----


class PLinear(nn.Module):
    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim_out, dim_in))
        self.bias = nn.Parameter(torch.empty(dim_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PLayerNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias)


class PLayer(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.ln, self.fc, self.drop = PLayerNorm(dim), PLinear(dim, dim), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h = self.fc(self.ln(x))
        if gate is not None:
            h = h * gate
        return x + self.drop(torch.tanh(h))


class PNet(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.emb = nn.Parameter(torch.empty(V, D))
        self.layers = nn.ModuleList([PLayer(D, dropout) for _ in range(L)])
        self.head = PLinear(D, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.emb)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def init_like_bmt(model: nn.Module) -> nn.Module:
    """Initialize a PNet exactly as init_parameters initializes a BNet (same calls, same order)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "emb":
                nn.init.normal_(p, std=1.0)
            elif name.endswith("fc.weight") or name == "head.weight":
                nn.init.normal_(p, std=0.3)
            elif name.endswith("ln.weight"):
                nn.init.ones_(p)
            else:
                nn.init.zeros_(p)
    return model


def plain_reference(seed: int = 0, dropout: float = 0.0) -> PNet:
    model = PNet(dropout)
    torch.manual_seed(seed)
    return init_like_bmt(model)


def bmt_model(seed: int = 0, **kw) -> BNet:
    torch.manual_seed(seed)
    model = BNet(**kw)
    bmt.init_parameters(model)
    return model


def data(step: int, batch: int = 8, seq: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets; the target is a fixed function of the token, so the loss can fall."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, V, (batch, seq), generator=g)
    return ids, (ids * 3 + 1) % V


def local(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]
