"""Markdown of :mod:`kvslim.bench.gpucheck`: one summary per stage and the index (stages, then targets)."""

from __future__ import annotations


def _fmt(v, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def stage_markdown(stage: dict) -> str:
    name = stage["stage"]
    head = [f"## gpu_check stage `{name}`: {stage['status']} ({stage.get('seconds', 0):.0f} s, estimate "
            f"{stage.get('estimate_s', '-')} s)", ""]
    if stage["status"] in ("skipped", "error"):
        return "\n".join(head + [stage.get("reason") or stage.get("error", "")])
    if name == "correctness":
        lines = ["| pytest group | ok | counts | seconds | problems |", "|---|---|---|---|---|"]
        tests = stage["pytest"] if isinstance(stage["pytest"], list) else []
        for t in tests:
            lines.append(f"| {t['group']} | {_fmt(t['ok'])}{' (timed out)' if t['timed_out'] else ''} | "
                         f"{t['counts']} | {t['seconds']:.0f} | {'; '.join(t['problems'][:3])} |")
        if not tests:
            lines.append(f"| - | - | {stage['pytest']} | | |")
        lines += ["", "| method | dtype | tokens equal HF | agreement | first mismatch | expected equal | error |",
                  "|---|---|---|---|---|---|---|"]
        for r in stage["greedy_vs_hf"]:
            lines.append(f"| {r['method']} | {r['dtype']} | {_fmt(r.get('equal'))} | {_fmt(r.get('agreement'))} | "
                         f"{_fmt(r.get('first_mismatch'))} | {_fmt(r.get('expected_equal'))} | "
                         f"{r.get('error', '')} |")
        return "\n".join(head + lines)
    if name in ("mha-1b", "llama3-8b", "sparse"):
        from .cuda import markdown

        extra = [f"copy rate {stage['bandwidth']['copy_gbps']:.0f} GB/s (same run); compile mode "
                 f"{stage['settings'].get('compile_mode')}", ""]
        graphs = [f"- {r['kind']}: {r['compile_counts']}" for r in stage["records"] if r.get("compile_counts")]
        return "\n".join(head + extra + [markdown(stage)] + ([""] + graphs if graphs else []))
    if name == "encdec-mla":
        lines = ["| model | HF step ms | kvslim step ms | speedup | HF cache B | kvslim cache B | tokens equal |",
                 "|---|---|---|---|---|---|---|"]
        for key in ("whisper", "mla"):
            r = stage.get(key) or {}
            if "error" in r:
                lines.append(f"| {key} | failed: {r['error']} | | | | | |")
                continue
            lines.append(f"| {key} ({r.get('shape')}) | {_fmt(r['hf']['step_ms'])} | {_fmt(r['kvslim']['step_ms'])} "
                         f"| {_fmt(r['speedup'])} | {r['cache_bytes']['hf']:,} | {r['cache_bytes']['kvslim']:,} | "
                         f"{_fmt(r['tokens_equal'])} |")
        return "\n".join(head + lines)
    if name == "variants":
        lines = [f"backend {stage['backend']}, shape {stage['shape']}", "",
                 "| family | backend | tile | splits | dot operands | µs | codes GB/s | max abs err vs fp64 |",
                 "|---|---|---|---|---|---|---|---|"]
        for r in stage["variants"]:
            key = (f"| {r['family']} | {r.get('backend', '')} | {r['tile'] or 'default'} | {r['splits'] or 'auto'} | "
                   f"{r.get('dot', 'ieee')} |")
            if "max_abs_err_vs_float64" not in r:
                lines.append(f"{key} {r.get('error') or r.get('skipped')} | | |")
                continue
            us = f"{1e6 * r['seconds']:.1f}" if "seconds" in r else "-"
            gbps = f"{r['codes_gbps']:.0f}" if "codes_gbps" in r else "-"
            lines.append(f"{key} {us} | {gbps} | {r['max_abs_err_vs_float64']:.2e} |")
        return "\n".join(head + lines)
    return "\n".join(head)


def index_markdown(doc: dict) -> str:
    env = doc["environment"]
    lines = [f"# gpu_check on {env.get('gpu') or env.get('device')} (commit {env.get('commit') or '?'}, torch "
             f"{env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')})", "",
             f"`{doc['command']}`: budget {doc['budget_s']:.0f} s, elapsed {doc.get('elapsed_s', 0):.0f} s, "
             f"{doc.get('cpu_s', 0):.0f} CPU s"
             f"{' (--quick: tiny shapes, not figures)' if doc['quick'] else ''}", "",
             "| stage | status | seconds | CPU s | estimate s | note |", "|---|---|---|---|---|---|"]
    for s in doc["stages"]:
        note = s.get("reason") or s.get("error") or ", ".join(s.get("failed") or s.get("failed_tests") or [])
        lines.append(f"| {s['stage']} | {s['status']} | {s.get('seconds', 0):.0f} | {s.get('cpu_s', 0):.0f} | "
                     f"{s.get('estimate_s')} | "
                     f"{note} |")
    if doc.get("targets"):
        lines += ["", "| target | goal | measured | met | read from |", "|---|---|---|---|---|"]
        for t in doc["targets"]:
            lines.append(f"| {t['target']} | {_fmt(t['goal'])} | {_fmt(t['measured'])} | {_fmt(t['met'])} | "
                         f"{t['source']} |")
    return "\n".join(lines)
