"""`report_to` trackers (driver/trackers.py) on real stores: TensorBoard event files, MLflow's SQLite
store in the run dir (no server); and the driver dropping a tracker that fails without stopping."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.driver.run_dir import RunDir
from opd_trainer.driver.trackers import MLflowTracker, flat_params, open_trackers
from opd_trainer.errors import ConfigError
from opd_trainer.spec.job_spec import JobSpec, parse_job_spec


def _spec(tmp_path: Path, **extra: Any) -> JobSpec:
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    return parse_job_spec(
        {
            "job_name": "tracked",
            "model": "student",
            "teacher_model": "teacher",
            "training_datasets": [str(train)],
            "hyper_parameters": {"learning_rate": 3e-4},
            **extra,
        }
    )


def test_mlflow_gets_params_metrics_and_the_jobs_end_and_a_resume_continues_the_run(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    spec, run_dir = _spec(tmp_path, report_to=["mlflow"]), RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    [tracker] = open_trackers(spec, run_dir, "opdjob-1")
    assert isinstance(tracker, MLflowTracker) and tracker.tracking_uri.endswith("run/mlflow.db")
    tracker.log("train", 1, {"reverse_kl": 0.5, "engine/student/generation_tokens": 100.0})
    tracker.log("eval", 1, {"exact_match": 0.25})
    tracker.close("stopped")

    resumed = MLflowTracker(spec, run_dir, "opdjob-1")  # the server restarted the job
    assert resumed.run_id == tracker.run_id
    resumed.log("train", 2, {"reverse_kl": 0.25})
    resumed.close("succeeded")

    client = MlflowClient(tracking_uri=tracker.tracking_uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "opdjob-1"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    assert run.data.params["hyper_parameters.learning_rate"] == "0.0003"
    assert run.data.tags["opd.teacher_model"] == "teacher"
    history = client.get_metric_history(tracker.run_id, "train/reverse_kl")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.25)]
    assert client.get_metric_history(tracker.run_id, "eval/exact_match")[0].value == 0.25
    assert client.get_metric_history(tracker.run_id, "train/engine/student/generation_tokens")[0].value == 100


def test_tensorboard_is_the_default_and_none_is_allowed(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    [tracker] = open_trackers(_spec(tmp_path), run_dir, "j")
    tracker.log("train", 1, {"loss": 1.0})
    tracker.close("succeeded")
    assert list(run_dir.tensorboard_path.iterdir())
    assert open_trackers(_spec(tmp_path, report_to=[]), run_dir, "j") == []


def test_a_tracker_that_cannot_open_names_the_field(tmp_path: Path) -> None:
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    spec = _spec(tmp_path, report_to=["mlflow"], mlflow_tracking_uri="nosuchscheme://x")
    with pytest.raises(ConfigError) as caught:
        open_trackers(spec, run_dir, "j")
    assert caught.value.field == "mlflow_tracking_uri" and "nosuchscheme" in str(caught.value)


def test_report_to_names_each_tracker_once_and_only_known_ones(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="report_to"):
        _spec(tmp_path, report_to=["mlflow", "mlflow"])
    with pytest.raises(Exception, match="report_to"):
        _spec(tmp_path, report_to=["wandb"])


def test_nested_settings_become_dotted_params() -> None:
    assert flat_params({"a": 1, "b": {"c": [1, 2], "d": None}}, "hp.") == {
        "hp.a": "1",
        "hp.b.c": "[1, 2]",
        "hp.b.d": "None",
    }


class _Broken:
    name = "mlflow"

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        raise ConnectionError("tracking server down")

    def close(self, status: str) -> None:
        raise AssertionError("a dropped tracker is not closed")


class _Kept:
    name = "tensorboard"

    def __init__(self) -> None:
        self.records: list[tuple[str, int]] = []
        self.closed = ""

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self.records.append((kind, step))

    def close(self, status: str) -> None:
        self.closed = status


def test_the_driver_drops_a_failing_tracker_with_one_warning_and_keeps_the_others(tmp_path: Path) -> None:
    from opd_trainer.driver.job_driver import JobDriver

    driver = JobDriver(_spec(tmp_path), str(tmp_path / "run"))
    kept = _Kept()
    driver._trackers = [_Broken(), kept]
    driver._record("train", 1, {"loss": 1.0})
    driver._record("eval", 1, {"exact_match": 0.5})
    driver.status = "succeeded"
    driver._close_trackers()
    assert kept.records == [("train", 1), ("eval", 1)] and kept.closed == "succeeded"
    [warning] = [e for e in driver.events() if e["type"] == "warning"]
    assert "report_to mlflow: ConnectionError: tracking server down" in warning["message"]
    assert [r["kind"] for r in driver.log.records()] == ["train", "eval"]  # metrics.jsonl regardless
