"""A tiny trained multi-head-attention Llama decoder shipped with kvslim.

The weights live in ``kvslim/data/tiny_mha`` (fp16 safetensors, ~8 MB) and were trained by
``scripts/train_tiny_mha.py`` on Python's standard-library sources. The model uses MHA
(``num_key_value_heads == num_attention_heads``), so slim attention can run end-to-end on a *trained*
decoder without any download.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["tiny_mha_path", "load_tiny_mha"]


def tiny_mha_path() -> Path:
    """Directory holding the tiny MHA model's config, tokenizer and weights."""
    try:
        from importlib.resources import files

        path = Path(str(files("kvslim") / "data" / "tiny_mha"))
    except (ImportError, ModuleNotFoundError, TypeError):
        path = Path(__file__).resolve().parent.parent / "data" / "tiny_mha"
    if not (path / "config.json").is_file():  # e.g. an unusual install layout
        path = Path(__file__).resolve().parent.parent / "data" / "tiny_mha"
    return path


def load_tiny_mha(dtype: torch.dtype = torch.float32):
    """Load the tiny MHA model and its tokenizer offline.

    Returns ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode cast to ``dtype`` and a
    ``PreTrainedTokenizerFast``.
    """
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = tiny_mha_path()
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"tiny MHA model weights not found in {path}")
    from .progress import status

    with status("loading the tiny MHA model"):
        model = LlamaForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model.eval()
    return model, tokenizer
