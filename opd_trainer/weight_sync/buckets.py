"""Named tensors in buckets of bounded size, and a bucket packed into one flat byte tensor and back.

Every transport moves weights bucket by bucket so that no side ever holds a second full copy of the
model: `buckets` groups (name, tensor) pairs in order into buckets of at most `max_bytes` (a tensor
larger than that is a bucket of its own); `pack_bucket` copies one bucket into a flat `uint8` buffer at
aligned offsets (`BucketEntry` says where each tensor lies) and `unpack_bucket` turns the buffer back
into named views without copying. Pure torch: CPU tensors and CUDA tensors alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 512 * 1024 * 1024
"""The bucket size every transport uses unless told otherwise (512 MiB)."""

ALIGNMENT = 256
"""Byte alignment of each tensor inside a packed bucket (any dtype's view of it is then aligned)."""

NamedTensors = Iterable[tuple[str, torch.Tensor]]


def num_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def buckets(
    named_tensors: NamedTensors, max_bytes: int = DEFAULT_BUCKET_BYTES
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of `named_tensors`, in order, each at most `max_bytes` of tensor data; a
    tensor larger than `max_bytes` is a bucket alone. Lazy: a tensor is pulled from the iterable only
    when its bucket is being filled, so a caller can gather tensors one at a time."""
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        tensor_bytes = num_bytes(tensor)
        if bucket and size + tensor_bytes > max_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor_bytes
    if bucket:
        yield bucket


@dataclass(frozen=True)
class BucketEntry:
    """Where one tensor lies in a packed bucket: `offset` bytes from the start, `nbytes` long."""

    name: str
    dtype: str  # torch dtype name without the prefix: "float32", "bfloat16"
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{self.name}: unknown dtype {self.dtype!r}")
        return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGNMENT) * ALIGNMENT


def bucket_layout(bucket: Iterable[tuple[str, torch.Tensor]]) -> tuple[list[BucketEntry], int]:
    """The entries of `bucket` packed at aligned offsets, and the flat size they need in bytes."""
    entries = []
    offset = 0
    for name, tensor in bucket:
        offset = _aligned(offset)
        size = num_bytes(tensor)
        entries.append(BucketEntry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, size))
        offset += size
    return entries, offset


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s data as a flat `uint8` tensor (a view when it is contiguous; 0-d and empty included)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack_bucket(
    bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[BucketEntry]]:
    """`bucket` copied into one flat `uint8` tensor (`out`'s front when given: a buffer reused for
    every bucket, on the device the transport sends from) and the entries to unpack it."""
    entries, size = bucket_layout(bucket)
    if out is None:
        device = bucket[0][1].device if bucket else torch.device("cpu")
        out = torch.empty(size, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < size:
        raise ValueError(f"pack buffer must be a flat uint8 tensor of >= {size} bytes")
    for entry, (_, tensor) in zip(entries, bucket, strict=True):
        if entry.nbytes:
            out[entry.offset : entry.offset + entry.nbytes].copy_(byte_view(tensor))
    return out[:size], entries


def unpack_bucket(flat: torch.Tensor, entries: Iterable[BucketEntry]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a packed bucket, as views of `flat` (no copy: they live as long as it)."""
    out = []
    for entry in entries:
        if entry.offset + entry.nbytes > flat.numel():
            raise ValueError(
                f"{entry.name}: bytes {entry.offset}..{entry.offset + entry.nbytes} past the bucket"
            )
        raw = flat[entry.offset : entry.offset + entry.nbytes]
        out.append((entry.name, raw.view(entry.torch_dtype).reshape(entry.shape)))
    return out
