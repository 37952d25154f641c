"""`weight_sync/streamed.py`: the cuda_ipc / nccl handshake, end to end on CPU.

No GPU here: CPU tensors stand in for CUDA ones, an in-process table for CUDA IPC handles and a gloo
group (torch.distributed's, one rank per thread) for NCCL. The learner half runs its real sending
thread; the engine half runs against the real `WeightReloadExtension` (only vLLM's layerwise-reload
calls and the GPU openers are replaced) over a stand-in for vLLM's model runner.
"""

from __future__ import annotations

import asyncio
import datetime
import socket
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from opd_trainer.errors import WeightSyncError
from opd_trainer.weight_sync.streamed import _STREAMS, BucketBoard, CudaIpcTransfer, NcclTransfer
from opd_trainer.weight_sync.worker_extension import WeightReloadExtension

_SHARED: dict[int, torch.Tensor] = {}  # the "IPC handles": one process, so a table of buffers


def _share(buffer: torch.Tensor) -> bytes:
    _SHARED[id(buffer)] = buffer
    return str(id(buffer)).encode()


class _Gloo:
    """A broadcast over a gloo group of its own (what vLLM's PyNcclCommunicator is on GPU)."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: torch.device) -> None:
        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = src
        self.group.broadcast([tensor], options).wait()


def _weights(scale: float = 1.0) -> dict[str, torch.Tensor]:
    return {
        "model.embed_tokens.weight": torch.arange(12, dtype=torch.float32).reshape(4, 3) * scale,
        "model.layers.0.mlp.up_proj.weight": torch.full((8, 8), scale).to(torch.bfloat16),  # 128 B
        "model.norm.weight": torch.ones(3) * scale,
        "model.scale": torch.tensor(scale),
    }


class _Model:
    def __init__(self, log: list[str]) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.log = log

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.log.append("load " + ",".join(name for name, _ in weights))
        self.loaded.update({name: tensor.clone() for name, tensor in weights})


class _Worker(WeightReloadExtension):
    def __init__(self, model_dir: Path, rank: int, log: list[str]) -> None:
        self.rank = rank
        self.device = torch.device("cpu")
        self.log = log
        self.model = _Model(log)
        self.model_runner = SimpleNamespace(  # type: ignore[assignment]
            model_config=SimpleNamespace(
                model=str(model_dir), hf_config=SimpleNamespace(tie_word_embeddings=False)
            ),
            get_model=lambda: self.model,
        )

    def _opd_open_ipc(self, handle: bytes) -> torch.Tensor:
        return _SHARED[int(handle)]

    def _opd_nccl_comm(self, host: str, port: int, rank: int, world_size: int, device: torch.device) -> Any:
        return _Gloo(host, port, rank, world_size, device)

    def _opd_layerwise_begin(self) -> None:
        self.log.append("begin")

    def _opd_layerwise_end(self) -> None:
        self.log.append("end")


class _Engine:
    """Stands for vLLM's `AsyncLLM`: `collective_rpc` runs the method on every worker at once (as
    vLLM's workers do, each in its own process), so collectives across workers can meet."""

    def __init__(self, model_dir: Path, workers: int = 2) -> None:
        self.log: list[str] = []
        self.workers = [_Worker(model_dir, rank, self.log) for rank in range(workers)]

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        calls = (asyncio.to_thread(getattr(worker, method), *args) for worker in self.workers)
        return list(await asyncio.gather(*calls))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    save_file(_weights(), str(tmp_path / "model.safetensors"))
    return tmp_path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _assert_loaded(engine: _Engine, expected: dict[str, torch.Tensor]) -> None:
    for worker in engine.workers:
        assert set(worker.model.loaded) == set(expected)
        for name, tensor in expected.items():
            assert torch.equal(worker.model.loaded[name], tensor), name


def _publish(transfer: Any, engines: list[_Engine], weights: dict[str, torch.Tensor]) -> list[Any]:
    async def run() -> list[Any]:
        handoff = transfer.export(list(weights.items()), consumers=len(engines))
        try:
            return await asyncio.gather(
                *(transfer.apply(handoff, e, f"student-{i}") for i, e in enumerate(engines)),
                return_exceptions=True,
            )
        finally:
            transfer.release(handoff)
            assert handoff.stream_id not in _STREAMS

    return asyncio.run(run())


# -- the board alone ------------------------------------------------------------------------------


def test_board_orders_messages_and_waits_for_every_acknowledgement() -> None:
    board = BucketBoard(consumers=2)
    board.post(0, "bucket 0")
    assert board.take(0) == "bucket 0"
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (board.wait_acks(0, 5), done.set()))
    waiter.start()
    board.ack(0)
    assert not done.wait(0.2), "the learner went on with one replica of two still loading"
    board.ack(0)
    assert done.wait(5)
    waiter.join()
    with pytest.raises(WeightSyncError, match="no message 1"):
        board.take(1, 0.1)


def test_board_abort_wakes_every_waiter() -> None:
    board = BucketBoard(consumers=1)
    errors: list[str] = []

    def wait() -> None:
        try:
            board.take(3, 10)
        except WeightSyncError as exc:
            errors.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    board.ack(0, "student-1: shape mismatch")
    waiter.join(5)
    assert errors == ["weight stream aborted: student-1: shape mismatch"]
    with pytest.raises(WeightSyncError, match="aborted"):
        board.wait_acks(0, 1)


def test_board_gives_each_replicas_workers_their_group_ranks() -> None:
    board = BucketBoard(consumers=2)
    assert board.register(2) == 1 and board.register(4) == 3
    assert board.wait_registered(1) == 7


# -- cuda_ipc -------------------------------------------------------------------------------------


def test_cuda_ipc_streams_every_bucket_through_one_buffer_to_every_replica(model_dir: Path) -> None:
    engines = [_Engine(model_dir), _Engine(model_dir)]
    new = _weights(2.0)
    transfer = CudaIpcTransfer(bucket_bytes=100, board_factory=BucketBoard, share=_share, timeout_s=30)
    _SHARED.clear()
    results = _publish(transfer, engines, new)
    assert results == [None, None]
    for engine in engines:
        _assert_loaded(engine, new)
    assert len(_SHARED) == 1, "every bucket went through the one shared buffer"
    # Buckets of <= 100 bytes (the 128-byte tensor alone), each loaded by both workers, between one begin
    # and one end per worker.
    log = engines[0].log
    assert log[:2] == ["begin", "begin"] and log[-2:] == ["end", "end"]
    loads = [entry for entry in log if entry.startswith("load")]
    assert loads == [
        "load model.embed_tokens.weight",
        "load model.embed_tokens.weight",
        "load model.layers.0.mlp.up_proj.weight",
        "load model.layers.0.mlp.up_proj.weight",
        "load model.norm.weight,model.scale",
        "load model.norm.weight,model.scale",
    ]


def test_cuda_ipc_a_refusing_replica_fails_and_the_learner_stops(model_dir: Path) -> None:
    good, bad = _Engine(model_dir), _Engine(model_dir)
    broken = {**_weights(), "model.norm.weight": torch.ones(5)}
    transfer = CudaIpcTransfer(bucket_bytes=100, board_factory=BucketBoard, share=_share, timeout_s=30)
    results = _publish(transfer, [good, bad], broken)
    assert all(isinstance(r, WeightSyncError) for r in results)
    assert "shape mismatch" in str(results[0]) + str(results[1])
    for engine in (good, bad):
        assert not any(entry.startswith("load") for entry in engine.log)


# -- nccl over gloo -------------------------------------------------------------------------------


def test_nccl_broadcasts_every_bucket_to_every_worker_of_every_replica(model_dir: Path) -> None:
    engines = [_Engine(model_dir, workers=2), _Engine(model_dir, workers=1)]
    new = _weights(3.0)
    transfer = NcclTransfer(
        bucket_bytes=100, board_factory=BucketBoard, comm_factory=_Gloo, host="127.0.0.1", timeout_s=60
    )
    results = _publish(transfer, engines, new)
    assert results == [None, None]
    for engine in engines:
        _assert_loaded(engine, new)
        assert all(worker._opd_comm is None for worker in engine.workers), (
            "the group is left after the update"
        )
