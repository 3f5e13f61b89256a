"""KL against measured bytes per token on the held-out texts, both models: one plot of the quality/bytes frontier.

Reads held-out records of ``bench_quality.py --texts heldout`` (fp32, 2,049 tokens: prefill 1,536 + 512 scored
single steps; the later file wins a label) and plots, per model, every row's mean KL over the three held-out texts
(code, technical prose, dialogue; the bar spans the lowest and highest text) against its bytes per token measured
from the tensors (window included, averaged over the steps and texts). Rows of superseded formats ("before issue
29") are left out; the development text (Botchan) is not plotted.

llama.cpp's KV types (``bench_llamacpp_kv.py``: the same GGUF files run by llama.cpp, the same token ids) are scored
against llama.cpp's own f16 cache, not against the HF fp32 dense cache, and their bytes per token are computed from
ggml's block sizes (llama.cpp keeps no full-precision window): green triangles. The dashed line is the
transformers fp32 dense cache scored against that llama.cpp f16 reference (how far apart the two engines are before
any KV quantization); the f16 reference itself (KL 0) is not drawn.

    .venv/bin/python benchmarks/plot_kl_bytes.py

Writes ``benchmarks/results/kl_vs_bytes_heldout.{png,json}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RECORDS = {
    "SmolLM2-135M": ["quality_heldout_2026-11-26.json", "quality_heldout_2026-11-26_defaults.json",
                     "quality_heldout_2026-11-26_turbo.json", "quality_heldout_2026-11-26_turbo_prerope.json",
                     "quality_heldout_2026-11-26_turbo_rope_centred.json",
                     "quality_heldout_2026-11-26_turbo_rope_centred_library.json",
                     "quality_heldout_2026-11-26_int_per_layer.json", "quality_heldout_2026-11-26_int_per_layer_g32.json",
                     "quality_heldout_2026-11-26_int4_layers15_24_int8.json", "quality_heldout_2026-11-26_llamacpp.json"],
    "Qwen2.5-Coder-0.5B": ["quality_heldout_2026-11-26_qwen25_quanto.json",
                           "quality_heldout_2026-11-26_qwen25_defaults.json",
                           "quality_heldout_2026-11-26_qwen25_turbo.json",
                           "quality_heldout_2026-11-26_qwen25_turbo_prerope.json",
                           "quality_heldout_2026-11-26_qwen25_turbo_rope_centred.json",
                           "quality_heldout_2026-11-26_qwen25_turbo_rope_centred_library.json",
                           "quality_heldout_2026-11-26_qwen25_int8.json",
                           "quality_heldout_2026-11-26_qwen25_llamacpp.json"],
}
SHORT = {"turbo3 centred K o16 r123 (<= int3's bytes)": "turbo3", "turbo3 pre-RoPE K r123 (<= int3's bytes)":
         "turbo3 pre-RoPE keys", "turbo2 centred K3 o16 V2 r123 (<= int2's bytes)": "turbo2",
         "turbo2 pre-RoPE K r123 (<= int2's bytes)": "turbo2 pre-RoPE keys",
         "int4 r60 +sink4 (quanto 4-bit's bytes)": "int4, 60-token window",
         "turbo3 RoPE-centred K r123 (<= int3's bytes)": "turbo3 RoPE-centred keys",
         "turbo2 RoPE-centred K r123 (<= int2's bytes)": "turbo2 RoPE-centred keys",
         "int4 keys rotated outside the offset layers": "int4, rotated keys",
         "int2 keys rotated outside the offset layers": "int2, rotated keys",
         "int2 keys rotated outside the offset layers, values g32 (3.25 bits)": "int2, rotated keys, V g32"}
HELDOUT = ("torch-tensor-str", "python-reference", "twelfth-night")


def points(files: list[str]) -> dict[str, dict]:
    """label -> {"kl": {text: KL}, "bytes": {text: bytes/token avg}, "delta_ppl": {...}} over the held-out texts."""
    rows: dict[str, dict] = {}
    for name in files:
        path = RESULTS / name
        if not path.is_file():
            print(f"{name}: not found, left out")
            continue
        for t in json.loads(path.read_text())["texts"]:
            if t["name"] not in HELDOUT:
                continue
            for r in t["rows"]:
                if "before issue 29" in r["label"] or "error" in r:
                    continue
                row = rows.setdefault(r["label"], {"kl": {}, "bytes": {}, "delta_ppl": {}, "file": name})
                row["kl"][t["name"]] = r["kl"]
                row["bytes"][t["name"]] = r["bytes_per_token_avg"]
                row["delta_ppl"][t["name"]] = r["delta_ppl"]
                row["file"] = name
                row["bytes_computed"] = bool(r.get("bytes_computed"))
    return {k: v for k, v in rows.items() if len(v["kl"]) == len(HELDOUT)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="kl_vs_bytes_heldout")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    summary = {}
    for ax, (model, files) in zip(axes, RECORDS.items()):
        rows = points(files)
        summary[model], gap = {}, None
        for label, r in sorted(rows.items(), key=lambda kv: sum(kv[1]["bytes"].values())):
            kls = [r["kl"][t] for t in HELDOUT]
            x = sum(r["bytes"].values()) / len(HELDOUT)
            y = sum(kls) / len(kls)
            summary[model][label] = {"bytes_per_token": x, "kl_mean": y, "kl": r["kl"], "delta_ppl": r["delta_ppl"],
                                     "file": r["file"], "bytes_computed": r["bytes_computed"]}
            if label.startswith("transformers"):  # the engines' gap: HF fp32 dense against llama.cpp f16
                gap = y
                continue
            if y <= 0:  # llama.cpp's f16 reference against itself
                continue
            kind = ("quanto" if label.startswith("quanto") else "turbo" if label.startswith("turbo") else
                    "llama.cpp" if label.startswith("llama.cpp") else "int")
            style = {"quanto": ("s", "tab:gray"), "turbo": ("D", "tab:red"), "int": ("o", "tab:blue"),
                     "llama.cpp": ("^", "tab:green")}[kind]
            ax.errorbar(x, y, yerr=[[y - min(kls)], [max(kls) - y]], fmt=style[0], color=style[1], capsize=3)
            short = SHORT.get(label, label.replace(" (default)", "").replace(" g64 r128", "").replace(" K/V", ""))
            ax.annotate(short, (x, y), fontsize=7, xytext=(6, -9 if "pre-RoPE" in short else -18 if "centred" in short else 3),
                        textcoords="offset points")
        if gap is not None:
            ax.axhline(gap, ls="--", lw=0.8, color="tab:green")
            ax.annotate("transformers fp32 dense vs llama.cpp f16", (ax.get_xlim()[1], gap), fontsize=7, ha="right",
                        color="tab:green", xytext=(-4, -9), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bytes per token, measured (all layers, window included; llama.cpp: computed)")
        ax.set_ylabel("mean KL from dense (llama.cpp: from its f16), nats")
        ax.set_title(f"{model}, fp32, 3 held-out texts (bar: lowest-highest)", fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("KL against bytes per token: kvslim (blue int, red turbo), HF quanto (grey), llama.cpp KV types "
                 "(green, against llama.cpp's f16 cache)", fontsize=10)
    fig.tight_layout()
    stem = RESULTS / args.out
    fig.savefig(stem.with_suffix(".png"), dpi=110)
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    stem.with_suffix(".json").write_text(json.dumps({"records": RECORDS, "texts": HELDOUT, "rows": summary,
                                                     "commit": commit or "unknown"}, indent=1))
    for model, rows in summary.items():
        print(model)
        for label, r in rows.items():
            print(f"  {label:50s} {r['bytes_per_token']:7.0f} B/token  KL {r['kl_mean']:.4f}")


if __name__ == "__main__":
    main()
