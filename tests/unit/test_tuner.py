"""`tune_spec` (opd_trainer/tuner.py): AgentScope's tuner arguments (`TunerModelConfig`,
`AlgorithmConfig`, `DatasetConfig`, `experiment_name`, `monitor_type`, `config_path`) become the job
`opd train` runs, field by field; what the service cannot honour is refused by name. The job itself
runs in tests/integration/test_workflow_functions.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from opd_trainer.errors import ConfigError
from opd_trainer.tuner import AlgorithmConfig, DatasetConfig, JudgeOutput, TunerModelConfig, tune_spec


async def workflow(task: dict, model: object, auxiliary_models: object = None) -> dict:
    return {"response": str(task)}


async def judge(task: dict, response: object, auxiliary_models: object = None) -> JudgeOutput:
    return JudgeOutput(reward=1.0)


def _dataset(folder: Path) -> DatasetConfig:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.jsonl").write_text('{"question": "2 + 2?", "answer": "4"}\n')
    return DatasetConfig(path=folder, split="train")


def test_the_seeds_main_py_ports_by_its_import_line(tmp_path: Path) -> None:
    """Seed 002's example, as written: GRPO on the judge's reward, no teacher named."""
    spec = tune_spec(
        workflow_func=workflow,
        judge_func=judge,
        model=TunerModelConfig(model_path="Qwen/Qwen3-0.6B", max_model_len=16384),
        train_dataset=_dataset(tmp_path / "my_dataset"),
        algorithm=AlgorithmConfig(
            algorithm_type="multi_step_grpo", group_size=8, batch_size=32, learning_rate=1e-6
        ),
    )
    hp = spec.hyper_parameters
    # teacher_model "self": the student's own starting weights, scored but not learned from (kl_coef 0).
    assert spec.model == spec.teacher_model == "Qwen/Qwen3-0.6B" and spec.job_name == "tune"
    assert (hp.n_rollouts, hp.batch_size, hp.learning_rate, hp.max_length) == (8, 32, 1e-6, 16384)
    assert hp.kl_coef == 0.0 and hp.normalize_reward_by_std and hp.reward_coef > 0
    assert [(f.name, f.type) for f in spec.functions] == [("workflow", "rollout"), ("judge", "reward")]
    assert spec.training_datasets == [str(tmp_path / "my_dataset" / "train.jsonl")]


def test_model_and_algorithm_fields_land_where_the_job_reads_them(tmp_path: Path) -> None:
    model = TunerModelConfig(
        model_path="student",
        temperature=0.7,
        max_tokens=96,
        enable_thinking=False,
        inference_engine_num=2,
        tool_call_parser="qwen3_coder",
    )
    spec = tune_spec(
        workflow_func=workflow,
        model=model,
        teacher_model="teacher",
        train_dataset=_dataset(tmp_path),
        algorithm=AlgorithmConfig(save_interval_steps=5, eval_interval_steps=3),
        experiment_name="exp-1",
        monitor_type="mlflow",
    )
    hp = spec.hyper_parameters
    assert (hp.temperature, hp.max_tokens, hp.save_steps, hp.eval_steps) == (0.7, 96, 5, 3)
    assert hp.kl_coef == 1.0 and not hp.normalize_reward_by_std  # opd: the distillation term stays
    assert spec.chat_template_kwargs == {"enable_thinking": False} and spec.tool_call_parser == "qwen3_coder"
    assert spec.resources.student.replicas == 2 and spec.job_name == "exp-1" and spec.report_to == ["mlflow"]


def test_a_job_file_is_completed_by_the_arguments_its_paths_from_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"question": "q", "answer": "a"}\n')
    document = {
        "job_name": "from-file",
        "model": "student",
        "teacher_model": "teacher",
        "training_datasets": ["train.jsonl"],
        "hyper_parameters": {"max_steps": 3, "batch_size": 2, "seed": 7},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(document))
    spec = tune_spec(
        workflow_func=workflow,
        config_path=folder / "job.yaml",
        algorithm=AlgorithmConfig(batch_size=4),
        hyper_parameters={"seed": 9},  # job fields given to tune itself come last
    )
    hp = spec.hyper_parameters
    assert (hp.max_steps, hp.batch_size, hp.seed) == (3, 4, 9) and spec.job_name == "from-file"
    assert spec.training_datasets == [str(folder / "train.jsonl")]


def test_what_cannot_be_honoured_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="top_p"):
        TunerModelConfig(model_path="student", top_p=0.9)
    with pytest.raises(ValidationError, match="reasoning_parser"):
        TunerModelConfig(model_path="student", reasoning_parser="deepseek_r1")  # type: ignore[call-arg]
    with pytest.raises(ValidationError, match="algorithm_type"):
        AlgorithmConfig(algorithm_type="ppo")  # type: ignore[arg-type]
    dataset = _dataset(tmp_path)
    with pytest.raises(ConfigError) as raised:
        tune_spec(
            workflow_func=workflow,
            model="student",
            train_dataset=dataset,
            algorithm=AlgorithmConfig(algorithm_type="multi_step_grpo"),
        )
    assert raised.value.field == "judge_func"
    with pytest.raises(ConfigError) as raised:
        tune_spec(workflow_func=workflow, model="student", train_dataset=dataset)  # opd needs a teacher
    assert raised.value.field == "teacher_model"
    with pytest.raises(ConfigError) as raised:
        tune_spec(
            workflow_func=workflow, model="s", teacher_model="t", train_dataset=dataset, project_name="p"
        )
    assert raised.value.field == "project_name"
