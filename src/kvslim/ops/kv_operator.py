"""The KeyValueCache operator (SPEC §1, seed 002): a functional, preallocated multi-layer KV cache.

Stores K and V of all layers in one tensor (two layouts), as the input dtype or as grouped symmetric
int8 / packed int4 codes with one scale per ``quant_group`` values (memory ≈ bits/16 of fp16 plus the
scales). Exact with ``quant_bit=0``; lossy otherwise (|error| <= scale/2 per value). Writes are index
writes at ``start_pos``; stored history is never re-quantized. Quantization is shared with
:mod:`kvslim.ops.quant`.
"""

from __future__ import annotations

import operator

import torch

from kvslim.ops.quant import check_quant_args, codes_width, dequantize, quantize

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPERATOR_SCALE_DTYPES = (torch.float32, torch.float16)
QUANT_BITS = (0, 4, 8)
CACHE_LAYOUTS = (0, 1)


def cache_shape(max_batch: int, num_layer: int, max_seq: int, num_heads: int, head_dim: int, *,
                quant_bit: int = 0, cache_layout: int = 0) -> tuple[int, ...]:
    """Shape of the cache tensor: layout 0 (MaxB, L, 2, MaxS, H, Dc), layout 1 (L, MaxB, 2, H, MaxS, Dc).

    ``Dc`` is ``head_dim`` for quant_bit 0 and 8, ``head_dim // 2`` for packed int4.
    """
    width = head_dim if quant_bit == 0 else codes_width(head_dim, quant_bit)
    return _layout_shape(max_batch, num_layer, max_seq, num_heads, width, cache_layout)


def scale_shape(max_batch: int, num_layer: int, max_seq: int, num_heads: int, head_dim: int, *,
                quant_group: int = 8, cache_layout: int = 0) -> tuple[int, ...]:
    """Shape of the scale tensor: the cache shape with last axis ``head_dim // quant_group``."""
    return _layout_shape(max_batch, num_layer, max_seq, num_heads, head_dim // quant_group, cache_layout)


def allocate_kv_cache(max_batch: int, num_layer: int, max_seq: int, num_heads: int, head_dim: int, *,
                      dtype: torch.dtype, quant_bit: int = 0, quant_group: int = 8,
                      scale_dtype: torch.dtype = torch.float32, cache_layout: int = 0,
                      device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero-filled ``(cache, scale)`` for :func:`key_value_cache`; ``scale`` is None when quant_bit is 0.

    Args:
        dtype: dtype of the K/V the cache will receive (the cache dtype when quant_bit is 0;
            int8 / uint8 are used for 8 / 4 bits).
        scale_dtype: float32 or float16 (ignored when quant_bit is 0).
    """
    for name, value in (("max_batch", max_batch), ("num_layer", num_layer), ("max_seq", max_seq),
                        ("num_heads", num_heads), ("head_dim", head_dim)):
        if _as_int(value, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {value!r}")
    quant_bit = _check_choice(quant_bit, "quant_bit", QUANT_BITS)
    cache_layout = _check_choice(cache_layout, "cache_layout", CACHE_LAYOUTS)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    dims = (max_batch, num_layer, max_seq, num_heads, head_dim)
    shape = cache_shape(*dims, quant_bit=quant_bit, cache_layout=cache_layout)
    if quant_bit == 0:
        return torch.zeros(shape, dtype=dtype, device=device), None
    check_quant_args(head_dim, quant_bit, quant_group, bits_name="quant_bit", group_name="quant_group")
    if scale_dtype not in OPERATOR_SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {OPERATOR_SCALE_DTYPES}, got {scale_dtype}")
    cache = torch.zeros(shape, dtype=_cache_dtype(quant_bit, dtype), device=device)
    scale = torch.zeros(scale_shape(*dims, quant_group=quant_group, cache_layout=cache_layout),
                        dtype=scale_dtype, device=device)
    return cache, scale


def key_value_cache(current_key: torch.Tensor, current_value: torch.Tensor,
                    start_pos: int | torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None = None,
                    *, num_layer: int = 1, layer_idx: int = 0, quant_bit: int = 0, quant_group: int = 8,
                    num_repeat: int = 1, cache_layout: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the current K/V at ``start_pos`` and return the layer's keys/values ``[0, start_pos + S)``.

    Args:
        current_key, current_value: (B, S, H, Dh), float32 / float16 / bfloat16, same shape and dtype.
        start_pos: int — every sequence writes at ``[start_pos, start_pos + S)``; or an integer tensor
            of shape (B,) — sequence ``b`` writes at ``[start_pos[b], start_pos[b] + S)`` ("dynamic
            batching"). Must satisfy ``0 <= start_pos`` and ``start_pos + S <= MaxS``.
        cache: layout 0 (MaxB, L, 2, MaxS, H, Dc), layout 1 (L, MaxB, 2, H, MaxS, Dc); index 0 of the
            "2" axis holds keys, 1 values. Dc = Dh and dtype = input dtype (quant_bit 0), Dc = Dh and
            int8 (8 bits), Dc = Dh/2 and uint8 with two codes per byte, low nibble first (4 bits).
            Modified in place.
        scale: cache shape with last axis Dh/quant_group, float32 or float16; required when
            quant_bit > 0 (modified in place), ignored when quant_bit is 0.
        num_layer: L, must match the cache. layer_idx: layer to access, in [0, L).
        quant_bit: 0 (store as is), 8 or 4. quant_group: values per scale (divides Dh; only checked
            when quant_bit > 0).
        num_repeat: GQA factor; each KV head is repeated ``num_repeat`` times consecutively.
        cache_layout: 0 or 1, see ``cache``.

    Returns:
        ``(key, value)``, each (B, T, H·num_repeat, Dh) in the input dtype, freshly allocated (never a
        view of the cache), with T = start_pos + S. For a tensor ``start_pos``, T = max(start_pos) + S
        and positions ``t >= start_pos[b] + S`` of sequence ``b`` are zeros.

    Raises:
        ValueError: naming the offending argument; nothing has been written when it is raised.
    """
    start, positions = _validate(current_key, current_value, start_pos, cache, scale, num_layer=num_layer,
                                 layer_idx=layer_idx, quant_bit=quant_bit, quant_group=quant_group,
                                 num_repeat=num_repeat, cache_layout=cache_layout)
    quant_bit, num_repeat, layer_idx, cache_layout = map(int, (quant_bit, num_repeat, layer_idx, cache_layout))
    quant_group = int(quant_group) if quant_bit else quant_group
    batch, seq = current_key.shape[:2]
    dtype = current_key.dtype
    cache_view = _layer_view(cache, layer_idx, batch, cache_layout)  # (B, 2, MaxS, H, Dc)
    scale_view = None if quant_bit == 0 else _layer_view(scale, layer_idx, batch, cache_layout)

    # --- write ---
    kv = torch.stack((current_key, current_value), dim=1)  # (B, 2, S, H, Dh)
    if quant_bit:
        codes, kv_scale = quantize(kv, quant_bit, quant_group, scale_dtype=scale.dtype)
    else:
        codes, kv_scale = kv, None
    if positions is None:
        total = start + seq
        cache_view[:, :, start:total] = codes
        if scale_view is not None:
            scale_view[:, :, start:total] = kv_scale
    else:
        total = int(positions.max()) + seq
        arange = torch.arange(seq, device=cache.device)
        b_idx = torch.arange(batch, device=cache.device).view(batch, 1, 1)  # (B, 1, 1)
        kv_idx = torch.arange(2, device=cache.device).view(1, 2, 1)  # (1, 2, 1)
        t_idx = (positions.view(batch, 1) + arange).unsqueeze(1)  # (B, 1, S)
        cache_view[b_idx, kv_idx, t_idx] = codes  # indices broadcast to (B, 2, S)
        if scale_view is not None:
            scale_view[b_idx, kv_idx, t_idx] = kv_scale

    # --- read ---
    outs = []
    for i in (0, 1):  # keys, values
        stored = cache_view[:, i, :total]  # (B, T, H, Dc)
        if quant_bit:
            x = dequantize(stored, scale_view[:, i, :total], quant_bit, quant_group, dtype)
        else:
            x = stored
        fresh = quant_bit != 0
        if positions is not None:
            lengths = (positions + seq).view(batch, 1)  # (B, 1)
            valid = torch.arange(total, device=cache.device).view(1, total) < lengths  # (B, T)
            x = torch.where(valid[:, :, None, None], x, torch.zeros((), dtype=dtype, device=x.device))
            fresh = True
        if num_repeat > 1:
            x = x.repeat_interleave(num_repeat, dim=2)  # (B, T, H·R, Dh)
        elif fresh:
            x = x.contiguous()
        else:
            x = x.clone(memory_format=torch.contiguous_format)
        outs.append(x)
    return outs[0], outs[1]


# ----------------------------------------------------------------------------------------------
# helpers

def _layout_shape(max_batch: int, num_layer: int, max_seq: int, num_heads: int, width: int,
                  cache_layout: int) -> tuple[int, ...]:
    if cache_layout == 0:
        return (max_batch, num_layer, 2, max_seq, num_heads, width)
    if cache_layout == 1:
        return (num_layer, max_batch, 2, num_heads, max_seq, width)
    raise ValueError(f"cache_layout must be 0 or 1, got {cache_layout!r}")


def _layer_view(t: torch.Tensor, layer_idx: int, batch: int, cache_layout: int) -> torch.Tensor:
    """(B, 2, MaxS, H, X) view of one layer's first ``batch`` sequences, whatever the layout."""
    if cache_layout == 0:
        return t[:batch, layer_idx]  # (B, 2, MaxS, H, X)
    return t[layer_idx, :batch].transpose(2, 3)  # (B, 2, H, MaxS, X) -> (B, 2, MaxS, H, X)


def _cache_dtype(quant_bit: int, dtype: torch.dtype) -> torch.dtype:
    return {0: dtype, 8: torch.int8, 4: torch.uint8}[quant_bit]


def _as_int(value: object, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {value!r}") from None


def _check_choice(value: object, name: str, choices: tuple[int, ...]) -> int:
    try:
        ok = _as_int(value, name) in choices
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return operator.index(value)


def _normalize_start_pos(start_pos: object, batch: int, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """Return (min start, per-sequence positions or None). Raises ValueError naming ``start_pos``."""
    if isinstance(start_pos, torch.Tensor):
        if start_pos.dtype.is_floating_point or start_pos.dtype.is_complex or start_pos.dtype == torch.bool:
            raise ValueError(f"start_pos tensor must have an integer dtype, got {start_pos.dtype}")
        if start_pos.dim() == 0:
            return int(start_pos), None
        if start_pos.shape != (batch,):
            raise ValueError(f"start_pos tensor must have shape (B,) = ({batch},), got {tuple(start_pos.shape)}")
        positions = start_pos.to(device=device, dtype=torch.long)
        return int(positions.min()), positions
    return _as_int(start_pos, "start_pos"), None


def _validate(current_key: torch.Tensor, current_value: torch.Tensor, start_pos: object,
              cache: torch.Tensor, scale: torch.Tensor | None, *, num_layer: int, layer_idx: int,
              quant_bit: int, quant_group: int, num_repeat: int,
              cache_layout: int) -> tuple[int, torch.Tensor | None]:
    """Check every argument before anything is written; return the normalized start position(s)."""
    quant_bit = _check_choice(quant_bit, "quant_bit", QUANT_BITS)
    cache_layout = _check_choice(cache_layout, "cache_layout", CACHE_LAYOUTS)
    if _as_int(num_layer, "num_layer") < 1:
        raise ValueError(f"num_layer must be >= 1, got {num_layer!r}")
    if not 0 <= _as_int(layer_idx, "layer_idx") < num_layer:
        raise ValueError(f"layer_idx must be in [0, num_layer={num_layer}), got {layer_idx!r}")
    if _as_int(num_repeat, "num_repeat") < 1:
        raise ValueError(f"num_repeat must be >= 1, got {num_repeat!r}")

    for name, t in (("current_key", current_key), ("current_value", current_value)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if current_key.dim() != 4:
        raise ValueError(f"current_key must be 4-D (B, S, H, Dh), got shape {tuple(current_key.shape)}")
    if current_key.dtype not in FLOAT_DTYPES:
        raise ValueError(f"current_key dtype must be one of {FLOAT_DTYPES}, got {current_key.dtype}")
    if current_value.shape != current_key.shape:
        raise ValueError(f"current_value shape {tuple(current_value.shape)} must equal current_key shape "
                         f"{tuple(current_key.shape)}")
    if current_value.dtype != current_key.dtype:
        raise ValueError(f"current_value dtype {current_value.dtype} must equal current_key dtype "
                         f"{current_key.dtype}")
    if current_value.device != current_key.device:
        raise ValueError(f"current_value is on {current_value.device}, current_key on {current_key.device}")
    batch, seq, heads, head_dim = current_key.shape
    if batch < 1 or heads < 1 or head_dim < 1:
        raise ValueError(f"current_key needs B, H, Dh >= 1, got shape {tuple(current_key.shape)}")
    if quant_bit:
        _as_int(quant_group, "quant_group")
        check_quant_args(head_dim, quant_bit, quant_group, bits_name="quant_bit", group_name="quant_group")

    if not isinstance(cache, torch.Tensor):
        raise ValueError(f"cache must be a torch.Tensor, got {type(cache).__name__}")
    if cache.device != current_key.device:
        raise ValueError(f"cache is on {cache.device} but current_key is on {current_key.device}")
    want_dtype = _cache_dtype(quant_bit, current_key.dtype)
    if cache.dtype != want_dtype:
        raise ValueError(f"cache dtype must be {want_dtype} for quant_bit={quant_bit} and "
                         f"{current_key.dtype} input, got {cache.dtype}")
    axes = "(MaxB, L, 2, MaxS, H, Dc)" if cache_layout == 0 else "(L, MaxB, 2, H, MaxS, Dc)"
    if cache.dim() != 6:
        raise ValueError(f"cache must be 6-D {axes} for cache_layout={cache_layout}, "
                         f"got shape {tuple(cache.shape)}")
    if cache_layout == 0:
        max_batch, cache_layers, two, max_seq, cache_heads, width = cache.shape
    else:
        cache_layers, max_batch, two, cache_heads, max_seq, width = cache.shape
    if cache_layers != num_layer:
        raise ValueError(f"num_layer={num_layer} does not match the cache's layer axis ({cache_layers}) "
                         f"of shape {tuple(cache.shape)} {axes}")
    want = cache_shape(max_batch, num_layer, max_seq, heads, head_dim, quant_bit=quant_bit,
                       cache_layout=cache_layout)
    if tuple(cache.shape) != want:
        raise ValueError(f"cache shape must be {want} {axes} for H={heads}, Dh={head_dim}, "
                         f"quant_bit={quant_bit}, got {tuple(cache.shape)}")
    if batch > max_batch:
        raise ValueError(f"current_key batch B={batch} exceeds the cache's max batch {max_batch}")

    start, positions = _normalize_start_pos(start_pos, batch, cache.device)
    if start < 0:
        raise ValueError(f"start_pos must be >= 0, got {start}")
    end = start + seq if positions is None else int(positions.max()) + seq
    if end > max_seq:
        raise ValueError(f"start_pos + S = {end} exceeds the cache's max sequence length MaxS={max_seq}")

    if quant_bit:
        if scale is None:
            raise ValueError(f"scale is required when quant_bit={quant_bit}")
        if not isinstance(scale, torch.Tensor):
            raise ValueError(f"scale must be a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype not in OPERATOR_SCALE_DTYPES:
            raise ValueError(f"scale dtype must be one of {OPERATOR_SCALE_DTYPES}, got {scale.dtype}")
        if scale.device != cache.device:
            raise ValueError(f"scale is on {scale.device} but cache is on {cache.device}")
        want = scale_shape(max_batch, num_layer, max_seq, heads, head_dim, quant_group=quant_group,
                           cache_layout=cache_layout)
        if tuple(scale.shape) != want:
            raise ValueError(f"scale shape must be {want} (the cache shape with last axis "
                             f"Dh/quant_group = {head_dim // quant_group}), got {tuple(scale.shape)}")
    return start, positions
