"""Programs and compile seconds for a stream of sequence lengths and for `generate()`, with
`dynamic=False` (a program per shape) and `dynamic=True` (NOTE: [Dynamic sizes]), on the CPU:

    PYTHONPATH=. python benchmarks/lengths_cpu.py
    PYTHONPATH=. python benchmarks/lengths_cpu.py --layers 24 --stream   # the stream alone, deeper
    PYTHONPATH=. python benchmarks/lengths_cpu.py --layers 16 --stream --model hf-no-cache   # HF's Llama
    FBMT_STAMP=0 PYTHONPATH=. python benchmarks/lengths_cpu.py --layers 24 --stream   # every layer traced
    PYTHONPATH=. python benchmarks/lengths_cpu.py --background   # Inductor's compiles in the step / in workers
    PYTHONPATH=. python benchmarks/lengths_cpu.py --generate --family mistral   # a sliding window of 10 that fills
    PYTHONPATH=. python benchmarks/lengths_cpu.py --shapes   # batch sizes vary too, then an evaluation

A GPT of 4 layers (width 64) trains on one rank on batches of 12 lengths from 16 to 128 (inputs and
targets sliced from one token tensor), and a tiny Hugging Face Llama generates 20 tokens with its
default cache; the stream runs again with backend="inductor" (Inductor's caches in a fresh folder,
so cold). Printed: programs compiled, fbmt's compile seconds, and the wall time of the loop; with
Inductor also its region compiles and their seconds. `--stream`: the eager stream alone, with
dynamic=True, and each program's compile seconds (`--layers`: the model's depth; `--model`: the GPT,
or the tiny HF Llama called with `use_cache=False` or as HF documents it). `--background`: the Inductor
stream with dynamic=True, `background_compile=False` and then `True` (the default on CUDA, asked for here),
each cold: every step's seconds and the loop's wall time (the compiles still running then are waited for
after it: `wait_compiled`).
"""

from __future__ import annotations

import argparse
import copy
import os
import tempfile
import time

import torch
import torch.nn.functional as F
import transformers

import fbmt
from fbmt.models.gpt import GPT, GPTConfig
from tests.models import hf


def stream(
    dynamic: bool, backend: str = "eager", layers: int = 4, model: str = "gpt", background: bool | None = None
) -> tuple[int, float, float, object]:
    """`model`: "gpt", or the tiny HF Llama called with `use_cache=False` ("hf-no-cache") or as HF
    documents it ("hf")."""
    torch.manual_seed(0)
    if model == "gpt":
        built = GPT(GPTConfig(vocab_size=64, seq_len=128, n_layer=layers, n_head=2, d_model=64))
    else:
        config = hf.config("llama")
        config.num_hidden_layers, config.max_position_embeddings = layers, 256
        built = transformers.AutoModelForCausalLM.from_config(config)
    m = fbmt.compile(
        built, world_size=1, cache_dir=False, dynamic=dynamic, backend=backend, background_compile=background
    )
    lengths = [16, 24, 16, 40, 128, 57, 33, 96, 16, 71, 88, 20]
    t = time.perf_counter()
    for n in lengths:
        began = time.perf_counter()
        tok = torch.randint(0, 64, (4, n + 1))
        x, y = tok[:, :-1], tok[:, 1:]
        before = m.compile_seconds
        if model == "gpt":
            F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
        else:
            m(input_ids=x, labels=y, **({"use_cache": False} if model == "hf-no-cache" else {})).loss.backward()
        if m.compile_seconds > before:
            m.__dict__.setdefault("each", []).append(round(m.compile_seconds - before, 2))
        m.__dict__.setdefault("steps", []).append(time.perf_counter() - began)
    return len(m.programs), m.compile_seconds, time.perf_counter() - t, m


def gen(dynamic: bool, family: str = "llama", tokens: int = 20) -> tuple[int, float, float, object]:
    """generate() of `tokens` tokens from a prompt of 5; Mistral with a window of 10, which fills on the way (its
    layers count their tokens in an int: NOTE: [Numbers in an object])."""
    if family == "llama":
        ref = hf.build("llama")
    else:
        config = transformers.MistralConfig(**hf.DECODER, vocab_size=hf.VOCAB, sliding_window=10)
        torch.manual_seed(0)
        ref = transformers.AutoModelForCausalLM.from_config(config)
    m = fbmt.compile(copy.deepcopy(ref), world_size=1, cache_dir=False, dynamic=dynamic)
    prompt = torch.randint(3, hf.VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    m.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return len(m.programs), m.compile_seconds, time.perf_counter() - t, None


def shapes(layers: int = 4) -> tuple[int, float, float, object]:
    """The tiny HF Llama (`layers` deep) trains on batches whose size varies as well as their length (a last
    batch cut short, another batch size), then evaluates (`eval()`, `no_grad()`) at three other shapes."""
    config = hf.config("llama")
    config.num_hidden_layers, config.max_position_embeddings = layers, 256
    torch.manual_seed(0)
    m = fbmt.compile(transformers.AutoModelForCausalLM.from_config(config), world_size=1, cache_dir=False)
    t = time.perf_counter()
    for batch, n in [(4, 16), (4, 24), (3, 16), (8, 40), (6, 20), (4, 33), (2, 90), (4, 57)]:
        x = torch.randint(3, hf.VOCAB, (batch, n))
        m(input_ids=x, labels=x).loss.backward()
    m.eval()
    with torch.no_grad():
        for batch, n in [(4, 20), (6, 28), (8, 12)]:
            x = torch.randint(3, hf.VOCAB, (batch, n))
            m(input_ids=x, labels=x)
    return len(m.programs), m.compile_seconds, time.perf_counter() - t, m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4, help="the model's depth")
    ap.add_argument("--stream", action="store_true", help="the eager stream alone, dynamic=True")
    ap.add_argument("--model", choices=("gpt", "hf-no-cache", "hf"), default="gpt", help="with --stream")
    ap.add_argument("--background", action="store_true", help="the Inductor stream, compiles in the step / in workers")
    ap.add_argument("--generate", action="store_true", help="generate() alone, dynamic=False / True")
    ap.add_argument("--family", choices=("llama", "mistral"), default="llama", help="with --generate")
    ap.add_argument("--new-tokens", type=int, default=20, help="with --generate: how many tokens it generates")
    ap.add_argument("--shapes", action="store_true", help="batch sizes and lengths both vary, then an evaluation")
    args = ap.parse_args()
    if args.shapes:
        p, c, w, _ = shapes(args.layers)
        print(
            f"8 training shapes, 3 evaluated, tiny HF Llama {args.layers} layers | {p} programs | compile {c:.2f} s "
            f"| wall {w:.2f} s"
        )
        return
    if args.generate:
        for dynamic in (False, True):
            p, c, w, _ = gen(dynamic, args.family, args.new_tokens)
            print(
                f"generate {args.new_tokens} tokens, tiny HF {args.family} | dynamic={dynamic} | {p} programs | "
                f"compile {c:.2f} s "
                f"| wall {w:.2f} s"
            )
        return
    if args.background:
        for background in (False, True):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lengths-inductor-")
            p, c, w, m = stream(True, "inductor", background=background)
            m.wait_compiled()
            steps = " ".join(f"{s:.2f}" for s in m.steps)
            print(
                f"background_compile={background} | {p} programs | compiles (s) {m.each} | steps (s) {steps} "
                f"| loop {w:.1f} s | {m.regions}"
            )
        return
    if args.stream:
        p, c, w, m = stream(True, layers=args.layers, model=args.model)
        print(
            f"stream, {args.model} {args.layers} layers | {p} programs | compile {c:.2f} s (each: {m.each}) "
            f"| wall {w:.2f} s"
        )
        return
    for name, f in (
        ("stream of 12 lengths 16-128, GPT 4 layers d64, 1 rank", stream),
        ("generate 20 tokens, tiny HF Llama", gen),
    ):
        for dynamic in (False, True):
            p, c, w, _ = f(dynamic)
            print(f"{name} | dynamic={dynamic} | {p} programs | compile {c:.2f} s | wall {w:.2f} s", flush=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="lengths-inductor-")
    for dynamic in (False, True):
        p, c, w, r = stream(dynamic, "inductor")
        print(
            f"stream, backend=inductor | dynamic={dynamic} | {p} programs | compile {c:.2f} s | wall {w:.2f} s "
            f"| Inductor: {r.regions.misses} region compiles, {r.regions.seconds:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
