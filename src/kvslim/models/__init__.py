"""Real models loaded offline from files shipped in Python packages."""

from kvslim.models.gguf_llama import load_gguf_llama, load_smollm2, smollm2_gguf_path

__all__ = ["load_gguf_llama", "load_smollm2", "smollm2_gguf_path"]
