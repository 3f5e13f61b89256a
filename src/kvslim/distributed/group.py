"""Process-group setup for sequence-parallel decode: bounded timeouts, a start-up agreement check, counted
collectives and a watchdog.

Every collective kvslim issues goes through :class:`Comm`, which counts the bytes each rank sends (by the
collective's standard algorithm, see :meth:`Comm.all_gather`) and turns any failure — a dead peer, a timeout —
into a :class:`DistributedError` that names the rank, the collective and what it was for.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

#: default bound on any one collective (seconds); a dead or stuck rank surfaces within it
DEFAULT_TIMEOUT_S = 60.0


class DistributedError(RuntimeError):
    """A collective failed or timed out (a peer died or hung), or the ranks disagree on their set-up."""


def init_group(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join (or reuse) the default process group from torchrun's environment; returns ``(rank, world_size)``.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); ``None`` picks NCCL when CUDA is available, else gloo.
        timeout_s: bound on every collective of the group, in seconds (> 0).

    Without ``RANK``/``WORLD_SIZE`` in the environment (a plain ``python`` run) this is a one-rank world and no
    group is created.
    """
    if not isinstance(timeout_s, (int, float)) or isinstance(timeout_s, bool) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return 0, 1
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":  # one GPU per rank (untested here: no GPU in this project's CI)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=float(timeout_s)))
    return dist.get_rank(), dist.get_world_size()


def close_group() -> None:
    """Leave the default process group (no-op without one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Watchdog:
    """Ends this process (exit code 70, with a message on stderr) if one collective stays pending longer than
    ``limit_s``: the last resort should a backend not honour its own timeout."""

    def __init__(self, limit_s: float, rank: int):
        self.limit_s, self.rank = limit_s, rank
        self._since: float | None = None
        self._what = ""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvslim-watchdog", daemon=True)
        self._thread.start()

    def enter(self, what: str) -> None:
        with self._lock:
            self._since, self._what = time.monotonic(), what

    def leave(self) -> None:
        with self._lock:
            self._since = None

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.limit_s / 4))
            with self._lock:
                since, what = self._since, self._what
            if since is not None and time.monotonic() - since > self.limit_s:
                sys.stderr.write(f"kvslim.distributed: rank {self.rank}: {what} pending for more than "
                                 f"{self.limit_s:.0f} s; a peer rank died or hangs. Exiting.\n")
                sys.stderr.flush()
                os._exit(70)


class Comm:
    """The collectives of one rank, counted. ``world_size == 1`` makes every collective the identity.

    Attributes:
        sent_bytes: bytes this rank has sent, by the standard algorithms (ring all-gather: (N−1)·P,
            ring all-reduce: 2·(N−1)/N·P for a payload of P bytes per rank).
        payload_bytes: bytes of the tensors handed to collectives (per rank).
        calls: number of collectives issued.
        seconds: wall time spent inside collectives (transfer plus waiting for the slowest rank).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, timeout_s: float = DEFAULT_TIMEOUT_S,
                 watchdog: bool = True):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.sent_bytes = 0
        self.payload_bytes = 0
        self.calls = 0
        self.seconds = 0.0  # wall time inside collectives (includes waiting for slower ranks)
        self.watchdog = Watchdog(2 * timeout_s + 10, rank) if watchdog and world_size > 1 else None

    def reset_counters(self) -> None:
        self.sent_bytes = self.payload_bytes = self.calls = 0
        self.seconds = 0.0

    def _run(self, what: str, fn) -> None:
        if self.watchdog:
            self.watchdog.enter(what)
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # gloo raises RuntimeError / DistBackendError on a dead peer or a timeout
            raise DistributedError(
                f"rank {self.rank}/{self.world_size}: {what} failed ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}); a peer rank died, hung past the "
                f"{self.timeout_s:.0f} s timeout, or left the job") from exc
        finally:
            self.seconds += time.perf_counter() - t0
            if self.watchdog:
                self.watchdog.leave()

    def all_gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """Stack of every rank's ``x`` (same shape on all ranks): ``(N, *x.shape)``."""
        n = self.world_size
        self.calls += 1
        p = x.numel() * x.element_size()
        self.payload_bytes += p
        if n == 1:
            return x[None]
        self.sent_bytes += (n - 1) * p
        out = x.new_empty(n * x.numel())  # flat: rank r's values at [r·numel, (r+1)·numel)
        self._run(what, lambda: _gather_single(out, x.contiguous().view(-1)))
        return out.view(n, *x.shape)

    def all_reduce(self, x: torch.Tensor, op: str, what: str) -> torch.Tensor:
        """``x`` reduced in place over ranks with ``op`` (``"sum"`` or ``"max"``)."""
        n = self.world_size
        self.calls += 1
        p = x.numel() * x.element_size()
        self.payload_bytes += p
        if n == 1:
            return x
        self.sent_bytes += 2 * (n - 1) * p // n
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        self._run(what, lambda: dist.all_reduce(x, op=red))
        return x

    def all_gather_object(self, obj, what: str) -> list:
        """Every rank's picklable ``obj`` (start-up checks; not counted as decode traffic)."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        self._run(what, lambda: dist.all_gather_object(out, obj))
        return out


def fingerprint_tensor(t: torch.Tensor) -> str:
    """A short digest of a tensor's values (cheap: sums in float64, not a cryptographic hash of the bytes)."""
    x = t.detach().double()
    return f"{x.sum().item():.12e}/{(x * x).sum().item():.12e}/{tuple(t.shape)}/{t.dtype}"


def model_fingerprint(model) -> dict[str, str]:
    """Named digests of what every rank must share: the config and the weights."""
    cfg = model.config.to_dict()
    cfg.pop("_attn_implementation_internal", None)
    cfg_s = json.dumps(cfg, sort_keys=True, default=str)
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(fingerprint_tensor(p).encode())
    return {"config": hashlib.sha256(cfg_s.encode()).hexdigest()[:16], "weights": h.hexdigest()[:16],
            "dtype": str(next(model.parameters()).dtype)}


def check_agreement(comm: Comm, items: dict[str, str], what: str = "start-up") -> None:
    """Refuse to go on unless every rank passed the same ``items``; the error names each field that differs.

    Raises:
        DistributedError: on every rank, listing the mismatching fields and each rank's value.
    """
    everyone = comm.all_gather_object(items, f"{what} agreement check")
    bad = []
    for key in sorted(set().union(*everyone)):
        values = [e.get(key) for e in everyone]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            bad.append(f"{key} ({shown})")
    if bad:
        raise DistributedError(f"ranks disagree at {what} on: " + "; ".join(bad))


def _gather_single(out: torch.Tensor, x: torch.Tensor) -> None:
    """All-gather into one flat tensor (``all_gather_single`` where torch has it, its older name otherwise)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x)
