"""`FusedCrossEntropy`: cross entropy on fp16/bf16 logits, computed in fp32 one row chunk at a time.

`torch.nn.functional.cross_entropy` on low-precision logits either computes in low precision or
needs an fp32 copy of the whole (tokens x vocab) logits, often the largest tensor of a language
model step. Here the forward and the backward each convert one chunk of rows (at most
`chunk_bytes` of fp32) at a time; the backward writes the gradient straight into a tensor of the
logits' dtype. Only the per-row log-sum-exp (4 bytes per row) is saved between them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


class _FusedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str, rows_per_chunk: int
    ) -> torch.Tensor:
        n = logits.shape[0]
        losses = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)
        for lo in range(0, n, rows_per_chunk):
            x = logits[lo : lo + rows_per_chunk].float()
            lse[lo : lo + x.shape[0]] = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, safe[lo : lo + x.shape[0], None])[:, 0]
            losses[lo : lo + x.shape[0]] = lse[lo : lo + x.shape[0]] - picked
        losses = torch.where(valid, losses, 0.0)
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.reduction, ctx.rows = reduction, rows_per_chunk
        if reduction == "none":
            return losses
        total = losses.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logits, safe, valid, lse, count = ctx.saved_tensors
        n = logits.shape[0]
        if ctx.reduction == "none":
            row_scale = grad_out.float() * valid
        else:
            scale = grad_out.float() / count if ctx.reduction == "mean" else grad_out.float()
            row_scale = valid * scale
        grad = torch.empty_like(logits)
        for lo in range(0, n, ctx.rows):
            hi = min(n, lo + ctx.rows)
            p = (logits[lo:hi].float() - lse[lo:hi, None]).exp_()
            p.scatter_add_(1, safe[lo:hi, None], torch.full((hi - lo, 1), -1.0, device=p.device))
            grad[lo:hi] = p.mul_(row_scale[lo:hi, None])
        return grad, None, None, None, None


class FusedCrossEntropy(nn.Module):
    """Cross entropy of `(N, vocab)` logits (any float dtype) against `(N,)` class indices, in fp32.

    Args:
        ignore_index: targets equal to it contribute nothing (and are not counted by "mean").
        reduction: "mean" (over counted targets), "sum" or "none" (per row, fp32).
        chunk_bytes: the most fp32 logits converted at once.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        weight: torch.Tensor | None = None,
        label_smoothing: float = 0.0,
        inplace: bool = False,
        chunk_bytes: int = 64 << 20,
    ):
        super().__init__()
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"FusedCrossEntropy(reduction={reduction!r}): expected 'mean', 'sum' or 'none'")
        if weight is not None or label_smoothing:
            raise NotImplementedError(
                "FusedCrossEntropy: class weights and label smoothing are not supported yet; "
                "use torch.nn.CrossEntropyLoss for them"
            )
        self.ignore_index, self.reduction, self.chunk_bytes = ignore_index, reduction, chunk_bytes

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() != 2 or target.shape != input.shape[:1]:
            raise ValueError(
                f"FusedCrossEntropy: expected logits (N, vocab) and targets (N,), got "
                f"{tuple(input.shape)} and {tuple(target.shape)}; reshape with "
                "logits.view(-1, vocab), target.view(-1)"
            )
        rows = max(1, self.chunk_bytes // (4 * max(1, input.shape[1])))
        return _FusedCrossEntropy.apply(input.contiguous(), target, self.ignore_index, self.reduction, rows)
