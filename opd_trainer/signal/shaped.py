"""What one shaping step of the training signal returns (`shape.shape_signal` chains them)."""

from __future__ import annotations

import dataclasses

from opd_trainer.records import LLMCall


@dataclasses.dataclass(frozen=True)
class Shaped:
    """The segments to train on after one shaping step, the rewrites it added (chosen actions that only
    the preference and supervised terms read, never distilled: `beacons.py`) and its metrics."""

    segments: list[LLMCall]
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    rewrites: list[LLMCall] = dataclasses.field(default_factory=list)

    def then(self, after: Shaped) -> Shaped:
        """The next step's result (`after`, computed from `self.segments`) with this one's metrics and
        rewrites before its own."""
        return Shaped(after.segments, {**self.metrics, **after.metrics}, self.rewrites + after.rewrites)
