"""``scripts/gpu_check.sh`` (kvslim.bench.gpucheck, issue 33): ``--quick`` runs every stage's code path on CPU;
the budget stops stages from starting; a failing stage is recorded and the next one runs; bad flags are refused by
name; nothing it imports needs a package the GPU machine may lack (rich, matplotlib, scipy, hypothesis...)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import hide_packages_prelude

from kvslim.bench import gpucheck, gpucheck_stages

ROOT = Path(__file__).resolve().parents[1]
#: packages a bare GPU machine (torch, triton, transformers and their dependencies) may not have
ABSENT = ("rich", "matplotlib", "scipy", "hypothesis", "gguf", "accelerate", "optimum", "ninja")

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(tmp_path, monkeypatch, *argv):
    monkeypatch.delenv("OUT", raising=False)
    assert gpucheck.main(["--quick", "--device", "cpu", "--out", str(tmp_path), *argv]) == 0
    return json.loads((tmp_path / "gpu_check.json").read_text())


def test_quick_runs_every_stage_on_cpu(tmp_path, monkeypatch):
    t0 = time.monotonic()
    doc = _run(tmp_path, monkeypatch, "--budget", "3600")  # a loaded CI machine must not skip stages by budget
    elapsed = time.monotonic() - t0
    stages = {s["stage"]: s for s in doc["stages"]}
    assert list(stages) == list(gpucheck.STAGES)
    for name, s in stages.items():
        assert s["status"] == "ok", (name, s.get("error") or s.get("failed") or s.get("failed_tests"), s.get("where"))
        assert (tmp_path / f"gpu_check_{name}.json").exists() and (tmp_path / f"gpu_check_{name}.md").exists()
    greedy = {(r["method"], r["dtype"]): r for r in stages["correctness"]["greedy_vs_hf"]}
    assert greedy[("dense", "float32")]["equal"] and greedy[("dense", "float32")]["expected_equal"]
    assert {m for m, _ in greedy} == set(gpucheck_stages.GREEDY_CASES)
    assert all(t["ok"] for t in stages["correctness"]["pytest"])  # the CUDA-only tests: collected, skipped
    rows = {r["kind"]: r for r in stages["mha-1b"]["records"]}
    for kind in ("kvslim-int8+compiled", "kvslim-int4+compiled"):  # capturable caches: one graph for every step
        assert rows[kind]["compile_counts"]["unique_graphs"] == 1, rows[kind]
        assert rows[kind]["capturable"] is True  # a cache of its own, built capturable=True (the int4 default too)
    assert {c["kind"] for c in stages["llama3-8b"]["capacity"]} == {"kvslim-dense", "kvslim-int4"}
    assert stages["encdec-mla"]["whisper"]["tokens_equal"] and stages["encdec-mla"]["mla"]["speedup"] > 0
    sparse = {r["kind"]: r for r in stages["sparse"]["records"]}  # tiny GQA at 4k x 1: past the 2,048 budget
    kinds = {"hf-static", "kvslim-int4", "kvslim-int4-sparse"}
    assert set(sparse) == kinds | {f"{k}+compiled" for k in kinds}
    assert all("error" not in r for r in sparse.values()), sparse
    # every layer keeps page statistics: the sparse cache is the larger (its steps are sparse)
    assert sparse["kvslim-int4-sparse"]["cache_bytes"] > sparse["kvslim-int4"]["cache_bytes"]
    captured = sparse["kvslim-int4-sparse+compiled"]  # a capturable sparse cache: one graph for every step
    assert captured["capturable"] is True and captured["compile_counts"]["unique_graphs"] == 1, captured
    variants = stages["variants"]["variants"]
    assert all("max_abs_err_vs_float64" in r for r in variants)
    # the one tiny Triton variant (the interpreter: tests/conftest.py sets TRITON_INTERPRET=1) and the twin agree with
    # float64 to fp32 rounding
    assert {r["backend"] for r in variants} == {"twin", "triton-interpreter"}
    assert all(r["max_abs_err_vs_float64"] < 1e-4 for r in variants)
    targets = {t["target"]: t for t in doc["targets"]}
    assert targets["int2 compiled vs HF static compiled"]["measured"] is None  # quick runs no int2 there
    assert targets["slim vs HF, Whisper-large-v3 decoder, batch 64"]["measured"] > 0
    assert "| correctness | ok |" in (tmp_path / "gpu_check.md").read_text()
    # the target is < 120 s on 2 free cores: its CPU seconds (this process and its pytest child) are recorded, not
    # asserted (no timing assertions: a loaded CI machine took 380 s; the default --budget bounds a real run)
    assert 0 < doc["cpu_s"] and all(s["cpu_s"] >= 0 for s in stages.values())
    print(f"gpu_check --quick: {elapsed:.0f} s, {doc['cpu_s']:.0f} CPU s")


def test_budget_stops_stages_from_starting(tmp_path, monkeypatch):
    doc = _run(tmp_path, monkeypatch, "--budget", "1", "--stages", "correctness,variants")
    assert [s["status"] for s in doc["stages"]] == ["skipped", "skipped"]
    assert all(s["reason"].startswith("budget:") for s in doc["stages"])
    assert (tmp_path / "gpu_check_variants.json").exists()


def test_a_failing_stage_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    def oom(ctx):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(gpucheck_stages, "stage_llama3_8b", oom)
    doc = _run(tmp_path, monkeypatch, "--stages", "llama3-8b,variants")
    first, second = doc["stages"]
    assert first["status"] == "error" and first["out_of_memory"] and "OutOfMemoryError" in first["error"]
    assert second["status"] == "ok"
    assert "failed" not in json.loads((tmp_path / "gpu_check_variants.json").read_text())["status"]


@pytest.mark.parametrize("argv, match", [(["--budget", "0"], "--budget"), (["--budget", "-5"], "--budget"),
                                         (["--budget", "soon"], "--budget"), (["--budget", "inf"], "--budget"),
                                         (["--stages", "correctness,warp"], "--stages")])
def test_bad_flags_are_refused_by_name(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        gpucheck.main(["--quick", "--device", "cpu", "--out", str(tmp_path), *argv])
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("flag, value", [("--points", "mha-1b,llama4"), ("--budget", "0"), ("--kinds", "kvslim-int5"),
                                         ("--capacity-kinds", "hf-magic")])
def test_bench_flags_refuse_unknown_names_and_non_positive_numbers(tmp_path, flag, value):
    from kvslim.cli import bench as cli

    parser = __import__("argparse").ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--quick", "--out", str(tmp_path), flag, value])
    with pytest.raises(ValueError, match=flag):
        cli.gpu_settings(args)


def test_nothing_it_imports_needs_a_package_the_gpu_machine_may_lack(tmp_path):
    """A subprocess hides rich, matplotlib, scipy, hypothesis, ... and runs a quick stage and the bench stages' path
    (model, plan, filled cache); the test files stage 1 runs import none of them either."""
    hide = (hide_packages_prelude(ABSENT) +
            "from kvslim.bench import gpucheck, gpucheck_models, gpucheck_report, gpucheck_stages, gpucheck_targets\n"
            f"gpucheck.main(['--quick', '--device', 'cpu', '--stages', 'variants', '--out', {str(tmp_path)!r}])\n"
            "from kvslim.bench import cuda\n"  # the bench stages' path: a model, a method's plan, a filled cache
            "m = cuda.build_model('tiny-gqa', 'cpu', cuda.torch.float32)\n"
            "print(cuda.fill(m, 'kvslim-int4', 1, 8, 2).nbytes > 0, cuda.api.get_plan(m).cache_bytes(8) > 0)\n"
            "print('loaded', sorted(m for m in sys.modules if m.split('.')[0] in ABSENT))\n")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    out = subprocess.run([sys.executable, "-c", hide], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded []" in out.stdout
    assert json.loads((tmp_path / "gpu_check.json").read_text())["stages"][0]["status"] == "ok"
    files = {n.split("::")[0] for _, nodes in gpucheck_stages.PYTEST_GROUPS for n in nodes}
    files |= {"tests/conftest.py", "tests/triton_aot.py", "tests/tolerances.py", "tests/test_mla_model.py"}
    for f in sorted(files):
        mods = re.findall(r"^\s*(?:from|import) ([a-zA-Z_]\w*)", (ROOT / f).read_text(), re.M)
        assert not set(mods) & set(ABSENT), (f, set(mods) & set(ABSENT))


def test_the_script_is_a_thin_wrapper():
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "kvslim.bench.gpucheck" in text and 'PYTHONPATH="$PWD/src' in text


def test_variant_sweep_puts_the_operand_precisions_first_and_refuses_unknown_ones():
    """On a GPU the sweep starts with fp32 ieee / tf32x3 / bf16 operands at the launcher's own tile (the budget may
    stop it later); a launcher refuses an operand precision it has no kernel for, by name."""
    from kvslim.bench.gpucheck_models import variant_plan
    from kvslim.kernels.triton import quant_decode as tq
    from kvslim.kernels.triton import quant_decode_lowbit as tl2

    for fam in ("int4", "int2"):
        plan = variant_plan(fam, cuda=True, interpreting=False)
        assert [r[3] for r in plan[:3]] == ["ieee", "tf32x3", "bf16"] and all(r[1] is None for r in plan[:3])
        assert all(r[3] == "ieee" for r in plan[3:]) and len(plan) > 3
    assert variant_plan("int4", cuda=False, interpreting=False) == [("twin", None, 0, "ieee")]
    q = torch.zeros(1, 1, 1, 64)
    codes = torch.zeros(1, 1, 16, 32, dtype=torch.uint8)
    params = torch.ones(1, 1, 16, 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="dot must be one of"):
        tq.launch(q, codes, params, params, codes, params, params, 4, 64, 0, 16, dot="tf32")
    with pytest.raises(ValueError, match="dot must be one of"):
        tl2.launch(q, codes[..., :24], params, params, codes[..., :16], params, params, 3, 2, 64, 0, 16, None, None,
                   None, None, 0.125, dot="fp16")


COLLECT = r'''
import json, sys
import pytest
class Seen:
    def pytest_collection_finish(self, session):
        self.items = [(i.nodeid, sorted({"kernel_dev", "cuda_dev"} & set(i.fixturenames))) for i in session.items]
seen = Seen()
pytest.main(sys.argv[1:], plugins=[seen])
print("ITEMS " + json.dumps(getattr(seen, "items", None)))
'''


def test_stage1_selects_only_tests_that_take_their_device_from_the_helper():
    """Issue 42, failure 3: every test stage 1 selects takes its device from tests/triton_aot.kernel_device (the
    ``kernel_dev`` or ``cuda_dev`` fixture): CUDA on a GPU, never CPU tensors there. Collected under the interpreter
    (every module imports); then run as stage 1 runs them (``TRITON_INTERPRET=0``) on this CPU: all skipped with a
    reason, none failed, none run."""
    nodes = [n for _, group in gpucheck_stages.PYTEST_GROUPS for n in group]
    env = {**gpucheck_stages._pytest_env(), "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", COLLECT, "--collect-only", "-q", "-p", "no:cacheprovider", "-k",
                          "not sm90", *nodes], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ITEMS ")), "ITEMS null")
    items = json.loads(line[6:])
    assert items, out.stdout[-3000:] + out.stderr[-3000:]
    files = {n.split("::")[0] for n, _ in items}
    assert files == {n.split("::")[0] for n in nodes}, files  # every group's file collected something
    bad = [n for n, fixtures in items if not fixtures]
    assert not bad, f"{len(bad)} tests stage 1 selects do not take their device from kernel_device: {bad[:10]}"
    if torch.cuda.is_available():
        return
    run = subprocess.run([sys.executable, "-m", "pytest", "-rs", "-p", "no:cacheprovider", "-k", "not sm90",
                          *nodes], cwd=ROOT, env=gpucheck_stages._pytest_env(), capture_output=True, text=True,
                         timeout=600)
    counts = gpucheck_stages._parse_pytest(run.stdout)["counts"]
    assert run.returncode == 0 and not counts.get("passed") and not counts.get("failed"), run.stdout[-3000:]
    assert counts.get("skipped"), run.stdout[-3000:]


def test_environment_is_recorded_before_any_stage(tmp_path, monkeypatch):
    """The first JSON (written before stage 1 starts) names the versions and the host: CPU model and its amx_* /
    avx512* flags, cores, host memory (issue 42): a stage that hangs still leaves them."""
    seen = []

    def first(ctx):
        seen.append(json.loads((tmp_path / "gpu_check.json").read_text()))
        raise RuntimeError("stop here")

    monkeypatch.setattr(gpucheck_stages, "stage_variants", first)
    _run(tmp_path, monkeypatch, "--stages", "variants")
    env = seen[0]["environment"]
    assert not seen[0]["stages"] and {"torch", "triton", "transformers", "python", "host"} <= set(env)
    cpu, mem = env["host"]["cpu"], env["host"]["memory"]
    assert cpu["logical_cores"] >= 1 and isinstance(cpu["flags"], list) and isinstance(cpu["amx"], bool)
    assert all(f.startswith(("amx", "avx512", "avx2", "avx_vnni", "fma", "f16c")) for f in cpu["flags"])
    assert mem["total_bytes"] is None or mem["available_bytes"] <= mem["total_bytes"]
    assert "nvidia_smi" in env["host"]


def test_all_kinds_runs_every_group_and_kind():
    """``--quick --all-kinds`` (the replica's CPU mode): stage 1's every group in one CPU process; refused without
    --quick."""
    (name, nodes), = gpucheck_stages.pytest_groups(True, True, "cpu")
    assert list(nodes) == [n for _, group in gpucheck_stages.PYTEST_GROUPS for n in group]
    assert [g[0] for g in gpucheck_stages.pytest_groups(True, False, "cpu")] == list(gpucheck_stages.QUICK_GROUPS)
    assert len(gpucheck_stages.pytest_groups(False, False, "cuda")) == len(gpucheck_stages.PYTEST_GROUPS)
    assert len(gpucheck_stages.STAGE2_KINDS) == 6
    with pytest.raises(ValueError, match="--all-kinds"):
        gpucheck.main(["--all-kinds", "--device", "cpu"])
