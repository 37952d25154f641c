"""`weight_sync/buckets.py` and `safetensors_stream.py`: bounded buckets, pack/unpack, a streamed file."""

from __future__ import annotations

import json
import struct
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from opd_trainer.weight_sync.buckets import buckets, pack_bucket, unpack_bucket
from opd_trainer.weight_sync.safetensors_stream import TensorSpec, write_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    return {
        "a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b.weight": torch.randn(5, 7).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "ids": torch.arange(5, dtype=torch.int64),
        "flag": torch.tensor([True, False]),
        "half": torch.randn(3).to(torch.float16),
    }


def _read(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def test_streamed_file_loads_with_safe_open_and_equals_the_tensors(tmp_path: Path) -> None:
    tensors = _tensors()
    count, size = write_safetensors(tmp_path / "w.safetensors", tensors.items(), metadata={"format": "pt"})
    assert count == len(tensors) and size == sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = _read(tmp_path / "w.safetensors")
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name], tensor)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    raw = (tmp_path / "w.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert header_len % 8 == 0 and json.loads(raw[8 : 8 + header_len])["scalar"]["shape"] == []


def test_non_contiguous_tensors_are_written_by_value(tmp_path: Path) -> None:
    t = torch.arange(20, dtype=torch.float32).reshape(4, 5).t()
    write_safetensors(tmp_path / "t.safetensors", [("t", t)])
    assert torch.equal(_read(tmp_path / "t.safetensors")["t"], t)


def test_with_specs_the_tensors_stream_one_at_a_time(tmp_path: Path) -> None:
    tensors = _tensors()
    specs = [TensorSpec.of(n, t) for n, t in tensors.items()]
    pulled: list[str] = []

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors.items():
            pulled.append(name)
            yield name, tensor.clone()  # as a ZeRO-3 gather would: a fresh tensor, dropped after use

    write_safetensors(tmp_path / "s.safetensors", gathered(), specs=specs)
    assert pulled == list(tensors)
    assert all(torch.equal(_read(tmp_path / "s.safetensors")[n], t) for n, t in tensors.items())
    with pytest.raises(ValueError, match="does not match"):
        write_safetensors(tmp_path / "x.safetensors", reversed(list(tensors.items())), specs=specs)
    with pytest.raises(ValueError, match="ended before"):
        write_safetensors(tmp_path / "y.safetensors", list(tensors.items())[:2], specs=specs)


def test_writer_memory_does_not_grow_with_the_model(tmp_path: Path) -> None:
    """Python-side peak while writing stays a small constant, not a copy of the model (save_file builds
    one buffer of the whole model; tracemalloc sees that as a model-sized allocation)."""

    def peak(num_tensors: int) -> int:
        tensors = [(f"t{i}", torch.zeros(256 * 1024)) for i in range(num_tensors)]  # 1 MiB each
        tracemalloc.start()
        write_safetensors(tmp_path / f"m{num_tensors}.safetensors", tensors)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    small, large = peak(4), peak(32)
    assert large < 1024 * 1024, f"peak {large} bytes while writing 32 MiB"
    assert large < small + 256 * 1024


def test_buckets_are_bounded_in_order_and_a_big_tensor_is_alone() -> None:
    sizes = [40, 40, 40, 200, 10, 10]  # bytes (uint8 tensors)
    named = [(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)]
    got = [[name for name, _ in bucket] for bucket in buckets(named, max_bytes=100)]
    assert got == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert [name for bucket in buckets(named, 100) for name, _ in bucket] == [n for n, _ in named]
    assert [[n for n, _ in b] for b in buckets(named, 80)] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert list(buckets([], 100)) == []
    with pytest.raises(ValueError):
        list(buckets(named, 0))


def test_buckets_pull_lazily() -> None:
    pulled: list[int] = []

    def source() -> Iterator[tuple[str, torch.Tensor]]:
        for i in range(4):
            pulled.append(i)
            yield f"t{i}", torch.zeros(60, dtype=torch.uint8)

    stream = buckets(source(), max_bytes=100)
    assert [n for n, _ in next(stream)] == ["t0"] and pulled == [0, 1]


def test_pack_and_unpack_round_trip_through_one_flat_tensor() -> None:
    tensors = list(_tensors().items())
    flat, entries = pack_bucket(tensors)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(entry.offset % 256 == 0 for entry in entries)
    views = unpack_bucket(flat, entries)
    assert [name for name, _ in views] == [name for name, _ in tensors]
    for (_, view), (_, tensor) in zip(views, tensors, strict=True):
        assert view.dtype == tensor.dtype and view.shape == tensor.shape and torch.equal(view, tensor)
        assert view.numel() == 0 or view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_pack_reuses_a_buffer_and_refuses_a_small_one() -> None:
    buffer = torch.full((4096,), 7, dtype=torch.uint8)
    first, _ = pack_bucket([("a", torch.ones(4))], buffer)
    assert first.data_ptr() == buffer.data_ptr()
    flat, entries = pack_bucket([("b", torch.arange(3.0)), ("c", torch.tensor(1, dtype=torch.int32))], buffer)
    assert torch.equal(dict(unpack_bucket(flat, entries))["b"], torch.arange(3.0))
    with pytest.raises(ValueError, match="pack buffer"):
        pack_bucket([("big", torch.zeros(2048))], buffer)
