"""Real models loaded offline from files shipped in Python packages."""

from kvslim.models.gguf_llama import load_gguf_llama, load_smollm2, smollm2_gguf_path
from kvslim.models.tiny_mha import load_tiny_mha, tiny_mha_path

__all__ = ["load_gguf_llama", "load_smollm2", "load_tiny_mha", "smollm2_gguf_path", "tiny_mha_path"]
