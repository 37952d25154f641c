"""The LoRA adapters one student engine serves: one `LoRARequest` per (job, weight version).

A job with `hyper_parameters.lora` trains adapters only; after each step its learner's adapter files
reach the engine as an `AdapterHandoff` (`opd_trainer.weight_sync`), which is written to a folder on
the engine's node and loaded by a new `LoRARequest` (vLLM's multi-LoRA path, as in its
`examples/offline_inference/multilora_inference.py`); the previous version is unloaded once the new one
is in. The base weights never change, so requests without an adapter (the base model: a LoRA job's
`teacher_model: self`) keep their prefix cache across updates.

An engine may serve several jobs' adapters (`client` names the job; None: the engine's own job), each
sampling with its own. `BASE_MODEL_CLIENT` is the client that never has one: a LoRA job whose teacher is
its own base model (`teacher_model: self`) scores and samples as the teacher on its student's engines
under it (`driver/components.py`).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opd_trainer.errors import WeightSyncError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from opd_trainer.weight_sync import AdapterHandoff

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts (`vllm.config.lora.MaxLoRARanks`)."""

OWN_JOB = "job"
"""The adapter key of an engine's own job (requests that name no client)."""

BASE_MODEL_CLIENT = "<base model>"
"""The client whose requests always run the base model (no adapter is ever loaded for it): a LoRA job's
teacher when it is the student's base model, served by the student's own engines. The engine's fair
gate and per-client counts treat it as a client of its own, apart from the job's sampling."""


def served_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds adapters of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"LoRA rank {rank} exceeds vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}")


class ServedAdapters:
    """The current adapter of each job an engine serves, and the folders they were loaded from."""

    def __init__(self, engine_name: str, directory: Path | None = None) -> None:
        self.engine_name = engine_name
        self._directory = directory
        self._current: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)  # vLLM's lora_int_id: unique per loaded adapter, > 0

    @property
    def directory(self) -> Path:
        if self._directory is None:
            self._directory = Path(tempfile.mkdtemp(prefix=f"opd-adapters-{self.engine_name}-"))
        return self._directory

    def current(self, client: str | None = None) -> LoRARequest | None:
        """The adapter `client`'s sampling requests use (None: the base model, always for
        `BASE_MODEL_CLIENT`)."""
        if client == BASE_MODEL_CLIENT:
            return None
        return self._current.get(client or OWN_JOB)

    def clients(self) -> list[str]:
        return list(self._current)

    async def swap(self, llm: Any, handoff: AdapterHandoff, client: str | None = None) -> LoRARequest:
        """Loads `handoff` as `client`'s adapter (loaded now, so a broken adapter fails the update, not a
        later request), then unloads the one it replaces. Raises `WeightSyncError`; the old one stays."""
        from vllm.lora.request import LoRARequest

        from opd_trainer.weight_sync import AdapterTransfer

        key = client or OWN_JOB
        if key == BASE_MODEL_CLIENT:
            raise WeightSyncError(f"{self.engine_name}: the base model's client takes no adapter")
        folder = await AdapterTransfer().materialize(handoff, self.directory / key)
        request = LoRARequest(
            lora_name=f"{key}-v{handoff.version}", lora_int_id=next(self._ids), lora_path=str(folder)
        )
        try:
            loaded = await llm.add_lora(request)
        except Exception as exc:  # vLLM raises many types; the caller needs one
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightSyncError(
                f"{self.engine_name}: adapter v{handoff.version} did not load: {exc}"
            ) from exc
        if loaded is False:
            shutil.rmtree(folder, ignore_errors=True)
            raise WeightSyncError(f"{self.engine_name}: vLLM refused adapter v{handoff.version}")
        previous = self._current.get(key)
        self._current[key] = request
        if previous is not None:
            await self._unload(llm, previous)
        return request

    async def drop(self, llm: Any, client: str | None = None) -> None:
        """Unloads `client`'s adapter (a job that ended); its requests then use the base model."""
        previous = self._current.pop(client or OWN_JOB, None)
        if previous is not None:
            await self._unload(llm, previous)

    @staticmethod
    async def _unload(llm: Any, request: LoRARequest) -> None:
        await llm.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Removes every adapter folder (the engine is shutting down)."""
        self._current.clear()
        if self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
