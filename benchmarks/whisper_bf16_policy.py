"""bf16 policy on real Whisper: teacher-forced decode over the fp32 transcript of fox.wav, logits vs a float64
reference; the plain bf16 cache (HF's) vs kvslim slim (the bf16 policy) and the paper's K-only slim cache.

    python benchmarks/whisper_bf16_policy.py [tiny.en|base]     # prints the table of docs/real_models.md
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import DynamicCache, EncoderDecoderCache

import kvslim
from kvslim.adapters.compat import CACHE_KW
from kvslim.audio import read_wav, speech_clip
from kvslim.models import load_whisper_base, load_whisper_tiny_en
from kvslim.models.whisper_run import transcribe_tokens, whisper_inputs


def hf_cache(model) -> EncoderDecoderCache:
    return EncoderDecoderCache(DynamicCache(config=model.config), DynamicCache(config=model.config))


@torch.no_grad()
def stepwise(model, cache, processor, audio, ids: torch.Tensor) -> torch.Tensor:
    """Logits (T-1, V) in float64 predicting ids[1:], one decoder token per step through ``cache``."""
    enc = model.get_encoder()(whisper_inputs(processor, audio, model.dtype)["input_features"])
    out = []
    for t in range(ids.shape[1] - 1):
        o = model(encoder_outputs=enc, decoder_input_ids=ids[:, t:t + 1], **{CACHE_KW: cache}, use_cache=True)
        cache = getattr(o, CACHE_KW)
        out.append(o.logits[0, -1].double())
    return torch.stack(out)


def main(name: str = "tiny.en") -> None:
    torch.set_num_threads(2)
    m32, proc = (load_whisper_tiny_en if name == "tiny.en" else load_whisper_base)(torch.float32)
    audio = read_wav(speech_clip()[0])
    toks = transcribe_tokens(m32, proc, audio)  # fp32 greedy with HF's cache
    start = torch.tensor([[m32.generation_config.decoder_start_token_id]])
    ids = toks if toks[0, 0] == start[0, 0] else torch.cat([start, toks], 1)
    m64 = copy.deepcopy(m32).double()
    ref = stepwise(m64, hf_cache(m64), proc, audio, ids)
    del m64

    def run(model, method=None, **opts):
        if method is not None:
            kvslim.apply(model, method, **opts)
        try:
            x = stepwise(model, kvslim.make_cache(model) if method else hf_cache(model), proc, audio, ids)
        finally:
            if method is not None:
                kvslim.restore(model)
        d = x - ref
        return d.abs().max().item(), (d.norm() / ref.norm()).item()

    mb = copy.deepcopy(m32).to(torch.bfloat16)
    rows = {"fp32, HF cache": run(m32), "fp32, slim (policy)": run(m32, "slim"),
            "bf16, HF cache (plain)": run(mb), "bf16, slim (policy)": run(mb, "slim"),
            "bf16, slim K-only (paper)": run(mb, "slim", cache="k", rank=0)}
    plain = rows["bf16, HF cache (plain)"]
    print(f"Whisper {name}, {ids.shape[1]} decoder tokens\n")
    print("| model dtype, cache | max |Δlogit| vs float64 | relative error | × plain bf16 (max / rel) |")
    print("|---|---|---|---|")
    for k, (mx, rel) in rows.items():
        print(f"| {k} | {mx:.3e} | {rel:.3e} | {mx / plain[0]:.2f} / {rel / plain[1]:.2f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="tiny.en", choices=("tiny.en", "base"), help="Whisper checkpoint")
    main(ap.parse_args().model)
