"""Single-tensor cache layers of slim attention (SPEC §3): one row of ``width`` values per token.

Stores: only K (``width = e``; memory factor 0.5 of K+V when e = d), K plus r conditioning coordinates
(``e + r``), only V (``e``), or only the layer input X (``d``). Plain or grouped int8/int4 along the row.
The storage itself is exact; what the attention rebuilds from it is exact only in exact arithmetic, and
its rounding is measured by the slim method's plan. Paper: Graef & Wasielewski 2025, "Slim attention".
"""

from __future__ import annotations

import torch

from .capture import graph_step
from .dense import AppendLayer
from .spec import StoreSpec
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
        self.rope_rows: int | None = None  # static path: RoPE table rows its positions need (set at prefill)
        #: whether the first write ran eagerly (``None`` before it): the static path needs an eager prefill (its
        #: offsets and the RoPE span are read on the host); a layer first written inside a graph keeps the old path
        self.eager_prefill: bool | None = None

    def __repr__(self) -> str:
        return f"SlimLayer({self.technique}, width={self.width}, bits={self.spec.bits}, seen={self.cumulative_length})"

    def _static_format(self) -> bool:
        return super()._static_format() and self.eager_prefill is not False

    def update(self, key_states, value_states, *args, **kwargs):
        raise RuntimeError(f"SlimLayer({self.technique}) stores one tensor per token and is filled by slim "
                           "attention; it was called by unpatched attention (apply the 'slim' method first)")

    def _init_static(self) -> None:
        """With ``max_length`` (``caches/capture.py``): besides the zeroed rows and the device length, the offsets
        and the position-jump flag live in tensors of their own that graph steps update in place."""
        super()._init_static()
        b = self.k_store.data.shape[0]
        self.offsets = torch.zeros(b, dtype=torch.long, device=self.device)
        self.position_jump = torch.zeros((), dtype=torch.bool, device=self.device)
        self.rope_rows = self.max_length
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.offsets)
            torch._dynamo.mark_static_address(self.position_jump)

    def write(self, rows: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        """Append ``rows`` (B, S, width) as the next S tokens; ``position_ids`` (B or 1, S) their positions.

        With ``max_length`` a graph step (or any step of a ``capturable`` cache) writes at the device length
        (``caches/capture.py``: nothing is written past ``max_length``).

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
            self.eager_prefill = not graph_step()
            if self._static_format():
                self._init_static()
        elif x.shape[0] != self.k_store.data.shape[0] or x.dtype != self.dtype:
            raise ValueError(f"rows must be batch {self.k_store.data.shape[0]} in {self.dtype}, got "
                             f"{tuple(rows.shape)} in {rows.dtype}")
        s = x.shape[2]
        if self._static_now():
            in_graph = graph_step()
            old, pos, keep = self._claim(s, in_graph)
            if position_ids is not None:
                self._track_offsets(None if in_graph else int(self.cumulative_length) - s, old[:1] + s, s,
                                    position_ids, x)
            self.k_store.write_at(pos, x, keep)
            return
        self._sync_host()
        start, end = self.cumulative_length, self.cumulative_length + s
        if position_ids is not None:
            self._track_offsets(start, end, s, position_ids, x)
        self._ensure_capacity(end)
        self.k_store.write(start, x)
        self.cumulative_length = end
        self._note_length()

    def _track_offsets(self, start: int | None, end, s: int, position_ids: torch.Tensor, x: torch.Tensor) -> None:
        """Offsets (slot − position) of a write ending at slot ``end`` (an int, or a (1,) device tensor in a graph
        step, where ``start`` is ``None``): set by a prefill (one host read: whether any is non-zero), checked on the
        device by a decode step, checked at once by any other multi-token write."""
        last = position_ids[:, -1].to(device=x.device, dtype=torch.long).expand(x.shape[0])
        offsets = (end - 1) - last
        static = self.length_t is not None
        if start == 0 or (self.offsets is None and start is not None):
            if static:
                self.offsets.copy_(offsets)
                self.position_jump.zero_()
                # RoPE table rows the whole buffer needs (positions = slot − offset, host read at prefill only)
                self.rope_rows = self.max_length - min(0, int(offsets.min()))
            else:
                self.offsets, self.position_jump = offsets, None
            self.shifted = bool(offsets.any())  # a prefill: one host read
        elif s == 1:  # a decode step: checked on the device, read at the next host boundary
            jump = (offsets != self.offsets).any()
            if self.position_jump is None:
                self.position_jump = jump
            else:
                self.position_jump.logical_or_(jump)
        elif not torch.equal(offsets, self.offsets) or self._jumped():
            raise ValueError(self.JUMP)

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
        """All stored rows (B, n, width) in the model dtype (dequantized if quantized); on the static path the whole
        buffer (n = ``max_length``; rows past :meth:`lengths` hold zeros or stale finite rows, masked)."""
        return self.k_store.read(0, self.max_length if self._static_now() else self.cumulative_length)[:, 0]

    def lengths(self) -> torch.Tensor | None:
        """(B,) rows written per sequence on the static path (the device length, this step's row included; the
        slim kernels read no row past it), else ``None``."""
        return self.length_t if self._static_now() else None

    def is_empty(self) -> bool:
        """Whether this layer holds no tokens. In a graph step (no host read): whether it was never written, so a
        capturable slim cache must be prefilled eagerly (as HF's ``generate`` does)."""
        if graph_step() and self._static_format():
            return not self.is_initialized
        return self.get_seq_length() == 0

    def positions(self) -> torch.Tensor | None:
        """Positions (B, n) of the stored slots (clamped at 0 for left padding), or ``None`` if all start at 0."""
        if self.offsets is None or not self.shifted:
            return None
        n = self.max_length if self._static_now() else self.cumulative_length
        slots = torch.arange(n, device=self.offsets.device)
        return (slots[None, :] - self.offsets[:, None]).clamp_min(0)

    def rope_table_rows(self) -> int | None:
        """RoPE table rows the static path's positions need (a host int fixed at prefill), else ``None``."""
        return self.rope_rows if self._static_now() else None

    def _map_batch(self, fn) -> None:
        super()._map_batch(fn)
        if self.offsets is not None:
            self.offsets = fn(self.offsets[:, None, None, None])[:, 0, 0, 0]

    def reset(self) -> None:
        super().reset()
        self.shifted = False
        if self.length_t is None:
            self.offsets, self.position_jump = None, None
        else:  # graph steps update them in place: kept allocated
            self.offsets.zero_()
            self.position_jump.zero_()
