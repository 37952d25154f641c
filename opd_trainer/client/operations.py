"""The job server's operations, each defined once for both clients (`OPDClient`, `AsyncOPDClient`).

An operation is a `Call`: the request it sends and how its answer parses into the API's own model
(`wire/schemas.py`). Beside the calls: the error an error answer becomes (`api_error`), which failures
are sent again and after how long (`retry_policy`, tenacity's arguments), the paging cursor
(`next_page`), the event stream's items and reconnects (`EventFollower`), and what both clients hold
(`ClientBase`). Nothing here does I/O: a client builds `call.request(http)` with its own httpx
client, sends it under `retry_policy`, and hands the answer to `call.parse`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Generic, Literal, Protocol, TypeVar

import httpx
from pydantic import BaseModel, Field
from tenacity import (
    RetryCallState,
    retry_if_exception,
    retry_if_exception_type,
    retry_if_result,
    stop_after_attempt,
    wait_exponential,
)

from opd_trainer.errors import OPDError
from opd_trainer.jobspec.job_status import TERMINAL
from opd_trainer.wire.schemas import (
    CheckpointList,
    CheckpointPublic,
    Deleted,
    EventList,
    EventPublic,
    FileList,
    FilePublic,
    FilePurpose,
    JobList,
    JobPublic,
    KeyList,
    KeyPublic,
    MetricsPublic,
    TenantUsage,
    TrajectoryList,
    UsageList,
    ValidationTrajectoryList,
    WebhookDeliveryList,
    WebhookList,
    WebhookPublic,
)

logger = logging.getLogger(__name__)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "DELETE"})
# Statuses after which the server has done nothing: any request may be sent again.
RETRY_ALWAYS = frozenset({429, 503})
# A gateway error may come after the server acted: only idempotent requests are sent again.
RETRY_IDEMPOTENT = RETRY_ALWAYS | {502, 504}
MAX_BACKOFF_S = 8.0
MAX_RETRY_AFTER_S = 60.0
# Streams (events, checkpoint downloads) may be quiet for long stretches: no read timeout.
STREAM_TIMEOUT = httpx.Timeout(30.0, read=None)
DOWNLOAD_TIMEOUT = httpx.Timeout(60.0, read=None)

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
Http = TypeVar("Http", httpx.Client, httpx.AsyncClient)
Item = TypeVar("Item", bound="_HasId")
Item_co = TypeVar("Item_co", bound="_HasId", covariant=True)
JobAction = Literal["cancel", "pause", "resume"]


class OPDAPIError(OPDError):
    """The server answered with an error: `status`, `code`, and `field` (the server's `param`)."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 0, code: str = "") -> None:
        super().__init__(message, field=field)
        self.status = status
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            self.__class__,
            (self.message,),
            {"field": self.field, "status": self.status, "code": self.code},
        )


class StreamEnd(BaseModel):
    """The last item of `stream_events`: the job has finished and every event was sent.

    The server's `end` event carries the finished job, or only its id when the job was deleted while
    it was followed (then `job` is None).
    """

    type: Literal["end"] = Field(default="end", description="Always `end`, as the stream names it.")
    job_id: str = Field(description="The followed job's id.")
    job: JobPublic | None = Field(default=None, description="The finished job; None once deleted.")


# -- clients --------------------------------------------------------------------------------------


class ClientBase(Generic[Http]):
    """What both clients hold: one server, one tenant key, one httpx client (`_http_class`)."""

    _http_class: type[Http]

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
        retries: int = 3,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`base_url` / `api_key` default to `OPD_BASE_URL` / `OPD_API_KEY`. `retries`: how often a
        request is sent again (see `retry_policy`): after a 503, a 429 that says when to come back
        (`Retry-After`), a refused connection and, for reads and deletes only, after a 502, 504 or a
        dropped connection. `transport`: httpx's (e.g. `httpx.MockTransport` in tests)."""
        self.base_url = (base_url or os.environ.get("OPD_BASE_URL") or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get("OPD_API_KEY")
        self.retries = retries
        self._http: Http = self._http_class(
            base_url=self.base_url, headers=_bearer(self.api_key), timeout=timeout, transport=transport
        )


def _bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# -- calls ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request of the API and the parser of its (successful) answer."""

    method: str
    path: str
    parse: Callable[[httpx.Response], T]
    params: dict[str, Any] = field(default_factory=dict)
    json: Any = None
    data: dict[str, str] | None = None
    files: dict[str, tuple[str, Any]] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    timeout: httpx.Timeout | None = None

    def options(self) -> dict[str, Any]:
        """Keyword arguments of `build_request`, `stream` and httpx-sse's `connect_sse`."""
        options: dict[str, Any] = {"params": self.params, "headers": self.headers}
        if self.json is not None:
            options["json"] = self.json
        if self.files is not None:
            options.update(files=self.files, data=self.data)
        if self.timeout is not None:
            options["timeout"] = self.timeout
        return options

    def request(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        return http.build_request(self.method, self.path, **self.options())


def _model(model: type[M]) -> Callable[[httpx.Response], M]:
    def parse(response: httpx.Response) -> M:
        return model.model_validate(response.json())

    return parse


def _text(response: httpx.Response) -> str:
    return response.text


def _unread(response: httpx.Response) -> httpx.Response:
    return response


def create_key(tenant: str, admin_key: str) -> Call[KeyPublic]:
    return Call("POST", "/v1/keys", _model(KeyPublic), json={"tenant": tenant}, headers=_bearer(admin_key))


def list_keys(admin_key: str | None) -> Call[list[KeyPublic]]:
    return Call(
        "GET", "/v1/keys", lambda r: KeyList.model_validate(r.json()).data, headers=_bearer(admin_key)
    )


def usage(admin_key: str | None) -> Call[list[TenantUsage]]:
    return Call(
        "GET", "/v1/usage", lambda r: UsageList.model_validate(r.json()).data, headers=_bearer(admin_key)
    )


def revoke_key(key_id: str, admin_key: str) -> Call[Deleted]:
    return Call("DELETE", f"/v1/keys/{key_id}", _model(Deleted), headers=_bearer(admin_key))


def upload_file(filename: str, content: Any, purpose: FilePurpose) -> Call[FilePublic]:
    """`content`: bytes or a binary file object (httpx rewinds it when the request is sent again)."""
    files = {"file": (filename, content)}
    return Call("POST", "/v1/files", _model(FilePublic), files=files, data={"purpose": purpose})


def list_files(purpose: FilePurpose | None) -> Call[list[FilePublic]]:
    params = {"purpose": purpose} if purpose else {}
    return Call("GET", "/v1/files", lambda r: FileList.model_validate(r.json()).data, params=params)


def get_file(file_id: str) -> Call[FilePublic]:
    return Call("GET", f"/v1/files/{file_id}", _model(FilePublic))


def delete_file(file_id: str) -> Call[Deleted]:
    return Call("DELETE", f"/v1/files/{file_id}", _model(Deleted))


def create_job(spec: dict[str, Any], dry_run: bool = False) -> Call[JobPublic]:
    params = {"dry_run": "true"} if dry_run else {}
    return Call("POST", "/v1/opd/jobs", _model(JobPublic), params=params, json=spec)


def list_jobs(status: str | None, limit: int, after: str | None) -> Call[JobList]:
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    if after:
        params["after"] = after
    return Call("GET", "/v1/opd/jobs", _model(JobList), params=params)


def get_job(job_id: str) -> Call[JobPublic]:
    return Call("GET", f"/v1/opd/jobs/{job_id}", _model(JobPublic))


def job_action(job_id: str, action: JobAction) -> Call[JobPublic]:
    return Call("POST", f"/v1/opd/jobs/{job_id}/{action}", _model(JobPublic))


def delete_job(job_id: str) -> Call[Deleted]:
    return Call("DELETE", f"/v1/opd/jobs/{job_id}", _model(Deleted))


def events(job_id: str, after: int, limit: int) -> Call[EventList]:
    params = {"after": after, "limit": limit}
    return Call("GET", f"/v1/opd/jobs/{job_id}/events", _model(EventList), params=params)


def logs(job_id: str, after: int) -> Call[str]:
    return Call("GET", f"/v1/opd/jobs/{job_id}/logs", _text, params={"after": after})


def checkpoints(job_id: str) -> Call[list[CheckpointPublic]]:
    path = f"/v1/opd/jobs/{job_id}/checkpoints"
    return Call("GET", path, lambda r: CheckpointList.model_validate(r.json()).data)


def checkpoint_content(job_id: str, checkpoint_id: str, merged: bool = False) -> Call[httpx.Response]:
    """The checkpoint's student as a zip (`merged`: a LoRA checkpoint's adapter merged into its base);
    sent with `stream`, its answer is read in chunks."""
    path = f"/v1/opd/jobs/{job_id}/checkpoints/{checkpoint_id}/content"
    params = {"merged": "true"} if merged else {}
    return Call("GET", path, _unread, params=params, timeout=DOWNLOAD_TIMEOUT)


def metrics(job_id: str) -> Call[MetricsPublic]:
    return Call("GET", f"/v1/opd/jobs/{job_id}/metrics", _model(MetricsPublic))


def trajectories(job_id: str, limit: int) -> Call[list[dict[str, Any]]]:
    """The API types a trajectory as a free-form object (`TrajectoryList.data`): these stay dicts."""
    path = f"/v1/opd/jobs/{job_id}/trajectories"
    return Call("GET", path, lambda r: TrajectoryList.model_validate(r.json()).data, params={"limit": limit})


def validation_trajectories(
    job_id: str, query: dict[str, Any], limit: int, offset: int
) -> Call[ValidationTrajectoryList]:
    """A page of the recorded validation rollouts; `query` (the filters step, label, model, sample_id;
    sort, order) left out where None."""
    params = {k: v for k, v in query.items() if v is not None} | {"limit": limit, "offset": offset}
    path = f"/v1/opd/jobs/{job_id}/validation_trajectories"
    return Call("GET", path, _model(ValidationTrajectoryList), params=params)


def create_webhook(url: str, events: list[str] | None, description: str) -> Call[WebhookPublic]:
    body: dict[str, Any] = {"url": url, "description": description}
    if events:
        body["events"] = events
    return Call("POST", "/v1/opd/webhooks", _model(WebhookPublic), json=body)


def list_webhooks() -> Call[list[WebhookPublic]]:
    return Call("GET", "/v1/opd/webhooks", lambda r: WebhookList.model_validate(r.json()).data)


def get_webhook(webhook_id: str) -> Call[WebhookPublic]:
    return Call("GET", f"/v1/opd/webhooks/{webhook_id}", _model(WebhookPublic))


def delete_webhook(webhook_id: str) -> Call[Deleted]:
    return Call("DELETE", f"/v1/opd/webhooks/{webhook_id}", _model(Deleted))


def webhook_deliveries(
    webhook_id: str, limit: int, after: str | None, job_id: str | None
) -> Call[WebhookDeliveryList]:
    params: dict[str, Any] = {"limit": limit}
    if after:
        params["after"] = after
    if job_id:
        params["job_id"] = job_id
    path = f"/v1/opd/webhooks/{webhook_id}/deliveries"
    return Call("GET", path, _model(WebhookDeliveryList), params=params)


# -- errors and retries ---------------------------------------------------------------------------


def api_error(response: httpx.Response) -> OPDAPIError:
    """The server's error (`{"error": {code, message, param}}`), or the bare HTTP status when the
    answer is not one (a proxy's page, say). A streamed response must have been read."""
    try:
        error = response.json()["error"]
        return OPDAPIError(
            str(error.get("message")),
            field=error.get("param"),
            status=response.status_code,
            code=error["code"],
        )
    except (ValueError, KeyError, TypeError):
        text = response.text[:500] or response.reason_phrase
        return OPDAPIError(
            f"HTTP {response.status_code}: {text}", status=response.status_code, code="http_error"
        )


def checked(response: httpx.Response) -> httpx.Response:
    """`response` when it is a success, else its `OPDAPIError` raised."""
    if response.status_code >= 400:
        raise api_error(response)
    return response


def retry_policy(method: str, retries: int) -> dict[str, Any]:
    """tenacity's arguments (`Retrying(**policy)`, `AsyncRetrying(**policy)`) for sending one request.

    It is sent again, up to `retries` times, where the server cannot have acted on it (a refused
    connection, 503, or a 429 with `Retry-After`: a 429 without one is a limit, not a request to slow
    down) and, for reads and deletes only, after a 502, 504 or a connection lost once sent. It waits
    the server's `Retry-After`, else 0.5, 1, 2, 4, then 8 s. When it gives up the last answer is
    returned (the caller maps an error status to `OPDAPIError`) or the last exception raised.
    """
    idempotent = method in IDEMPOTENT_METHODS
    return {
        "stop": stop_after_attempt(retries + 1),
        "retry": retry_if_exception(partial(_retry_exception, idempotent))
        | retry_if_result(partial(_retry_response, idempotent)),
        "wait": _wait,
        "retry_error_callback": _last_outcome,
        "before_sleep": _log_retry,
    }


def _retry_exception(idempotent: bool, exc: BaseException) -> bool:
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
        return True  # never reached the server
    return idempotent and isinstance(exc, httpx.TransportError)  # sent, then lost


def _retry_response(idempotent: bool, response: httpx.Response) -> bool:
    if response.status_code == 429 and retry_after(response) is None:
        return False  # a limit (e.g. the tenant's active jobs)
    return response.status_code in (RETRY_IDEMPOTENT if idempotent else RETRY_ALWAYS)


def _wait(state: RetryCallState) -> float:
    outcome = state.outcome
    if outcome is not None and not outcome.failed:
        after = retry_after(outcome.result())
        if after is not None:
            return after
    return backoff(state.attempt_number - 1)


def _last_outcome(state: RetryCallState) -> Any:
    assert state.outcome is not None  # tenacity gives up only after an attempt
    return state.outcome.result()


def _log_retry(state: RetryCallState) -> None:
    outcome = state.outcome
    if outcome is None:
        return
    what = repr(outcome.exception()) if outcome.failed else f"HTTP {outcome.result().status_code}"
    wait = state.next_action.sleep if state.next_action else 0.0
    logger.info("request failed (%s), attempt %d; retrying in %.1fs", what, state.attempt_number, wait)


def backoff(attempt: int) -> float:
    """Seconds before sending again after `attempt` failures (0-based): 0.5, 1, 2, 4, 8, 8, ..."""
    return float(min(MAX_BACKOFF_S, 0.5 * 2**attempt))


def retry_after(response: httpx.Response) -> float | None:
    """The answer's `Retry-After` in seconds (at most a minute), None without one."""
    value = response.headers.get("Retry-After", "")
    return min(float(value), MAX_RETRY_AFTER_S) if value.replace(".", "", 1).isdigit() else None


# -- paging ---------------------------------------------------------------------------------------


class _HasId(Protocol):
    @property
    def id(self) -> str | int: ...


class Page(Protocol[Item_co]):
    """A page of a list endpoint (`JobList`, `EventList`)."""

    @property
    def data(self) -> Sequence[Item_co]: ...

    @property
    def has_more(self) -> bool: ...


def next_page(call: Call[Page[Item]], page: Page[Item]) -> Call[Page[Item]] | None:
    """The call of the page after `page` (the same, `after` its last item's id); None after the last."""
    if not page.has_more or not page.data:
        return None
    return dataclasses.replace(call, params={**call.params, "after": page.data[-1].id})


# -- waiting --------------------------------------------------------------------------------------


def finished(job: JobPublic, waited_s: float, timeout_s: float | None) -> bool:
    """Whether `wait` stops polling: the job has finished. Past `timeout_s`, `TimeoutError`."""
    if job.status in TERMINAL:
        return True
    if timeout_s is not None and waited_s > timeout_s:
        raise TimeoutError(f"job {job.id} still {job.status} after {timeout_s}s")
    return False


# -- the event stream -----------------------------------------------------------------------------


class EventFollower:
    """One followed event stream: its cursor (the last event id received) and its reconnects.

    A dropped connection, the server's `shutdown` event (it is restarting) or its `reconnect` event
    (the stream reached the server's longest, `OPD_EVENT_STREAM_MAX_S`) is reconnected after 2, 4, 8,
    then 10 s from the cursor; more than `retries` failures in a row without an event in
    between give up (the last error is raised).
    """

    def __init__(self, job_id: str, after: int, retries: int) -> None:
        self.job_id = job_id
        self.after = after
        self.retries = retries
        self.failures = 0
        self.ended = False

    def call(self) -> Call[httpx.Response]:
        """The stream request from the cursor (`Last-Event-ID` and `after` both say where)."""
        return Call(
            "GET",
            f"/v1/opd/jobs/{self.job_id}/events",
            _unread,
            params={"after": self.after},
            headers={"Accept": "text/event-stream", "Last-Event-ID": str(self.after)},
            timeout=STREAM_TIMEOUT,
        )

    def retrying(self) -> dict[str, Any]:
        """tenacity's arguments for the reconnect loop."""
        return {
            "retry": retry_if_exception_type(httpx.TransportError),
            "stop": self._give_up,
            "wait": wait_exponential(multiplier=2, max=10),
            "reraise": True,
        }

    def _give_up(self, _: RetryCallState) -> bool:
        self.failures += 1
        return self.failures > self.retries

    def items(self, kind: str, data: str) -> list[EventPublic | StreamEnd]:
        """The stream's items in one server-sent event: none (a ping, no data) or one. After the
        `end` event, `ended` is set; after `shutdown` or `reconnect`, the connection is to be made
        again."""
        if not data:
            return []
        self.failures = 0
        payload = json.loads(data)
        if kind == "end":
            self.ended = True
            job = None if payload.get("deleted") else JobPublic.model_validate(payload)
            return [StreamEnd(job_id=str(payload["id"]), job=job)]
        if kind in ("shutdown", "reconnect"):  # the server restarts, or ends long streams: reconnect
            raise httpx.RemoteProtocolError(f"the server ended the event stream ({kind})")
        event = EventPublic.model_validate(payload)
        self.after = max(self.after, event.id)
        return [event]
