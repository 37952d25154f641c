"""Promotion: which checkpoint becomes the job's model (`promotion` in the job spec).

Every validation of the trained student is a candidate; the one best by `promotion.metric` that
passes the gates (`min_gain_over_start` over the starting student's validation, `threshold`) is
promoted. The driver checkpoints a promoted step even between `save_steps`, so the best evaluation
always has weights, and `keep_last_n` never removes it. The decision is written under the run's
checkpoints (`storage/checkpoints.py`, `promoted.json`) at each new best and, final, at the end; a job
whose gate is never met ends with `checkpoint: null` and the reason.
"""

from __future__ import annotations

import dataclasses
import math

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.wire.checkpoint import PromotionDecision, PromotionState


@dataclasses.dataclass
class Promoter:
    metric: str
    higher_is_better: bool
    min_gain_over_start: float | None
    threshold: float | None
    start: float | None = None  # the starting student's value
    best_step: int | None = None  # the best validation that passed the gates
    best_value: float | None = None
    top_step: int | None = None  # the best validation, gates or not (for the reason when none passed)
    top_value: float | None = None

    @classmethod
    def for_job(cls, spec: JobSpec) -> Promoter | None:
        """The job's promoter; None without validation data (its model is the last checkpoint)."""
        if not spec.validation_datasets:
            return None
        metric = spec.promotion_metric
        return cls(
            metric,
            spec.promotion.direction_higher(metric),
            spec.promotion.min_gain_over_start,
            spec.promotion.threshold,
        )

    def state(self) -> PromotionState:
        """What a checkpoint keeps, so a resumed job keeps its best."""
        return PromotionState(**dataclasses.asdict(self))

    def restore(self, state: PromotionState | None) -> None:
        """Takes up what a checkpoint kept (`state`); None (a checkpoint without it) keeps the present."""
        if state is None:
            return
        self.start, self.best_step, self.best_value = state.start, state.best_step, state.best_value
        self.top_step, self.top_value = state.top_step, state.top_value

    def value(self, metrics: dict[str, float]) -> float:
        """The metric's value in one validation; a name the validation does not report fails the job."""
        if self.metric not in metrics:
            reported = ", ".join(sorted(metrics)) or "none"
            raise ConfigError(
                f"validation reports no {self.metric!r}; it reports: {reported}", field="promotion.metric"
            )
        return float(metrics[self.metric])

    def observe_start(self, metrics: dict[str, float]) -> None:
        """The starting student's validation: the baseline of `min_gain_over_start`."""
        self.start = self.value(metrics)

    def consider(self, step: int, metrics: dict[str, float]) -> bool:
        """A validation of the trained student at `step`; True when it is the new promoted best."""
        value = self.value(metrics)
        if not math.isfinite(value):
            return False
        if self.top_value is None or self._beats(value, self.top_value):
            self.top_step, self.top_value = step, value
        if self.gate_failure(value) is not None:
            return False
        if self.best_value is not None and not self._beats(value, self.best_value):
            return False
        self.best_step, self.best_value = step, value
        return True

    def gate_failure(self, value: float) -> str | None:
        """Why `value` may not be promoted, or None when it passes every gate."""
        if self.threshold is not None and not self._at_least(value, self.threshold):
            return f"{self.metric} {value:.4g} does not reach the threshold {self.threshold:.4g}"
        if self.min_gain_over_start is not None and self.start is not None:
            sign = 1.0 if self.higher_is_better else -1.0
            needed = self.start + sign * self.min_gain_over_start
            if not self._at_least(value, needed):
                return (
                    f"{self.metric} {value:.4g} does not beat the starting student's {self.start:.4g} "
                    f"by {self.min_gain_over_start:.4g}"
                )
        return None

    def decision(self, checkpoint: str | None, *, final: bool) -> PromotionDecision:
        """The record `promoted.json` holds: the promoted checkpoint (None: no validation passed the
        gates, or none ran), the metric and its value, and why."""
        start = self.start if self.start is not None and math.isfinite(self.start) else None
        if checkpoint is not None:
            reason = f"best {self.metric} {self.best_value:.4g} at step {self.best_step}"
        elif self.top_value is None:
            reason = "no validation of the trained student ran"
        else:
            failure = self.gate_failure(self.top_value)
            reason = f"no validation met the gate; the best, at step {self.top_step}: {failure}"
        return PromotionDecision(
            checkpoint=checkpoint,
            metric=self.metric,
            higher_is_better=self.higher_is_better,
            start=start,
            step=self.best_step,
            value=self.best_value,
            final=final,
            reason=reason,
        )

    def _beats(self, value: float, other: float) -> bool:
        return value > other if self.higher_is_better else value < other

    def _at_least(self, value: float, bound: float) -> bool:
        return value >= bound if self.higher_is_better else value <= bound
