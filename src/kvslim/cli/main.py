"""``kvslim <command>``: a thin dispatcher; one module per command."""

from __future__ import annotations

import argparse
import sys

from . import bench, demo, plan, transcribe

COMMANDS = {"plan": plan, "demo": demo, "bench": bench, "transcribe": transcribe}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvslim", description="Smaller KV caches for transformers models.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.strip().splitlines()[0]))
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command].run(args) or 0
    except (ValueError, FileNotFoundError) as exc:  # bad input, missing file or package: a message, no traceback
        print(f"kvslim {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
