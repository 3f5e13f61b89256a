"""One rank of the sequence-parallel tests (run as a process by tests/test_distributed.py; no tests here).

``python tests/test_distributed_worker.py SCENARIO OUT_DIR`` with torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) in the environment; writes ``OUT_DIR/rank<R>.json``. The cases are shared with the
parent, which runs each one in a single process with plain ``kvslim.apply`` as the reference.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import padded_batch, tiny_model  # noqa: E402

import kvslim  # noqa: E402
from kvslim.adapters.compat import CACHE_KW

MLA_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16, n_shared_experts=1, num_experts_per_tok=2, n_routed_experts=4,
                first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1, q_lora_rank=24,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_interleave=True)

#: name -> (model, method, method options, sequence-parallel options, prompt kind, new tokens)
CASES = {
    "dense": ("llama", "dense", {}, {}, "even", 8),
    "dense-reduce": ("llama", "dense", {}, {"merge": "reduce"}, "even", 6),
    "int8": ("llama", "int8", {"group_size": 16}, {}, "even", 8),
    "int8-uneven": ("llama", "int8", {"group_size": 16}, {"split": (3, 1)}, "even", 6),
    "int2-kivi": ("llama", "int2", {"group_size": 16, "residual": 8, "key_channel_group": 8, "sink": 0}, {}, "even", 8),
    "int4-padded": ("llama", "int4", {"group_size": 16}, {}, "padded", 6),
    "dense-empty-rank": ("llama", "dense", {}, {"split": (1, 0), "rule": "round_robin"}, "even", 4),
    "dense-padded": ("llama", "dense", {}, {}, "padded", 8),
    "window": ("mistral", "window", {}, {}, "padded", 8),
    "slim": ("llama-mha", "slim", {}, {}, "even", 8),
    "slim-padded": ("llama-mha", "slim", {}, {"rule": "round_robin"}, "padded", 6),
    "slim-before": ("llama-mha", "slim", {}, {"project": "before"}, "padded", 6),
    "mla-before": ("deepseek-v3", "mla", {}, {"project": "before", "merge": "reduce"}, "padded", 6),
    "mla": ("deepseek-v3", "mla", {}, {}, "even", 8),
    "mla-padded": ("deepseek-v3", "mla", {"bits": 8, "group_size": 16}, {"split": (0, 1)}, "padded", 6),
}


def build(model: str):
    if model == "llama":
        return tiny_model("llama")
    if model == "llama-mha":
        return tiny_model("llama", kv_heads=4)
    if model == "mistral":
        return tiny_model("mistral")
    if model == "deepseek-v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.manual_seed(0)
        return DeepseekV3ForCausalLM(DeepseekV3Config(**MLA_BASE)).eval()
    raise ValueError(model)


def prompt(kind: str):
    if kind == "padded":
        return padded_batch(batch=2, length=13)
    ids = torch.randint(1, 128, (2, 13), generator=torch.Generator().manual_seed(3))
    return ids, torch.ones_like(ids)


def run_generate(model, ids, mask, new: int):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def reference(name: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The single-process result of case ``name``: tokens, logits (steps, B, V), cache bytes."""
    model_name, method, mopts, _, kind, new = CASES[name]
    model = build(model_name)
    ids, mask = prompt(kind)
    kvslim.apply(model, method, **mopts)
    cache = kvslim.make_cache(model, max_length=ids.shape[1] + new)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                             **{CACHE_KW: cache})
    return out.sequences, torch.stack(out.logits), cache.nbytes


def scenario_cases(names):
    import kvslim.distributed as kd

    results = {}
    for name in names:
        model_name, method, mopts, sopts, kind, new = CASES[name]
        model = build(model_name)
        ids, mask = prompt(kind)
        rt = kd.apply(model, method, timeout_s=30, **sopts, **mopts)
        rt.comm.reset_counters()
        seq, logits = run_generate(model, ids, mask, new)
        results[name] = {"tokens": seq.tolist(), "logits": logits.tolist(), "bytes": rt.cache_bytes_per_rank(),
                         "sent": rt.comm.sent_bytes, "calls": rt.comm.calls,
                         "local_tokens": rt.cache.local_tokens(), "layers": len(rt.cache.layers)}
        kd.restore(model)
    return results


def scenario_kill(hang: bool = False):
    """Rank 1 dies (or hangs) at its third decode step; the others must fail with a clear error within the
    timeout."""
    import kvslim.distributed as kd

    model = build("llama")
    ids, mask = prompt("even")
    rt = kd.apply(model, "dense", timeout_s=5 if hang else 10, watchdog=False)
    calls = {"n": 0}
    forward = model.forward

    def dying_forward(*a, **kw):
        calls["n"] += 1
        if rt.rank == 1 and calls["n"] == 4:
            if hang:
                time.sleep(60)
            os._exit(3)
        return forward(*a, **kw)

    model.forward = dying_forward
    t0 = time.monotonic()
    try:
        run_generate(model, ids, mask, 8)
    except kd.DistributedError as exc:
        return {"error": str(exc), "type": type(exc).__name__, "elapsed": time.monotonic() - t0}
    return {"error": None, "elapsed": time.monotonic() - t0}


def scenario_mismatch():
    """Ranks ask for different options: every rank must refuse, naming the field."""
    import kvslim.distributed as kd

    model = build("llama")
    rank = int(os.environ["RANK"])
    try:
        kd.apply(model, "int8", timeout_s=20, group_size=16 if rank == 0 else 32)
    except kd.DistributedError as exc:
        return {"error": str(exc)}
    return {"error": None}


def main() -> None:
    scenario, out_dir = sys.argv[1], sys.argv[2]
    torch.set_num_threads(1)
    import kvslim.distributed as kd

    rank = int(os.environ["RANK"])
    if scenario == "failures":  # refused set-up, then a rank that dies mid-generation
        result = {"mismatch": scenario_mismatch(), "kill": scenario_kill()}
    elif scenario == "hang":
        result = {"hang": scenario_kill(hang=True)}
    else:
        result = scenario_cases(scenario.split(","))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if scenario not in ("failures", "hang"):
        kd.close_group()
    os._exit(0)  # skip interpreter teardown (and any gloo shutdown wait on a dead peer)


if __name__ == "__main__":
    main()
