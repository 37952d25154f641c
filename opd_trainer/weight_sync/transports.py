"""The host-memory transports (shm, ray), the registry of every transport, and the per-replica choice.

A transport is named as in the job spec (`resources.weight_transfer`) and does two jobs:
- learner side: `export` turns the learner's named tensors into a handoff (a small picklable value
  that crosses Ray to the engines) and `release` frees what `export` made once every engine is done;
- engine side: `apply` loads a handoff into one running engine replica (`Engine.update_weights`, which
  pauses generation around it and clears the prefix cache after it).

Host-memory transports (here; run on CPU in unit and integration tests, and on GPU jobs):
- `ShmTransfer` ("shm", engines on the learner's node): the learner streams its tensors, one at a
  time, into a safetensors file on tmpfs (`/dev/shm`, or `OPD_SHM_DIR`); every replica on that node
  memory-maps it and reloads in place through the `WeightReloadExtension` worker extension.
- `RayTransfer` ("ray", engines on any node): the learner puts its tensors in Ray's object store in
  buckets (one object per `DEFAULT_BUCKET_BYTES`); each replica fetches them bucket by bucket (Ray
  moves them between nodes), streams each into a file on its own node's tmpfs and reloads from there.

GPU transports (`streamed.py`: "cuda_ipc" on the learner's node, "nccl" on any node) move buckets
GPU to GPU. They are opt-in and have not yet run on a GPU (the GPU machine available to the project
has no vLLM); only their protocol and pack/unpack are tested, on CPU.

`auto` (the default) resolves per replica (`transfer_for`): shm where the replica shares the learner's
node, ray elsewhere. A handoff names its transport (`handoff.kind`), so neither the learner nor the
engine switches on kinds or types: they call `transfer(kind)`'s methods.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import ray

from opd_trainer.errors import WeightSyncError
from opd_trainer.weight_sync.base import RpcEngine, WeightTransfer, check_worker_results, shared_memory_dir
from opd_trainer.weight_sync.buckets import DEFAULT_BUCKET_BYTES, NamedTensors, buckets
from opd_trainer.weight_sync.safetensors_stream import SafetensorsWriter, TensorSpec, write_safetensors
from opd_trainer.weight_sync.streamed import CudaIpcHandoff, CudaIpcTransfer, NcclHandoff, NcclTransfer
from opd_trainer.weight_sync.worker_extension import RELOAD_FROM_FILE


@dataclass(frozen=True)
class ShmHandoff:
    """A safetensors file on tmpfs holding a full set of named weights."""

    kind: ClassVar[str] = "shm"
    path: str
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class RayHandoff:
    """Named weights in Ray's object store: `refs` holds one `ObjectRef` per bucket, each a list of
    (name, tensor) in `specs` order (inside a tuple, so Ray passes the references to the engine rather
    than resolving them on the way)."""

    kind: ClassVar[str] = "ray"
    refs: tuple[Any, ...]
    specs: tuple[TensorSpec, ...]
    num_tensors: int
    num_bytes: int


WeightHandoff = ShmHandoff | RayHandoff | CudaIpcHandoff | NcclHandoff


def _new_file(directory: Path | None) -> Path:
    target_dir = directory or shared_memory_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    return target_dir / f"opd-weights-{uuid.uuid4().hex}.safetensors"


class ShmTransfer(WeightTransfer):
    """`shm`: one safetensors file on the node's tmpfs, memory-mapped by every replica there."""

    kind = "shm"

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory

    def export(self, named_tensors: NamedTensors, consumers: int = 1) -> ShmHandoff:
        path = _new_file(self.directory)
        partial = path.with_suffix(".partial")
        num_tensors, num_bytes = write_safetensors(partial, named_tensors)
        # Rename last so a reader never maps a half-written file.
        partial.rename(path)
        return ShmHandoff(path=str(path), num_tensors=num_tensors, num_bytes=num_bytes)

    def release(self, handoff: Any) -> None:
        assert isinstance(handoff, ShmHandoff)
        Path(handoff.path).unlink(missing_ok=True)

    async def apply(self, handoff: Any, llm: RpcEngine, name: str) -> None:
        assert isinstance(handoff, ShmHandoff)
        check_worker_results(await llm.collective_rpc(RELOAD_FROM_FILE, args=(handoff.path,)), name)


class RayTransfer(WeightTransfer):
    """`ray`: one object per bucket in Ray's object store, fetched bucket by bucket by each replica
    and streamed into a file on its node's tmpfs (so a replica holds one bucket in memory at a time)."""

    kind = "ray"

    def __init__(self, directory: Path | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.staging = ShmTransfer(directory)  # where a replica stages what it fetched
        self.bucket_bytes = bucket_bytes

    def export(self, named_tensors: NamedTensors, consumers: int = 1) -> RayHandoff:
        refs, specs = [], []
        for bucket in buckets(named_tensors, self.bucket_bytes):
            host = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in bucket]
            specs += [TensorSpec.of(name, tensor) for name, tensor in host]
            refs.append(ray.put(host))
            del host  # the object store holds the bucket now
        num_bytes = sum(spec.nbytes for spec in specs)
        return RayHandoff(refs=tuple(refs), specs=tuple(specs), num_tensors=len(specs), num_bytes=num_bytes)

    # release: nothing to do; the object-store copies go with their last references.

    async def apply(self, handoff: Any, llm: RpcEngine, name: str) -> None:
        assert isinstance(handoff, RayHandoff)
        path = _new_file(self.staging.directory)
        partial = path.with_suffix(".partial")
        try:
            with SafetensorsWriter(partial, list(handoff.specs)) as writer:
                for ref in handoff.refs:
                    for tensor_name, tensor in await ref:
                        writer.write(tensor_name, tensor)
            partial.rename(path)
            local = ShmHandoff(path=str(path), num_tensors=handoff.num_tensors, num_bytes=handoff.num_bytes)
            await self.staging.apply(local, llm, name)
        finally:
            partial.unlink(missing_ok=True)
            path.unlink(missing_ok=True)


TRANSFERS: dict[str, type[WeightTransfer]] = {
    ShmTransfer.kind: ShmTransfer,
    RayTransfer.kind: RayTransfer,
    CudaIpcTransfer.kind: CudaIpcTransfer,
    NcclTransfer.kind: NcclTransfer,
}

# `resources.weight_transfer`: how the learner's weights reach each student engine replica.
WEIGHT_TRANSFERS = ("auto", *TRANSFERS)
NEEDS_CUDA = (CudaIpcTransfer.kind, NcclTransfer.kind)
SAME_NODE_ONLY = (ShmTransfer.kind, CudaIpcTransfer.kind)


def transfer(kind: str) -> WeightTransfer:
    """The transport named `kind` (`auto` is resolved per replica by `transfer_for`)."""
    if kind not in TRANSFERS:
        raise WeightSyncError(f"unknown weight transfer {kind!r}; expected one of {tuple(TRANSFERS)}")
    return TRANSFERS[kind]()


def check_transfer_available(configured: str, cuda_available: bool) -> None:
    """Raises ValueError (naming `resources.weight_transfer`) for a GPU transport without CUDA."""
    if configured in NEEDS_CUDA and not cuda_available:
        raise ValueError(
            f"resources.weight_transfer {configured!r} moves weights GPU to GPU and needs CUDA, which this "
            "machine does not have; use 'auto', 'shm' or 'ray'"
        )


def transfer_for(configured: str, learner_node: str, engine_node: str) -> str:
    """The transport for one engine replica. `auto` uses shared memory only where the engine shares
    the learner's node (a tmpfs file cannot reach another node) and Ray's object store elsewhere; `shm`
    and `cuda_ipc` refuse an engine on another node rather than fail at the first update."""
    if configured not in WEIGHT_TRANSFERS:
        raise ValueError(f"unknown weight transfer {configured!r}; expected one of {WEIGHT_TRANSFERS}")
    if configured == "auto":
        return ShmTransfer.kind if engine_node == learner_node else RayTransfer.kind
    if configured in SAME_NODE_ONLY and engine_node != learner_node:
        raise ValueError(
            f"weight_transfer {configured!r} needs every student engine on the learner's node; an "
            f"engine runs on node {engine_node[:12]}, the learner on {learner_node[:12]} "
            "(use 'auto', 'ray' or 'nccl')"
        )
    return configured


def export_weights(named_tensors: NamedTensors, kinds: Iterable[str]) -> dict[str, WeightHandoff]:
    """Learner side: one handoff per distinct kind in `kinds` (one entry per replica: a streamed
    transport waits for that many replicas to apply each bucket)."""
    weights = list(named_tensors)
    kinds = list(kinds)
    return {kind: transfer(kind).export(weights, kinds.count(kind)) for kind in sorted(set(kinds))}


def release_weights(handoffs: Iterable[WeightHandoff]) -> None:
    """Learner side: frees what `export_weights` made."""
    for handoff in handoffs:
        transfer(handoff.kind).release(handoff)


async def apply_weights(handoff: WeightHandoff, llm: RpcEngine, name: str) -> None:
    """Engine side: loads `handoff` into `llm` by its own transport."""
    await transfer(handoff.kind).apply(handoff, llm, name)
