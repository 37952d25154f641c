"""What every weight transport shares: the `WeightTransfer` interface and the engine it talks to.

A transport's learner half (`export`, `release`) runs in learner rank 0; its engine half (`apply`) runs
in an engine actor and reaches vLLM's workers only through `collective_rpc` (any object with that
coroutine: vLLM's `AsyncLLM`, the in-process core, or a test's stand-in), so this package imports
neither the engine nor the learner.
"""

from __future__ import annotations

import os
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Protocol

from opd_trainer.errors import WeightSyncError
from opd_trainer.weight_sync.buckets import NamedTensors

# tmpfs is memory: the "file" is the shared buffer, not a disk write. Containers with a tiny /dev/shm
# (Docker's 64 MB default) can point this elsewhere.
SHM_DIR_ENV = "OPD_SHM_DIR"


class RpcEngine(Protocol):
    """The one thing a transport uses of a running engine: a call on every one of its workers."""

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]: ...


class Handoff(Protocol):
    """A small picklable value that crosses Ray from the learner to the engines; names its transport."""

    kind: ClassVar[str]


class WeightTransfer(ABC):
    """One transport: the learner's `export` / `release` and the engine's `apply`."""

    kind: ClassVar[str]

    @abstractmethod
    def export(self, named_tensors: NamedTensors, consumers: int = 1) -> Any:
        """Learner side: the tensors as a handoff that `consumers` engine replicas will each apply."""

    def release(self, handoff: Any) -> None:  # noqa: B027 (a transport may hold nothing)
        """Learner side: frees what `export` made, once every engine has applied it."""

    @abstractmethod
    async def apply(self, handoff: Any, llm: RpcEngine, name: str) -> None:
        """Engine side: loads `handoff` into the running engine `llm` (replica `name`, for errors).
        Raises `WeightSyncError` when a worker refuses the weights."""

    @contextmanager
    def exported(self, named_tensors: NamedTensors, consumers: int = 1) -> Iterator[Any]:
        """`export`, then `release` on leaving the block."""
        handoff = self.export(named_tensors, consumers)
        try:
            yield handoff
        finally:
            self.release(handoff)


def check_worker_results(results: list[dict[str, Any]], name: str) -> None:
    """Raises `WeightSyncError` naming replica `name` if any worker answered {"ok": False}."""
    failed = [r["error"] for r in results if not r["ok"]]
    if failed:
        raise WeightSyncError(f"{name}: a worker could not load weights: {failed[0]}")


def shared_memory_dir() -> Path:
    """`OPD_SHM_DIR`, else `/dev/shm` where it is writable, else the temp dir."""
    configured = os.environ.get(SHM_DIR_ENV)
    if configured:
        return Path(configured)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
