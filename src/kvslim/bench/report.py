"""Write benchmark records: one JSON file (environment + records), PNG plots, and a Markdown table."""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

import torch

from ..units import human_bytes


def environment() -> dict:
    import transformers

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "commit": commit}


def write_json(path: Path, records: list[dict], bandwidth: dict, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"environment": environment(), "bandwidth": bandwidth, **(extra or {}), "records": records}
    path.write_text(json.dumps(doc, indent=2))


def label(r: dict) -> str:
    """A record's method as the tables and plots name it: a left-padded batch's (``kvslim bench --padded``) marked."""
    return r["method"] + (" (padded)" if r.get("padded") else "")


def markdown_table(records: list[dict], baseline: str = "hf-static") -> str:
    """One row per (model, context, batch, method, padded or not) with tokens/s and ratios to ``baseline``,
    hf-dynamic and kvslim-dense (same run, same padding)."""
    skipped = [r for r in records if "skipped" in r]
    records = [r for r in records if "skipped" not in r]
    index = {(r["model"], r["context"], r["batch"], label(r)): r for r in records}
    lines = ["| model | context | batch | method | tokens/s | × HF static | × HF dynamic | × kvslim dense | cache "
             "| GB/s | % roofline |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def ratio(r: dict, method: str) -> str:
        base = index.get((r["model"], r["context"], r["batch"], label({**r, "method": method})))
        return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"

    for r in records:
        lines.append(f"| {r['model']} | {r['context']} | {r['batch']} | {label(r)} | {r['tokens_per_s']:.1f} | "
                     f"{ratio(r, baseline)} | {ratio(r, 'hf-dynamic')} | {ratio(r, 'kvslim-dense')} | "
                     f"{human_bytes(r['cache_bytes'])} | {r['gbps']:.1f} | "
                     f"{100 * r['roofline_fraction']:.0f} |")
    if any("padded" in r for r in records):
        lines.append("\nLeft-padded batches: row r's first r·context/(2·batch) tokens are padding (an attention mask "
                     "every step).")
    reasons = {(r["model"], r["method"]): r["skipped"] for r in skipped}
    lines += [f"\n{method} not run on {model}: {why}" for (model, method), why in reasons.items()]
    return "\n".join(lines)


def plot(records: list[dict], path: Path, roofline_gbps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if "skipped" not in r]
    groups = sorted({(r["model"], r["batch"]) for r in records})
    fig, axes = plt.subplots(2, len(groups), figsize=(4.6 * len(groups), 7.5), squeeze=False)
    for col, (model, batch) in enumerate(groups):
        rows = [r for r in records if r["model"] == model and r["batch"] == batch]
        for method in dict.fromkeys(label(r) for r in rows):
            pts = sorted((r["context"], r["tokens_per_s"], r["gbps"]) for r in rows if label(r) == method)
            ctx = [p[0] for p in pts]
            axes[0][col].plot(ctx, [p[1] for p in pts], marker="o", label=method)
            axes[1][col].plot(ctx, [p[2] for p in pts], marker="o", label=method)
        axes[1][col].axhline(roofline_gbps, color="k", ls="--", lw=1, label="measured bandwidth")
        axes[0][col].set_title(f"{model}, batch {batch}")
        axes[0][col].set_ylabel("decode tokens/s")
        axes[1][col].set_ylabel("effective GB/s")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
