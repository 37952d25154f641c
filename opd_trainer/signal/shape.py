"""The training signal of one step: the teacher-scored segments (`scores.py`) shaped into what the
learner trains on, one step at a time (each takes segments and returns a `Shaped`), in this order:

1. `staleness.drop_stale`: segments sampled more than `max_staleness` versions ago are dropped;
2. `leaks.drop_leaks` (with `teacher_hindsight`): rollouts whose replies carry a note's wording;
3. `hindsight.add_hindsight` (with `hindsight_coef`): the turn-level hindsight values;
4. `pairs.add_preference_pairs` (with `turn_preference_coef`): the mined preference pairs;
5. `beacons.rewrite_with_beacons` (with `beacon_rewrite`): turns rewritten with a hindsight beacon,
   paired against themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_spec import HyperParameters
from opd_trainer.records import LLMCall
from opd_trainer.signal.beacons import BeaconModels, rewrite_with_beacons
from opd_trainer.signal.hindsight import add_hindsight
from opd_trainer.signal.leaks import drop_leaks
from opd_trainer.signal.pairs import add_preference_pairs
from opd_trainer.signal.shaped import Shaped
from opd_trainer.signal.staleness import drop_stale

if TYPE_CHECKING:
    from opd_trainer.rollout.runner import RolloutResult


async def shape_signal(
    segments: list[LLMCall],
    step: int,
    hp: HyperParameters,
    results: list[RolloutResult] | None = None,
    beacon_models: BeaconModels | None = None,
) -> Shaped:
    """Step `step`'s (0-based) `segments` shaped as `hp` asks (module docstring); `results`, the step's
    rollouts, and `beacon_models` are what beacons need (`beacon_rewrite` on). Raises `OPDError` when no
    segment is left to train."""
    shaped = drop_stale(segments, step, hp.max_staleness)
    if hp.teacher_hindsight != "none":
        shaped = shaped.then(drop_leaks(shaped.segments))
    if hp.hindsight_coef > 0:
        shaped = shaped.then(add_hindsight(shaped.segments))
    if hp.turn_preference_coef > 0:
        level, floor = hp.preference_level, hp.turn_preference_min_chosen_reward
        shaped = shaped.then(add_preference_pairs(shaped.segments, level, floor))
    if not shaped.segments:  # every segment stale, or every rollout leaking a hindsight note's wording
        named = ("staleness/dropped_segments", "hindsight/leaked_rollouts")
        dropped = {name: shaped.metrics[name] for name in named if name in shaped.metrics}
        raise OPDError(f"step {step + 1}: no segment left to train; the signal phase dropped {dropped}")
    if hp.beacon_rewrite != "off":
        if beacon_models is None or results is None:
            raise ValueError("beacon_rewrite needs the step's rollouts and the job's BeaconModels")
        shaped = shaped.then(await rewrite_with_beacons(beacon_models, hp, results, shaped.segments, step))
    return shaped
