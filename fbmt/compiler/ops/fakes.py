"""Fake kernels of fbmt's for built-in ops whose own fail where the real kernel computes (`fake_kernels`): what
a trace runs, and what Inductor runs where it compiles a region, in this process or in a compile worker."""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

aten = torch.ops.aten

_fakes_registered = False


def fake_kernels() -> None:
    """Fake kernels of fbmt's for built-in ops whose meta kernel, which tracing runs, fails where the
    real kernel computes (torch 2.11-2.15):

    - `aten._grouped_mm` (Hugging Face's default mixture-of-experts kernel) runs in float32 on CPU and
      CUDA, but its meta kernel accepts only bfloat16;
    - `aten.linalg_solve_triangular` (the gated delta rule of Qwen3-Next's and Qwen3.5's linear
      attention) fails at symbolic sizes ("SymIntArrayRef expected to contain only concrete integers"):
      without this, such a model compiled a program for every sequence length (NOTE: [Dynamic sizes]).

    Each answers the shapes as the real kernel computes them, and leaves what it need not answer to
    torch's own; the op stays in the program as it is. (Where torch runs a Python decomposition of an op
    before any fake kernel, as it does for `polar` at symbolic sizes, `trace._SYMBOLIC_DECOMPOSITIONS` holds
    fbmt's instead.) They go into torch's table of fake kernels (a private one: torch has no public way to
    add to a built-in op's fake kernel) on the first trace of the process, never when fbmt is imported, and
    where a compile worker first compiles a region (Inductor traces the region on fakes too)."""
    global _fakes_registered
    if _fakes_registered:
        return
    _fakes_registered = True
    from torch._subclasses import fake_impls

    @fake_impls.register_op_impl(lambda func: func is aten._grouped_mm.default)
    def grouped_mm(
        mode: FakeTensorMode, func: Any, a: Any, b: Any, offs: Any = None, bias: Any = None, out_dtype: Any = None
    ):
        if a.dtype == torch.bfloat16 or bias is not None:
            return NotImplemented  # the meta kernel's own checks and shapes
        if a.dim() == 2 and b.dim() == 2:
            shape = [offs.shape[0], a.shape[0], b.shape[1]]
        elif a.dim() == 2:
            shape = [a.shape[0], b.shape[-1]]
        elif b.dim() == 2:
            shape = [a.shape[1], b.shape[1]]
        else:
            shape = [a.shape[0], a.shape[1], b.shape[-1]]
        with mode:
            return torch.empty(shape, dtype=out_dtype or a.dtype, device=a.device)

    @fake_impls.register_op_impl(lambda func: func is aten.linalg_solve_triangular.default)
    def solve_triangular(mode: FakeTensorMode, func: Any, a: Any, b: Any, **options: Any):
        """X of `A X = B` (left=True) or `X A = B`: B's matrix shape in the batch both broadcast to, each
        matrix column-major (LAPACK's layout), as the real and the meta kernels lay it out."""
        if all(isinstance(n, int) for n in (*a.shape, *b.shape)):
            return NotImplemented  # exact sizes: the meta kernel (its checks, its layout)
        batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        rows, cols = b.shape[-2:]
        with mode:
            return torch.empty([*batch, cols, rows], dtype=b.dtype, device=b.device).transpose(-2, -1)
