"""Per-layer options chosen on a calibration text: ``kvslim.calibrate`` (docs/quantization.md §12).

One prefill of the calibration text captures every layer's queries, keys and values (post-RoPE, as the cache
sees them). For each layer and each candidate coding (e.g. keys rotated or not), the layer's keys and values are
written into that coding's own cache layer (the plan's factory: the same stores, sinks and full-precision window a
run uses) and read back; the proxy is the relative squared error of the layer's attention output,
``Σ‖softmax(q K̂ᵀ) V̂ − softmax(q Kᵀ) V‖² / Σ‖softmax(q Kᵀ) V‖²``, over the last ``queries`` queries of the prefill,
causal, every query head. The layer takes the candidate with the lower error. The result is a ``per_layer`` dict
for ``kvslim.apply`` / ``plan`` (plain ints, strings and dicts: it pickles and prints).

Why the attention output and not the keys' error: key reconstruction error does not predict the rotation's effect
(§9: rotated keys have more squared error on both models, yet lower KL on SmolLM2 and higher on Qwen2.5); what
attention does with the error depends on the queries.
"""

from __future__ import annotations

import torch


def capture_qkv(model, ids: torch.Tensor, each=None) -> list:
    """Per decoder layer, the prefill's (q, k, v) as (B, H, S, D), (B, Hk, S, D), (B, Hk, S, D) in fp32, RoPE
    applied to q and k (Llama-style attention: ``q_proj``/``k_proj``/``v_proj`` and ``position_embeddings``; a
    layer's ``q_norm``/``k_norm`` first where it has them, as Qwen3 and Gemma 3). With ``each``: the results of
    ``each(layer, q, k, v)`` instead (nothing kept: long texts, large models)."""
    layers = model.model.layers
    got: dict[int, object] = {}

    def hook(mod, args, kwargs, i):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        b, s, _ = h.shape
        d = mod.head_dim
        q, k = mod.q_proj(h).view(b, s, -1, d), mod.k_proj(h).view(b, s, -1, d)
        if getattr(mod, "q_norm", None) is not None:  # Qwen3, Gemma 3: per-head norms before RoPE
            q = mod.q_norm(q)
        if getattr(mod, "k_norm", None) is not None:
            k = mod.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = mod.v_proj(h).view(b, s, -1, d).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        got[i] = (q.float(), k.float(), v.float()) if each is None else each(i, q.float(), k.float(), v.float())

    handles = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: hook(mod, args, kwargs, i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if len(got) != len(layers):
        raise ValueError(f"calibration captured {len(got)} of the model's {len(layers)} attention layers")
    return [got[i] for i in range(len(layers))]


def check_ids(ids) -> None:
    """``ValueError`` naming ``ids`` unless it is a (1, T) tensor of token ids."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1 or ids.is_floating_point():
        raise ValueError(f"ids must be a (1, T) tensor of token ids, got "
                         f"{tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__}")


def check_model(model, what: str) -> None:
    """``ValueError`` naming ``model`` unless its layers have the Llama-style attention :func:`capture_qkv` reads."""
    attn = getattr(getattr(getattr(model, "model", None), "layers", [None])[0], "self_attn", None)
    if attn is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "head_dim")):
        raise ValueError(f"model: {what} needs Llama-style attention (model.model.layers[i].self_attn with "
                         f"q_proj, k_proj, v_proj), got {type(model).__name__}")


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's ``apply_rotary_pos_emb`` for one tensor (rotate-half convention; partial rotary keeps the rest)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    r = cos.shape[-1]
    xr, rest = x[..., :r], x[..., r:]
    half = torch.cat((-xr[..., r // 2:], xr[..., :r // 2]), dim=-1)
    return torch.cat((xr * cos + half * sin, rest), dim=-1)


def stored_kv(factory, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``, ``v`` written into a fresh cache layer from ``factory`` (one prefill call) and read back as stored."""
    layer = factory(None)
    layer.update(k, v)
    n = k.shape[2]
    return layer.k_store.read(0, n).float(), layer.v_store.read(0, n).float()


def attention_error(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor, v_hat: torch.Tensor,
                    queries: int, scale: float) -> float:
    """Relative squared error of causal attention outputs over the last ``queries`` queries (all heads)."""
    b, h, s, d = q.shape
    g = h // k.shape[1]
    qq = q[:, :, s - queries:].unflatten(1, (-1, g))  # (B, Hk, G, Q, D)
    pos = torch.arange(s - queries, s).unsqueeze(1)
    mask = torch.arange(s).unsqueeze(0) > pos  # (Q, S): keys after the query
    outs = []
    for kk, vv in ((k, v), (k_hat, v_hat)):
        w = torch.einsum("bkgqd,bksd->bkgqs", qq, kk) * scale
        w = w.masked_fill(mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("bkgqs,bksd->bkgqd", w, vv))
    return ((outs[1] - outs[0]) ** 2).sum().item() / (outs[0] ** 2).sum().clamp_min(1e-30).item()


def layer_errors(model, ids: torch.Tensor, method: str, candidates, queries: int = 256, **options
                 ) -> list[list[float]]:
    """``errors[layer][c]``: the attention-output error (module docstring) of candidate ``c`` (a dict of per-layer
    options over ``options``) in each layer, on the prefill of ``ids``."""
    from .methods import METHODS

    n = len(model.model.layers)
    base = dict(options.pop("per_layer", None) or {})
    plans = []
    for c in candidates:
        per_layer = {**base, **{i: {**base.get(i, {}), **c} for i in range(n)}} if c else base
        plans.append(METHODS[method].plan_model(model, **options, **({"per_layer": per_layer} if per_layer else {})))
    for lp in plans[0].layers:
        if lp.window is not None:
            raise ValueError(f"calibrate covers append-only layers; layer {lp.index} of this {method} plan is a ring of "
                             f"{lp.window} tokens (the model's sliding window or window=)")
    out = []
    for i, (q, k, v) in enumerate(capture_qkv(model, ids)):
        if not (torch.isfinite(k).all() and torch.isfinite(v).all() and torch.isfinite(q).all()):
            raise ValueError(f"ids: calibration saw non-finite queries, keys or values in layer {i}; nothing chosen")
        scale = getattr(model.model.layers[i].self_attn, "scaling", q.shape[-1] ** -0.5)
        row = []
        for plan in plans:
            kh, vh = stored_kv(plan.layers[i].factory, k, v)
            row.append(attention_error(q, k, v, kh, vh, min(queries, q.shape[2]), scale))
        out.append(row)
    return out


CHOICES = {"rotation": ("int8", "int4", "int3", "int2"), "key_scales": ("turbo4", "turbo3", "turbo2")}
CALIBRATED_METHODS = tuple(m for ms in CHOICES.values() for m in ms)


def key_scales(q: torch.Tensor, k: torch.Tensor, spec) -> torch.Tensor:
    """(Hk, D) float64 key scales s of one layer for the turbo key ``spec`` from its prefill queries ``q`` (1, H, T, D)
    and keys ``k`` (1, Hk, T, D), post-RoPE: ``s_j = (a_j / b_j)^(1/4)`` with ``a_j = Σ_g E[q_j²]`` over the query
    heads of a KV head and ``b_j = E[r_j²]`` of the residual the store codes (``k − RoPE_t(μ)`` for RoPE-centred
    keys, μ the pre-RoPE channel means; ``k − mean`` for plain centring; ``k``), normalized to a geometric mean of 1
    per head. Minimizes the expected squared logit error ``(Σ a/s²)(Σ b s²)`` of a code whose error is white in
    the rotated basis (docs/quantization.md §13)."""
    from .ops.rope import rotate, table, unrotate

    q, k = q[0].double(), k[0].double()
    hk, t, d = k.shape
    a = q.pow(2).mean(1).view(hk, -1, d).sum(1)
    if spec.rope_centred:
        cos, sin = table(torch.tensor(spec.rope, dtype=torch.float64), torch.arange(t))
        mu = unrotate(k, cos, sin).mean(1, keepdim=True)
        r = k - rotate(mu.expand(hk, t, d), cos, sin)
    elif spec.center:
        r = k - k.mean(1, keepdim=True)
    else:
        r = k
    b = r.pow(2).mean(1)
    tiny = torch.finfo(torch.float32).tiny
    a = torch.maximum(a, a.amax(-1, keepdim=True) * 1e-6 + tiny)
    b = torch.maximum(b, b.amax(-1, keepdim=True) * 1e-6 + tiny)
    s = (a / b).pow(0.25)
    return s / s.log().mean(-1, keepdim=True).exp()


def _calibrate_key_scales(model, ids: torch.Tensor, method: str, given: dict, options: dict) -> dict[int, dict]:
    from .methods import METHODS

    plan = METHODS[method].plan_model(model, **options)
    spec = plan.layers[0].factory.keywords["spec"]
    if spec.rope is not None and not spec.rope_centred:
        raise ValueError("prerope_keys=True: key scales are calibrated for post-RoPE codes (the query meets the "
                         "coded basis there); calibrate without prerope_keys")
    if spec.smooth:
        raise ValueError("smooth_keys=True: key scales replace smoothing; calibrate with smooth_keys=False")
    out = {i: dict(over) for i, over in given.items()}
    for i, (q, k, v) in enumerate(capture_qkv(model, ids)):
        if not (torch.isfinite(k).all() and torch.isfinite(v).all() and torch.isfinite(q).all()):
            raise ValueError(f"ids: calibration saw non-finite queries, keys or values in layer {i}; nothing chosen")
        if "key_scales" not in given.get(i, {}):
            out[i] = {**out.get(i, {}), "key_scales": key_scales(q, k, spec).tolist()}
    return dict(sorted(out.items()))


def calibrate(model, ids: torch.Tensor, method: str = "int4", *, choose: str | None = None, queries: int = 256,
              **options) -> dict[int, dict]:
    """Per-layer options of ``method`` for ``model``, chosen on calibration tokens: a ``per_layer`` dict.

    ``choose="key_scales"`` (the turbo methods' choice, their default): every layer gets fixed key channel scales
    (:func:`key_scales`, from the whole prefill's queries and keys; nested lists of floats, KV heads × head dim).
    ``choose="rotation"`` (the int methods' default): each layer's keys are rotated (``{"rotation": "hadamard"}``) or not (``None``),
    whichever gives the layer the lower attention-output error on the prefill of ``ids`` (module docstring); the
    dict names the layers whose choice differs from the method's ``rotation``. ``options`` are the method's ``apply`` options (a ``per_layer`` among them is kept and merged:
    layers it gives a rotation are not chosen for). Use the result as
    ``kvslim.apply(model, method, per_layer=calibrate(model, ids, method), **options)``; it is a plain dict (it
    pickles, prints and goes into JSON with string keys). One prefill of ``ids`` plus, per layer, one coding of its
    keys and values per candidate: seconds on a 135M model over 1,536 tokens.

    Args:
        model: a Llama-style causal LM (``q_proj``/``k_proj``/``v_proj``; Llama, Qwen2, Mistral without sliding
            layers), the model the plan is for.
        ids: (1, T) token ids of the calibration text; T must exceed the method's full-precision tokens (sinks +
            window) by at least ``queries``, so that the last ``queries`` queries see coded keys.
        method: ``"int8"``, ``"int4"``, ``"int3"`` or ``"int2"`` (rotation); ``"turbo4"``, ``"turbo3"`` or
            ``"turbo2"`` (key scales).
        queries: the last queries of the prefill over which the error is measured.
    Raises:
        ValueError naming the argument: another method or choice, ids of the wrong type, shape or length, queries
        not a positive int, a model without separate q/k/v projections, ring layers, non-finite activations.
    """
    from .methods import METHODS

    if method not in CALIBRATED_METHODS:
        raise ValueError(f"method must be one of {', '.join(CALIBRATED_METHODS)} for calibrate, got {method!r}")
    if choose is None:
        choose = next(c for c, ms in CHOICES.items() if method in ms)
    if choose not in CHOICES or method not in CHOICES[choose]:
        raise ValueError(f"choose must be 'rotation' (int methods) or 'key_scales' (turbo methods), got {choose!r} "
                         f"for {method!r}")
    if not isinstance(queries, int) or isinstance(queries, bool) or queries <= 0:
        raise ValueError(f"queries must be a positive int, got {queries!r}")
    check_ids(ids)
    opts = METHODS[method].options(**options)  # validates the options, nothing built
    exact = opts.sink + opts.residual
    if ids.shape[1] < exact + max(opts.flush, 1) + queries:
        raise ValueError(f"ids: {ids.shape[1]} tokens are too few: calibrating {method} over the last {queries} "
                         f"queries needs at least {exact + max(opts.flush, 1) + queries} (sinks + window + one "
                         f"flush + queries)")
    check_model(model, "calibrate")
    given = dict(options.get("per_layer") or {})
    if choose == "key_scales":
        return _calibrate_key_scales(model, ids, method, given, options)
    candidates = (None, "hadamard")
    errors = layer_errors(model, ids, method, tuple({"rotation": c} for c in candidates), queries, **options)
    out = {i: dict(over) for i, over in given.items()}
    for i, errs in enumerate(errors):
        pick = candidates[min(range(len(errs)), key=errs.__getitem__)]  # ties keep the method's own (None first)
        if "rotation" not in given.get(i, {}) and pick != opts.rotation:
            out[i] = {**out.get(i, {}), "rotation": pick}
    return dict(sorted(out.items()))


@torch.inference_mode()
def chunk_reference(model, ids: torch.Tensor, prefill: int, chunk: int = 64) -> dict:
    """The dense run that :func:`chunk_kl` compares against: the prefill's keys and values per layer and the
    next-token log-probabilities of ``ids[:, prefill:]`` fed ``chunk`` tokens per call."""
    from transformers import DynamicCache

    from .adapters.compat import CACHE_KW

    ref = DynamicCache()
    model(ids[:, :prefill], use_cache=True, **{CACHE_KW: ref}, logits_to_keep=1)
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in ref.layers]
    starts = list(range(prefill, ids.shape[1], chunk))
    logp = [torch.log_softmax(model(ids[:, a:a + chunk], use_cache=True, **{CACHE_KW: ref}).logits[0].float(), -1)
            for a in starts]
    return {"ids": ids, "kv": kv, "starts": starts, "chunk": chunk, "logp": logp}


@torch.inference_mode()
def chunk_kl(model, reference: dict, plan) -> float:
    """Mean KL (dense ‖ coded) of the next-token distributions of :func:`chunk_reference`'s tokens with ``plan``'s
    cache (a storage-method plan): its layers get the prefill's keys and values as a prefill call would write them
    (the prefill itself attends to its own exact rows, so it runs once, dense), then the same chunks."""
    from .adapters.compat import CACHE_KW
    from .caches import KVSlimCache

    ids, chunk = reference["ids"], reference["chunk"]
    cache = KVSlimCache([lp.factory(None) for lp in plan.layers], plan=plan)
    for i, (k, v) in enumerate(reference["kv"]):
        cache.update(k, v, i)
    kl = []
    for a, rl in zip(reference["starts"], reference["logp"]):
        lp = torch.log_softmax(model(ids[:, a:a + chunk], use_cache=True, **{CACHE_KW: cache}).logits[0].float(), -1)
        kl.append((rl.exp() * (rl - lp)).sum(-1))
    return torch.cat(kl).mean().item()
