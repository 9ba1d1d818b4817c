"""What a new sequence length costs each of SDPA's CUDA kernels (NOTE: [Attention at symbolic sizes]).

    python benchmarks/attention_plans.py [--batch 4 --heads 16 --head-dim 128]

A causal attention's forward and backward in bf16, each kernel forced with `sdpa_kernel`: 20 calls at one
length, then 20 calls at 20 lengths never seen before (1001-1020). cuDNN builds an execution plan for each
shape it meets; flash's kernel needs none. One GPU; milliseconds a call, printed.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def call(args: argparse.Namespace, length: int) -> None:
    shape = (args.batch, args.heads, length, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()


def ms_a_call(args: argparse.Namespace, lengths: list[int]) -> float:
    call(args, lengths[0])  # the first length's plan (and the process's warm-up) not counted
    torch.cuda.synchronize()
    start = time.perf_counter()
    for length in lengths[1:]:
        call(args, length)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (len(lengths) - 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        with sdpa_kernel([backend]):
            one = ms_a_call(args, [1500] * 21)
            new = ms_a_call(args, list(range(1000, 1021)))
        print(f"{name}: {one:.2f} ms a call at one length (1500), {new:.2f} ms at a new length each call (1001-1020)")


if __name__ == "__main__":
    main()
