"""The OPD trainer, one package per role (see docs/architecture.md for the diagram):

- `sdk`: what user code imports (processor types; tracing on top, loaded on first use).
- `jobspec`: the job spec, its datasets and the pre-flight checks of a spec against its models.
- `engine`: vLLM engines for the student (sampling) and the teacher (scoring), and their life.
- `weight_sync`: how the learner's weights reach running engines, one class per transport.
- `rollout`: one rollout step: the OpenAI-compatible gateway that records exact tokens, the runner.
- `workers`: the autoscaled Ray pools that load user processors from an uploaded workspace.
- `learner`: the DeepSpeed learner and the distillation losses.
- `signal`: the training signal: the teacher's scores on the student's calls, shaped (staleness,
  hindsight, preference pairs, beacons) into what the learner trains on.
- `driver`: the job driver actor that runs a job's steps, and running a spec locally.
- `storage`: the run directory's layout, checkpoints and workspace zips.
- `cluster`: starting or joining Ray, placing actors on nodes, free ports.
- `wire`: typed models of what crosses a process or outlives one (API bodies, the driver's progress,
  checkpoint state).
- `client`: the Python client of the job server (and its Bailian-shaped `AgenticRL`).
- `cli`: the `opd` command.
- `demo`: the tiny models and the tool-routing task the examples and tests use; nothing else
  in the trainer imports it.

Modules every role shares: `errors` (the exceptions every role raises), `records` (one LLM call, from
the engine that sampled it to the learner), `recorded_calls` (a rollout key's recorded calls as the
gateway hands them over), `chat` (a conversation rendered to prompt token ids), `actions` (what an
LLM call did, as an action), `kv_cache` (a CPU engine's KV cache size), `seeds` (each request's sampler
seed), `jsonl` (JSON Lines files), `stats` (plain statistics); and `tuner`: `tune(...)`, a job from a
Python script.
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
