"""Argument types shared by `opd` commands."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)
