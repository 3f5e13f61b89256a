"""Decode benchmark: kvslim methods against HF DynamicCache and StaticCache in the same run."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise ValueError("not yet")
