"""A folder as a zip archive, produced chunk by chunk: the server streams a checkpoint's model with
it and the client writes a model folder to a file with it, so a multi-GB model is never held in memory.

Entries are stored (not deflated: safetensors weights do not compress) with ZIP64 sizes, so any
model size works; `zipfile` writes each entry's sizes after its data when the output cannot seek.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Iterator
from pathlib import Path

CHUNK = 1024 * 1024


class _Chunks(io.RawIOBase):
    """A write-only, unseekable sink whose bytes are taken out as they come."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def stream_zip(folder: Path, root: str) -> Iterator[bytes]:
    """The files under `folder` (links skipped), in a stable order, as entries under `root/`."""
    sink = _Chunks()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            name = f"{root}/{path.relative_to(folder).as_posix()}"
            with path.open("rb") as source, archive.open(name, "w", force_zip64=True) as entry:
                while chunk := source.read(CHUNK):
                    entry.write(chunk)
                    yield sink.take()
            yield sink.take()
    yield sink.take()  # the central directory, written when the archive closed
