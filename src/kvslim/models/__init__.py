"""Real models loaded offline from files shipped in Python packages, one loader module per source format:
``gguf`` (GGUF through transformers' own loader, cached: SmolLM2, Gemma-3, Qwen2.5), ``ctranslate2`` (CTranslate2
Whisper), ``tiny_mha`` (our own safetensors)."""

from kvslim.models.ctranslate2 import load_whisper_base, load_whisper_ct2, load_whisper_tiny_en
from kvslim.models.gguf import load_gemma3_270m, load_gguf, load_qwen25_coder, load_smollm2, smollm2_gguf_path
from kvslim.models.tiny_mha import load_tiny_mha, tiny_mha_path

__all__ = ["load_gemma3_270m", "load_gguf", "load_qwen25_coder", "load_smollm2", "load_tiny_mha", "load_whisper_base",
           "load_whisper_ct2", "load_whisper_tiny_en", "smollm2_gguf_path", "tiny_mha_path"]
