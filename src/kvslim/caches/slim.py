"""Single-tensor cache layers of slim attention (SPEC §3): one row of ``width`` values per token.

Stores: only K (``width = e``; memory factor 0.5 of K+V when e = d), K plus r conditioning coordinates
(``e + r``), only V (``e``), or only the layer input X (``d``). Plain or grouped int8/int4 along the row.
The storage itself is exact; what the attention rebuilds from it is exact only in exact arithmetic, and
its rounding is measured by the slim method's plan. Paper: Graef & Wasielewski 2025, "Slim attention".
"""

from __future__ import annotations

import torch

from .dense import AppendLayer
from .storage import StoreSpec
from .stores import make_store


class SlimLayer(AppendLayer):
    """Append-only layer keeping one (B, 1, capacity, width) store; grows like :class:`AppendLayer`.

    Writes go through :meth:`write` (the slim attention calls it directly); ``update`` is refused because a
    slim layer has no V (or no K) to return. For RoPE layers it also keeps each sequence's position offset
    (slot − position, B ints of bookkeeping like the sequence length, not cached data) so the attention can
    rotate stored keys for any left padding.
    """

    def __init__(self, technique: str, width: int, spec: StoreSpec | None = None, *, chunk: int = 256,
                 max_length: int | None = None):
        super().__init__(spec, chunk=chunk, max_length=max_length)
        if not isinstance(width, int) or width <= 0:
            raise ValueError(f"width must be a positive int, got {width!r}")
        self.technique, self.width = technique, width
        self.offsets: torch.Tensor | None = None  # (B,) long: slot − position per sequence
        #: whether any offset may be non-zero (host-side, read once when the offsets are set: no per-step sync)
        self.shifted = False
        #: (0-dim bool on the device) a decode step's position did not follow on (checked without a host read;
        #: refused by name at the next multi-token write, docs/gpu.md)
        self.position_jump: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"SlimLayer({self.technique}, width={self.width}, bits={self.spec.bits}, seen={self.cumulative_length})"

    def _static_format(self) -> bool:
        return False  # slim attention reads its rows up to the Python-int length (not capturable yet)

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(f"SlimLayer({self.technique}) stores one tensor per token and is filled by slim "
                           "attention; it was called by unpatched attention (apply the 'slim' method first)")

    def write(self, rows: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Append ``rows`` (B, S, width) as the next S tokens; ``position_ids`` (B or 1, S) their positions.

        Raises:
            ValueError: wrong shape/dtype, or positions that are not consecutive per sequence (the rotation
                of stored keys assumes position = slot − offset).
        """
        if rows.dim() != 3 or rows.shape[-1] != self.width:
            raise ValueError(f"rows must be (batch, seq, {self.width}), got {tuple(rows.shape)}")
        x = rows.unsqueeze(1)  # (B, 1, S, width)
        if not self.is_initialized:
            self.k_store = make_store(self.spec, x, self._initial_capacity(x.shape[2]))
            self.dtype, self.device = x.dtype, x.device
            self.is_initialized = True
        elif x.shape[0] != self.k_store.data.shape[0] or x.dtype != self.dtype:
            raise ValueError(f"rows must be batch {self.k_store.data.shape[0]} in {self.dtype}, got "
                             f"{tuple(rows.shape)} in {rows.dtype}")
        start, end = self.cumulative_length, self.cumulative_length + x.shape[2]
        if position_ids is not None:
            last = position_ids[:, -1].to(device=x.device, dtype=torch.long).expand(x.shape[0])
            offsets = (end - 1) - last
            if self.offsets is None or start == 0:
                self.offsets = offsets
                self.shifted = bool(offsets.any())  # a prefill: one host read
                self.position_jump = None
            elif x.shape[2] == 1:  # a decode step: checked on the device, read at the next host boundary
                jump = (offsets != self.offsets).any()
                if self.position_jump is None:
                    self.position_jump = jump
                else:
                    self.position_jump.logical_or_(jump)
            elif not torch.equal(offsets, self.offsets) or self._jumped():
                raise ValueError(self.JUMP)
        self._ensure_capacity(end)
        self.k_store.write(start, x)
        self.cumulative_length = end

    JUMP = ("slim attention with RoPE needs consecutive positions per sequence (position = slot − constant); got a "
            "jump in position_ids")

    def _jumped(self) -> bool:
        return self.position_jump is not None and bool(self.position_jump)

    def raise_deferred(self) -> None:
        """The checks decode steps made on the device, read (``KVSlimCache.check_finite``): inf/nan in a quantized
        store, a jump in position_ids."""
        super().raise_deferred()
        if self._jumped():
            raise ValueError(self.JUMP)

    def read(self) -> torch.Tensor:
        """All stored rows (B, n, width) in the model dtype (dequantized if quantized)."""
        return self.k_store.read(0, self.cumulative_length)[:, 0]

    def positions(self) -> torch.Tensor | None:
        """Positions (B, n) of the stored slots (clamped at 0 for left padding), or ``None`` if all start at 0."""
        if self.offsets is None or not self.shifted:
            return None
        slots = torch.arange(self.cumulative_length, device=self.offsets.device)
        return (slots[None, :] - self.offsets[:, None]).clamp_min(0)

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.offsets is not None:
            self.offsets = fn(self.offsets[:, None, None, None])[:, 0, 0, 0]

    def reset(self) -> None:
        super().reset()
        self.offsets, self.shifted, self.position_jump = None, False, None
