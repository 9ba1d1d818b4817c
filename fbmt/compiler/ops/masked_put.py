"""`x[mask] = value` whose backward has no size of values (NOTE: [Masked assignment] in
fbmt/compiler/trace.py).

Autograd's backward of the assignment gathers the gradient at the mask's true elements (`grad[mask]`),
a size no trace has. `masked_put(x, mask, value)` returns `x` with `value` put where `mask` is true, as
eager puts it; its backward gives `x` the gradient with the put elements zeroed, as eager's does, and
`value` what `fbmt::masked_sum` gathers inside the op, at run time, summed to `value`'s shape as autograd
sums it: eager's kernels, eager's values.
"""

from __future__ import annotations

from typing import Any

import torch


@torch.library.custom_op(
    "fbmt::masked_sum", mutates_args=(), schema="(Tensor grad, Tensor mask, SymInt[] shape) -> Tensor"
)
def masked_sum(grad: torch.Tensor, mask: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return grad[mask].sum_to_size(shape).clone()


@masked_sum.register_fake
def _masked_sum_fake(grad, mask, shape):  # noqa: ANN001, ANN202
    return grad.new_empty(shape)


class _MaskedPut(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(mask)
        ctx.shape = list(value.shape)
        out = x.clone()
        out[mask] = value
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (mask,) = ctx.saved_tensors
        put = mask.reshape(*mask.shape, *[1] * (grad.dim() - mask.dim()))
        return grad.masked_fill(put, 0), None, masked_sum(grad, mask, ctx.shape)


def masked_put(x: torch.Tensor, mask: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """`x` with `value` put where the boolean `mask` (over `x`'s leading dimensions) is true."""
    return _MaskedPut.apply(x, mask, value)
