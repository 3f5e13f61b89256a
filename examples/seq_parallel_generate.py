"""Sequence-parallel greedy generation with a kvslim cache split across processes.

    torchrun --nproc_per_node 2 examples/seq_parallel_generate.py --method int8
    torchrun --nproc_per_node 1 examples/seq_parallel_generate.py --method int8   # the single-process reference

Every rank loads the same model (the shipped tiny trained MHA Llama; a tiny random DeepSeek-V3 for ``--method
mla``), runs the same ``model.generate(...)`` and holds only its slice of the cache. Rank 0 prints exactly two lines:
``tokens: <space-separated ids>`` (the new tokens of every sequence, row after row) and
``cache bytes per rank: <ints>``. With one process the script runs plain ``kvslim.apply`` (no sharding): the
reference the multi-rank tokens must equal.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

import kvslim
from kvslim.adapters.compat import CACHE_KW

PROMPT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
          "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\ndef factorial(n):\n")


def load(method: str, seed: int):
    """(model, prompt ids (1, P)) — identical on every rank."""
    if method == "mla":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        torch.manual_seed(seed)
        cfg = DeepseekV3Config(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                               q_lora_rank=96, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                               n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
                               first_k_dense_replace=1, max_position_embeddings=1024)
        model = DeepseekV3ForCausalLM(cfg).eval()
        ids = torch.randint(1, 512, (1, 48), generator=torch.Generator().manual_seed(seed))
        return model, ids
    from kvslim.models.tiny_mha import load_tiny_mha

    model, tok = load_tiny_mha(torch.float32)
    return model, tok(PROMPT, return_tensors="pt").input_ids


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", default="int8", help="dense | window | int8 | int4 | int2 | slim | mla")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1, help="copies of the prompt")
    p.add_argument("--window", type=int, default=None, help="ring-buffer window (method window)")
    p.add_argument("--group-size", type=int, default=32, help="quantization group (int8/int4; the tiny model's "
                   "head_dim is 32)")
    p.add_argument("--rule", default="fewest", help="where decoded tokens go: fewest | round_robin")
    p.add_argument("--merge", default="auto", help="auto | gather | reduce")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may take")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    options = {"window": args.window} if args.window else {}
    if args.method == "window" and not args.window:
        options = {"window": 32}
    if args.method in ("int8", "int4"):
        options["group_size"] = args.group_size
    model, ids = load(args.method, args.seed)
    ids = ids.repeat(args.batch, 1)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=0, attention_mask=torch.ones_like(ids))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    with torch.no_grad():
        if world == 1:  # the reference: one process, plain kvslim
            kvslim.apply(model, args.method, **options)
            cache = kvslim.make_cache(model, max_length=ids.shape[1] + args.new_tokens)
            out = model.generate(ids, **{CACHE_KW: cache}, **gen)  # `cache=` from transformers 5.24
            sizes, rank = [cache.nbytes], 0
        else:
            import kvslim.distributed as kd

            rt = kd.apply(model, args.method, rule=args.rule, merge=args.merge, timeout_s=args.timeout,
                          **options)
            out = model.generate(ids, **gen)
            sizes, rank = rt.cache_bytes_per_rank(), rt.rank
    if rank == 0:
        new = out[:, ids.shape[1]:]
        print("tokens: " + " ".join(str(t) for t in new.flatten().tolist()))
        print("cache bytes per rank: " + " ".join(str(s) for s in sizes))
    sys.stdout.flush()
    if world > 1:
        kd.close_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
