"""MLA decode speed and memory: kvslim ``mla`` against Hugging Face's own DeepseekV2, same run, same weights.

Model: V2-Lite-shaped (d 2048, h 16, dc 512, dr 64, dk 128, dv 128, no q compression, dense MLP 10944, MoE
1408 × 2 shared + 6 of 8 routed experts per token) scaled down to 4 layers and a 32k vocabulary, float32 on CPU.

Context: a random prompt of 1,024 tokens is prefilled for real (timed, HF and kvslim); for 4k and 8k the prefilled
1k latents are tiled (a real 8k prefill of this model takes minutes on 2 cores, and decode cost does not depend on the
cached values). Both caches then hold the same latents and decode the same greedy continuation (checked).

Also: the four attention paths alone per layer (decode, 1k-8k), and the prefill crossover between expanding K/V
once and scoring absorbed queries (which sets ``prefill_threshold``).

    .venv/bin/python benchmarks/bench_mla.py            # ~6 min on 2 cores; JSON + PNG in benchmarks/results/
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path

# freed large buffers go straight back to the OS, so RSS shows live memory (peak measurement)
if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DynamicCache  # noqa: E402

import kvslim  # noqa: E402
from kvslim.adapters.compat import CACHE_KW  # noqa: E402
from kvslim.attention import mla  # noqa: E402

OUT = Path(__file__).parent / "results"
CONTEXTS = (1024, 4096, 8192)
H, DK, DR, DV, DC = 16, 128, 64, 128, 512
CFG = dict(vocab_size=32000, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
           num_hidden_layers=4, num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=DC, q_lora_rank=None,
           qk_nope_head_dim=DK, qk_rope_head_dim=DR, v_head_dim=DV, n_shared_experts=2, n_routed_experts=8,
           num_experts_per_tok=6, first_k_dense_replace=1, topk_method="greedy", max_position_embeddings=16384,
           rope_parameters={"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "rope_theta": 10000.0})
# (YaRN as V2-Lite publishes it: factor 40 over 4096 original positions; HF warns that 16384 != 40·4096)


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Samples RSS every 2 ms; ``peak`` is the highest value above the level at entry."""

    def __enter__(self):
        self.base, self.peak, self._run = rss(), 0, True
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self

    def _loop(self):
        while self._run:
            self.peak = max(self.peak, rss() - self.base)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._run = False
        self._t.join()
        self.peak = max(self.peak, rss() - self.base)


def timed(fn, trials: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(trials):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


# -- attention alone ----------------------------------------------------------------------------------------------
def attention_only() -> dict:
    g = torch.Generator().manual_seed(0)
    w = mla.absorb(torch.randn(H * (DK + DV), DC, generator=g) / DC ** 0.5, H, DK, DV, (DK + DR) ** -0.5)

    def inputs(s, t):
        return (torch.randn(1, H, s, DK, generator=g), torch.randn(1, H, s, DR, generator=g),
                torch.randn(1, t, DC, generator=g), torch.randn(1, t, DR, generator=g))

    decode = {}
    for t in CONTEXTS:
        qn, qp, c, r = inputs(1, t)
        k, v = mla.expand(c, r, w)
        row = {"decompressed": partial(mla.attend_dense, torch.cat((qn, qp), -1), k, v, w.scale)}
        row |= {n: partial(f, qn, qp, c, r, w) for n, f in mla.LATENT_PATHS.items()}
        decode[t] = {n: statistics.median(timed(f, 5 if n == "compressed" else 15)) * 1e3 for n, f in row.items()}
        print(f"  attention decode T={t}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in decode[t].items()))
    prefill = {}
    for s in (16, 32, 64, 128, 192, 256, 384, 512, 1024):
        qn, qp, c, r = inputs(s, s)
        prefill[s] = {n: statistics.median(timed(partial(f, qn, qp, c, r, w), 3)) * 1e3
                      for n, f in (("expanded", mla.attend_compressed), ("elided", mla.attend_elided))}
        print(f"  attention prefill S=T={s}: expanded {prefill[s]['expanded']:.2f} ms, "
              f"elided {prefill[s]['elided']:.2f} ms")
    cross = next((s for s, r in prefill.items() if r["expanded"] < r["elided"]), None)
    return {"decode_ms_per_layer": decode, "prefill_ms_per_layer": prefill, "prefill_crossover_tokens": cross}


# -- end to end ----------------------------------------------------------------------------------------------------
def fill(cache, latents, ctx):
    for i, (c, r) in enumerate(latents):
        reps = -(-ctx // c.shape[2])
        cache.update(c.repeat(1, 1, reps, 1)[:, :, :ctx].contiguous(), r.repeat(1, 1, reps, 1)[:, :, :ctx].contiguous(),
                     i)
    return cache


def decode(model, cache, first: torch.Tensor, steps: int):
    x, toks = first, []
    with torch.no_grad():
        for _ in range(steps):
            x = model(x, **{CACHE_KW: cache}, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
            toks.append(int(x))
    return toks


def cache_bytes(cache) -> int:
    if isinstance(cache, kvslim.KVSlimCache):
        return cache.nbytes
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def end_to_end() -> dict:
    torch.manual_seed(0)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**CFG)).eval()
    prompt = torch.randint(1, CFG["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(1))
    res = {"params": sum(p.numel() for p in model.parameters()), "prefill_1k_s": {}, "decode": {}}
    with torch.no_grad():
        t = time.perf_counter()
        hf_cache = DynamicCache(config=model.config)
        model(prompt, **{CACHE_KW: hf_cache}, use_cache=True)
        res["prefill_1k_s"]["hf"] = time.perf_counter() - t
        kvslim.apply(model, "mla")
        t = time.perf_counter()
        ours = kvslim.make_cache(model)
        model(prompt, **{CACHE_KW: ours}, use_cache=True)
        res["prefill_1k_s"]["kvslim"] = time.perf_counter() - t
    latents = [(layer.c_kv_store.read(0, 1024).clone(), layer.k_pe_store.read(0, 1024).clone())
               for layer in ours.layers]
    del ours, hf_cache
    first = prompt[:, -1:]
    for ctx in CONTEXTS:
        row = {}
        steps = {1024: 6, 4096: 4, 8192: 3}[ctx]
        for who in ("hf", "kvslim", "kvslim-int8"):
            if who == "hf":
                kvslim.restore(model)
            else:
                kvslim.apply(model, "mla", bits=8 if who.endswith("int8") else 0)
            n = steps if who == "hf" else 16
            cache = fill(DynamicCache(config=model.config) if who == "hf"
                         else kvslim.make_cache(model, max_length=ctx + n + 1), latents, ctx)
            decode(model, cache, first, 1)  # warm-up step (also grows nothing: preallocated)
            with PeakRSS() as mem:
                t = time.perf_counter()
                toks = decode(model, cache, first, n)
                dt = time.perf_counter() - t
            row[who] = {"tokens_per_s": n / dt, "steps": n, "cache_bytes": cache_bytes(cache),
                        "peak_rss_increase_bytes": mem.peak, "tokens": toks}
            print(f"  e2e ctx={ctx} {who}: {n / dt:.2f} tok/s, cache {cache_bytes(cache) / 2**20:.1f} MiB, "
                  f"peak +{mem.peak / 2**20:.0f} MiB")
            del cache
        k = min(len(row["hf"]["tokens"]), len(row["kvslim"]["tokens"]))
        row["same_greedy_tokens"] = row["hf"]["tokens"][:k] == row["kvslim"]["tokens"][:k]
        row["speedup"] = row["kvslim"]["tokens_per_s"] / row["hf"]["tokens_per_s"]
        res["decode"][ctx] = row
        print(f"  ctx={ctx}: speedup {row['speedup']:.1f}×, same tokens {row['same_greedy_tokens']}")
    kvslim.restore(model)
    return res


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    dec = {int(c): r for c, r in rec["end_to_end"]["decode"].items()}  # int keys (str after a JSON round trip)
    ctx = sorted(dec)
    for who in ("hf", "kvslim", "kvslim-int8"):
        a.plot(ctx, [dec[c][who]["tokens_per_s"] for c in ctx], "o-", label=who)
    a.set(xscale="log", yscale="log", xlabel="context tokens", ylabel="decode tokens/s",
          title="V2-Lite-shaped (4 layers), fp32, CPU")
    a.set_xticks(ctx, [str(c) for c in ctx])
    a.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    a.legend()
    pre = {int(k): v for k, v in rec["attention"]["prefill_ms_per_layer"].items()}
    s = sorted(pre)
    for n in ("expanded", "elided"):
        b.plot(s, [pre[x][n] for x in s], "o-", label=n)
    b.set(xscale="log", yscale="log", xlabel="prefill tokens (S = T)", ylabel="ms per layer",
          title="prefill attention: expand once vs absorbed")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=OUT, help="folder for bench_mla.json / .png (default benchmarks/results)")
    out = p.parse_args().out
    out.mkdir(parents=True, exist_ok=True)
    # one thread for both sides: on a shared 2-core machine two OpenMP threads spin-wait on each other for
    # whole scheduler quanta (100 ms floors on 1 ms ops); override with KVSLIM_BENCH_THREADS
    torch.set_num_threads(int(os.environ.get("KVSLIM_BENCH_THREADS", "1")))
    t0 = time.perf_counter()
    print("attention alone (per layer):")
    att = attention_only()
    print("end to end:")
    e2e = end_to_end()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    rec = {"benchmark": "mla", "commit": commit, "torch": torch.__version__, "transformers": transformers.__version__,
           "kvslim": kvslim.__version__, "python": platform.python_version(), "cpu_threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "dtype": "float32",
           "model": {k: v for k, v in CFG.items() if k != "rope_parameters"}, "attention": att, "end_to_end": e2e,
           "wall_s": None}
    rec["wall_s"] = time.perf_counter() - t0
    (out / "bench_mla.json").write_text(json.dumps(rec, indent=1, default=str))
    plot(rec, out / "bench_mla.png")
    print(f"wrote {out / 'bench_mla.json'} and .png in {rec['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
