"""`report_to` trackers (driver/trackers.py) on real stores: TensorBoard event files, MLflow's SQLite
store in the run dir (no server); the server's policy on tenants' tracking URIs; writes on a thread of
their own that never hold up the driver; and the driver dropping a tracker that fails without stopping."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from opd_trainer.driver.trackers import (
    ALLOWED_URIS_ENV,
    LOCAL_JOB_ID,
    BackgroundTracker,
    MLflowTracker,
    check_tracking_uri,
    flat_params,
    open_trackers,
    parse_allowed_uris,
)
from opd_trainer.errors import ConfigError
from opd_trainer.jobspec.job_spec import JobSpec, parse_job_spec
from opd_trainer.storage.run_dir import RunDir


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
    [background] = open_trackers(spec, run_dir, "opdjob-1")  # a server's job: the default store
    tracker = background.tracker
    assert isinstance(tracker, MLflowTracker) and tracker.tracking_uri.endswith("run/mlflow.db")
    background.log("train", 1, {"reverse_kl": 0.5, "engine/student/generation_tokens": 100.0})
    background.log("eval", 1, {"exact_match": 0.25})
    background.close("stopped")
    assert background.notices() == []

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
        open_trackers(spec, run_dir, LOCAL_JOB_ID)  # `opd train`: any URI is tried
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
    driver._trackers = [BackgroundTracker(_Broken()), BackgroundTracker(kept)]
    driver._record("train", 1, {"loss": 1.0})
    driver._record("eval", 1, {"exact_match": 0.5})
    driver.status = "succeeded"
    asyncio.run(driver._close_trackers())
    assert kept.records == [("train", 1), ("eval", 1)] and kept.closed == "succeeded"
    [warning] = [e for e in driver.events() if e.type == "warning"]
    assert "report_to mlflow: ConnectionError: tracking server down" in warning.message
    assert [r["kind"] for r in driver.log.records()] == ["train", "eval"]  # metrics.jsonl regardless


# -- the server's policy on tracking URIs ------------------------------------------------------------

ALLOWED = ["http://mlflow.internal:5000", "https://MLflow.example.com"]


@pytest.mark.parametrize(
    "uri",
    [
        "http://mlflow.internal:5000",
        "http://mlflow.internal:5000/some/path?x=1",
        "http://MLFLOW.internal:5000",
        "https://mlflow.example.com",
        "https://mlflow.example.com:443/",
    ],
)
def test_a_server_accepts_the_operators_tracking_servers(uri: str) -> None:
    check_tracking_uri(uri, ALLOWED)


@pytest.mark.parametrize(
    "uri",
    [
        "http://mlflow.internal:5001",  # another port
        "https://mlflow.internal:5000",  # another scheme
        "http://mlflow.internal",  # port 80
        "http://mlflow.internal:5000@attacker.example",  # the allowed host as user info
        "http://mlflow.internal:5000.attacker.example",  # a string prefix, another host
        "http://attacker.example#@mlflow.internal:5000",
        "http://169.254.169.254/latest/meta-data",
        "http://mlflow.internal:notaport",
    ],
)
def test_a_server_refuses_any_other_tracking_server(uri: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_tracking_uri(uri, ALLOWED)
    assert caught.value.field == "mlflow_tracking_uri" and ALLOWED_URIS_ENV in caught.value.message


@pytest.mark.parametrize(
    "uri", ["sqlite:////srv/opd-data/opd.db", "file:///srv/opd-data", "/srv/mlruns", "./mlruns"]
)
def test_a_server_never_opens_a_tenants_local_store_even_if_the_host_list_is_wide(uri: str) -> None:
    with pytest.raises(ConfigError) as caught:
        check_tracking_uri(uri, [*ALLOWED, "http://localhost"])
    assert caught.value.field == "mlflow_tracking_uri" and "local tracking stores" in caught.value.message


def test_no_uri_is_the_operators_default_and_passes() -> None:
    check_tracking_uri(None, [])


def test_the_operators_list_is_comma_separated_servers() -> None:
    assert parse_allowed_uris(" http://a:1, ,https://b ") == ["http://a:1", "https://b"]
    assert parse_allowed_uris("") == []
    for bad in ("sqlite:///x.db", "file:///tmp", "mlflow.internal:5000x", "/srv/mlruns"):
        with pytest.raises(ValueError, match="not a tracking server"):
            parse_allowed_uris(f"http://ok:1,{bad}")


def test_a_servers_driver_refuses_a_uri_its_environment_does_not_allow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the driver's start: a job stored before the operator narrowed the list fails naming the
    field; `opd train` (job `local`) opens whatever the user gives."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    store = tmp_path / "elsewhere.db"
    spec = _spec(tmp_path, report_to=["mlflow"], mlflow_tracking_uri=f"sqlite:///{store}")
    monkeypatch.setenv(ALLOWED_URIS_ENV, "http://mlflow.internal:5000")
    with pytest.raises(ConfigError) as caught:
        open_trackers(spec, run_dir, "opdjob-1")
    assert caught.value.field == "mlflow_tracking_uri" and not store.exists()
    monkeypatch.delenv(ALLOWED_URIS_ENV)
    other = _spec(tmp_path, report_to=["mlflow"], mlflow_tracking_uri="http://mlflow.internal:5000")
    with pytest.raises(ConfigError, match=ALLOWED_URIS_ENV):  # no list: no tenant URI at all
        open_trackers(other, run_dir, "opdjob-1")

    [local] = open_trackers(spec, run_dir, LOCAL_JOB_ID)
    local.close("succeeded")
    assert store.is_file()


# -- writes on a thread of their own ---------------------------------------------------------------


class _Stuck:
    """A tracker whose writes wait until `release` is set (a tracking server that stopped answering)."""

    name = "mlflow"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.records: list[int] = []
        self.closed = ""

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        self.entered.set()
        self.release.wait()
        self.records.append(step)

    def close(self, status: str) -> None:
        self.closed = status


def test_a_stuck_tracker_never_holds_up_logging_and_drops_what_does_not_fit() -> None:
    stuck = _Stuck()
    tracker = BackgroundTracker(stuck, queue_size=4)
    started = time.monotonic()
    tracker.log("train", 0, {"loss": 1.0})
    assert stuck.entered.wait(5)
    for step in range(1, 20):
        tracker.log("train", step, {"loss": 1.0})
    assert time.monotonic() - started < 1.0
    # One record is being written, four wait; the other fifteen are dropped and counted.
    assert tracker.dropped == 15
    [slow] = tracker.notices()  # reported once, however many are dropped
    assert slow.startswith("report_to mlflow is slow: 4 records are waiting for it")
    stuck.release.set()
    tracker.close("succeeded")
    assert stuck.records == [0, 1, 2, 3, 4] and stuck.closed == "succeeded"
    assert tracker.notices() == [
        "report_to mlflow: 15 records dropped (it was slower than training); metrics.jsonl has every record"
    ]


def test_a_slow_write_is_reported_once() -> None:
    stuck = _Stuck()
    tracker = BackgroundTracker(stuck, slow_write_s=0.05)
    for step in range(3):
        tracker.log("train", step, {"loss": 1.0})
    time.sleep(0.2)
    stuck.release.set()
    tracker.close("succeeded")
    [slow] = tracker.notices()
    assert slow.startswith("report_to mlflow is slow: one write took") and stuck.records == [0, 1, 2]


def test_closing_a_hung_tracker_gives_up_after_its_bound() -> None:
    stuck = _Stuck()
    tracker = BackgroundTracker(stuck)
    tracker.log("train", 1, {"loss": 1.0})
    started = time.monotonic()
    tracker.close("succeeded", timeout_s=0.3)
    assert 0.2 < time.monotonic() - started < 2.0 and stuck.closed == ""
    assert any("did not finish within" in n for n in tracker.notices())
    stuck.release.set()


def test_the_drivers_record_does_not_wait_for_a_stuck_tracker(tmp_path: Path) -> None:
    from opd_trainer.driver.job_driver import JobDriver

    driver = JobDriver(_spec(tmp_path), str(tmp_path / "run"))
    stuck = _Stuck()
    driver._trackers = [BackgroundTracker(stuck, queue_size=2)]
    started = time.monotonic()
    for step in range(1, 6):
        driver._record("train", step, {"loss": 1.0})
    assert time.monotonic() - started < 1.0
    [warning] = [e for e in driver.events() if e.type == "warning"]
    assert warning.message.startswith("report_to mlflow is slow")
    stuck.release.set()
    driver.status = "succeeded"
    asyncio.run(driver._close_trackers())
    assert stuck.closed == "succeeded" and driver._trackers == []
    assert [r["step"] for r in driver.log.records()] == [1, 2, 3, 4, 5]
