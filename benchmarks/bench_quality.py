"""KV-cache quantization quality on a real model and real long text: kvslim's formats beside HF QuantizedCache.

SmolLM2-135M-Instruct (fp32, dequantized from its GGUF), Botchan (shipped, public domain). Every cache is fed
the same text in lockstep with the model's own dense cache (``kvslim.evaluate.compare_caches``) and scored on
the same predictions: Δ perplexity, mean KL from dense, teacher-forced top-1 agreement, max |Δlogit|, bytes
per token measured from the tensors, bits per element of codes + scales (residual window apart).

Suites:
    ablation  one component at a time (asymmetric codes, KIVI keys, residual window, Hadamard rotation pre/post
              RoPE, smoothing), int4 and int2, plus quanto 4/2 bits       (explore: --tokens 2048 --steps 256)
    final     the defaults (``apply(model, "int4")``, ``"int2"``), the old int4, int8, quanto 4/2 bits
    heldout   int8 / int4 / int2 defaults and quanto 4/2 bits, for ``--texts`` (issue 29)
    int2x     int2 candidates (apply options only; defaults unchanged), chosen on ``--texts dev``
    decisions issue 29's candidates for the int4 / int2 / int3 defaults, run on ``--texts dev`` only

    .venv/bin/python benchmarks/bench_quality.py --suite final                 # full protocol, token mode
    .venv/bin/python benchmarks/bench_quality.py --suite ablation --tokens 2048 --steps 256
    .venv/bin/python benchmarks/bench_quality.py --suite final --mode chunked  # prefill 512 + 64-token chunks
    .venv/bin/python benchmarks/bench_quality.py --suite heldout --texts all --tokens 2049 --steps 512 --threads 1

``--texts dev|heldout|all`` (token mode, call by call; ``kvslim.heldout``): the development text (Botchan) and/or
the held-out texts (code, technical prose, dialogue), each scored step by step (``kvslim.stepwise``): Δppl with
a 95 % paired-bootstrap interval over the scored steps (1,000 resamples, seed 0), KL, top-1, and bytes measured
from the tensors after every scored step, full-precision window included, the same way for kvslim and quanto
(at the end and averaged over the steps). Writes benchmarks/results/quality_{dev,heldout}_<date>[_model][tag].

Needs ``pip install --no-deps optimum-quanto==0.2.7`` (the ``[bench]`` extra) for the quanto rows.
Writes benchmarks/results/bench_quality_<suite>_<mode>.json and .md (and, for ``final``, a PNG of Δppl
against bits per element).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from kvslim import api
from kvslim.caches import KVSlimCache
from kvslim.caches.dense import AppendLayer
from kvslim.caches.residual import ResidualStore, RingResidualStore
from kvslim.caches.sink import SinkStore
from kvslim.evaluate import compare_caches, greedy_agreement, text_ids
from kvslim.methods import METHODS
from kvslim.ops.rope import rotate, unrotate
from kvslim.optional import quanto_missing

RESULTS = Path(__file__).resolve().parent / "results"
F16 = torch.float16

# (label, method or "quanto", options). Options of kvslim methods are apply() keywords; "prerope" (bench only)
# quantizes keys before RoPE (see PreRopeStore).
def _int4(label_opts: str, **opts) -> tuple[str, str, dict]:
    """An int4 row with every format option explicit (independent of the method's defaults)."""
    full = dict(asymmetric=True, residual=0, key_channel_group=0, rotation=None, group_size=64, scale_dtype=F16,
                smooth_keys=True, value_rotation=None, sink=0)
    full.update(opts)
    return f"int4 {label_opts}", "int4", full


def _int2(label_opts: str, **opts) -> tuple[str, str, dict]:
    full = dict(asymmetric=True, residual=128, key_channel_group=0, rotation=None, group_size=32, scale_dtype=F16,
                smooth_keys=True, key_bits=None, value_rotation=None, sink=0)
    full.update(opts)
    return f"int2 {label_opts}", "int2", full


OLD_INT4 = dict(asymmetric=False, residual=0, key_channel_group=0, rotation=None, group_size=64,
                scale_dtype="float32", smooth_keys=True, value_rotation="none", sink=0)
ABLATION = [
    ("int4 old: sym g64 fp32 +smooth", "int4", OLD_INT4),
    _int4("sym g32 fp32 +smooth", asymmetric=False, group_size=32, scale_dtype="float32"),
    _int4("asym g64 fp16 +smooth"),
    _int4("asym g32 fp16 +smooth", group_size=32),
    _int4("asym g64 fp16 +smooth +r128", residual=128),
    _int4("asym g64 fp16 +kivi32 +r32", key_channel_group=32, residual=32),
    _int4("asym g64 fp16 +kivi32 +r128", key_channel_group=32, residual=128),
    _int4("asym g32 fp16 +kivi32 +r128", key_channel_group=32, residual=128, group_size=32),
    _int4("asym g32 fp16 +had(post)", rotation="hadamard", group_size=32, smooth_keys=False),
    _int4("asym g64 fp16 +had(post) +r128", rotation="hadamard", residual=128, smooth_keys=False),
    _int4("asym g64 fp16 +had(pre) +r128", rotation="hadamard", residual=128, smooth_keys=False, prerope=True),
    _int4("asym g64 fp16 +kivi32(pre) +r128", key_channel_group=32, residual=128, prerope=True),
    _int4("asym g64 fp16 +kivi32 +r128 +vhad (default)", key_channel_group=32, residual=128,
          value_rotation="hadamard"),
    _int4("asym g64 fp16 +kivi32 +r124 +vhad +sink4", key_channel_group=32, residual=124,
          value_rotation="hadamard", sink=4),
    _int4("asym g64 fp16 +kivi32 +r120 +vhad +sink8", key_channel_group=32, residual=120,
          value_rotation="hadamard", sink=8),
    ("quanto 4-bit g64 r128", "quanto", dict(nbits=4)),
    _int2("asym g32 fp16 +smooth +r128"),
    _int2("K3 kivi64 V2 g64 +r128", key_bits=3, key_channel_group=64, group_size=64),
    _int2("K3 kivi64 V2 g64 +vhad +r128 (default)", key_bits=3, key_channel_group=64, group_size=64,
          value_rotation="hadamard"),
    _int2("K3 kivi64 V2 g32 +r128 (3.25 bits)", key_bits=3, key_channel_group=64, group_size=32),
    _int2("asym g32 fp16 +kivi32 +r128", key_channel_group=32),
    _int2("asym g32 fp16 +kivi32 +r32", key_channel_group=32, residual=32),
    _int2("asym g32 fp16 +had(post) +r128", rotation="hadamard", smooth_keys=False),
    _int2("asym g32 fp16 +kivi32(pre) +r128", key_channel_group=32, prerope=True),
    ("quanto 2-bit g64 r128", "quanto", dict(nbits=2)),
]
OLD_INT2 = dict(key_bits=2, asymmetric=True, residual=128, key_channel_group=32, group_size=32, scale_dtype=F16,
                value_rotation="none", rotation=None)
PREV_INT4 = dict(asymmetric=True, key_channel_group=32, residual=128, group_size=64, scale_dtype=F16,
                 value_rotation="hadamard", sink=0, rotation=None)  # the int4 default before the sink tokens
FINAL = [
    ("int8 g64 (default)", "int8", {}),
    ("int4 old: sym g64 fp32 +smooth", "int4", OLD_INT4),
    ("int4 KIVI-32 r128, rotated V, no sinks", "int4", PREV_INT4),
    ("int4 (default)", "int4", {}),
    ("quanto 4-bit g64 r128", "quanto", dict(nbits=4)),
    ("int2 old: K2 kivi32 V2 g32 r128", "int2", OLD_INT2),
    ("int2 (default)", "int2", {}),
    ("quanto 2-bit g64 r128", "quanto", dict(nbits=2)),
    # HF's QuantizedCache refuses models with sliding-window layers (Gemma-3); the same quanto layers built one
    # per layer (every layer keeps every token, quantized; HF's mask still applies the sliding window)
    ("quanto 4-bit g64 r128, every layer", "quanto", dict(nbits=4, every_layer=True)),
    ("quanto 2-bit g64 r128, every layer", "quanto", dict(nbits=2, every_layer=True)),
]
PREV_INT2 = dict(asymmetric=True, key_bits=3, key_channel_group=64, residual=128, sink=0, group_size=64,
                 scale_dtype=F16, value_rotation="hadamard")  # the int2 default before issue 29
HELDOUT = [r for r in FINAL if r[0] in ("int8 g64 (default)", "int4 (default)", "int2 (default)",
                                       "quanto 4-bit g64 r128", "quanto 2-bit g64 r128")] + [
    # the default format with a 60-token window: at or below quanto 4-bit's measured bytes (its 128-token
    # buffer averages about half full), for the equal-bytes comparison
    ("int4 r60 +sink4 (quanto 4-bit's bytes)", "int4", {"residual": 60}),
    ("int2 before issue 29 (r128, no sinks)", "int2", PREV_INT2),
    ("int3 (default)", "int3", {}),
]
INT2_DEFAULT = dict(asymmetric=True, key_bits=3, key_channel_group=64, residual=128, group_size=64, scale_dtype=F16,
                    value_rotation="hadamard", rotation=None, sink=0)  # the int2 default before issue 29, explicit
INT2X = [
    ("int2 (default)", "int2", {}),
    ("int2 K3 V2 g64 +vhad r124 +sink4", "int2", {**INT2_DEFAULT, "residual": 124, "sink": 4}),
    ("int2 K3 V2 g32 +vhad r128 (3.25 bits)", "int2", {**INT2_DEFAULT, "group_size": 32}),
    ("int2 K4 V2 g64 +vhad r128 (3.5 bits)", "int2", {**INT2_DEFAULT, "key_bits": 4}),
    ("int2 K3 kivi32 V2 g64 +vhad r128", "int2", {**INT2_DEFAULT, "key_channel_group": 32}),
]
_V8 = dict(asymmetric=True, key_channel_group=32, residual=124, sink=4, group_size=64, scale_dtype=F16,
           value_rotation="hadamard")  # int8 values beside int4-format keys (key_bits=4): the keys' share
ROT = {"rotation": "hadamard"}  # keys Hadamard-rotated before their groups
DECISIONS = [  # issue 29: candidates on the development text only (--texts dev --engine one-pass), both models
    ("int4 (default: KIVI-32 keys, rotated values, sink4 r124)", "int4", {}),
    ("int4 keys only (values int8)", "int8", {**_V8, "key_bits": 4}),
    ("int4 values only (keys int8)", "int4", {"key_bits": 8}),
    ("int4 KIVI-64 keys", "int4", {"key_channel_group": 64}),
    ("int4 KIVI-16 keys", "int4", {"key_channel_group": 16}),
    ("int4 keys per token g64, rotated", "int4", {**ROT, "key_channel_group": 0, "flush": 32, "smooth_keys": False}),
    ("int4 sink8 r120", "int4", {"sink": 8, "residual": 120}),
    ("int4 rotated keys", "int4", ROT),
    ("int4 rotated keys, sink8 r120", "int4", {**ROT, "sink": 8, "residual": 120}),
    ("int4 rotated KIVI-64 keys", "int4", {**ROT, "key_channel_group": 64}),
    ("int2 before issue 29 (r128, no sinks)", "int2", PREV_INT2),
    ("int2 keys only (values int8)", "int8", {**_V8, "key_bits": 3, "key_channel_group": 64, "residual": 128,
                                               "sink": 0}),
    ("int2 values only (keys int8)", "int2", {**PREV_INT2, "key_bits": 8}),
    ("int2 rotated keys (r128, no sinks)", "int2", {**PREV_INT2, **ROT}),
    ("int2 (default: sink4 r124)", "int2", {}),
    ("int2 rotated keys, sink4 r124", "int2", ROT),
    ("int2 sink8 r120", "int2", {"sink": 8, "residual": 120}),
    ("int2 + values g32 (3.25 bits)", "int2", {"group_size": 32}),
    ("int2 + KIVI-32 keys (3.25 bits)", "int2", {"key_channel_group": 32}),
    ("int3 (default: K3 KIVI-64 + V3 g64, 3.5 bits)", "int3", {}),
    ("int3 rotated keys", "int3", ROT),
    ("int3 K3 KIVI-32 + V3 g64 (3.75 bits)", "int3", {"key_channel_group": 32}),
]
_T = dict(flush=64)  # turbo rows flush their window 64 tokens at a time, as int3/int2: the same full-precision bytes
_TO = dict(flush=64, rotation="orthogonal", outliers=16)  # 16 key channels at one more bit (48 + 16 not 2^k)
TURBO = [  # issue 35: TurboQuant-class codes against int3/int2 at equal measured bytes (--engine one-pass)
    ("int3 (default)", "int3", {}),
    ("int2 (default)", "int2", {}),
    ("int4 (default)", "int4", {}),
    ("turbo3 (default)", "turbo3", {}),
    ("turbo3 flush64", "turbo3", _T),
    ("turbo3 flush64 orthogonal", "turbo3", {**_T, "rotation": "orthogonal"}),
    ("turbo3 flush64 smooth keys", "turbo3", {**_T, "smooth_keys": True}),
    ("turbo3 flush64 K o16 (int3's bytes)", "turbo3", _TO),
    ("turbo2 (default)", "turbo2", {}),
    ("turbo2 flush64 K3 V2", "turbo2", {**_T, "key_bits": 3}),
    ("turbo2 flush64 K3 o16 V2 (int2's bytes)", "turbo2", {**_TO, "key_bits": 3}),
    ("turbo4 flush64", "turbo4", _T),
    # keys centred per channel before the rotation (the first write's means, fp32): a key's constant offset no
    # longer rides on every row's norm
    ("turbo3 flush64 centred keys", "turbo3", {**_T, "center_keys": True}),
    ("turbo3 flush64 centred K o16 (int3's bytes)", "turbo3", {**_TO, "center_keys": True}),
    ("turbo2 flush64 centred K3 V2", "turbo2", {**_T, "key_bits": 3, "center_keys": True}),
    ("turbo2 flush64 centred K3 o16 V2 (int2's bytes)", "turbo2", {**_TO, "key_bits": 3, "center_keys": True}),
]
_TC = dict(flush=64, rotation="orthogonal", outliers=16, center_keys=True)  # the turbo3/turbo2 candidates of record
TURBO_HELDOUT = [  # issue 35: the turbo rows on the held-out texts (kvslim int rows: the heldout suite's records)
    ("turbo3 centred K o16 r123 (<= int3's bytes)", "turbo3", {**_TC, "residual": 123}),
    ("turbo2 centred K3 o16 V2 r123 (<= int2's bytes)", "turbo2", {**_TC, "key_bits": 3, "residual": 123}),
]
_PR = dict(prerope_keys=True)  # keys coded before RoPE (KVQuant's lever; the store un-rotates by the slot's angles)
TURBO_LEVERS = [  # issue 35 point 2: the KVQuant levers on the turbo formats, decided on --texts dev
    ("turbo3 pre-RoPE keys", "turbo3", _PR),
    ("turbo2 pre-RoPE keys", "turbo2", _PR),
    ("turbo3 pre-RoPE keys, no outliers (3.25 bits)", "turbo3", {**_PR, "outliers": 0}),
    ("turbo3 pre-RoPE keys, not centred", "turbo3", {**_PR, "center_keys": False}),
]
TURBO_LEVERS_HELDOUT = [  # the levers that won on the development text of both models, at int3's / int2's bytes
    ("turbo3 pre-RoPE K r123 (<= int3's bytes)", "turbo3", {**_PR, "residual": 123}),
    ("turbo2 pre-RoPE K r123 (<= int2's bytes)", "turbo2", {**_PR, "residual": 123}),
]
_RC = dict(rope_centred_keys=True)  # pre-RoPE channel means, post-RoPE codes (the library's RoPE-centred keys)
TURBO_ROPE_CENTRED = [
    ("turbo3 RoPE-centred keys (pre-RoPE means, post-RoPE codes)", "turbo3", _RC),
    ("turbo2 RoPE-centred keys (pre-RoPE means, post-RoPE codes)", "turbo2", _RC),
]
TURBO_ROPE_CENTRED_HELDOUT = [  # at int3's / int2's bytes
    ("turbo3 RoPE-centred K r123 (<= int3's bytes)", "turbo3", {**_RC, "residual": 123}),
    ("turbo2 RoPE-centred K r123 (<= int2's bytes)", "turbo2", {**_RC, "residual": 123}),
]
# issue 35, the int formats: keys rotated layer by layer (``per_layer``), except the layers whose keys are mostly a
# constant offset on the development text (benchmarks/key_offsets.py -> key_offsets_<model>.json; SmolLM2: none,
# Qwen2.5-Coder: 0, 1, 2, 4, 8). "per_layer": OFFSET_ROT is resolved per model in cache_maker.
OFFSET_ROT = "rotate keys outside the offset layers"
INT_PER_LAYER = [  # decided on --texts dev, both models
    ("int4 (default)", "int4", {}),
    ("int4 keys rotated outside the offset layers", "int4", {"per_layer": OFFSET_ROT}),
    ("int2 (default)", "int2", {}),
    ("int2 keys rotated outside the offset layers", "int2", {"per_layer": OFFSET_ROT}),
    ("int2 keys rotated outside the offset layers, values g32 (3.25 bits)", "int2",
     {"per_layer": OFFSET_ROT, "group_size": 32}),
]
INT_PER_LAYER_HELDOUT = [row for row in INT_PER_LAYER if row[2]]
# SmolLM2 only: its int4 error sits in layers 15-24 (Botchan: those ten in int8 cut KL 77 %, layers 0-14 in int8 16 %;
# quality_dev_2026-11-26_int_levers.json); the same ten layers in int8 on the held-out texts
INT4_SMOLLM2_BITS_HELDOUT = [("int4, layers 15-24 in int8", "int4", {"per_layer": {i: {"bits": 8} for i in range(15, 25)}})]
SUITES = {"int_per_layer": INT_PER_LAYER, "int_per_layer_heldout": INT_PER_LAYER_HELDOUT,
          "int4_smollm2_bits_heldout": INT4_SMOLLM2_BITS_HELDOUT, "ablation": ABLATION, "turbo_levers": TURBO_LEVERS, "turbo_rope_centred": TURBO_ROPE_CENTRED,
          "turbo_rope_centred_heldout": TURBO_ROPE_CENTRED_HELDOUT, "turbo_levers_heldout": TURBO_LEVERS_HELDOUT, "final": FINAL, "heldout": HELDOUT, "int2x": INT2X, "decisions": DECISIONS,
          "turbo": TURBO, "turbo_heldout": TURBO_HELDOUT}
FUSED_DECODE = False  # set by --fused-decode
MODEL = "smollm2"  # set by --model


def offset_rotation(layers: int) -> dict:
    """``per_layer`` rotating the keys of every layer but the offset layers of key_offsets_<MODEL>.json."""
    path = RESULTS / f"key_offsets_{MODEL}.json"
    if not path.is_file():
        raise SystemExit(f"{path.name} is missing: run benchmarks/key_offsets.py --model {MODEL} first")
    skip = set(json.loads(path.read_text())["offset_layers"])
    return {i: {"rotation": "hadamard"} for i in range(layers) if i not in skip}
MODELS = {  # --model: (loader name in kvslim.models, label)
    "smollm2": ("load_smollm2", "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized, fp32)"),
    "gemma3": ("load_gemma3_270m", "Gemma-3-270M (GGUF Q4_K_M dequantized, fp32)"),
    "qwen25": ("load_qwen25_coder", "Qwen2.5-Coder-0.5B-Instruct (GGUF dequantized, fp32)"),
}


def load_model(loader: str):
    """The model of ``--model`` in fp32. When its weight packages are gone but an earlier run left the converted
    Hugging Face folder in the kvslim cache (``<cache>/models/<name>-<fingerprint>``, one such folder), that folder
    is loaded instead (the same weights; the script says so)."""
    import kvslim.models
    from kvslim.kernels.build import cache_root

    try:
        return getattr(kvslim.models, loader)(torch.float32)
    except FileNotFoundError as e:
        name = {"load_qwen25_coder": "qwen2.5-coder-0.5b-instruct", "load_smollm2": "smollm2-135m-instruct",
                "load_gemma3_270m": "gemma-3-270m"}[loader]
        found = sorted(p for p in (cache_root() / "models").glob(f"{name}-*") if (p / "config.json").is_file())
        if len(found) != 1:
            raise
        from transformers import AutoModelForCausalLM, AutoTokenizer

        print(f"{e}\nloading the converted folder {found[0]} instead", flush=True)
        model = AutoModelForCausalLM.from_pretrained(found[0], dtype=torch.float32, local_files_only=True).eval()
        tok = AutoTokenizer.from_pretrained(found[0], local_files_only=True)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.padding_side = "left"
        tok.model_max_length = getattr(model.config, "max_position_embeddings", None) or tok.model_max_length
        return model, tok


class PreRopeStore:
    """Bench-only: keeps keys *before* RoPE in a coded store and re-applies RoPE on read. Valid for one unpadded
    sequence, where a token's slot is its position (what this benchmark feeds). A library version would store
    positions; measured here to decide whether it is worth it."""

    def __init__(self, inner, cos: torch.Tensor, sin: torch.Tensor):
        self.inner, self.cos, self.sin = inner, cos, sin  # cos/sin: (positions, D)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def write(self, start: int, x: torch.Tensor) -> None:
        s = x.shape[2]
        self.inner.write(start, unrotate(x, self.cos[start:start + s], self.sin[start:start + s]).to(x.dtype))

    def read(self, start: int, end: int, scratch=None) -> torch.Tensor:
        return rotate(self.inner.read(start, end), self.cos[start:end], self.sin[start:end])


class PreRopeAppendLayer(AppendLayer):
    def __init__(self, spec, cos, sin, **kw):
        super().__init__(spec, **kw)
        self._rope = (cos, sin)

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        if isinstance(self.k_store, ResidualStore):
            self.k_store.inner = PreRopeStore(self.k_store.inner, *self._rope)
        else:
            self.k_store = PreRopeStore(self.k_store, *self._rope)


def cache_maker(model, method: str, options: dict, max_positions: int):
    """A function building a fresh cache for one row, and facts about its format."""
    if method == "quanto":
        from transformers import QuantizedCache
        from transformers.cache_utils import Cache, QuantoQuantizedLayer

        kw = dict(nbits=options["nbits"], q_group_size=64, residual_length=128)
        if options.get("every_layer"):  # what QuantizedCache would build, without its full-attention-only check
            n = model.config.num_hidden_layers
            return (lambda: Cache(layers=[QuantoQuantizedLayer(**kw) for _ in range(n)])), {}
        return (lambda: QuantizedCache("quanto", model.config, **kw)), {}
    opts = dict(options)
    prerope = opts.pop("prerope", False)
    if opts.get("per_layer") == OFFSET_ROT:
        opts["per_layer"] = offset_rotation(model.config.num_hidden_layers)
    plan = METHODS[method].plan_model(model, **opts)
    lp = plan.layers[0]
    cfg = model.config
    elems = 2 * cfg.num_key_value_heads * (cfg.head_dim if getattr(cfg, "head_dim", None) else
                                           cfg.hidden_size // cfg.num_attention_heads)
    per_token = sum(x.bytes_per_token for x in plan.layers) / len(plan.layers)  # layers may differ (per_layer)
    facts = {"plan_bits_per_element": 8 * per_token / elems, "residual": lp.residual, "plan": plan,
             "note": lp.note, "options": {k: str(v) for k, v in {**options, **opts}.items()}}
    if not prerope:
        def make_kvslim():
            cache = KVSlimCache([x.factory(None) for x in plan.layers], plan=plan)
            if FUSED_DECODE:  # --fused-decode: decode steps read the codes through the fused kernels
                cache.enable_fused_decode()
            return cache
        return make_kvslim, facts
    pos = torch.arange(max_positions)[None]
    dummy = torch.zeros(1, 1, 1, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(dummy, pos)  # (1, P, D)
    spec = lp.factory(None).spec

    def make():
        return KVSlimCache([PreRopeAppendLayer(spec, cos[0], sin[0], chunk=256) for _ in plan.layers], plan=plan)
    return make, facts


def measured_bits(cache, tokens: int, cfg) -> tuple[float, int]:
    """(bits per element of the coded part, bytes of the full-precision window) measured from the tensors."""
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    coded_bytes, coded_elems, window = 0, 0, 0
    for layer in cache.layers:
        if hasattr(layer, "k_store"):
            for store in layer._stores():
                b, h = store.data.shape[:2]
                if isinstance(store, (ResidualStore, SinkStore)):  # window (and sinks) apart
                    coded = store.coded if isinstance(store, SinkStore) else store.inner
                    f = store.flushed - min(tokens, store.spec.sink)
                    if isinstance(store, RingResidualStore):  # a sliding layer's ring keeps its last groups
                        f = store.coded_slots()
                    coded_bytes += coded.nbytes(f)
                    window += store.nbytes(tokens) - coded.nbytes(f)
                else:
                    f = layer.stored_tokens()  # a ring holds only its last W − 1 tokens
                    coded_bytes += store.nbytes(f)
                coded_elems += b * h * f * d
        else:  # HF QuantizedLayer: quantized tensors + full-precision residual keys/values
            from kvslim.evaluate import _tensor_bytes

            for name in ("_quantized_keys", "_quantized_values"):
                q = getattr(layer, name)
                coded_bytes += _tensor_bytes(q, set())
                coded_elems += q.numel()
            window += _tensor_bytes(layer.keys, set()) + _tensor_bytes(layer.values, set())
    return 8 * coded_bytes / max(1, coded_elems), window


def git_commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001 - informational only
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=sorted(SUITES), default="final")
    p.add_argument("--mode", choices=("token", "chunked"), default="token")
    p.add_argument("--tokens", type=int, default=4096, help="text tokens fed (protocol: >= 4096)")
    p.add_argument("--steps", type=int, default=1024, help="token mode: single-token steps scored (>= 1024)")
    p.add_argument("--greedy", type=int, default=0, help="also greedy agreement over N new tokens (256)")
    p.add_argument("--only", default=None, help="comma-separated substrings of row labels to keep")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="", help="suffix of the result files (e.g. _short for a ranking run)")
    p.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="only merge the rows of these result files (same model and protocol) into "
                        "bench_quality_<suite>_<mode>_merged<tag>.{json,md,png}; the later file wins a label")
    p.add_argument("--engine", choices=("calls", "one-pass"), default="calls",
                   help="calls: feed every cache call by call (compare_caches); one-pass: the same protocol in one "
                        "forward pass per kvslim row (kvslim.evaluate_parallel; quanto rows are skipped)")
    p.add_argument("--fused-decode", action="store_true",
                   help="kvslim int8/int4/int2 rows decode through the fused kernels (kernels/quant_decode*.py; "
                        "their score path follows KVSLIM_QUANT_SCORES) instead of the layers' dequantized reads")
    p.add_argument("--texts", choices=("dev", "heldout", "all"), default=None,
                   help="score these texts step by step (token mode, call by call): Δppl with a paired-bootstrap "
                        "95 %% interval, KL, top-1, bytes at the end and averaged over the steps (kvslim.heldout)")
    p.add_argument("--resamples", type=int, default=1000, help="--texts: bootstrap resamples (seed 0)")
    args = p.parse_args()
    if args.texts and (args.mode != "token" or args.merge):
        p.error("--texts runs the token mode (--mode token), not with --merge")
    global FUSED_DECODE, MODEL
    FUSED_DECODE, MODEL = args.fused_decode, args.model
    if args.merge:
        merge(args)
        return
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")

    loader, model_label = MODELS[args.model]
    model, tok = load_model(loader)
    api.apply(model, "dense")  # the storage methods' attention (packed GQA SDPA); caches differ per row
    rows = SUITES[args.suite]
    if args.only:
        keys = args.only.split(",")  # a key ending in "$" must match a whole label
        rows = [r for r in rows if any(r[0] == k[:-1] if k.endswith("$") else k in r[0] for k in keys)]
    if args.engine == "one-pass":  # --texts: quanto rows run call by call beside them
        rows = [r for r in rows if (args.texts or r[1] != "quanto") and not r[2].get("prerope")]
    if any(r[1] == "quanto" for r in rows) and quanto_missing():
        print(f"quanto rows left out: {quanto_missing()}")
        rows = [r for r in rows if r[1] != "quanto"]
    makers, facts = {}, {}
    for label, method, opts in rows:
        makers[label], facts[label] = cache_maker(model, method, opts, args.tokens + args.greedy + 8)
    if args.texts:
        per_text(args, model, tok, model_label, makers, facts)
        return
    ids = text_ids(tok, args.tokens)
    t0 = _STATE["t_start"] = time.time()  # the run's start: ``seconds`` in the JSON counts from here
    if args.engine == "one-pass":
        out = one_pass_rows(model, ids, rows, facts, args)
        finish(args, model, model_label, out, t0)
        return
    built: dict[str, object] = {}

    def keep(label, make):  # remember the last cache built for each row, to measure its tensors afterwards
        def f():
            built[label] = make()
            return built[label]
        return f
    results = compare_caches(model, ids, {k: keep(k, v) for k, v in makers.items()}, mode=args.mode,
                             min_tokens=4096 if args.tokens >= 4096 else None, steps=args.steps, progress=True)
    out = []
    for label, q in results.items():
        bits, window = measured_bits(built[label], args.tokens, model.config)
        rec = {**q.to_dict(), "bits_per_element": bits, "window_bytes": window, **_public(facts[label])}
        if args.greedy:
            prompt = ids[:, :512]
            rec["greedy"] = greedy_agreement(model, prompt, args.greedy, makers[label])
        out.append(rec)
        print(_row(rec), flush=True)
    finish(args, model, model_label, out, t0)


def per_text(args, model, tok, model_label, makers, facts) -> None:
    """``--texts``: every row on every text of the set, step by step; the record is rewritten after each text."""
    from kvslim import heldout
    from kvslim.evaluate_parallel import layer_specs_of
    from kvslim.stepwise import compare_specs_steps, compare_steps

    t0 = time.time()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    model_tag = "" if args.model == "smollm2" else f"_{args.model}"
    stem = RESULTS / f"quality_{'dev' if args.texts == 'dev' else 'heldout'}_{date}{model_tag}{args.tag}"
    one_pass = {label: layer_specs_of(facts[label]["plan"]) for label in makers
                if args.engine == "one-pass" and "plan" in facts[label]}
    engine = "calls (stepwise)" if not one_pass else "one-pass (stepwise) for kvslim rows, calls for quanto rows"
    record = {"texts_set": args.texts, "suite": args.suite, "mode": "token", "engine": engine,
              "tokens": args.tokens, "steps": args.steps, "prefill": args.tokens - args.steps - 1,
              "resamples": args.resamples, "bootstrap_seed": 0, "threads": args.threads,
              "command": "python " + " ".join(sys.argv), "model": model_label,
              "hf_dense_bytes_per_token": hf_dense_bytes_per_token(model, args.tokens),
              "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
              "commit": git_commit(), "date": date, "texts": [], "partial": True}
    for name in heldout.SETS[args.texts]:
        ids = heldout.text_ids(tok, name, args.tokens)
        built: dict[str, object] = {}
        print(f"{name}: {len(makers)} rows, {args.tokens} tokens, {args.steps} steps", flush=True)
        calls = {k: _keep(built, k, v) for k, v in makers.items() if k not in one_pass}
        res = compare_steps(model, ids, calls, steps=args.steps, progress=True) if calls else {}
        res.update(compare_specs_steps(model, ids, one_pass, steps=args.steps) if one_pass else {})
        rows = []
        for label in makers:
            q = res[label]
            if label in one_pass:
                bits, window = facts[label]["plan_bits_per_element"], None
            else:
                bits, window = measured_bits(built[label], int(q.held[-1]), model.config)
            rows.append({**q.to_dict(args.resamples), "bits_per_element": bits, "window_bytes": window,
                         "engine": "one-pass" if label in one_pass else "calls",
                         **_public(facts[label])})
            print(_text_row(rows[-1]), flush=True)
        record["texts"].append({**heldout.describe(name), "ref_ppl": rows[0]["ref_ppl"], "rows": rows})
        record["seconds"] = time.time() - t0
        RESULTS.mkdir(exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
        stem.with_suffix(".md").write_text(text_markdown(record))
    record["partial"] = False
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(text_markdown(record))
    print(text_markdown(record))


def _public(facts: dict) -> dict:
    """A row's facts for the JSON record (the plan object left out)."""
    return {k: v for k, v in facts.items() if k != "plan"}


def _keep(built: dict, label: str, make):
    """``make`` that also remembers the cache it built in ``built[label]`` (measured after the run)."""
    def f():
        built[label] = make()
        return built[label]
    return f


def _text_row(r: dict) -> str:
    lo, hi = r["delta_ppl_ci95"]
    return (f"{r['label']:40s} Δppl {100 * r['delta_ppl']:+6.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}]  "
            f"KL {r['kl']:.4f}  top1 {100 * r['top1']:.1f} %  {r['bytes_per_token_avg']:.0f} B/token avg  "
            f"{r['bytes_per_token_end']:.0f} end")


def text_markdown(rec: dict) -> str:
    """One table per text: Δppl with its paired-bootstrap 95 % interval, KL, top-1, measured bytes."""
    out = [f"{rec['model']}; token protocol: prefill {rec['prefill']}, {rec['steps']} single-token steps scored, "
           f"HF DynamicCache as reference; Δppl 95 % interval: paired bootstrap over the steps ({rec['resamples']} "
           f"resamples, seed {rec['bootstrap_seed']}); bytes measured from the tensors after every scored step, "
           f"full-precision window included (kvslim and quanto alike); HF DynamicCache "
           f"{rec['hf_dense_bytes_per_token']:.0f} B/token; commit {rec['commit']}, {rec['date']}"
           + (" (partial: texts so far)" if rec.get("partial") else ""), ""]
    for t in rec["texts"]:
        out += [f"### {t['name']} ({t['kind']}, {t['role']}; {t['package']} {t['installed']}, {t['path']}); "
                f"dense perplexity {t['ref_ppl']:.3f}", "",
                "| cache | Δ perplexity [95 % CI] | mean KL | top-1 | bytes/token avg | bytes/token end "
                "| bits/element (codes+scales) |", "|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            lo, hi = r["delta_ppl_ci95"]
            out.append(f"| {r['label']} | {100 * r['delta_ppl']:+.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}] | "
                       f"{r['kl']:.4f} | {100 * r['top1']:.1f} % | {r['bytes_per_token_avg']:.0f} | "
                       f"{r['bytes_per_token_end']:.0f} | {r['bits_per_element']:.2f} |")
        out.append("")
    return "\n".join(out)


def merge(args) -> None:
    """Rows of several result files of one model and protocol (e.g. call-by-call quanto rows beside one-pass
    kvslim rows) in one table and plot; each row keeps its engine."""
    records = [json.loads(Path(f).read_text()) for f in args.merge]
    key = {(r["model"], r["mode"], r["tokens"], r["steps"] if r["mode"] == "token" else 0) for r in records}
    if len(key) != 1:
        raise ValueError(f"--merge needs files of one model and protocol, got {sorted(key)}")
    rows: dict[str, dict] = {}
    for r in records:
        for row in r["rows"]:
            rows[row["label"]] = {**row, "engine": row.get("engine", r.get("engine", "calls"))}
    rec = {**records[-1], "engine": "+".join(sorted({r.get("engine", "calls") for r in records})),
           "merged": list(args.merge), "rows": list(rows.values()), "partial": False}
    stem = RESULTS / f"bench_quality_{rec['suite']}_{rec['mode']}_merged{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(rec, indent=1))
    stem.with_suffix(".md").write_text(markdown(rec))
    plot(rec, stem.with_suffix(".png"))
    print(markdown(rec))


def one_pass_rows(model, ids, rows, facts, args) -> list[dict]:
    """kvslim rows through the one-pass protocol (``kvslim.evaluate_parallel``), written as they land."""
    from kvslim.evaluate_parallel import compare_specs, layer_specs_of

    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    out = []
    for label, method, opts in rows:
        specs = layer_specs_of(METHODS[method].plan_model(model, **opts))
        q = compare_specs(model, ids, {label: specs}, mode=args.mode, steps=args.steps,
                          min_tokens=4096 if args.tokens >= 4096 else None)[label]
        n = q.tokens
        coded_bytes = coded_elems = window = 0
        for ls in specs:  # append-only layers and rings alike (a ring's window holds the same n − f tokens)
            for sp in (ls.key, ls.value):
                f = sp.flushed(n) - min(n, sp.sink) if sp.bits else 0  # coded tokens (sinks stay fp32)
                coded_bytes += f * sp.bytes_per_value_row(d, torch.float32)
                coded_elems += f * d
                window += (n - f) * d * 4 if sp.residual else 0
        heads = cfg.num_key_value_heads
        rec = {**q.to_dict(), "bits_per_element": 8 * coded_bytes / max(1, coded_elems), "window_bytes": window * heads,
               "engine": "one-pass", **_public(facts[label])}
        out.append(rec)
        print(_row(rec), flush=True)
        finish(args, model, None, out, None, partial=True)
    return out


def hf_dense_bytes_per_token(model, tokens: int) -> float:
    """Bytes per token of HF's own ``DynamicCache`` for this model at ``tokens`` tokens (fp32 model): sliding
    layers keep only their window."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    row = 2 * cfg.num_key_value_heads * d * 4
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    win = getattr(cfg, "sliding_window", None) or tokens
    return sum(row * (min(tokens, win) if t == "sliding_attention" else tokens) for t in types) / tokens


_STATE: dict = {}


def finish(args, model, model_label, out, t0, partial: bool = False) -> None:
    """Write the JSON and markdown (and the final suite's plot) of the rows so far."""
    if "record" not in _STATE:
        _STATE["record"] = {
            "suite": args.suite, "mode": args.mode, "tokens": args.tokens, "steps": args.steps,
            "engine": args.engine, "command": "python " + " ".join(sys.argv), "model": model_label or args.model,
            "text": "botchan", "hf_dense_bytes_per_token": hf_dense_bytes_per_token(model, args.tokens),
            "fp16_dense_bytes_per_token": hf_dense_bytes_per_token(model, args.tokens) / 2,
            "torch": torch.__version__, "machine": platform.machine(), "commit": git_commit(),
            "t0": _STATE.get("t_start", t0 if t0 is not None else time.time())}
    record = _STATE["record"]
    if model_label:
        record["model"] = model_label
    record.update(rows=out, ref_ppl=out[0]["ref_ppl"], seconds=time.time() - record["t0"], partial=partial)
    RESULTS.mkdir(exist_ok=True)
    model_tag = "" if args.model == "smollm2" else f"_{args.model}"
    engine_tag = "_onepass" if args.engine == "one-pass" else ""
    stem = RESULTS / f"bench_quality_{args.suite}_{args.mode}{model_tag}{engine_tag}{args.tag}"
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(markdown(record))
    if args.suite == "final" and not partial:
        plot(record, stem.with_suffix(".png"))
    if not partial:
        print(markdown(record))


def _row(r: dict) -> str:
    return (f"{r['label']:44s} Δppl {100 * r['delta_ppl']:+7.2f} %  KL {r['kl']:.4f}  top1 {100 * r['top1']:.1f} %"
            f"  max|Δlogit| {r['max_dlogit']:.2f}  {r['bits_per_element']:.2f} bits/elem  "
            f"{r['bytes_per_token']:.0f} B/token")


def markdown(rec: dict) -> str:
    hf = rec.get("hf_dense_bytes_per_token")
    lines = [f"{rec.get('model', 'SmolLM2-135M')}, Botchan, {rec['mode']} mode, {rec['tokens']} tokens"
             + (f", {rec['steps']} single-token steps scored" if rec["mode"] == "token" else "")
             + f"; dense perplexity {rec['ref_ppl']:.3f}; engine {rec.get('engine', 'calls')}"
             + (" (partial: rows so far)" if rec.get("partial") else "")
             + (f"; HF DynamicCache {hf:.0f} B/token (fp32; sliding layers keep their window)" if hf else ""), "",
             "| cache | bits/element (codes+scales) | Δ perplexity | mean KL | top-1 agreement | max abs Δlogit "
             "| bytes/token (all layers) | vs HF dense fp16 | full-precision window |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        g = f" (greedy {100 * r['greedy']['agreement']:.0f} %)" if "greedy" in r else ""
        lines.append(f"| {r['label']} | {r['bits_per_element']:.2f} | {100 * r['delta_ppl']:+.2f} % | "
                     f"{r['kl']:.4f} | {100 * r['top1']:.1f} %{g} | {r['max_dlogit']:.2f} | "
                     f"{r['bytes_per_token']:.0f} | "
                     + (f"{2 * r['bytes_per_token'] / hf:.2f}× | " if hf else "- | ")
                     + f"{r['window_bytes'] / 1024:.0f} KiB |")
    return "\n".join(lines) + "\n"


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rec["rows"]:
        quanto = r["label"].startswith("quanto")
        ax.scatter(r["bits_per_element"], 100 * r["delta_ppl"], marker="s" if quanto else "o",
                   color="tab:gray" if quanto else "tab:blue")
        ax.annotate(r["label"], (r["bits_per_element"], 100 * r["delta_ppl"]), fontsize=7,
                    xytext=(4, 3), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.axhline(1.0, ls=":", color="tab:green")
    ax.axhline(10.0, ls=":", color="tab:orange")
    ax.set_xlabel("bits per element (codes + scales/zero-points; residual window apart)")
    ax.set_ylabel("Δ perplexity vs dense (%)")
    ax.set_title(f"{rec.get('model', 'SmolLM2-135M').split(' (')[0]}, Botchan, {rec['mode']} mode "
                 f"({rec['tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
