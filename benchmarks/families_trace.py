"""How each Hugging Face family of the tests compiles: seconds to its first step, whether a trace ran
again under functionalization (NOTE: [Writes to fresh tensors]), what was stamped, and how many programs
four training calls of other lengths compiled (two where one symbolic program serves them all: NOTE:
[Dynamic sizes]).

    python benchmarks/families_trace.py                  # every family of tests/test_families.py, 4 layers
    python benchmarks/families_trace.py --only deepseek_v3,mbart --layers 8
    PYTHONPATH=.base python benchmarks/families_trace.py --package fbmt_base   # an older tree

Each family as `tests/test_families.py` builds it (tiny widths, from_config, dropout as its config has
it), compiled for one CPU process and called once with the test's first call, forward and backward.
The seconds include the first step's run, which is small beside compiling at these widths.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import test_families as families  # noqa: E402  (the families' configs and calls, as tested)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--only", default="", help="comma-separated model types")
    ap.add_argument("--package", default="fbmt")
    args = ap.parse_args()
    fbmt = importlib.import_module(args.package)
    trace = importlib.import_module(f"{args.package}.compiler.trace")
    second = []
    real = trace.functionalize
    trace.functionalize = lambda *a, **k: (second.append(1), real(*a, **k))[1]

    heads = [(m, transformers.AutoModelForCausalLM, "causal") for m in families.CAUSAL]
    heads += [(m, transformers.AutoModelForMaskedLM, "masked") for m in families.MASKED]
    heads += [(m, transformers.AutoModelForSeq2SeqLM, "seq2seq") for m in families.SEQ2SEQ]
    only = set(filter(None, args.only.split(",")))
    heads = [h for h in heads if not only or h[0] in only]
    print("| family | seconds | traces again | stamped | programs for lengths 12, 9, 15, 20 |\n|---|---|---|---|---|")
    for i, (model_type, auto, kind) in enumerate([heads[0], *heads]):  # the first once untimed: imports, caches
        extra = families.ENCODER_DECODER if kind == "seq2seq" else {}
        config = transformers.AutoConfig.for_model(
            model_type,
            **{**families.SMALL, **extra, **families.CAUSAL.get(model_type, {}), "num_hidden_layers": args.layers},
        )
        torch.manual_seed(0)
        try:
            model = auto.from_config(config, attn_implementation="sdpa")
        except ValueError:  # a family transformers runs with its eager attention only
            model = auto.from_config(config, attn_implementation="eager")
        call = families._calls(kind, torch.Generator().manual_seed(1))[0]
        second.clear()
        started = time.perf_counter()
        compiled = fbmt.compile(model, cache_dir=False)
        compiled(**call).loss.backward()
        seconds = time.perf_counter() - started
        line = next(x for x in str(compiled.program).splitlines() if "pass trace" in x)
        stamped = line[line.index("stamped their calls") :].split("(", 1)[1].split(")")[0] if "stamped" in line else "-"
        for length in (9, 15, 20):  # the sequences' length alone changes (a sequence-to-sequence model's source)
            ids = torch.randint(3, families.VOCAB, (3, length), generator=torch.Generator().manual_seed(length))
            sized = dict(input_ids=ids, labels=ids) if kind == "causal" else dict(call, input_ids=ids)
            if kind == "masked":
                sized["labels"] = ids
            if "attention_mask" in call:
                sized["attention_mask"] = torch.ones_like(ids)
            compiled(**sized).loss.backward()
        if i:
            programs = len(compiled.programs)
            print(f"| {model_type} | {seconds:.2f} | {len(second) or '-'} | {stamped} | {programs} |", flush=True)


if __name__ == "__main__":
    main()
