"""One weight publish: the learner exports, every student replica applies, the learner releases.

It drives both the learner group and the student's engine group, so it lives in the driver, above
both (`weight_sync/` below them holds the transports).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
