"""The CUDA pieces of the cuda_ipc and nccl transports, apart so that both halves import them.

Not yet run on a GPU (the GPU machine available to the project has no vLLM); the tests stand a
local handle and a gloo group in for them.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import torch


class Broadcaster(Protocol):
    """The one collective the nccl transport uses (vLLM's `PyNcclCommunicator` has it; so does the
    gloo stand-in the tests use)."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> Any: ...


def pynccl_comm(host: str, port: int, rank: int, world_size: int, device: torch.device) -> Broadcaster:
    """An NCCL communicator of its own between learner rank 0 and the engine workers: vLLM's
    `StatelessProcessGroup` rendezvous over TCP, then its `PyNcclCommunicator`, so neither side's own
    torch.distributed group is touched. Needs CUDA and vLLM in the calling process."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=device)


def share_cuda_buffer(buffer: torch.Tensor) -> bytes:
    """The CUDA IPC handle of `buffer` and its GPU's UUID, pickled (any RPC serializer carries bytes)."""
    _, args = torch.multiprocessing.reductions.reduce_tensor(buffer)
    gpu_uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
    return pickle.dumps((gpu_uuid, args))


def open_cuda_buffer(handle: bytes) -> torch.Tensor:
    """The tensor `share_cuda_buffer` shared, in this process (another process on the same node)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    gpu_uuid, args = pickle.loads(handle)
    visible = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if gpu_uuid not in visible:
        raise RuntimeError(
            f"the learner's GPU {gpu_uuid} is not visible to this process (it sees {visible}): cuda_ipc "
            "needs the learner's GPU visible to the engine's workers; use 'nccl'"
        )
    args = list(args)
    args[6] = visible.index(gpu_uuid)  # reduce_tensor's device index, renumbered as this process sees GPUs
    return rebuild_cuda_tensor(*args)
