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

**Which tracking URIs a job may give.** On the job server `mlflow_tracking_uri` comes from a tenant,
and the driver opens it: a URI of the tenant's choosing would make the server send requests anywhere
(and reflect the answers into the job's error), and `sqlite:` / `file:` would write to the server's
own disk (its database). So a server accepts a tenant's URI only when its scheme, host and port are
those of an entry of the operator's `OPD_TRACKER_ALLOWED_URIS` (comma-separated, e.g.
`http://mlflow.internal:5000,https://mlflow.example.com`; matched by parsed parts, not as a string
prefix, so `http://mlflow.internal:5000@elsewhere` does not pass), and never a `sqlite:` or `file:`
one. `MLFLOW_TRACKING_URI` and the per-run SQLite store (no URI given) are the operator's and stay.
The check runs twice: when the API takes the job (`api.services.jobs.create`, a 400 naming
`mlflow_tracking_uri`) and when the driver opens its trackers (the job fails at its start naming the
field: a job stored before the operator narrowed the list). A driver tells the server's jobs from
`opd train`'s by its job id: `opd train` runs the one job `local` (`LOCAL_JOB_ID`) on the user's own
machine and may give any URI; every other driver reads the allowed list from its own environment
(the embedded Ray inherits the server's; a separate Ray cluster needs the variable on its pods), and
without it allows no tenant URI.

**Writes never hold up training.** Each tracker writes on a thread of its own (`BackgroundTracker`)
from a bounded queue: the driver's loop only enqueues. When the queue is full (the tracker is slower
than training) records are dropped and counted; a slow tracker is reported once, as a `warning`
event, and the count of dropped records when the job ends. A tracker whose write fails (an MLflow
server down) is reported and dropped; training goes on. Closing waits at most `CLOSE_TIMEOUT_S`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from opd_trainer.errors import ConfigError

if TYPE_CHECKING:
    from opd_trainer.jobspec.job_spec import JobSpec
    from opd_trainer.storage.run_dir import RunDir

# Job status -> MLflow's run status.
MLFLOW_STATUS = {"succeeded": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}

# The operator's list of tracking servers a tenant's job may name (see the module docstring).
ALLOWED_URIS_ENV = "OPD_TRACKER_ALLOWED_URIS"
# The job id of `opd train`'s driver (`JobDriver`'s default): the user's own machine, any URI.
LOCAL_JOB_ID = "local"
# Schemes that name a file on the machine that opens them: never a tenant's.
LOCAL_SCHEMES = ("sqlite", "file")
# Records waiting for one tracker; past it they are dropped (and counted).
QUEUE_SIZE = 1000
# One write slower than this is reported (once per tracker).
SLOW_WRITE_S = 10.0
# How long the job's end waits for a tracker to write what is queued and close.
CLOSE_TIMEOUT_S = 10.0


def _origin(uri: str) -> tuple[str, str, int | None] | None:
    """(scheme, host, port) of `uri`, the port made explicit for http/https; None without a host."""
    try:
        parts = urlsplit(uri.strip())
        port = parts.port
    except ValueError:  # a port that is not a number, a bad IPv6 literal
        return None
    if not parts.scheme or not parts.hostname:
        return None
    scheme = parts.scheme.lower()
    return scheme, parts.hostname.lower(), port or {"http": 80, "https": 443}.get(scheme)


def parse_allowed_uris(text: str | Iterable[str]) -> list[str]:
    """The operator's allowed tracking servers (comma-separated, or a list), each checked to have a
    scheme and a host and not to be a local file store; raises ValueError naming a bad entry."""
    entries = text.split(",") if isinstance(text, str) else list(text)
    allowed = []
    for entry in (e.strip() for e in entries):
        if not entry:
            continue
        origin = _origin(entry)
        if origin is None or origin[0] in LOCAL_SCHEMES:
            raise ValueError(
                f"{entry!r} is not a tracking server: give scheme://host[:port], e.g. http://mlflow:5000"
            )
        allowed.append(entry)
    return allowed


def check_tracking_uri(uri: str | None, allowed: Iterable[str]) -> None:
    """Refuses a tenant's `mlflow_tracking_uri` unless its scheme, host and port are those of one of
    `allowed`; `sqlite:` / `file:` always. None (the operator's default store) passes."""
    if uri is None:
        return
    origin = _origin(uri)
    scheme = (origin[0] if origin else urlsplit(uri.strip()).scheme).lower()
    if scheme in LOCAL_SCHEMES or not scheme:
        raise ConfigError(
            "the job server does not open local tracking stores (sqlite:, file:, a path): leave "
            "mlflow_tracking_uri unset for a store in the job's run folder, or name a tracking server",
            field="mlflow_tracking_uri",
        )
    if origin is None or origin not in {_origin(entry) for entry in allowed}:
        raise ConfigError(
            f"{uri!r} is not a tracking server this job server may report to: its operator lists those "
            f"({ALLOWED_URIS_ENV}); leave mlflow_tracking_uri unset for a store in the job's run folder",
            field="mlflow_tracking_uri",
        )


class Tracker(Protocol):
    name: str

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None: ...

    def close(self, status: str) -> None:
        """`status`: the job's (`succeeded`, `failed`, `stopped`)."""


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: RunDir) -> None:
        # Lazy: optional tracker (TensorBoard via torch, mlflow): loaded only when the job reports to it.
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
        # Lazy: optional tracker (TensorBoard via torch, mlflow): loaded only when the job reports to it.
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
        # One teacher: its model; several: `name=model` of each, the default first.
        teachers = spec.teachers
        teacher_models = (
            teachers[0].model if len(teachers) == 1 else ", ".join(f"{t.name}={t.model}" for t in teachers)
        )
        run = self._client.create_run(
            experiment_id,
            run_name=job_id,
            tags={"opd.job_id": job_id, "opd.model": spec.model, "opd.teacher_model": teacher_models},
        )
        self.run_id = run.info.run_id
        # Lazy: optional tracker (TensorBoard via torch, mlflow): loaded only when the job reports to it.
        from mlflow.entities import Param

        params = flat_params(spec.hyper_parameters.model_dump(mode="json"), "hyper_parameters.")
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])
        run_id_path.write_text(self.run_id)

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        # Lazy: optional tracker (TensorBoard via torch, mlflow): loaded only when the job reports to it.
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(f"{kind}/{name}", float(value), now, step) for name, value in metrics.items()]
        # MLflow takes at most 1000 metrics per batch call.
        for start in range(0, len(batch), 1000):
            self._client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self, status: str) -> None:
        self._client.set_terminated(self.run_id, MLFLOW_STATUS.get(status, "FAILED"))


def open_trackers(spec: JobSpec, run_dir: RunDir, job_id: str) -> list[BackgroundTracker]:
    """The trackers `spec.report_to` names, opened, each writing on its own thread (MLflow's first use
    of a SQLite store creates its tables: seconds; call it off the event loop). One that cannot open,
    or a tracking URI the server does not allow, fails the job at its start, naming the field to fix."""
    if "mlflow" in spec.report_to and job_id != LOCAL_JOB_ID:
        check_tracking_uri(spec.mlflow_tracking_uri, parse_allowed_uris(os.environ.get(ALLOWED_URIS_ENV, "")))
    trackers: list[BackgroundTracker] = []
    for name in spec.report_to:
        try:
            tracker: Tracker = (
                TensorBoardTracker(run_dir) if name == "tensorboard" else MLflowTracker(spec, run_dir, job_id)
            )
        except Exception as exc:
            for opened in trackers:
                opened.close("failed")
            field = "mlflow_tracking_uri" if name == "mlflow" else "report_to"
            raise ConfigError(
                f"report_to {name}: cannot open it: {type(exc).__name__}: {exc}", field=field
            ) from exc
        trackers.append(BackgroundTracker(tracker))
    return trackers


_CLOSE = object()  # the queue's last item: close the tracker


class BackgroundTracker:
    """A tracker whose writes run on a thread of its own, from a bounded queue: `log` never waits.

    What the driver should tell the job's events (a slow tracker, once; a failed one; records dropped)
    collects in `notices()`, which the driver drains on its own loop. A write that raises drops the
    tracker: `failed` is set, later records are ignored and it is not closed.
    """

    def __init__(
        self, tracker: Tracker, queue_size: int = QUEUE_SIZE, slow_write_s: float = SLOW_WRITE_S
    ) -> None:
        self.name = tracker.name
        self.tracker = tracker
        self.slow_write_s = slow_write_s
        self.dropped = 0
        self.failed = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self._notices: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._slow_reported = threading.Event()
        self._thread = threading.Thread(target=self._write_loop, name=f"tracker-{self.name}", daemon=True)
        self._thread.start()

    def log(self, kind: str, step: int, metrics: dict[str, float]) -> None:
        """Queues one record; drops it (and counts) when the queue is full."""
        if self.failed:
            return
        try:
            self._queue.put_nowait((kind, step, dict(metrics)))
        except queue.Full:
            self.dropped += 1
            self._report_slow(f"{self._queue.maxsize} records are waiting for it; dropping records")

    def close(self, status: str, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Writes what is queued, then closes the tracker with the job's `status`; waits at most
        `timeout_s` (a tracker that hangs is left to its daemon thread)."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(queue.Full):  # a hung tracker with a full queue: the join times out
            self._queue.put((_CLOSE, status), timeout=timeout_s)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._notices.put(
                f"report_to {self.name}: did not finish within {timeout_s:.0f}s at the job's end; "
                "what it had not written is lost"
            )
        if self.dropped:
            self._notices.put(
                f"report_to {self.name}: {self.dropped} records dropped (it was slower than training); "
                "metrics.jsonl has every record"
            )

    def notices(self) -> list[str]:
        """What happened since the last call, for the job's `warning` events."""
        found = []
        while True:
            try:
                found.append(self._notices.get_nowait())
            except queue.Empty:
                return found

    def _report_slow(self, why: str) -> None:
        if not self._slow_reported.is_set():
            self._slow_reported.set()
            self._notices.put(f"report_to {self.name} is slow: {why}; training goes on")

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item[0] is _CLOSE:
                if not self.failed:
                    try:
                        self.tracker.close(item[1])
                    except Exception as exc:
                        self._notices.put(
                            f"report_to {self.name}: closing failed: {type(exc).__name__}: {exc}"
                        )
                return
            if self.failed:
                continue
            started = time.monotonic()
            try:
                self.tracker.log(*item)
            except Exception as exc:  # an external service: it must not stop training
                self.failed = True
                self._notices.put(
                    f"report_to {self.name}: {type(exc).__name__}: {exc}; not reporting to it any more"
                )
                continue
            took = time.monotonic() - started
            if took > self.slow_write_s:
                self._report_slow(f"one write took {took:.0f}s")
