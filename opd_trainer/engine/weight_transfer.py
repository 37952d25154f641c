"""How the learner's weights reach running vLLM engines: one class per transport, owning both halves.

A transport is named as in the job spec (`resources.weight_transfer`) and does two jobs:
- learner side: `export` turns the learner's named tensors into a handoff (a small picklable value
  that crosses Ray to the engines) and `release` frees what `export` made once every engine is done;
- engine side: `apply` loads a handoff into one running engine replica (`Engine.update_weights`, which
  pauses generation around it and clears the prefix cache after it).

Transports:
- `ShmTransfer` ("shm", engines on the learner's node): the learner writes its tensors once into a
  safetensors file on tmpfs (`/dev/shm`, or `OPD_SHM_DIR`); every replica on that node memory-maps it
  and reloads in place through the `WeightReloadExtension` worker extension. One copy on each side.
- `RayTransfer` ("ray", engines on any node): the learner puts its tensors in Ray's object store once;
  each replica fetches them (Ray moves them between nodes), stages them on its own node's tmpfs and
  reloads from there as above. One more copy per engine node than shm, no shared disk.

`auto` (the default) resolves per replica (`transfer_for`): shm where the replica shares the learner's
node, ray elsewhere. A handoff names its transport (`handoff.kind`), so neither the learner nor the
engine switches on kinds or types: they call `transfer(kind)`'s methods.

GPU: jobs on GPUs move weights by shm / ray too (through host memory). vLLM 0.32's RL weight-transfer
API (NCCL / CUDA IPC) is not wired: its learner half and the engines' start-up with a
`WeightTransferConfig` wait for a GPU to build and test them on.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import ray
import torch
from safetensors.torch import save_file

from opd_trainer.engine.vllm_extension import RELOAD_FROM_FILE
from opd_trainer.errors import WeightSyncError

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from opd_trainer.engine.inproc_llm import InprocAsyncLLM
    from opd_trainer.engine.vllm_engine import EngineGroup
    from opd_trainer.learner.deepspeed_learner import LearnerGroup

# tmpfs is memory: the "file" is the shared buffer, not a disk write. Containers with a tiny /dev/shm
# (Docker's 64 MB default) can point this elsewhere.
SHM_DIR_ENV = "OPD_SHM_DIR"

NamedTensors = Iterable[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ShmHandoff:
    """A safetensors file on tmpfs holding a full set of named weights."""

    kind: ClassVar[str] = "shm"
    path: str
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class RayHandoff:
    """Named weights in Ray's object store: `refs` holds one `ObjectRef` of a {name: tensor} dict
    (inside a tuple, so Ray passes the reference to the engine rather than resolving it on the way)."""

    kind: ClassVar[str] = "ray"
    refs: tuple[Any, ...]
    num_tensors: int
    num_bytes: int


WeightHandoff = ShmHandoff | RayHandoff


class WeightTransfer(ABC):
    """One transport: the learner's `export` / `release` and the engine's `apply`."""

    kind: ClassVar[str]

    @abstractmethod
    def export(self, named_tensors: NamedTensors) -> WeightHandoff:
        """Learner side: the tensors as a handoff every engine replica using this transport can load."""

    def release(self, handoff: WeightHandoff) -> None:  # noqa: B027 (a transport may hold nothing)
        """Learner side: frees what `export` made, once every engine has applied it."""

    @abstractmethod
    async def apply(self, handoff: WeightHandoff, llm: AsyncLLM | InprocAsyncLLM, name: str) -> None:
        """Engine side: loads `handoff` into the running engine `llm` (replica `name`, for errors).
        Raises `WeightSyncError` when a worker refuses the weights; the engine keeps its old ones."""

    @contextmanager
    def exported(self, named_tensors: NamedTensors) -> Iterator[WeightHandoff]:
        """`export`, then `release` on leaving the block."""
        handoff = self.export(named_tensors)
        try:
            yield handoff
        finally:
            self.release(handoff)


def _cpu_tensors(named_tensors: NamedTensors) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}


def _num_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def shared_memory_dir() -> Path:
    """`OPD_SHM_DIR`, else `/dev/shm` where it is writable, else the temp dir."""
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


class ShmTransfer(WeightTransfer):
    """`shm`: one safetensors file on the node's tmpfs, memory-mapped by every replica there."""

    kind = "shm"

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory

    def export(self, named_tensors: NamedTensors) -> ShmHandoff:
        tensors = _cpu_tensors(named_tensors)
        target_dir = self.directory or shared_memory_dir()
        target_dir.mkdir(parents=True, exist_ok=True)
        path = target_dir / f"opd-weights-{uuid.uuid4().hex}.safetensors"
        partial = path.with_suffix(".partial")
        save_file(tensors, str(partial))
        # Rename last so a reader never maps a half-written file.
        partial.rename(path)
        return ShmHandoff(path=str(path), num_tensors=len(tensors), num_bytes=_num_bytes(tensors))

    def release(self, handoff: WeightHandoff) -> None:
        assert isinstance(handoff, ShmHandoff)
        Path(handoff.path).unlink(missing_ok=True)

    async def apply(self, handoff: WeightHandoff, llm: AsyncLLM | InprocAsyncLLM, name: str) -> None:
        assert isinstance(handoff, ShmHandoff)
        results = await llm.collective_rpc(RELOAD_FROM_FILE, args=(handoff.path,))
        failed = [r["error"] for r in results if not r["ok"]]
        if failed:
            raise WeightSyncError(f"{name}: a worker could not load weights: {failed[0]}")


class RayTransfer(WeightTransfer):
    """`ray`: one copy in Ray's object store, fetched by each replica and staged on its node's tmpfs."""

    kind = "ray"

    def __init__(self, directory: Path | None = None) -> None:
        self.staging = ShmTransfer(directory)  # where a replica stages what it fetched

    def export(self, named_tensors: NamedTensors) -> RayHandoff:
        tensors = _cpu_tensors(named_tensors)
        return RayHandoff(refs=(ray.put(tensors),), num_tensors=len(tensors), num_bytes=_num_bytes(tensors))

    # release: nothing to do; the object-store copy goes with its last reference.

    async def apply(self, handoff: WeightHandoff, llm: AsyncLLM | InprocAsyncLLM, name: str) -> None:
        assert isinstance(handoff, RayHandoff)
        tensors = await handoff.refs[0]
        with self.staging.exported(tensors.items()) as local:
            del tensors  # the fetched copy is on tmpfs now; free it before the workers load
            await self.staging.apply(local, llm, name)


TRANSFERS: dict[str, type[WeightTransfer]] = {ShmTransfer.kind: ShmTransfer, RayTransfer.kind: RayTransfer}

# `resources.weight_transfer`: how the learner's weights reach each student engine replica.
WEIGHT_TRANSFERS = ("auto", *TRANSFERS)


def transfer(kind: str) -> WeightTransfer:
    """The transport named `kind` ("shm" or "ray"; `auto` is resolved per replica by `transfer_for`)."""
    if kind not in TRANSFERS:
        raise WeightSyncError(f"unknown weight transfer {kind!r}; expected one of {tuple(TRANSFERS)}")
    return TRANSFERS[kind]()


def transfer_for(configured: str, learner_node: str, engine_node: str) -> str:
    """The transport ("shm" or "ray") for one engine replica. `auto` uses shared memory only where
    the engine shares the learner's node (a tmpfs file cannot reach another node) and Ray's object
    store elsewhere; `shm` refuses an engine on another node rather than fail at the first update."""
    if configured not in WEIGHT_TRANSFERS:
        raise ValueError(f"unknown weight transfer {configured!r}; expected one of {WEIGHT_TRANSFERS}")
    if configured == "auto":
        return ShmTransfer.kind if engine_node == learner_node else RayTransfer.kind
    if configured == ShmTransfer.kind and engine_node != learner_node:
        raise ValueError(
            f"weight_transfer 'shm' needs every student engine on the learner's node; an engine runs on "
            f"node {engine_node[:12]}, the learner on {learner_node[:12]} (use 'auto' or 'ray')"
        )
    return configured


def export_weights(named_tensors: NamedTensors, kinds: Iterable[str]) -> dict[str, WeightHandoff]:
    """Learner side: one handoff per distinct kind in `kinds`."""
    weights = list(named_tensors)
    return {kind: transfer(kind).export(weights) for kind in sorted(set(kinds))}


def release_weights(handoffs: Iterable[WeightHandoff]) -> None:
    """Learner side: frees what `export_weights` made."""
    for handoff in handoffs:
        transfer(handoff.kind).release(handoff)


async def apply_weights(handoff: WeightHandoff, llm: AsyncLLM | InprocAsyncLLM, name: str) -> None:
    """Engine side: loads `handoff` into `llm` by its own transport."""
    await transfer(handoff.kind).apply(handoff, llm, name)


async def publish_weights(
    learner: LearnerGroup, student: EngineGroup, kinds: list[str], version: int
) -> None:
    """The learner's weights to every student replica (replica i by `kinds[i]`, as
    `EngineGroup.transfers` chose), all reporting `version`; the handoffs are released whatever happens."""
    handoffs = await learner.export_weights(kinds)
    try:
        await student.update_weights([handoffs[kind] for kind in kinds], version)
    finally:
        await learner.release_weights(list(handoffs.values()))
