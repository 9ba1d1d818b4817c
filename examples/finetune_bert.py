"""Fine-tune a pretrained BERT with a classification head, compiled by fbmt (ModelCenter's flow).

    torchrun --nproc_per_node=2 examples/finetune_bert.py                      # 2 CPU ranks (gloo)
    torchrun --nproc_per_node=2 examples/finetune_bert.py --pretrained DIR     # your HF BERT folder

The task: which package of Python's standard library a docstring comes from (asyncio, email, logging
or xml), read from the library's own source files, so the data set is on every machine. A model
folder in Hugging Face's layout (config.json, model.safetensors, tokenizer.json) is what the flow
starts from: `--pretrained` names one (any BERT checkpoint with its tokenizer.json). Without it, the
script first makes one, as a pretraining run would: a WordPiece tokenizer (`tokenizers`) and a small
BERT trained by masked language modeling on the training docstrings, saved with `save_pretrained`
into `checkpoints/bert-stdlib` (reused when there).

Then `fbmt.models.BertClassifier.from_pretrained` builds the model on the meta device with a fresh
classification head, `fbmt.compile` loads it block by block, every rank trains on its part of each
batch, and the held-out accuracy (over every rank's part) is printed beside the majority class's.
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import sysconfig
import time
import zlib

import torch

import fbmt
from fbmt.models import BertClassifier, BertConfig, BertMLM, load_tokenizer

PACKAGES = ("asyncio", "email", "logging", "xml")


def docstrings() -> list[tuple[str, int, bool]]:
    """(docstring, package index, held out) of every documented function and class of PACKAGES."""
    root, out = sysconfig.get_paths()["stdlib"], []
    for label, package in enumerate(PACKAGES):
        for folder, _, files in sorted(os.walk(os.path.join(root, package))):
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                with open(path, encoding="utf-8", errors="replace") as f:
                    tree = ast.parse(f.read())
                for node in ast.walk(tree):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        doc = ast.get_docstring(node)
                        if doc and len(doc) >= 20:
                            held_out = zlib.crc32(f"{path}:{node.lineno}".encode()) % 5 == 0  # a fixed 20%
                            out.append((" ".join(doc.split()), label, held_out))
    if not out:
        raise SystemExit(f"no docstrings found under {root}: this Python has no standard library sources")
    return out


def make_pretrained(folder: str, texts: list[str], args: argparse.Namespace) -> None:
    """A tokenizer and a small BERT pretrained by masked language modeling, saved as an HF folder."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(vocab_size=args.vocab, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    config = BertConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        intermediate_size=4 * args.dim,
        max_position_embeddings=args.seq,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    ids, mask = encode(tok, texts, args.seq)
    torch.manual_seed(args.seed)
    model = fbmt.compile(BertMLM(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    g = torch.Generator().manual_seed(args.seed)
    for step in range(args.pretrain_steps):
        pick = torch.randint(0, len(ids), (args.batch,), generator=g)  # the same global batch on every rank
        x, m = ids[pick], mask[pick]
        chosen = (torch.rand(x.shape, generator=g) < 0.15) & m.bool() & (x > 4)
        labels = torch.where(chosen, x, torch.full_like(x, -100))
        x = torch.where(chosen, torch.full_like(x, 4), x)  # [MASK]
        x, m, labels = fbmt.local_part((x, m, labels))
        loss = model(x, attention_mask=m, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if fbmt.rank() == 0 and (step + 1) % max(1, args.pretrain_steps // 4) == 0:
            print(f"  pretraining step {step + 1}/{args.pretrain_steps}: masked-LM loss {loss.item():.3f}")
    model.save_pretrained(folder)  # gathered from every rank's shards; rank 0 writes
    if fbmt.rank() == 0:
        tok.save(os.path.join(folder, "tokenizer.json"))
    torch.distributed.barrier()


def encode(tok, texts: list[str], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    tok.enable_truncation(seq)
    tok.enable_padding(pad_id=tok.token_to_id("[PAD]") or 0, length=seq)
    batch = tok.encode_batch(texts)
    return torch.tensor([e.ids for e in batch]), torch.tensor([e.attention_mask for e in batch])


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--pretrained", default=None, help="an HF BERT folder with tokenizer.json (default: make one)")
    p.add_argument("--out", default="checkpoints/bert-stdlib", help="where the made pretrained folder goes")
    p.add_argument("--epochs", type=int, default=8, help="fine-tuning passes over the training docstrings")
    p.add_argument("--batch", type=int, default=32, help="global batch (split across ranks)")
    p.add_argument("--lr", type=float, default=1e-3, help="fine-tuning learning rate")
    p.add_argument("--seq", type=int, default=64, help="tokens per docstring (truncated, padded)")
    p.add_argument("--dim", type=int, default=64, help="width of the made BERT")
    p.add_argument("--layers", type=int, default=2, help="layers of the made BERT")
    p.add_argument("--vocab", type=int, default=2000, help="WordPiece vocabulary of the made tokenizer")
    p.add_argument("--pretrain-steps", type=int, default=400, help="masked-LM steps of the made BERT")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    fbmt.init_distributed(seed=args.seed)
    if args.batch % fbmt.world_size():
        raise SystemExit(f"--batch {args.batch} must be a multiple of the {fbmt.world_size()} ranks")
    say = print if fbmt.rank() == 0 else (lambda *a, **k: None)
    data = docstrings()
    train = [(t, y) for t, y, held in data if not held]
    test = [(t, y) for t, y, held in data if held]
    say(f"data: {len(train)} training and {len(test)} held-out docstrings of {', '.join(PACKAGES)}")

    folder = args.pretrained or args.out
    if args.pretrained is None and not os.path.isfile(os.path.join(folder, "model.safetensors")):
        say(f"making a pretrained BERT in {folder} (tokenizer + masked-LM pretraining)")
        make_pretrained(folder, [t for t, _ in train], args)
    tok = load_tokenizer(folder)
    started = time.perf_counter()
    with torch.device("meta"):  # reads config.json and the tensor index only; the head is new, of the task's size
        model = BertClassifier.from_pretrained(folder, num_labels=len(PACKAGES))
    model = fbmt.compile(model)  # each block is read from model.safetensors as it is materialized
    say(f"loaded {folder} block by block in {time.perf_counter() - started:.1f}s")

    xs, ms = encode(tok, [t for t, _ in train], args.seq)
    ys = torch.tensor([y for _, y in train])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    order = list(range(len(train)))
    steps = 0
    for epoch in range(args.epochs):
        random.Random(args.seed + epoch).shuffle(order)  # the same order on every rank
        model.train()
        for i in range(0, len(order) - args.batch + 1, args.batch):
            pick = torch.tensor(order[i : i + args.batch])
            x, m, y = fbmt.local_part((xs[pick], ms[pick], ys[pick]))
            loss = model(x, attention_mask=m, labels=y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
            steps += 1
        say(f"epoch {epoch + 1}: loss {loss.item():.3f}, held-out accuracy {accuracy(model, tok, test, args):.1%}")
    majority = max(sum(1 for _, y in test if y == k) for k in range(len(PACKAGES))) / len(test)
    final = accuracy(model, tok, test, args)
    say(f"held-out accuracy {final:.1%} after {steps} steps; the majority class alone: {majority:.1%}")


def accuracy(model, tok, test: list[tuple[str, int]], args: argparse.Namespace) -> float:
    """Every rank classifies its part of the held-out set; the counts are summed over ranks."""
    xs, ms = encode(tok, [t for t, _ in test], args.seq)
    ys = torch.tensor([y for _, y in test])
    n = len(test) - len(test) % fbmt.world_size()  # whole parts for every rank (the rest is left out)
    model.eval()
    right = torch.zeros(())
    with torch.no_grad():
        for i in range(0, n, args.batch):
            j = min(i + args.batch, n)
            x, m, y = fbmt.local_part((xs[i:j], ms[i:j], ys[i:j]))
            right += (model(x, attention_mask=m).logits.argmax(-1) == y).sum()
    torch.distributed.all_reduce(right)
    return right.item() / n


if __name__ == "__main__":
    main()
