"""What a quantized cache layer hands to attention on a fused decode step: the codes, not a dequantized copy.

With fused decode on (``KVSlimCache.enable_fused_decode``, done by ``kvslim.make_cache`` when the model runs
kvslim's attention, ``adapters/sdpa.py``), a decode step (one new token) of an int8/int4 layer writes the token
as usual and returns two *marker* tensors in place of K and V: zero-stride views of shape (B, H, n, D) filled
with NaN (anything that reads them without knowing gets NaN, never plausible numbers) that carry a
:class:`FusedKV`. kvslim's attention recognises the marker and runs :mod:`kvslim.attention.quant` on the codes
(``torch.ops.kvslim.quant_decode``); :meth:`FusedKV.materialize` gives the exact tensors the unfused path
returns, for any case the fused path does not take.

Semantics are the unfused path's: the history is read from codes, the step's own key/value exactly as given
(the *tail*, together with a residual store's full-precision window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .residual import ResidualStore
from .sink import SinkStore
from .storage import QuantizedStore, TensorStore
from .turbo import TurboStore

ATTR = "_kvslim_fused"


@dataclass
class FusedKV:
    """One decode step's keys and values, as stored.

    ``k``/``v``: the coded stores (``QuantizedStore`` or its KIVI subclass); slots ``[0, n)`` hold the coded
    history. ``k_tail``/``v_tail``: (B, H, r, D) tokens after it in full precision (a residual window and/or the
    step's own token). Ring buffers (``ring`` = (first, skip)): history position i of HF's temporal order lives in
    slot ``(first + i) % n``, and slot ``skip`` (the step's own token, re-coded) is not attended (the tail has the
    exact token); the first ``lead`` tail tokens come before the coded history in temporal order (a full ring's
    oldest visible token, read before the step's token took its slot; an append layer's full-precision attention
    sinks, ``caches/sink.py``). ``columns`` (the general form, used by rings of coded token groups with a
    full-precision window, ``caches/window.ResidualRingLayer``): (n + r,) int64, for every coded slot then every
    tail token the column of HF's mask (the visible tokens in temporal order, ``visible`` of them) it stands for,
    or −1 for a row that must not be attended (a token that has left the window, a slot not yet written).
    ``materialize``: the unfused reads (the cache layer's own code path). ``v_tail_rotated``: ``v_tail`` is
    already in the value store's rotated basis (``v·R``, kept across steps by :func:`rotated_tail`);
    ``k_tail_rotated``: the same for ``k_tail`` (a rotated, unsmoothed key store: ``k·R``). Turbo stores: both tails
    in their coded bases (:func:`turbo_tail`).
    """

    k: QuantizedStore
    v: QuantizedStore
    n: int
    k_tail: torch.Tensor | None
    v_tail: torch.Tensor | None
    materialize: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    ring: tuple[int, int] | None = None
    lead: int = 0
    columns: torch.Tensor | None = None
    visible: int | None = None
    v_tail_rotated: bool = False
    k_tail_rotated: bool = False
    #: the static path of ``caches/capture.py``: slots ``[0, n)`` are the whole buffer, ``lengths`` (B,) the coded
    #: tokens to read (the step's own token is the tail), HF's mask covers the ``n`` slots; the tail is attended
    lengths: torch.Tensor | None = None
    static: bool = False
    #: sparse decode (attention/sparse.py): the ``n`` coded rows are logical, row t stored at slot
    #: ``pages[b, h, t // page]·page + t % page`` ((B, H, k) int64); the int8/int4 op reads them in place
    pages: torch.Tensor | None = None
    page: int = 0
    #: or the page list to choose in the op's own call (``kernels.sparse_select.PageChoice``: the step's queries, the
    #: layer's page boxes, the budget), read the same way once chosen
    select: object | None = None
    #: a multi-token call (:func:`history_handle`): the call's own keys and values (B, H, S, D) exactly as given,
    #: after everything above (the history); attention merges their causal block with the op's output
    own: tuple[torch.Tensor, torch.Tensor] | None = None
    #: the op's mask as built (B|1, n + r), HF's mask not consulted: a static sparse step's listed rows
    #: (``attention/sparse_static.decode_static``), whose columns differ per head
    listed_mask: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        """Visible tokens (HF's key length): the coded history (a ring: less the skipped slot) plus the tail (plus
        a multi-token call's own tokens)."""
        if self.visible is not None:
            return self.visible
        tail = 0 if self.k_tail is None else self.k_tail.shape[2]
        own = 0 if self.own is None else self.own[0].shape[2]
        return self.n - int(self.ring is not None) + tail + own  # int: torch 2.11 refuses a SymInt minus a bool

    def kernel_mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """HF's additive mask over the visible tokens in temporal order (B|1, tokens) -> the kernel's mask over
        slots ``[0, n)`` then the tail (B|1, n + r); ``None`` when nothing is masked."""
        if self.listed_mask is not None:
            return self.listed_mask
        # every index below is built on the codes' device: no host read, no device mix
        device = (self.k_tail if self.k_tail is not None else self.k.data).device
        if self.static:  # mask over the n slots, then the tail (the step's own token: attended)
            if mask is None:
                return None
            return torch.cat((mask.float(), mask.new_zeros(mask.shape[0], self.k_tail.shape[2]).float()), dim=1)
        if self.columns is not None:
            cols = self.columns.to(device)  # (n + r,), −1: not attended (built on the device by the layer)
            live = (cols >= 0)[None]  # (1, n + r)
            if mask is None:
                return torch.zeros(live.shape, dtype=torch.float32, device=device).masked_fill_(~live, float("-inf"))
            picked = mask[:, cols.clamp_min(0)].float()  # (B|1, n + r): a gather, no boolean indexing
            return torch.where(live, picked, float("-inf"))
        if self.ring is None and not self.lead:
            return mask
        if self.ring is None:  # append layer with full-precision sinks: tokens [0, lead) sit in the tail's front
            lead, n = self.lead, self.n
            if mask is None:
                return None
            return torch.cat((mask[:, lead:lead + n], mask[:, :lead], mask[:, lead + n:]), dim=1).float()
        first, skip = self.ring
        n, b = self.n, 1 if mask is None else mask.shape[0]
        out = torch.zeros(b, n + self.k_tail.shape[2], dtype=torch.float32, device=device)
        out[:, skip] = float("-inf")
        if mask is not None:
            lead = self.lead
            slots = (first + torch.arange(n - 1, device=device)) % n
            out[:, n:n + lead] = mask[:, :lead].float()
            out[:, slots] = mask[:, lead:lead + n - 1].float()
            out[:, n + lead:] = mask[:, lead + n - 1:].float()
        return out


def fusable(store: TensorStore | None) -> bool:
    """Whether the fused kernel reads this store's codes: int8/int4, per-token or KIVI, optional residual
    window and sinks."""
    inner = store.coded if isinstance(store, SinkStore) else store.inner if isinstance(store, ResidualStore) else store
    if isinstance(inner, TurboStore):  # turbo codes: kvslim.turbo_decode (attention/quant.py); not pre-RoPE keys
        return inner.spec.rope is None or inner.spec.rope_centred
    return isinstance(inner, QuantizedStore) and inner.spec.bits in (2, 3, 4, 8)


def append_handle(k_store: TensorStore, v_store: TensorStore, start: int, k_now: torch.Tensor,
                  v_now: torch.Tensor, materialize) -> FusedKV:
    """An append-only layer after writing the step's ``k_now``/``v_now`` (B, H, 1, D) at ``start``. A rotated
    value store's window is handed over as stored for the int8/int4 op (which rotates the coded sum back
    instead), rotated (:func:`rotated_tail`) for the low-bit op."""
    if isinstance(k_store, (SinkStore, ResidualStore)):  # the window holds the step's token exactly
        return _windowed(k_store, v_store, k_store.length, materialize)
    return FusedKV(k_store, v_store, start, k_now, v_now, materialize)


def history_handle(k_store: TensorStore, v_store: TensorStore, start: int, k_now: torch.Tensor,
                   v_now: torch.Tensor, materialize) -> FusedKV | None:
    """A multi-token call of an append-only layer after writing ``k_now``/``v_now`` (B, H, S, D) at ``start``: the
    history, tokens ``[0, start)`` as the unfused path reads them after the write (codes ``[0, n)``, then the
    full-precision rows of sinks and window), and the call's own tokens exactly (``own``). ``n`` can stop inside
    a key group when the call's write flushed some of its own tokens into codes (the ops read partial groups).
    ``None``: the key and value stores disagree on what is coded (the caller reads everything)."""
    own = (k_now, v_now)
    if isinstance(k_store, (SinkStore, ResidualStore)):
        if type(v_store) is not type(k_store) or k_store.flushed != v_store.flushed:
            return None
        return _windowed(k_store, v_store, start, materialize, own)
    return FusedKV(k_store, v_store, start, None, None, materialize, own=own)


def _windowed(k_store: ResidualStore | SinkStore, v_store: ResidualStore | SinkStore, upto: int, materialize,
              own: tuple[torch.Tensor, torch.Tensor] | None = None) -> FusedKV:
    """Tokens ``[0, upto)`` of a store with a full-precision window (and sinks) as stored: the codes ``[0, n)`` (``n``
    at most the coded tokens), then the tail ``[sinks | window rows before upto]`` (one buffer, the sinks attended
    before the codes: ``lead``)."""
    if isinstance(k_store, SinkStore):
        lead = min(upto, k_store.sink)
        past = upto - lead  # tokens behind the sinks (positions in the residual store)
        n = min(k_store.inner.flushed, past)
        coded = k_store.coded, v_store.coded
    else:
        lead, past = 0, upto
        n = min(k_store.flushed, upto)
        coded = k_store.inner, v_store.inner
    r = lead + past - n
    vt, rotated = _value_tail(v_store, r)
    kt, k_rotated = _key_tail(k_store, r)
    return FusedKV(*coded, n, kt, vt, materialize, lead=lead, v_tail_rotated=rotated, k_tail_rotated=k_rotated,
                   own=own)


def _value_tail(store: ResidualStore | SinkStore, r: int) -> tuple[torch.Tensor, bool]:
    """The value window for the op that will read it: as stored for int8/int4 codes, else :func:`rotated_tail`."""
    coded = store.coded if isinstance(store, SinkStore) else store.inner
    if isinstance(coded, TurboStore):
        return turbo_tail(store, r)
    if coded.spec.bits in (4, 8):
        return store.fp[:, :, :r], False
    return rotated_tail(store, r)


def _key_tail(store: ResidualStore | SinkStore, r: int) -> tuple[torch.Tensor, bool]:
    """The key window for the decode op: :func:`rotated_tail` (kept across steps: one new row rotated per step,
    not the whole window) when the coded keys are rotated and not smoothed, else as stored (the op then takes
    smoothing and rotation onto the window itself)."""
    coded = store.coded if isinstance(store, SinkStore) else store.inner
    if isinstance(coded, TurboStore):
        return turbo_tail(store, r)
    if coded.spec.smooth:
        return store.fp[:, :, :r], False
    return rotated_tail(store, r)


def _tail_buffer(store: ResidualStore | SinkStore, r: int) -> tuple[tuple, torch.Tensor, int]:
    """(key, buffer, rows already transformed) of the store's kept transformed tail: the rows of the previous
    steps when nothing could have changed them, else a fresh buffer with none done (see :func:`rotated_tail`)."""
    key = (id(store.fp), store.epoch, getattr(store.inner, "epoch", None), store.flushed)
    saved = store.rotated_copy
    if saved is None or saved[0] != key or saved[2] > r:
        return key, torch.empty(store.fp.shape, dtype=torch.float32, device=store.fp.device), 0
    return key, saved[1], saved[2]


def turbo_tail(store: ResidualStore | SinkStore, r: int) -> tuple[torch.Tensor, bool]:
    """The first ``r`` rows of a turbo store's full-precision tail in its coded basis (centred, permuted, each
    part rotated: ``TurboStore.to_coded_basis``), fp32: ``(tail, True)``. Kept across decode steps as
    :func:`rotated_tail` keeps its rows (one new row transformed per step; everything again after a flush, which
    also fits the store's means and permutation on its first one, or a rewind, reorder or reset)."""
    coded = store.coded if isinstance(store, SinkStore) else store.inner
    key, buf, done = _tail_buffer(store, r)
    if r > done:
        buf[:, :, done:r] = coded.to_coded_basis(store.fp[:, :, done:r])
    store.rotated_copy = (key, buf, r)
    return buf[:, :, :r], True


def rotated_tail(store: ResidualStore | SinkStore, r: int) -> tuple[torch.Tensor, bool]:
    """The first ``r`` rows of ``store.fp`` (its full-precision tail), times the coded store's rotation R when it
    has one: ``(tail, False)`` without a rotation, else ``(tail·R in fp32, True)``.

    A decode step appends one row to the tail, so the rows rotated on the previous step are kept (in a buffer on
    the store) and only the new rows are rotated: the key ``(fp buffer, epoch(s), flushed)`` changes whenever
    rows already rotated could have changed (a flush shifts the window, a rewind, reorder or reset bumps an
    epoch), and then every row is rotated again."""
    coded = store.coded if isinstance(store, SinkStore) else store.inner
    tail = store.fp[:, :, :r]
    rot = getattr(coded, "rotation", None)
    if rot is None:
        return tail, False
    key, buf, done = _tail_buffer(store, r)
    # a decode step's one row: one 2-D product into place (eagerly; dynamo refuses a strided out=)
    if r == done + 1 and tail.dtype == torch.float32 and not torch.compiler.is_compiling():
        torch.mm(tail[:, :, done:r].reshape(-1, rot.shape[0]), rot, out=buf[:, :, done:r].view(-1, rot.shape[1]))
    elif r > done:
        buf[:, :, done:r] = tail[:, :, done:r].float() @ rot
    store.rotated_copy = (key, buf, r)
    return buf[:, :, :r], True


def ring_handle(k_store: TensorStore, v_store: TensorStore, length: int, window: int, k_now: torch.Tensor,
                v_now: torch.Tensor, materialize, evicted: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> FusedKV:
    """A ring layer of ``window`` slots holding ``length`` tokens after writing the step's token (position
    ``length - 1``, slot ``(length - 1) % window``). ``evicted``: the (B, H, 1, D) key and value the step's token
    overwrote when that token is still visible to the step (it is attended first, from the tail)."""
    n = min(length, window)
    first = length % n if length >= window else 0
    if evicted is not None:
        k_now, v_now = torch.cat((evicted[0], k_now), dim=2), torch.cat((evicted[1], v_now), dim=2)
    return FusedKV(k_store, v_store, n, k_now, v_now, materialize, ring=(first, (length - 1) % window),
                   lead=0 if evicted is None else 1)


def markers(h, like: torch.Tensor, attr: str = ATTR) -> tuple[torch.Tensor, torch.Tensor]:
    """Two NaN zero-stride (B, H, ``h.tokens``, D) tensors shaped like the step's K/V, carrying handle ``h`` as
    attribute ``attr`` (a :class:`FusedKV` here; sparse decode's handle under its own name)."""
    b, heads, _, d = like.shape
    nan = torch.full((), float("nan"), dtype=like.dtype, device=like.device)
    out = []
    for _ in range(2):  # two views of one NaN scalar, each carrying h
        m = nan.expand(b, heads, h.tokens, d)
        setattr(m, attr, h)
        out.append(m)
    return out[0], out[1]


def fused_of(key: torch.Tensor) -> FusedKV | None:
    """The :class:`FusedKV` a marker carries, or ``None`` for an ordinary tensor."""
    return getattr(key, ATTR, None)
