"""One weight publish: the learner exports, every student replica applies, the learner releases.

It drives both the learner group and the student's engine group, so it lives in the driver, above
both (`weight_sync/` below them holds the transports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_trainer.weight_sync import AdapterTransfer

if TYPE_CHECKING:
    from opd_trainer.engine.vllm_engine import EngineGroup
    from opd_trainer.learner.deepspeed_learner import LearnerGroup


async def publish_weights(learner: LearnerGroup, student: EngineGroup, kinds: list[str], version: int) -> int:
    """The learner's weights to every student replica (replica i by `kinds[i]`, as
    `EngineGroup.transfers` chose), all reporting `version`; the handoffs are released whatever happens.
    Returns the bytes handed off (each distinct handoff once)."""
    handoffs = await learner.export_weights(kinds)
    try:
        await student.update_weights([handoffs[kind] for kind in kinds], version)
        return sum(handoff.num_bytes for handoff in handoffs.values())
    finally:
        await learner.release_weights(list(handoffs.values()))


async def publish_adapter(learner: LearnerGroup, student: EngineGroup, version: int) -> int:
    """A LoRA job's adapter to every student replica (one `AdapterHandoff`, loaded by each as a new
    `LoRARequest`), all reporting `version`. Returns the adapter's bytes."""
    handoff = AdapterTransfer().export(await learner.adapter_files(), version)
    await student.update_weights([handoff] * len(student.actors), version)
    return handoff.num_bytes
