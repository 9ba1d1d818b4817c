"""Train a Hugging Face model with `transformers.Trainer`, compiled by fbmt.

    torchrun --nproc_per_node=2 examples/hf_trainer.py           # 2 CPU ranks (gloo)
    torchrun --nproc_per_node=2 examples/hf_trainer.py --check   # then the same run in eager DDP, compared

The script is what a Trainer user writes, plus two lines: `fbmt.init_distributed()` before the model
is built, and `fbmt.compile(model)` before it goes to the Trainer. The Trainer reads the compiled
model's `forward` signature to pick the dataset's columns, shards the data across ranks, builds its
AdamW over the compiled model's parameters (this rank's flat shards), and clips by the norm over
every rank's shards. It does not wrap the model in DDP: fbmt already reduces the gradients.

The model is a tiny random Llama (`from_config`, nothing downloaded) learning to continue counting
sequences modulo the vocabulary. `--check` trains the eager model (DDP, the same data and seed) and
compares the losses and every parameter; it exits non-zero where they differ.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import transformers
from torch.utils.data import Dataset

import fbmt


class Counting(Dataset):
    """Sequences `s, s+1, s+2, ...` (mod vocab): a next-token task a tiny model learns in steps."""

    def __init__(self, n: int, seq: int, vocab: int):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.seq) + i * 7) % self.vocab
        return {"input_ids": ids, "attention_mask": torch.ones(self.seq, dtype=torch.long), "labels": ids.clone()}


def build(args: argparse.Namespace) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.dim,
        intermediate_size=2 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq,
    )
    torch.manual_seed(args.seed)  # every rank builds the same model (fbmt keeps its part of each parameter)
    return transformers.AutoModelForCausalLM.from_config(config)


def train(
    model: torch.nn.Module, args: argparse.Namespace, out: str, optimizer: torch.optim.Optimizer | None = None
) -> tuple[list[float], transformers.Trainer]:
    training = transformers.TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate,  # accelerate runs all but the last under model.no_sync()
        max_steps=args.steps,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,  # all but biases and norm weights, split inside fbmt's flat shards
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        dataloader_drop_last=True,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    data = Counting(
        args.batch * args.accumulate * args.steps * int(os.environ.get("WORLD_SIZE", "1")), args.seq, args.vocab
    )
    trainer = transformers.Trainer(model=model, args=training, train_dataset=data, optimizers=(optimizer, None))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per micro-batch")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--dim", type=int, default=64, help="model width")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's, on all but biases and norm weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="also train eager (DDP) and compare")
    p.add_argument(
        "--offload",
        action="store_true",
        help="fbmt.compile(offload=True): shards, gradients and Adam's state in host memory, stepped by "
        "fbmt.optim.AdamOffloadOptimizer (Trainer's AdamW, in fbmt's C++ Adam)",
    )
    args = p.parse_args()
    if args.offload and args.weight_decay:
        p.error(
            "--offload builds its optimizer on the flat shards, where Trainer's split of decay by name cannot be "
            "kept: add --weight-decay 0"
        )
    transformers.logging.set_verbosity_error()

    fbmt.init_distributed(seed=args.seed)
    model = fbmt.compile(build(args), offload=args.offload)
    # Trainer's own optimizer is torch's AdamW; with offload, the same update runs on the host shards in place
    host_adam = fbmt.optim.AdamOffloadOptimizer(model.parameters(), lr=args.lr) if args.offload else None
    with tempfile.TemporaryDirectory() as out:
        losses, _ = train(model, args, out, host_adam)
    params = model.full_parameters()  # a collective: every rank
    if fbmt.rank() == 0:
        print(f"fbmt: {args.steps} steps on {fbmt.world_size()} rank(s), loss {losses[0]:.3f} -> {losses[-1]:.3f}")
        per_step = model.gradient_reductions / args.steps  # what accumulation without sync saves
        print(f"gradient reductions per optimizer step: {per_step:g} ({len(model.layout.groups)} flat groups)")
    if not args.check:
        return
    with tempfile.TemporaryDirectory() as out:
        eager_losses, trainer = train(build(args), args, out)
    eager = dict(trainer.model.named_parameters())
    diff = max((params[n] - p.detach()).abs().max().item() for n, p in eager.items())
    loss_diff = max(abs(a - b) for a, b in zip(losses, eager_losses))
    if fbmt.rank() == 0:
        print(f"eager: loss {eager_losses[0]:.3f} -> {eager_losses[-1]:.3f}")
        print(f"check: max loss difference {loss_diff:.2e}, max parameter difference {diff:.2e}")
    if diff > 1e-5 or loss_diff > 1e-5:
        raise SystemExit(f"fbmt and eager differ (parameters by {diff:.2e}, losses by {loss_diff:.2e})")


if __name__ == "__main__":
    main()
