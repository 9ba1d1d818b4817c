"""Speech models on CUDA, compiled by fbmt, against eager on the same GPU (one process).

    python tests/gpu/speech_on_gpu.py

wav2vec2's CTC head (its label check kept as a device-side check, NOTE: [Checks that raise]; its targets
read as rows by fbmt::ctc_nll, NOTE: [CTC's selected targets]; SpecAugment's spans drawn on the host at
every call, NOTE: [Host calls], from padded rows' lengths) with fbmt's executor, with Inductor, and with
cuda_graph=True (which such a program runs without), WavLM's and the conformer's CTC heads, and Whisper:
the losses and the parameters after 3 SGD steps at three input lengths (two programs; three with
cuda_graph=True), dropout off, numpy seeded alike. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import os
import sys

import numpy as np
import torch
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import fbmt  # noqa: E402
from tests.test_families import AUDIO, VOCAB, WHISPER  # noqa: E402


def _calls(kind: str, device: torch.device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    calls = []
    for step in range(3):
        if kind == "ctc":
            labels = torch.randint(1, AUDIO["vocab_size"], (2, 6), generator=g)
            labels[1, 4 - step :] = -100
            audio = torch.randn(2, 400 + 40 * step, generator=g)
            audio[1, 300:] = 0  # padded, as the feature extractor pads
            call = dict(input_values=audio, attention_mask=(audio != 0).long(), labels=labels)
        else:
            call = dict(
                input_features=torch.randn(2, 16, 32, generator=g),
                labels=torch.randint(3, VOCAB, (2, 5 + step), generator=g),
            )
        calls.append({k: v.to(device) for k, v in call.items()})
    return calls


def train(ref: torch.nn.Module, kind: str, device: torch.device, **options) -> float:
    """The worst relative error of the losses and of the parameters after 3 SGD steps."""
    model = fbmt.compile(copy.deepcopy(ref), cache_dir=False, **options)
    # CTC's loss is summed over the batch (in the hundreds here): a larger step turns rounding into 1e-3
    opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (ref, model)]
    worst = 0.0
    for step, call in enumerate(_calls(kind, device)):
        losses = []
        for m in (ref, model):
            np.random.seed(step)  # SpecAugment's spans: eager's
            losses.append(m(**call).loss)
        want, got = losses
        worst = max(worst, float((got - want).abs() / want.abs().clamp_min(1e-6)))
        for loss, opt in zip((want, got), opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
    full = model.full_parameters()
    for name, p in ref.named_parameters():
        scale = p.detach().abs().max().clamp_min(1e-6)
        worst = max(worst, float((full[name] - p.detach()).abs().max() / scale))
    # the second length's program, of symbolic sizes, takes the third; CUDA graphs replay one shape each
    if len(model.programs) > (3 if options.get("cuda_graph") else 2):
        print(f"{len(model.programs)} programs for 3 lengths", flush=True)
        return float("inf")
    return worst


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    spans = dict(mask_time_prob=0.3, mask_time_length=2, mask_feature_prob=0.2, mask_feature_length=4)
    config = transformers.AutoConfig.for_model("wav2vec2", **AUDIO, **spans, final_dropout=0.0)
    failed = []
    for how in (dict(backend="eager"), dict(backend="inductor"), dict(backend="eager", cuda_graph=True)):
        torch.manual_seed(0)
        ref = transformers.AutoModelForCTC.from_config(config).to(device)
        err = train(ref, "ctc", device, background_compile=False, **how)
        print(f"wav2vec2 CTC with SpecAugment, {how}: worst relative error {err:.2e}", flush=True)
        if err > 1e-3:
            failed.append(f"wav2vec2 CTC {how}")
    # attention through F.multi_head_attention_forward (WavLM), and the conformer's: one symbolic program on
    # torch 2.11 too (NOTE: [Matmul on symbolic sizes])
    for family in ("wavlm", "wav2vec2-conformer"):
        torch.manual_seed(0)
        # the conformer's convolution module keeps a dropout of its own: off, as every other is
        config = transformers.AutoConfig.for_model(family, **AUDIO, final_dropout=0.0, conformer_conv_dropout=0.0)
        err = train(
            transformers.AutoModelForCTC.from_config(config).to(device), "ctc", device, background_compile=False
        )
        print(f"{family} CTC: worst relative error {err:.2e}", flush=True)
        if err > 1e-3:
            failed.append(f"{family} CTC")
    whisper = transformers.AutoConfig.for_model("whisper", **WHISPER)
    torch.manual_seed(0)
    err = train(transformers.AutoModelForSpeechSeq2Seq.from_config(whisper).to(device), "speech", device)
    print(f"whisper: worst relative error {err:.2e}", flush=True)
    if err > 1e-3:
        failed.append("whisper")
    if failed:
        raise SystemExit(f"FAILED: {failed}")
    print("PASSED")


if __name__ == "__main__":
    main()
