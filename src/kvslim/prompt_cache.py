"""Compressed prompt caches as files: ``kvslim.save_cache`` / ``load_cache`` (docs/prompt_cache.md, issue 44).

One safetensors file (loads without executing code; tensors are read through safetensors' mmap backend): the
cache's tensors as tensors, only the token slots that hold data (``caches/state.py``), and under the metadata key
``kvslim`` one JSON object: the format, the method and its options (tensor options such as calibrated
``key_scales`` are tensors too), the model's identity (as the per-layer calibration files': name, config hash,
``k_proj`` norms, plus the norm of 1,024 rows of the input embedding), the token ids the cache holds, the cache's
state tree, a BLAKE2b digest of the header and every tensor's bytes, and the kvslim / transformers that wrote it.

``load_cache(path, model)`` refuses, naming what differs and what would work, a file for another model (config or
weights), method or dtype, a cache layout this kvslim / transformers does not build, an unknown format version, a
truncated or corrupted file; nothing is changed then. Saving refuses a cache holding inf/nan. Writes go to a
temporary file in the target folder, renamed over ``path`` when complete.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import secrets
from pathlib import Path
from typing import NamedTuple

import torch

from .caches.state import Decoder, Encoder, StateError
from .per_layer_file import NORM_RTOL, config_hash, k_norms

FORMAT = "kvslim.prompt_cache/2"  # /2: the digest covers the header too (/1: the tensors only)
FORMAT_PREFIX = "kvslim.prompt_cache/"
META_KEY = "kvslim"
REMAKE = "re-create it for this model with kvslim cache-prompt (or kvslim.save_cache)"
#: generate() options that run assisted decoding (its first verify step needs the ids past the cache only)
ASSISTED = frozenset({"prompt_lookup_num_tokens", "assistant_model", "assistant_early_exit"})


class PromptCache(NamedTuple):
    """What :func:`load_cache` gives: the cache, the token ids it holds (B, T) int64, and the file's metadata."""

    cache: object
    token_ids: torch.Tensor
    meta: dict

    def generate(self, model, input_ids: torch.Tensor, *, reuse_prefix: bool = True, **kwargs):
        """``model.generate(input_ids, **kwargs)`` continuing this cache.

        ``input_ids`` (B, T') of the file's batch: with ``reuse_prefix`` (the default) the cache is first trimmed to
        the longest prefix it shares with ``input_ids`` (:meth:`common_prefix`; as llama.cpp's ``--prompt-cache``
        and mlx-lm's ``trim_prompt_cache`` do), so an edited document, or a question tokenized together with the
        document (tokens can merge across the boundary), continues from the last token that still agrees;
        ``reuse_prefix=False`` refuses ids that do not start with the file's ``token_ids`` (:func:`check_prefix`).
        The cache must still hold exactly the file's tokens (a cache a previous call extended is refused: load the
        file again); ``max_new_tokens`` more must fit (:func:`check_room`). ``ValueError`` naming the argument,
        nothing run or trimmed. A trimmed int4/int3/int2/turbo cache keeps the coded rows before the cut where a
        fresh prefill of the shorter text would still hold its last ~128 rows in full precision."""
        from .adapters.compat import CACHE_KW

        held = self.token_ids.shape[1]
        now = int(self.cache.get_seq_length())
        if now != held:
            raise ValueError(f"this prompt cache holds {now} tokens, not its file's {held}: a previous generate "
                             "extended it; load the file again (kvslim.load_cache) for each new question")
        if reuse_prefix:
            keep = self.common_prefix(input_ids)
        else:
            check_prefix(self, input_ids)
            keep = held
        new = kwargs.get("max_new_tokens")
        check_room(self, model, max(0, input_ids.shape[1] - held + (new if isinstance(new, int) else 0)))
        if keep < held:
            self.trim(keep)
        if not ASSISTED.intersection(kwargs):
            return model.generate(input_ids, **{CACHE_KW: self.cache}, **kwargs)
        # transformers' assisted decoding feeds its first verify step every id, whatever the cache holds (5.24:
        # ``next_sequence_length=None`` on the first iteration), so a prefilled cache got the prompt a second time
        # (measured: 299 cached + 300 ids -> 606 tokens after 8 new ones). Fed only the ids past the cache instead.
        original = model.prepare_inputs_for_generation
        cache = self.cache

        @functools.wraps(original)  # generate() checks its kwargs against this signature
        def prepare(ids, *args, next_sequence_length=None, is_first_iteration=False, **kw):
            held_now = int(cache.get_seq_length())
            if is_first_iteration and next_sequence_length is None and 0 < held_now < ids.shape[1]:
                next_sequence_length = ids.shape[1] - held_now
            return original(ids, *args, next_sequence_length=next_sequence_length,
                            is_first_iteration=is_first_iteration, **kw)

        own = model.__dict__.get("prepare_inputs_for_generation")
        model.prepare_inputs_for_generation = prepare
        try:
            return model.generate(input_ids, **{CACHE_KW: self.cache}, **kwargs)
        finally:
            if own is None:
                del model.prepare_inputs_for_generation  # the class's own again
            else:
                model.prepare_inputs_for_generation = own

    def common_prefix(self, input_ids: torch.Tensor) -> int:
        """Tokens of this cache that ``input_ids`` (B, T') can reuse: the longest prefix every sequence shares with
        the file's ``token_ids``, at most T' − 1 (``generate`` needs one token to feed). ``ValueError`` for ids
        that are not a (B, T' ≥ 1) integer tensor of the file's batch."""
        held = self.token_ids
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
            raise ValueError(f"input_ids must be a (batch, tokens) integer tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if input_ids.shape[0] != held.shape[0] or input_ids.shape[1] < 1:
            raise ValueError(f"input_ids must be ({held.shape[0]}, at least 1 token): the prompt cache holds "
                             f"{held.shape[0]} sequence(s), got {tuple(input_ids.shape)}")
        n = min(held.shape[1], input_ids.shape[1] - 1)
        differ = (input_ids[:, :n].to(held.device) != held[:, :n]).any(0)
        return int(differ.int().argmax()) if bool(differ.any()) else n

    def trim(self, tokens: int) -> None:
        """Keep the cache's first ``tokens`` tokens (a crop); ``ValueError`` naming why, nothing changed, for a
        count outside [0, held] or a cache whose layers cannot rewind (sliding-window rings, a capturable residual
        layout): those continue only from the file's end."""
        from .caches.dense import AppendLayer

        held = int(self.cache.get_seq_length())
        if not isinstance(tokens, int) or isinstance(tokens, bool) or not 0 <= tokens <= held:
            raise ValueError(f"tokens must be an int in [0, {held}] (the cache's tokens to keep), got {tokens!r}")
        if tokens == held:
            return
        layers = _layers(self.cache)
        stuck = [i for i, layer in enumerate(layers) if not isinstance(layer, AppendLayer)
                 or layer._residual_static()]
        if stuck or hasattr(self.cache, "cross_attention_cache"):
            raise ValueError(f"this prompt cache cannot be trimmed to {tokens} of its {held} tokens: layer(s) "
                             f"{stuck[:8]} are ring buffers or a capturable residual layout, which continue only from "
                             "the file's end; start input_ids with PromptCache.token_ids (or pass reuse_prefix=False "
                             "to be told where they differ)")
        self.cache.crop(tokens - held)


def model_identity(model, name: str | None = None) -> dict:
    """Name, config hash, layer count, per-layer ``k_proj`` norms and the input embedding's norm of ``model``."""
    cfg = model.config
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    return {"model": name or getattr(cfg, "_name_or_path", "") or cfg.model_type, "config_hash": config_hash(model),
            "num_layers": getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "decoder_layers", None),
            "k_norms": k_norms(model),
            "embed_norm": None if weight is None else _sample_norm(weight),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def _sample_norm(weight: torch.Tensor, rows: int = 1024) -> float:
    """Norm (float64) of about ``rows`` evenly spaced rows of ``weight``: tells two checkpoints apart without
    reading a 150k-token embedding on every load."""
    w = weight.detach()
    return float(w[::max(1, w.shape[0] // rows)].double().norm())


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= NORM_RTOL * max(abs(a), abs(b), 1e-30)


def check_identity(saved: dict, model, where: str) -> None:
    """``ValueError`` naming what differs between the model a file was written for (``saved``) and ``model``."""
    mine = model_identity(model)
    theirs, here = saved.get("model"), mine["model"]
    if saved.get("config_hash") != mine["config_hash"]:
        raise ValueError(f"{where}: written for model {theirs!r} (config {saved.get('config_hash')}, "
                         f"{saved.get('num_layers')} layers), not this model {here!r} (config {mine['config_hash']}, "
                         f"{mine['num_layers']} layers): load it with the model it was written for, or {REMAKE}")
    if saved.get("dtype") != mine["dtype"]:
        raise ValueError(f"{where}: written for model {theirs!r} in {saved.get('dtype')}, this model is in "
                         f"{mine['dtype']}: load the model in {saved.get('dtype')}, or {REMAKE}")
    pairs = list(zip(saved.get("k_norms") or [], mine["k_norms"] or []))
    if saved.get("embed_norm") is not None and mine["embed_norm"] is not None:
        pairs.append((saved["embed_norm"], mine["embed_norm"]))
    for i, (a, b) in enumerate(pairs):
        if not _close(a, b):
            what = "input embedding" if i == len(pairs) - 1 and len(pairs) > len(saved.get("k_norms") or []) \
                else f"layer {i} k_proj"
            raise ValueError(f"{where}: written for model {theirs!r}, whose {what} weights differ from this model's "
                             f"{here!r} (norm {a:.6g} vs {b:.6g}): the same architecture, other weights. Load it with "
                             f"the model it was written for, or {REMAKE}")


def _digest(tensors: dict[str, torch.Tensor], meta: dict) -> str:
    """BLAKE2b of the metadata (every field but ``digest``: the state tree, method, options, identity) and of every
    tensor's name, dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({k: v for k, v in meta.items() if k != "digest"}, sort_keys=True, allow_nan=False).encode())
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}|{str(t.dtype)}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def _caches(cache) -> list:
    """The kvslim caches inside ``cache`` (itself, or an encoder-decoder cache's self-attention half)."""
    inner = getattr(cache, "self_attention_cache", None)
    return [cache] + ([inner] if inner is not None else [])


def _layers(cache) -> list:
    out = []
    for c in _caches(cache):
        out.extend(getattr(c, "layers", []))
    cross = getattr(cache, "cross_attention_cache", None)
    return out + list(getattr(cross, "layers", []))


def check_finite(cache) -> None:
    """``ValueError`` naming the layer when the cache holds inf/nan: the flags of quantized stores (their writes
    are checked, caches/storage.py) and the live tokens of plain stores and encoder outputs, read back."""
    for i, layer in enumerate(_layers(cache)):
        try:
            if hasattr(layer, "raise_deferred"):
                layer.raise_deferred()
        except ValueError as e:
            raise ValueError(f"layer {i}: {e}") from None
        live = []
        if getattr(layer, "enc", None) is not None:
            live.append(layer.enc)
        slots = layer.file_slots() if hasattr(layer, "file_slots") else None
        for store in layer._stores() if hasattr(layer, "_stores") and slots else ():
            if not store.spec.bits:  # a coded store refused inf/nan at its write
                live.append(store.read(0, slots))
        for x in live:
            if not bool(torch.isfinite(x).all()):
                raise ValueError(f"layer {i} holds a non-finite value (inf/nan) among its cached tokens: a prompt "
                                 "cache file must continue a generation, and this cache cannot; nothing was written. "
                                 "Run the model in float32 (or bfloat16) so that the prefill does not overflow")


def _umask() -> int:
    """The process's umask, read without setting it (``os.umask`` changes process-wide state): Linux's
    ``/proc/self/status``, else the common 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _batch(cache) -> int | None:
    """Sequences the cache holds (from its first filled layer's stores), ``None`` when no layer says."""
    for layer in _layers(cache):
        stores = layer._stores() if hasattr(layer, "_stores") and getattr(layer, "is_initialized", False) else []
        for store in stores:
            tensors = store.tensors()
            if tensors:
                return int(tensors[0].shape[0])
    return None


def _max_length(cache) -> int | None:
    lengths = [layer.max_length for layer in _layers(cache) if getattr(layer, "max_length", None)]
    return min(lengths) if lengths else None


def save_cache(cache, path, model, token_ids: torch.Tensor, *, name: str | None = None, text: str | None = None,
               extra: dict | None = None) -> Path:
    """Write ``cache`` (a kvslim cache ``model`` filled with ``token_ids`` (B, T)) to ``path`` (module docstring).

    ``name``: the model's name in the file and in refusals. ``text``: an optional note (e.g. the source file).
    ``extra``: JSON values kept under ``meta["extra"]`` (``kvslim cache-prompt --chat`` keeps the template's tail).
    ``ValueError`` naming the argument, nothing written, for a cache that is not kvslim's, token ids that are not
    the cache's length, a cache holding inf/nan, or a folder that does not exist. Returns the path written.
    """
    from safetensors.torch import save_file

    from ._version import __version__
    from .api import check_model, get_plan

    check_model(model)
    plan = getattr(cache, "plan", None) or get_plan(model)
    if not hasattr(cache, "get_seq_length") or plan is None or not type(cache).__module__.startswith("kvslim."):
        raise ValueError(f"cache must be a kvslim cache (kvslim.make_cache(model)), got {type(cache).__name__}")
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 2 or token_ids.dtype.is_floating_point:
        raise ValueError("token_ids must be the (batch, tokens) integer tensor the cache was filled with")
    held = int(cache.get_seq_length())
    if token_ids.shape[1] != held:
        raise ValueError(f"token_ids holds {token_ids.shape[1]} tokens, the cache {held}: pass the ids of the "
                         "prefill that filled it")
    batch = _batch(cache)
    if batch is not None and token_ids.shape[0] != batch:
        raise ValueError(f"token_ids holds {token_ids.shape[0]} sequences, the cache {batch}: pass the ids of the "
                         "prefill that filled it")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"path: {str(path)!r} is a folder; give a file name (e.g. doc.kvslim)")
    if not path.parent.is_dir():
        raise ValueError(f"path: no folder {str(path.parent)!r} to write {path.name!r} into")
    check_finite(cache)
    enc = Encoder()
    try:
        tree = enc.encode(cache, "cache")
        options = enc.encode(dict(plan.options), "options")
    except StateError as e:
        raise ValueError(f"cache: {e}") from None
    tensors = dict(enc.tensors)
    tensors["token_ids"] = token_ids.detach().to(torch.int64).cpu().contiguous()
    import transformers

    meta = {"format": FORMAT, "method": plan.method, "options": options, "identity": model_identity(model, name),
            "tokens": held, "batch": int(token_ids.shape[0]), "max_length": _max_length(cache),
            "nbytes": int(getattr(cache, "nbytes", 0)), "layers": [lp.technique for lp in getattr(plan, "layers", ())],
            "text": text, "extra": dict(extra or {}), "kvslim": __version__, "transformers": transformers.__version__,
            "cache": tree}
    meta = json.loads(json.dumps(meta, allow_nan=False))  # as a reader will see it (keys as strings, lists)
    meta["digest"] = _digest(tensors, meta)
    tmp = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp"
    try:
        save_file(tensors, tmp, metadata={META_KEY: json.dumps(meta, allow_nan=False)})
        os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates it 0600: the mode any new file gets instead
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def prefill(model, ids: torch.Tensor, cache, chunk: int = 512, progress=None) -> torch.Tensor:
    """Fill ``cache`` with ``ids`` (B, T) through ``model``, ``chunk`` tokens per forward pass (a long prompt's
    activations stay small); ``progress(done, total)`` after each pass. Returns the last position's logits (B, V)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    from .adapters.compat import CACHE_KW

    total, logits = ids.shape[1], None
    with torch.no_grad():
        for start in range(0, total, chunk):
            part = ids[:, start:start + chunk]
            logits = model(part, use_cache=True, logits_to_keep=1, **{CACHE_KW: cache}).logits[:, -1]
            if progress is not None:
                progress(start + part.shape[1], total)
    return logits


def read_meta(path) -> dict:
    """The metadata of the prompt cache file at ``path``; ``FileNotFoundError`` for a missing path, ``ValueError``
    naming a file that is not one (another format, a truncated or hand-broken header)."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no prompt cache file {str(p)!r}")
    try:
        with safe_open(str(p), "pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
    except Exception as e:  # a foreign or truncated file, a broken header
        raise ValueError(f"{str(p)!r} is not a readable kvslim prompt cache ({type(e).__name__}: {e}); "
                         f"{REMAKE}") from None
    if not isinstance(meta, dict) or not str(meta.get("format", "")).startswith(FORMAT_PREFIX):
        raise ValueError(f"{str(p)!r} is a safetensors file but not a kvslim prompt cache (no {FORMAT!r} metadata); "
                         f"{REMAKE}")
    if meta["format"] != FORMAT:
        raise ValueError(f"{str(p)!r} is prompt cache format {meta['format']!r} (written by kvslim "
                         f"{meta.get('kvslim')}); this kvslim reads {FORMAT!r}: {REMAKE}")
    return meta


def _plan_for(meta: dict, model, where: str, options: dict):
    """The plan the file's cache is rebuilt with: the model's own when it runs the file's method and options (a
    ``ValueError`` when it runs others), else the file's method planned for ``model`` (nothing applied yet)."""
    from . import api
    from .methods import METHODS

    plan = api.get_plan(model)
    method = meta["method"]
    if plan is None:
        if method not in METHODS:
            raise ValueError(f"{where}: method {method!r} is not one of this kvslim's ({sorted(METHODS)}); {REMAKE}")
        return api._plan_model(METHODS[method], model, **options)  # validates, changes nothing
    if plan.method != method or not _same_options(plan.options, options):
        raise ValueError(f"{where}: a {method} cache with options {_show(options)}, but this model runs "
                         f"{plan.method} with {_show(plan.options)}: kvslim.restore(model) first (load_cache applies "
                         f"the file's method), or kvslim.apply(model, {method!r}, **{_show(options)})")
    return plan


def _show(options: dict) -> str:
    return "{" + ", ".join(f"{k}={'<tensor>' if isinstance(v, torch.Tensor) else repr(v)}"
                           for k, v in options.items()) + "}"


def _same_options(a, b) -> bool:
    ea, eb = Encoder(), Encoder()
    ta, tb = ea.encode(dict(a), "o"), eb.encode(dict(b), "o")
    return ta == tb and all(torch.equal(ea.tensors[k], eb.tensors[k]) for k in ea.tensors)


def _check_layout(cache, fresh, meta: dict, where: str) -> None:
    """``ValueError`` when the decoded cache's classes or attributes differ from what this kvslim and transformers
    build for the same plan (``fresh``): a file from another transformers cache layout."""
    import transformers

    mine, theirs = _layers(fresh), _layers(cache)
    if len(mine) != len(theirs) or type(fresh) is not type(cache):
        raise ValueError(f"{where}: {type(cache).__name__} of {len(theirs)} layers, this model's plan builds "
                         f"{type(fresh).__name__} of {len(mine)}; {REMAKE}")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        missing = sorted(set(vars(a)) - set(vars(b)))
        if type(a) is not type(b) or missing:
            what = (f"a {type(b).__name__}, this one builds {type(a).__name__}" if type(a) is not type(b)
                    else f"lacks {missing}")
            raise ValueError(f"{where}: layer {i} of the file's cache {what} (file written with transformers "
                             f"{meta.get('transformers')}, kvslim {meta.get('kvslim')}; this is transformers "
                             f"{transformers.__version__}): another cache layout; {REMAKE}")


def load_cache(path, model, *, verify: bool = True) -> PromptCache:
    """The cache saved at ``path`` for ``model`` (module docstring), ready to continue ``model.generate``:
    pass ``token_ids`` followed by the new tokens as ``input_ids`` and the cache as ``past_key_values``.

    ``model`` gets the file's method (``kvslim.apply``) when it runs none, once every check passed (a refused load
    changes nothing). ``verify``: check the header's and the tensors' digest
    (reads every byte once). The file is only read: a loaded cache owns copies of what it changes.
    """
    from safetensors import safe_open

    from .adapters.generate import build_cache
    from .api import apply, check_model, get_plan

    check_model(model)
    meta = read_meta(path)
    where = str(path)
    check_identity(meta.get("identity") or {}, model, where)
    device = next(model.parameters()).device
    try:
        with safe_open(str(path), "pt") as f:
            tensors = {k: _aligned(f.get_tensor(k)) for k in f.keys()}
        if verify and _digest(tensors, meta) != meta.get("digest"):
            raise ValueError("the digest of its header and tensors differs from the one written (the file was "
                             "changed or damaged)")
        options = Decoder(tensors, device).decode(meta["options"], "options")
    except (ValueError, StateError, KeyError, RuntimeError, OSError) as e:
        raise ValueError(f"{where}: a damaged prompt cache ({type(e).__name__}: {e}); {REMAKE}") from None
    limit = getattr(model.config, "max_position_embeddings", None)
    for name in ("max_length", "tokens"):  # sizes a cache is built with: never past what the model can place
        value = meta.get(name)
        if value is not None and (not isinstance(value, int) or value < 0 or (limit and value > limit)):
            raise ValueError(f"{where}: {name}={value!r} in the file is beyond the model's max_position_embeddings "
                             f"({limit}); {REMAKE}")
    applied = get_plan(model) is not None
    plan = _plan_for(meta, model, where, options)
    dec = Decoder(tensors, device, layer_devices(model))
    try:
        cache = dec.decode(meta["cache"], "cache")
    except (StateError, KeyError, TypeError, RuntimeError) as e:
        raise ValueError(f"{where}: a cache this kvslim cannot rebuild ({type(e).__name__}: {e}); {REMAKE}") from None
    _check_layout(cache, build_cache(model, plan, meta.get("max_length")), meta, where)
    if not applied:  # every check passed: now the model gets the file's method
        plan = apply(model, meta["method"], **options)
    for c in _caches(cache):
        c.plan = plan
    ids = tensors["token_ids"].to(device)
    return PromptCache(cache, ids, meta)


def layer_devices(model) -> list[torch.device] | None:
    """The device of each decoder layer of a model split over devices (``device_map``: each layer's cache belongs
    beside its weights), ``None`` when every layer sits on one device (or the layers cannot be found)."""
    stack = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(stack, "layers", None)
    if layers is None:
        return None
    devices = [next((p.device for p in layer.parameters()), None) for layer in layers]
    if any(d is None for d in devices) or len(set(devices)) < 2:
        return None
    return devices


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in memory of its own, 64-byte aligned as torch allocates it: a tensor read from the file can sit at any
    offset of the file's buffer, and CPU kernels round a product's last bit differently on unaligned rows (a turbo
    cache's rotation read at offset 24 made every step after the first 2-4e-7 away from the never-saved cache)."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def check_prefix(prompt: PromptCache, input_ids) -> None:
    """``ValueError`` unless ``input_ids`` is a (B, T') int tensor of the file's batch whose first T tokens are the
    file's ``token_ids`` and T' > T."""
    held = prompt.token_ids
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be a (batch, tokens) integer tensor, got "
                         f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if input_ids.shape[0] != held.shape[0] or input_ids.shape[1] <= held.shape[1]:
        raise ValueError(f"input_ids must be ({held.shape[0]}, more than {held.shape[1]}): the prompt cache's "
                         f"{held.shape[1]} tokens and the new ones, got {tuple(input_ids.shape)}")
    same = input_ids[:, :held.shape[1]].to(held.device) == held
    if not bool(same.all()):
        first = int((~same).any(0).int().argmax())
        raise ValueError(f"input_ids differ from the prompt cache's tokens at position {first} of "
                         f"{held.shape[1]}: start input_ids with PromptCache.token_ids (tokenize the question on its "
                         "own and append it; tokenizing document and question together can merge tokens across "
                         "the boundary)")


def check_room(prompt: PromptCache, model, new_tokens: int) -> None:
    """``ValueError`` when ``new_tokens`` more tokens (question and answer) after the cached prefix exceed the
    model's ``max_position_embeddings`` or the cache's ``max_length``, naming the limit and what fits; ``ValueError``
    naming ``new_tokens`` unless it is an int ≥ 0."""
    if not isinstance(new_tokens, int) or isinstance(new_tokens, bool) or new_tokens < 0:
        raise ValueError(f"new_tokens must be an int >= 0 (the question's and the answer's tokens), got {new_tokens!r}")
    held = prompt.token_ids.shape[1]
    limits = [("the model's max_position_embeddings", getattr(model.config, "max_position_embeddings", None)),
              ("the cache's max_length", _max_length(prompt.cache))]
    for what, limit in limits:
        if limit is not None and held + new_tokens > limit:
            raise ValueError(f"the prompt cache holds {held} tokens; {new_tokens} more (question + answer) make "
                             f"{held + new_tokens}, beyond {what} ({limit}): at most {max(0, limit - held)} more fit "
                             "(shorten the question or --max-new-tokens, or cache a shorter text)")
