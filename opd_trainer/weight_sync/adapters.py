"""The adapter handoff: a PEFT adapter folder's files, from the learner to engines that serve LoRA.

A LoRA job moves only its adapter: the learner exports the files of a PEFT adapter folder
(`adapter_config.json`, `adapter_model.safetensors`) as bytes in Ray's object store, and each engine
replica writes them into a folder of its own node (`materialize`) that vLLM loads as a new
`LoRARequest`. The object goes with its last reference, so `release` drops nothing.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any, ClassVar

import ray

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class AdapterHandoff:
    """One adapter version: `refs` holds one `ObjectRef` of a {file name: bytes} dict (inside a tuple,
    so Ray passes the reference to the engine rather than resolving it on the way)."""

    kind: ClassVar[str] = "adapter"
    refs: tuple[Any, ...]
    version: int
    num_bytes: int


class AdapterTransfer:
    """`export` on the learner, `materialize` on an engine replica's node."""

    kind = "adapter"

    def export(self, files: dict[str, bytes], version: int) -> AdapterHandoff:
        for name in files:
            if PurePath(name).name != name or name in ("", ".", ".."):
                raise ValueError(f"adapter file name {name!r} must be a bare file name")
        missing = [name for name in ADAPTER_FILES if name not in files]
        if missing:
            raise ValueError(f"an adapter needs {list(ADAPTER_FILES)}; missing {missing}")
        num_bytes = sum(len(data) for data in files.values())
        return AdapterHandoff(refs=(ray.put(dict(files)),), version=version, num_bytes=num_bytes)

    def release(self, handoff: AdapterHandoff) -> None:
        """Nothing to free: the object-store copy goes with its last reference."""

    async def materialize(self, handoff: AdapterHandoff, directory: Path) -> Path:
        """Writes the adapter's files into `directory / f"v{version}"` and returns that folder. Idempotent:
        a folder already there (every file of it written, then renamed into place) is returned as is."""
        target = directory / f"v{handoff.version}"
        if target.is_dir():
            return target
        files: dict[str, bytes] = await handoff.refs[0]
        directory.mkdir(parents=True, exist_ok=True)
        partial = directory / f".v{handoff.version}-{uuid.uuid4().hex}.partial"
        partial.mkdir()
        for name, data in files.items():
            (partial / PurePath(name).name).write_bytes(data)
        try:
            os.rename(partial, target)  # whole folder or none: vLLM never sees half an adapter
        except OSError:
            if not target.is_dir():
                raise
            for file in partial.iterdir():  # another caller materialized it first
                file.unlink()
            partial.rmdir()
        return target
