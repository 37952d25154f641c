"""Which weights a sampled completion came from, when updates arrive while sampling runs.

`VersionGate` admits sampling requests under the weights (or adapter) now held and yields their
version; an update admits none while it runs and starts only once the admitted ones have finished, so
the version a completion records is the one its whole sequence was sampled with (updates may come
between a rollout's calls: `max_staleness >= 2` publishes without waiting for the batches sampled ahead).

An engine holds one gate for the whole engine when updates replace its weights (every request's model
changes), and one per client (job) when it serves LoRA adapters (`engine/adapters.py`): job A's adapter
update then holds only A's sampling, never job B's on the same engine (`Engine._version_gate`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class VersionGate:
    """Sampling requests admitted under one version, and the updates that change it, one at a time."""

    def __init__(self) -> None:
        self.version = 0
        self.admitted = 0  # sampling requests admitted under `version` and not yet finished
        self._updating = asyncio.Lock()
        self._accepting = asyncio.Event()
        self._accepting.set()
        self._idle = asyncio.Event()  # set while no admitted request runs
        self._idle.set()

    @contextlib.asynccontextmanager
    async def admit(self) -> AsyncIterator[int]:
        """Holds one sampling request under the current version while the block runs; yields it.
        Waits while an update runs."""
        while not self._accepting.is_set():
            await self._accepting.wait()
        self.admitted += 1  # no await since the check: an update cannot slip in between
        self._idle.clear()
        try:
            yield self.version
        finally:
            self.admitted -= 1
            if self.admitted == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def updating(self) -> AsyncIterator[None]:
        """Runs the block with no sampling request admitted: waits for the admitted ones to finish
        and admits none until the block ends (whether it succeeded or not). Updates run one at a time.
        The block sets `version` when it changed what sampling uses."""
        async with self._updating:
            self._accepting.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._accepting.set()
