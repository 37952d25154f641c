"""The GPU-to-GPU transports: "cuda_ipc" (engines on the learner's node) and "nccl" (engines anywhere).

Both stream the weights bucket by bucket through one flat buffer on learner rank 0's GPU (its size:
the largest bucket, `DEFAULT_BUCKET_BYTES` or one tensor larger than that), so neither side ever
holds a second full copy of the model in GPU memory:

- `CudaIpcTransfer`: each bucket is packed into the buffer (`buckets.pack_bucket`) and its CUDA IPC
  handle (`torch.multiprocessing.reductions.reduce_tensor`) goes to every vLLM worker with the bucket's
  (name, dtype, shape, offset) entries; each worker opens the buffer, loads the views in place and
  answers; the learner reuses the buffer only when every replica has acknowledged the bucket. The
  learner's GPU must be visible to the engine's workers (same node; under Ray, not hidden by
  `CUDA_VISIBLE_DEVICES`).
- `NcclTransfer`: a process group of learner rank 0 (rank 0) and every worker of every nccl replica
  (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`, so neither side's own torch.distributed
  group is touched), made for each update; the learner broadcasts each bucket, the workers receive it
  into a buffer of their own, load it and answer.

The handshake is the same for both and runs through a `BucketBoard` (a small threaded Ray actor made
by `export`; a plain object in tests): the learner's sending thread posts bucket i's message and waits
for one acknowledgement per replica; each replica's `apply` takes message i, has its workers load it
(`collective_rpc` into `WeightReloadExtension`, between a begin and a finish that wrap vLLM's layerwise
reload, as one `reload_weights` call does) and acknowledges. A worker that refuses or fails aborts the
board: the learner stops sending and the other replicas fail their update. `release` aborts what is
left, joins the thread and drops the buffer.

Status: opt-in (`resources.weight_transfer: cuda_ipc | nccl`; `auto` never picks them) and not yet run
on a GPU: the GPU machine available to the project has no vLLM. What is tested, on CPU: the board's
protocol (ordering, waiting for every acknowledgement, aborts, release), pack/unpack, both transports
end to end with CPU tensors standing in for CUDA ones (an in-process handle for IPC, a gloo group for
NCCL) against the real worker extension over a stand-in model runner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import ray
import torch

from opd_trainer.errors import WeightSyncError
from opd_trainer.weight_sync.base import RpcEngine, WeightTransfer
from opd_trainer.weight_sync.buckets import (
    DEFAULT_BUCKET_BYTES,
    BucketEntry,
    NamedTensors,
    bucket_layout,
    buckets,
    pack_bucket,
)
from opd_trainer.weight_sync.gpu import Broadcaster, pynccl_comm, share_cuda_buffer
from opd_trainer.weight_sync.safetensors_stream import TensorSpec, specs_to_wire
from opd_trainer.weight_sync.worker_extension import (
    BEGIN_RELOAD,
    CHECK_SPECS,
    FINISH_RELOAD,
    IPC_LOAD_BUCKET,
    NCCL_JOIN,
    NCCL_LOAD_BUCKET,
)

logger = logging.getLogger(__name__)

STREAM_TIMEOUT_S = 600.0
"""How long either side waits for the other at one step of the handshake before giving up."""

GROUP_MESSAGE = -1
"""The board index of the nccl group's address (buckets are 0, 1, ...)."""


@dataclass(frozen=True)
class BucketMessage:
    """What a replica needs to load bucket `index`: where each tensor lies in the flat buffer of `size`
    bytes, and (cuda_ipc) the pickled IPC handle of the learner's buffer."""

    index: int
    entries: tuple[BucketEntry, ...]
    size: int
    handle: bytes = b""

    def to_wire(self) -> dict[str, Any]:
        """Plain values only, for vLLM's RPC serializer (`worker_extension.entries_from_wire`)."""
        return {
            "index": self.index,
            "entries": [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries],
            "size": self.size,
            "handle": self.handle,
        }


@dataclass(frozen=True)
class GroupAddress:
    """Where the nccl group meets (learner rank 0's host) and how many ranks it has."""

    host: str
    port: int
    world_size: int


class BucketBoard:
    """The handshake between the learner's sending thread and `consumers` engine replicas.

    Thread-safe, blocking calls (a Ray actor with one thread per waiting caller: `_board`). Every wait
    ends with `WeightSyncError` on `abort` or after `timeout` seconds."""

    def __init__(self, consumers: int) -> None:
        self.consumers = consumers
        self._cond = threading.Condition()
        self._messages: dict[int, Any] = {}
        self._acks: dict[int, list[str]] = {}
        self._aborted = ""
        self._next_rank = 1  # rank 0 is the learner
        self._registered = 0

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self._aborted:
                raise WeightSyncError(f"weight stream aborted: {self._aborted}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightSyncError(f"weight stream: no {what} within {timeout:.0f} s")
            self._cond.wait(left)
        if self._aborted:
            raise WeightSyncError(f"weight stream aborted: {self._aborted}")

    def post(self, index: int, message: Any) -> None:
        with self._cond:
            self._messages[index] = message
            self._acks[index] = []
            self._cond.notify_all()

    def take(self, index: int, timeout: float = STREAM_TIMEOUT_S) -> Any:
        with self._cond:
            self._wait(lambda: index in self._messages, timeout, f"message {index} from the learner")
            return self._messages[index]

    def ack(self, index: int, error: str = "") -> None:
        with self._cond:
            self._acks.setdefault(index, []).append(error)
            if error:
                self._aborted = self._aborted or error
            self._cond.notify_all()

    def wait_acks(self, index: int, timeout: float = STREAM_TIMEOUT_S) -> None:
        """Returns once every replica acknowledged `index`; the message is dropped then."""
        with self._cond:
            self._wait(lambda: len(self._acks.get(index, ())) >= self.consumers, timeout, f"acks of {index}")
            self._messages.pop(index, None)

    def register(self, workers: int) -> int:
        """A replica with `workers` workers joins; returns the group rank of its first worker."""
        with self._cond:
            first, self._next_rank = self._next_rank, self._next_rank + workers
            self._registered += 1
            self._cond.notify_all()
            return first

    def wait_registered(self, timeout: float = STREAM_TIMEOUT_S) -> int:
        """The group's world size (the learner and every registered worker) once every replica has
        registered."""
        with self._cond:
            self._wait(lambda: self._registered >= self.consumers, timeout, "replicas registering")
            return self._next_rank

    def abort(self, reason: str) -> None:
        with self._cond:
            self._aborted = self._aborted or reason
            self._cond.notify_all()

    def aborted(self) -> str:
        with self._cond:
            return self._aborted


class _Board:
    """Calls a board the same way whether it is a Ray actor handle or a plain `BucketBoard`."""

    def __init__(self, board: Any) -> None:
        self.board = board
        self.remote = not isinstance(board, BucketBoard)

    def call(self, method: str, *args: Any) -> Any:
        if self.remote:
            return ray.get(getattr(self.board, method).remote(*args))
        return getattr(self.board, method)(*args)

    async def acall(self, method: str, *args: Any) -> Any:
        if self.remote:
            return await getattr(self.board, method).remote(*args)
        return await asyncio.to_thread(getattr(self.board, method), *args)


def ray_board(consumers: int) -> Any:
    """A `BucketBoard` as a Ray actor: one thread for each replica's wait, the learner's and spares."""
    actor = ray.remote(BucketBoard).options(num_cpus=0, max_concurrency=2 * consumers + 4)
    return actor.remote(consumers)


CommFactory = Callable[[str, int, int, int, torch.device], Broadcaster]


def _send_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _host_address() -> str:
    with contextlib.suppress(Exception):
        return ray.util.get_node_ip_address()
    return socket.gethostbyname(socket.gethostname())


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class CudaIpcHandoff:
    kind: ClassVar[str] = "cuda_ipc"
    stream_id: str
    board: tuple[Any, ...]  # the board, inside a tuple as a Ray handoff's refs are
    specs: tuple[TensorSpec, ...]
    num_buckets: int
    num_tensors: int
    num_bytes: int


@dataclass(frozen=True)
class NcclHandoff:
    kind: ClassVar[str] = "nccl"
    stream_id: str
    board: tuple[Any, ...]
    specs: tuple[TensorSpec, ...]
    num_buckets: int
    num_tensors: int
    num_bytes: int


# The learner's sending threads, by `stream_id`, until `release` joins them.
_STREAMS: dict[str, tuple[threading.Thread, _Board]] = {}


class _StreamedTransfer(WeightTransfer):
    """What cuda_ipc and nccl share: the learner's sending thread and the engine's receiving loop."""

    handoff_class: ClassVar[type[CudaIpcHandoff] | type[NcclHandoff]]
    load_method: ClassVar[str]

    def __init__(
        self,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        board_factory: Callable[[int], Any] = ray_board,
        timeout_s: float = STREAM_TIMEOUT_S,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.board_factory = board_factory
        self.timeout_s = timeout_s

    def export(self, named_tensors: NamedTensors, consumers: int = 1) -> Any:
        plan = list(buckets(named_tensors, self.bucket_bytes))  # references only: no tensor is copied
        specs = tuple(TensorSpec.of(name, tensor) for bucket in plan for name, tensor in bucket)
        board = _Board(self.board_factory(consumers))
        stream_id = uuid.uuid4().hex
        thread = threading.Thread(
            target=self._send_all, args=(plan, board), name=f"opd-{self.kind}-{stream_id[:8]}", daemon=True
        )
        _STREAMS[stream_id] = (thread, board)
        thread.start()
        return self.handoff_class(
            stream_id=stream_id,
            board=(board.board,),
            specs=specs,
            num_buckets=len(plan),
            num_tensors=len(specs),
            num_bytes=sum(spec.nbytes for spec in specs),
        )

    def _send_all(self, plan: list[list[tuple[str, torch.Tensor]]], board: _Board) -> None:
        try:
            self._send(plan, board)
        except Exception as exc:  # the engines hear of it through the board
            logger.warning("%s weight stream failed: %s", self.kind, exc)
            with contextlib.suppress(Exception):
                board.call("abort", f"learner: {exc}")

    def _send(self, plan: list[list[tuple[str, torch.Tensor]]], board: _Board) -> None:
        raise NotImplementedError

    @staticmethod
    def _buffer(plan: list[list[tuple[str, torch.Tensor]]]) -> torch.Tensor:
        """One flat buffer for every bucket: the largest bucket's packed size."""
        size = max((bucket_layout(bucket)[1] for bucket in plan), default=0)
        return torch.empty(size, dtype=torch.uint8, device=_send_device())

    def release(self, handoff: Any) -> None:
        assert isinstance(handoff, self.handoff_class)
        stream = _STREAMS.pop(handoff.stream_id, None)
        if stream is None:
            return
        thread, board = stream
        with contextlib.suppress(Exception):
            board.call("abort", "released")  # a no-op for a stream every replica finished
        thread.join(self.timeout_s)
        if board.remote:
            with contextlib.suppress(Exception):
                ray.kill(board.board)

    async def apply(self, handoff: Any, llm: RpcEngine, name: str) -> None:
        assert isinstance(handoff, self.handoff_class)
        board = _Board(handoff.board[0])
        try:
            results = await llm.collective_rpc(CHECK_SPECS, args=(specs_to_wire(handoff.specs),))
            _raise_failed(results, name)
            await self._prepare(board, llm, name, len(results))
            _raise_failed(await llm.collective_rpc(BEGIN_RELOAD), name)
            for index in range(handoff.num_buckets):
                message = await board.acall("take", index, self.timeout_s)
                results = await llm.collective_rpc(self.load_method, args=(message.to_wire(),))
                failure = next((r["error"] for r in results if not r["ok"]), "")
                await board.acall("ack", index, f"{name}: {failure}" if failure else "")
                _raise_failed(results, name)
            _raise_failed(await llm.collective_rpc(FINISH_RELOAD, args=(True,)), name)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await board.acall("abort", f"{name}: {exc}")
            with contextlib.suppress(Exception):
                await llm.collective_rpc(FINISH_RELOAD, args=(False,))
            if isinstance(exc, WeightSyncError) or not isinstance(exc, Exception):
                raise
            raise WeightSyncError(f"{name}: {self.kind} weight update failed: {exc}") from exc

    async def _prepare(self, board: _Board, llm: RpcEngine, name: str, workers: int) -> None:
        """What a replica does before the first bucket (nccl: join the group)."""


def _raise_failed(results: list[dict[str, Any]], name: str) -> None:
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        raise WeightSyncError(f"{name}: a worker could not load weights: {failed[0]}")


class CudaIpcTransfer(_StreamedTransfer):
    """`cuda_ipc`: each bucket in one flat buffer on the learner's GPU, opened in place by every
    worker through its CUDA IPC handle (engines on the learner's node)."""

    kind = "cuda_ipc"
    handoff_class = CudaIpcHandoff
    load_method = IPC_LOAD_BUCKET

    def __init__(
        self, *args: Any, share: Callable[[torch.Tensor], bytes] = share_cuda_buffer, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.share = share

    def _send(self, plan: list[list[tuple[str, torch.Tensor]]], board: _Board) -> None:
        buffer = self._buffer(plan)
        handle = self.share(buffer)
        for index, bucket in enumerate(plan):
            flat, entries = pack_bucket(bucket, buffer)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)  # packed before any worker reads it
            board.call("post", index, BucketMessage(index, tuple(entries), flat.numel(), handle))
            board.call("wait_acks", index, self.timeout_s)  # only then may the buffer be overwritten


class NcclTransfer(_StreamedTransfer):
    """`nccl`: each bucket broadcast from the learner's GPU to every worker of every nccl replica."""

    kind = "nccl"
    handoff_class = NcclHandoff
    load_method = NCCL_LOAD_BUCKET

    def __init__(
        self, *args: Any, comm_factory: CommFactory = pynccl_comm, host: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.comm_factory = comm_factory
        self.host = host

    def _send(self, plan: list[list[tuple[str, torch.Tensor]]], board: _Board) -> None:
        world_size = board.call("wait_registered", self.timeout_s)
        host = self.host or _host_address()
        address = GroupAddress(host, _free_port(host), world_size)
        board.call("post", GROUP_MESSAGE, address)
        comm = self.comm_factory(address.host, address.port, 0, world_size, _send_device())
        buffer = self._buffer(plan)
        for index, bucket in enumerate(plan):
            flat, entries = pack_bucket(bucket, buffer)
            board.call("post", index, BucketMessage(index, tuple(entries), flat.numel()))
            comm.broadcast(flat, 0)
            board.call("wait_acks", index, self.timeout_s)

    async def _prepare(self, board: _Board, llm: RpcEngine, name: str, workers: int) -> None:
        first_rank = await board.acall("register", workers)
        address: GroupAddress = await board.acall("take", GROUP_MESSAGE, self.timeout_s)
        args = (address.host, address.port, first_rank, address.world_size)
        _raise_failed(await llm.collective_rpc(NCCL_JOIN, args=args), name)
