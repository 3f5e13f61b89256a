"""The shipped int4/int3/int2 defaults (full-precision residual window, attention sinks, KIVI keys) in a layout that
CUDA graphs capture (issue 33; ``kvslim.make_cache(model, max_length=N, capturable=True)``).

The eager layout (``caches/residual.py``, ``caches/sink.py``) keeps the window as a linear buffer that a flush
shifts, with the coded length as a Python int: a decode step's shapes and control flow follow the length. A capturable
layer built with ``max_length`` and ``capturable=True`` keeps instead, per key or value store
(:class:`StaticResidualStore`):

* ``fp`` (B, H, sink + R, D) in the model dtype: the ``sink`` first tokens in rows ``[0, sink)`` and the residual
  window as a **ring** of ``R = residual`` rows behind them: window position p (counted after the sinks) lives in row
  ``sink + p mod R``;
* the coded store (per-token codes, or KIVI keys per channel over token groups) of ``max_length`` slots, slot j =
  token ``sink + j``, exactly as the eager layout's;
* the coded length ``flushed_t`` (a 0-dim int64 device tensor) beside the layer's device length.

A decode step (one token at position n) runs the same ops at every n, decided on the device:

1. *flush*: the flush group (the ``flush`` oldest window tokens, ring rows ``flushed … flushed + flush − 1`` mod R)
   is always gathered and encoded; it is written into coded slots ``[flushed, flushed + flush)`` only where the
   predicate ``n − sink − flushed == R`` holds (the window is full: the eager layout flushes at that very step), else
   those slots are rewritten with what they hold (``torch.where``); ``flushed_t += flush`` under the same predicate.
   Whole groups, so KIVI keys and per-token codes are the eager layout's codes of the same tokens;
2. *write*: the token goes to row ``n`` (a sink) or ``sink + (n − sink) mod R`` (the window). When the window was
   full, that is the row of the oldest token, encoded in step 1 before it is overwritten (R rows suffice).

Reads cover the whole buffer: the fused decode op gets the coded slots with ``lengths = flushed`` and ``fp`` as its
tail, with a column per row (``FusedKV.columns``: the position each row holds, −1 for a row not attended), so HF's
whole-buffer causal mask applies; the unfused read decodes every slot into position order and puts sinks and window
on top. Costs against the eager layout: the flush group is gathered, encoded and written every step (written back
unchanged when no flush is due): for int4 at D = 128 in bf16, 32 full-precision K and V rows read and 32 coded rows
read and written, ~26 KB per sequence and head against ~1.25 MB of history at 8k tokens, about 2 % (arithmetic, not
measured); no shift of the window.
Multi-token updates (a prefill) run eagerly with host integers and leave the same state as that many single steps.

Fitted parameters (the eager layout fits them on its first coded write, the first flush): turbo codes' channel
means (RoPE-centred for turbo3), outlier channels and smoothing (``caches/turbo.TurboStore``), smoothed int keys'
factors. A graph step cannot fit (it would have to decide on the device whether this is the first flush, and the
turbo basis moves built from the fit would be rebuilt every step), so the eager prefill fits them: on the tokens the
first flush takes when the prefill covers them (the prefill flushes itself, or holds ``sink + flush`` tokens: 68 for
the turbo defaults) — then the codes are the eager layout's —, else on the prefill's tokens after the sinks (then the
codes differ from the eager layout's, as a fit on other tokens does: measured on a 2-layer tiny Llama, turbo3, a 24-token
prompt, first flush at step 104: logits 2.7e-4 from the eager cache's, tokens equal). An eager step fits at the first
flush as the eager layout does. A graph step before any fit (a prefill of ``sink`` tokens or fewer) is refused with a
``ValueError`` naming the fit (:func:`unfitted_error`; under dynamo it surfaces in the ``Unsupported`` error at trace
time, nothing runs). Once fitted, the turbo basis moves and the RoPE-centred bias rows of the whole capacity are
computed eagerly and kept at static addresses (``TurboStore.frozen``, ``kept_rows``).

Turbo codes: the coded store is a ``TurboStore`` (slot j = position ``sink + j``, its RoPE table by device positions);
the window is also kept in the codes' basis (``coded``, fp32: one row transformed per step), which the fused op
``kvslim.turbo_decode`` attends as its tail after the whole coded buffer (masked by ``columns``, with
``lengths = flushed``: the op reads no coded slot past the coded tokens).
The flush group (64 rows for the defaults) is rotated and coded every step: for D = 128, ~2·64·D² multiply-adds per
sequence and KV head (arithmetic, not measured). Pre-RoPE keys (``prerope_keys``) are capturable through the
unfused reads (every slot decoded per step).

Not covered: rewinding (``crop``), ring-window layers with a residual window (``ResidualRingLayer``; plain and
per-token rings: ``caches/capture_ring.py``).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .residual import ChannelQuantizedStore
from .spec import StoreSpec
from .storage import QuantizedStore, _kept, check_finite
from .turbo import TurboStore


def supported(spec: StoreSpec) -> bool:
    """Whether a residual-window spec has a capturable layout here (see the module docstring)."""
    return bool(spec.residual) and spec.codec in ("int", "turbo")


def unfitted_error(spec: StoreSpec) -> ValueError:
    return ValueError(f"a capturable cache of {spec.describe()} fits its {_fitted_names(spec)} on its first coded "
                      "tokens in an eager call, and this layer holds no token after its sinks yet: run the prefill "
                      f"eagerly with more than sink={spec.sink} tokens (HF's generate does) before compiled or "
                      "captured steps")


def _fitted_names(spec: StoreSpec) -> str:
    names = [n for n, on in (("channel means", spec.center), ("smoothing factors", spec.smooth),
                             ("outlier channels", spec.outliers)) if on]
    return " and ".join(names) or "parameters"


class StaticResidualStore:
    """Sinks + a ring window in full precision in front of a coded store, with the coded length on the device."""

    def __init__(self, spec: StoreSpec, like: torch.Tensor, capacity: int):
        if not supported(spec):
            raise ValueError(f"a capturable residual store needs residual > 0 and int or turbo codes, got "
                             f"{spec.describe()}")
        b, h, _, d = like.shape
        inner = replace(spec, sink=0)
        turbo = spec.codec == "turbo"
        cls = TurboStore if turbo else ChannelQuantizedStore if spec.channel_group else QuantizedStore
        self.inner = cls(inner, b, h, capacity, d, like.dtype, like.device)
        self.inner.position_offset = spec.sink  # coded slot j is position sink + j (turbo keys' RoPE table)
        self.spec, self.dtype, self.dim = spec, like.dtype, d
        self.sink, self.window, self.flush = spec.sink, spec.residual, spec.flush
        self.fp = torch.zeros(b, h, self.sink + self.window, d, dtype=like.dtype, device=like.device)
        # turbo: the rows of ``fp`` in the codes' basis (fp32; fused decode attends the tail there), one row
        # transformed per step once fitted
        fusable = turbo and (spec.rope is None or spec.rope_centred)  # pre-RoPE keys: no one basis, not fused
        self.coded = torch.zeros(self.fp.shape, dtype=torch.float32, device=like.device) if fusable else None
        self.flushed_t = torch.zeros((), dtype=torch.int64, device=like.device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=like.device)
        self.flushed = 0  # host copies, current after eager calls (``sync_host`` after graph steps)
        self.length = 0

    # -- the TensorStore surface the layer uses ----------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        return self.inner.data

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def tensors(self) -> list[torch.Tensor]:
        return self.inner.tensors() + [self.fp]

    def set_tensors(self, tensors: list[torch.Tensor]) -> None:
        self.inner.set_tensors(tensors[:-1])
        self.fp = tensors[-1]

    def device_state(self) -> list[torch.Tensor]:
        """Tensors a graph step updates in place besides :meth:`tensors` (their addresses must stay put)."""
        return [self.flushed_t, self.nonfinite] + ([] if self.coded is None else [self.coded])

    # -- fitting (the first coded write's parameters: turbo means / outliers, smoothed keys' factors) -----------
    @property
    def fitted(self) -> bool:
        """Whether the coded store's fitted parameters are set (always, for specs that fit nothing)."""
        inner = self.inner
        if isinstance(inner, TurboStore):
            return inner.fitted
        return not (inner.spec.smooth and inner.channel is None)

    def _fit_on(self, start: int, x: torch.Tensor) -> None:
        """Eagerly, fit the coded store on window tokens ``x`` at window positions ``start`` on (what the eager
        layout's first coded write fits on), then keep what a compiled step reads at fixed addresses."""
        inner = self.inner
        if isinstance(inner, TurboStore):
            inner.fit(torch.arange(start, start + x.shape[2], device=x.device), x)
        else:
            inner._channel_for(x)
        self._hold()
        self._refresh_coded()

    def _hold(self) -> None:
        """Mark the fitted tensors a compiled step reads as static addresses (CUDA graphs replay in place)."""
        inner = self.inner
        held = inner.frozen_tensors() if isinstance(inner, TurboStore) else [inner.channel]
        if not torch.compiler.is_compiling():
            for t in held:
                if t is not None:
                    torch._dynamo.mark_static_address(t)

    def _refresh_coded(self) -> None:
        if self.coded is not None and self.fitted:
            self.coded.copy_(self.inner.to_coded_basis(self.fp))

    def fused_tail(self) -> tuple[torch.Tensor, bool]:
        """The tail a fused decode step attends (sinks and ring rows) and whether it is in the codes' basis."""
        return (self.fp, False) if self.coded is None else (self.coded, True)

    def map_sequences(self, fn) -> None:
        self.inner.map_sequences(fn)
        self.fp = fn(self.fp)
        if self.coded is not None:
            self.coded = fn(self.coded)

    def reset(self) -> None:
        self.flushed = self.length = 0
        self.flushed_t.zero_()
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=self.fp.device)
        self.inner.reset()
        if self.coded is not None:
            self.coded.zero_()

    def sync_host(self, length: int) -> None:
        """After graph steps: the host copies from the device (one read, at an eager boundary)."""
        self.flushed, self.length = int(self.flushed_t), length

    def allocated_nbytes(self) -> int:
        return self.inner.allocated_nbytes() + self.fp.numel() * self.fp.element_size()

    def nbytes(self, used_slots: int) -> int:
        """The eager layout's bytes for ``used_slots`` tokens: sinks and window rows in full precision, the rest
        in codes (host copies: the layer syncs them first)."""
        b, h = self.fp.shape[:2]
        row = b * h * self.dim * self.dtype.itemsize
        coded = min(self.flushed, max(0, used_slots - self.sink))
        return row * (used_slots - coded) + self.inner.nbytes(coded)

    # -- writes ------------------------------------------------------------------------------------------------
    def append(self, start: int, x: torch.Tensor) -> None:
        """Eager multi-token write at ``start`` (= the tokens held; host integers): sinks, then the eager layout's
        flushes (whole groups, :meth:`StoreSpec.flushed`), the rest into the ring. ``ValueError`` on inf/nan,
        nothing written."""
        if start != self.length:
            raise ValueError(f"a capturable residual store appends: start {start} is not its {self.length} tokens")
        check_finite(x, self)
        s, n = self.sink, start + x.shape[2]
        if start < s:
            k = min(s, n) - start
            self.fp[:, :, start:start + k] = x[:, :, :k]
            x = x[:, :, k:]
        if x.shape[2]:
            a, b = max(start, s) - s, n - s  # window positions of x: [a, b)
            target = max(self.flushed, self.spec.flushed(n) - s)
            if target > self.flushed:
                held = self.fp.index_select(2, self._rows(torch.arange(self.flushed, a, device=x.device)))
                pending = torch.cat((held, x), dim=2)[:, :, :target - self.flushed]
                self.inner.write(self.flushed, pending, checked=True)
            lo = max(target, a)
            rows = self._rows(torch.arange(lo, b, device=x.device))
            self.fp.index_copy_(2, rows, x[:, :, lo - a:].to(self.dtype))
            self.flushed = target
            self.flushed_t.fill_(target)
        self.length = n
        if not self.fitted and n > s:  # fit now on the tokens of the first flush group (all of them when held)
            take = min(self.flush, n - s)
            self._fit_on(0, self.fp.index_select(2, self._rows(torch.arange(take, device=x.device))))
        elif self.fitted:  # fitted before, or by this call's flush (the eager layout's first coded write)
            self._hold()
            self._refresh_coded()

    def _rows(self, window_pos: torch.Tensor) -> torch.Tensor:
        return self.sink + window_pos.remainder(self.window)

    def step(self, n: torch.Tensor, x: torch.Tensor, ok: torch.Tensor | None, host: bool) -> None:
        """One token ``x`` (B, H, 1, D) at position ``n`` ((1,) int64 on the device), the same ops at every ``n``
        (module docstring). ``ok``: (1,) bool, false for a refused step (nothing changes); ``host``: keep the host
        copies current (an eager call, whose position the caller knows)."""
        s, w, f = self.sink, self.window, self.flush
        check_finite(x, self)  # one token: a device-side flag (storage.check_finite)
        fresh = False
        if not self.fitted:  # only eagerly: the fit is the first coded write's, decided on the host
            if not host:
                raise unfitted_error(self.spec)
            pos = self.length
            if pos >= s and pos - s - self.flushed == w:  # this step flushes the first group: fit on it first
                rows = self._rows(self.flushed + torch.arange(f, device=x.device))
                self._fit_on(self.flushed, self.fp.index_select(2, rows))
                fresh = True
        is_sink = n < s
        if self.fitted:
            due = (~is_sink) & (n - s - self.flushed_t == w)  # (1,): the window is full, its oldest group flushes
            if ok is not None:
                due = due & ok
            slots = self.flushed_t + torch.arange(f, device=n.device)
            group = self.fp.index_select(2, self._rows(slots))  # encoded every step, written only when due
            self.inner.write_at(slots.clamp(max=self.capacity - 1), group, ~due, checked=True)
            self.flushed_t.add_(due.to(torch.int64)[0] * f)
        row = torch.where(is_sink, n, self._rows(n - s))
        keep = None if ok is None else ~ok
        self.fp.index_copy_(2, row, _kept(self.fp, row, x.to(self.dtype), keep))
        if self.coded is not None and self.fitted and not fresh:  # the row in the codes' basis
            self.coded.index_copy_(2, row, _kept(self.coded, row, self.inner.to_coded_basis(x), keep))
        elif fresh:
            self._refresh_coded()
        if host:
            pos = self.length
            if pos >= s and pos - s - self.flushed == w:
                self.flushed += f
            self.length = pos + 1

    # -- reads -------------------------------------------------------------------------------------------------
    def read_positions(self, max_length: int) -> torch.Tensor:
        """(B, H, max_length, D): every position's value as stored (sinks, decoded codes, window; slots past the
        length hold anything finite: HF's causal mask hides them)."""
        b, h, _, d = self.fp.shape
        s, w = self.sink, self.window
        coded = self.inner.read(0, self.capacity).to(self.dtype)
        out = torch.cat((self.fp[:, :, :s], coded, self.fp.new_zeros(b, h, w, d)), dim=2)
        pos = self.flushed_t + torch.arange(w, device=self.fp.device)  # the window's positions after the sinks
        out = out.index_copy(2, s + pos, self.fp.index_select(2, self._rows(pos)))
        return out[:, :, :max_length]

    def columns(self, length: torch.Tensor) -> torch.Tensor:
        """(capacity + sink + R,) int64 on the device: for every coded slot, then every ``fp`` row, the position it
        holds when the layer holds ``length`` tokens (a 0-dim tensor), −1 where it holds none (fused.FusedKV)."""
        dev, s, w, f = self.fp.device, self.sink, self.window, self.flushed_t
        j = torch.arange(self.capacity, device=dev)
        coded = torch.where(j < f, s + j, -1)
        i = torch.arange(s, device=dev)
        sinks = torch.where(i < length, i, -1)
        q = torch.arange(w, device=dev)
        held = f + (q - f).remainder(w)  # window position of ring row q
        ring = torch.where(held < length - s, s + held, -1)
        return torch.cat((coded, sinks, ring))
