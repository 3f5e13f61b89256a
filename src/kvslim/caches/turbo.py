"""The store of TurboQuant-class codes (``StoreSpec(codec="turbo")``; formats in :mod:`kvslim.ops.turbo`).

Per token and head, the row of D values is split into ``outliers`` channels (coded at ``bits + 1``) and the other
``D − outliers`` (at ``bits``); each part is rotated by its own seeded orthogonal matrix and coded with the
Lloyd–Max codebook of N(0, 1), one scale per part and row. Which channels are outliers is fitted per sequence and
head by the store's first write (the largest mean squares: a prefill's channels, as key smoothing is fitted) and
kept as a permutation, D int16 per head (``perm``: outliers first, then the rest, each ascending).

With ``spec.rope`` (pre-RoPE keys, KVQuant's lever) a key row written at slot s is un-rotated by RoPE's angles of
position ``s + position_offset`` before anything else (centring, outliers, codes: all in the pre-RoPE basis, where
a channel's offset is the same for every token) and rotated back on read. The slot stands for the position: exact
for one unpadded sequence (``position_offset``: the sink tokens in front of a :class:`~kvslim.caches.sink.SinkStore`'s
coded part); with left padding every row of a sequence is off by the same angle (its pad count), a fixed
orthogonal change of basis that the read undoes, so the codes stay consistent. Such keys are not fused
(``caches/fused.fusable``): RoPE of each decoded row belongs inside the kernel.

With ``spec.rope_centred`` (RoPE-centred keys) only the centring uses the table: the channel means μ of the first
write are fitted before RoPE (as above), a key at slot s is coded *after* RoPE as the residual ``k − RoPE_s(μ)``
(outliers, rotations and codes as usual, in one post-RoPE basis) and read as ``RoPE_s(μ) + residual``. Positions and
padding as for pre-RoPE keys (with left padding the fitted μ is the true one turned by the pad count, and
``RoPE_s`` of it is the true row's offset). Fusable: a query's score against slot s gains the bias
``q·RoPE_s(μ)`` (:meth:`TurboStore.bias_factors`, inputs of the decode op), the window is not centred.

Layout per row: ``data`` (B, H, capacity, bytes) = the outliers' packed codes, then the rest's (kvslim's packing,
``ops/quant_formats.pack_codes``); ``scale`` (B, H, capacity, parts) in ``scale_dtype``.

``spec.key_scales`` (fixed per-head channel scales s, calibrated: ``kvslim.calibrate(model, ids, "turbo3")``) take
the smoothing factors' place as ``channel = 1 / s``, shared by every sequence: the (centred) row is coded as
``s ⊙ k`` (the outlier channels are then fitted on the scaled row), read as ``k̂ / s``, the query moved as ``q / s``
by the same kept matrix; like the rotations they are the plan's parameters, not bytes of the sequence. The fused decode op
(``kernels/turbo_decode.py``) reads the codes; the full-precision window goes in through :meth:`to_coded_basis`
(``caches/fused.turbo_tail``, one new row per decode step).
"""

from __future__ import annotations

import functools

import torch

from ..ops import turbo
from ..ops.rope import rotate, unrotate
from ..ops.rope import table as rope_table
from .spec import StoreSpec
from .storage import ScratchPool, TensorStore, _kept, check_finite


class TurboStore(TensorStore):
    """Turbo codes of rows (B, H, capacity, D), quantized once at write time (see the module docstring)."""

    def __init__(self, spec: StoreSpec, batch: int, heads: int, capacity: int, dim: int,
                 dtype: torch.dtype, device: torch.device):
        spec.check_dim(dim)
        self.spec, self.dtype, self.dim = spec, dtype, dim
        self.parts = spec.turbo_parts(dim)  # ((width, bits), ...): outliers first
        nbytes = sum(w * b // 8 for w, b in self.parts)
        self.data = torch.empty(batch, heads, capacity, nbytes, dtype=torch.uint8, device=device)
        self.scale = torch.empty(batch, heads, capacity, len(self.parts), dtype=spec.scale_dtype, device=device)
        self.rotations = [turbo.rotation_matrix(spec.rotation, w, 4 * spec.seed + j).to(device)
                          for j, (w, _) in enumerate(self.parts)]
        self.perm: torch.Tensor | None = None  # (B, H, D) int16, fitted by the first write (outliers only)
        self.channel: torch.Tensor | None = None  # (B, H, 1, D) fp32 key smoothing, fitted by the first write
        self.fixed_channel = None  # (1, H, 1, D) fp32 1 / spec.key_scales: fixed factors in smoothing's place
        if spec.key_scales is not None:
            if len(spec.key_scales) != heads:
                raise ValueError(f"key_scales: {len(spec.key_scales)} rows of scales for {heads} KV heads")
            s = torch.tensor(spec.key_scales, dtype=torch.float64, device=device)
            self.fixed_channel = (1.0 / s).float()[None, :, None, :].contiguous()
            self.channel = self.fixed_channel
        self.mean: torch.Tensor | None = None  # (B, H, 1, D) fp32 channel means (``center``), fitted by the first write
        self.position_offset = 0  # position of slot 0 (RoPE table; make_store sets it behind sinks)
        self._inv_freq = None if spec.rope is None else torch.tensor(spec.rope, dtype=torch.float32, device=device)
        self._prerope = spec.rope is not None and not spec.rope_centred  # codes before RoPE (else: post-RoPE codes)
        self._matrices: dict = {}  # query / key basis moves (_moves), keyed by the fitted tensors they come from
        self.tables = [turbo.level_tables(b, device) for _, b in self.parts]  # each part's codebook, kept
        self.frozen: dict | None = None  # _moves once fitted (fixed until a reset or reorder): no lookup per step
        self.kept_rows: torch.Tensor | None = None  # bias_rows of the capacity, once fitted (RoPE-centred keys)
        if self.fitted:
            self._freeze()

    def _slots(self, start: int, end: int) -> torch.Tensor:
        return torch.arange(start, end, device=self.data.device)

    def _rope_table(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (S, 2·len(rope)) of ``slots`` (S,) int64 (host ranges or device positions alike), computed as
        HF's rotary embedding does (fp32 position × inverse frequency, both halves)."""
        return rope_table(self._inv_freq, slots + self.position_offset)

    def _rope_mean(self, slots: torch.Tensor) -> torch.Tensor:
        """``RoPE_s(μ)`` (B, H, S, D) fp32 for ``slots`` (S,) (RoPE-centred keys)."""
        m = self.mean
        return rotate(m.expand(*m.shape[:2], slots.shape[0], m.shape[-1]), *self._rope_table(slots))

    def _as_coded(self, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rows written at ``slots`` (S,) int64, in the basis the codes see before centring: un-rotated (pre-RoPE
        keys), or less ``RoPE_s(μ)`` (RoPE-centred keys: μ fitted here, before RoPE, on the first write)."""
        if self._prerope:
            return unrotate(x.float(), *self._rope_table(slots))
        if not self.spec.rope_centred:
            return x
        if self.mean is None:
            self.mean = unrotate(x.float(), *self._rope_table(slots)).mean(dim=2, keepdim=True)
        return x.float() - self._rope_mean(slots)

    @property
    def fitted(self) -> bool:
        """Whether everything the first write fits (channel means, smoothing factors, outlier channels) is fitted:
        later writes only code (``write_at`` in a compiled step needs it)."""
        sp = self.spec
        return not ((sp.center and self.mean is None) or (sp.smooth and self.channel is None)
                    or (sp.outliers and self.perm is None))

    def fit(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        """Fit what the first write fits on rows ``x`` (B, H, S, D) at ``slots`` (S,), writing nothing (a capturable
        layer fits in its eager prefill, ``caches/capture_residual.py``); no-op once fitted."""
        if not self.fitted:
            self._fit(self._as_coded(slots, x))
            self._freeze()

    def _freeze(self) -> None:
        """Once fitted: both basis moves and (RoPE-centred keys) the bias rows of the whole capacity, computed now
        (eagerly) and kept until a reset or reorder, so that a compiled step only reads them."""
        self.frozen = None
        self.frozen = {query: self._moves(query) for query in (True, False)}
        if self.spec.rope_centred and self.mean is not None:
            width = self._bias_matrix().shape[-1]
            self.kept_rows = rope_cos_sin(self.spec.rope, self.position_offset, self.capacity, self.data.device,
                                          width)

    def frozen_tensors(self) -> list[torch.Tensor]:
        """What a compiled step reads besides the codes (fitted parameters, kept moves and rows): their addresses
        are marked static by a capturable layer."""
        out = [t for t in (self.mean, self.channel, self.perm, self.kept_rows) if t is not None]
        return out + ([] if self.frozen is None else list(self.frozen.values())) + self.rotations \
            + [t for pair in self.tables for t in pair]

    def bias_rows(self, n: int, width: int) -> torch.Tensor:
        """:func:`rope_cos_sin` of slots [0, n) (kept rows when they cover them)."""
        kept = self.kept_rows
        if kept is not None and kept.shape[0] >= n and kept.shape[1] == width:
            return kept[:n]
        return rope_cos_sin(self.spec.rope, self.position_offset, n, self.data.device, width)

    def bias_factors(self, q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """RoPE-centred keys: the score term ``q·RoPE_s(μ)`` of slots [0, n) that the residual codes leave out,
        factored as ``ab (B, H, G, W) · rows (n, W)ᵀ`` for queries ``q`` (B, H, G, D) (the model's basis). With h
        RoPE frequencies θ it is ``a·cos(sθ) + b·sin(sθ)`` with ``a = q₁μ₁ + q₂μ₂``, ``b = q₂μ₁ − q₁μ₂`` (halves of h
        channels), linear in q (``ab = q·A``, :meth:`_bias_matrix`): ``rows`` is one table ``[cos | sin]`` of the
        slots' positions (:func:`rope_cos_sin`, shared by every layer, sequence and head), W = 2h; with partial
        rotary the unturned channels' ``q·μ`` rides on a column of ones (W rounded up to a multiple of 8). ``None``
        for other keys or before the first coded write."""
        if not self.spec.rope_centred or self.mean is None:
            return None
        a = self._bias_matrix()
        return q.float() @ a, rope_cos_sin(self.spec.rope, self.position_offset, n, q.device, a.shape[-1])

    def _bias_matrix(self) -> torch.Tensor:
        """(B, H, D, W) fp32 A with ``q·A = ab`` of :meth:`bias_factors` (built from the fitted means)."""
        m = self.mean[:, :, 0]  # (B, H, D)
        h, d = self._inv_freq.shape[0], m.shape[-1]
        width = 2 * h if d == 2 * h else -(-(2 * h + 1) // 8) * 8
        a = m.new_zeros(*m.shape[:2], d, width)
        i = torch.arange(h, device=m.device)
        a[:, :, i, i], a[:, :, i + h, i] = m[..., :h], m[..., h:2 * h]  # a = q₁μ₁ + q₂μ₂
        a[:, :, i + h, i + h], a[:, :, i, i + h] = m[..., :h], -m[..., h:2 * h]  # b = q₂μ₁ − q₁μ₂
        if width > 2 * h:  # the unturned channels' q·μ
            a[:, :, 2 * h:, 2 * h] = m[..., 2 * h:]
        return a

    def _moves(self, query: bool) -> torch.Tensor:
        """(B|1, H|1, D, D [+ W]) fp32 M with ``x·M`` = :meth:`to_coded_basis` of centred rows (``query``: of a query,
        then its bias factors for RoPE-centred keys): smoothing, the outlier permutation and the part rotations in
        one matrix, kept until the fitted permutation, factors or means change."""
        if self.frozen is not None:
            return self.frozen[query]
        key = (query, self.perm, self.channel, self.mean)
        saved = self._matrices.get(query)
        if saved is not None and all(a is b for a, b in zip(saved[0], key)):
            return saved[1]
        bd = torch.block_diag(*self.rotations) if len(self.rotations) > 1 else self.rotations[0]  # (D, D)
        d = bd.shape[0]
        if self.perm is None:
            m = bd[None, None]
        else:  # row perm[i] of M is row i of the block-diagonal rotation
            b, h = self.perm.shape[:2]
            m = bd.new_zeros(b, h, d, d).scatter_(2, self.perm.long()[..., None].expand(b, h, d, d),
                                                  bd.expand(b, h, d, d))
        if self.channel is not None:
            c = self.channel[:, :, 0, :, None]  # (B, H, D, 1)
            m = m * c if query else m / c
        if query and self.spec.rope_centred and self.mean is not None:
            m = torch.cat((m.expand(*self.mean.shape[:2], d, d), self._bias_matrix()), dim=-1)
        self._matrices[query] = (key, m.contiguous())
        return self._matrices[query][1]

    def move_query(self, q: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A decode query (B, H, G, D) in the coded basis (``to_coded_basis(q, scale_by_channel=True)``) and, for
        RoPE-centred keys, its :meth:`bias_factors` over the ``n`` coded slots: one product with a kept matrix."""
        d = q.shape[-1]
        out = q.float() @ self._moves(True)
        if out.shape[-1] == d:
            return out, None
        return out[..., :d], out[..., d:]

    def score_bias(self, q: torch.Tensor, n: int) -> torch.Tensor | None:
        """:meth:`bias_factors` multiplied out: (B, H, G, n) fp32, or ``None``."""
        f = self.bias_factors(q, n)
        return None if f is None else f[0] @ f[1].T

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.data, self.scale = tensors

    def _fit(self, x: torch.Tensor) -> None:
        """Key smoothing factors and the outlier permutation, from the first write (``x``: (B, H, S, D))."""
        if self.spec.center and self.mean is None and not self.spec.rope_centred:
            self.mean = x.detach().float().mean(dim=2, keepdim=True)
        if self.spec.smooth and self.channel is None:
            amax = self._centered(x).abs().amax(dim=2, keepdim=True)
            floor = amax.amax(dim=-1, keepdim=True) * 1e-3 + torch.finfo(torch.float32).tiny
            self.channel = torch.maximum(amax, floor).sqrt()
        if self.spec.outliers and self.perm is None:
            z = self._centered(x) if self.channel is None else self._centered(x) / self.channel
            ms = z.pow(2).mean(dim=2)  # (B, H, D)
            top = ms.topk(self.spec.outliers, dim=-1).indices.sort(dim=-1).values
            rest = torch.ones_like(ms, dtype=torch.bool).scatter_(-1, top, False)
            others = rest.nonzero()[:, -1].view(*ms.shape[:2], -1)  # ascending per (b, h)
            self.perm = torch.cat((top, others), dim=-1).to(torch.int16)

    def _centered(self, x: torch.Tensor) -> torch.Tensor:
        if self.mean is None or self.spec.rope_centred:  # RoPE-centred rows come in centred (_as_coded)
            return x.float()
        return x.float() - self.mean

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self._centered(x) if self.channel is None else self._centered(x) / self.channel
        if self.perm is not None:
            z = z.gather(-1, self.perm.long()[:, :, None, :].expand(z.shape))
        codes, scales, at = [], [], 0
        for j, ((w, b), rot) in enumerate(zip(self.parts, self.rotations)):
            q, s = turbo.encode(z[..., at:at + w], b, rot, self.spec.scale_dtype, tables=self.tables[j])
            codes.append(turbo.pack(q, b))
            scales.append(s)
            at += w
        return torch.cat(codes, dim=-1), torch.cat(scales, dim=-1)

    def _decode(self, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """fp32 rows from codes: un-rotated, un-permuted, un-smoothed, the plain centring's means added back."""
        parts, at = [], 0
        for j, ((w, b), rot) in enumerate(zip(self.parts, self.rotations)):
            n = w * b // 8
            q = turbo.unpack(codes[..., at:at + n], b)
            parts.append(turbo.decode(q, scale[..., j:j + 1], b, rot, self.tables[j]))
            at += n
        z = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        if self.perm is not None:
            z = torch.empty_like(z).scatter_(-1, self.perm.long()[:, :, None, :].expand(z.shape), z)
        if self.channel is not None:
            z = z * self.channel
        if self.mean is not None and not self.spec.rope_centred:
            z = z + self.mean
        return z

    def to_coded_basis(self, x: torch.Tensor, scale_by_channel: bool = False) -> torch.Tensor:
        """fp32 ``x`` (B, H, S, D) in the basis the codes live in: divided by the smoothing factors (a query:
        ``scale_by_channel``, multiplied, so that ``q·k = (q ⊙ c)·(k / c)``), permuted (outliers first), each
        part rotated. A query times a coded row there is the query times the decoded row. Not for pre-RoPE keys
        (``spec.rope``: each row's RoPE differs, no one basis); RoPE-centred keys: not centred (the coded rows'
        scores take :meth:`score_bias`)."""
        if self._prerope:
            raise ValueError("to_coded_basis: pre-RoPE keys (spec.rope) have no single coded basis; read the rows")
        z = x.float() if scale_by_channel else self._centered(x)  # keys centered; a query is not
        if self.perm is None and self.channel is None and len(self.rotations) == 1:  # (a shift of every key's
            return z @ self.rotations[0]                                                # score by q·mean: same softmax)
        return (z @ self._moves(scale_by_channel))[..., :x.shape[-1]]

    def write(self, start: int, x: torch.Tensor, *, checked: bool = False) -> None:
        """Code ``x`` (B, H, S, D) into slots [start, start+S); ``ValueError`` on inf/nan, nothing written."""
        if not checked:
            check_finite(x, self)
        fitted = self.fitted
        x = self._as_coded(self._slots(start, start + x.shape[2]), x)
        self._fit(x)
        if not fitted:
            self._freeze()
        codes, scale = self._encode(x)
        self.data[:, :, start:start + x.shape[2]] = codes
        self.scale[:, :, start:start + x.shape[2]] = scale

    def write_at(self, pos: torch.Tensor, x: torch.Tensor, keep: torch.Tensor | None = None, *,
                 checked: bool = False) -> None:
        """Code ``x`` (B, H, S, D) into slots ``pos`` (S,) int64 on the device, the same ops at every position
        (``caches/capture_residual.py``); ``keep``: 1-element bool, true = leave the slots as they are. Fits
        nothing: ``ValueError`` naming the fit when the store is not fitted yet (a capturable layer fits in its
        eager prefill)."""
        if not self.fitted:
            raise ValueError(f"a turbo store ({self.spec.describe()}) codes by slot only once fitted (channel means, "
                             "outlier channels, smoothing: fitted by the first coded write); run that write eagerly")
        if not checked:
            check_finite(x, self)
        codes, scale = self._encode(self._as_coded(pos, x))
        self.data.index_copy_(2, pos, _kept(self.data, pos, codes, keep))
        self.scale.index_copy_(2, pos, _kept(self.scale, pos, scale, keep))

    def _restore(self, start: int, z: torch.Tensor) -> torch.Tensor:
        """Decoded fp32 rows of slots [start, …) back in the model's basis and dtype (RoPE, or ``RoPE_s(μ)``)."""
        slots = self._slots(start, start + z.shape[2])
        if self._prerope:
            z = rotate(z, *self._rope_table(slots))
        elif self.spec.rope_centred and self.mean is not None:
            z = z + self._rope_mean(slots)
        return z.to(self.dtype)

    def read(self, start: int, end: int, scratch: tuple[ScratchPool, str] | None = None) -> torch.Tensor:
        return self._restore(start, self._decode(self.data[:, :, start:end], self.scale[:, :, start:end]))

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (B, H, S, D) coded and decoded as if written at slots [0, S) (fits on the first call)."""
        fitted = self.fitted
        z = self._as_coded(self._slots(0, x.shape[2]), x)
        self._fit(z)
        if not fitted:
            self._freeze()
        return self._restore(0, self._decode(*self._encode(z)))

    def map_sequences(self, fn) -> None:
        super().map_sequences(fn)
        if self.channel is not None and self.fixed_channel is None:  # fixed factors: one row per head, no batch
            self.channel = fn(self.channel)
        if self.perm is not None:
            self.perm = fn(self.perm)
        if self.mean is not None:
            self.mean = fn(self.mean)
        if self.frozen is not None:
            self._freeze()

    def _fixed_nbytes(self) -> int:
        fitted = (None if self.fixed_channel is not None else self.channel, self.perm, self.mean)
        return sum(t.numel() * t.element_size() for t in fitted if t is not None)  # fixed key scales: the plan's

    def allocated_nbytes(self) -> int:
        return super().allocated_nbytes() + self._fixed_nbytes()

    def reset(self) -> None:
        self.perm = self.mean = None
        self.channel = self.fixed_channel  # fitted smoothing forgotten; fixed key scales stay
        self.nonfinite = None
        self.frozen = self.kept_rows = None
        if self.fitted:
            self._freeze()

    def nbytes(self, used_slots: int) -> int:
        return super().nbytes(used_slots) + (self._fixed_nbytes() if used_slots else 0)


@functools.lru_cache(maxsize=8)
def _cos_sin(rope: tuple[float, ...], offset: int, rows: int, device: str, width: int) -> torch.Tensor:
    inv = torch.tensor(rope, dtype=torch.float32, device=device)
    freqs = torch.arange(offset, offset + rows, device=device).float()[:, None] * inv[None, :]
    out = torch.zeros(rows, width, dtype=torch.float32, device=device)
    h = len(rope)
    out[:, :h], out[:, h:2 * h] = freqs.cos(), freqs.sin()
    if width > 2 * h:
        out[:, 2 * h] = 1.0
    return out


def rope_cos_sin(rope: tuple[float, ...], offset: int, n: int, device: torch.device | str,
                 width: int | None = None) -> torch.Tensor:
    """(n, width) fp32 ``[cos(sθ) | sin(sθ)]`` of positions ``offset … offset + n − 1`` (HF's table: fp32 position ×
    inverse frequency; ``width`` > 2h: a column of ones, then zeros), kept in blocks of 1,024 rows so that every
    layer and decode step shares one table."""
    rows = max(1024, -(-n // 1024) * 1024)
    return _cos_sin(rope, offset, rows, str(device), width or 2 * len(rope))[:n]
