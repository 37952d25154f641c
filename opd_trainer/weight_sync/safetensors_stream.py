"""A safetensors file written tensor by tensor, never holding the whole model in one buffer.

`safetensors.torch.save_file` serialises every tensor into one in-memory buffer before writing: a
second full copy of the model. The format is simple enough to stream instead: an 8-byte little-endian
header length, a JSON header (per name: dtype, shape, `data_offsets` [begin, end) into the data
section; optional `__metadata__` of strings), padded with spaces to a multiple of 8, then the raw bytes
in offset order. Offsets follow from shapes alone, so the header is written first and each tensor's
bytes go straight from the tensor to the file.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from opd_trainer.weight_sync.buckets import byte_view, dtype_name

# torch dtype name -> safetensors dtype tag
_DTYPE_TAGS = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


@dataclass(frozen=True)
class TensorSpec:
    """What the header needs of one tensor, known before its data (e.g. a ZeRO-3 parameter's full
    shape before it is gathered)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> TensorSpec:
        return cls(name, tensor.dtype, tuple(tensor.shape))


def specs_to_wire(specs: Iterable[TensorSpec]) -> list[list[Any]]:
    """[name, dtype name, shape] per spec: plain values for vLLM's RPC serializer."""
    return [[spec.name, dtype_name(spec.dtype), list(spec.shape)] for spec in specs]


def header_bytes(specs: Iterable[TensorSpec], metadata: dict[str, str] | None = None) -> bytes:
    """The length prefix and JSON header for tensors laid out in `specs` order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        tag = _DTYPE_TAGS.get(dtype_name(spec.dtype))
        if tag is None:
            raise ValueError(f"{spec.name}: safetensors has no dtype for {spec.dtype}")
        if spec.name in header:
            raise ValueError(f"tensor name {spec.name!r} appears twice")
        header[spec.name] = {
            "dtype": tag,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


class SafetensorsWriter:
    """Writes a safetensors file whose layout (`specs`) is known up front, one tensor at a time, in
    `specs` order; `close` checks that every entry was written. A context manager."""

    def __init__(self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None) -> None:
        self.specs = specs
        self.num_bytes = 0
        self._next = 0
        self._handle: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self._handle.write(header_bytes(specs, metadata))

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.specs):
            raise ValueError(f"tensor {name!r} is past the header's {len(self.specs)} entries")
        spec = self.specs[self._next]
        if (name, tensor.dtype, tuple(tensor.shape)) != (spec.name, spec.dtype, spec.shape):
            raise ValueError(
                f"tensor {name!r} {tensor.dtype} {tuple(tensor.shape)} does not match its header entry "
                f"{spec.name!r} {spec.dtype} {spec.shape}"
            )
        # One tensor at a time on the host (no copy for a CPU tensor that is already contiguous).
        data = byte_view(tensor.detach().to("cpu"))
        if data.numel():
            self._handle.write(memoryview(data.numpy()))
        self._next += 1
        self.num_bytes += spec.nbytes

    def close(self) -> None:
        self._handle.close()
        if self._next != len(self.specs):
            raise ValueError(f"tensors ended before {self.specs[self._next].name!r}")

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._handle.close()


def write_safetensors(
    path: Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    specs: list[TensorSpec] | None = None,
    metadata: dict[str, str] | None = None,
) -> tuple[int, int]:
    """Writes `named_tensors` to `path` as a safetensors file; returns (tensors, data bytes).

    Without `specs` the pairs are listed first (references, not copies) to lay out the header. With
    `specs` (the names, dtypes and shapes in the order the tensors will come) the iterable is consumed
    lazily, one tensor in memory at a time, and each tensor must match its spec."""
    if specs is None:
        pairs = list(named_tensors)
        specs = [TensorSpec.of(name, tensor) for name, tensor in pairs]
        named_tensors = pairs
    with SafetensorsWriter(path, specs, metadata) as writer:
        for name, tensor in named_tensors:
            writer.write(name, tensor)
    return len(specs), writer.num_bytes
