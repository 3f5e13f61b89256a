"""Read the attention shape of any Hugging Face config (no weights): the planner's and the methods' input."""

from __future__ import annotations

from dataclasses import dataclass, field

ENCODER_DECODER_TYPES = ("whisper", "t5", "bart", "mbart", "mt5", "pegasus", "marian")


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of a model, read from its config.

    ``family`` is one of ``"mha"``, ``"gqa"``, ``"mqa"``, ``"mla"``, ``"encoder-decoder"``.
    For encoder-decoder models the decoder's self-attention fields are filled, plus ``encoder_layers`` and
    ``encoder_length`` (the encoder context, e.g. Whisper's 1500 frames; ``None`` when not fixed).
    """

    model_type: str
    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None = None
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    q_lora_rank: int | None = None
    encoder_layers: int | None = None
    encoder_length: int | None = None
    extras: dict = field(default_factory=dict, compare=False)

    @property
    def kv_values_per_token(self) -> int:
        """Values a standard K+V cache stores per token per layer (``2·hkv·dk``; MLA: decompressed)."""
        if self.family == "mla":
            return self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def is_sliding(self) -> tuple[bool, ...]:
        return tuple(t == "sliding_attention" for t in self.layer_types)


def _get(config, *names, default=None):
    for n in names:
        v = getattr(config, n, None)
        if v is not None:
            return v
    return default


def _layer_types(config, n_layers: int, sliding: int | None) -> tuple[str, ...]:
    lt = getattr(config, "layer_types", None)
    if lt:
        return tuple(lt)[:n_layers]
    return ("sliding_attention" if sliding else "full_attention",) * n_layers


def shape_from_config(config) -> ModelShape:
    """Detect MHA / GQA / MQA / MLA / encoder-decoder from an HF config object.

    Raises:
        ValueError: if the config lacks the fields needed (the message names them).
    """
    mt = getattr(config, "model_type", None) or "unknown"
    if mt in ENCODER_DECODER_TYPES or getattr(config, "is_encoder_decoder", False):
        d = _get(config, "d_model", "hidden_size")
        h = _get(config, "decoder_attention_heads", "num_heads", "num_attention_heads")
        n_dec = _get(config, "decoder_layers", "num_decoder_layers", "num_layers")
        n_enc = _get(config, "encoder_layers", "num_layers")
        if None in (d, h, n_dec):
            raise ValueError(f"config of model_type {mt!r} lacks d_model / heads / decoder layer count")
        dk = _get(config, "d_kv", default=d // h)
        return ModelShape(mt, "encoder-decoder", n_dec, d, h, h, dk, ("full_attention",) * n_dec,
                          encoder_layers=n_enc, encoder_length=_get(config, "max_source_positions"))
    n = _get(config, "num_hidden_layers", "n_layer", "num_layers")
    d = _get(config, "hidden_size", "n_embd", "d_model")
    h = _get(config, "num_attention_heads", "n_head")
    missing = [name for name, v in (("num_hidden_layers", n), ("hidden_size", d), ("num_attention_heads", h))
               if v is None]
    if missing:
        raise ValueError(f"config of model_type {mt!r} lacks {', '.join(missing)}: cannot read its attention shape")
    if getattr(config, "kv_lora_rank", None) is not None or mt.startswith("deepseek_v"):
        fields = {k: getattr(config, k, None) for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                         "v_head_dim")}
        absent = [k for k, v in fields.items() if v is None]
        if absent:
            raise ValueError(f"MLA config of model_type {mt!r} is missing {', '.join(absent)}")
        return ModelShape(mt, "mla", n, d, h, h, fields["qk_nope_head_dim"] + fields["qk_rope_head_dim"],
                          ("full_attention",) * n, q_lora_rank=getattr(config, "q_lora_rank", None), **fields)
    hkv = _get(config, "num_key_value_heads", default=h)
    if getattr(config, "multi_query", False):
        hkv = 1
    dk = _get(config, "head_dim", default=d // h)
    family = "mha" if hkv == h else ("mqa" if hkv == 1 else "gqa")
    sliding = getattr(config, "sliding_window", None)
    if mt == "qwen2" and not getattr(config, "use_sliding_window", False):
        sliding = None
    types = _layer_types(config, n, sliding)
    if "sliding_attention" not in types:
        sliding = None
    return ModelShape(mt, family, n, d, h, hkv, dk, types, sliding_window=sliding, extras=_rope_extras(config))


def _rope_extras(config) -> dict:
    """``{"rope": {"rope_type", "rope_theta", "partial_rotary_factor"}}`` when the config names a RoPE base (what
    a plan from the config alone needs for pre-RoPE keys), else ``{}``."""
    params = getattr(config, "rope_parameters", None)
    params = dict(params) if isinstance(params, dict) else {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        return {}
    return {"rope": {"rope_type": params.get("rope_type", "default"), "rope_theta": float(theta),
                     "partial_rotary_factor": float(params.get("partial_rotary_factor",
                                                               getattr(config, "partial_rotary_factor", 1.0) or 1.0))}}
