"""The GPU decode table of issue 26 in one run: ``kvslim bench --device cuda`` (``--quick``: tiny shapes, any device).

Kinds: HF ``StaticCache`` eager and compiled (``torch.compile(mode="reduce-overhead", fullgraph=True)``: CUDA
graphs), HF ``DynamicCache``, HF ``QuantizedCache`` with quanto 4-bit (when ``optimum-quanto`` imports), and every
kvslim method eager and compiled (a method that does not apply to a shape is recorded with its reason; a compile
that fails is recorded with its error). Points: the three shapes of the issue with random weights in bf16, each
cache filled with ``context`` random tokens through its own ``update`` (:func:`kvslim.bench.decode.make_filled_cache`).

Per kind: step ms (median over ``rounds`` × ``steps`` steps; the eager and compiled runs of a kind share its model
and cache and take turns, round by round), cache bytes, bytes read per step (weights + stored cache) ÷ step time
against a device-to-device copy rate measured in the same run, peak memory. Kinds run one after another (each
holds its own cache: the 8B point's caches would not fit together). Capacity: for the capacity shape, the largest
batch per kind whose cache fills and decodes without running out of memory, and tokens/s there.
"""

from __future__ import annotations

import statistics
import time
import traceback
import warnings
from dataclasses import dataclass, field

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .. import api
from ..adapters.compat import CACHE_KW
from ..adapters.shape import shape_from_config
from ..methods import METHODS
from ..optional import quanto_missing
from ..units import human_bytes
from . import decode

#: model shapes (Llama family, random weights): the issue's three points
SHAPES = {
    "mha-1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16),
    "llama3.2-1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                        num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0),
    # --quick: the same kinds of shape (MHA, GQA) small enough for a CPU test
    "tiny-mha": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4),
    "tiny-gqa": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2),
    # the sparse stage's --quick point: four layers, every one sparse (sparse_dense_layers=0, the default)
    "tiny-gqa-4l": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2),
}
#: (shape, context, batch)
POINTS = (("mha-1b", 8192, 8), ("llama3.2-1b", 8192, 8), ("llama3-8b", 32768, 4))
QUICK_POINTS = (("tiny-mha", 96, 2), ("tiny-gqa", 96, 2))
#: (shape, context) of the capacity search
CAPACITY = ("llama3-8b", 32768)
QUICK_CAPACITY = ("tiny-gqa", 96)
METHOD_NAMES = ("dense", "window", "int8", "int4", "int3", "int2", "slim", "mla")
HF_NAMES = ("hf-static", "hf-dynamic", "hf-quanto4")
CAPACITY_KINDS = ("hf-static", "kvslim-dense", "kvslim-int8", "kvslim-int4", "kvslim-int2")
#: kinds that are a method with options (gpu_check's sparse stage): kind -> (method, apply() options)
OPTION_KINDS = {"kvslim-int4-sparse": ("int4", {"sparse_budget": 2048})}
COMPILE_MODES = ("reduce-overhead", "cudagraphs", "default", "eager-backend", None)
#: capacity fills write this many tokens per update (the transient of one write, not the context, sets the peak)
FILL_CHUNK = 4096


@dataclass
class Settings:
    """One run. ``compile_mode``: ``"reduce-overhead"`` (inductor + CUDA graphs), ``"cudagraphs"`` (dynamo + CUDA
    graphs, no inductor code generation: seconds to compile instead of a minute), ``"default"``, ``"eager-backend"``
    (dynamo tracing only, ``backend="eager"``: what a CPU test can afford) or ``None`` (no compiled kinds).
    ``points``: (shape, context, batch) rows (``None``: :data:`POINTS`, ``--quick``: :data:`QUICK_POINTS`).
    ``deadline``: a ``time.monotonic()`` after which no kind or capacity try is started (recorded as skipped)."""

    device: str = "cuda"
    quick: bool = False
    steps: int = 4
    rounds: int = 3
    warmup: int = 3
    compile_mode: str | None = "reduce-overhead"
    capacity: bool = True
    kinds: tuple[str, ...] = field(default_factory=lambda: HF_NAMES + tuple(f"kvslim-{m}" for m in METHOD_NAMES))
    #: CPU runs (no OOM to detect): a memory budget for the capacity search, bytes
    cpu_budget: int = 64 << 20
    #: the capacity search stops here (``--quick``: 16)
    max_batch: int = 4096
    points: tuple[tuple[str, int, int], ...] | None = None
    capacity_kinds: tuple[str, ...] = CAPACITY_KINDS
    deadline: float | None = None

    def __post_init__(self) -> None:
        for name in ("steps", "rounds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {self.compile_mode!r}")
        known = HF_NAMES + tuple(f"kvslim-{m}" for m in METHOD_NAMES) + tuple(OPTION_KINDS)
        for name, kinds in (("kinds", self.kinds), ("capacity_kinds", self.capacity_kinds)):
            bad = [k for k in kinds if k not in known]
            if bad or (name == "kinds" and not kinds):
                raise ValueError(f"{name}: unknown {bad or kinds!r}; choose from {', '.join(known)}")
        for point in self.points or ():
            if (not isinstance(point, tuple) or len(point) != 3 or point[0] not in SHAPES
                    or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in point[1:])):
                raise ValueError(f"points: each must be (shape in {', '.join(SHAPES)}, context > 0, batch > 0), "
                                 f"got {point!r}")

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline


def build_model(shape: str, device: str, dtype: torch.dtype = torch.bfloat16) -> LlamaForCausalLM:
    """A random-weight Llama of ``shape`` (:data:`SHAPES`) on ``device`` in ``dtype``, SDPA attention."""
    torch.manual_seed(0)
    cfg = LlamaConfig(max_position_embeddings=131072, attn_implementation="sdpa", **SHAPES[shape])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in dtype: an 8B model never exists in fp32 (32 GB) on the way
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).to(dtype).eval()
    finally:
        torch.set_default_dtype(default)


def _method_options(method: str, context: int) -> dict:
    """``kvslim.apply`` options of a table kind: each method's defaults; ``window`` (a Llama has no sliding window
    of its own) attends the last context/4 tokens; ``slim`` keeps K only."""
    return {"window": {"window": max(2, context // 4)}, "slim": {"cache": "k", "rank": 0}}.get(method, {})


def not_applicable(model, kind: str) -> str | None:
    """Why ``kind`` cannot run on ``model`` here (a method that does not apply, quanto missing), or ``None``."""
    if kind == "hf-quanto4":
        return quanto_missing()
    if kind.startswith("kvslim-"):
        return METHODS[method_of(kind)[0]].not_applicable(shape_from_config(model.config))
    return None


def method_of(kind: str, context: int = 0) -> tuple[str, dict]:
    """A kvslim kind's method and ``apply()`` options."""
    if kind in OPTION_KINDS:
        return OPTION_KINDS[kind]
    method = kind.removeprefix("kvslim-")
    return method, _method_options(method, context)


#: kvslim methods whose caches are built ``capturable=True`` for the compiled rows (CUDA graphs replay one step at
#: every length; the int4/int3/int2 defaults keep their window as a ring, caches/capture_residual.py; slim keeps its
#: rows in a fixed buffer read whole, caches/slim.py; window: a ring of W slots, caches/capture_ring.py)
CAPTURABLE = ("dense", "int8", "int4", "int3", "int2", "slim", "window")


def fill(model, kind: str, batch: int, context: int, room: int, capturable: bool = False):
    """A cache of ``kind`` holding ``context`` random tokens per sequence (through its own ``update``), room for
    ``room`` more; the model is applied (kvslim kinds) or restored (HF kinds) to match. ``capturable``: a kvslim
    cache of a :data:`CAPTURABLE` method built with ``capturable=True`` (the layout the compiled rows use)."""
    device = next(model.parameters()).device
    if kind in ("hf-static", "hf-dynamic"):
        return decode.make_filled_cache(model, kind, batch, context, room)
    api.restore(model)
    if kind == "hf-quanto4":
        from transformers import QuantizedCache

        cache = QuantizedCache(backend="quanto", config=model.config, nbits=4, q_group_size=64, residual_length=128)
        return _fill_kv(model, cache, batch, context, device)
    method, options = method_of(kind, context)
    with warnings.catch_warnings():  # random weights: slim's measured error warns
        warnings.simplefilter("ignore")
        api.apply(model, method, **options)
    cache = api.make_cache(model, max_length=context + room + 1, capturable=capturable and method in CAPTURABLE)
    if method == "slim":  # slim layers store one row per token (K), written directly
        pos = torch.arange(context, device=device)[None].expand(batch, -1)
        g = torch.Generator(device=device).manual_seed(0)
        dtype = next(model.parameters()).dtype
        for layer in cache.layers:
            layer.write(torch.randn(batch, context, layer.width, generator=g, device=device).to(dtype), pos)
        return cache
    return _fill_kv(model, cache, batch, context, device)


def _fill_kv(model, cache, batch: int, context: int, device) -> object:
    """Random keys (values: a copy) through ``cache.update``, :data:`FILL_CHUNK` tokens per call."""
    shape = shape_from_config(model.config)
    dtype = next(model.parameters()).dtype
    g = torch.Generator(device=device).manual_seed(0)
    for i in range(shape.num_layers):
        for start in range(0, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - start)
            k = torch.randn(batch, shape.num_kv_heads, n, shape.head_dim, generator=g, device=device).to(dtype)
            cache.update(k, k.clone(), i)
            del k
    return cache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compiled(model, mode: str):
    """``model`` under ``torch.compile(fullgraph=True)`` in ``mode`` (see :class:`Settings`)."""
    if mode == "eager-backend":
        return torch.compile(model, backend="eager", fullgraph=True)
    if mode == "cudagraphs":
        return torch.compile(model, backend="cudagraphs", fullgraph=True)
    return torch.compile(model, mode=mode, fullgraph=True)


@torch.inference_mode()
def run_steps(fn, cache, batch: int, start: int, steps: int, device: torch.device, graphs: bool) -> list[float]:
    """Seconds of ``steps`` greedy decode steps at positions ``start`` … (one token per sequence each)."""
    tok = torch.zeros(batch, 1, dtype=torch.long, device=device)
    times = []
    for i in range(steps):
        pos = torch.full((batch, 1), start + i, dtype=torch.long, device=device)
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        _sync(device)
        t0 = time.perf_counter()
        out = fn(tok, position_ids=pos, cache_position=pos[0], use_cache=True, **{CACHE_KW: cache})
        tok = out.logits[:, -1:].argmax(-1)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def cache_bytes(cache, context: int) -> int | None:
    """Bytes the cache holds for ``context`` tokens: kvslim's exact ``nbytes``; HF's K/V tensors up to ``context``;
    HF's quantized layers: every tensor of their quantized K/V objects plus the full-precision residual."""
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    total = 0
    for layer in cache.layers:
        quantized = [getattr(layer, a, None) for a in ("_quantized_keys", "_quantized_values")]
        if any(q is not None for q in quantized):
            total += sum(_tensor_bytes(q) for q in quantized)
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None)
            continue
        for t in (layer.keys, layer.values):
            if t is None or t.dim() < 3:
                continue
            total += t.numel() // t.shape[2] * t.element_size() * min(context, t.shape[2])
    return total


def _tensor_bytes(obj, depth: int = 0) -> int:
    """Bytes of the tensors an object holds (a quanto ``QBitsTensor``: data, scale, shift), two levels deep."""
    if obj is None or depth > 2:
        return 0
    if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
        return obj.numel() * obj.element_size()
    held = vars(obj) if hasattr(obj, "__dict__") else {}  # a tensor subclass: the plain tensors inside it
    return sum(_tensor_bytes(v, depth + 1) for v in held.values() if isinstance(v, torch.Tensor))


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"


def measure_kind(model, kind: str, batch: int, context: int, s: Settings, copy_gbps: float,
                 weights: int) -> list[dict]:
    """Records of ``kind`` eager (and compiled when ``s.compile_mode``) at one point; errors recorded, not raised."""
    device = next(model.parameters()).device
    base = {"context": context, "batch": batch}
    reason = not_applicable(model, kind)
    if reason:
        return [{**base, "kind": kind, "skipped": reason}]
    variants = [("eager", model)]
    if s.compile_mode and kind not in ("hf-dynamic", "hf-quanto4"):  # HF's dynamic caches are not compile targets
        variants.append((f"compiled:{s.compile_mode}", None))
    room = (s.warmup + s.rounds * s.steps) * len(variants) + 2
    _peak_reset(device)
    try:
        cache = fill(model, kind, batch, context, room)
        # compiled rows of a capturable method: a cache of its own, built capturable=True (filled the same way)
        own = len(variants) > 1 and kind.startswith("kvslim-") and method_of(kind, context)[0] in CAPTURABLE
        caches = {kind: cache, f"{kind}+compiled": fill(model, kind, batch, context, room, True) if own else cache}
    except Exception as e:  # noqa: BLE001 - a kind that cannot be built is a record, not the end of the run
        api.restore(model)
        return [{**base, "kind": kind, "error": _error(e), "where": traceback.format_exc()[-600:]}]
    stored = cache_bytes(cache, context)
    runs, records = {}, []
    at = {id(c): context for c in caches.values()}  # each cache's next position (a shared cache: one count)
    graphs = device.type == "cuda" and s.compile_mode in ("reduce-overhead", "cudagraphs")
    for name, fn in variants:
        label = kind if name == "eager" else f"{kind}+compiled"
        t0 = time.perf_counter()
        try:
            if fn is None:
                torch._dynamo.reset()
                torch._dynamo.utils.counters.clear()
                fn = compiled(model, s.compile_mode)
            first = run_steps(fn, caches[label], batch, at[id(caches[label])], s.warmup, device,
                              graphs and name != "eager")
            at[id(caches[label])] += s.warmup
            runs[label] = {"fn": fn, "times": [], "graphs": graphs and name != "eager",
                           "warmup_s": time.perf_counter() - t0, "first_step_s": first[0]}
        except Exception as e:  # noqa: BLE001
            records.append({**base, "kind": label, "error": _error(e), "where": traceback.format_exc()[-600:]})
    for _ in range(s.rounds):
        for label, run in list(runs.items()):
            try:
                c = caches[label]
                run["times"] += run_steps(run["fn"], c, batch, at[id(c)], s.steps, device, run["graphs"])
                at[id(c)] += s.steps
            except Exception as e:  # noqa: BLE001
                records.append({**base, "kind": label, "error": _error(e), "where": traceback.format_exc()[-600:]})
                runs.pop(label)
    peak = _peak(device)
    graphs_compiled = compile_counts()
    for label, run in runs.items():
        step = statistics.median(run["times"])
        read = weights + stored
        records.append({**base, "kind": label, "step_ms": 1e3 * step, "step_ms_all": [1e3 * t for t in run["times"]],
                        "tokens_per_s": batch / step, "cache_bytes": stored, "cache_gb": stored / 1e9,
                        "bytes_read_per_step": read, "read_gbps": read / step / 1e9,
                        "fraction_of_copy_bandwidth": read / step / 1e9 / copy_gbps,
                        "peak_bytes": peak, "warmup_s": run["warmup_s"], "first_step_s": run["first_step_s"]})
        if label != kind:  # compiled: how many graphs dynamo made over all its steps (1 = no recompilation)
            records[-1]["compile_counts"] = graphs_compiled
            records[-1]["capturable"] = caches[label] is not cache
    del cache, caches, runs
    api.restore(model)
    torch._dynamo.reset()
    _peak_reset(device)
    return records


def compile_counts() -> dict:
    """Dynamo's counters since the last clear: graphs and frames compiled (1 each: no recompilation), graph breaks,
    CUDA-graph skips (counted under their reason)."""
    c = torch._dynamo.utils.counters
    return {"unique_graphs": int(c["stats"]["unique_graphs"]), "frames_compiled": int(c["frames"]["total"]),
            "graph_breaks": int(sum(c["graph_break"].values())),
            "cudagraph_skips": {str(k): int(v) for k, v in c["inductor"].items() if "cudagraph" in str(k)}}


def _fits(model, kind: str, batch: int, context: int, s: Settings) -> tuple[bool, float | None]:
    """Whether a cache of ``kind`` at ``batch`` fills and decodes 2 steps; tokens/s over ``s.steps`` steps if so.
    On CUDA a ``torch.OutOfMemoryError`` says no; elsewhere the cache's allocated bytes against ``s.cpu_budget``."""
    device = next(model.parameters()).device
    cache = None
    try:
        cache = fill(model, kind, batch, context, s.steps + 3)
        if device.type != "cuda":
            held = getattr(cache, "allocated_nbytes", None) or cache_bytes(cache, context)
            if held > s.cpu_budget:
                return False, None
        run_steps(model, cache, batch, context, 2, device, False)
        times = run_steps(model, cache, batch, context + 2, s.steps, device, False)
        return True, batch / statistics.median(times)
    except torch.OutOfMemoryError:
        return False, None
    finally:
        del cache
        api.restore(model)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def capacity(model, kind: str, context: int, s: Settings) -> dict:
    """The largest batch (found by doubling, then bisection) whose ``kind`` cache fits, and tokens/s there."""
    reason = not_applicable(model, kind)
    if reason:
        return {"kind": kind, "context": context, "skipped": reason}
    lo, lo_tps, hi = 0, None, 1
    try:
        while True:  # doubling: lo fits, hi is the next try
            if s.out_of_time():
                return {"kind": kind, "context": context, "largest_batch": lo, "tokens_per_s": lo_tps,
                        "stopped": "budget: the deadline passed during the search (largest_batch is a lower bound)"}
            ok, tps = _fits(model, kind, hi, context, s)
            if not ok:
                break
            lo, lo_tps, hi = hi, tps, hi * 2
            if hi > s.max_batch:
                break
        while hi - lo > max(1, lo // 16) and not s.out_of_time():  # bisection to ~6 %
            mid = (lo + hi) // 2
            ok, tps = _fits(model, kind, mid, context, s)
            lo, lo_tps, hi = (mid, tps, hi) if ok else (lo, lo_tps, mid)
    except Exception as e:  # noqa: BLE001
        return {"kind": kind, "context": context, "error": _error(e), "largest_batch": lo}
    return {"kind": kind, "context": context, "largest_batch": lo, "tokens_per_s": lo_tps}


def run(s: Settings, progress=print) -> dict:
    """The whole table (and capacity) as one JSON-ready dict: ``bandwidth``, ``records``, ``capacity``."""
    from .roofline import measure_bandwidth

    device = torch.device(s.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda asked for, but torch sees no CUDA device")
    bw = measure_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" and not s.quick else 32 << 20,
                           trials=10 if not s.quick else 3)
    progress(f"copy bandwidth (read + write) {bw['copy_gbps']:.0f} GB/s")
    records, cap = [], []
    for shape, context, batch in s.points or (QUICK_POINTS if s.quick else POINTS):
        if s.out_of_time():
            records.append({"point": shape, "context": context, "batch": batch, "kind": "*",
                            "skipped": "budget: the deadline passed before this point"})
            continue
        model = build_model(shape, s.device)
        weights = decode.weight_bytes(model)
        for kind in s.kinds:
            if s.out_of_time():
                records.append({"point": shape, "context": context, "batch": batch, "kind": kind,
                                "skipped": "budget: the deadline passed before this kind"})
                progress(_line(records[-1]))
                continue
            for rec in measure_kind(model, kind, batch, context, s, bw["copy_gbps"], weights):
                rec.update(point=shape, weights_bytes=weights)
                records.append(rec)
                progress(_line(rec))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if s.capacity:
        shape, context = QUICK_CAPACITY if s.quick else CAPACITY
        model = build_model(shape, s.device)
        for kind in s.capacity_kinds:
            rec = {**capacity(model, kind, context, s), "point": shape}
            cap.append(rec)
            progress(f"capacity {shape} ctx {context} {kind}: {rec.get('largest_batch')} sequences, "
                     f"{rec.get('tokens_per_s') or 0:.1f} tok/s {rec.get('skipped') or rec.get('error') or ''}")
        del model
    return {"bandwidth": bw, "settings": {k: v for k, v in vars(s).items() if k not in ("kinds", "deadline")}
            | {"kinds": s.kinds},
            "records": records, "capacity": cap, "gpu": torch.cuda.get_device_name(device) if device.type == "cuda"
            else None}


def _line(rec: dict) -> str:
    head = f"{rec['point']:12s} b{rec['batch']:<3d} ctx {rec['context']:6d} {rec['kind']:32s}"
    if "skipped" in rec:
        return f"{head} not run: {rec['skipped']}"
    if "error" in rec:
        return f"{head} failed: {rec['error']}"
    return (f"{head} {rec['step_ms']:9.2f} ms  {rec['cache_gb']:7.3f} GB  {rec['read_gbps']:8.1f} GB/s "
            f"({100 * rec['fraction_of_copy_bandwidth']:.0f}% of copy)")


def markdown(doc: dict) -> str:
    """The table: one row per (point, kind), step ms and the ratio to HF static eager of the same point."""
    lines = ["| point | kind | step ms | × HF static eager | cache | read GB/s | % of copy | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    ok = [r for r in doc["records"] if "step_ms" in r]
    base = {(r["point"], r["batch"]): r["step_ms"] for r in ok if r["kind"] == "hf-static"}
    for r in doc["records"]:
        if "step_ms" not in r:
            why = r.get("skipped") or r.get("error")
            lines.append(f"| {r['point']} | {r['kind']} | {'skipped' if 'skipped' in r else 'failed'}: {why} "
                         "| | | | | |")
            continue
        b = base.get((r["point"], r["batch"]))
        peak = human_bytes(r["peak_bytes"])
        lines.append(f"| {r['point']} | {r['kind']} | {r['step_ms']:.2f} | {b / r['step_ms']:.2f} |" if b else
                     f"| {r['point']} | {r['kind']} | {r['step_ms']:.2f} | - |")
        lines[-1] += (f" {human_bytes(r['cache_bytes'])} | {r['read_gbps']:.0f} | {100 * r['fraction_of_copy_bandwidth']:.0f} "
                      f"| {peak} |")
    if doc["capacity"]:
        lines += ["", "| capacity point | kind | largest batch | tokens/s |", "|---|---|---|---|"]
        for c in doc["capacity"]:
            tps = c.get("tokens_per_s")
            lines.append(f"| {c['point']} ctx {c['context']} | {c['kind']} | {c.get('largest_batch', '-')} | "
                         f"{'-' if tps is None else f'{tps:.1f}'} |")
    return "\n".join(lines)


def plot(doc: dict, path) -> None:
    """Step ms per kind and point (log scale), and the capacity bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = list(dict.fromkeys(r["point"] for r in doc["records"]))
    n = len(points) + (1 if doc["capacity"] else 0)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n, 4.8), squeeze=False)
    for ax, point in zip(axes[0], points):
        rows = [r for r in doc["records"] if r["point"] == point and "step_ms" in r]
        ax.barh([r["kind"] for r in rows], [r["step_ms"] for r in rows],
                color=["tab:gray" if r["kind"].startswith("hf") else "tab:blue" for r in rows])
        ax.set_xscale("log")
        ax.set_xlabel("decode step (ms, lower is better)")
        first = rows[0] if rows else {"context": "?", "batch": "?"}
        ax.set_title(f"{point}, {first['context']} × {first['batch']}", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3, axis="x")
    if doc["capacity"]:
        ax = axes[0][-1]
        rows = [c for c in doc["capacity"] if c.get("largest_batch")]
        ax.barh([c["kind"] for c in rows], [c["largest_batch"] for c in rows], color="tab:green")
        ax.set_xlabel("largest batch that fits")
        ax.set_title(f"capacity, {rows[0]['point']} ctx {rows[0]['context']}" if rows else "capacity", fontsize=9)
        ax.tick_params(labelsize=7)
    gpu = doc.get("gpu") or "cpu"
    fig.suptitle(f"kvslim decode on {gpu} ({doc.get('environment', {}).get('commit', '')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

