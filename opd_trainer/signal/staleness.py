"""Staleness: segments sampled with weights too many versions behind the learner are not trained."""

from __future__ import annotations

import dataclasses

from opd_trainer.records import LLMCall
from opd_trainer.signal.shaped import Shaped
from opd_trainer.stats import mean


def drop_stale(segments: list[LLMCall], step: int, max_staleness: int) -> Shaped:
    """With `max_staleness` k >= 1, `segments` less those sampled more than k weight versions before
    `step`, each kept one carrying its lag (`LLMCall.staleness`); with 0 all of them. Metrics:
    `staleness/mean`, `staleness/max` (over all of `segments`), `staleness/dropped_segments`."""
    staleness = [step - s.weight_version for s in segments]
    kept = segments
    if max_staleness > 0:
        kept = [
            dataclasses.replace(s, staleness=lag) if lag else s
            for s, lag in zip(segments, staleness, strict=True)
            if lag <= max_staleness
        ]
    metrics = {
        "staleness/mean": mean(staleness),
        "staleness/max": float(max(staleness, default=0)),
        "staleness/dropped_segments": float(len(segments) - len(kept)),
    }
    return Shaped(kept, metrics)
