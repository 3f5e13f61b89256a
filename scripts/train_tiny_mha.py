#!/usr/bin/env python
"""Train a tiny multi-head-attention (MHA) Llama causal LM on Python's standard library, on CPU.

The result is a small *trained* decoder with ``num_key_value_heads == num_attention_heads``, so that
slim attention (which needs MHA) can be exercised end-to-end offline. Artifacts written to ``--out``:
``config.json``, ``generation_config.json``, ``model.safetensors`` (fp16), ``tokenizer.json``,
``tokenizer_config.json`` and ``train_log.json``.

Example::

    .venv/bin/python scripts/train_tiny_mha.py --minutes 11 --out src/kvslim/data/tiny_mha

The learning rate warms up linearly for ``--warmup-steps`` steps, then decays (cosine) with the fraction of the
wall-clock budget spent, so the run always ends at the minimum learning rate; pass ``--steps N`` instead for a schedule that
depends only on the step count (fully reproducible given the seed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import sysconfig
import time
import zlib
from pathlib import Path

# Threads that sleep instead of spinning at OpenMP barriers: on a CPU shared with other processes this made
# training steps ~3x faster here (and costs little when the machine is idle).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"


def stdlib_files(root: Path) -> list[Path]:
    """All ``*.py`` files of the stdlib under ``root``, excluding tests and site-packages, sorted."""
    skip = {"test", "tests", "site-packages", "__pycache__", "idle_test", "lib2to3_tests"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in skip for part in rel.parts[:-1]):
            continue
        if rel.parts[0].startswith("config-"):
            continue
        out.append(p)
    return out


def is_val(rel: str, val_mod: int) -> bool:
    """Deterministic held-out split: a fixed set of files chosen by a CRC of their relative path."""
    return zlib.crc32(rel.encode()) % val_mod == 0


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=EOS,
        model_max_length=1024,
        clean_up_tokenization_spaces=False,
    )


def encode_corpus(tok: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    eos = tok.eos_token_id
    ids: list[int] = []
    for enc in tok(texts, add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def build_model(args, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,  # MHA: required by slim attention
        head_dim=args.hidden // args.heads,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )
    return LlamaForCausalLM(config)


def batch(data: torch.Tensor, bs: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq - 1, (bs,), generator=gen)
    x = torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()
    return x[:, :-1], x[:, 1:]


def loss_fn(model, x, y, amp: bool) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


@torch.no_grad()
def evaluate(model, val_batches, amp: bool) -> float:
    model.eval()
    losses = [loss_fn(model, x, y, amp).item() for x, y in val_batches]
    model.train()
    return sum(losses) / len(losses)


def lr_at(step: int, frac: float, args) -> float:
    """Linear warmup over ``--warmup-steps`` steps, then cosine decay to ``--min-lr`` over the run."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def bench_amp(model, data, args, gen) -> bool:
    """Time a few fwd+bwd steps in fp32 and with bf16 autocast; return True if bf16 is faster."""
    x, y = batch(data, args.batch_size, args.seq_len, gen)
    times = {}
    for amp in (False, True):
        loss_fn(model, x, y, amp).backward()  # warm-up
        t = time.perf_counter()
        for _ in range(2):
            loss_fn(model, x, y, amp).backward()
        times[amp] = (time.perf_counter() - t) / 2
    model.zero_grad(set_to_none=True)
    print(f"bench: fp32 {times[False]:.2f}s/step, bf16-autocast {times[True]:.2f}s/step", flush=True)
    return times[True] < 0.9 * times[False]


def main(argv=None) -> int:
    default_root = Path(sysconfig.get_paths()["stdlib"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("src/kvslim/data/tiny_mha"))
    ap.add_argument("--stdlib", type=Path, default=default_root, help="root of the Python stdlib sources")
    ap.add_argument("--minutes", type=float, default=11.0, help="wall-clock training budget")
    ap.add_argument("--steps", type=int, default=0, help="if >0, a fixed step count for the LR schedule")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=688)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-steps", type=int, default=40)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--val-mod", type=int, default=25, help="~1/val_mod of the files are held out")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--eval-every", type=float, default=90.0, help="seconds between validation evals")
    ap.add_argument("--amp", choices=["auto", "bf16", "fp32"], default="auto")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()

    files = stdlib_files(args.stdlib)
    train_texts, val_texts, val_names = [], [], []
    for p in files:
        rel = p.relative_to(args.stdlib).as_posix()
        (val_texts if is_val(rel, args.val_mod) else train_texts).append(read(p))
        if is_val(rel, args.val_mod):
            val_names.append(rel)
    print(f"{len(train_texts)} train files, {len(val_texts)} val files", flush=True)

    tok = train_tokenizer(train_texts, args.vocab_size)
    train_data = encode_corpus(tok, train_texts)
    val_data = encode_corpus(tok, val_texts)
    print(
        f"tokenizer: vocab {len(tok)}; train {len(train_data):,} tokens, val {len(val_data):,} tokens "
        f"({time.perf_counter() - t0:.0f}s)",
        flush=True,
    )

    model = build_model(args, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    vgen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [batch(val_data, args.batch_size, args.seq_len, vgen) for _ in range(args.val_batches)]

    amp = args.amp == "bf16" or (args.amp == "auto" and bench_amp(model, train_data, args, gen))
    print(f"using {'bf16 autocast' if amp else 'fp32'}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )

    budget = args.minutes * 60.0
    log = {"args": {k: str(v) for k, v in vars(args).items()}, "train": [], "val": []}
    step, tokens, ema = 0, 0, None
    start = time.perf_counter()
    last_eval = start
    model.train()
    while True:
        elapsed = time.perf_counter() - start
        frac = step / args.steps if args.steps > 0 else elapsed / budget
        if frac >= 1.0 or elapsed >= budget:
            break
        lr = lr_at(step, frac, args)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train_data, args.batch_size, args.seq_len, gen)
        loss = loss_fn(model, x, y, amp)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 10 == 0:
            log["train"].append({"step": step, "tokens": tokens, "loss": round(ema, 4), "lr": lr})
            print(
                f"step {step:5d} tok {tokens:>10,} loss {ema:.3f} lr {lr:.2e} {elapsed:6.0f}s", flush=True
            )
        if time.perf_counter() - last_eval >= args.eval_every:
            vl = evaluate(model, val_batches, amp)
            log["val"].append({"step": step, "tokens": tokens, "loss": round(vl, 4)})
            print(f"  val loss {vl:.3f} (ppl {math.exp(vl):.1f})", flush=True)
            last_eval = time.perf_counter()

    train_minutes = (time.perf_counter() - start) / 60
    final_val = evaluate(model, val_batches, amp)
    final_val_fp32 = evaluate(model, val_batches, False)
    log["val"].append({"step": step, "tokens": tokens, "loss": round(final_val, 4)})
    summary = {
        "steps": step,
        "tokens_seen": tokens,
        "train_minutes": round(train_minutes, 2),
        "final_train_loss_ema": round(ema, 4),
        "final_val_loss": round(final_val_fp32, 4),
        "final_val_ppl": round(math.exp(final_val_fp32), 2),
        "amp": "bf16" if amp else "fp32",
        "n_params": n_params,
        "train_tokens_corpus": len(train_data),
        "val_tokens_corpus": len(val_data),
        "val_files": val_names,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    log["summary"] = summary
    print(json.dumps({k: v for k, v in summary.items() if k != "val_files"}, indent=1), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.float16)
    model.config.dtype = "float16"
    model.save_pretrained(args.out, safe_serialization=True)
    GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        do_sample=False,
        max_new_tokens=64,
    ).save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")
    print(f"saved to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
