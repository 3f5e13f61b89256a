"""How a store keeps its values: :class:`StoreSpec` (the frozen format of one tensor family), its validation and
its exact bytes per row.

The store classes that hold codes under a spec live in :mod:`kvslim.caches.storage` (plain and grouped integer),
:mod:`kvslim.caches.turbo`, :mod:`kvslim.caches.residual` and :mod:`kvslim.caches.sink`; :mod:`kvslim.caches.stores`
picks one for a spec.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from ..ops.quant import check_quant_args
from ..ops.quant_formats import hadamard

MAX_RESIDUAL = 128


@dataclass(frozen=True)
class StoreSpec:
    """How a store keeps values: ``bits`` 0 (as is), 2, 4 or 8; the rest applies to quantized stores.

    * ``group_size``: values per scale along the head dimension (per-token groups, SPEC §1).
    * ``asymmetric``: min/max codes with a zero-point per group (``x ≈ q·scale + zero``) instead of SPEC §1's
      symmetric ``x ≈ q·scale``; ``scale_dtype`` holds scales and zero-points.
    * ``rotation``: ``"hadamard"`` keeps ``x·R`` (R the normalized D×D Hadamard matrix); reads return ``x``.
    * ``channel_group``: > 0 quantizes per channel over groups of this many tokens (KIVI keys) instead of
      per token over ``group_size`` channels; needs a ``residual`` of at least one group.
    * ``residual``: the most recent tokens (at most ``residual`` ≤ 128) stay in full precision; they are
      flushed into codes ``flush`` tokens at a time, once ``residual`` would be exceeded, and never re-quantized.
    * ``value_bits``: bits of the value store beside keys kept with this spec (``None``: ``bits``); the value
      store's own spec is :meth:`for_values`. A key spec with ``bits=3, value_bits=2`` keeps 3-bit keys and
      2-bit values (the ``int2`` default: 3.0 bits per element over K and V).
    * ``value_rotation``: the value store's rotation (``None``: ``rotation``; ``"none"``: no rotation, e.g. rotated
      keys with plain values). The ``int2`` default rotates values only.
    * ``sink``: the first ``sink`` tokens of the sequence (attention sinks) stay in full precision for good and
      are left out of every group's range (:class:`kvslim.caches.sink.SinkStore`); needs a ``residual`` window,
      and ``sink + residual`` ≤ 128 full-precision tokens in all.
    * ``codec``: ``"int"`` (the grouped integer codes above) or ``"turbo"`` (TurboQuant-class codes,
      :mod:`kvslim.ops.turbo`, :class:`kvslim.caches.turbo.TurboStore`: a seeded ``rotation`` — ``"hadamard"`` or
      ``"orthogonal"`` — then a Lloyd–Max codebook of N(0, 1) per coordinate and one ``scale_dtype`` scale per
      row; ``bits`` 2, 3 or 4; no groups, no zero-point). ``outliers`` (turbo keys only): that many key channels
      per head, fitted by the first write, coded apart at ``bits + 1``. ``center`` (turbo keys only): the channel
      means of the first write subtracted before the rotation and kept in fp32. ``seed``: the rotations' seed (turbo
      only; the value store's is ``seed + 1``). ``rope`` (turbo keys only): the model's RoPE inverse frequencies;
      keys are coded *before* RoPE (KVQuant's pre-RoPE keys): a row written at slot s is un-rotated by s's angles
      before coding and rotated back on read (:mod:`kvslim.caches.turbo`). ``rope_centred`` (with ``rope`` and
      ``center``): the keys stay post-RoPE; only the centring uses the table: the channel means μ are fitted before
      RoPE and a row at slot s is coded as ``k − RoPE_s(μ)`` (fusable: the decode adds ``q·RoPE_s(μ)`` per row).
      ``key_scales`` (turbo keys only): fixed per-head channel scales ``s`` (a tuple of H tuples of D positive
      finite floats, e.g. from ``kvslim.calibrate(model, ids, "turbo3")``): the (centred) key row is coded as
      ``s ⊙ k`` and read as ``k̂ / s``; the fused decode moves the query as ``q / s`` (the smoothing machinery with
      fixed factors; docs/quantization.md §13). Not with ``smooth``.
    * ``smooth`` (per-token keys only) divides each channel by a per-sequence, per-head factor before the
      grouped quantization and multiplies it back on read: ``sqrt(max_t |x[t, c]|)`` over the first write (the
      prefill), kept in fp32 (D values per head per sequence). Keys have outlier channels that otherwise set
      every group's scale. On SmolLM2 (256 tokens of the demo text, group 64): int4 keys alone +31 % perplexity
      without it; int4 keys and values +5.3 % with it (``kvslim demo``, full text: +6.2 %).
    """

    bits: int = 0
    group_size: int = 64
    scale_dtype: torch.dtype = torch.float32
    smooth: bool = False
    asymmetric: bool = False
    rotation: str | None = None
    channel_group: int = 0
    residual: int = 0
    flush: int = 1
    value_bits: int | None = None
    value_rotation: str | None = None
    sink: int = 0
    codec: str = "int"
    outliers: int = 0
    seed: int = 0
    center: bool = False
    rope: tuple[float, ...] | None = None
    rope_centred: bool = False
    key_scales: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        if self.codec not in ("int", "turbo"):
            raise ValueError(f"codec must be 'int' or 'turbo', got {self.codec!r}")
        if self.codec == "turbo":
            self._check_turbo()
            return
        if self.key_scales is not None:
            raise ValueError("key_scales are fixed channel scales of turbo keys (codec='turbo'): grouped integer "
                             "codes take none")
        if self.outliers or self.seed or self.center or self.rope is not None or self.rope_centred:
            raise ValueError(f"outliers, seed, center, rope and rope_centred are options of turbo codes "
                             f"(codec='turbo'), got outliers={self.outliers!r}, seed={self.seed!r}, "
                             f"center={self.center!r}, rope={'set' if self.rope is not None else None}, "
                             f"rope_centred={self.rope_centred!r}")
        if self.bits not in (0, 2, 3, 4, 8):
            raise ValueError(f"bits must be 0, 2, 3, 4 or 8, got {self.bits!r}")
        if self.value_bits is not None and (self.value_bits not in (2, 3, 4, 8) or not self.bits):
            raise ValueError(f"value_bits must be None (= bits) or 2, 3, 4 or 8 with bits > 0, got "
                             f"{self.value_bits!r}")
        if self.scale_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"scale_dtype must be float32, float16 or bfloat16, got {self.scale_dtype}")
        if not isinstance(self.asymmetric, bool):
            raise ValueError(f"asymmetric must be True or False, got {self.asymmetric!r}")
        if self.rotation not in (None, "hadamard"):
            raise ValueError(f"rotation must be None or 'hadamard', got {self.rotation!r}")
        if self.value_rotation not in (None, "none", "hadamard"):
            raise ValueError(f"value_rotation must be None (= rotation), 'none' or 'hadamard', got "
                             f"{self.value_rotation!r}")
        if not isinstance(self.group_size, int) or isinstance(self.group_size, bool) or self.group_size <= 0:
            raise ValueError(f"group_size must be a positive int, got {self.group_size!r}")
        for name in ("channel_group", "residual", "flush", "sink"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "flush" else 0):
                raise ValueError(f"{name} must be a{' positive' if name == 'flush' else ' non-negative'} int, "
                                 f"got {v!r}")
        if self.residual > MAX_RESIDUAL:
            raise ValueError(f"residual must be at most {MAX_RESIDUAL} tokens, got {self.residual}")
        if self.sink and not self.residual:
            raise ValueError(f"sink={self.sink} needs a residual window (residual > 0): sink tokens are kept beside it")
        if self.sink + self.residual > MAX_RESIDUAL:
            raise ValueError(f"sink + residual must be at most {MAX_RESIDUAL} full-precision tokens, got "
                             f"sink={self.sink} + residual={self.residual}")
        if self.channel_group:
            if self.residual < self.channel_group:
                raise ValueError(f"channel_group={self.channel_group} needs residual >= channel_group "
                                 f"(tokens wait in full precision until a group is complete), got {self.residual}")
            if self.flush % self.channel_group:
                raise ValueError(f"flush={self.flush} must be a multiple of channel_group={self.channel_group}")
        if self.residual and self.flush > self.residual:
            raise ValueError(f"flush={self.flush} must not exceed residual={self.residual}")
        if self.bits == 0 and (self.asymmetric or self.rotation or self.channel_group or self.residual
                               or self.value_rotation):
            raise ValueError("asymmetric, rotation, value_rotation, channel_group and residual need bits > 0")

    def _check_turbo(self) -> None:
        from ..ops.turbo import TURBO_BITS, TURBO_ROTATIONS

        if self.bits not in TURBO_BITS or isinstance(self.bits, bool):
            raise ValueError(f"bits must be 2, 3 or 4 for turbo codes, got {self.bits!r}")
        if self.value_bits is not None and self.value_bits not in TURBO_BITS:
            raise ValueError(f"value_bits must be None (= bits) or 2, 3 or 4 for turbo codes, got {self.value_bits!r}")
        if self.rotation not in TURBO_ROTATIONS:
            raise ValueError(f"rotation must be one of {TURBO_ROTATIONS} for turbo codes (the codebook assumes "
                             f"rotated coordinates), got {self.rotation!r}")
        if self.value_rotation not in (None, *TURBO_ROTATIONS):
            raise ValueError(f"value_rotation must be None (= rotation) or one of {TURBO_ROTATIONS} for turbo codes, "
                             f"got {self.value_rotation!r}")
        if not isinstance(self.center, bool):
            raise ValueError(f"center must be True or False, got {self.center!r}")
        if self.rope is not None and (not isinstance(self.rope, tuple) or not self.rope or not all(
                isinstance(f, float) and math.isfinite(f) and f > 0 for f in self.rope)):
            raise ValueError("rope must be None or a non-empty tuple of positive finite floats (RoPE inverse "
                             f"frequencies), got {self.rope!r}")
        if not isinstance(self.rope_centred, bool):
            raise ValueError(f"rope_centred must be True or False, got {self.rope_centred!r}")
        if self.rope_centred and (self.rope is None or not self.center):
            raise ValueError("rope_centred=True centres keys by their RoPE-turned channel means: it needs rope (the "
                             f"RoPE inverse frequencies) and center=True, got rope="
                             f"{'set' if self.rope is not None else None}, center={self.center!r}")
        if self.key_scales is not None:
            ks = self.key_scales
            if not (isinstance(ks, tuple) and ks and all(isinstance(r, tuple) and r and len(r) == len(ks[0])
                                                         for r in ks)):
                raise ValueError("key_scales must be None or a tuple of H equal-length tuples of floats (one per KV "
                                 f"head), got {type(ks).__name__}")
            if not all(isinstance(f, float) and math.isfinite(f) and f > 0 for r in ks for f in r):
                raise ValueError("key_scales must be positive finite floats")
            if self.smooth:
                raise ValueError("key_scales are fixed key channel factors: they replace smoothing (smooth=False)")
        if self.asymmetric or self.channel_group:
            raise ValueError("asymmetric and channel_group (KIVI keys) are options of the grouped integer codes, not "
                             "of turbo codes (one scale per row, no zero-point)")
        for name in ("outliers", "seed", "residual", "flush", "sink"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "flush" else 0):
                raise ValueError(f"{name} must be a{' positive' if name == 'flush' else ' non-negative'} int, "
                                 f"got {v!r}")
        if self.outliers and self.bits >= 4:
            raise ValueError(f"outliers={self.outliers} are coded at bits + 1 (at most 4): turbo keys of "
                             f"{self.bits} bits take outliers=0")
        if self.scale_dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"scale_dtype must be float32, float16 or bfloat16, got {self.scale_dtype}")
        if self.residual > MAX_RESIDUAL or self.sink + self.residual > MAX_RESIDUAL:
            raise ValueError(f"sink + residual must be at most {MAX_RESIDUAL} full-precision tokens, got "
                             f"sink={self.sink} + residual={self.residual}")
        if self.sink and not self.residual:
            raise ValueError(f"sink={self.sink} needs a residual window (residual > 0): sink tokens are kept beside it")
        if self.residual and self.flush > self.residual:
            raise ValueError(f"flush={self.flush} must not exceed residual={self.residual}")

    def turbo_parts(self, dim: int) -> tuple[tuple[int, int], ...]:
        """A turbo row's parts ``((width, bits), ...)``: the outlier channels at ``bits + 1``, then the rest."""
        parts = ((self.outliers, self.bits + 1), (dim - self.outliers, self.bits))
        return tuple(p for p in parts if p[0])

    def fixed_bytes(self, dim: int) -> int:
        """Bytes per sequence and head that do not grow with the tokens: key smoothing's fp32 factors, a turbo
        store's outlier permutation (int16 per channel) and channel means (fp32, ``center``)."""
        return dim * 4 * (bool(self.smooth) + bool(self.center)) + dim * 2 * bool(self.codec == "turbo" and self.outliers)

    def for_values(self) -> StoreSpec:
        """The spec of the value store beside keys kept with this spec: no smoothing, per-token groups. (Specs are
        frozen: the result is computed once per spec; a layer asks on every update.)"""
        return _values_spec(self)

    def check_dim(self, dim: int) -> None:
        """Raise ``ValueError`` naming the option when rows of ``dim`` values cannot be kept with this spec."""
        if self.bits == 0:
            return
        if self.codec == "turbo":
            self._check_turbo_dim(dim)
            return
        if self.bits in (4, 8):
            check_quant_args(dim, self.bits, self.group_size)
        elif not isinstance(self.group_size, int) or self.group_size <= 0 or dim % self.group_size:
            raise ValueError(f"group_size={self.group_size!r} must be a positive divisor of the head dimension {dim}")
        if self.bits == 3 and dim % 8:
            raise ValueError(f"bits=3 packs 8 values in 3 bytes; head dimension {dim} is not a multiple of 8")
        if self.bits != 3 and dim % (8 // self.bits):
            raise ValueError(f"bits={self.bits} packs {8 // self.bits} values per byte; head dimension {dim} is not "
                             "a multiple")
        if self.channel_group and dim % self.channel_group:
            raise ValueError(f"channel_group={self.channel_group} must divide the head dimension {dim} (scales of "
                             "a token group are laid out over its rows)")
        if self.rotation or self.value_rotation == "hadamard":
            try:
                hadamard(dim)
            except ValueError as e:
                name = "rotation" if self.rotation else "value_rotation"
                raise ValueError(f"{name}='hadamard': {e}") from None

    def _check_turbo_dim(self, dim: int) -> None:
        from ..ops.turbo import check_rotation, packable

        if not 0 <= self.outliers < dim:
            raise ValueError(f"outliers={self.outliers} must be below the head dimension {dim}")
        if self.key_scales is not None and len(self.key_scales[0]) != dim:
            raise ValueError(f"key_scales: rows of {len(self.key_scales[0])} scales, the head dimension is {dim}")
        if self.rope is not None and 2 * len(self.rope) > dim:
            raise ValueError(f"rope: {len(self.rope)} frequencies rotate {2 * len(self.rope)} channels, more than the "
                             f"head dimension {dim}")
        for width, bits in self.turbo_parts(dim):
            what = "outlier channels" if bits > self.bits else "channels"
            if not packable(width, bits):
                raise ValueError(f"outliers={self.outliers}: {width} {what} at {bits} bits do not fill whole bytes "
                                 f"({'8' if bits == 3 else 8 // bits} codes per {'3 bytes' if bits == 3 else 'byte'});"
                                 " take an outlier count that leaves multiples of 8")
            try:
                check_rotation(self.rotation, width)
            except ValueError as e:
                raise ValueError(f"{e} (head dimension {dim}, outliers={self.outliers})") from None

    def params_per_group(self) -> int:
        return 2 if self.asymmetric else 1

    def bytes_per_value_row(self, dim: int, dtype: torch.dtype) -> int:
        """Exact bytes of codes and scales (zero-points) per row of ``dim`` values (one token, one head), for
        tokens already flushed into codes (a channel-grouped store: averaged over a whole token group)."""
        if self.bits == 0:
            return dim * dtype.itemsize
        self.check_dim(dim)
        if self.codec == "turbo":
            parts = self.turbo_parts(dim)
            return sum(w * b // 8 for w, b in parts) + len(parts) * self.scale_dtype.itemsize
        groups = dim // self.channel_group if self.channel_group else dim // self.group_size
        return dim * self.bits // 8 + groups * self.params_per_group() * self.scale_dtype.itemsize

    def bits_per_element(self, dim: int, dtype: torch.dtype) -> float:
        """Stored bits per value of flushed tokens, codes plus scales and zero-points (residual excluded)."""
        return 8 * self.bytes_per_value_row(dim, dtype) / dim

    def flushed(self, tokens: int) -> int:
        """Tokens before the full-precision window after ``tokens`` appended tokens: the ``sink`` tokens (full
        precision) and the coded ones; the rest, at most ``residual``, wait in the window."""
        if not self.residual:
            return tokens
        if tokens <= self.sink:
            return tokens
        return self.sink + self.flush * -(-max(0, tokens - self.sink - self.residual) // self.flush)

    def describe(self) -> str:
        """Short name of the format, e.g. ``int4 asym g32 fp16 kivi-k32 hadamard r128``."""
        if self.bits == 0:
            return "plain"
        if self.codec == "turbo":
            parts = [f"turbo{self.bits}", self.rotation, str(self.scale_dtype).replace("torch.float", "fp")]
            if self.outliers:
                parts.append(f"o{self.outliers}@{self.bits + 1}")
        else:
            parts = [f"int{self.bits}", "asym" if self.asymmetric else "sym", f"g{self.group_size}",
                     str(self.scale_dtype).replace("torch.float", "fp").replace("torch.", "")]
            if self.channel_group:
                parts.append(f"kivi-k{self.channel_group}")
            if self.rotation:
                parts.append(self.rotation)
        if self.smooth:
            parts.append("smooth-k")
        if self.key_scales is not None:
            parts.append("scaled-k")
        if self.codec == "turbo" and self.rope_centred:
            parts.append("rope-centred-k")
        elif self.codec == "turbo":
            if self.center:
                parts.append("center-k")
            if self.rope is not None:
                parts.append("prerope-k")
        if self.residual:
            parts.append(f"r{self.residual}/{self.flush}")
        if self.sink:
            parts.append(f"sink{self.sink}")
        return " ".join(parts)


@functools.lru_cache(maxsize=256)
def _values_spec(spec: StoreSpec) -> StoreSpec:
    if spec.codec == "turbo":
        return replace(spec, bits=spec.value_bits or spec.bits, value_bits=None, smooth=False, value_rotation=None,
                       rotation=spec.value_rotation or spec.rotation, seed=spec.seed + 1, outliers=0, center=False, rope=None,
                       rope_centred=False, key_scales=None)
    rotation = spec.rotation if spec.value_rotation is None else spec.value_rotation
    return replace(spec, bits=spec.value_bits or spec.bits, value_bits=None, smooth=False, channel_group=0,
                   rotation=None if rotation == "none" else rotation, value_rotation=None)
