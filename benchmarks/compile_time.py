"""Compile time against depth: tracing and each pass, for GPT models of L layers on meta.

    python benchmarks/compile_time.py                       # L = 4, 16, 64 (the dev CPU)
    python benchmarks/compile_time.py --layers 4,16,64,128 --profile 64
    python benchmarks/compile_time.py --cache /tmp/c; python benchmarks/compile_time.py --cache /tmp/c
    PYTHONPATH=.base python benchmarks/compile_time.py --package fbmt_base   # an older commit's tree
    FBMT_STAMP=0 python benchmarks/compile_time.py --hf --d-model 256   # HF's Llama, no stamping
    python benchmarks/compile_time.py --hf --hf-call default --d-model 256   # called as HF documents it
    python benchmarks/compile_time.py --hf --family t5 --d-model 256 --layers 8,24   # GPT-2, BERT, T5, BART: dropout on
    python benchmarks/compile_time.py --floor     # one layer's forward alone, on meta and on fake tensors: no trace

Nothing runs: the model is built on meta, compiled for `--world` ranks and traced on CPU fakes, as
`fbmt.simulate` does, so the numbers are the compiler's own time, without Inductor or a device.
A compiler whose passes are linear in the program's nodes shows a flat `ms/layer` column per pass;
`--profile L` prints cProfile's top functions for one depth, to find the pass that is not.
`--package fbmt_base` times a tree written by `benchmarks/base_package.sh COMMIT .base` instead.
`--cache DIR` compiles with the compile cache in DIR: the first run fills it (cold), a second
process loads every program from it (warm; the pass columns are then 0).
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import pstats
import time
from collections.abc import Callable

import torch


def compile_once(
    layers: int,
    d_model: int,
    world: int,
    remat: str,
    package: str = "fbmt",
    cache_dir: str | bool = False,
    hf: bool = False,
    hf_call: str = "no-cache",
    family: str = "llama",
) -> tuple[float, dict[str, float], int]:
    fbmt = importlib.import_module(package)
    ids = torch.zeros(2, 1024, dtype=torch.long)
    # Hugging Face's Llama is built on the host (its rotary buffer has no initializer on meta): give it
    # a width the host holds (--d-model 256)
    with torch.device("cpu" if hf else "meta"):
        if hf:  # Hugging Face's Llama: with use_cache=False its layers get a causal mask; called as Hugging
            # Face documents it (`--hf-call default`), they write to the cache the forward built
            import transformers

            config = transformers.LlamaConfig(
                vocab_size=32000,
                hidden_size=d_model,
                intermediate_size=4 * d_model,
                num_hidden_layers=layers,
                num_attention_heads=16,
                max_position_embeddings=1024,
            )
            model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
            args, kwargs = (), {"input_ids": ids, "labels": ids}
            if hf_call == "no-cache":
                kwargs["use_cache"] = False
            if family != "llama":  # as their configs have them: dropout on (a mask drawn in place)
                model = _family(transformers, family, layers, d_model)
                kwargs = {"input_ids": ids[:, :512].contiguous(), "labels": ids[:, :512].contiguous()}
        else:
            gpt = importlib.import_module(f"{package}.models.gpt")
            GPT, GPTConfig = gpt.GPT, gpt.GPTConfig
            model = GPT(GPTConfig(vocab_size=32000, seq_len=1024, n_layer=layers, n_head=16, d_model=d_model))
            args, kwargs = (ids,), {}
    started = time.perf_counter()
    try:  # without --cache, no cache at all: a default folder filled by an earlier run would load
        compiled = fbmt.compile(model, world_size=world, device="meta", remat=remat, cache_dir=cache_dir)
    except TypeError:  # an older tree, from before the compile cache
        compiled = fbmt.compile(model, world_size=world, device="meta", remat=remat)
    program = compiled.trace(*args, device="cpu", **kwargs)
    total = time.perf_counter() - started
    # a program loaded from the cache took no pass time in this run
    loaded = getattr(program, "origin", "").startswith("loaded")
    passes = {r.name: 0.0 if loaded else r.seconds for r in program.history}
    return total, passes, len(program.graph.nodes)


def _family(transformers, family: str, layers: int, d_model: int):
    """GPT-2, BERT, T5 or BART (T5, BART: `layers` in the encoder and in the decoder) of width `d_model`."""
    heads = dict(num_attention_heads=16) if family != "t5" else dict(num_heads=16, d_kv=d_model // 16)
    if family == "bart":
        heads = dict(encoder_attention_heads=16, decoder_attention_heads=16, max_position_embeddings=1024)
        heads.update(
            encoder_layers=layers, decoder_layers=layers, encoder_ffn_dim=4 * d_model, decoder_ffn_dim=4 * d_model
        )
    config = transformers.AutoConfig.for_model(
        family,
        vocab_size=32000,
        hidden_size=d_model,
        num_hidden_layers=layers,
        intermediate_size=4 * d_model,
        **heads,
        **(dict(d_ff=4 * d_model, num_decoder_layers=layers, decoder_start_token_id=0) if family == "t5" else {}),
    )
    auto = {"gpt2": "AutoModelForCausalLM", "bert": "AutoModelForMaskedLM"}.get(family, "AutoModelForSeq2SeqLM")
    return getattr(transformers, auto).from_config(config, attn_implementation="sdpa")


def forward_floor_ms(d_model: int, repeats: int = 50) -> tuple[float, float]:
    """What running one GPT layer's forward costs with no trace at all (the floor under any proof that
    runs each layer to show the layers alike): on plain `meta` tensors, and on the fake tensors a trace
    runs it on (their cached dispatch is the cheaper: on meta, attention runs its decomposition)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fbmt.models import gpt

    with torch.device("meta"):
        model = gpt.GPT(gpt.GPTConfig(vocab_size=32000, seq_len=1024, n_layer=1, n_head=16, d_model=d_model))
        x = torch.empty(2, 1024, d_model)
    layer = next(m for m in model.modules() if type(m).__name__ == "Block")

    def timed(run: Callable[[], object]) -> float:
        for _ in range(3):
            run()
        started = time.perf_counter()
        for _ in range(repeats):
            run()
        return (time.perf_counter() - started) / repeats * 1e3

    fake_mode = FakeTensorMode()
    with fake_mode:
        params = {n: torch.empty(p.shape, requires_grad=True) for n, p in layer.named_parameters()}
        x_fake = torch.empty(2, 1024, d_model, requires_grad=True)

    def on_fakes() -> object:
        with fake_mode:
            return torch.func.functional_call(layer, params, (x_fake,))

    return timed(lambda: layer(x)), timed(on_fakes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", default="4,16,64")
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--remat", default="block")
    ap.add_argument("--profile", type=int, default=0, help="profile this depth instead")
    ap.add_argument("--package", default="fbmt", help="the package to time (fbmt_base: an older tree)")
    ap.add_argument("--cache", default="", help="compile with this cache folder (run twice: cold, then warm)")
    ap.add_argument("--hf", action="store_true", help="transformers' LlamaForCausalLM (use_cache=False), not GPT")
    ap.add_argument(
        "--hf-call",
        choices=("no-cache", "default"),
        default="no-cache",
        help="with --hf: use_cache=False, or not given",
    )
    ap.add_argument(
        "--family", choices=("llama", "gpt2", "bert", "t5", "bart"), default="llama", help="with --hf: which model"
    )
    ap.add_argument(
        "--floor",
        action="store_true",
        help="time one GPT layer's forward alone (no trace), on meta and on fake tensors, instead",
    )
    args = ap.parse_args()
    if args.floor:
        on_meta, on_fakes = forward_floor_ms(args.d_model)
        print(f"one layer's forward: {on_meta:.2f} ms on meta, {on_fakes:.2f} ms on fake tensors")
        return

    def once(layers: int) -> tuple[float, dict[str, float], int]:
        return compile_once(
            layers,
            args.d_model,
            args.world,
            args.remat,
            args.package,
            args.cache or False,
            args.hf,
            args.hf_call,
            args.family,
        )

    if args.profile:
        prof = cProfile.Profile()
        prof.runcall(once, args.profile)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        return
    rows = []
    for layers in (int(x) for x in args.layers.split(",")):
        total, passes, nodes = once(layers)
        rows.append((layers, total, passes, nodes))
        print(f"L={layers}: {total:.2f} s, {nodes} nodes", flush=True)
    names = list(rows[0][2])
    print("\n| layers | nodes | total (s) | trace + rest (s) | " + " | ".join(f"{n} (s)" for n in names) + " |")
    print("|---" * (4 + len(names)) + "|")
    for layers, total, passes, nodes in rows:
        rest = total - sum(passes.values())
        cells = " | ".join(f"{passes[n]:.2f}" for n in names)
        print(f"| {layers} | {nodes} | {total:.2f} | {rest:.2f} | {cells} |")
    first, last = rows[0], rows[-1]
    print(
        f"\nper layer: L={first[0]} {first[1] / first[0] * 1e3:.0f} ms, L={last[0]} {last[1] / last[0] * 1e3:.0f} ms "
        f"(total {last[1] / first[1]:.1f}x for {last[0] / first[0]:.0f}x the layers)"
    )


if __name__ == "__main__":
    main()
