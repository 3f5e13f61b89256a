"""What the model loaders show while they work: one kvslim line per step, none of transformers' own bars.

:class:`status` wraps a loader step. On a terminal it shows a transient spinner with the step's name; a long
step (a conversion done once, ``long=True``) also leaves one line saying how long it took, and when stderr is
not a terminal it is the only thing printed (``kvslim: <step> … done in 12 s``, one line). Inside a step,
transformers' progress bars ("Loading weights", "Writing model shards", the GGUF de-quantizing bar) are hidden,
and restored afterwards.
"""

from __future__ import annotations

import sys
import time


def _no_bar(iterable=None, *args, **kwargs):
    """A stand-in for ``tqdm(...)`` that only iterates."""
    return iterable


class hf_bars_hidden:
    """Context manager: transformers' progress bars off (its own switch; with ``gguf=True`` also the GGUF
    converter's, which calls tqdm directly)."""

    def __init__(self, gguf: bool = False):
        self.gguf = gguf

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._was = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()
        self._gguf = None
        if self.gguf:
            import transformers.modeling_gguf_pytorch_utils as gguf_utils

            self._gguf = gguf_utils
        self._tqdm = getattr(self._gguf, "tqdm", None)
        if self._tqdm is not None:
            self._gguf.tqdm = _no_bar
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        if self._tqdm is not None:
            self._gguf.tqdm = self._tqdm
        if self._was:
            hf_logging.enable_progress_bar()
        return False


class status:
    """One progress line on stderr for a loader step (see the module docstring).

    Args:
        text: what the step does ("converting CTranslate2 -> Hugging Face Whisper").
        long: a slow step worth a lasting line (conversions done once); short steps show only the spinner.
        gguf: the step runs transformers' GGUF converter (its bar is hidden too).
    """

    def __init__(self, text: str, long: bool = False, gguf: bool = False):
        self.text, self.long = text, long
        self._spinner = None
        self._bars = hf_bars_hidden(gguf)

    def __enter__(self):
        self._t = time.perf_counter()
        self._bars.__enter__()
        if sys.stderr.isatty():
            from rich.console import Console

            self._spinner = Console(stderr=True).status(f"kvslim: {self.text}")
            self._spinner.__enter__()
        elif self.long:
            print(f"kvslim: {self.text} …", end="", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, *exc):
        self._bars.__exit__(exc_type, *exc)
        if self._spinner is not None:
            self._spinner.__exit__(exc_type, *exc)
        if not self.long:
            return False
        took = f"{time.perf_counter() - self._t:.0f} s"
        end = "failed" if exc_type is not None else f"done in {took}"
        if self._spinner is not None:
            print(f"kvslim: {self.text}: {end}", file=sys.stderr, flush=True)
        else:
            print(f" {end}", file=sys.stderr, flush=True)
        return False
