"""Stage 4 and 5 of :mod:`kvslim.bench.gpucheck`: slim on a Whisper-large-v3-shaped decoder (batch 64) and MLA on
the DeepSeek-V2-Lite shape (32k x 1), each against Hugging Face's own cache on the same weights; a sweep of the int4
and int2 decode kernels' block sizes and splits with each variant's error against float64.

Random weights in bf16 (decode cost does not depend on the values). Steps are timed one by one with a device
synchronisation around each; the two configurations take turns round by round; the figure is the median step.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch

from ..adapters.compat import CACHE_KW

#: Whisper large-v3 decoder (d 1280, 20 heads, 32 layers, FFN 5120, 51,866 tokens, 1500 encoder frames); the
#: encoder is cut to one layer: the check passes random encoder outputs, decode never runs it
WHISPER_LARGE_V3 = dict(vocab_size=51866, num_mel_bins=128, d_model=1280, encoder_layers=1, decoder_layers=32,
                        encoder_attention_heads=20, decoder_attention_heads=20, encoder_ffn_dim=5120,
                        decoder_ffn_dim=5120, max_source_positions=1500, max_target_positions=448)
WHISPER_TINY = dict(vocab_size=256, num_mel_bins=80, d_model=64, encoder_layers=1, decoder_layers=2,
                    encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                    max_source_positions=32, max_target_positions=64)
#: DeepSeek-V2-Lite attention (d 2048, 16 heads, dc 512, dr 64, dk 128, dv 128, no q compression, 27 layers) with
#: its dense MLP (10944) in every layer: the cache and attention are V2-Lite's, the MoE routing is left out
V2_LITE = dict(vocab_size=102400, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
               num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512,
               q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_shared_experts=2,
               n_routed_experts=64, num_experts_per_tok=6, first_k_dense_replace=27, topk_method="greedy",
               max_position_embeddings=163840,
               rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                                "rope_theta": 10000.0})
V2_TINY = dict(V2_LITE, vocab_size=256, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64, qk_nope_head_dim=32,
               qk_rope_head_dim=16, v_head_dim=32, max_position_embeddings=4096, first_k_dense_replace=2,
               n_routed_experts=4, num_experts_per_tok=2)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _build(cls_cfg, cls_model, kw: dict, device: str, dtype=torch.bfloat16):
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls_model(cls_cfg(**kw, attn_implementation="sdpa")).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)


def _interleaved(step_fns: dict, warmup: int, rounds: int, steps: int, device) -> dict:
    """``name -> step()`` closures (each advances its own cache); per name the step seconds after ``warmup``."""
    times = {n: [] for n in step_fns}
    for fn in step_fns.values():
        for _ in range(warmup):
            fn()
    for r in range(rounds):
        for name in (list(step_fns) if r % 2 == 0 else list(step_fns)[::-1]):
            for _ in range(steps):
                _sync(device)
                t0 = time.perf_counter()
                step_fns[name]()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
    return times


def _summary(times: dict, read: dict, batch: int) -> dict:
    out = {}
    for name, ts in times.items():
        step = statistics.median(ts)
        out[name] = {"step_ms": 1e3 * step, "step_ms_all": [1e3 * t for t in ts], "tokens_per_s": batch / step,
                     "bytes_read_per_step": read[name], "read_gbps": read[name] / step / 1e9}
    return out


@torch.no_grad()
def whisper_vs_hf(ctx) -> dict:
    """slim (E once for every cross-attention layer, X-cache self-attention) against HF's ``EncoderDecoderCache``."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    import kvslim
    from kvslim.caches.encdec import hf_cache_nbytes

    from .decode import weight_bytes

    shape = WHISPER_TINY if ctx.quick else WHISPER_LARGE_V3
    batch, frames = (2, 32) if ctx.quick else (64, 1500)
    warmup, rounds, steps = (1, 1, 2) if ctx.quick else (2, 3, 6)
    total = 4 + warmup + rounds * steps
    models = {"hf": _build(WhisperConfig, WhisperForConditionalGeneration,
                           dict(shape, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                           ctx.device)}
    models["kvslim"] = copy.deepcopy(models["hf"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(models["kvslim"], "slim")
    enc = torch.randn(batch, frames, shape["d_model"], generator=torch.Generator(ctx.device).manual_seed(0),
                      device=ctx.device).to(torch.bfloat16)
    ids = torch.tensor([[1, 5, 6, 7]], device=ctx.device).expand(batch, 4)
    state, toks = {}, {"hf": [], "kvslim": []}
    for name, model in models.items():
        cache = None if name == "hf" else kvslim.make_cache(model, max_length=total + 1)
        o = model(encoder_outputs=(enc,), decoder_input_ids=ids, use_cache=True, **{CACHE_KW: cache})
        state[name] = [getattr(o, CACHE_KW), o.logits[:, -1].argmax(-1, keepdim=True)]

    def stepper(name):
        def step():
            cache, tok = state[name]
            o = models[name](encoder_outputs=(enc,), decoder_input_ids=tok, use_cache=True, **{CACHE_KW: cache})
            state[name] = [getattr(o, CACHE_KW), o.logits[:, -1].argmax(-1, keepdim=True)]
            toks[name].append(state[name][1])
        return step

    times = _interleaved({n: stepper(n) for n in models}, warmup, rounds, steps, ctx.device)
    layers = shape["decoder_layers"]
    w = weight_bytes(models["hf"].model.decoder)
    read = {"hf": w + hf_cache_nbytes(state["hf"][0]),
            "kvslim": w + int(state["kvslim"][0].self_attention_cache.nbytes) + layers * enc.numel() * 2}
    res = _summary(times, read, batch)
    same = torch.equal(torch.cat(toks["hf"], 1), torch.cat(toks["kvslim"], 1))
    return {"shape": "whisper-tiny-ish (quick)" if ctx.quick else "whisper-large-v3 decoder", "batch": batch,
            "encoder_frames": frames, "dtype": "bfloat16", **res, "speedup": res["hf"]["step_ms"] /
            res["kvslim"]["step_ms"], "cache_bytes": {"hf": hf_cache_nbytes(state["hf"][0]),
                                                      "kvslim": hf_cache_nbytes(state["kvslim"][0])},
            "tokens_equal": same, "note": "bf16 greedy tokens: equality is recorded, not required"}


@torch.no_grad()
def mla_vs_hf(ctx) -> dict:
    """kvslim ``mla`` (latent cache, the Triton absorbed decode) against HF's DynamicCache of re-expanded K/V."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache

    import kvslim
    from kvslim.caches.encdec import hf_cache_nbytes

    from .decode import weight_bytes

    shape = V2_TINY if ctx.quick else V2_LITE
    context, chunk = (64, 32) if ctx.quick else (32768, 4096)
    warmup, rounds, steps = (1, 1, 2) if ctx.quick else (2, 3, 6)
    models = {"hf": _build(DeepseekV2Config, DeepseekV2ForCausalLM, shape, ctx.device)}
    models["kvslim"] = copy.deepcopy(models["hf"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kvslim.apply(models["kvslim"], "mla")
    total = context + warmup + rounds * steps + 1
    ids = torch.randint(1, shape["vocab_size"], (1, context), generator=torch.Generator().manual_seed(0))
    ids = ids.to(ctx.device)
    state, toks, prefill_s = {}, {"hf": [], "kvslim": []}, {}
    for name, model in models.items():
        cache = DynamicCache(config=model.config) if name == "hf" else kvslim.make_cache(model, max_length=total)
        _sync(ctx.device)
        t0 = time.perf_counter()
        for start in range(0, context, chunk):
            o = model(ids[:, start:start + chunk], use_cache=True, logits_to_keep=1, **{CACHE_KW: cache})
        _sync(ctx.device)
        prefill_s[name] = time.perf_counter() - t0
        state[name] = [cache, o.logits[:, -1].argmax(-1, keepdim=True), context]

    def stepper(name):
        def step():
            cache, tok, pos = state[name]
            p = torch.full((1, 1), pos, dtype=torch.long, device=ctx.device)
            o = models[name](tok, position_ids=p, cache_position=p[0], use_cache=True, **{CACHE_KW: cache})
            state[name] = [cache, o.logits[:, -1].argmax(-1, keepdim=True), pos + 1]
            toks[name].append(state[name][1])
        return step

    times = _interleaved({n: stepper(n) for n in models}, warmup, rounds, steps, ctx.device)
    w = weight_bytes(models["hf"])
    stored = {"hf": hf_cache_nbytes(state["hf"][0]), "kvslim": int(state["kvslim"][0].nbytes)}
    res = _summary(times, {n: w + stored[n] for n in models}, 1)
    return {"shape": "deepseek-v2-lite attention (quick: tiny)" if not ctx.quick else "tiny v2", "context": context,
            "batch": 1, "dtype": "bfloat16", **res, "speedup": res["hf"]["step_ms"] / res["kvslim"]["step_ms"],
            "cache_bytes": stored, "memory_ratio": stored["hf"] / max(1, stored["kvslim"]), "prefill_s": prefill_s,
            "tokens_equal": torch.equal(torch.cat(toks["hf"], 1), torch.cat(toks["kvslim"], 1)),
            "note": "dense MLP in every layer (V2-Lite's MoE routing left out); bf16 tokens: recorded, not required"}


# -- stage 5: kernel variants ----------------------------------------------------------------------------------------
def _coded(bits: int, vbits: int, b: int, h: int, n: int, d: int, device: str):
    """Random keys/values quantized per token (asymmetric, groups of 64, fp16 parameters) through the stores, and
    their dequantized values in float64 (the oracle's inputs)."""
    from ..caches.spec import StoreSpec
    from ..caches.storage import QuantizedStore

    g = torch.Generator(device).manual_seed(0)
    out = []
    for bb in (bits, vbits):
        spec = StoreSpec(bits=bb, group_size=64, asymmetric=True, scale_dtype=torch.float16)
        x = torch.randn(b, h, n, d, generator=g, device=device)
        store = QuantizedStore(spec, b, h, n, d, torch.float32, torch.device(device))
        store.write(0, x)
        out.append((store.data, store.scale, store.zero, store.read(0, n).double()))
    return out


def _oracle(q, k64, v64, scaling):
    s = torch.einsum("bhgd,bhtd->bhgt", q.double(), k64) * scaling
    return torch.softmax(s, -1) @ v64


def _time(fn, device, reps: int) -> float:
    fn()
    _sync(device)
    ts = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _interpreting_triton() -> bool:
    """Whether Triton's kernels run through its interpreter in this process (``TRITON_INTERPRET=1`` was set before
    Triton was imported: ``gpucheck.main --quick`` on a CPU sets it first)."""
    import importlib.util

    from ..kernels import backend

    if not backend.interpreting() or importlib.util.find_spec("triton") is None:
        return False
    import triton
    from triton.runtime.jit import JITFunction

    return not isinstance(triton.language.zeros, JITFunction)


def variant_plan(fam: str, cuda: bool, interpreting: bool) -> list[tuple[str, object, int, str]]:
    """``(backend, tile, splits, dot)`` rows, most important first (the budget may stop the sweep): on a GPU the
    operand precisions (``dot``: fp32 ``ieee`` / ``tf32x3`` / bf16 operands) at the launcher's own tile and splits,
    then tiles x splits in ``ieee``; on a CPU the torch twin and, under Triton's interpreter, one tiny ``ieee``
    variant (the interpreter ignores the precision and multiplies bf16 operands wrongly: no other ``dot``).
    ``tile``: int4 (tokens per step, warps), int2 a block size, ``None`` the launcher's choice."""
    from ..kernels.triton.merge import DOT_CHOICES

    if not cuda:
        return [("twin", None, 0, "ieee")] + ([("triton-interpreter", None, 0, "ieee")] if interpreting else [])
    rows = [("triton", None, 0, dot) for dot in DOT_CHOICES]
    tiles = [(16, 4), (16, 8), (32, 4), (32, 8), (64, 8)] if fam == "int4" else [16, 32, 64]
    return rows + [("triton", t, sp, "ieee") for t in tiles for sp in (0, 8, 16, 32, 64)]


def kernel_variants(ctx) -> dict:
    """int4 (stage-1 tile: tokens per step x warps; splits) and int2 (block size; splits) at point 2's attention
    shape (8 sequences x 16 KV heads x 8,192 tokens, D 128), and the operand precision of their ``tl.dot`` (fp32
    ``ieee``, ``tf32x3``, bf16 operands; :func:`variant_plan`); per variant the median time (the first call, which
    compiles, is not timed), GB/s of codes and parameters read, and max |out - float64| beside it."""
    from ..kernels import quant_decode as qd
    from ..kernels import quant_decode_lowbit as ql

    cuda = ctx.device == "cuda"
    interp = not cuda and _interpreting_triton()
    b, h, n, d = (2, 2, 256, 64) if ctx.quick else (8, 16, 8192, 128)
    q = torch.randn(b, h, 1, d, generator=torch.Generator(ctx.device).manual_seed(1), device=ctx.device)
    scaling = d ** -0.5
    rows = []
    families = {"int4": (4, 4), "int2": (3, 2)}
    for fam, (kb, vb) in families.items():
        (kc, ks, kz, k64), (vc, vs, vz, v64) = _coded(kb, vb, b, h, n, d, ctx.device)
        ref = _oracle(q, k64, v64, scaling)
        nbytes = sum(t.numel() * t.element_size() for t in (kc, ks, kz, vc, vs, vz))
        del k64, v64
        for kind, tile, splits, dot in variant_plan(fam, cuda, interp):
            row = {"family": fam, "backend": kind, "tile": tile, "splits": splits, "dot": dot}
            if time.monotonic() > ctx.deadline - 5:
                rows.append({**row, "skipped": "budget"})
                continue
            try:
                fn = _launcher(fam, kind, tile, q, (kc, ks, kz, vc, vs, vz), kb, vb, n, scaling, splits, dot, qd, ql)
                out = fn()[0]  # the first call compiles (GPU): never timed
                row["max_abs_err_vs_float64"] = float((out.double() - ref).abs().max())
                if kind != "triton-interpreter":  # an interpreted kernel's time means nothing
                    row["seconds"] = _time(fn, ctx.device, 20 if cuda else 1)
                    row["codes_gbps"] = nbytes / row["seconds"] / 1e9
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is a row
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
    failed = [r for r in rows if "error" in r]
    backend = "triton" if cuda else "torch twin" + (" + one Triton-interpreter variant" if interp else "") + " (no GPU)"
    return {"status": "failed" if failed else "ok", "shape": {"batch": b, "kv_heads": h, "tokens": n, "head_dim": d},
            "backend": backend, "input_precision": "per row (dot)", "variants": rows}


def _launcher(fam, kind, tile, q, codes, kb, vb, n, scaling, splits, dot, qd, ql):
    kc, ks, kz, vc, vs, vz = codes
    if kind == "twin":
        if fam == "int4":
            return lambda: qd.reference(q, kc, ks, kz, vc, vs, vz, 4, 64, 0, n, scaling=scaling, scores="exact",
                                        values="exact")
        return lambda: ql.reference(q, kc, ks, kz, vc, vs, vz, kb, vb, 64, 0, n, scaling=scaling)
    if fam == "int4":
        from ..kernels.triton import quant_decode as tq

        def run():
            saved = tq.tile_config
            if tile is not None:
                tq.tile_config = lambda block_d: tile
            try:
                return tq.launch(q, kc, ks, kz, vc, vs, vz, 4, 64, 0, n, scaling=scaling, splits=splits, dot=dot)
            finally:
                tq.tile_config = saved
        return run
    from ..kernels.triton import quant_decode_lowbit as tl2

    def run2():
        saved = tl2.block_size
        if tile is not None:
            tl2.block_size = lambda d, kcg: tile
        try:
            return tl2.launch(q, kc, ks, kz, vc, vs, vz, kb, vb, 64, 0, n, None, None, None, None, scaling,
                              splits=splits, dot=dot)
        finally:
            tl2.block_size = saved
    return run2
