"""Hands a learner's weights to running vLLM engines without a disk round-trip.

Two handoffs, one engine method (`Engine.update_weights`):
- `SharedMemoryWeights` (CPU, and any box): the learner writes its tensors once into a safetensors
  file on tmpfs (`/dev/shm`); every engine replica memory-maps it and reloads in place through the
  `WeightReloadExtension` worker extension. One memory copy on each side.
- `TransferEngineWeights` (GPU): vLLM's RL weight-transfer API (nccl / ipc backends). The learner runs
  the trainer half (`vllm.distributed.weight_transfer`) while the engine runs start/update/finish.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# tmpfs is memory: the "file" is the shared buffer, not a disk write. Containers with a tiny /dev/shm
# (Docker's 64 MB default) can point this elsewhere.
SHM_DIR_ENV = "OPD_SHM_DIR"


@dataclass(frozen=True)
class SharedMemoryWeights:
    """A safetensors file on tmpfs holding a full set of named weights."""

    path: str
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class TransferEngineWeights:
    """One update round of vLLM's weight-transfer API; `update_info` is backend specific."""

    update_info: dict[str, Any] = field(default_factory=dict)


WeightHandoff = SharedMemoryWeights | TransferEngineWeights


def shared_memory_dir() -> Path:
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def write_shared_memory_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: Path | None = None
) -> SharedMemoryWeights:
    """Copies `named_tensors` into one tmpfs file that every engine replica can map."""
    from safetensors.torch import save_file

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    target_dir = directory or shared_memory_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    path = target_dir / f"opd-weights-{uuid.uuid4().hex}.safetensors"
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    # Rename last so a reader never maps a half-written file.
    partial.rename(path)
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return SharedMemoryWeights(path=str(path), num_tensors=len(tensors), num_bytes=num_bytes)


def release_shared_memory_weights(handoff: SharedMemoryWeights) -> None:
    Path(handoff.path).unlink(missing_ok=True)


@contextmanager
def shared_memory_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]], directory: Path | None = None
) -> Iterator[SharedMemoryWeights]:
    """Writes the handoff file and removes it once every engine has loaded it."""
    handoff = write_shared_memory_weights(named_tensors, directory)
    try:
        yield handoff
    finally:
        release_shared_memory_weights(handoff)
