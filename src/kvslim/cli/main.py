"""``kvslim <command>``: a thin dispatcher; one module per command, imported only when its command runs.

``kvslim --help`` imports no command module (so neither torch nor transformers): each command's one-line help is
listed here (``tests/test_cli_defects.py`` checks it against the module's docstring), and only the chosen
command's module is imported to add its arguments.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module under kvslim.cli, one-line help: the first line of that module's docstring)
COMMANDS = {
    "plan": ("plan", "Bytes per method for any Hugging Face config, loading no weights."),
    "demo": ("demo", "Generate with each method on the built-in model and print one comparison table (no "
                     "download)."),
    "bench": ("bench", "Decode benchmark: kvslim methods against HF DynamicCache and StaticCache in the same run."),
    "transcribe": ("transcribe", "Transcribe a WAV file with real Whisper (tiny.en / base from PyPI, offline) and "
                                 "a kvslim cache."),
    "eval": ("eval", "Quality of kvslim's methods on your own model and text, or a retrieval check at a long "
                     "context."),
    "calibrate": ("calibrate", "Choose a method's per-layer options for your model on a calibration text and write "
                               "them to a file."),
    "cache-prompt": ("cache_prompt", "Prefill a text once through a kvslim cache and write the compressed cache to "
                                     "a file."),
    "generate": ("generate", "Answer a prompt with a model and a kvslim cache, optionally continuing a prompt "
                             "cache file."),
}


def command_module(name: str):
    """The module of command ``name`` (``kvslim.cli.<module>``), imported now."""
    return importlib.import_module(f"{__package__}.{COMMANDS[name][0]}")


def _chosen(argv: list[str]) -> str | None:
    """The command named in ``argv`` (its first word that is not an option), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="kvslim", description="Smaller KV caches for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen(argv)
    for name, (_, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            command_module(name).add_arguments(p)
    args = parser.parse_args(argv)
    try:
        return command_module(args.command).run(args) or 0
    except (ValueError, FileNotFoundError) as exc:  # bad input, missing file or package: a message, no traceback
        print(f"kvslim {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
