"""Hands a learner's weights to running vLLM engines without a disk round-trip.

Handoffs, one engine method (`Engine.update_weights`):
- `SharedMemoryWeights` (engines on the learner's node): the learner writes its tensors once into a
  safetensors file on tmpfs (`/dev/shm`); every engine replica on that node memory-maps it and reloads
  in place through the `WeightReloadExtension` worker extension. One memory copy on each side.
- `ObjectStoreWeights` (engines on any node): the learner puts its tensors in Ray's object store once;
  each engine fetches them (Ray moves them between nodes), writes them to its own node's tmpfs and
  reloads from there as above. One more copy per engine node than shared memory, no shared disk.
- `TransferEngineWeights` (GPU): vLLM's RL weight-transfer API (nccl / ipc backends). The engine side
  is implemented (`init_weight_transfer`, `update_weights`); nothing on the learner side builds this
  handoff yet, so GPU jobs also move weights by the two handoffs above.

`transfer_for` picks a handoff for one engine replica from the job's `resources.weight_transfer`.
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


@dataclass(frozen=True)
class ObjectStoreWeights:
    """Named weights in Ray's object store: `refs` holds one `ObjectRef` of a {name: tensor} dict
    (inside a tuple, so Ray passes the reference to the engine rather than resolving it on the way)."""

    refs: tuple[Any, ...]
    num_tensors: int
    num_bytes: int


WeightHandoff = SharedMemoryWeights | ObjectStoreWeights | TransferEngineWeights

# `resources.weight_transfer`: how the learner's weights reach each student engine replica.
WEIGHT_TRANSFERS = ("auto", "shm", "ray")


def transfer_for(configured: str, learner_node: str, engine_node: str) -> str:
    """The handoff kind ("shm" or "ray") for one engine replica. `auto` uses shared memory only where
    the engine shares the learner's node (a tmpfs file cannot reach another node) and Ray's object
    store elsewhere; `shm` refuses an engine on another node rather than fail at the first update."""
    if configured not in WEIGHT_TRANSFERS:
        raise ValueError(f"unknown weight transfer {configured!r}; expected one of {WEIGHT_TRANSFERS}")
    if configured == "auto":
        return "shm" if engine_node == learner_node else "ray"
    if configured == "shm" and engine_node != learner_node:
        raise ValueError(
            f"weight_transfer 'shm' needs every student engine on the learner's node; an engine runs on "
            f"node {engine_node[:12]}, the learner on {learner_node[:12]} (use 'auto' or 'ray')"
        )
    return configured


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


def put_object_store_weights(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> ObjectStoreWeights:
    """Puts `named_tensors` in Ray's object store once, for engines on any node to fetch."""
    import ray

    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ObjectStoreWeights(refs=(ray.put(tensors),), num_tensors=len(tensors), num_bytes=num_bytes)


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
