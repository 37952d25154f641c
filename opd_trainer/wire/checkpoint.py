"""What a checkpoint keeps besides the learner's state, and the promotion decision beside them.

`CheckpointState` is each `checkpoints/step-N/driver_state.json`: a resumed job reads it back to
continue where the checkpoint was taken (`JobDriver._resume`). `PromotionDecision` is
`checkpoints/promoted.json` (`driver/promotion.py`), which the server reads for `fine_tuned_model`.
Both are written as `json.dumps(model.model_dump(), indent=2)` (`storage/checkpoints.py`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class CursorState(BaseModel):
    """Where the job is in its training data (`jobspec.dataset.EpochCursor.state`)."""

    epoch: int = Field(ge=0, description="Passes over the training data begun.")
    position: int = Field(ge=0, description="Samples taken from this epoch's seeded shuffle.")


class PromotionState(BaseModel):
    """The promoter's state (`driver.promotion.Promoter`), so a resumed job keeps its best."""

    metric: str = Field(description="The validation metric promotion compares (`promotion.metric`).")
    higher_is_better: bool = Field(description="Its direction.")
    min_gain_over_start: float | None = Field(description="The gate over the starting student.")
    threshold: float | None = Field(description="The gate on the value itself.")
    start: float | None = Field(default=None, description="The starting student's value.")
    best_step: int | None = Field(default=None, description="The best validation that passed the gates.")
    best_value: float | None = Field(default=None, description="Its value.")
    top_step: int | None = Field(default=None, description="The best validation, gates or not.")
    top_value: float | None = Field(default=None, description="Its value.")


class CheckpointState(BaseModel):
    """`driver_state.json`: the driver's part of a checkpoint."""

    step: int = Field(ge=0, description="Training steps done when it was saved.")
    cursor: CursorState = Field(
        description="The data cursor before the first batch not yet trained on (a resume samples it again)."
    )
    total_steps: int = Field(ge=0, description="Training steps the job planned.")
    promotion: PromotionState | None = Field(
        default=None, description="The promoter's state; None for a job without validation data."
    )


class PromotionDecision(BaseModel):
    """`promoted.json`: which checkpoint is the job's model so far, and why."""

    checkpoint: str | None = Field(
        description="The promoted checkpoint's id; None when no validation met the gates (or none ran)."
    )
    metric: str = Field(description="The metric compared.")
    higher_is_better: bool = Field(description="Its direction.")
    start: float | None = Field(description="The starting student's value (None when not finite).")
    step: int | None = Field(description="The promoted validation's step.")
    value: float | None = Field(description="Its value.")
    final: bool = Field(description="The job's decision (at its end), not one so far.")
    reason: str = Field(description="Why this checkpoint, or why none.")
