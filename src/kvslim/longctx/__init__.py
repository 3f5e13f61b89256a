"""Long-context retrieval (issue 34): RULER-style tasks generated from a seed (:mod:`.tasks`), haystacks of an
exact token length (:mod:`.haystack`) and the protocol that decodes each answer through a compressed cache
(:mod:`.protocol`). ``benchmarks/bench_longctx.py`` and ``kvslim eval --task`` share it."""

from .protocol import answer, correct, fill, prefill_kv, run, summarize, wilson
from .tasks import DEPTHS, TASKS, filler_units, instances

__all__ = ["DEPTHS", "TASKS", "answer", "correct", "fill", "filler_units", "instances", "prefill_kv", "run",
           "summarize", "wilson"]
