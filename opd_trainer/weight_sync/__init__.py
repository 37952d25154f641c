"""Weight sync: how the learner's weights reach running vLLM engines, one class per transport.

A package below both `engine/` and `learner/` (it imports neither, nor `driver/`): the learner calls
the export half, the engine the apply half, the driver (`driver/publish.py`) joins them.

- `base.py`: the `WeightTransfer` interface every transport implements and the engine it talks to.
- `transports.py`: the host-memory transports ("shm": a safetensors file on the learner node's tmpfs,
  streamed tensor by tensor; "ray": Ray's object store, one object per bucket, staged on the engine
  node's tmpfs), the registry (`transfer`), the per-replica choice (`transfer_for`; `auto` picks shm
  or ray) and the learner's / engine's entry points. These run in the CPU test suites and GPU jobs.
- `streamed.py` + `gpu.py`: "cuda_ipc" (same node) and "nccl" (any node), bucket by bucket through one
  flat GPU buffer. Opt-in only and not yet run on a GPU (the GPU machine available to the project has
  no vLLM): their protocol and pack/unpack are tested on CPU with stand-ins (an in-process handle,
  a gloo group).
- `buckets.py`: bounded buckets, pack into one flat tensor and unpack into views.
- `safetensors_stream.py`: a safetensors file written tensor by tensor (no second full copy).
- `worker_extension.py`: the worker half in every vLLM worker (`EXTENSION_CLASSPATH`).
- `adapters.py`: a PEFT adapter folder's files from the learner to the engines (LoRA jobs).
"""

from opd_trainer.weight_sync.adapters import AdapterHandoff, AdapterTransfer
from opd_trainer.weight_sync.base import SHM_DIR_ENV, RpcEngine, WeightTransfer, shared_memory_dir
from opd_trainer.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketEntry,
    buckets,
    pack_bucket,
    unpack_bucket,
)
from opd_trainer.weight_sync.safetensors_stream import SafetensorsWriter, TensorSpec, write_safetensors
from opd_trainer.weight_sync.streamed import (
    BucketBoard,
    BucketMessage,
    CudaIpcHandoff,
    CudaIpcTransfer,
    NcclHandoff,
    NcclTransfer,
)
from opd_trainer.weight_sync.transports import (
    WEIGHT_TRANSFERS,
    RayHandoff,
    RayTransfer,
    ShmHandoff,
    ShmTransfer,
    WeightHandoff,
    apply_weights,
    check_transfer_available,
    export_weights,
    release_weights,
    transfer,
    transfer_for,
)
from opd_trainer.weight_sync.worker_extension import EXTENSION_CLASSPATH, WeightReloadExtension

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "EXTENSION_CLASSPATH",
    "SHM_DIR_ENV",
    "WEIGHT_TRANSFERS",
    "AdapterHandoff",
    "AdapterTransfer",
    "BucketBoard",
    "BucketEntry",
    "BucketMessage",
    "CudaIpcHandoff",
    "CudaIpcTransfer",
    "NcclHandoff",
    "NcclTransfer",
    "RayHandoff",
    "RayTransfer",
    "RpcEngine",
    "SafetensorsWriter",
    "ShmHandoff",
    "ShmTransfer",
    "TensorSpec",
    "WeightHandoff",
    "WeightReloadExtension",
    "WeightTransfer",
    "apply_weights",
    "buckets",
    "check_transfer_available",
    "export_weights",
    "pack_bucket",
    "release_weights",
    "shared_memory_dir",
    "transfer",
    "transfer_for",
    "unpack_bucket",
    "write_safetensors",
]
