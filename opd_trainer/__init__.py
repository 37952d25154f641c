"""The OPD trainer, one package per role (see docs/architecture.md for the diagram):

- `sdk`: what user code imports (processor types; tracing on top, loaded on first use).
- `spec`: the job spec, its datasets and the pre-flight checks of a spec against its models.
- `engine`: vLLM engines for the student (sampling) and the teacher (scoring), weight sync into them.
- `rollout`: one rollout step: the OpenAI-compatible gateway that records exact tokens, the runner.
- `workers`: the autoscaled Ray pools that load user processors from an uploaded workspace.
- `learner`: the DeepSpeed learner, the distillation losses and checkpoints.
- `signal`: the training signal: the teacher's scores on the student's calls, shaped (staleness,
  hindsight, preference pairs, beacons) into what the learner trains on.
- `driver`: the job driver actor that runs a job's steps, its run directory and Ray runtime.
- `client`: the Python client of the job server (and its Bailian-shaped `AgenticRL`).
- `cli`: the `opd` command.
- `demo`: the tiny models and the tool-routing task the examples and tests use; nothing else
  in the trainer imports it.

`errors` holds the exceptions every role raises; `tuner` is `tune(...)`, a job from a Python script.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    """`opd_trainer.tune` is `opd_trainer.tuner.tune`, imported on first use."""
    if name == "tune":
        # Lazy: `opd_trainer.tune` loads the tuner on first use.
        from opd_trainer.tuner import tune

        return tune
    raise AttributeError(f"module 'opd_trainer' has no attribute {name!r}")
