"""Which rank stores which token: the same deterministic decision on every rank, from counts alone.

* A multi-token call (the prompt) is cut into contiguous slices, one per rank, sized by ``split`` weights
  (default: equal; the first ``P mod N`` ranks get one token more). A slice may be empty.
* Each decoded token goes to the rank holding the **fewest** tokens (ties: the lowest rank) — the default — or,
  with ``rule="round_robin"``, to rank ``k mod N`` for the k-th decoded token (k = 0, 1, …).
* With a sliding window W (ring-buffer layers) a token stops counting once it leaves the window: a prompt keeps
  only its last W tokens, sliced as above, and "fewest" counts live tokens. With equal weights every rank then
  holds at most ⌈W/N⌉ tokens.

Nothing here communicates: every rank holds one :class:`Placement` per window size and reaches the same owners.
"""

from __future__ import annotations

RULES = ("fewest", "round_robin")


def split_sizes(total: int, weights: tuple[float, ...]) -> list[int]:
    """``total`` tokens cut into ``len(weights)`` contiguous slices proportional to ``weights`` (largest
    remainders first, ties to the lower rank)."""
    s = float(sum(weights))
    exact = [total * w / s for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda r: (-(exact[r] - sizes[r]), r))
    for r in order[: total - sum(sizes)]:
        sizes[r] += 1
    return sizes


def check_split(split, world_size: int) -> tuple[float, ...]:
    """Validated split weights (``None``: equal)."""
    if split is None:
        return (1.0,) * world_size
    try:
        weights = tuple(float(w) for w in split)
    except TypeError:
        raise ValueError(f"split must be a sequence of {world_size} non-negative weights, got {split!r}") from None
    if len(weights) != world_size or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"split must be {world_size} non-negative weights (one per rank) with a positive sum, "
                         f"got {split!r}")
    return weights


class Placement:
    """Owners of global token indices 0, 1, … for one window size (``None``: unbounded)."""

    def __init__(self, world_size: int, rule: str = "fewest", split: tuple[float, ...] | None = None,
                 window: int | None = None):
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.world_size, self.rule, self.window = world_size, rule, window
        self.weights = check_split(split, world_size)
        self.owners: list[int] = []  # owner of each global index (-1: never stored, outside the window)
        self.counts = [0] * world_size  # live tokens per rank
        self.decoded = 0

    def owners_of(self, start: int, length: int) -> list[int]:
        """Owners of tokens ``[start, start + length)`` (decided on first request, then remembered)."""
        if start + length > len(self.owners):
            if start != len(self.owners):
                raise ValueError(f"tokens must arrive in order: got start={start}, expected {len(self.owners)}")
            self._place(start, length)
        return self.owners[start:start + length]

    def reset(self) -> None:
        """Forget every placement (a new generation starts)."""
        self.owners, self.counts, self.decoded = [], [0] * self.world_size, 0

    def _expire_before(self, t: int) -> None:
        """Drop tokens that leave the window once token ``t`` is visible (positions ≤ t − W)."""
        if self.window is None:
            return
        g = t - self.window
        if 0 <= g < len(self.owners) and self.owners[g] >= 0:
            self.counts[self.owners[g]] -= 1

    def _place(self, start: int, length: int) -> None:
        first = len(self.owners)
        if length == 1 and first > 0:
            self._expire_before(first)
            if self.rule == "fewest":
                owner = min(range(self.world_size), key=lambda r: (self.counts[r], r))
            else:
                owner = self.decoded % self.world_size
            self.decoded += 1
            self.owners.append(owner)
            self.counts[owner] += 1
            return
        end = start + length
        kept = length if self.window is None else min(length, self.window)
        if self.window is not None:  # tokens already stored that fall out of the window with this chunk
            for g in range(max(0, first - self.window), min(first, max(0, end - self.window))):
                if self.owners[g] >= 0:
                    self.counts[self.owners[g]] -= 1
        self.owners.extend([-1] * (length - kept))
        for r, size in enumerate(split_sizes(kept, self.weights)):
            self.owners.extend([r] * size)
            self.counts[r] += size

    def local_indices(self, rank: int, start: int, length: int) -> list[int]:
        """Offsets ``i`` in ``[0, length)`` of the tokens ``start + i`` that ``rank`` stores."""
        return [i for i, o in enumerate(self.owners_of(start, length)) if o == rank]
