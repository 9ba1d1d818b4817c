"""`x[mask] = value` as an op whose results' sizes do not depend on values (NOTE: [Masked assignment] in
fbmt/compiler/trace.py).

Autograd's backward of the assignment gathers the gradient at the mask's true elements (`grad[mask]`),
a size no trace has. `fbmt::masked_put(x, mask, value)` returns `x` with `value` put where `mask` is
true, and its backward (`fbmt::masked_put_backward`) gathers at run time, inside the op, what eager's
backward gathers, and sums it to `value`'s shape as autograd does: eager's kernels, eager's values.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op("fbmt::masked_put", mutates_args=())
def masked_put(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    out[mask] = value
    return out


@masked_put.register_fake
def _masked_put_fake(x, mask, value):  # noqa: ANN001, ANN202
    return torch.empty_like(x)


@torch.library.custom_op(
    "fbmt::masked_put_backward",
    mutates_args=(),
    schema="(Tensor grad, Tensor mask, SymInt[] shape) -> (Tensor, Tensor)",
)
def masked_put_backward(grad: torch.Tensor, mask: torch.Tensor, shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x = grad.clone()
    grad_x[mask] = 0
    return grad_x, grad[mask].sum_to_size(shape).clone()


@masked_put_backward.register_fake
def _masked_put_backward_fake(grad, mask, shape):  # noqa: ANN001, ANN202
    return torch.empty_like(grad), grad.new_empty(shape)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    _, mask, value = inputs
    ctx.save_for_backward(mask)
    ctx.shape = list(value.shape)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    (mask,) = ctx.saved_tensors
    grad_x, grad_value = masked_put_backward(grad, mask, ctx.shape)
    return grad_x, None, grad_value


masked_put.register_autograd(_backward, setup_context=_setup)
