"""CTC's loss as ops whose results' sizes do not depend on values (NOTE: [CTC's selected targets] in
fbmt/compiler/trace.py).

`aten._ctc_loss` returns, beside each sequence's loss, the table of its forward variables, sized by the
longest target, which its backward reads: a size no trace has. `fbmt::ctc_nll` returns the losses alone,
and its backward (`fbmt::ctc_nll_backward`) computes the table again, then the gradient as aten's
backward does: the values are eager's, at the cost of a second pass of the loss's forward.
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


@torch.library.custom_op("fbmt::ctc_nll", mutates_args=())
def ctc_nll(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> torch.Tensor:
    return aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)[0]


@ctc_nll.register_fake
def _ctc_nll_fake(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity):  # noqa: ANN001, ANN202
    return log_probs.new_empty((log_probs.shape[1],))


@torch.library.custom_op("fbmt::ctc_nll_backward", mutates_args=())
def ctc_nll_backward(
    grad: torch.Tensor,
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    nll: torch.Tensor,
    blank: int,
    zero_infinity: bool,
) -> torch.Tensor:
    _, log_alpha = aten._ctc_loss.Tensor(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    grad_log_probs = aten._ctc_loss_backward.Tensor(
        grad, log_probs, targets, input_lengths, target_lengths, nll, log_alpha, blank, zero_infinity
    )
    # laid out as `log_probs` (the fake says so): aten's kernels choose their own layout, and a transposed
    # `log_probs` (transformers') then gives its producer's backward a contiguous gradient, the layout the
    # trace's views of it were recorded for
    if grad_log_probs.stride() == log_probs.stride():
        return grad_log_probs
    return torch.empty_like(log_probs).copy_(grad_log_probs)


@ctc_nll_backward.register_fake
def _ctc_nll_backward_fake(grad, log_probs, *rest):  # noqa: ANN001, ANN002, ANN202
    return torch.empty_like(log_probs)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    log_probs, targets, input_lengths, target_lengths, blank, zero_infinity = inputs
    ctx.save_for_backward(log_probs, targets, input_lengths, target_lengths, output)
    ctx.blank, ctx.zero_infinity = blank, zero_infinity


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    log_probs, targets, input_lengths, target_lengths, nll = ctx.saved_tensors
    grad_log_probs = ctc_nll_backward(
        grad, log_probs, targets, input_lengths, target_lengths, nll, ctx.blank, ctx.zero_infinity
    )
    return grad_log_probs, None, None, None, None, None


ctc_nll.register_autograd(_backward, setup_context=_setup)


def ctc_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    input_lengths: torch.Tensor,
    target_lengths: torch.Tensor,
    blank: int = 0,
    reduction: str = "mean",
    zero_infinity: bool = False,
) -> torch.Tensor:
    """`F.ctc_loss` of batched `log_probs` (T, N, C) and targets as rows (N, S), with lengths as tensors,
    reduced as aten's `ctc_loss` reduces."""
    nll = ctc_nll(log_probs, targets, input_lengths, target_lengths, blank, zero_infinity)
    if zero_infinity:
        nll = torch.where(nll == float("inf"), torch.zeros((), dtype=nll.dtype, device=nll.device), nll)
    if reduction == "mean":
        return (nll / target_lengths.clamp_min(1)).mean()
    if reduction == "sum":
        return nll.sum()
    return nll
