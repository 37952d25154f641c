"""`tune(...)`: an OPD job from a Python script on the embedded Ray, like AgentScope's tuner.

    from opd_trainer.tuner import AlgorithmConfig, DatasetConfig, TunerModelConfig, tune
    from opd_trainer.tuner import JudgeOutput, WorkflowOutput

    async def workflow(task, model, auxiliary_models=None) -> WorkflowOutput: ...
    async def judge(task, response, auxiliary_models=None) -> JudgeOutput: ...

    if __name__ == "__main__":
        tune(workflow_func=workflow, judge_func=judge,
             model=TunerModelConfig(model_path="Qwen/Qwen3-0.6B", max_model_len=16384),
             teacher_model="Qwen/Qwen3-8B",
             train_dataset=DatasetConfig(path="my_dataset", split="train"),
             algorithm=AlgorithmConfig(group_size=8, batch_size=32, learning_rate=1e-6))

AgentScope's names and fields port as they are (`TunerModelConfig`, `AlgorithmConfig`, `DatasetConfig`,
`experiment_name`, `monitor_type`, `config_path`); what this service adds is `teacher_model`, the model
whose judgment of every token the student learns (`"self"`: its own initial weights). AgentScope's own
`algorithm_type="multi_step_grpo"` runs here too: group-relative policy optimisation on the judge's
reward (the distillation term off, `kl_coef` 0, rewards over the group's spread), with `teacher_model`
"self" unless one is given. A field this service cannot honour is refused by name, never ignored.

The functions must live in a `.py` file: its folder is the job's workspace (shipped to the rollout and
reward workers, which import the file by itself, so keep the `tune(...)` call under `if __name__ ==
"__main__":`). The job is the same one `opd train` runs (`opd_trainer/jobspec/job_spec.py`):
`hyper_parameters`, `resources` and the other keyword arguments are its fields, and `config_path` a job
file of that format whose fields the arguments complete.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import TASK_KEY, load_samples, sample_view
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec, read_job_document, resolve_paths
from opd_trainer.sdk.workflow import JudgeOutput, WorkflowOutput

__all__ = [
    "AlgorithmConfig",
    "DatasetConfig",
    "JudgeOutput",
    "TunerModelConfig",
    "WorkflowOutput",
    "tune",
    "tune_spec",
]


class TunerModelConfig(BaseModel):
    """The student, as AgentScope's `TunerModelConfig` names it; each field becomes a job field (said
    per field). Defaults left as None keep the job's own."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model_path: str = Field(description="The student: a Hugging Face model folder or hub name (`model`).")
    max_model_len: int | None = Field(
        default=None, ge=16, description="Longest prompt + completion (`hyper_parameters.max_length`)."
    )
    temperature: float = Field(default=1.0, gt=0, description="`hyper_parameters.temperature`.")
    top_p: float = Field(
        default=1.0,
        description="Only 1.0: a job has no top_p of its own; a workflow's requests may set `top_p` "
        "themselves (the gateway passes it to the engine and records the logprobs it sampled from).",
    )
    max_tokens: int | None = Field(default=None, ge=1, description="`hyper_parameters.max_tokens`.")
    enable_thinking: bool | None = Field(
        default=None, description="`chat_template_kwargs.enable_thinking` (Qwen3's thinking mode)."
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="`resources.student.tensor_parallel_size`."
    )
    inference_engine_num: int = Field(default=1, ge=1, description="`resources.student.replicas`.")
    tool_call_parser: str = Field(default="hermes", description="`tool_call_parser`.")

    @field_validator("top_p")
    @classmethod
    def _whole_distribution(cls, value: float) -> float:
        if value != 1.0:
            raise ValueError("only 1.0: a job has no top_p of its own; set top_p on the workflow's requests")
        return value


class AlgorithmConfig(BaseModel):
    """How the student learns, as AgentScope's `AlgorithmConfig` names it. Defaults left as None keep the
    job's own (`hyper_parameters`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    algorithm_type: Literal["opd", "multi_step_grpo"] = Field(
        default="opd",
        description="`opd`: on-policy distillation toward `teacher_model` plus the judge's reward. "
        "`multi_step_grpo`: group-relative policy optimisation on the judge's reward alone (`kl_coef` 0, "
        "`normalize_reward_by_std`), needing a `judge_func`.",
    )
    learning_rate: float | None = Field(default=None, gt=0, description="`hyper_parameters.learning_rate`.")
    group_size: int | None = Field(default=None, ge=1, description="`hyper_parameters.n_rollouts`.")
    batch_size: int | None = Field(default=None, ge=1, description="`hyper_parameters.batch_size`.")
    save_interval_steps: int | None = Field(default=None, ge=1, description="`hyper_parameters.save_steps`.")
    eval_interval_steps: int | None = Field(default=None, ge=1, description="`hyper_parameters.eval_steps`.")


@dataclass(frozen=True)
class DatasetConfig:
    """A JSONL dataset: `path` a file, or a folder holding `{split}.jsonl` (Hugging Face's layout)."""

    path: str | Path
    split: str = "train"

    @property
    def file(self) -> Path:
        path = Path(self.path)
        return path / f"{self.split}.jsonl" if path.is_dir() else path

    def preview(self, n: int = 5) -> list[dict[str, Any]]:
        """The first `n` records as the trainer reads them (a task record as written; a chat sample as
        processors see it); raises `ConfigError` naming every bad line of the whole file."""
        samples = load_samples([str(self.file)], "dataset")[:n]
        return [s.rollout_extra[TASK_KEY] if not s.messages else sample_view(s) for s in samples]


def dataset_file(dataset: DatasetConfig | str | Path, split: str) -> str:
    """The JSONL file of `dataset`: a `DatasetConfig` as configured; a path as a file, or a folder's
    `{split}.jsonl` (`train` for training, `test` for evaluation, as AgentScope's datasets)."""
    config = dataset if isinstance(dataset, DatasetConfig) else DatasetConfig(dataset, split)
    return str(config.file)


def _component(name: str, kind: str, function: Callable[..., Any], field: str) -> dict[str, Any]:
    source = inspect.getsourcefile(function)
    if source is None or not inspect.iscoroutinefunction(function):
        raise ConfigError(f"{field} must be an `async def` defined in a .py file", field=field)
    file = Path(source).resolve()
    return {
        "name": name,
        "type": kind,
        "fcmodel": {"zipdir": str(file.parent), "classpath": f"{file.name}:{function.__name__}"},
    }


def _model_fields(model: TunerModelConfig) -> dict[str, Any]:
    hyper = {
        "max_length": model.max_model_len,
        "temperature": model.temperature,
        "max_tokens": model.max_tokens,
    }
    fields: dict[str, Any] = {
        "model": model.model_path,
        "tool_call_parser": model.tool_call_parser,
        "hyper_parameters": {k: v for k, v in hyper.items() if v is not None},
        "resources": {
            "student": {
                "tensor_parallel_size": model.tensor_parallel_size,
                "replicas": model.inference_engine_num,
            }
        },
    }
    if model.enable_thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": model.enable_thinking}
    return fields


def _algorithm_fields(algorithm: AlgorithmConfig) -> dict[str, Any]:
    named = {
        "learning_rate": algorithm.learning_rate,
        "n_rollouts": algorithm.group_size,
        "batch_size": algorithm.batch_size,
        "save_steps": algorithm.save_interval_steps,
        "eval_steps": algorithm.eval_interval_steps,
    }
    hyper = {k: v for k, v in named.items() if v is not None}
    if algorithm.algorithm_type == "multi_step_grpo":
        hyper |= {"kl_coef": 0.0, "normalize_reward_by_std": True}
    return {"hyper_parameters": hyper}


def _merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Later layers win; mappings (hyper_parameters, resources and their parts) merge key by key."""
    merged: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = _merged(merged[key], value)
            else:
                merged[key] = value
    return merged


def tune_spec(
    *,
    workflow_func: Callable[..., Any],
    judge_func: Callable[..., Any] | None = None,
    model: str | TunerModelConfig | None = None,
    teacher_model: str | list[dict[str, Any]] | None = None,
    train_dataset: DatasetConfig | str | Path | None = None,
    eval_dataset: DatasetConfig | str | Path | None = None,
    algorithm: AlgorithmConfig | None = None,
    experiment_name: str | None = None,
    monitor_type: Literal["tensorboard", "mlflow"] | None = None,
    config_path: str | Path | None = None,
    **job_fields: Any,
) -> JobSpec:
    """The job `tune` runs (see there), validated; raises `ConfigError` naming a bad field."""
    algorithm = algorithm or AlgorithmConfig()
    if algorithm.algorithm_type == "multi_step_grpo" and judge_func is None:
        raise ConfigError(
            "multi_step_grpo learns from the judge's reward: give a judge_func", field="judge_func"
        )
    functions = [_component("workflow", "rollout", workflow_func, "workflow_func")]
    if judge_func is not None:
        functions.append(_component("judge", "reward", judge_func, "judge_func"))
    base = read_job_document(Path(config_path)) if config_path is not None else {}
    given: dict[str, Any] = {"functions": functions}
    if (
        teacher_model is None
        and "teacher_model" not in base
        and algorithm.algorithm_type == "multi_step_grpo"
    ):
        teacher_model = "self"  # scored but not learned from: kl_coef is 0
    for name, value in (("teacher_model", teacher_model), ("job_name", experiment_name)):
        if value is not None:
            given[name] = value
    if train_dataset is not None:
        given["training_datasets"] = [dataset_file(train_dataset, "train")]
    if eval_dataset is not None:
        given["validation_datasets"] = [dataset_file(eval_dataset, "test")]
    if monitor_type is not None:
        given["report_to"] = [monitor_type]
    configured = _model_fields(model) if isinstance(model, TunerModelConfig) else {}
    if isinstance(model, str):
        given["model"] = model
    layers = (
        {"job_name": "tune"},
        base,
        configured,
        _algorithm_fields(algorithm),
        given,
        job_fields,
    )
    spec = parse_job_spec(_merged(*layers))
    return resolve_paths(spec, Path(config_path).parent) if config_path is not None else spec


def tune(
    *,
    workflow_func: Callable[..., Any],
    judge_func: Callable[..., Any] | None = None,
    model: str | TunerModelConfig | None = None,
    teacher_model: str | list[dict[str, Any]] | None = None,
    train_dataset: DatasetConfig | str | Path | None = None,
    eval_dataset: DatasetConfig | str | Path | None = None,
    algorithm: AlgorithmConfig | None = None,
    experiment_name: str | None = None,
    monitor_type: Literal["tensorboard", "mlflow"] | None = None,
    config_path: str | Path | None = None,
    run_dir: str | Path | None = None,
    **job_fields: Any,
) -> dict[str, Any]:
    """Trains `model` (a model folder or hub name, or a `TunerModelConfig`) toward `teacher_model`
    (`"self"`: its own initial weights; a list of {name, model, data_tags}: several teachers routed by
    data tag, as in the job spec) on `workflow_func`'s rollouts, rewarded by `judge_func` if given, as
    `algorithm` says (`AlgorithmConfig`); returns the job's summary (validation before and after when
    `eval_dataset` is given). `experiment_name` names the job (default "tune"), `monitor_type` is its
    tracker (`report_to`: tensorboard or mlflow), `config_path` is a job file (YAML or JSON, `opd train`'s
    format) whose fields the other arguments complete or override; `job_fields` are further job-spec
    fields (`hyper_parameters`, `resources`, `job_name`, ...), applied last. Raises `ConfigError` naming
    a bad field, `OPDError` when the job fails."""
    # Workflow files import this module for `WorkflowOutput`/`JudgeOutput`, also inside the sandboxed
    # processor host: Ray, tqdm and the pre-flight stack load only when a job is run.
    from opd_trainer.driver.local_run import prepare_spec, train_spec

    spec = tune_spec(
        workflow_func=workflow_func,
        judge_func=judge_func,
        model=model,
        teacher_model=teacher_model,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        algorithm=algorithm,
        experiment_name=experiment_name,
        monitor_type=monitor_type,
        config_path=config_path,
        **job_fields,
    )
    return train_spec(prepare_spec(spec), Path(run_dir) if run_dir is not None else None)
