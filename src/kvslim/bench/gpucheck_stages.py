"""The stages of :mod:`kvslim.bench.gpucheck`: each takes the check's ``Context`` and returns its JSON-ready record
(``status`` ok / failed; an exception is recorded by the caller)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
#: stage 1's pytest runs: (name, node ids); run side by side (Triton's compiles are CPU-bound, the GPU work tiny)
PYTEST_GROUPS = (
    ("triton-int8-int4", ("tests/test_triton_quant_decode.py",)),
    ("triton-int2", ("tests/test_triton_quant_decode_lowbit.py",)),
    ("triton-slim-encdec", ("tests/test_triton_slim.py",)),
    ("triton-mla", ("tests/test_triton_mla.py",)),
    ("triton-turbo", ("tests/test_triton_turbo_decode.py",)),
    ("sync-debug-mode", ("tests/test_sync_free.py::test_cuda_decode_steps_pass_sync_debug_mode_error",)),
    ("cuda-graph-tokens", ("tests/test_cuda_graphs.py::test_reduce_overhead_decode_steps_give_eager_tokens_on_cuda",)),
    ("capturable-cuda-graphs", ("tests/test_cuda_graphs.py::test_capturable_steps_under_cuda_graphs_on_cuda",)),
)
#: --quick (CPU): one CUDA-only group (its tests skip there): the subprocess, parsing and recording path (each pytest
#: process costs ~13 CPU s of imports and collection on the shared 2-core machine, so one)
QUICK_GROUPS = ("capturable-cuda-graphs",)
#: stage 2's kinds (each eager and compiled)
STAGE2_KINDS = ("hf-static", "kvslim-dense", "kvslim-int8", "kvslim-int4", "kvslim-int2", "kvslim-slim")
#: pytest seconds at most (the rest of stage 1 runs meanwhile)
PYTEST_TIMEOUT_S = 200
#: methods of the greedy check: apply options (small residual windows so that codes are read within 40 tokens)
GREEDY_CASES = {"dense": {}, "window": {"window": 64}, "int8": {},
                "int4": {"residual": 8, "flush": 4, "key_channel_group": 4, "sink": 2},
                "int3": {"residual": 8, "flush": 8, "key_channel_group": 8, "sink": 0},
                "int2": {"residual": 8, "flush": 8, "key_channel_group": 8, "sink": 0},
                "slim": {}, "mla": {}, "turbo4": {"residual": 8, "flush": 4, "sink": 2},
                "turbo3": {"residual": 8, "flush": 4, "sink": 2}, "turbo2": {"residual": 8, "flush": 4, "sink": 2}}


# -- stage 1 -------------------------------------------------------------------------------------------------------
def _pytest_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KVSLIM_BACKEND",)}
    env["TRITON_INTERPRET"] = "0"  # tests/conftest.py only sets it when unset
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    return env


def _parse_pytest(text: str) -> dict:
    """Counts from pytest's last summary line, and the FAILED / ERROR lines (at most 20)."""
    counts = {}
    for line in reversed(text.splitlines()):
        found = re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)", line)
        if found and (" in " in line or "=" in line):
            counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in found}
            break
    bad = [ln.strip()[:300] for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:20]
    if not counts:  # no summary (killed): count the verbose lines
        for status in ("PASSED", "FAILED", "SKIPPED", "ERROR"):
            n = len(re.findall(rf" {status}\b", text))
            if n:
                counts[status.lower()] = n
    return {"counts": counts, "problems": bad}


def start_pytest(groups) -> list[dict]:
    runs = []
    for name, nodes in groups:
        log = tempfile.NamedTemporaryFile("w+", prefix=f"gpucheck_{name}_", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "-k", "not sm90", *nodes]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=_pytest_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        runs.append({"name": name, "nodes": list(nodes), "proc": proc, "log": log, "t0": time.monotonic()})
    return runs


def finish_pytest(runs: list[dict], deadline: float) -> list[dict]:
    out = []
    for run in runs:
        proc, timed_out = run["proc"], False
        try:
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, 9)  # the process group this run started (start_new_session)
            proc.wait()
        run["log"].flush()
        text = Path(run["log"].name).read_text(errors="replace")
        run["log"].close()
        os.unlink(run["log"].name)
        parsed = _parse_pytest(text)
        ok = not timed_out and proc.returncode in (0, 5) and not parsed["counts"].get("failed") \
            and not parsed["counts"].get("error")
        out.append({"group": run["name"], "nodes": run["nodes"], "returncode": proc.returncode,
                    "timed_out": timed_out, "seconds": time.monotonic() - run["t0"], "ok": ok, **parsed,
                    "tail": text[-1500:] if not ok else ""})
    return out


def _tiny(method: str, device: str, dtype):
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if method == "mla":
        cfg = DeepseekV2Config(vocab_size=256, hidden_size=128, intermediate_size=192, moe_intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                               q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                               n_shared_experts=1, num_experts_per_tok=2, n_routed_experts=4, first_k_dense_replace=1,
                               topk_method="greedy", max_position_embeddings=256, initializer_range=0.1)
        model = DeepseekV2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4 if method == "slim" else 2,
                          max_position_embeddings=256, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=dtype).eval()


def greedy_vs_hf(device: str, quick: bool) -> list[dict]:
    """Every method on a tiny model, fp32 and bf16: 16 greedy tokens after a 24-token prompt (batch 2) against HF's
    own cache on the same weights. ``expected_equal``: the plan calls every layer exact and the dtype is fp32."""
    import torch

    import kvslim

    rows = []
    for dtype in (torch.float32,) if quick else (torch.float32, torch.bfloat16):  # bf16 on a CPU: slow, not news
        for method, opts in GREEDY_CASES.items():
            row = {"method": method, "dtype": str(dtype).replace("torch.", ""), "options": opts}
            try:
                model = _tiny(method, device, dtype)
                ids = torch.randint(1, 256, (2, 24), generator=torch.Generator().manual_seed(1)).to(device)
                kw = dict(max_new_tokens=8 if quick else 16, do_sample=False, pad_token_id=0)
                with torch.no_grad():
                    ref = model.generate(ids, **kw)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        plan = kvslim.apply(model, method, **opts)
                    out = model.generate(ids, **kw)
                kvslim.restore(model)
                new_ref, new_out = ref[:, 24:], out[:, 24:]
                same = (new_ref == new_out).all(0) if new_ref.shape == new_out.shape else None
                first = None if same is None or bool(same.all()) else int((~same).nonzero()[0, 0])
                row.update(equal=bool(torch.equal(new_ref, new_out)), first_mismatch=first,
                           agreement=float((new_ref == new_out).float().mean()) if same is not None else 0.0,
                           exactness=sorted({lp.exactness for lp in plan.layers}),
                           expected_equal=dtype == torch.float32 and all(lp.exactness.startswith("exact") for lp in plan.layers))
            except Exception as e:  # noqa: BLE001 - one method's failure is its row
                row.update(error=f"{type(e).__name__}: {str(e)[:300]}", expected_equal=True, equal=False)
            rows.append(row)
    return rows


def pytest_groups(quick: bool, all_kinds: bool, device: str) -> list[tuple[str, tuple[str, ...]]]:
    """Stage 1's pytest runs: every group side by side (a GPU); ``--quick``: :data:`QUICK_GROUPS`; ``--quick
    --all-kinds`` on a CPU: every group's tests in one process (imports once; there they skip with a reason)."""
    if quick and all_kinds and device == "cpu":
        return [("all-groups", tuple(n for _, nodes in PYTEST_GROUPS for n in nodes))]
    return [g for g in PYTEST_GROUPS if not quick or all_kinds or g[0] in QUICK_GROUPS]


def stage_correctness(ctx) -> dict:
    have_pytest = importlib.util.find_spec("pytest") is not None
    groups = pytest_groups(ctx.quick, getattr(ctx, "all_kinds", False), ctx.device)
    runs = start_pytest(groups) if have_pytest else []
    greedy = greedy_vs_hf(ctx.device, ctx.quick)  # meanwhile, in this process
    deadline = min(ctx.deadline, time.monotonic() + PYTEST_TIMEOUT_S)  # --quick too: a loaded CI machine is slow
    tests = finish_pytest(runs, deadline) if have_pytest else []
    bad_greedy = [f"{r['method']} {r['dtype']}" for r in greedy if r.get("error") or (r["expected_equal"]
                                                                                      and not r["equal"])]
    bad_tests = [t["group"] for t in tests if not t["ok"]]
    return {"status": "failed" if bad_greedy or bad_tests or not have_pytest else "ok",
            "pytest": tests if have_pytest else "pytest does not import here: the kernel tests were not run",
            "greedy_vs_hf": greedy, "failed_greedy": bad_greedy, "failed_tests": bad_tests}


# -- stages 2 and 3: kvslim bench --device cuda with points ------------------------------------------------------
def _bench(ctx, **kw) -> dict:
    from . import cuda

    small = {"steps": 1, "rounds": 1, "max_batch": 16, "cpu_budget": 256 << 10} if ctx.quick else {}
    s = cuda.Settings(device=ctx.device, quick=ctx.quick, deadline=ctx.deadline, **small, **kw)
    doc = cuda.run(s, progress=ctx.progress)
    failed = [f"{r['point']} {r['kind']}" for r in doc["records"] if "error" in r]
    failed += [f"capacity {c['kind']}" for c in doc["capacity"] if "error" in c]
    return {"status": "failed" if failed else "ok", "failed": failed, **doc}


def stage_mha_1b(ctx) -> dict:
    """HF static and kvslim dense/int8/int4/int2/slim at 8k x 8, eager and under CUDA graphs (dynamo's
    ``cudagraphs`` backend: no inductor code generation, so six kinds compile within the stage)."""
    every = getattr(ctx, "all_kinds", False)
    # --quick --all-kinds on a CPU: the GPU's own mode (dynamo + AOT autograd; the capture itself skips CPU tensors)
    mode = "cudagraphs" if ctx.device == "cuda" or every else "eager-backend"
    kinds = STAGE2_KINDS
    # --quick: three compiles (~3 CPU s each): HF's static cache, a per-token static path, the int4 default's ring
    quick = ("hf-static", "kvslim-int8", "kvslim-int4")
    return _bench(ctx, points=(("tiny-mha", 96, 2),) if ctx.quick else (("mha-1b", 8192, 8),), compile_mode=mode,
                  capacity=False, kinds=quick if ctx.quick and not every else kinds)


def stage_llama3_8b(ctx) -> dict:
    """HF static, kvslim dense/int4/int2 eager at 32k x 4; the capacity (largest batch at 32k) of dense and int4."""
    return _bench(ctx, points=(("tiny-gqa", 96, 2),) if ctx.quick else (("llama3-8b", 32768, 4),),
                  compile_mode=None, capacity=True, capacity_kinds=("kvslim-dense", "kvslim-int4"),
                  kinds=("hf-static", "kvslim-dense", "kvslim-int4", "kvslim-int2"))


# -- stage 4 -------------------------------------------------------------------------------------------------------
def stage_encdec_mla(ctx) -> dict:
    from . import gpucheck_models as gm

    out = {}
    for name, fn in (("whisper", gm.whisper_vs_hf), ("mla", gm.mla_vs_hf)):
        try:
            out[name] = fn(ctx)
        except Exception as e:  # noqa: BLE001 - one half failing keeps the other
            import torch

            out[name] = {"error": f"{type(e).__name__}: {str(e)[:400]}",
                         "out_of_memory": isinstance(e, torch.OutOfMemoryError)}
        finally:
            import gc

            gc.collect()
    failed = [k for k, v in out.items() if "error" in v or v.get("tokens_equal") is False]
    return {"status": "failed" if failed else "ok", "failed": failed, **out}


# -- stage 5 -------------------------------------------------------------------------------------------------------
def stage_variants(ctx) -> dict:
    from . import gpucheck_models as gm

    return gm.kernel_variants(ctx)


# -- stage 6 -------------------------------------------------------------------------------------------------------
def stage_sparse(ctx) -> dict:
    """Sparse decode on the GPU (docs/sparse.md): HF static, full int4 and int4 with ``sparse_budget=2048``: eager
    and under CUDA graphs (dynamo's ``cudagraphs`` backend; the kvslim caches capturable, the sparse step's page
    table decided on the device) at Llama-3-8B 32k x 4, eager at 128k x 1 (``--quick``: a 4-layer tiny GQA at 4k x 1,
    past the budget, every layer sparse, eager and compiled): step time and bytes."""
    mode = "cudagraphs" if ctx.device == "cuda" else "eager-backend"
    kinds = ("hf-static", "kvslim-int4", "kvslim-int4-sparse")
    if ctx.quick:
        return _bench(ctx, points=(("tiny-gqa-4l", 4096, 1),), compile_mode=mode, capacity=False, kinds=kinds)
    graphs = _bench(ctx, points=(("llama3-8b", 32768, 4),), compile_mode=mode, capacity=False, kinds=kinds)
    long = _bench(ctx, points=(("llama3-8b", 131072, 1),), compile_mode=None, capacity=False, kinds=kinds)
    failed = graphs["failed"] + long["failed"]
    return {**graphs, "status": "failed" if failed else "ok", "failed": failed,
            "records": graphs["records"] + long["records"]}
