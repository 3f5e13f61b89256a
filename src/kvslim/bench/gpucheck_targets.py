"""The targets of the earlier GPU issues (26, 33), read off the records of :mod:`kvslim.bench.gpucheck`'s stages.

Each target: what is compared, the goal, the measured value (``None`` when its stage did not run or a kind failed)
and ``met`` (``None`` when not measured). Ratios are step-time ratios of the same run (HF ÷ kvslim: > 1 is faster).
"""

from __future__ import annotations

#: (name, stage, numerator kind, denominator kind, goal): ratio = step_ms(numerator) / step_ms(denominator)
RATIO_TARGETS = (
    ("int4 eager vs HF static eager (1B MHA 8k x 8)", "mha-1b", "hf-static", "kvslim-int4", 2.0),
    ("int8 compiled vs HF static compiled", "mha-1b", "hf-static+compiled", "kvslim-int8+compiled", 1.4),
    ("int4 compiled vs HF static compiled", "mha-1b", "hf-static+compiled", "kvslim-int4+compiled", 1.9),
    ("int2 compiled vs HF static compiled", "mha-1b", "hf-static+compiled", "kvslim-int2+compiled", 2.2),
    ("slim eager vs HF static eager", "mha-1b", "hf-static", "kvslim-slim", 1.4),
    ("slim compiled vs HF static compiled", "mha-1b", "hf-static+compiled", "kvslim-slim+compiled", 1.4),
    ("int4 eager vs HF static eager (Llama-3-8B 32k x 4)", "llama3-8b", "hf-static", "kvslim-int4", None),
    ("int2 eager vs HF static eager (Llama-3-8B 32k x 4)", "llama3-8b", "hf-static", "kvslim-int2", None),
)
#: the fraction of the measured copy rate a kind's bytes per step reach
BANDWIDTH_TARGETS = (("int4 compiled: bytes read per step / copy rate", "mha-1b", "kvslim-int4+compiled", 0.70),)


def _steps(stage: dict | None) -> dict:
    if not stage or "records" not in stage:
        return {}
    return {r["kind"]: r for r in stage["records"] if "step_ms" in r}


def _row(name, goal, measured, source) -> dict:
    met = None if measured is None or goal is None else measured >= goal
    return {"target": name, "goal": goal, "measured": measured, "met": met, "source": source}


def targets(results: dict) -> list[dict]:
    """``results``: stage name -> record (as ``gpu_check_<stage>.json`` holds it)."""
    rows = []
    for name, stage, num, den, goal in RATIO_TARGETS:
        s = _steps(results.get(stage))
        value = s[num]["step_ms"] / s[den]["step_ms"] if num in s and den in s else None
        rows.append(_row(name, goal, value, f"gpu_check_{stage}.json: step_ms {num} / {den}"))
    for name, stage, kind, goal in BANDWIDTH_TARGETS:
        r = _steps(results.get(stage)).get(kind)
        rows.append(_row(name, goal, r["fraction_of_copy_bandwidth"] if r else None,
                         f"gpu_check_{stage}.json: {kind} fraction_of_copy_bandwidth"))
    cap = {c["kind"]: c for c in (results.get("llama3-8b") or {}).get("capacity", []) if c.get("largest_batch")}
    value = (cap["kvslim-int4"]["largest_batch"] / cap["kvslim-dense"]["largest_batch"]
             if "kvslim-int4" in cap and "kvslim-dense" in cap else None)
    rows.append(_row("int4 capacity vs dense (Llama-3-8B, 32k): largest batch ratio", None, value,
                     "gpu_check_llama3-8b.json: capacity largest_batch int4 / dense"))
    four = results.get("encdec-mla") or {}
    for key, name, goal in (("whisper", "slim vs HF, Whisper-large-v3 decoder, batch 64", 1.8),
                            ("mla", "MLA vs HF, DeepSeek-V2-Lite shape, 32k x 1", 5.0)):
        rec = four.get(key) or {}
        rows.append(_row(name, goal, rec.get("speedup"), f"gpu_check_encdec-mla.json: {key}.speedup"))
    for kind in ("kvslim-dense+compiled", "kvslim-int8+compiled", "kvslim-int4+compiled", "kvslim-int2+compiled",
                 "kvslim-slim+compiled"):
        r = _steps(results.get("mha-1b")).get(kind)
        graphs = (r or {}).get("compile_counts", {}).get("unique_graphs")
        rows.append({"target": f"{kind}: graphs compiled over all its steps (capturable cache: 1)", "goal": 1,
                     "measured": graphs, "met": None if graphs is None else graphs == 1,
                     "source": f"gpu_check_mha-1b.json: {kind} compile_counts.unique_graphs"})
    return rows
