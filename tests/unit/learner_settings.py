"""`LearnerSettings` for unit tests that use the learner's pure functions (no model is loaded).

Built the way the job driver builds them, from a job spec (`LearnerSettings.from_spec`), so that the
spec's defaults and checks apply here too.
"""

from __future__ import annotations

from typing import Any

from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.learner.settings import LearnerSettings


def learner_settings(
    resources: dict[str, Any] | None = None, model: str = "unused", **hyper_parameters: Any
) -> LearnerSettings:
    """A ZeRO-0 learner's settings of the student at `model`; `hyper_parameters` and `resources`
    override the tests' defaults below."""
    spec = parse_job_spec(
        {
            "job_name": "unit",
            "model": model,
            "teacher_model": "unused",
            "training_datasets": ["unused.jsonl"],
            "hyper_parameters": {
                "learning_rate": 1e-4,
                "lr_scheduler_type": "constant",
                "seed": 0,
                "distill_loss": "sampled",
                **hyper_parameters,
            },
            "resources": {"zero_stage": 0, **(resources or {})},
        }
    )
    return LearnerSettings.from_spec(spec, total_updates=1)


SETTINGS = learner_settings()
