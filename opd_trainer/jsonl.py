"""JSON Lines files: one reader and one writer for every role (datasets, run records, benchmarks)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


def write_jsonl(path: str | Path, records: Iterable[dict[str, Any]], *, append: bool = False) -> None:
    """One JSON object per line, UTF-8 with non-ASCII text kept readable; `default=str` for the rest."""
    with Path(path).open("a" if append else "w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")


def read_jsonl(path: str | Path, *, tail: int | None = None) -> list[dict[str, Any]]:
    """The objects of a JSONL file, or of its last `tail` lines.

    Made for files another process may be appending to: a missing file reads as empty, and a line that
    does not decode to an object (a half-written last line) is skipped.
    """
    path = Path(path)
    if not path.is_file():
        return []
    if tail is None:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    else:
        lines = _tail_lines(path, tail)
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _tail_lines(path: Path, count: int) -> list[str]:
    """The last `count` lines, reading backwards in blocks (trajectory files grow large)."""
    block = 64 * 1024
    with path.open("rb") as handle:
        handle.seek(0, 2)
        end = handle.tell()
        data = b""
        while end > 0 and data.count(b"\n") <= count:
            start = max(0, end - block)
            handle.seek(start)
            data = handle.read(end - start) + data
            end = start
    return data.decode("utf-8", errors="replace").splitlines()[-count:] if count else []
