"""Fair admission of requests from several clients (jobs) to one engine.

An engine shared by several jobs (`engine/shared_engines.py`: a teacher, or a LoRA jobs' student) must
not let one job's burst of scoring or sampling requests starve another's. `FairGate` lets at most
`capacity` requests into the engine at once; when more wait, a freed slot goes to the next client in
turn (round-robin over the clients with waiting requests), so each job gets an equal share of the
engine while both have work queued, and all of it when alone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator


class FairGate:
    """At most `capacity` requests in flight; waiting requests admitted round-robin by client."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.in_flight = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self.admitted: dict[str, int] = {}  # requests admitted so far, per client

    @property
    def queued(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    @contextlib.asynccontextmanager
    async def slot(self, client: str) -> AsyncIterator[None]:
        """Holds one of the engine's slots for `client` while the block runs."""
        if self.in_flight < self.capacity and not self._waiting:
            self.in_flight += 1
        else:
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.setdefault(client, deque()).append(future)
            try:
                await future  # set when a finishing request hands its slot over
            except asyncio.CancelledError:
                if future.done() and not future.cancelled():
                    self._hand_over()  # the slot arrived with the cancellation: pass it on
                raise
        self.admitted[client] = self.admitted.get(client, 0) + 1
        try:
            yield
        finally:
            self._hand_over()

    def _hand_over(self) -> None:
        """A slot is free: to the longest-waiting request of the next client in turn, else released."""
        while self._waiting:
            client, queue = next(iter(self._waiting.items()))
            future = queue.popleft()
            if queue:
                self._waiting.move_to_end(client)  # its next request waits for the others' turns
            else:
                del self._waiting[client]
            if not future.done():
                future.set_result(None)
                return
        self.in_flight -= 1
