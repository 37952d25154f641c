"""`tune(...)`: an OPD job from a Python script on the embedded Ray, like AgentScope's tuner (seed 002).

    from opd_trainer.tuner import DatasetConfig, JudgeOutput, WorkflowOutput, tune

    async def workflow(task, model, auxiliary_models=None) -> WorkflowOutput: ...
    async def judge(task, response, auxiliary_models=None) -> JudgeOutput: ...

    if __name__ == "__main__":
        tune(workflow_func=workflow, judge_func=judge, model="Qwen/Qwen3-0.6B",
             teacher_model="Qwen/Qwen3-8B", train_dataset=DatasetConfig(path="my_dataset", split="train"))

The functions must live in a `.py` file: its folder is the job's workspace (shipped to the rollout and
reward workers, which import the file by itself, so keep the `tune(...)` call under `if __name__ ==
"__main__":`). The job is the same one `opd train` runs (`opd_trainer/jobspec/job_spec.py`):
`hyper_parameters`, `resources` and the other keyword arguments are its fields.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.dataset import TASK_KEY, load_samples, sample_view
from opd_trainer.jobspec.job_spec import parse_job_spec
from opd_trainer.sdk.workflow import JudgeOutput, WorkflowOutput

__all__ = ["DatasetConfig", "JudgeOutput", "WorkflowOutput", "tune"]


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


def tune(
    *,
    workflow_func: Callable[..., Any],
    judge_func: Callable[..., Any] | None = None,
    model: str,
    teacher_model: str | list[dict[str, Any]],
    train_dataset: DatasetConfig | str | Path,
    eval_dataset: DatasetConfig | str | Path | None = None,
    job_name: str = "tune",
    run_dir: str | Path | None = None,
    **job_fields: Any,
) -> dict[str, Any]:
    """Trains `model` toward `teacher_model` (`"self"`: its own initial weights; a list of
    {name, model, data_tags}: several teachers routed by data tag, as in the job spec) on `workflow_func`'s
    rollouts, rewarded by `judge_func` if given; returns the job's summary (validation before and after
    when `eval_dataset` is given). `job_fields` are further job-spec fields (`hyper_parameters`,
    `resources`, ...). Raises `ConfigError` naming a bad field, `OPDError` when the job fails."""
    # Workflow files import this module for `WorkflowOutput`/`JudgeOutput`, also inside the sandboxed
    # processor host: Ray, tqdm and the pre-flight stack load only when a job is run.
    from opd_trainer.driver.local_run import prepare_spec, train_spec

    functions = [_component("workflow", "rollout", workflow_func, "workflow_func")]
    if judge_func is not None:
        functions.append(_component("judge", "reward", judge_func, "judge_func"))

    spec = parse_job_spec(
        {
            "job_name": job_name,
            "model": model,
            "teacher_model": teacher_model,
            "training_datasets": [dataset_file(train_dataset, "train")],
            "validation_datasets": [dataset_file(eval_dataset, "test")] if eval_dataset is not None else [],
            "functions": functions,
            **job_fields,
        }
    )
    return train_spec(prepare_spec(spec), Path(run_dir) if run_dir is not None else None)
