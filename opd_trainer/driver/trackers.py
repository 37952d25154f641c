"""Experiment trackers a job reports its metrics to, as `report_to` names them: TensorBoard, MLflow.

`metrics.jsonl` in the run dir is always written (the server and CLI read it); a tracker gets the same
records (`kind` train / eval, the step, the metrics) as `kind/name` series:

- `tensorboard`: event files in the run dir's `tensorboard/` (`RunDir.tensorboard_path`).
- `mlflow`: one MLflow run per job in the experiment named after `job_name`, under the tracking URI
  `mlflow_tracking_uri` (else `MLFLOW_TRACKING_URI`, else `sqlite:///RUN_DIR/mlflow.db`, which works
  offline), with the job's hyper-parameters as params and its models and id as tags. The run's id is
  kept in the run dir (`mlflow_run_id`), so a job resumed after a restart goes on logging to the same
  run (steps it redoes from its checkpoint are logged again). The run ends FINISHED, FAILED or KILLED
  (stopped) with the job.

A tracker that fails (an MLflow server down) is reported by the caller and dropped; training goes on.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any, Protocol

from opd_trainer.errors import ConfigError

if TYPE_CHECKING:
    from opd_trainer.driver.run_dir import RunDir
    from opd_trainer.spec.job_spec import JobSpec

# Job status -> MLflow's run status.
MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}


class Tracker(Protocol):
    name: str

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str) -> None:
        """`status`: the job's (`succeeded`, `failed`, `stopped`)."""


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: RunDir) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir.tensorboard_path))

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(f"{kind}/{name}", value, step)
        self._writer.flush()

    def close(self, status: str) -> None:
        self._writer.close()


def flat_params(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested settings as MLflow params: `section.key` -> its value as text (MLflow's limit: 6000 chars)."""
    params: dict[str, str] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            params.update(flat_params(value, f"{name}."))
        else:
            params[name] = str(value)[:6000]
    return params


class MLflowTracker:
    name = "mlflow"

    def __init__(self, spec: JobSpec, run_dir: RunDir, job_id: str) -> None:
        from mlflow import MlflowClient

        uri = spec.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.tracking_uri = uri or f"sqlite:///{run_dir.mlflow_store_path.resolve()}"
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        run_id_path = run_dir.mlflow_run_id_path
        if run_id_path.is_file():  # a resumed job: the same run
            self.run_id = run_id_path.read_text().strip()
            self._client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self._client.get_experiment_by_name(spec.job_name)
        experiment_id = (
            experiment.experiment_id if experiment else self._client.create_experiment(spec.job_name)
        )
        run = self._client.create_run(
            experiment_id,
            run_name=job_id,
            tags={"opd.job_id": job_id, "opd.model": spec.model, "opd.teacher_model": spec.teacher_model},
        )
        self.run_id = run.info.run_id
        from mlflow.entities import Param

        params = flat_params(spec.hyper_parameters.model_dump(mode="json"), "hyper_parameters.")
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        run_id_path.write_text(self.run_id)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{kind}/{name}", float(value), now, step) for name, value in metrics.items()]
        # MLflow takes at most 1000 metrics per batch call.
        for start in range(0, len(batch), 1000):
            self._client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))


def open_trackers(spec: JobSpec, run_dir: RunDir, job_id: str) -> list[Tracker]:
    """The trackers `spec.report_to` names, opened (MLflow's first use of a SQLite store creates its
    tables: seconds; call it off the event loop). One that cannot open fails the job at its start,
    naming the field to fix."""
    trackers: list[Tracker] = []
    for name in spec.report_to:
        try:
            trackers.append(
                TensorBoardTracker(run_dir) if name == "tensorboard" else MLflowTracker(spec, run_dir, job_id)
            )
        except Exception as exc:
            field = "mlflow_tracking_uri" if name == "mlflow" else "report_to"
            raise ConfigError(
                f"report_to {name}: cannot open it: {type(exc).__name__}: {exc}", field=field
            ) from exc
    return trackers
