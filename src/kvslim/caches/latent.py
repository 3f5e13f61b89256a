"""MLA latent cache layer: the compressed ``c_kv`` (kv_lora_rank wide) and the shared RoPE key ``k_pe``.

Stores ``dc + dr`` values per token (DeepSeek-V2: 576 instead of 40,960 for per-head K and V, 1/71); ``c_kv`` plain
(exact) or grouped int8/int4 (lossy, measured), ``k_pe`` always in the model dtype (RoPE phases are sensitive).
Speaks the same ``update(c_kv, k_pe)`` protocol as Hugging Face's own cache for DeepSeek models (seed 003/004).
"""

from __future__ import annotations

import torch

from .dense import AppendLayer
from .spec import StoreSpec
from .storage import TensorStore
from .stores import make_store


class LatentLayer(AppendLayer):
    """Append-only latent cache: preallocated, grown in chunks (:class:`AppendLayer`), two stores of own precision.

    ``update(c_kv (B, 1, S, dc), k_pe (B, 1, S, dr))`` returns all cached ``(c_kv, k_pe)`` as ``(B, 1, T, ·)``
    in the model dtype (``c_kv`` history dequantized when quantized; the current tokens as given, in full precision).
    With ``max_length`` a graph step (or any step of a ``capturable`` cache) takes the static path of
    ``caches/capture.py``: T = ``max_length`` (HF's whole-buffer mask hides the slots not written), the device
    length as the MLA op's ``lengths``.
    """

    def __init__(self, spec: StoreSpec | None = None, *, chunk: int = 256, max_length: int | None = None):
        super().__init__(spec, chunk=chunk, max_length=max_length)

    def __repr__(self) -> str:
        return f"LatentLayer(c_kv bits={self.spec.bits}, seen={self.cumulative_length})"

    def value_spec(self) -> StoreSpec:
        """``k_pe`` is always kept plain, in the model dtype."""
        return StoreSpec()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cap = self._initial_capacity(key_states.shape[2])
        self.k_store = make_store(self.spec, key_states, cap)  # c_kv: (B, 1, cap, dc), maybe quantized
        self.v_store = make_store(self.value_spec(), value_states, cap)  # k_pe: (B, 1, cap, dr), model dtype
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True
        if self._static_format():  # max_length: fixed buffers, device length (caches/capture.py)
            self._init_static()

    @property
    def c_kv_store(self) -> TensorStore | None:
        return self.k_store

    @property
    def k_pe_store(self) -> TensorStore | None:
        return self.v_store

    @staticmethod
    def bytes_per_token(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype, spec: StoreSpec | None = None) -> int:
        """Exact bytes one token occupies at batch 1 (what the planner reports)."""
        spec = spec or StoreSpec()
        return spec.bytes_per_value_row(kv_lora_rank, dtype) + rope_dim * dtype.itemsize
