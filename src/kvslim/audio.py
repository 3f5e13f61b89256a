"""Read speech for the Whisper demo: WAV files as 16 kHz mono float32, and the shipped clip.

Only PCM WAV (8-bit unsigned, 16/24/32-bit signed) is read, with the standard library; other sample rates are
resampled with ``scipy.signal.resample_poly``.
"""

from __future__ import annotations

import warnings
import wave
from importlib import resources
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000


#: longest audio :func:`read_wav` reads unless told otherwise (samples are held in memory whole: 30 min at 16 kHz is
#: 115 MB of float32, and HF's long-form decoding keeps the log-mel features of all of it)
MAX_SECONDS = 30 * 60


def read_wav(path: str | Path, rate: int = SAMPLE_RATE, max_seconds: float | None = MAX_SECONDS) -> np.ndarray:
    """Samples of a PCM WAV file as mono float32 in [-1, 1] at ``rate`` Hz.

    Args:
        path: the ``.wav`` file.
        rate: output sample rate.
        max_seconds: refuse (from the header, before reading any sample) a longer file; ``None``: no limit.

    Returns:
        ``(n,)`` float32 array (channels averaged).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a PCM WAV file this reader handles, no samples, or longer than ``max_seconds``.

    A file holding fewer frames than its header says (cut short) is read up to its last whole frame, with a
    ``UserWarning`` naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} does not exist or is not a file")
    try:
        with wave.open(str(path), "rb") as w:
            width, channels, src_rate, frames = w.getsampwidth(), w.getnchannels(), w.getframerate(), w.getnframes()
            if src_rate <= 0 or channels <= 0:
                raise ValueError(f"path {str(path)!r}: header says {src_rate} Hz, {channels} channels")
            if max_seconds is not None and frames / src_rate > max_seconds:
                raise ValueError(f"path {str(path)!r} holds {frames / src_rate / 60:.1f} min of audio, more than "
                                 f"the {max_seconds / 60:.1f} min limit (max_seconds={max_seconds}); cut it into "
                                 "shorter files or raise the limit")
            raw = w.readframes(frames)
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"path {str(path)!r} is not a PCM WAV file: {exc}") from exc
    frame_bytes = width * channels
    got = len(raw) // frame_bytes
    if got == 0:
        raise ValueError(f"path {str(path)!r} holds no audio (0 frames)")
    if got < frames:
        warnings.warn(f"path {str(path)!r} is cut short: its header says {frames} frames "
                      f"({frames / src_rate:.1f} s), the file holds {got} ({got / src_rate:.1f} s); reading those",
                      UserWarning, stacklevel=2)
    raw = raw[:got * frame_bytes]
    if width == 1:
        x = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif width == 2:
        x = np.frombuffer(raw, "<i2").astype(np.float32) / 32768.0
    elif width == 3:
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        x = ((b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8).astype(np.float32) / 8388608.0
    elif width == 4:
        x = np.frombuffer(raw, "<i4").astype(np.float32) / 2147483648.0
    else:
        raise ValueError(f"path {str(path)!r}: {8 * width}-bit samples are not supported")
    x = x.reshape(-1, channels).mean(axis=1)
    if src_rate != rate:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(src_rate, rate)
        x = resample_poly(x, rate // g, src_rate // g).astype(np.float32)
    return np.ascontiguousarray(x, dtype=np.float32)


def speech_clip() -> tuple[Path, str]:
    """``(path, text)`` of the shipped 17 s synthesized English clip (``kvslim/data/speech/fox.wav``)."""
    folder = resources.files("kvslim").joinpath("data/speech")
    return Path(str(folder.joinpath("fox.wav"))), folder.joinpath("fox.txt").read_text().strip()


def long_form(audio: np.ndarray, repeats: int = 2, gap_s: float = 1.0, rate: int = SAMPLE_RATE) -> np.ndarray:
    """``audio`` played ``repeats`` times with ``gap_s`` seconds of silence between (for > 30 s inputs)."""
    if repeats < 1:
        raise ValueError(f"repeats must be ≥ 1, got {repeats}")
    gap = np.zeros(int(gap_s * rate), np.float32)
    parts = [audio if i == 0 else np.concatenate([gap, audio]) for i in range(repeats)]
    return np.concatenate(parts)
