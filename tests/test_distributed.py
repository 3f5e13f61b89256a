"""Sequence-parallel decode (kvslim.distributed): placement and log-sum-exp merge against float64 formulas, then
2 real processes on localhost (gloo) against one process with plain ``kvslim.apply`` — dense, int8/int4, window,
slim, MLA; uneven and empty slices; left-padded batches; a refused set-up and a killed rank."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_distributed_worker import CASES, build, reference
from tolerances import LOGIT_ATOL, RTOL

import kvslim
import kvslim.distributed as kd
from kvslim.adapters.shape import shape_from_config
from kvslim.cli.main import main
from kvslim.distributed.merge import Partial, merge_local, partial_attention, reference_attention
from kvslim.distributed.placement import Placement, split_sizes
from kvslim.distributed.plan import per_rank

pytestmark = pytest.mark.usefixtures("one_thread")
WORKER = Path(__file__).with_name("test_distributed_worker.py")


# -- in-process: placement and merge ----------------------------------------------------------------------------
def test_split_sizes_and_rules():
    assert split_sizes(10, (1, 1, 1)) == [4, 3, 3]
    assert split_sizes(5, (3, 1)) == [4, 1]
    assert split_sizes(5, (1, 0)) == [5, 0]
    p = Placement(2)
    assert p.owners_of(0, 7) == [0] * 4 + [1] * 3
    assert [p.owners_of(t, 1)[0] for t in range(7, 11)] == [1, 0, 1, 0]  # fewest tokens, ties to rank 0
    r = Placement(2, rule="round_robin", split=(1, 0))
    assert r.owners_of(0, 3) == [0, 0, 0]
    assert [r.owners_of(t, 1)[0] for t in range(3, 7)] == [0, 1, 0, 1]
    assert p.owners_of(2, 3) == [0, 0, 1]  # decided once, then remembered


def test_window_placement_keeps_each_rank_within_ceil_w_over_n():
    w, n = 10, 3
    p = Placement(n, window=w)
    p.owners_of(0, 25)  # a prompt longer than the window keeps its last W tokens
    assert p.owners[:15] == [-1] * 15 and sum(p.counts) == w
    for t in range(25, 80):
        p.owners_of(t, 1)
        live = [sum(1 for g in range(t - w + 1, t + 1) if p.owners[g] == r) for r in range(n)]
        assert live == p.counts and max(live) <= -(-w // n)


def test_bad_options_are_refused_by_name():
    with pytest.raises(ValueError, match="rule"):
        kd.SeqParallelOptions(rule="random")
    with pytest.raises(ValueError, match="merge"):
        kd.SeqParallelOptions(merge="ring")
    with pytest.raises(ValueError, match="timeout_s"):
        kd.SeqParallelOptions(timeout_s=0)
    with pytest.raises(ValueError, match="split"):
        Placement(2, split=(1, 1, 1))


@pytest.mark.parametrize("hkv", [4, 2])
def test_merge_of_slices_equals_float64_attention(hkv):
    g = torch.Generator().manual_seed(0)
    b, h, t, n, d = 2, 4, 3, 17, 8
    q = torch.randn(b, h, t, d, generator=g)
    k, v = torch.randn(b, hkv, n, d, generator=g) * 3, torch.randn(b, hkv, n, d, generator=g)
    mask = torch.rand(b, 1, t, n, generator=g) > 0.3
    mask[..., 0] = True
    ref = reference_attention(q, k, v, mask, 0.35)
    for cuts in ([0, 17], [0, 0, 9, 17], [0, 5, 5, 17, 17]):  # empty slices included
        parts = [partial_attention(q, k[:, :, a:z], v[:, :, a:z], mask[..., a:z], 0.35)
                 for a, z in zip(cuts, cuts[1:])]
        out = merge_local(parts)
        assert (out.double() - ref).abs().max().item() <= RTOL[torch.float32] * 10


def test_empty_partial_is_neutral():
    acc = torch.randn(1, 2, 1, 4)
    full = Partial(acc, torch.zeros(1, 2, 1), torch.full((1, 2, 1), 2.0))
    empty = Partial(torch.zeros(1, 2, 1, 4), torch.full((1, 2, 1), float("-inf")), torch.zeros(1, 2, 1))
    torch.testing.assert_close(merge_local([empty, full, empty]), acc / 2)


def test_plan_ranks_divides_the_cache(tmp_path, capsys):
    model = build("llama")
    model.config.save_pretrained(tmp_path)
    args = ["plan", "--config", str(tmp_path / "config.json"), "--context", "1001", "--batch", "2", "--dtype",
            "float32", "--json", "--group-size", "16"]
    assert main(args + ["--ranks", "4"]) == 0
    recs = {r["method"]: r for r in json.loads(capsys.readouterr().out)}
    dense = recs["dense"]
    assert dense["cache_bytes_per_rank"] == dense["cache_bytes"] // 1001 * 251  # ⌈1001 / 4⌉ tokens
    # 4 ranks merge by all-reduce: 2·(N−1)/N of 3 layers · batch 2 · 4 heads · (16 + 2) · 4 bytes
    assert dense["merge"] == "reduce" and dense["sent_bytes_per_step"] == 2 * 3 * 3 * 2 * 4 * 18 * 4 // 4
    assert dense["sent_bytes_per_step"] <= dense["sent_bound"]
    assert main(args + ["--ranks", "0"]) == 2
    assert "--ranks must be a positive int" in capsys.readouterr().err


def test_one_rank_job_equals_plain_kvslim():
    model = build("llama")
    ids = torch.randint(1, 128, (2, 9), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    kvslim.apply(model, "int8", group_size=16)
    ref = model.generate(ids, **kw)
    rt = kd.apply(model, "int8", group_size=16)
    assert rt.world_size == 1
    assert torch.equal(model.generate(ids, **kw), ref)
    kd.restore(model)
    assert "generate" not in vars(model) and kvslim.get_plan(model) is None


# -- two processes ------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(scenario: str, out: Path, limit_s: float = 240) -> list[int]:
    port = _free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    deadline = time.monotonic() + limit_s
    codes = []
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: ranks did not finish within {limit_s} s")
        codes.append(p.returncode)
    return codes


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("seqpar")
    codes = _launch(",".join(CASES), out)
    assert codes == [0, 0], f"worker exit codes {codes}"
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


#: formats that group along tokens (KIVI keys, full-precision residual window) group each rank's own tokens:
#: same memory, a different (not worse) quantization than one process, so not the same tokens
RANK_LOCAL_GROUPS = {"int2-kivi"}
#: d_out per case family (the width merged per head): head_dim, slim row width (d), MLA latent dc
D_OUT = {"llama": 16, "mistral": 16, "llama-mha": 64, "deepseek-v3": 32}


@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_one_process(two_rank_results, name):
    r0, r1 = (res[name] for res in two_rank_results)
    model_name, method, mopts, sopts, kind, new = CASES[name]
    seq, logits, total = reference(name)
    assert r0["tokens"] == r1["tokens"], "ranks disagree on the tokens"
    if name not in RANK_LOCAL_GROUPS:
        assert r0["tokens"] == seq.tolist(), "tokens differ from one process"
        err = (torch.tensor(r0["logits"]) - logits).abs().max().item()
        assert err <= LOGIT_ATOL[torch.float32], f"logits differ by {err:.2e}"
    # memory: the ranks hold the single-process cache between them (per-sequence fixed bytes, e.g. int8 key
    # smoothing factors, are held by every rank), split as the placement says
    plan = kvslim.plan_config(build(model_name).config, method, "float32", **mopts)
    fixed = sum(lp.fixed_bytes for lp in plan.layers) * 2  # batch 2
    bytes_ = r0["bytes"]
    assert bytes_ == r1["bytes"] and sum(bytes_) == total + fixed
    if "split" not in sopts and sopts.get("rule", "fewest") == "fewest":
        per_token = (total - fixed) / (len(seq[0]) - 1 if method != "window" else 8 - 1)  # a ring keeps W − 1
        assert abs(bytes_[0] - bytes_[1]) <= per_token + 1, "cache per rank not within one token of total / N"
    # traffic: at most 2 · layers · batch · heads · (d_out + 2) · 4 bytes sent per decode step
    bound = 2 * r0["layers"] * 2 * 4 * (D_OUT[model_name] + 2) * 4
    assert r0["sent"] / (new - 1) <= bound
    if sopts.get("project") == "before":  # the value map before the merge: head_dim-wide partials
        assert r0["sent"] / (new - 1) <= 2 * r0["layers"] * 2 * 4 * (16 + 2) * 4
    # the planner (`kvslim plan --ranks`) predicts both: the fullest rank's bytes and the bytes sent per step
    shape = shape_from_config(build(model_name).config)
    pred = per_rank(plan, shape, len(seq[0]) - 1, 2, 2, sopts.get("merge", "auto"), sopts.get("project", "after"))
    assert pred["sent_bytes_per_step"] * (new - 1) == r0["sent"]
    assert pred["sent_bound"] == bound or sopts.get("project") == "before"
    if "split" not in sopts and sopts.get("rule", "fewest") == "fewest":
        assert max(bytes_) == pred["cache_bytes_per_rank"]


def test_refused_setup_and_killed_rank(tmp_path):
    codes = _launch("failures", tmp_path, limit_s=120)
    assert codes[1] == 3, f"rank 1 should have died with exit code 3, got {codes}"
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert "options" in r0["mismatch"]["error"] and "group_size" in r0["mismatch"]["error"]
    kill = r0["kill"]
    assert kill["type"] == "DistributedError" and "rank 0/2" in kill["error"] and "died" in kill["error"]
    assert kill["elapsed"] < 10, "the surviving rank should fail within the 10 s timeout"


def test_sharded_layer_refuses_bad_values_before_writing_keys():
    """A sequence-parallel int8 layer (one rank's view, no process group needed) refuses a step whose values hold
    a NaN before any store is written: the keys' slot and the counters stay as they were."""
    from kvslim.caches.storage import StoreSpec
    from kvslim.distributed.layers import ShardedKVLayer

    spec = StoreSpec(8, 8)
    layer = ShardedKVLayer([spec, spec.for_values()], Placement(1), 0)
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(1, 2, 5, 16, generator=gen), torch.randn(1, 2, 5, 16, generator=gen))
    before = [t.clone() for s in layer.stores for t in s.tensors()]
    k, v = torch.randn(1, 2, 1, 16, generator=gen), torch.randn(1, 2, 1, 16, generator=gen)
    v[0, 0, 0, 2] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        layer.update(k, v)
    assert layer.cumulative_length == 5 and layer.used == 5
    assert all(torch.equal(a.flatten().view(torch.uint8), b.flatten().view(torch.uint8))
               for a, b in zip(before, [t for s in layer.stores for t in s.tensors()], strict=True))
