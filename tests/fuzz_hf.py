"""Hugging Face models as users train them, against eager PyTorch: a search over families, fbmt's options,
training loops and batches for the run fbmt gets wrong.

    python -m tests.fuzz_hf --seeds 0:40              # one process
    python -m tests.fuzz_hf --seeds 0:40 --ranks 2    # 2 gloo ranks, each its part of the batch
    python -m tests.fuzz_hf --seeds 0:40 --bf16       # param_dtype=torch.bfloat16, against eager's bf16 copies

Each seed draws a tiny family from tests/test_families.py's tables (causal, masked and sequence-to-sequence
language models, sequence classifiers, speech models' CTC heads; `from_config`, nothing downloaded), one of
tests/fuzz.py's option sets and training loops (plain; accumulation under `no_sync()`; eval calls between
steps; a `no_grad()` call first; then clipping or a reload from the state_dict), and its batches as data
collators make them: a length of its own at each step, rows (some steps more or fewer) padded on the left or
on the right with their labels -100, `use_cache` left at the default or False, dropout on in some
single-process runs, Hugging Face's gradient checkpointing on in some (enabled before compile, or after it as
Trainer does). Three steps of SGD or AdamW are compared with eager on each rank's part (DDP's semantics: each
rank's mean loss, the gradients averaged): the losses, the eval logits, then every parameter, within what
rounding makes (eager in float64 beside it is the yardstick, in float32 for bf16 runs; as in tests/fuzz.py).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
import sys
from typing import Any

import numpy as np
import torch
import transformers

import fbmt
from tests import fuzz
from tests import test_families as fam

transformers.logging.set_verbosity_error()

KINDS = {  # a family (and its head, after a slash) -> the kind of call
    **{name: "causal" for name in ["llama", "mistral", "qwen2", "gpt2", *fam.CAUSAL]},
    **{name: "masked" for name in fam.MASKED},
    **{name: "seq2seq" for name in [*fam.SEQ2SEQ, "t5"]},
    **{f"{name}/classifier": "classifier" for name in fam.CLASSIFIERS},
}
# CTC heads of speech models, drawn apart from KINDS (on one seed in 8) so that each seed's other draws
# stay what they were
SPEECH = {f"{name}/ctc": "ctc" for name in ["wav2vec2", "hubert", "wavlm"]}
AUTO = {
    "ctc": transformers.AutoModelForCTC,
    "classifier": transformers.AutoModelForSequenceClassification,
    "causal": transformers.AutoModelForCausalLM,
    "masked": transformers.AutoModelForMaskedLM,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
}
PLAIN = fuzz.How()  # fp32, on the CPU, fbmt's own executor
ROUTED = ("num_experts", "num_local_experts", "n_routed_experts")  # a mixture of experts' config
# dropout, on in some one-process runs: where one process runs the whole batch, eager and fbmt draw the same
# masks from the same seed
DROPOUT = 0.1


def build(
    seed: int, ranks: int = 1, how: fuzz.How = PLAIN
) -> tuple[torch.nn.Module, str, dict[str, Any], random.Random]:
    """The model of `seed`, its family, fbmt's options for it, and the generator that drew them."""
    rnd = random.Random(seed)
    name = rnd.choice(sorted(KINDS))
    apart = random.Random(-2 - seed)
    if apart.random() < 1 / 8:
        name = apart.choice(sorted(SPEECH))
    kind, family = {**KINDS, **SPEECH}[name], name.split("/")[0]
    draws = rnd.random() < 0.3 and ranks == 1 and how.backend is None  # Inductor draws its own numbers
    extra = fam.ENCODER_DECODER if kind in ("seq2seq", "classifier") else {}  # (num_labels=3)
    if family == "t5":
        extra = dict(d_ff=128, d_kv=16, decoder_start_token_id=0)
    no_draws = {k: (DROPOUT if draws else 0.0) for k in fam.NO_DRAWS}
    no_draws["router_jitter_noise"] = no_draws["input_jitter_noise"] = 0.0  # noise a router adds: not a mask
    if kind == "ctc":  # SpecAugment's spans drawn with numpy at every call (NOTE: [Host calls]), on 3 seeds in 4
        spans = dict(mask_time_prob=0.2, mask_time_length=2, mask_feature_prob=0.1, mask_feature_length=4)
        speech = {
            **(spans if apart.random() < 0.75 else {"mask_time_prob": 0.0}),
            "final_dropout": DROPOUT if draws else 0.0,
        }
        config = transformers.AutoConfig.for_model(family, **{**fam.AUDIO, **speech})
        if not hasattr(config, "mask_feature_min_masks"):  # WavLM's reads it, though its config lacks it
            config.mask_feature_prob = 0.0
    else:
        config = transformers.AutoConfig.for_model(
            family, **{**fam.SMALL, **no_draws, **extra, **fam.CAUSAL.get(family, {})}
        )
    torch.manual_seed(seed)
    try:
        model = AUTO[kind].from_config(config, attn_implementation="sdpa")
    except ValueError:  # a family transformers runs with its eager attention only
        model = AUTO[kind].from_config(config, attn_implementation="eager")
    if rnd.random() < 0.25 and model.supports_gradient_checkpointing:  # as Trainer's gradient_checkpointing=True
        # WavLM's reentrant checkpoints do not finish a step in eager (seed 9908 ran for minutes, its backward
        # nested in a hundred autograd threads), most likely because its layers pass the position bias on as a
        # keyword, which a reentrant checkpoint does not detach: each layer's recompute reaches the one before
        reentrant = rnd.random() < 0.5 and not family.startswith("wavlm")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    options = {**fuzz.OPTIONS[rnd.randrange(len(fuzz.OPTIONS))], "cache_dir": False}
    options.update({k: v for k, v in (("param_dtype", how.dtype), ("backend", how.backend)) if v is not None})
    return model.to(how.device), kind, options, rnd


def _checkpointing(model: torch.nn.Module) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _compiled(ref: torch.nn.Module, seed: int, options: dict[str, Any]) -> tuple[torch.nn.Module, bool]:
    """fbmt's model of a copy of `ref`, and whether Hugging Face's checkpointing was enabled on it after
    compile, as Trainer enables it (on half of the seeds that have it: drawn apart from `build`'s, so a
    seed's model and loop stay what they were)."""
    model = copy.deepcopy(ref)
    if not _checkpointing(ref) or random.Random(-1 - seed).random() < 0.5:
        return fbmt.compile(model, **options), False
    func = next(m._gradient_checkpointing_func for m in ref.modules() if getattr(m, "gradient_checkpointing", False))
    model.gradient_checkpointing_disable()
    model = fbmt.compile(model, **options)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=dict(func.keywords))
    return model, True


def _batch(kind: str, rnd: random.Random, rows: int, length: int, device: str) -> dict[str, torch.Tensor]:
    """One step's call as a collator pads it: every row its own count of pads, on the side `rnd` draws."""
    g = torch.Generator().manual_seed(rnd.randrange(2**31))
    if kind == "ctc":  # 40 samples of audio a token's length; transcripts padded with -100 on the right
        labels = torch.randint(1, fam.AUDIO["vocab_size"], (rows, rnd.randint(3, 6)), generator=g)
        for r in range(rows):
            labels[r, labels.shape[1] - rnd.randrange(labels.shape[1] - 1) :] = -100
        audio = torch.randn(rows, 40 * length, generator=g)
        call = dict(input_values=audio, labels=labels)
        if rows > 1:  # the last row's audio padded with zeros, as the feature extractor pads
            audio[-1, 40 * length - 40 * int(torch.randint(0, length // 2, (), generator=g)) :] = 0
            call["attention_mask"] = (audio != 0).long()
        return {k: v.to(device) for k, v in call.items()}
    ids = torch.randint(3, fam.VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    side = rnd.choice(["none", "left", "right"])
    for r in range(rows):
        pads = 0 if side == "none" else rnd.randrange(length - 3)
        if side == "left":
            mask[r, :pads] = 0
        elif side == "right":
            mask[r, length - pads :] = 0
    ids = ids.masked_fill(mask == 0, fam.SMALL["pad_token_id"])
    if kind == "seq2seq":
        labels = torch.randint(3, fam.VOCAB, (rows, rnd.randint(3, 6)), generator=g)
        call = dict(input_ids=ids, attention_mask=mask, labels=labels)
    elif kind == "classifier":  # its pooling finds each row's last token that is not the pad token
        call = dict(input_ids=ids, attention_mask=mask, labels=torch.randint(0, 3, (rows,), generator=g))
    else:
        labels = ids.masked_fill(mask == 0, -100)
        if kind == "masked":  # the collator's: most tokens are not predicted
            labels = labels.masked_fill(torch.rand(ids.shape, generator=g) < 0.6, -100)
            labels[:, 1] = ids[:, 1]  # at least one a row
        call = dict(input_ids=ids, labels=labels)
        if side != "none" or rnd.random() < 0.5:
            call["attention_mask"] = mask
    return {k: v.to(device) for k, v in call.items()}


def _part(call: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in call.items()}


def compare(seed: int, rank: int = 0, ranks: int = 1, how: fuzz.How = PLAIN) -> str | None:
    """What differs from eager for `seed` (None: nothing, or eager itself fails). Call it on every rank. `how`
    as in tests/fuzz.py: with its `dtype`, fbmt's `param_dtype` against eager computing on copies of its
    parameters in it (`fuzz._LowEager`)."""
    ref, kind, options, rnd = build(seed, ranks, how)
    dtype = how.dtype
    if dtype is not None and any(hasattr(ref.config, k) for k in ROUTED):
        return None  # a router's top-k jumps where bf16 rounds a score past another
    loop = rnd.choice(fuzz.LOOPS)
    then = rnd.choice(fuzz.THEN)
    use_cache = rnd.choice([None, False]) if kind == "causal" else None
    lengths = [rnd.randint(6, 14) for _ in range(3)]
    adamw = rnd.random() < 0.5  # its eps large: an update of a gradient that is rounding alone stays small
    make_opt = (
        (lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1))
        if adamw
        else (lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    )
    # rows a rank has at each step: mostly 2, some batches more, and an epoch's last batch fewer
    rows = [rnd.choice([2, 2, 3] if loop == "accumulate" else [2, 2, 3, 1]) for _ in lengths]
    calls = [_batch(kind, rnd, b * ranks, n, how.device) for b, n in zip(rows, lengths)]
    extra = {} if use_cache is None else {"use_cache": use_cache}
    model, after = _compiled(ref, seed, options)
    checkpointing = f" (gradient checkpointing{' enabled after compile' if after else ''})"
    said = (
        f"seed {seed}: {type(ref).__name__}{checkpointing if _checkpointing(ref) else ''}, "
        f"{options}, {'AdamW' if adamw else 'SGD'}, loop {loop} {then}, use_cache {use_cache}, lengths {lengths}, "
        f"rows a rank {rows}"
    )
    fresh = copy.deepcopy(ref) if then == "reload" else None
    # where rounding alone makes eager and fbmt part: eager in float64, or in float32 against bf16's rounding
    exact = copy.deepcopy(ref).double() if dtype is None else copy.deepcopy(ref)
    try:
        exact(**_part(calls[0], slice(0, 1)), **extra)
    except RuntimeError:  # a kernel without float64 (grouped_mm experts): eager itself is the yardstick
        exact = copy.deepcopy(ref)
    eager = fuzz._LowEager(ref, dtype) if dtype else ref
    runs = [eager, model, exact]
    opts = [make_opt(m) for m in (ref, model, exact)]
    eps = torch.finfo(dtype).eps if dtype else 0.0
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}

    def close(a: torch.Tensor, b: torch.Tensor, wide: torch.Tensor, atol: float = 1e-5, scale: Any = None) -> bool:
        """fbmt's `a` near eager's `b`: within tolerance, or within 4 times eager's own distance from `wide`;
        in `dtype`, also within 4 of its epsilons of `scale` (the values' size, or a parameter's change)."""
        a, b = a.double(), b.double()
        scale = b if scale is None else scale
        own = (b - wide.double()).abs().max()  # not a number where float64 overflows a mask's minimum
        room = atol + 4 * torch.nan_to_num(own, nan=0.0) + 4 * eps * scale.abs().max()
        return torch.allclose(a, b, rtol=1e-4, atol=atol) or bool((a - b).abs().max() <= room)

    def call(m: torch.nn.Module, c: dict[str, torch.Tensor], seed: int) -> Any:
        torch.manual_seed(seed)  # dropout draws eager's masks from the same seed
        np.random.seed(seed)  # and SpecAugment eager's spans
        return m(**c, **extra)

    micro = 2 if loop == "accumulate" else 1  # a step's micro-batches: a rank's first row, then the rest

    def part_of(r: int, b: int) -> slice:
        return slice(b * r, b * r + b)

    if loop == "no_grad_first":
        with torch.no_grad():
            outs = [call(m, _part(calls[0], part_of(rank, rows[0])), 7).logits for m in runs]
        if not close(outs[1], outs[0], outs[2]):
            return f"{said}: the no_grad call's logits"
    first = None  # eager's first loss
    for step, c in enumerate(calls):
        mine = part_of(rank, rows[step])
        losses = {}  # (model, part) -> loss
        for i, m in enumerate(runs):
            # eager runs every rank's part on its own: DDP's mean of each rank's mean loss
            parts = [mine] if m is model else [part_of(r, rows[step]) for r in range(ranks)]
            for part in parts:
                for k in range(micro):
                    cut = (
                        [slice(part.start, part.start + 1), slice(part.start + 1, part.stop)][k] if micro == 2 else part
                    )
                    quiet = m is model and micro == 2 and k == 0
                    with model.no_sync() if quiet else contextlib.nullcontext():
                        loss = call(m, _part(c, cut), step).loss
                        scale = micro * (1 if m is model else ranks)
                        (loss / scale).backward()
                    if m is eager and dtype is not None:
                        eager.settle()
                    losses[i, part.start, k] = loss.item()
            if then == "clip":
                torch.nn.utils.clip_grad_norm_(opts[i].param_groups[0]["params"], 0.05)
            opts[i].step()
            opts[i].zero_grad()
        for k in range(micro):
            want, got, wide = (losses[i, mine.start, k] for i in range(3))  # eager, fbmt, float64
            if not abs(want) < 1e6:
                return None  # eager's loss overflowed, or eager itself fails
            first = want if first is None else first
            if dtype is not None and abs(want) > 10 * abs(first):
                return None  # training diverges: where bf16 rounds decides
            if not close(torch.tensor(got), torch.tensor(want), torch.tensor(wide)):
                return f"{said}: loss at step {step} {got}, eager {want}"
        if loop == "eval_between":
            for m in runs:
                m.eval()
            with torch.no_grad():
                outs = [call(m, _part(c, mine), 0).logits for m in runs]
            for m in runs:
                m.train()
            if not close(outs[1], outs[0], outs[2]):
                return f"{said}: the eval call's logits after step {step}"
        if then == "reload" and step == 1:  # a second job: a new compile, the first's state loaded
            state = model.state_dict()
            model = fbmt.compile(copy.deepcopy(fresh), **options)
            model.load_state_dict(state)
            runs[1] = model
            # the state_dict holds the model alone: every side starts a new optimizer (AdamW's moments)
            opts = [make_opt(m) for m in (ref, model, exact)]
    full, wide = model.full_parameters(), dict(exact.named_parameters())
    for n, p in ref.named_parameters():
        got = full[model.layout.aliases.get(n, n)]
        if not close(got, p.detach(), wide[n].detach(), scale=p.detach() - start[n]):
            moved = (p.detach() - start[n]).abs().max().item()
            return f"{said}: parameter {n} differs by {(got - p).abs().max().item():.3g} (moved {moved:.3g})"
    return None


def caught(seed: int, rank: int = 0, ranks: int = 1, how: fuzz.How = PLAIN) -> str | None:
    try:
        return compare(seed, rank, ranks, how)
    except Exception as e:
        return f"seed {seed}, {type(build(seed, ranks)[0]).__name__}: {type(e).__name__}: {str(e)[:600]}"


def on_ranks(rank: int, world: int, seeds: list[int], how: fuzz.How = PLAIN) -> list[str]:
    logging.getLogger("fbmt").setLevel(logging.ERROR)
    return [said for seed in seeds if (said := caught(seed, rank, world, how))]


def main(argv: list[str] | None = None) -> int:
    return fuzz.search(__doc__, caught, on_ranks, argv, "no dropout: it draws its own")


if __name__ == "__main__":
    sys.exit(main())
