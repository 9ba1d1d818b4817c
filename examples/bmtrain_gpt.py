"""BMTrain's canonical training script, run by fbmt: only the import line differs.

    torchrun --nproc_per_node=2 examples/bmtrain_gpt.py            # 2 CPU ranks (gloo)
    torchrun --nproc_per_node=8 examples/bmtrain_gpt.py --dim 1024  # 8 GPUs (NCCL), when present

A GPT written with BMTrain's classes (DistributedModule, DistributedParameter, Block,
TransformerBlockList), initialized with `init_parameters`, trained with AdamOffloadOptimizer, a Noam
schedule and OptimManager's loss scaling on bytes of Python's standard library. Every rank holds only
its part of each parameter; `bmt.save` writes one full checkpoint that a plain module can load.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import fbmt as bmt  # was: import bmtrain as bmt
from fbmt.train import batch_at, load_corpus


class Embedding(bmt.DistributedModule):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = bmt.DistributedParameter(
            torch.empty(vocab_size, dim, dtype=dtype),
            init_method=bmt.ParameterInitializer(torch.nn.init.normal_, std=0.02),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def projection(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class LayerNorm(bmt.DistributedModule):
    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = bmt.DistributedParameter(torch.ones(dim, dtype=dtype), init_method=torch.nn.init.ones_)
        self.bias = bmt.DistributedParameter(torch.zeros(dim, dtype=dtype), init_method=torch.nn.init.zeros_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class Attention(bmt.DistributedModule):
    def __init__(self, dim_model: int, dim_head: int, num_heads: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.dim_head = num_heads, dim_head
        self.project_q = bmt.nn.Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
        self.project_k = bmt.nn.Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
        self.project_v = bmt.nn.Linear(dim_model, dim_head * num_heads, bias=bias, dtype=dtype)
        self.project_out = bmt.nn.Linear(dim_head * num_heads, dim_model, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.num_heads, self.dim_head).transpose(1, 2)
            for p in (self.project_q, self.project_k, self.project_v)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.project_out(out.transpose(1, 2).reshape(b, t, -1))


class Feedforward(bmt.DistributedModule):
    def __init__(self, dim_model: int, dim_ff: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.w_in = bmt.nn.Linear(dim_model, dim_ff, bias=bias, dtype=dtype)
        self.w_out = bmt.nn.Linear(dim_ff, dim_model, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x)))


class TransformerEncoder(bmt.DistributedModule):
    def __init__(self, dim_model: int, dim_head: int, num_heads: int, dim_ff: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.ln_att = LayerNorm(dim_model, dtype)
        self.attn = Attention(dim_model, dim_head, num_heads, bias, dtype)
        self.ln_ff = LayerNorm(dim_model, dtype)
        self.ff = Feedforward(dim_model, dim_ff, bias, dtype)

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.ln_att(hidden), mask)
        return hidden + self.ff(self.ln_ff(hidden))


class GPT(bmt.DistributedModule):
    def __init__(
        self,
        num_layers: int,
        vocab_size: int,
        dim_model: int,
        dim_head: int,
        num_heads: int,
        dim_ff: int,
        max_distance: int,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.word_emb = Embedding(vocab_size, dim_model, dtype)
        self.pos_emb = Embedding(max_distance, dim_model, dtype)
        self.transformers = bmt.TransformerBlockList(
            [
                bmt.Block(TransformerEncoder(dim_model, dim_head, num_heads, dim_ff, bias, dtype))
                for _ in range(num_layers)
            ]
        )
        self.layernorm = LayerNorm(dim_model, dtype)

    def forward(self, input: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask_2d = mask[:, None, :] & mask[:, :, None]  # (batch, query, key): both tokens are real
        mask_2d = mask_2d & (pos[:, None, :] <= pos[:, :, None])  # and the key does not come after the query
        out = self.word_emb(input) + self.pos_emb(pos)
        out = self.transformers(out, mask_2d)
        return self.word_emb.projection(self.layernorm(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--lr", type=float, default=1e-2, help="Noam start_lr (the peak is start_lr / sqrt(10))")
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="parameter dtype (default: float32 on CPU, float16 on GPUs, as BMTrain's example)",
    )
    ap.add_argument("--save", default="checkpoints/bmtrain_gpt.pt")
    args = ap.parse_args()

    bmt.init_distributed(seed=0)
    device = torch.device(bmt.config["device"])
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    model = GPT(
        num_layers=args.layers,
        vocab_size=256,
        dim_model=args.dim,
        dim_head=args.dim // args.heads,
        num_heads=args.heads,
        dim_ff=4 * args.dim,
        max_distance=args.seq,
        bias=True,
        dtype=dtype,
    )
    bmt.init_parameters(model)  # or bmt.load(model, "ckpt.pt")
    bmt.print_rank(
        f"model: {sum(p._original_shape.numel() for p in model.parameters()) / 1e6:.2f}M parameters "
        f"({dtype}), {bmt.world_size()} rank(s) on {device.type}"
    )

    loss_func = bmt.loss.FusedCrossEntropy(ignore_index=-100)
    optimizer = bmt.optim.AdamOffloadOptimizer(model.parameters(), lr=args.lr, weight_decay=1e-2)
    lr_scheduler = bmt.lr_scheduler.Noam(optimizer, start_lr=args.lr, warmup_iter=10, end_iter=args.steps, num_iter=0)
    optim_manager = bmt.optim.OptimManager(loss_scale=1024)
    optim_manager.add_optimizer(optimizer, lr_scheduler)

    corpus = load_corpus(4)
    gen = torch.Generator().manual_seed(bmt.rank())
    avg = bmt.utils.AverageRecorder()
    losses = []
    started = time.perf_counter()
    for iteration in range(args.steps):
        enc_input, targets = batch_at(
            corpus, iteration * bmt.world_size() + bmt.rank(), args.batch, args.seq, 1, device
        )
        pos = torch.arange(args.seq, device=device).expand(args.batch, -1)
        enc_length = torch.randint(args.seq // 2, args.seq + 1, (args.batch,), generator=gen).to(device)
        targets = torch.where(pos < enc_length[:, None], targets, -100)  # padding predicts nothing

        logits = model(enc_input, pos, pos < enc_length[:, None])
        loss = loss_func(logits.view(-1, logits.shape[-1]), targets.view(-1))
        global_loss = bmt.sum_loss(loss).item()
        optim_manager.zero_grad()
        optim_manager.backward(loss)
        grad_norm = optim_manager.clip_grad_norm(optimizer.param_groups, max_norm=1.0)
        optim_manager.step()

        losses.append(global_loss)
        avg.record(global_loss)
        if iteration % 10 == 0 or iteration == args.steps - 1:
            bmt.print_rank(
                f"| iter {iteration:4d} | loss {global_loss:.4f} (avg {avg.value:.4f}) | lr "
                f"{lr_scheduler.current_lr:.2e} | scale {optim_manager.loss_scale:g} | grad_norm "
                f"{float(grad_norm):.3f} | {time.perf_counter() - started:.1f}s"
            )
    bmt.save(model, args.save)
    k = max(1, min(10, args.steps // 4))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    bmt.print_rank(f"loss {first:.3f} -> {last:.3f} (mean of the first and last {k} steps); checkpoint: {args.save}")
    if not math.isfinite(last) or last >= first:
        raise SystemExit("bmtrain_gpt: the loss did not fall")


if __name__ == "__main__":
    main()
