"""Pure tensor functions: grouped quantization, the KeyValueCache operator, sliding-window masks.

No state, no Hugging Face imports, no side effects at import.
"""

from kvslim.ops.kv_operator import (
    allocate_kv_cache,
    cache_shape,
    key_value_cache,
    scale_shape,
)
from kvslim.ops.masks import (
    compressed_true_size,
    swa_bool_mask,
    swa_compressed_mask,
    swa_mask,
)
from kvslim.ops.quant import (
    check_quant_args,
    codes_width,
    compute_scale,
    dequantize,
    pack_int4,
    qmax,
    quantize,
    quantize_with_scale,
    unpack_int4,
)

__all__ = [
    "allocate_kv_cache",
    "cache_shape",
    "check_quant_args",
    "codes_width",
    "compressed_true_size",
    "compute_scale",
    "dequantize",
    "key_value_cache",
    "pack_int4",
    "qmax",
    "quantize",
    "quantize_with_scale",
    "scale_shape",
    "swa_bool_mask",
    "swa_compressed_mask",
    "swa_mask",
    "unpack_int4",
]
